"""A cycle process that dies (kill -9 here) is started again by the backend on the real path (ProcessBackend ->
pysoem -> veth -> the virtual hand): `recovering` and not connected meanwhile, counted, back to valid process
data, the backoff doubling while restarts do not lead to a good run, and the motors' demands at zero from
the restart on. Root only."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from services.ethercat_loop.control import SetDemands
from services.ethercat_loop.protocol import PalmCommand, unpack_command
from services.ethercat_loop.settings import EthercatSettings, link_policy
from services.ethercat_loop.sim.virtual_hand import HandControl
from services.ethercat_loop.transport.process_backend import ProcessBackend
from shared.link import SupervisedLink
from tests.ethercat_loop.wire_fixtures import hand, wait_for

pytestmark = pytest.mark.root


@contextmanager
def backend(**kw: Any) -> Iterator[tuple[ProcessBackend, HandControl]]:
    with hand("0220") as (ns, ctl):
        b = ProcessBackend(EthercatSettings(backend="virtual", ethercat_ifname=ns.master_if, ethercat_netns=ns.name,
                                            ethercat_push_config_on_start=False, **kw))
        b.start()
        try:
            yield b, ctl
        finally:
            b.stop()


def _pid(b: ProcessBackend) -> int:
    assert b._proc is not None
    return b._proc.pid


def _kill_and_watch(b: ProcessBackend) -> tuple[int, list[dict[str, Any]]]:
    """kill -9 the cycle process; every distinct (state, connected, issue) until it is connected again."""
    pid = _pid(b)
    os.kill(pid, signal.SIGKILL)
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        info = b.info()
        view = {"state": info["state"], "connected": info["connected"], "issue": info["issue"]}
        if not seen or {k: seen[-1][k] for k in view} != view:
            seen.append({**view, "ns": time.monotonic_ns()})
        if len(seen) > 1 and b.connected() and _pid(b) != pid:
            return pid, seen
        time.sleep(0.005)
    raise AssertionError(f"not back within 60 s: {seen}")


def _demand0(hexcmd: str) -> int | None:
    cmd = unpack_command(bytes.fromhex(hexcmd), "0220")
    return cmd.motor_data[0] if isinstance(cmd, PalmCommand) else None


def test_a_killed_cycle_process_is_restarted_with_zero_demands() -> None:
    with backend() as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        # a demand kept alive (the deadman would zero it after 100 ms) until the kill, to the first cycle process
        # only: a renewal to the restarted one would be the test's own demand on the wire after the kill (the
        # watch below returns once the new process is connected, before `stop` is set)
        stop = threading.Event()
        first = _pid(b)

        def renew() -> None:
            while not stop.is_set():
                if b.connected() and _pid(b) == first:
                    b.submit(SetDemands({0: 90}))
                time.sleep(0.02)

        t = threading.Thread(target=renew, daemon=True)
        t.start()
        try:
            wait_for(lambda: _demand0(ctl.call("stats")["last_command"]) == 90, 10, "the demand on the wire")
            ctl.call("changes", max=100_000)  # the change log from here on
            before = dict(b.stats().totals or {})
            old, seen = _kill_and_watch(b)
        finally:
            stop.set()
            t.join(2)
        # recovering, not connected, while the new process came up; then connected again
        assert any(v["state"] == "recovering" and not v["connected"] and "cycle process died (killed by SIGKILL)"
                   in v["issue"] for v in seen), seen
        info = b.info()
        assert info["restarts"] == 1 and info["last_exit"] == "killed by SIGKILL" and info["state"] == "op", info
        assert _pid(b) != old
        # the totals go on from where the dead process left them
        after = dict(b.stats().totals or {})
        assert after["restarts"] == 1 and after["cycles"] >= before["cycles"] and after["frames"] >= before["frames"]
        # motors safe across the restart: every command the palm got after the kill demands zero of motor 0
        # (the renewals stopped being sent when the link went down; none reached the new cycle before OP)
        wait_for(lambda: ctl.call("stats")["palm_cycles"] > 0, what="the palm cycling")
        changes = ctl.call("changes", max=100_000)["changes"]
        # (from when the backend saw it gone: a frame the dead process sent just before may arrive after the kill)
        gone_ns = next(v["ns"] for v in seen if v["state"] == "recovering")
        after_kill = [_demand0(h) for ns, _frame, h in changes if ns > gone_ns]
        assert after_kill and set(after_kill) == {0}, after_kill[:20]


def test_restarts_back_off_until_a_good_run() -> None:
    with backend(ethercat_restart_backoff_ms=300, ethercat_restart_backoff_max_ms=1000,
                 ethercat_restart_good_run_s=3.0) as (b, _ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        delays = []
        for _ in range(3):  # back to back: no good run in between, the backoff doubles up to its cap
            _old, seen = _kill_and_watch(b)
            delays.append(next(v["issue"].split("restarting in ")[1] for v in seen if "restarting in" in v["issue"]))
        assert delays == ["0.3 s", "0.6 s", "1.0 s"], delays
        assert b.info()["restarts"] == 3
        time.sleep(3.5)  # a good run
        _old, seen = _kill_and_watch(b)
        assert any("restarting in 0.3 s" in v["issue"] for v in seen), seen
        assert b.info()["restarts"] == 4


def test_a_cycle_process_late_to_op_is_a_failed_attempt_and_the_next_one_runs() -> None:
    """A cycle process that reaches OP after its start deadline (a loaded host, a slow scan) is stopped by the
    service and its attempt counted as failed; on its way out it must leave the service's shared memory alone (it
    deleted it, and every later attempt failed for ever with FileNotFoundError while health said `unreachable`). The
    start is made late on purpose: the first cycle process sleeps past the deadline before it opens the NIC."""
    with hand("0220") as (ns, ctl):
        s = EthercatSettings(backend="virtual", ethercat_ifname=ns.master_if, ethercat_netns=ns.name,
                             ethercat_push_config_on_start=False)
        b = ProcessBackend(s, start_timeout_s=3.0)
        b.start_delays = [4.0]  # OP about 1.5 s after the deadline, within the 5 s the service gives it to stop
        link = SupervisedLink(link_policy(s), lambda _fields: None)
        b.attach_link(link)
        b.start()
        try:
            wait_for(lambda: b.connected() and b.valid_statuses() > 0, 60,
                     f"valid process data from the next attempt ({link.details()})")
            d = link.details()
            assert d["failures"] == 1 and "did not reach OP within 3.0s" in d["last_failure"], d
            # the late process did reach OP (it is the one that, on its way out, took the memory along)
            to_op = [t for t in ctl.call("stats")["transitions"] if t.endswith("->0x08")]
            assert len(to_op) >= 2, ctl.call("stats")["transitions"]
        finally:
            b.stop()


def test_the_shared_memory_closes_under_no_reader() -> None:
    """stop() while other threads read the cycle's shared memory as the service's do (a handler's link check and
    submit on paho's thread, the publisher's snapshot and stats, the deadline thread's look at the newest status):
    every read after the close finds the link down, none finds the memory closed under it (`mmap closed or
    invalid`, an IndexError on an emptied view: the node's publisher died of it at SIGTERM under a demand
    stream)."""
    with hand("0220") as (ns, _ctl):
        b = ProcessBackend(EthercatSettings(backend="virtual", ethercat_ifname=ns.master_if, ethercat_netns=ns.name,
                                            ethercat_push_config_on_start=False))
        b.start()
        errors: list[BaseException] = []
        done = threading.Event()
        reads = [0]

        def read() -> None:
            while not done.is_set():
                try:
                    b.connected()
                    b.submit(SetDemands({0: 10}))
                    b.last_valid_status()
                    b.stats()
                    b.snapshot()
                    b.info()
                    b.stop_sent_ns(1)
                    reads[0] += 1
                except BaseException as exc:  # any of them is the defect
                    errors.append(exc)
                    return

        readers = [threading.Thread(target=read, daemon=True) for _ in range(3)]
        try:
            wait_for(lambda: b.connected(), what="valid process data")
            for t in readers:
                t.start()
            wait_for(lambda: reads[0] > 50, what="the readers at work")
        finally:
            b.stop()
            time.sleep(0.2)  # reads after the close
            done.set()
            for t in readers:
                t.join(5)
        assert not errors, errors[:3]
        assert not b.connected() and b.stats() is not None
