"""The cycle process: the 1 kHz cycle in its OWN PROCESS (pysoem master + PalmDriver), joined to the
MQTT process by shared memory and pipes, so MQTT, JSON and logging never hold the GIL the cycle needs
(`python -m services.ethercat_loop.transport.cycle`, started by process_backend.ProcessBackend).

    MQTT process (ProcessBackend)                 cycle process (cycle_main), single-threaded
    submit(msg) --pickle--> control pipe ------>  drained at every tick, msg.apply(driver)
    snapshot() <-- seqlock slots in /dev/shm <--  every valid status raw; a lean driver snapshot 10 Hz
    stats()    <-- counters + histograms <------  incremented in place every cycle
    on_can_rx  <-- event pipe (non-blocking) <--  driver.take_can_rx()

One cycle: sleep until the absolute deadline (CLOCK_MONOTONIC) -> record the wake-up latency ->
read the reply to the frame sent at the last release (queued by then: one sleep and one wake-up per
period, not two) -> WKC / loss bookkeeping -> apply control messages -> driver.cycle(that status)
builds the command -> send it -> AL state check and snapshot only in the slack the period leaves ->
next release (`realtime.next_deadline`): a cycle
that ran past the next release starts that one late; an overrun (a release that could not start
within its period) skips to the next period boundary (counted, never a burst).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from services.ethercat_loop.backend import STOP_ZERO_CYCLES, build_driver
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import CanRxFrame, Halt
from services.ethercat_loop.driver import PalmDriver
from services.ethercat_loop.loop_stats import HIST_US
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.transport.master import (
    EthercatMaster,
    Exchange,
    MasterConfig,
    MasterError,
    NoDevice,
    WrongKind,
)
from services.ethercat_loop.transport.realtime import (
    AbsoluteSleeper,
    RtSettings,
    apply_realtime,
    current_policy,
    next_deadline,
)
from services.ethercat_loop.transport.shm import C, SharedBlock
from shared.logs import setup_logging

log = logging.getLogger("robobus.ethercat.cycle")
MAX_MSGS_PER_CYCLE = 64
EOF_CHECK_EVERY = 50  # cycles between two polls of the control pipe for EOF when no message was announced
CAN_RX_CHUNK = 20  # frames per event message: keeps each pipe write under PIPE_BUF (atomic)
SUBMIT_STAMP = struct.Struct("<Q")  # each control message starts with its submit time (CLOCK_MONOTONIC ns)
SLACK_SNAPSHOT_NS = 300_000  # the least slack a snapshot may start in; more if recent ones took longer
SLACK_STATE_CHECK_NS = 400_000  # an AL state read is one round trip per slave (bounded: see below)
CHECK_RESERVE_NS = 100_000  # what the cycle still does after the state check, with margin
START_FAILED_EXIT = 3  # the bus could not be brought up (the state's `fatal` says why, `fault_kind` what kind)
LOST_EXIT = 4  # a re-scan found no device (or another kind) where the palm was: the bus is lost


@dataclass
class CycleConfig:
    """Everything the cycle process needs (picklable: it crosses a spawn)."""

    settings: EthercatSettings
    calibration: HandCalibration  # loaded once, in the MQTT process
    master: MasterConfig
    rt: RtSettings
    period_ns: int
    snapshot_every: int
    state_check_every: int
    error_after: int
    zero_cycles: int = STOP_ZERO_CYCLES


@dataclass
class _Stop:
    """Control message: zero demands, then leave OP and exit."""

    reason: str = "stop"


@dataclass
class _CycleState:
    state: str = "starting"
    error: str = ""
    fatal: str = ""
    warnings: list[str] = field(default_factory=list)
    state_issue: str = ""
    policy: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)
    stop_report: dict[str, Any] = field(default_factory=dict)
    # why the bus could not be brought up (or was lost): "absent" (no slave answers, or no NIC), "garbage" (frames
    # arrived, none a slave's answer), "wrong_kind" (not the palm configured), "" (anything else)
    fault_kind: str = ""
    garbage: int = 0  # frames that arrived during the failed scan


class _BusLost(Exception):
    """A re-scan found nothing to drive on the NIC: the cycle process ends and the service reconnects."""

    def __init__(self, cause: MasterError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def fault_kind(exc: BaseException) -> tuple[str, int]:
    """(kind, garbage frames) of a bring-up failure, for the service's link supervisor."""
    if isinstance(exc, WrongKind):
        return "wrong_kind", 0
    if isinstance(exc, NoDevice):
        return ("garbage" if exc.garbage else "absent"), exc.garbage
    return "", 0


