"""The cycle process: the 1 kHz cycle in its OWN PROCESS (pysoem master + PalmDriver), joined to the
MQTT process by shared memory and pipes, so MQTT, JSON and logging never hold the GIL the cycle needs
(`python -m services.ethercat_loop.transport.cycle`, started by process_backend.ProcessBackend).

    MQTT process (ProcessBackend)                 cycle process (cycle_main), single-threaded
    submit(msg) --pickle--> control pipe ------>  drained at every tick, msg.apply(driver)
    snapshot() <-- seqlock slots (shared mem) <-  every valid status raw; a lean driver snapshot 10 Hz
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
from services.ethercat_loop.control import CanRxFrame, Halt, SetDemands
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
# each control message starts with its submit time (CLOCK_MONOTONIC ns) and, for a SetDemands, the motors it sets
# (bit per motor; 0 for any other message): a backlog's superseded demands are dropped without unpickling them
SUBMIT_HEAD = struct.Struct("<QI")


def submit_frame(msg: object, now_ns: int) -> bytes:
    """A control message as the MQTT side writes it to the pipe: SUBMIT_HEAD, then the pickle."""
    mask = 0
    if isinstance(msg, SetDemands):
        for motor in msg.demands:
            mask |= 1 << motor
    return SUBMIT_HEAD.pack(now_ns, mask) + pickle.dumps(msg, 5)
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
    start_delay_s: float = 0.0  # tests: sleep this long before opening the NIC (a start made late on purpose)


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
def cycle_main(cfg: CycleConfig, shm_fd: int, ctl: Connection, events: Connection) -> None:
    """Entry point of the cycle process."""
    # the node's own logging configuration (level, ROBOBUS_LOG_JSON), not a private one
    setup_logging(cfg.settings.log_level, cfg.settings.log_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us cleanly
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.append("SIGTERM"))
    # The parent's death closes the control pipe: the cycle reads EOF and stops the same way (zero
    # demands, leave OP). No PR_SET_PDEATHSIG: it fires when the *thread* that started us exits.
    os.set_blocking(events.fileno(), False)
    shm = SharedBlock.attach(shm_fd)  # the MQTT process's: mapped here, never removed from here
    st = _CycleState()

    def publish() -> None:
        shm.write_slot("status", pickle.dumps(st, 5))

    st.warnings = apply_realtime(cfg.rt)
    st.policy = current_policy()
    for w in st.warnings:
        log.warning("%s", w)
    publish()
    if cfg.start_delay_s > 0:  # tests: a bring-up made late on purpose (ProcessBackend.start_delays)
        time.sleep(cfg.start_delay_s)
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
    if master.recovery_log:  # a bring-up that took more than one scan says why (EthercatMaster._configure)
        st.recovery = _recovery_view(master)
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
    if lost is not None:
        log.error("EtherCAT bus lost: %s", lost)
        raise SystemExit(LOST_EXIT)


# counter indices (shm.C), resolved once: the loop writes a dozen counters a period
K_COMMANDS_APPLIED = C["commands_applied"]
K_CONSECUTIVE_NO_STATUS = C["consecutive_no_status"]
K_CPU_NS_MAX = C["cpu_ns_max"]
K_CPU_NS_SUM = C["cpu_ns_sum"]
K_CYCLES = C["cycles"]
K_DECODE_ERRORS = C["decode_errors"]
K_DROPPED = C["dropped"]
K_ESCALATIONS = C["escalations"]
K_FRAMES = C["frames"]
K_HEALTH_ERROR = C["health_error"]
K_HEARTBEAT_NS = C["heartbeat_ns"]
K_IN_OP = C["in_op"]
K_LATE = C["late"]
K_LATE_STARTS = C["late_starts"]
K_LEFT_OP = C["left_op"]
K_LOST = C["lost"]
K_MAX_CONSECUTIVE_NO_STATUS = C["max_consecutive_no_status"]
K_NO_STATUS = C["no_status"]
K_OUTAGES = C["outages"]
K_OVERRUN_LATE_WAKE = C["overrun_late_wake"]
K_OVERRUN_LOST_FRAME = C["overrun_lost_frame"]
K_OVERRUN_SLACK_WORK = C["overrun_slack_work"]
K_OVERRUN_SLOW_EXCHANGE = C["overrun_slow_exchange"]
K_OVERRUNS = C["overruns"]
K_PERIOD_NS = C["period_ns"]
K_RECOVERIES = C["recoveries"]
K_RESCANS = C["rescans"]
K_RTT_NS_MAX = C["rtt_ns_max"]
K_SKIPPED_CYCLES = C["skipped_cycles"]
K_SNAPSHOTS = C["snapshots"]
K_STALE = C["stale"]
K_STARTED_NS = C["started_ns"]
K_STATE_CHECKS = C["state_checks"]
K_STOP_SENT_NS = C["stop_sent_ns"]
K_STOP_SEQ = C["stop_seq"]
K_SUBMITS = C["submits"]
K_SUPERSEDED = C["superseded"]
K_WAKE_NS_MAX = C["wake_ns_max"]
K_WKC_ERRORS = C["wkc_errors"]
_mono, _cpu_time = time.monotonic_ns, time.thread_time_ns  # one global lookup each, not a module's attribute


def _run(cfg: CycleConfig, master: EthercatMaster, driver: PalmDriver, shm: SharedBlock, ctl: Connection,
         events: Connection, st: _CycleState, publish: Callable[[], None], stopping: list[str]) -> None:
    _Cycle(cfg, master, driver, shm, ctl, events, st, publish, stopping).run()


class _Cycle:
    """The loop of the cycle process, one period at a time. `run` sleeps to each release and calls, in order:
    `read` (the reply to the last frame: loss, WKC, outage bookkeeping), `apply` (the control messages), update
    (`driver.cycle`: the driver builds the command from that status), `write` (the frame goes out; the
    counters, the raw status and the CAN events for the MQTT side), `slack` (state check, re-scan, snapshot, only
    in the period's slack) and `close` (CPU time, the next release, overrun accounting). What one period hands
    the next lives in the attributes; what one period's steps hand each other is passed as arguments."""

    __slots__ = ("backlog", "cfg", "check_due", "cnt", "ctl", "ctl_poll", "cycle", "drained", "driver", "events",
                 "h_cmd", "h_cpu", "h_rtt", "h_wake", "halting", "master", "no_exchange", "period", "publish",
                 "quarter", "recovery_seen", "rescan_after", "rescan_backoff", "shm", "slack_check", "snap_cost",
                 "snapshot_due", "st", "statuses_seen", "stop_seen", "stopping", "submitted", "wc", "write_raw")

    def __init__(self, cfg: CycleConfig, master: EthercatMaster, driver: PalmDriver, shm: SharedBlock,
                 ctl: Connection, events: Connection, st: _CycleState, publish: Callable[[], None],
                 stopping: list[str]) -> None:
        self.cfg, self.master, self.driver, self.shm, self.ctl, self.events = cfg, master, driver, shm, ctl, events
        self.st, self.publish, self.stopping = st, publish, stopping
        self.cnt, self.h_wake, self.h_cpu = shm.counters_mv, shm.hist_mv["wake"], shm.hist_mv["cpu"]
        self.h_rtt, self.h_cmd = shm.hist_mv["rtt"], shm.hist_mv["command"]
        # one poll object for the whole run: Connection.poll(0) builds a selector per call (~15 µs a cycle)
        self.ctl_poll = select.poll()
        self.ctl_poll.register(ctl.fileno(), select.POLLIN)
        self.submitted: list[int] = []  # submit times of the commands applied this cycle
        self.backlog: list[bytes] = []  # the control messages read this cycle, applied in order
        self.stop_seen = driver.stop_seq
        self.wc = master.counters
        self.period = cfg.period_ns
        self.quarter = cfg.period_ns // 4
        self.slack_check = min(SLACK_STATE_CHECK_NS, cfg.period_ns * 2 // 5)
        self.snap_cost = SLACK_SNAPSHOT_NS  # decaying maximum of what a snapshot took
        self.statuses_seen = -1
        self.halting = False
        self.check_due = cfg.state_check_every
        self.snapshot_due = cfg.snapshot_every
        self.recovery_seen = master.recovery_seq
        self.rescan_after, self.rescan_backoff = 0, 0
        self.cycle = int(self.cnt[K_CYCLES])  # 0, or where a cycle process that died stopped counting
        self.drained = 0
        self.write_raw = shm.raw_writer()
        self.no_exchange = Exchange(None, -1, 0, lost=False)

    def run(self) -> None:
        cnt, h_wake, period = self.cnt, self.h_wake, self.period
        mono, cpu_clock = _mono, _cpu_time
        # update: the driver's own step, the last status in, the command out
        read, apply, update, write, slack, close = self.read, self.apply, self.driver.cycle, self.write, \
            self.slack, self.close
        driver_c, zero_cycles = self.driver.c, self.cfg.zero_cycles
        sleeper = AbsoluteSleeper()
        cnt[K_PERIOD_NS] = period
        gc.disable()
        # releases on the CLOCK_MONOTONIC grid of the period (multiples of it; for a period dividing 1 s, on
        # the full second): a phase other processes can know, e.g. a latency probe woken just before it
        deadline = (mono() // period + 2) * period
        cnt[K_STARTED_NS] = deadline
        while True:
            sleeper.sleep_until(deadline)
            wake = mono()
            cpu0 = cpu_clock()
            lat = wake - deadline
            h_wake[min(lat // 1000, HIST_US)] += 1
            if lat > cnt[K_WAKE_NS_MAX]:
                cnt[K_WAKE_NS_MAX] = lat
            ex, t_ex, status = read(deadline, wake)
            apply()
            # the status of the last exchange answers the command before it (the palm loads it after the
            # command arrived), so building the command here loses nothing and saves a period of latency
            sent_ns = write(update(status, wake), status, wake)
            if self.halting and driver_c["halt_zero_cycles"] >= zero_cycles:
                self.finish_stop()
                return
            slack_work, after = slack(deadline, status)
            if after != deadline:  # a re-scan: back on the grid (the stop is a re-scan, not an overrun)
                deadline = wake = after
            deadline = close(deadline, wake, lat, cpu0, ex, t_ex, sent_ns, slack_work)

    def read(self, deadline: int, wake: int) -> tuple[Exchange, int, bytes | None]:
        """The reply to the frame sent at the last release: in the socket's queue long since (the cycle does not
        sleep a second time per period waiting for it); its round trip is the kernel's receive time. A reply not
        back yet is waited for at most a quarter period into this one. Returns (exchange, when it was read,
        the valid status or None)."""
        master = self.master
        if not master.pending:  # nothing in flight (the first cycle, or after a re-scan)
            return self.no_exchange, wake, None
        cnt, wc = self.cnt, self.wc
        ex = master.receive(deadline + self.quarter)
        t_ex = _mono()
        status = ex.status
        if ex.rtt_ns >= 0:  # a reply older than its send is stale (counted by the master), never an index
            self.h_rtt[min(ex.rtt_ns // 1000, HIST_US)] += 1
        cnt[K_LOST] = wc.lost
        cnt[K_STALE] = wc.stale
        cnt[K_LATE] = wc.late
        cnt[K_WKC_ERRORS] = wc.wkc_errors
        cnt[K_RTT_NS_MAX] = wc.rtt_max_ns
        if status is None:
            cnt[K_NO_STATUS] += 1
            run = cnt[K_CONSECUTIVE_NO_STATUS] + 1
            cnt[K_CONSECUTIVE_NO_STATUS] = run
            if run > cnt[K_MAX_CONSECUTIVE_NO_STATUS]:
                cnt[K_MAX_CONSECUTIVE_NO_STATUS] = run
            if run == self.cfg.error_after:
                cnt[K_HEALTH_ERROR] = 1
                cnt[K_OUTAGES] += 1
                self.st.error = f"no valid status for {run} cycles (lost {wc.lost}, WKC errors {wc.wkc_errors})"
                self.publish()
        elif cnt[K_CONSECUTIVE_NO_STATUS]:
            cnt[K_CONSECUTIVE_NO_STATUS] = 0
            if cnt[K_HEALTH_ERROR]:
                cnt[K_HEALTH_ERROR] = 0
                self.st.error = ""
                self.publish()
        return ex, t_ex, status

    def apply(self) -> None:
        """The control messages, applied to the driver before it builds the command: a demand that arrived before
        the tick goes out now. The pipe is read only when the MQTT side's count of messages written moved (no
        poll syscall in most periods), and every EOF_CHECK_EVERY cycles anyway, for its EOF (the MQTT process
        gone). A stop (message, SIGTERM or EOF) zeroes every demand from this cycle on."""
        cnt = self.cnt
        announced = cnt[K_SUBMITS] - self.drained
        if announced > 0 or self.cycle % EOF_CHECK_EVERY == 0:
            limit = min(max(announced, 1), MAX_MSGS_PER_CYCLE)
            ctl, poll, backlog = self.ctl, self.ctl_poll.poll, self.backlog
            while len(backlog) < limit and poll(0):  # readable, or EOF (POLLHUP)
                self.drained += 1
                try:
                    backlog.append(ctl.recv_bytes())
                except (EOFError, OSError):
                    self.stopping.append("parent gone")
                    break
            if backlog:
                self.apply_backlog(backlog)
                backlog.clear()
        if self.stopping and not self.halting:
            Halt(True).apply(self.driver)
            self.halting = True
            self.st.state = "stopping"
            self.publish()

    def apply_backlog(self, backlog: list[bytes]) -> None:
        """The messages read this cycle, in order; a SetDemands whose every motor a newer one in the backlog sets
        again is superseded (only the newest demand of a motor can reach the frame): counted, never unpickled."""
        cnt, driver, head = self.cnt, self.driver, SUBMIT_HEAD
        newer = 0  # motors set by the SetDemands after the one looked at
        skip = 0  # bit i: backlog[i] superseded
        if len(backlog) > 1:
            for i in range(len(backlog) - 1, -1, -1):
                mask = head.unpack_from(backlog[i])[1]
                if mask:
                    if not mask & ~newer:
                        skip |= 1 << i
                    newer |= mask
        for i, data in enumerate(backlog):
            if skip >> i & 1:
                cnt[K_SUPERSEDED] += 1
                continue
            msg = pickle.loads(memoryview(data)[head.size :])
            if isinstance(msg, _Stop):
                self.stopping.append(msg.reason)
            else:  # validated once, by the service, before it was submitted
                msg.apply(driver)
                cnt[K_COMMANDS_APPLIED] += 1
                self.submitted.append(head.unpack_from(data)[0])

    def write(self, command: bytes, status: bytes | None, wake: int) -> int:
        """The command goes out now (its reply is read at the next release); then what the MQTT side reads: how
        long the applied commands waited for their frame, the counters, every valid status raw (a few µs: it
        decodes joints there, so the costly full driver snapshot can run at a fraction of the rate), the CAN
        frames received. Returns the send time."""
        cnt, driver = self.cnt, self.driver
        sent_ns = self.master.send(command)
        submitted = self.submitted
        if submitted:  # how long the applied commands waited for their frame (the cycle's share of the latency)
            h_cmd = self.h_cmd
            for t_sub in submitted:
                h_cmd[min((sent_ns - t_sub) // 1000, HIST_US)] += 1
            submitted.clear()
            if driver.stop_seq != self.stop_seen:  # a bus stop was applied: this frame carries it (zero demands)
                self.stop_seen = driver.stop_seq
                cnt[K_STOP_SENT_NS] = sent_ns  # the time first: a reader that sees the number sees its time
                cnt[K_STOP_SEQ] = self.stop_seen
        self.cycle += 1
        cnt[K_CYCLES] = self.cycle
        cnt[K_FRAMES] = self.wc.frames
        dc = driver.c
        cnt[K_DROPPED] = dc["dropped"]
        cnt[K_DECODE_ERRORS] = dc["decode_errors"]
        if status is not None and dc["statuses"] != self.statuses_seen:
            self.statuses_seen = dc["statuses"]
            self.write_raw(driver.cycle_no, wake, self.statuses_seen, status)
        if not self.halting or dc["halt_zero_cycles"] < self.cfg.zero_cycles:
            rx = driver.take_can_rx()
            if rx:
                _send_events(self.events, rx, cnt)
        return sent_ns

    def finish_stop(self) -> None:
        """That many zero commands exchanged: the last of them answered (or lost) before leaving OP."""
        driver = self.driver
        self.master.settle(_mono() + self.period)
        self.st.stop_report = {"zero_demand_cycles": driver.c["halt_zero_cycles"],
                               "demands_sent_last": [m.demand_sent for m in driver.motors],
                               "reason": self.stopping[0]}
        self.shm.write_slot("snapshot", pickle.dumps(driver.snapshot(joints=False), 5))
        self.publish()

    def slack(self, deadline: int, status: bytes | None) -> tuple[bool, int]:
        """Slack work, only with enough of the period left: it may wait a cycle, the next tick may not. Returns
        (some was done, the release: `deadline`, or after a re-scan the period boundary before now)."""
        cnt, master, st, period = self.cnt, self.master, self.st, self.period
        mono = _mono
        slack_work = False
        self.check_due -= 1
        self.snapshot_due -= 1
        recheck = self.cycle % 10 == 0 and (status is None or st.state_issue or master.episode_open)
        if master.rescan_needed and not self.halting and mono() >= self.rescan_after:
            # a full re-scan stops the cycle for as long as it takes: only ever while no valid data flow
            slack_work = True
            self.rescan_after = _rescan(master, st, self.publish, cnt, self.rescan_backoff)
            self.rescan_backoff = 0 if not master.rescan_needed else min(5_000_000_000, max(
                self.rescan_backoff * 2, 100_000_000))
            deadline = mono() // period * period
            cnt[K_RESCANS] = self.wc.rescans
        elif (self.check_due <= 0 or recheck) and master.is_open and deadline + period - mono() > self.slack_check:
            self.check_due = self.cfg.state_check_every
            slack_work = True
            cnt[K_STATE_CHECKS] += 1
            # never past the period: a slave that stopped answering must not stall the cycle for SOEM's
            # 2 ms per datagram (the reads that do not fit count as no evidence, not as a problem)
            issue = master.check_states(deadline + period - CHECK_RESERVE_NS)
            master.refresh_clock_offset()
            wc = self.wc
            cnt[K_RECOVERIES] = wc.recoveries
            cnt[K_LEFT_OP] = wc.left_op
            cnt[K_ESCALATIONS] = wc.escalations
            cnt[K_IN_OP] = 0 if issue else 1
            if issue != st.state_issue or master.recovery_seq != self.recovery_seen:
                self.recovery_seen = master.recovery_seq
                st.state_issue = issue
                st.state = "recovering" if issue else ("stopping" if self.halting else "op")
                st.recovery = _recovery_view(master)
                self.publish()
        # start a snapshot only in 2x what recent ones took (a slowly decaying maximum: one took 2x its
        # usual on this VM); after another snapshot interval of refusals, anyway
        if self.snapshot_due <= 0 and (deadline + period - mono() > min(self.snap_cost * 2, period * 4 // 5)
                                       or self.snapshot_due < -self.cfg.snapshot_every):
            self.snapshot_due = self.cfg.snapshot_every
            slack_work = True
            t_snap = mono()
            self.shm.write_slot("snapshot", pickle.dumps(self.driver.snapshot(joints=False), 5))
            self.snap_cost = max(self.snap_cost * 31 // 32, mono() - t_snap, SLACK_SNAPSHOT_NS // 2)
            cnt[K_SNAPSHOTS] += 1
        return slack_work, deadline

    def close(self, deadline: int, wake: int, lat: int, cpu0: int, ex: Exchange, t_ex: int, sent_ns: int,
              slack_work: bool) -> int:
        """The period's CPU time, the heartbeat, and the next release (`realtime.next_deadline`): an overrun skips
        to the next period boundary, counted with what the cycle was doing. Returns the next release."""
        cnt, period = self.cnt, self.period
        cpu = _cpu_time() - cpu0
        self.h_cpu[min(cpu // 1000, HIST_US)] += 1
        cnt[K_CPU_NS_SUM] += cpu
        if cpu > cnt[K_CPU_NS_MAX]:
            cnt[K_CPU_NS_MAX] = cpu
        now = _mono()
        cnt[K_HEARTBEAT_NS] = now
        release = deadline
        deadline, skipped = next_deadline(deadline, wake, now, period)
        if skipped:
            # what the cycle was doing, µs after its release (a fixed-size record written in place)
            self.shm.put_overrun(int(cnt[K_OVERRUNS]), release, lat // 1000, (sent_ns - release) // 1000,
                                 (t_ex - release) // 1000, (now - release) // 1000, skipped, ex.lost, slack_work)
            cnt[K_OVERRUNS] += 1
            cnt[K_SKIPPED_CYCLES] += skipped
            if lat >= period:
                cnt[K_OVERRUN_LATE_WAKE] += 1
            if ex.lost:
                cnt[K_OVERRUN_LOST_FRAME] += 1
            elif ex.rtt_ns > period // 2:
                cnt[K_OVERRUN_SLOW_EXCHANGE] += 1
            if slack_work:
                cnt[K_OVERRUN_SLACK_WORK] += 1
        elif now > deadline:
            cnt[K_LATE_STARTS] += 1  # ran past the next release: it starts now, late (its latency is in "wake")
        elif self.cycle % 1000 == 0 and deadline - _mono() > period // 2:
            gc.collect(0)  # young objects only, and only with half a period of slack left
        return deadline


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
        st.recovery = _recovery_view(master)  # with the re-scan's failure (the last status this process writes)
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
    """`python -m services.ethercat_loop.cycle CTL_FD EVENTS_FD SHM_FD`, the config pickled on stdin."""
    cfg: CycleConfig = pickle.loads(sys.stdin.buffer.read())
    cycle_main(cfg, int(argv[2]), Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


if __name__ == "__main__":
    # run the copy imported under its package name, so pickled classes resolve in both processes
    from services.ethercat_loop.transport import cycle as _cycle

    _cycle._child_entry(sys.argv[1:])
