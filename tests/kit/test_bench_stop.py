"""bench/stop.py end to end, shortened: every service on its simulators, the watches proved, each stop stamped on
every device's wire (or answered, for Dexters and a hand without a wire), every motion command during the stop
refused `stopped` with nothing on a wire. No speed figure is asserted here: that is the bench's own verdict."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    """bench/stop.py in a session of its own, every process of it (its simulators and services) killed at the end
    whatever ends the test: a timeout must not leave a whole simulated system running beside the suite."""
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "stop.py"), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=540)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)  # a whole system of simulators: minutes on a loaded host
def test_the_stop_bench_measures_every_service_and_finds_no_motion_while_stopped() -> None:
    out = _bench("--quick", "--robots", "3", "--arms", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "stop" and result["rounds"] == 5
    # the watches see the probes when no stop is active: a probe that got through while stopped would be seen
    assert result["watch_check_ok"], result["watch_check"]
    assert set(result["services"]) == {"epuck-gateway", "roi-modules", "dexter-gateway", "ethercat-loop"}
    for name, svc in result["services"].items():
        assert svc["rounds"] == 5, (name, svc)  # a time for every stop: every device stamped or answered
        assert svc["missing"] == 0 and svc["early"] == 0, (name, svc)
        assert svc["motion_probes"] > 0 and svc["refused_stopped"] == svc["motion_probes"], (name, svc)
        assert svc["reached_wire"] == 0, (name, svc)
        assert svc["p50_ms"] > 0 and svc["max_ms"] >= svc["p99_ms"] >= svc["p50_ms"], (name, svc)
    assert result["motion_executed_while_stopped"] == 0
    assert result["move_failures"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_sent_during_a_stall_reaches_every_wire_when_the_stall_ends() -> None:
    """Each service's node in turn stopped with SIGSTOP for 3 s while a client streams setpoints, the stop published
    during the stall: after the SIGCONT the stop is on every device's wire (or answered, where the wire has no stop
    bytes), no Dexter gets a motion request after it, and none of it waits behind the backlog (the old path took
    seconds: one inbound queue, demands without an age). The 50 ms target is the bench's verdict; a stalled broker is
    tests/kit/test_stop_stall.py's (and `bench/stop.py --stall broker`)."""
    stalled = "node"
    out = _bench("--stall", stalled, "--rounds", "1", "--robots", "2", "--arms", "1", "--roi-modules", "6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["stall"] == stalled and result["rounds"] == 1
    assert set(result["services"]) == {"epuck-gateway", "roi-modules", "dexter-gateway", "ethercat-loop"}
    for name, svc in result["services"].items():
        assert svc["rounds"] == 1 and svc["missing"] == 0, (name, svc)  # every device, its node's stall
        assert svc["reached_wire"] == 0, (name, svc)
        assert svc["max_ms"] < 1000, (name, svc)  # not behind the stall's backlog (functional bound, not a target)
    assert result["move_failures"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_restarted_under_the_stop_stops_every_device_it_serves() -> None:
    """Every service's node killed -9 while its devices move, the stop set while none runs, the nodes started again:
    each holds every device it serves (the stop on every wire after the restart, each node's answer without an
    error), and no Dexter gets a motion request."""
    out = _bench("--restart", "--rounds", "1", "--robots", "2", "--arms", "1", "--roi-modules", "6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name, svc in result["services"].items():
        assert svc["rounds"] == 1 and svc["missing"] == 0, (name, svc, out.stdout[-2000:])
        assert svc["stop_errors"] == 0 and svc["reached_wire"] == 0, (name, svc)


def unexcused_motion_services() -> list[str]:
    """What each registered service with a motion command must declare when bench/stop.py does not measure it (its
    SERVICES): why not, in its rig (SimRig.stop_unmeasured); and each measured service that also excuses itself."""
    from shared.registry import service_apis, service_packages

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import stop as bench_stop  # type: ignore[import-not-found]  # bench/stop.py
    finally:
        sys.path.remove(str(REPO / "bench"))
    packages = service_packages()
    problems = []
    for api in service_apis():
        if not (any(c.motion for c in api.commands.values()) or any(j.motion for j in api.jobs.values())):
            continue
        package = packages[api.service]
        try:
            why = importlib.import_module(f"{package}.rig").RIG.stop_unmeasured
        except (ImportError, AttributeError):
            why = None
        if api.service in bench_stop.SERVICES and why:
            problems.append(f"{api.service}: measured by bench/stop.py, yet {package}.rig says it is not ({why!r})")
        elif api.service not in bench_stop.SERVICES and not why:
            problems.append(f"{api.service}: a motion service bench/stop.py does not measure: say why in "
                            f"{package}.rig (SimRig(..., stop_unmeasured=\"<why>\")), or measure it in bench/stop.py")
    return problems


def test_every_registered_motion_service_is_measured_or_says_why() -> None:
    """A service with a motion command is measured by bench/stop.py, or its own rig says why not: a sixth motion
    service is never silently left out of the stop's bench, and never needs an edit outside its folder."""
    problems = unexcused_motion_services()
    assert not problems, "\n".join(problems)
