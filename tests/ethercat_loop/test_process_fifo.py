"""services/ethercat_loop/transport/realtime.py `process_fifo`: every thread of the MQTT process at the priority
asked, except a thread already above it (the kit's stop thread, one above its node: shared/stop.py), which keeps
its place. Run in a child process: the test's own threads stay as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import json, os, threading
from services.ethercat_loop.transport.realtime import process_fifo
ready, done = threading.Event(), threading.Event()
tids = {}
def above():
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(12))
    tids["above"] = threading.get_native_id(); ready.set(); done.wait()
def plain():
    tids["plain"] = threading.get_native_id(); done.wait()
threading.Thread(target=above).start(); ready.wait()
threading.Thread(target=plain).start()
while "plain" not in tids: pass
warnings = process_fifo(10)
prio = {k: os.sched_getparam(t).sched_priority for k, t in tids.items()}
prio["main"] = os.sched_getparam(0).sched_priority
done.set()
print(json.dumps({"warnings": warnings, "priority": prio}))
"""


def test_every_thread_at_the_priority_but_one_already_above_it() -> None:
    if subprocess.run(["chrt", "-f", "10", "true"], capture_output=True).returncode != 0:
        pytest.skip("this host refuses SCHED_FIFO to the tests (no CAP_SYS_NICE)")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"warnings": [], "priority": {"above": 12, "plain": 10, "main": 10}}, got
