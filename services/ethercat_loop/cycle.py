"""The realtime wire backend: the 1 kHz cycle in its OWN PROCESS (pysoem master + PalmDriver),
joined to the MQTT process by shared memory and pipes, so MQTT, JSON and logging never hold the
GIL the cycle needs (`python -m services.ethercat_loop.cycle`, started by ProcessBackend).

    MQTT process (ProcessBackend)                 cycle process (cycle_main), single-threaded
    submit(msg) --pickle--> control pipe ------>  drained at every tick, driver.apply()
    snapshot() <-- seqlock slots in /dev/shm <--  every valid status raw; a lean driver snapshot 10 Hz
    stats()    <-- counters + histograms <------  incremented in place every cycle
    on_can_rx  <-- event pipe (non-blocking) <--  driver.take_can_rx()

One cycle: sleep until the absolute deadline (CLOCK_MONOTONIC) -> record the wake-up latency ->
apply control messages -> driver.cycle(last status) builds the command -> exchange it (sleeping in
select() for the reply, never past the next tick) -> WKC / loss bookkeeping -> AL state check and
snapshot only in the slack the period leaves -> next release (`cycle_rt.next_deadline`): a cycle
that ran past the next release starts that one late; an overrun (a release that could not start
within its period) skips to the next period boundary (counted, never a burst).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.ethercat_loop.backend import (
    STOP_ZERO_CYCLES,
    BackendUnavailable,
    CanRxHandler,
    EthercatSettings,
    HandBackend,
    build_driver,
)
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.cycle_rt import AbsoluteSleeper, RtSettings, apply_realtime, current_policy, next_deadline
from services.ethercat_loop.cycle_shm import HIST_US, RAW_HEAD, C, SharedBlock, percentiles
from services.ethercat_loop.driver import (
    CanRxFrame,
    CanTx,
    ControlMessage,
    Halt,
    PalmDriver,
    PalmJointSnapshot,
    PalmSnapshot,
)
from services.ethercat_loop.master import EthercatMaster, MasterConfig, MasterError
from services.ethercat_loop.protocol import DecodeError, EdcCommand, s16, unpack_status

log = logging.getLogger("robobus.ethercat.cycle")
MAX_MSGS_PER_CYCLE = 64
CAN_RX_CHUNK = 20  # frames per event message: keeps each pipe write under PIPE_BUF (atomic)
PIPE_ATOMIC = 4096
OVERRUNS_SHOWN = 8  # overrun records in loop_stats (all kept ones: their release times)
SUBMIT_STAMP = struct.Struct("<Q")  # each control message starts with its submit time (CLOCK_MONOTONIC ns)
SWITCH_INTERVAL_S = 0.0005
POST_EXCHANGE_NS = 250_000  # bookkeeping after the exchange, with margin
SLACK_SNAPSHOT_NS = 300_000  # the least slack a snapshot may start in; more if recent ones took longer
SLACK_STATE_CHECK_NS = 400_000  # an AL state read is one round trip per slave (bounded: see below)
CHECK_RESERVE_NS = 100_000  # what the cycle still does after the state check, with margin
REPO = Path(__file__).resolve().parents[2]


class WireSettings(EthercatSettings):
    """Settings of the wire backends on top of EthercatSettings (ROBOBUS_ETHERCAT_*)."""

    ethercat_netns: str = Field("", description="Network namespace holding the NIC (the virtual hand's "
                                "namespace from `make ethercat-vhand`); empty: the host's")
    ethercat_rt_priority: int = Field(80, ge=0, le=99, description="SCHED_FIFO priority of the cycle process "
                                      "(0: normal scheduling)")
    ethercat_cpus: list[int] = Field(default_factory=list, description="CPU affinity of the cycle process")
    ethercat_lock_memory: bool = Field(True, description="mlockall in the cycle process")
    ethercat_recv_timeout_us: int = Field(500, ge=50, le=100_000, description="Receive timeout per frame, "
                                          "well under the period")
    ethercat_late_us: int = Field(300, ge=10, description="A reply later than this counts as a late frame")
    ethercat_program_sms: Literal["auto", "always", "never"] = Field(
        "auto", description="Program the 4 mailbox SMs + 2 FMMUs when the palm's SII lacks them")
    ethercat_snapshot_hz: float = Field(10.0, gt=0, le=1000, description="Full driver snapshots per second "
                                        "(motors, counters); joints and sensors come from every status")
    ethercat_state_check_ms: int = Field(250, ge=1, description="Period of the AL state check (a backstop: a "
                                         "palm leaving OP already shows as a working-counter drop)")
    ethercat_virtual_args: list[str] = Field(default_factory=list, description="Extra virtual_hand options "
                                             "when the virtual backend starts its own hand")


@dataclass
class CycleConfig:
    """Everything the cycle process needs (picklable: it crosses a spawn)."""

    settings: WireSettings
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
    stop_report: dict[str, Any] = field(default_factory=dict)


# ============================================================================ the cycle process
def cycle_main(cfg: CycleConfig, shm_path: str, ctl: Connection, events: Connection) -> None:
    """Entry point of the cycle process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s ethercat-cycle: %(message)s")
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
    try:
        ident = master.open()
        driver = build_driver(cfg.settings, ident.protocol)
        # Everything allocated so far lives for the whole run: collect and freeze it now, while no
        # frame is due (a full collection can take tens of ms), then keep the collector out of the cycle.
        gc.collect()
        gc.freeze()
        master.to_op()
    except (MasterError, OSError, ValueError) as exc:
        st.state, st.fatal, st.error = "error", str(exc), str(exc)
        publish()
        log.error("%s", exc)
        master.close()
        shm.close()
        raise SystemExit(3) from None
    st.identity = ident.as_dict()
    st.state = "op"
    publish()
    try:
        _run(cfg, master, driver, shm, ctl, events, st, publish, stopping)
    finally:
        with contextlib.suppress(Exception):
            master.leave_op()
        master.close()
        st.state = "stopped"
        publish()
        shm.close()
        if "parent gone" in stopping:  # nobody is left to remove the shared block
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path)