# ============================================================================ the cycle process
def cycle_main(cfg: CycleConfig, shm_path: str, ctl: Connection, events: Connection) -> None:
    """Entry point of the cycle process."""
    # the node's own logging configuration (level, ROBOBUS_LOG_JSON), not a private one
    setup_logging(cfg.settings.log_level, cfg.settings.log_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us cleanly
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.append("SIGTERM"))
    # The parent's death closes the control pipe: the cycle reads EOF and stops the same way (zero
    # demands, leave OP). No PR_SET_PDEATHSIG: it fires when the *thread* that started us exits.
    os.set_blocking(events.fileno(), False)
    shm = SharedBlock(shm_path)
    st = _CycleState()

    def publish() -> None:
        shm.write_slot("status", pickle.dumps(st, 5))

    st.warnings = apply_realtime(cfg.rt)
    st.policy = current_policy()
    for w in st.warnings:
        log.warning("%s", w)
    publish()
    master = EthercatMaster(cfg.master)
    _continue_counts(master, shm)
    try:
        ident = master.open()
        driver = build_driver(cfg.settings, cfg.calibration, ident.protocol)
        for k in ("dropped", "decode_errors"):  # driver counters the shared block mirrors: on from there too
            driver.c[k] = int(shm.counters[C[k]])
        # Everything allocated so far lives for the whole run: collect and freeze it now, while no
        # frame is due (a full collection can take tens of ms), then keep the collector out of the cycle.
        gc.collect()
        gc.freeze()
        master.to_op()
    except (MasterError, OSError, ValueError) as exc:
        st.state, st.fatal, st.error = "error", str(exc), str(exc)
        st.fault_kind, st.garbage = fault_kind(exc)
        publish()
        log.error("%s", exc)
        master.close()
        shm.close()
        raise SystemExit(START_FAILED_EXIT) from None
    st.identity = ident.as_dict()
    st.state = "op"
    publish()
    lost: _BusLost | None = None
    try:
        _run(cfg, master, driver, shm, ctl, events, st, publish, stopping)
    except _BusLost as exc:
        lost = exc
    finally:
        with contextlib.suppress(Exception):
            master.leave_op()
        master.close()
        if lost is not None:
            st.state, st.fatal, st.error = "lost", str(lost), str(lost)
            st.fault_kind, st.garbage = fault_kind(lost.cause)
        else:
            st.state = "stopped"
        publish()
        shm.close()
        if "parent gone" in stopping:  # nobody is left to remove the shared block
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path)
    if lost is not None:
        log.error("EtherCAT bus lost: %s", lost)
        raise SystemExit(LOST_EXIT)


