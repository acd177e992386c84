"""What `robobus foxglove` costs: its CPU and memory while `make run`'s whole demo streams (every service on its
simulator: the hand's joints at 100 Hz, three e-pucks with their cameras, the ROI modules, Dexter) and a Foxglove
client (the protocol's own, tests/foxglove/wsclient/client.js) is subscribed to every channel, validating each
message against its schema.

    python bench/foxglove_bridge.py [--seconds 30] [--quick]

Figures: the bridge's CPU in % of one core over the window (from /proc: user + system), its resident memory (mean
over the window), the messages per second it forwarded to the client, and the client's count of invalid messages.
Targets: <= 15 % of one core, <= 150 MB resident, no invalid message."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from results import Figure, report, variant_name  # noqa: E402

from shared.rpc import RpcClient  # noqa: E402
from shared.settings import KitSettings  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

CPU_TARGET = 15.0  # % of one core
RSS_TARGET_MB = 150.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    ap.add_argument("--quick", action="store_true", help="a 10 s window")
    a = ap.parse_args()
    window = 10.0 if a.quick else a.seconds
    from tests.dashboard.stack import NODES, SimStack
    from tests.foxglove.stack import WsClient, client_missing, start_bridge

    why = client_missing()
    if why:
        print(f"bench/foxglove_bridge.py: {why}", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="robobus-bench-foxglove-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        stack = SimStack(None, Path(d), broker.url)  # type: ignore[arg-type]
        client = RpcClient(KitSettings(mqtt_url=broker.url), name="bench-foxglove")
        ws: WsClient | None = None
        try:
            client.connect()
            stack.start_services(NODES)
            port = start_bridge(stack)
            stack.wait_online(client, NODES)
            ws = WsClient(port)
            time.sleep(5)  # every channel advertised and subscribed, the startup burst over
            pid = stack.procs["foxglove"].popen.pid
            r0, c0, t0 = ws.report(), cpu_seconds(pid), time.monotonic()
            samples = []
            while time.monotonic() - t0 < window:
                samples.append(rss_mb(pid))
                time.sleep(1.0)
            r1, c1, t1 = ws.report(), cpu_seconds(pid), time.monotonic()
        finally:
            if ws is not None:
                ws.close()
            client.close()
            stack.stop()
            broker.kill()
    span = t1 - t0
    msgs = sum(v["messages"] for v in r1["topics"].values()) - sum(v["messages"] for v in r0["topics"].values())
    invalid = sum(v["invalid"] for v in r1["topics"].values())
    cpu = 100 * (c1 - c0) / span
    rss = sum(samples) / len(samples)
    result: dict[str, Any] = {"bench": "foxglove_bridge", "window_s": round(span, 1), "cpu_pct_core": round(cpu, 2),
                              "rss_mb": round(rss, 1), "rss_max_mb": round(max(samples), 1),
                              "messages_per_s": round(msgs / span, 1), "channels": len(r1["topics"]),
                              "services": len(r1["services"]), "invalid": invalid,
                              "load": round(os.getloadavg()[0], 2)}
    figures = [Figure("bridge CPU, whole demo streaming, one client on every channel", round(cpu, 2), "% core", "<=",
                      CPU_TARGET),
               Figure("bridge resident memory", round(rss, 1), "MB", "<=", RSS_TARGET_MB),
               Figure("messages forwarded to the client", round(msgs / span, 1), "msg/s"),
               Figure("invalid messages seen by the client", invalid, "", "<=", 0)]
    report("foxglove_bridge", result, figures, variant=variant_name("quick" if a.quick else ""))


if __name__ == "__main__":
    main()
