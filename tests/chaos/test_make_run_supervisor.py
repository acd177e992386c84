"""`make run`'s process supervisor (deploy/dev/supervise.py over deploy/Procfile.sim), run as
`make run` runs it, on a private broker port: the broker killed -9 comes back and the nodes reconnect; a node
killed -9 comes back; one process dying stops nothing else; SIGINT stops the nodes (each says
`reason: shutdown` on a broker still up), then the broker, and leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared.tools.localbroker import REPO, free_port
from tests.fixtures import mosquitto_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NODES = ("can-bootloader", "ethercat-loop")  # two nodes that need no fixed port and no simulator process
# generous for a busy machine: by hand on a quiet one the broker and both nodes are back in ~1-2 s
DEADLINE_S = 30.0


class Statuses:
    """The latest status of every node, as a client that reconnects by itself sees it."""

    def __init__(self, port: int) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, *_: c.subscribe("robobus/+/status", qos=1)
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.1, 0.5)  # type: ignore[arg-type]  # paho's hint says int; floats work
        self.client.connect_async("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        node = msg.topic.split("/")[1]
        with contextlib.suppress(ValueError):
            body = json.loads(msg.payload) if msg.payload else {}
            with self.lock:
                self.latest[node] = body
                self.history.append((node, body))

    def online(self) -> set[str]:
        with self.lock:
            return {n for n, s in self.latest.items() if s.get("online")}

    def close(self) -> None:
        self.client.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        self.client.loop_stop()


def _wait(cond: Any, what: str, deadline_s: float = DEADLINE_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"not within {deadline_s} s: {what}")


def _children(pid: int) -> dict[str, int]:
    """command line -> pid of the supervisor's children."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {args: int(p) for p, args in (line.strip().split(None, 1) for line in out.splitlines() if line.strip())}


def _child(pid: int, needle: str) -> int:
    matches = [p for args, p in _children(pid).items() if needle in args]
    assert len(matches) == 1, f"{needle!r} among {_children(pid)}"
    return matches[0]


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Statuses, Path]]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"allow_anonymous true\npersistence false\nset_tcp_nodelay true\nlistener {port} 127.0.0.1\n")
    env = dict(os.environ, ROBOBUS_MOSQUITTO_CONF=str(conf), ROBOBUS_MQTT_URL=f"mqtt://127.0.0.1:{port}",
               PATH=f"{Path(sys.executable).parent}:/usr/sbin:{os.environ.get('PATH', '')}",
               ROBOBUS_TOPIC_ROOT="robobus")
    log = tmp_path / "supervisor.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-S", str(REPO / "deploy/dev/supervise.py"), "--rundir",
                                 str(tmp_path / "run"), "broker", *NODES], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    statuses = Statuses(port)
    try:
        _wait(lambda: statuses.online() >= set(NODES), "both nodes online at start")
        yield proc, port, statuses, log
    finally:
        statuses.close()
        # stop it as Ctrl-C does (its children die with it even on a SIGKILL, tests/deploy/test_supervise_lifecycle.py;
        # this is the orderly path), and kill whatever of its children is left after
        children = list(_children(proc.pid).values()) if proc.poll() is None else []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_broker_killed_comes_back_and_the_nodes_reconnect(supervised: Any) -> None:
    proc, port, statuses, log = supervised
    broker = _child(proc.pid, "mosquitto")
    node_pids = {n: _child(proc.pid, n.replace("-", "_")) for n in NODES}
    with statuses.lock:
        statuses.latest.clear()
    os.kill(broker, signal.SIGKILL)
    took = _wait(lambda: statuses.online() >= set(NODES), "both nodes online again after the broker's kill -9")
    print(f"broker killed -9: both nodes online again after {took:.2f} s")
    assert _accepts(port)
    assert _child(proc.pid, "mosquitto") != broker, "the broker was started again"
    # nothing else was restarted: the nodes reconnected, they did not die
    assert {n: _child(proc.pid, n.replace("-", "_")) for n in NODES} == node_pids
    assert proc.poll() is None, log.read_text()


def test_a_node_killed_comes_back_and_nothing_else_stops(supervised: Any) -> None:
    proc, _port, statuses, log = supervised
    victim = _child(proc.pid, "ethercat_loop")
    broker = _child(proc.pid, "mosquitto")
    other = _child(proc.pid, "can_bootloader")
    os.kill(victim, signal.SIGKILL)
    _wait(lambda: not statuses.latest.get("ethercat-loop", {}).get("online", True), "the Last Will")
    took = _wait(lambda: "ethercat-loop" in statuses.online(), "ethercat-loop online again")
    print(f"node killed -9: online again after {took:.2f} s")
    assert _child(proc.pid, "ethercat_loop") != victim
    assert _child(proc.pid, "mosquitto") == broker and _child(proc.pid, "can_bootloader") == other
    assert proc.poll() is None, log.read_text()


def test_sigint_stops_the_nodes_then_the_broker(supervised: Any) -> None:
    proc, port, statuses, log = supervised
    pids = list(_children(proc.pid).values())
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    assert proc.wait(60) == 0, log.read_text()
    with statuses.lock:
        said = {n: s for n, s in statuses.history if not s.get("online")}
    # each node said goodbye itself on a broker that was still up (not its Last Will)
    for node in NODES:
        assert said.get(node, {}).get("reason") == "shutdown", (node, said, log.read_text()[-3000:])
    assert not _accepts(port)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not alive, f"left running: {alive}"