def _run(cfg: CycleConfig, master: EthercatMaster, driver: PalmDriver, shm: SharedBlock, ctl: Connection,
         events: Connection, st: _CycleState, publish: Callable[[], None], stopping: list[str]) -> None:
    # counter indices as locals: the loop writes a dozen counters a period
    k_commands_applied = C["commands_applied"]
    k_consecutive_no_status = C["consecutive_no_status"]
    k_cpu_ns_max = C["cpu_ns_max"]
    k_cpu_ns_sum = C["cpu_ns_sum"]
    k_cycles = C["cycles"]
    k_decode_errors = C["decode_errors"]
    k_dropped = C["dropped"]
    k_escalations = C["escalations"]
    k_frames = C["frames"]
    k_health_error = C["health_error"]
    k_heartbeat_ns = C["heartbeat_ns"]
    k_in_op = C["in_op"]
    k_late = C["late"]
    k_late_starts = C["late_starts"]
    k_left_op = C["left_op"]
    k_lost = C["lost"]
    k_max_consecutive_no_status = C["max_consecutive_no_status"]
    k_no_status = C["no_status"]
    k_outages = C["outages"]
    k_overrun_late_wake = C["overrun_late_wake"]
    k_overrun_lost_frame = C["overrun_lost_frame"]
    k_overrun_slack_work = C["overrun_slack_work"]
    k_overrun_slow_exchange = C["overrun_slow_exchange"]
    k_overruns = C["overruns"]
    k_period_ns = C["period_ns"]
    k_recoveries = C["recoveries"]
    k_rescans = C["rescans"]
    k_rtt_ns_max = C["rtt_ns_max"]
    k_skipped_cycles = C["skipped_cycles"]
    k_snapshots = C["snapshots"]
    k_stale = C["stale"]
    k_started_ns = C["started_ns"]
    k_state_checks = C["state_checks"]
    k_wake_ns_max = C["wake_ns_max"]
    k_wkc_errors = C["wkc_errors"]
    cnt, h_wake, h_cpu, h_rtt = shm.counters_mv, shm.hist_mv["wake"], shm.hist_mv["cpu"], shm.hist_mv["rtt"]
    h_cmd = shm.hist_mv["command"]
    # one poll object for the whole run: Connection.poll(0) builds a selector per call (~15 µs a cycle)
    ctl_poll = select.poll()
    ctl_poll.register(ctl.fileno(), select.POLLIN)
    submitted: list[int] = []  # submit times of the commands applied this cycle
    k_stop_sent_ns, k_stop_seq = C["stop_sent_ns"], C["stop_seq"]
    stop_seen = driver.stop_seq
    wc = master.counters
    period = cfg.period_ns
    sleeper = AbsoluteSleeper()
    mono, cpu_clock, loads, dumps = time.monotonic_ns, time.thread_time_ns, pickle.loads, pickle.dumps
    cnt[k_period_ns] = period
    slack_check = min(SLACK_STATE_CHECK_NS, period * 2 // 5)
    snap_cost = SLACK_SNAPSHOT_NS  # decaying maximum of what a snapshot took
    status: bytes | None = None
    statuses_seen = -1
    halting = False
    check_due = cfg.state_check_every
    snapshot_due = cfg.snapshot_every
    recovery_seen = master.recovery_seq
    rescan_after, rescan_backoff = 0, 0
    gc.disable()
    # releases on the CLOCK_MONOTONIC grid of the period (multiples of it; for a period dividing 1 s, on
    # the full second): a phase other processes can know, e.g. a latency probe woken just before it
    deadline = (mono() // period + 2) * period
    cnt[k_started_ns] = deadline
    cycle = int(cnt[k_cycles])  # 0, or where a cycle process that died stopped counting
    quarter = period // 4
    submits_at, drained = C["submits"], 0
    write_raw = shm.raw_writer()
    no_exchange = Exchange(None, -1, 0, lost=False)
    while True:
        sleeper.sleep_until(deadline)
        wake = mono()
        cpu0 = cpu_clock()
        lat = wake - deadline
        h_wake[min(lat // 1000, HIST_US)] += 1
        if lat > cnt[k_wake_ns_max]:
            cnt[k_wake_ns_max] = lat
        # ---- the reply to the frame sent at the last release: in the socket's queue long since (the
        # cycle does not sleep a second time per period waiting for it); its round trip is the kernel's
        # receive time. A reply not back yet is waited for at most a quarter period into this one.
        if master.pending:
            ex = master.receive(deadline + quarter)
            t_ex = mono()
            status = ex.status
            if ex.rtt_ns >= 0:  # a reply older than its send is stale (counted by the master), never an index
                h_rtt[min(ex.rtt_ns // 1000, HIST_US)] += 1
            cnt[k_lost] = wc.lost
            cnt[k_stale] = wc.stale
            cnt[k_late] = wc.late
            cnt[k_wkc_errors] = wc.wkc_errors
            cnt[k_rtt_ns_max] = wc.rtt_max_ns
            if status is None:
                cnt[k_no_status] += 1
                run = cnt[k_consecutive_no_status] + 1
                cnt[k_consecutive_no_status] = run
                if run > cnt[k_max_consecutive_no_status]:
                    cnt[k_max_consecutive_no_status] = run
                if run == cfg.error_after:
                    cnt[k_health_error] = 1
                    cnt[k_outages] += 1
                    st.error = f"no valid status for {run} cycles (lost {wc.lost}, WKC errors {wc.wkc_errors})"
                    publish()
            elif cnt[k_consecutive_no_status]:
                cnt[k_consecutive_no_status] = 0
                if cnt[k_health_error]:
                    cnt[k_health_error] = 0
                    st.error = ""
                    publish()
        else:  # nothing in flight (the first cycle, or after a re-scan)
            ex = no_exchange
            t_ex = wake
            status = None
        # ---- control messages, then the command: a demand that arrived before the tick goes out now ----
        # read the pipe only when the MQTT side's count of messages written moved (no poll syscall in most
        # periods), and every EOF_CHECK_EVERY cycles anyway, for its EOF (the MQTT process gone)
        announced = cnt[submits_at] - drained
        if announced > 0 or cycle % EOF_CHECK_EVERY == 0:
            limit = min(max(announced, 1), MAX_MSGS_PER_CYCLE)
            n = 0
            while n < limit and ctl_poll.poll(0):  # readable, or EOF (POLLHUP)
                n += 1
                drained += 1
                try:
                    data = ctl.recv_bytes()
                    msg = loads(memoryview(data)[SUBMIT_STAMP.size :])
                except (EOFError, OSError):
                    stopping.append("parent gone")
                    break
                if isinstance(msg, _Stop):
                    stopping.append(msg.reason)
                else:  # validated once, by the service, before it was submitted
                    msg.apply(driver)
                    cnt[k_commands_applied] += 1
                    submitted.append(SUBMIT_STAMP.unpack_from(data)[0])
        if stopping and not halting:
            Halt(True).apply(driver)
            halting = True
            st.state = "stopping"
            publish()
        # the status of the last exchange answers the command before it (the palm loads it after the
        # command arrived), so building the command here loses nothing and saves a period of latency
        command = driver.cycle(status, wake)
        # ---- the wire: the command goes out now; its reply is read at the next release ----
        sent_ns = master.send(command)
        if submitted:  # how long the applied commands waited for their frame (the cycle's share of the latency)
            for t_sub in submitted:
                h_cmd[min((sent_ns - t_sub) // 1000, HIST_US)] += 1
            submitted.clear()
            if driver.stop_seq != stop_seen:  # a bus stop was applied: this frame carries it (zero demands)
                stop_seen = driver.stop_seq
                cnt[k_stop_sent_ns] = sent_ns  # the time first: a reader that sees the number sees its time
                cnt[k_stop_seq] = stop_seen
        cycle += 1
        cnt[k_cycles] = cycle
        cnt[k_frames] = wc.frames
        cnt[k_dropped] = driver.c["dropped"]
        cnt[k_decode_errors] = driver.c["decode_errors"]
        if status is not None and driver.c["statuses"] != statuses_seen:
            # every valid status goes to the MQTT side raw (a few µs); it decodes joints there, so the
            # costly full driver snapshot can run at a fraction of the rate
            statuses_seen = driver.c["statuses"]
            write_raw(driver.cycle_no, wake, statuses_seen, status)
        if halting and driver.c["halt_zero_cycles"] >= cfg.zero_cycles:  # that many zero commands exchanged
            master.settle(mono() + period)  # the last of them answered (or lost) before leaving OP
            st.stop_report = {"zero_demand_cycles": driver.c["halt_zero_cycles"],
                              "demands_sent_last": [m.demand_sent for m in driver.motors],
                              "reason": stopping[0]}
            shm.write_slot("snapshot", dumps(driver.snapshot(joints=False), 5))
            publish()
            return
        rx = driver.take_can_rx()
        if rx:
            _send_events(events, rx, cnt)
        # ---- slack work, only with enough of the period left: it may wait a cycle, the next tick may not ----
        slack_work = False
        check_due -= 1
        snapshot_due -= 1
        recheck = (status is None or st.state_issue) and cycle % 10 == 0
        if master.rescan_needed and not halting and mono() >= rescan_after:
            # a full re-scan stops the cycle for as long as it takes: only ever while no valid data flow
            slack_work = True
            rescan_after = _rescan(master, st, publish, cnt, rescan_backoff)
            rescan_backoff = 0 if not master.rescan_needed else min(5_000_000_000, max(rescan_backoff * 2,
                                                                                       100_000_000))
            deadline = mono() // period * period  # back on the grid: the stop is a re-scan, not an overrun
            wake = deadline
            cnt[k_rescans] = wc.rescans
        elif (check_due <= 0 or recheck) and master.is_open and deadline + period - mono() > slack_check:
            check_due = cfg.state_check_every
            slack_work = True
            cnt[k_state_checks] += 1
            # never past the period: a slave that stopped answering must not stall the cycle for SOEM's
            # 2 ms per datagram (the reads that do not fit count as no evidence, not as a problem)
            issue = master.check_states(deadline + period - CHECK_RESERVE_NS)
            master.refresh_clock_offset()
            cnt[k_recoveries] = wc.recoveries
            cnt[k_left_op] = wc.left_op
            cnt[k_escalations] = wc.escalations
            cnt[k_in_op] = 0 if issue else 1
            changed = issue != st.state_issue or master.recovery_seq != recovery_seen
            if changed:
                recovery_seen = master.recovery_seq
                st.state_issue = issue
                st.state = "recovering" if issue else ("stopping" if halting else "op")
                st.recovery = _recovery_view(master)
                publish()
        left = deadline + period - mono()
        # start a snapshot only in 2x what recent ones took (a slowly decaying maximum: one took 2x its
        # usual on this VM); after another snapshot interval of refusals, anyway
        fits = left > min(snap_cost * 2, period * 4 // 5)
        if snapshot_due <= 0 and (fits or snapshot_due < -cfg.snapshot_every):
            snapshot_due = cfg.snapshot_every
            slack_work = True
            t_snap = mono()
            shm.write_slot("snapshot", dumps(driver.snapshot(joints=False), 5))
            snap_cost = max(snap_cost * 31 // 32, mono() - t_snap, SLACK_SNAPSHOT_NS // 2)
            cnt[k_snapshots] += 1
        cpu = cpu_clock() - cpu0
        h_cpu[min(cpu // 1000, HIST_US)] += 1
        cnt[k_cpu_ns_sum] += cpu
        if cpu > cnt[k_cpu_ns_max]:
            cnt[k_cpu_ns_max] = cpu
        now = mono()
        cnt[k_heartbeat_ns] = now
        release = deadline
        deadline, skipped = next_deadline(deadline, wake, now, period)
        if skipped:
            # what the cycle was doing, µs after its release (a fixed-size record written in place)
            shm.put_overrun(int(cnt[k_overruns]), release, lat // 1000, (sent_ns - release) // 1000,
                            (t_ex - release) // 1000, (now - release) // 1000, skipped, ex.lost, slack_work)
            cnt[k_overruns] += 1
            cnt[k_skipped_cycles] += skipped
            if lat >= period:
                cnt[k_overrun_late_wake] += 1
            if ex.lost:
                cnt[k_overrun_lost_frame] += 1
            elif ex.rtt_ns > period // 2:
                cnt[k_overrun_slow_exchange] += 1
            if slack_work:
                cnt[k_overrun_slack_work] += 1
        elif now > deadline:
            cnt[k_late_starts] += 1  # ran past the next release: it starts now, late (its latency is in "wake")
        elif cycle % 1000 == 0 and deadline - mono() > period // 2:
            gc.collect(0)  # young objects only, and only with half a period of slack left


def _continue_counts(master: EthercatMaster, shm: SharedBlock) -> None:
    """A cycle process started after one died continues the totals in the shared block (they are copied there
    from the master's counters each cycle): loop_stats windows and totals never go backwards."""
    c = master.counters
    for k in ("frames", "lost", "stale", "late", "wkc_errors", "recoveries", "left_op", "escalations", "rescans"):
        setattr(c, k, int(shm.counters[C[k]]))
    c.rtt_max_ns = int(shm.counters[C["rtt_ns_max"]])


def _recovery_view(master: EthercatMaster) -> dict[str, Any]:
    """What recovery did (for health details and the MQTT side's log): the last steps with their
    CLOCK_MONOTONIC time, and the counters."""
    wc = master.counters
    return {"steps": [[t, text] for t, text in master.recovery_log], "seq": master.recovery_seq,
            "escalations": wc.escalations, "escalation_failures": wc.escalation_failures, "rescans": wc.rescans,
            "recoveries": wc.recoveries}


def _rescan(master: EthercatMaster, st: _CycleState, publish: Callable[[], None], cnt: Any, backoff_ns: int) -> int:
    """Run the re-scan the master asked for; returns the CLOCK_MONOTONIC time before which not to retry."""
    st.state, st.state_issue = "rescanning", f"re-scanning the bus: {master.rescan_needed}"
    st.recovery = _recovery_view(master)
    publish()
    try:
        ident = master.rescan()
    except (NoDevice, WrongKind) as exc:
        # nothing to drive where the palm was: the service's link supervisor reconnects (its back-off and
        # probe period), with a new cycle process, rather than this one re-scanning on a rhythm of its own
        raise _BusLost(exc) from None
    except (MasterError, OSError, ValueError) as exc:
        master.rescan_needed = f"re-scan failed: {exc}"
        st.state, st.state_issue = "recovering", master.rescan_needed
        st.recovery = _recovery_view(master)
        publish()
        return time.monotonic_ns() + max(backoff_ns, 100_000_000)
    st.identity = ident.as_dict()
    st.state, st.state_issue = "op", ""
    st.recovery = _recovery_view(master)
    publish()
    return 0


def _send_events(events: Connection, rx: list[CanRxFrame], cnt: Any) -> None:
    for i in range(0, len(rx), CAN_RX_CHUNK):
        try:
            events.send_bytes(pickle.dumps(rx[i : i + CAN_RX_CHUNK], 5))
        except BlockingIOError:
            cnt[C["events_dropped"]] += 1  # the MQTT side is not reading: frames are dropped, not queued
            break


def _child_entry(argv: list[str]) -> None:
    """`python -m services.ethercat_loop.cycle CTL_FD EVENTS_FD SHM_PATH`, the config pickled on stdin."""
    cfg: CycleConfig = pickle.loads(sys.stdin.buffer.read())
    cycle_main(cfg, argv[2], Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


if __name__ == "__main__":
    # run the copy imported under its package name, so pickled classes resolve in both processes
    from services.ethercat_loop.transport import cycle as _cycle

    _cycle._child_entry(sys.argv[1:])
