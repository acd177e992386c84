"""The e-puck simulator's command with serial robots beside the WiFi ones (`--serial-count`, what `make run`
starts: one process for the gateway's three demo robots): both kinds serve their wire, the serial robot answers
the gateway's serial link, and SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from services.epuck_gateway.protocol.wifi import EpuckController, Packet
from services.epuck_gateway.transport.serial import EpuckSerialConfig, EpuckSerialLink
from shared.tools.localbroker import REPO
from tests.chaos.stack import consecutive_free_ports

DEADLINE_S = 60.0  # generous: a busy machine starts an interpreter and numpy slowly


def test_wifi_and_serial_robots_in_one_process(tmp_path: Path) -> None:
    base = consecutive_free_ports(2)[0]
    link = tmp_path / "tty-epuck"
    proc = subprocess.Popen([sys.executable, "-m", "services.epuck_gateway.sim", "--count", "2", "--base-port",
                             str(base), "--serial-count", "1", "--serial-link", str(link)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        ready = _wait(lambda: next((json.loads(ln) for ln in list(lines) if ln.startswith('{"ready"')), None),
                      lines, "the ready line")
        assert ready["robots"] == {"epuck1": base, "epuck2": base + 1}, ready
        assert ready["ports"] == {"epuck-serial1": f"{link}1"}, ready
        for port in (base, base + 1):  # the WiFi robots accept the gateway's connection
            with socket.create_connection(("127.0.0.1", port), timeout=10):
                pass
        assert asyncio.run(_serial_sensors(f"{link}1")) >= 5
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        reader.join(10)
    assert code == 0, "".join(lines)[-3000:]
    assert any('"stats"' in ln for ln in lines), "".join(lines)[-3000:]


async def _serial_sensors(port: str) -> int:
    """Sensor packets the serial robot gave a gateway's serial link within the deadline (at least 5 wanted)."""
    packets: list[Packet] = []
    ctl = EpuckController()
    ctl.set_stream(image=False, sensors=True)
    cfg = EpuckSerialConfig(port, poll_hz=50.0, reopen_min_s=0.05, reopen_max_s=0.3)
    link = EpuckSerialLink("s1", cfg, ctl, lambda p, t: packets.extend(p), lambda c, s, m: None, lambda e: None)
    link.start()
    end = time.monotonic() + DEADLINE_S
    while len(packets) < 5 and time.monotonic() < end:
        await asyncio.sleep(0.02)
    await link.close()
    return len(packets)


def _wait(get: Any, lines: list[str], what: str) -> Any:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        found = get()
        if found is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {DEADLINE_S} s: {what}\n{''.join(lines)[-3000:]}")
