"""Idle cost of ethercat-loop on the in-process palm model (what `make run` starts): the service process's
CPU (utime + stime of every thread, /proc/<pid>/stat) over a window with nothing happening: no client, no
demand; the palm model cycling, joints state published at its default rate, health, the kit's heartbeat.

    python bench/ethercat_model_idle.py [--seconds 60] [--quick] [--settle 5] [--repo PATH]

`--repo PATH` runs the node from another checkout with its own .venv (e.g. the "before" tree), so before and
after are measured by the same script. Target: <= 10 % of one core. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from results import Figure, report, variant_name  # noqa: E402

from shared.rpc import RpcClient  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

TARGET_CORE_FRACTION = 0.10
NODE = "ethercat-loop"


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process (all threads), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after "(comm)"


def wait_online(broker: Broker, timeout: float) -> None:
    online: list[bool] = []
    with RpcClient(broker.settings(), name="bench-idle-watch") as c:
        def until(topic: str, payload: bytes) -> bool:
            if topic.split("/")[-2] == NODE and json.loads(payload).get("online"):
                online.append(True)
            return bool(online)
        c.collect(f"{broker.settings().topic_root}/+/status", timeout, until=until)
    if not online:
        raise RuntimeError(f"{NODE} not online within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="a 30 s window")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after online before measuring")
    ap.add_argument("--repo", default=str(REPO), help="checkout to run the node from (its .venv/bin/python)")
    a = ap.parse_args()
    seconds = 30.0 if a.quick else a.seconds
    repo = Path(a.repo).resolve()
    python = repo / ".venv" / "bin" / "python"
    hz = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory() as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_ETHERCAT_BACKEND": "model",
               "PYTHONUNBUFFERED": "1"}
        node = subprocess.Popen([str(python), "-m", "services.ethercat_loop"], cwd=repo, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_online(broker, 60)
            time.sleep(a.settle)
            t0, c0 = time.monotonic(), cpu_ticks(node.pid)
            time.sleep(seconds)
            t1, c1 = time.monotonic(), cpu_ticks(node.pid)
            if node.poll() is not None:
                raise RuntimeError(f"the node exited ({node.returncode}) during the window")
        finally:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
                try:
                    node.wait(10)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait(5)
            broker.kill()
    frac = (c1 - c0) / hz / (t1 - t0)
    out = {"bench": "ethercat_model_idle", "repo": str(repo), "seconds": round(t1 - t0, 1),
           "cpu_core_fraction": round(frac, 4), "target": TARGET_CORE_FRACTION,
           "ratio_to_target": round(frac / TARGET_CORE_FRACTION, 2), "target_met": frac <= TARGET_CORE_FRACTION,
           "loadavg": os.getloadavg()}
    print(f"ethercat-loop on the palm model, idle {t1 - t0:.0f} s: {100 * frac:.1f} % of a core "
          f"(target <= {100 * TARGET_CORE_FRACTION:.0f} %, ratio {frac / TARGET_CORE_FRACTION:.2f})")
    report("ethercat_model_idle", out, [
        Figure("`make run`'s ethercat-loop on the palm model, idle", round(100 * frac, 1), "% of a core", "<=",
               100 * TARGET_CORE_FRACTION),
    ], variant=variant_name("quick" if a.quick else "", "other-repo" if Path(a.repo).resolve() != REPO else ""))


if __name__ == "__main__":
    main()