def _run(cfg: CycleConfig, master: EthercatMaster, driver: PalmDriver, shm: SharedBlock, ctl: Connection,
         events: Connection, st: _CycleState, publish: Callable[[], None], stopping: list[str]) -> None:
    cnt, h_wake, h_cpu, h_rtt = shm.counters, shm.hist["wake"], shm.hist["cpu"], shm.hist["rtt"]
    h_cmd = shm.hist["command"]
    submitted: list[int] = []  # submit times of the commands applied this cycle
    wc = master.counters
    period = cfg.period_ns
    sleeper = AbsoluteSleeper()
    mono, cpu_clock, loads, dumps = time.monotonic_ns, time.thread_time_ns, pickle.loads, pickle.dumps
    cnt[C["period_ns"]] = period
    slack_check = min(SLACK_STATE_CHECK_NS, period * 2 // 5)
    snap_cost = SLACK_SNAPSHOT_NS  # decaying maximum of what a snapshot took
    status: bytes | None = None
    statuses_seen = -1
    halting = False
    check_due = cfg.state_check_every
    snapshot_due = cfg.snapshot_every
    gc.disable()
    # releases on the CLOCK_MONOTONIC grid of the period (multiples of it; for a period dividing 1 s, on
    # the full second): a phase other processes can know, e.g. a latency probe woken just before it
    deadline = (mono() // period + 2) * period
    cnt[C["started_ns"]] = deadline
    cycle = 0
    while True:
        sleeper.sleep_until(deadline)
        wake = mono()
        cpu0 = cpu_clock()
        lat = wake - deadline
        h_wake[min(lat // 1000, HIST_US)] += 1
        if lat > cnt[C["wake_ns_max"]]:
            cnt[C["wake_ns_max"]] = lat
        # ---- control messages, then the command: a demand that arrived before the tick goes out now ----
        n = 0
        while n < MAX_MSGS_PER_CYCLE and ctl.poll(0):
            n += 1
            try:
                data = ctl.recv_bytes()
                msg = loads(memoryview(data)[SUBMIT_STAMP.size :])
            except (EOFError, OSError):
                stopping.append("parent gone")
                break
            if isinstance(msg, _Stop):
                stopping.append(msg.reason)
            elif driver.apply(msg) is None:
                cnt[C["commands_applied"]] += 1
                submitted.append(SUBMIT_STAMP.unpack_from(data)[0])
            else:
                cnt[C["commands_rejected"]] += 1
        if stopping and not halting:
            driver.apply(Halt(True))
            halting = True
            st.state = "stopping"
            publish()
        # the status of the last exchange answers the command before it (the palm loads it after the
        # command arrived), so building the command here loses nothing and saves a period of latency
        command = driver.cycle(status, wake)
        # ---- the wire ----
        # a reply that would end this cycle after the next tick is not worth waiting for: the next
        # frame on time is what the palm needs (the late one is counted as lost, not as an overrun)
        ex = master.exchange(command, deadline + period - POST_EXCHANGE_NS)
        t_ex = mono()
        status = ex.status
        if submitted:  # how long the applied commands waited for their frame (the cycle's share of the latency)
            for t_sub in submitted:
                h_cmd[min((ex.sent_ns - t_sub) // 1000, HIST_US)] += 1
            submitted.clear()
        h_rtt[min(ex.rtt_ns // 1000, HIST_US)] += 1
        cycle += 1
        cnt[C["cycles"]] = cycle
        cnt[C["frames"]] = wc.frames
        cnt[C["lost"]] = wc.lost
        cnt[C["late"]] = wc.late
        cnt[C["dropped"]] = driver.c["dropped"]
        cnt[C["wkc_errors"]] = wc.wkc_errors
        cnt[C["rtt_ns_max"]] = wc.rtt_max_ns
        if status is None:
            cnt[C["no_status"]] += 1
            run = cnt[C["consecutive_no_status"]] + 1
            cnt[C["consecutive_no_status"]] = run
            if run > cnt[C["max_consecutive_no_status"]]:
                cnt[C["max_consecutive_no_status"]] = run
            if run == cfg.error_after:
                cnt[C["health_error"]] = 1
                st.error = f"no valid status for {run} cycles (lost {wc.lost}, WKC errors {wc.wkc_errors})"
                publish()
        elif cnt[C["consecutive_no_status"]]:
            cnt[C["consecutive_no_status"]] = 0
            if cnt[C["health_error"]]:
                cnt[C["health_error"]] = 0
                st.error = ""
                publish()
        if status is not None and driver.c["statuses"] != statuses_seen:
            # every valid status goes to the MQTT side raw (a few µs); it decodes joints there, so the
            # costly full driver snapshot can run at a fraction of the rate
            statuses_seen = driver.c["statuses"]
            shm.write_slot("raw", RAW_HEAD.pack(driver.cycle_no, wake, statuses_seen) + status)
        if halting and driver.c["halt_zero_cycles"] >= cfg.zero_cycles:  # that many zero commands exchanged
            st.stop_report = {"zero_demand_cycles": driver.c["halt_zero_cycles"],
                              "demands_sent_last": [m.demand_sent for m in driver.motors],
                              "reason": stopping[0]}
            shm.write_slot("snapshot", dumps(_lean_snapshot(driver), 5))
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
        if (check_due <= 0 or recheck) and deadline + period - mono() > slack_check:
            check_due = cfg.state_check_every
            slack_work = True
            cnt[C["state_checks"]] += 1
            # never past the period: a slave that stopped answering must not stall the cycle for SOEM's
            # 2 ms per datagram (the reads that do not fit count as no evidence, not as a problem)
            issue = master.check_states(deadline + period - CHECK_RESERVE_NS)
            cnt[C["recoveries"]] = wc.recoveries
            cnt[C["left_op"]] = wc.left_op
            cnt[C["in_op"]] = 0 if issue else 1
            if issue != st.state_issue:
                st.state_issue = issue
                st.state = "recovering" if issue else ("stopping" if halting else "op")
                publish()
        left = deadline + period - mono()
        # start a snapshot only in 2x what recent ones took (a slowly decaying maximum: one took 2x its
        # usual on this VM); after another snapshot interval of refusals, anyway
        fits = left > min(snap_cost * 2, period * 4 // 5)
        if snapshot_due <= 0 and (fits or snapshot_due < -cfg.snapshot_every):
            snapshot_due = cfg.snapshot_every
            slack_work = True
            t_snap = mono()
            shm.write_slot("snapshot", dumps(_lean_snapshot(driver), 5))
            snap_cost = max(snap_cost * 31 // 32, mono() - t_snap, SLACK_SNAPSHOT_NS // 2)
            cnt[C["snapshots"]] += 1
        cpu = cpu_clock() - cpu0
        h_cpu[min(cpu // 1000, HIST_US)] += 1
        cnt[C["cpu_ns_sum"]] += cpu
        if cpu > cnt[C["cpu_ns_max"]]:
            cnt[C["cpu_ns_max"]] = cpu
        now = mono()
        cnt[C["heartbeat_ns"]] = now
        release = deadline
        deadline, skipped = next_deadline(deadline, wake, now, period)
        if skipped:
            # what the cycle was doing, µs after its release (a fixed-size record written in place)
            shm.put_overrun(int(cnt[C["overruns"]]), release, lat // 1000, (ex.sent_ns - release) // 1000,
                            (t_ex - release) // 1000, (now - release) // 1000, skipped, ex.lost, slack_work)
            cnt[C["overruns"]] += 1
            cnt[C["skipped_cycles"]] += skipped
            if lat >= period:
                cnt[C["overrun_late_wake"]] += 1
            if ex.lost:
                cnt[C["overrun_lost_frame"]] += 1
            elif ex.rtt_ns > period // 2:
                cnt[C["overrun_slow_exchange"]] += 1
            if slack_work:
                cnt[C["overrun_slack_work"]] += 1
        elif now > deadline:
            cnt[C["late_starts"]] += 1  # ran past the next release: it starts now, late (its latency is in "wake")
        elif cycle % 1000 == 0 and deadline - mono() > period // 2:
            gc.collect(0)  # young objects only, and only with half a period of slack left


def _lean_snapshot(driver: PalmDriver) -> PalmSnapshot:
    """driver.snapshot() without the joint calibration, which is 40 % of its cost: the MQTT side decodes
    joints from the raw status of every cycle anyway (`ProcessBackend._merge`)."""
    sensors = driver.last_sensor_data
    driver.last_sensor_data = None
    try:
        return driver.snapshot()
    finally:
        driver.last_sensor_data = sensors


def _send_events(events: Connection, rx: list[CanRxFrame], cnt: Any) -> None:
    for i in range(0, len(rx), CAN_RX_CHUNK):
        try:
            events.send_bytes(pickle.dumps(rx[i : i + CAN_RX_CHUNK], 5))
        except BlockingIOError:
            cnt[C["events_dropped"]] += 1  # the MQTT side is not reading: frames are dropped, not queued
            break


# ============================================================================ the MQTT side
class ProcessBackend(HandBackend):
    """HandBackend whose cycle runs in its own realtime process against pysoem (virtual hand or NIC)."""

    def __init__(self, settings: EthercatSettings, start_timeout_s: float = 30.0) -> None:
        self.settings = settings if isinstance(settings, WireSettings) else WireSettings(**settings.model_dump())
        s = self.settings
        self.start_timeout_s = start_timeout_s
        self.period_ns = s.ethercat_period_us * 1000
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm: SharedBlock | None = None
        self._ctl_w: Connection | None = None
        self._events_r: Connection | None = None
        self._lock = threading.Lock()
        self._snap_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state_seq = 0
        self._state = _CycleState()
        self._snap: PalmSnapshot | None = None
        self._snap_seq = 0
        self._merged: PalmSnapshot | None = None
        self._raw_seq: tuple[int, int] = (0, 0)
        self._cal = HandCalibration.load(self.settings.ethercat_calibration)
        self._rx_handler: CanRxHandler | None = None
        self._threads: list[threading.Thread] = []
        self._running = False
        self._stopped = False
        self._window: dict[str, Any] = {}
        self._win_prev: tuple[int, dict[str, int], Any] | None = None
        self._netns: Any = None
        self.dropped_submits = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def _master_config(self) -> MasterConfig:
        s = self.settings
        iface, netns = s.ethercat_ifname, s.ethercat_netns or None
        if s.backend == "virtual" and not iface:
            from services.ethercat_loop.netns import VethNetns  # late: only this path needs ip/netns

            ns = VethNetns(f"rbec{os.getpid()}")
            try:
                ns.up()
                # the hand answers frames a little below the cycle's priority: it must not starve either
                hand_rt = ["--rt-priority", str(max(1, s.ethercat_rt_priority - 10))] if s.ethercat_rt_priority else []
                ns.start_hand(s.ethercat_protocol, ["--serial", str(s.ethercat_serial), *hand_rt,
                                                    *s.ethercat_virtual_args])
            except Exception as exc:
                ns.down()
                raise BackendUnavailable(f"cannot start the virtual EtherCAT hand (needs root, iproute2): {exc}") \
                    from exc
            self._netns = ns
            iface, netns = ns.master_if, ns.name
        if not iface:
            raise BackendUnavailable(f"backend {s.backend!r} needs ROBOBUS_ETHERCAT_IFNAME (the EtherCAT NIC)")
        return MasterConfig(iface, netns, None, s.ethercat_recv_timeout_us, s.ethercat_late_us, s.ethercat_program_sms)

    def start(self) -> None:
        if self._proc is not None:
            return
        try:
            self._start()
        except BaseException:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(5)
            self._teardown()
            raise

    def _start(self) -> None:
        # In this (MQTT) process a demand hops paho's thread -> a handler -> submit(); each hop waits for
        # the GIL, up to the switch interval (5 ms by default) while the state publisher decodes joints.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        s = self.settings
        period_ms = self.period_ns / 1e6
        cfg = CycleConfig(
            s, self._master_config(), RtSettings(s.ethercat_rt_priority, tuple(s.ethercat_cpus),
                                                 s.ethercat_lock_memory),
            self.period_ns, max(1, round(1000 / period_ms / s.ethercat_snapshot_hz)),
            max(1, round(s.ethercat_state_check_ms / period_ms)), s.ethercat_error_after_lost)
        self._shm = SharedBlock.create()
        # A fresh interpreter (not fork: no paho threads or held locks inherited; not multiprocessing
        # spawn: no re-import of the caller's __main__): `python -m services.ethercat_loop.cycle`.
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.ethercat_loop.cycle", str(ctl_r), str(ev_w), self._shm.path],
                stdin=subprocess.PIPE, pass_fds=(ctl_r, ev_w), cwd=REPO,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                               os.environ.get("PYTHONPATH")]))})
        finally:
            os.close(ctl_r)
            os.close(ev_w)
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(cfg, 5))
        self._proc.stdin.close()
        self._ctl_w, self._events_r = Connection(ctl_w, readable=False), Connection(ev_r, writable=False)
        os.set_blocking(ctl_w, False)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._poll_state()
            if self._state.state == "op":
                break
            if self._state.fatal or self._proc.poll() is not None:
                if self._proc.poll() is None:
                    self._proc.wait(5)
                raise BackendUnavailable(self._state.fatal
                                         or f"cycle process exited ({self._proc.returncode}) before OP")
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"cycle process did not reach OP within {self.start_timeout_s}s")
            time.sleep(0.02)
        self._running = True
        for target, name in ((self._monitor, "ethercat-monitor"), (self._pump_events, "ethercat-events")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        ident = self._state.identity
        log.info("EtherCAT cycle process %d: palm %s protocol %s serial %s, %s; %s", self._proc.pid,
                 ident.get("palm_name"), ident.get("protocol"), ident.get("serial"), self._state.policy,
                 "; ".join(self._state.warnings) or "realtime settings applied")

    def stop(self) -> None:
        if self._stopped or self._proc is None:
            return
        self._stopped = True
        self._send(_Stop("stop"), force=True)
        try:
            self._proc.wait(max(3.0, 3 * STOP_ZERO_CYCLES * self.period_ns / 1e9))
        except subprocess.TimeoutExpired:
            log.error("cycle process did not stop in time: killing it")
            self._proc.kill()
            self._proc.wait(5)
        self._poll_state()
        self._running = False
        self._teardown()

    def _teardown(self) -> None:
        for t in self._threads:
            t.join(1.0)
        for conn in (self._ctl_w, self._events_r):
            if conn is not None:
                conn.close()
        self._ctl_w = self._events_r = None
        if self._shm is not None:
            with self._snap_lock:
                self._read_snapshot()
                self._shm.close()
            self._shm = None
        if self._netns is not None:
            self._netns.down()
            self._netns = None

    def stop_report(self) -> dict[str, Any]:
        return dict(self._state.stop_report)

    # ---- messages -------------------------------------------------------------------------
    def submit(self, msg: ControlMessage) -> None:
        if isinstance(msg, CanTx) and len(msg.frames) > CAN_RX_CHUNK:
            for i in range(0, len(msg.frames), CAN_RX_CHUNK):
                self._send(CanTx(msg.frames[i : i + CAN_RX_CHUNK]))
            return
        self._send(msg)

    def _send(self, msg: object, force: bool = False) -> None:
        data = SUBMIT_STAMP.pack(time.monotonic_ns()) + pickle.dumps(msg, 5)
        with self._lock:
            conn = self._ctl_w
            if conn is None:
                return
            try:
                if force or len(data) > PIPE_ATOMIC - 8:
                    os.set_blocking(conn.fileno(), True)  # rare: must arrive whole
                    try:
                        conn.send_bytes(data)
                    finally:
                        os.set_blocking(conn.fileno(), False)
                else:
                    conn.send_bytes(data)
            except BlockingIOError:
                self.dropped_submits += 1  # the cycle is not draining: never block the MQTT side on it
                log.warning("control pipe full: dropped %s", type(msg).__name__)
            except (BrokenPipeError, OSError):
                self.dropped_submits += 1

    # ---- views ----------------------------------------------------------------------------
    def _poll_state(self) -> None:
        with self._state_lock:  # the monitor thread and info() callers: log each change once
            self._poll_state_locked()

    def _poll_state_locked(self) -> None:
        shm = self._shm
        got = shm.read_slot("status") if shm is not None and shm.seq("status") != self._state_seq else None
        if got is not None and got[0] != self._state_seq:
            self._state_seq = got[0]
            new: _CycleState = pickle.loads(got[1])
            old = self._state
            if new.state_issue != old.state_issue:
                if new.state_issue:
                    log.warning("EtherCAT: %s; recovering", new.state_issue)
                else:
                    log.info("EtherCAT: all slaves back in OP")
            if new.error != old.error and new.error:
                log.error("EtherCAT: %s", new.error)
            self._state = new

    def _read_snapshot(self) -> PalmSnapshot | None:
        shm = self._shm
        if shm is None:
            return self._merged or self._snap
        # peek at the sequences first: most calls find nothing new and copy nothing
        got = shm.read_slot("snapshot") if shm.seq("snapshot") != self._snap_seq else None
        if got is not None and got[0] != self._snap_seq:
            self._snap_seq = got[0]
            self._snap = pickle.loads(got[1])
            self._merged = None
        raw = shm.read_slot("raw") if (shm.seq("raw"), self._snap_seq) != self._raw_seq else None
        if self._snap is not None and raw is not None and (raw[0], self._snap_seq) != self._raw_seq:
            self._raw_seq = (raw[0], self._snap_seq)
            self._merged = self._merge(self._snap, raw[1])
        return self._merged or self._snap

    def _merge(self, base: PalmSnapshot, raw: bytes) -> PalmSnapshot | None:
        """The last full snapshot refreshed with the newest status: what driver.snapshot() would say about
        sensors, joints, tactiles, IMU and analog inputs (decoded here, off the realtime process). Every
        accepted status is written raw, so the raw slot always holds the driver's latest status."""
        cycle, now_ns, statuses = RAW_HEAD.unpack_from(raw)
        st = unpack_status(raw[RAW_HEAD.size :], base.protocol)
        if isinstance(st, DecodeError) or st.dropped:
            return None
        joints = base.joints
        if st.edc_command == EdcCommand.SENSOR_DATA:
            joints = tuple(PalmJointSnapshot(j.name, j.position, j.raw) for j in self._cal.joints(st.sensors))
        sensors = st.sensors
        if cycle < base.cycle:
            cycle, now_ns, statuses = base.cycle, base.now_ns, base.status_count
        return dataclasses.replace(
            base, cycle=cycle, now_ns=now_ns, edc_echo=st.edc_command, status_count=statuses, joints=joints,
            sensors_raw=sensors, tactile_type=st.tactile_data_type, tactile_valid=st.tactile_data_valid,
            tactile=st.tactile, imu=tuple(s16(v) for v in sensors[26:32]), analog=tuple(sensors[32:36]),
            idle_time_us=st.idle_time_us)

    def snapshot(self) -> PalmSnapshot | None:
        with self._snap_lock:  # not the submit lock: decoding must never delay a demand
            return self._read_snapshot()

    def _monitor(self) -> None:
        while self._running:
            self._poll_state()
            self._roll_window()
            if self._proc is not None and self._proc.poll() is not None and not self._stopped:
                self._state.state, self._state.error = "error", f"cycle process died ({self._proc.returncode})"
                log.error("EtherCAT: %s", self._state.error)
                self._running = False
                return
            time.sleep(0.05)

    def _roll_window(self) -> None:
        shm = self._shm
        if shm is None:
            return
        now = time.monotonic_ns()
        if self._win_prev is not None and now - self._win_prev[0] < 1_000_000_000:
            return
        counters, wake = shm.counters_dict(), shm.hist["wake"].copy()
        if self._win_prev is not None:
            t0, c0, w0 = self._win_prev
            dc = {k: counters[k] - c0[k] for k in ("cycles", "overruns", "lost", "no_status", "wkc_errors", "late",
                                                   "dropped")}
            p = percentiles(wake - w0)
            secs = (now - t0) / 1e9
            self._window = {
                "period_us": round(secs * 1e6 / dc["cycles"], 3) if dc["cycles"] else 0.0,
                "target_period_us": self.period_ns / 1000.0, "cycles": dc["cycles"],
                "jitter_p50_us": p["p50"] or 0.0, "jitter_p99_us": p["p99"] or 0.0,
                "jitter_max_us": p["max"] or 0.0, "overruns": dc["overruns"], "drops": dc["dropped"],
                "frames_lost": dc["lost"], "decode_errors": 0, "window_s": round(secs, 3),
                "total_cycles": counters["cycles"], "total_overruns": counters["overruns"],
                "late_frames": dc["late"], "wkc_errors": dc["wkc_errors"], "no_status": dc["no_status"],
            }
        self._win_prev = (now, counters, wake)

    def stats(self) -> dict[str, Any]:
        """The last full 1 s window (LoopStatsWindow keys) plus totals since start."""
        shm = self._shm
        out: dict[str, Any] = dict(self._window)
        if shm is None:
            return out
        c = shm.counters_dict()
        cycles = max(1, c["cycles"])
        out["totals"] = {
            **{k: c[k] for k in ("cycles", "overruns", "skipped_cycles", "frames", "lost", "late", "wkc_errors",
                                 "no_status", "dropped", "recoveries", "left_op", "max_consecutive_no_status",
                                 "commands_applied", "commands_rejected", "state_checks", "events_dropped",
                                 "overrun_late_wake", "overrun_slow_exchange", "overrun_lost_frame",
                                 "overrun_slack_work", "late_starts")},
            "wake_us": percentiles(shm.hist["wake"]), "cpu_us": percentiles(shm.hist["cpu"]),
            "wake_over_period": int(shm.hist["wake"][self.period_ns // 1000 :].sum()),
            "rtt_us": percentiles(shm.hist["rtt"]), "command_us": percentiles(shm.hist["command"]),
            **self._overrun_view(),
            "cpu_mean_us": round(c["cpu_ns_sum"] / cycles / 1000, 1),
            "cpu_max_us": c["cpu_ns_max"] / 1000, "wake_max_us": c["wake_ns_max"] / 1000,
            "dropped_submits": self.dropped_submits,
        }
        out["realtime"] = {"policy": self._state.policy, "warnings": list(self._state.warnings)}
        out["health_error"] = bool(c["health_error"])
        out["state_issue"] = self._state.state_issue
        return out

    def _overrun_view(self) -> dict[str, Any]:
        """The kept overrun records (cycle_shm.OVERRUN_FIELDS: release in CLOCK_MONOTONIC ns, then µs after
        it the wake-up, frame sent, exchange done and end; periods skipped; lost frame; slack work)."""
        recent = self._shm.overruns() if self._shm is not None else []
        return {"recent_overruns": recent[-OVERRUNS_SHOWN:], "overrun_releases_ns": [o["release_ns"] for o in recent]}

    def histograms(self) -> dict[str, Any]:
        """Raw 1 µs histograms (wake, cpu, rtt) for the benchmark."""
        shm = self._shm
        return {k: v.copy() for k, v in shm.hist.items()} if shm is not None else {}

    def info(self) -> dict[str, Any]:
        self._poll_state()
        st = self._state
        ident = st.identity
        return {"vendor": ident.get("vendor"), "product": ident.get("product"), "revision": ident.get("revision"),
                "serial": ident.get("serial"), "protocol": ident.get("protocol", self.settings.ethercat_protocol),
                "backend": self.settings.backend, "connected": self._running and st.state in ("op", "stopping")
                and not st.state_issue, "state": st.state, "error": st.error or st.fatal,
                "warnings": list(st.warnings), "mapping": ident.get("mapping"), "slaves": ident.get("slaves"),
                "realtime_policy": st.policy, "state_issue": st.state_issue}

    def on_can_rx(self, handler: CanRxHandler) -> None:
        self._rx_handler = handler

    def connected(self) -> bool:
        """info()["connected"] from the state the monitor thread reads every 50 ms: no shared-memory read
        or unpickling on a command's path."""
        st = self._state
        return self._running and st.state in ("op", "stopping") and not st.state_issue

    def _pump_events(self) -> None:
        conn = self._events_r
        while self._running and conn is not None:
            try:
                if not conn.poll(0.2):
                    continue
                frames: list[CanRxFrame] = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if self._rx_handler is not None:
                try:
                    self._rx_handler(frames)
                except Exception:
                    log.exception("CAN rx handler failed")


def _child_entry(argv: list[str]) -> None:
    """`python -m services.ethercat_loop.cycle CTL_FD EVENTS_FD SHM_PATH`, the config pickled on stdin."""
    cfg: CycleConfig = pickle.loads(sys.stdin.buffer.read())
    cycle_main(cfg, argv[2], Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


if __name__ == "__main__":
    # run the copy imported under its package name, so pickled classes resolve in both processes
    from services.ethercat_loop import cycle as _cycle

    _cycle._child_entry(sys.argv[1:])
