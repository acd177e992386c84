"""What runs at which priority on a busy host (services/ethercat_loop/README.md, "Priorities on a busy host"):
with `ethercat_mqtt_rt_priority`, every thread of the MQTT process (those running before the backend starts,
as paho's does, and those started after) runs SCHED_FIFO at that priority, below the cycle's; the cycle keeps its
own; a cycle asked to run at normal priority does not inherit the MQTT process's realtime policy. Root only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from services.ethercat_loop.transport.process_backend import REPO
from tests.ethercat_loop.wire_fixtures import hand

pytestmark = pytest.mark.root

FIFO, OTHER = os.SCHED_FIFO, os.SCHED_OTHER

PRIORITIES = """
import json, os, sys, threading, time
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.transport.process_backend import ProcessBackend
hold = threading.Event()
threading.Thread(target=hold.wait, name="before", daemon=True).start()  # running before start(), as paho's thread
b = ProcessBackend(EthercatSettings(backend="virtual", ethercat_ifname=sys.argv[1], ethercat_netns=sys.argv[2],
                                    ethercat_mqtt_rt_priority=int(sys.argv[3]), ethercat_rt_priority=int(sys.argv[4]),
                                    ethercat_push_config_on_start=False))
b.start()
threading.Thread(target=hold.wait, name="after", daemon=True).start()  # started later: inherits the policy
def pol(tid):
    return [os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority]
threads = {t: pol(int(t)) for t in os.listdir("/proc/self/task")}
print(json.dumps({"threads": threads, "cycle": pol(b._proc.pid), "realtime": b.stats().realtime,
                  "warnings": b.info()["warnings"]}), flush=True)
hold.set()
b.stop()
"""


def run_backend(master_if: str, netns: str, mqtt_priority: int, cycle_priority: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", PRIORITIES, master_if, netns, str(mqtt_priority), str(cycle_priority)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_the_mqtt_process_runs_fifo_below_the_cycle_and_the_cycle_keeps_its_own() -> None:
    with hand("0220") as (ns, _ctl):
        out = run_backend(ns.master_if, ns.name, 10, 80)
        assert len(out["threads"]) >= 3, out["threads"]  # main, "before", "after" at least (and the monitor)
        assert all(p == [FIFO, 10] for p in out["threads"].values()), out["threads"]
        assert out["cycle"] == [FIFO, 80]
        assert out["realtime"]["mqtt_policy"] == "SCHED_FIFO/10" and out["realtime"]["policy"] == "SCHED_FIFO/80"
        assert not out["warnings"], out["warnings"]
        # never at or above the cycle: a priority that high is held just under it
        high = run_backend(ns.master_if, ns.name, 95, 80)
        assert all(p == [FIFO, 79] for p in high["threads"].values()), high["threads"]
        # a cycle asked to run at normal priority does not keep the policy it inherits from its starter
        normal = run_backend(ns.master_if, ns.name, 10, 0)
        assert normal["cycle"] == [OTHER, 0] and normal["realtime"]["policy"] == "SCHED_OTHER/0"


def test_by_default_the_mqtt_process_is_left_as_it_is() -> None:
    with hand("0220") as (ns, _ctl):
        out = run_backend(ns.master_if, ns.name, 0, 80)
    assert all(p == [OTHER, 0] for p in out["threads"].values()), out["threads"]
    assert out["realtime"]["mqtt_policy"] == "SCHED_OTHER/0" and out["cycle"] == [FIFO, 80]
