"""ProcessBackend: the MQTT process's side of the realtime cycle. It starts the cycle process
(`python -m services.ethercat_loop.transport.cycle`), hands it control messages through a pipe, and
reads its state, snapshots, counters and histograms from shared memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from services.ethercat_loop.backend import (
    STOP_ZERO_CYCLES,
    BackendHooks,
    BackendUnavailable,
    CanRxHandler,
    HandBackend,
    LinkEvents,
)
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import CanRxFrame, CanTx, ControlMessage
from services.ethercat_loop.loop_stats import LoopWindow, percentiles
from services.ethercat_loop.models import EthercatLoopStats
from services.ethercat_loop.protocol import DecodeError, unpack_status
from services.ethercat_loop.settings import EthercatSettings, link_policy
from services.ethercat_loop.snapshot import PalmSnapshot, status_fields
from services.ethercat_loop.transport.cycle import (
    CAN_RX_CHUNK,
    LOST_EXIT,
    CycleConfig,
    _CycleState,
    _Stop,
    submit_frame,
)
from services.ethercat_loop.transport.master import MasterConfig, RecoveryPolicy
from services.ethercat_loop.transport.realtime import RtSettings, current_policy, process_fifo
from services.ethercat_loop.transport.shm import RAW_HEAD, C, SharedBlock
from shared.link import SupervisedLink

log = logging.getLogger("robobus.ethercat")
PIPE_ATOMIC = 4096
OVERRUNS_SHOWN = 8  # overrun records in loop_stats (all kept ones: their release times)
SWITCH_INTERVAL_S = 0.0005
REPO = Path(__file__).resolve().parents[3]
# at start: (interface, network namespace or None, teardown run after the cycle process is gone)
NicProvider = Callable[[], tuple[str, str | None, Callable[[], None]]]


class ProcessBackend(HandBackend):
    """HandBackend whose cycle runs in its own realtime process against pysoem (virtual hand or NIC)."""

    def __init__(self, settings: EthercatSettings, calibration: HandCalibration | None = None,
                 start_timeout_s: float = 30.0, nic: NicProvider | None = None) -> None:
        self.settings = settings
        self.nic = nic  # brings up the NIC at start (e.g. a simulated hand on a veth pair); None: settings name it
        s = self.settings
        self.start_timeout_s = start_timeout_s  # a cycle process not in OP by then is a failed attempt
        self.start_delays: list[float] = []  # tests: each start of a cycle process takes the first (a late start)
        self.period_ns = s.ethercat_period_us * 1000
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm: SharedBlock | None = None
        self._ctl_w: Connection | None = None
        self._events_r: Connection | None = None
        self._lock = threading.Lock()
        self._snap_lock = threading.Lock()
        # the shared memory is closed under this lock (and the two above): every other reader of it holds one of
        # them, so no thread (a handler on paho's thread, the publisher, the node's deadline thread) reads it closed
        self._shm_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state_seq = 0
        self._state = _CycleState()
        # what recovery did in the cycle processes that ended (a re-scan that found no NIC, a death): the next one
        # starts with none, and health must still say why the link was lost while the palm is probed for
        self._ended_recovery: dict[str, Any] | None = None
        self._snap: PalmSnapshot | None = None
        self._snap_seq = 0
        self._merged: PalmSnapshot | None = None
        self._raw_seq: tuple[int, int] = (0, 0)
        self._cal = calibration or HandCalibration.load(settings.ethercat_calibration)
        self._rx_handler: CanRxHandler | None = None
        self._threads: list[threading.Thread] = []
        self._running = False
        self._stopped = False
        self._window = LoopWindow(self.period_ns)
        self.cleanups: list[Callable[[], None]] = []  # run after the cycle process is gone (e.g. a simulated NIC)
        self.dropped_submits = 0
        self.bad_raw_reads = 0  # raw status slots too short to hold a status (skipped, see _read_snapshot)
        # supervision: a cycle process that dies is started again (capped backoff, reset after a good run)
        self._cfg: CycleConfig | None = None  # built once: the NIC provider (a simulated hand) runs once
        self._stop_ev = threading.Event()
        self._restarting = ""  # why the cycle is being restarted ("" while it runs)
        self._failures = 0  # restarts since the last good run (the backoff's exponent)
        self._up_since: float | None = None  # CLOCK_MONOTONIC s when the running cycle process reached OP
        self.restarts = 0  # cycle processes started after one died
        self.last_exit = ""  # how the last one died
        # the link's events go to the kit's supervisor: the service's (attach_link), or, for a backend driven on
        # its own (tests, the bench), a private one, whose back-off paces the reconnects all the same
        self.link: LinkEvents = SupervisedLink(link_policy(settings), lambda _fields: None)
        self._own_link = True  # start() blocks until OP and raises, as a caller without a link expects
        self._mqtt_warnings: list[str] = []  # what the MQTT process was refused (ethercat_mqtt_rt_priority)
        self._mqtt_policy = ""

    def attach_link(self, link: LinkEvents) -> None:
        self.link = link
        self._own_link = False

    # ---- lifecycle ------------------------------------------------------------------------
    def _master_config(self) -> MasterConfig:
        s = self.settings
        iface, netns = s.ethercat_ifname, s.ethercat_netns or None
        if self.nic is not None:
            iface, netns, teardown = self.nic()
            self.cleanups.append(teardown)
        if not iface:
            raise BackendUnavailable(f"backend {s.backend!r} needs ROBOBUS_ETHERCAT_IFNAME (the EtherCAT NIC)")
        return MasterConfig(iface, netns, s.ethercat_expect_protocol or None, s.ethercat_recv_timeout_us,
                            s.ethercat_late_us, s.ethercat_program_sms,
                            recovery=RecoveryPolicy(outage_cycles=s.ethercat_error_after_lost))

    def start(self) -> None:
        if self._shm is not None:
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
        # the receive path at a realtime priority below the cycle's (README "Priorities on a busy host")
        mqtt_prio = s.ethercat_mqtt_rt_priority
        if s.ethercat_rt_priority and mqtt_prio >= s.ethercat_rt_priority:
            mqtt_prio = s.ethercat_rt_priority - 1
        self._mqtt_warnings = process_fifo(mqtt_prio)
        for w in self._mqtt_warnings:
            log.warning("%s", w)
        self._mqtt_policy = current_policy()
        period_ms = self.period_ns / 1e6
        self._cfg = CycleConfig(
            s, self._cal, self._master_config(), RtSettings(s.ethercat_rt_priority, tuple(s.ethercat_cpus),
                                                 s.ethercat_lock_memory),
            self.period_ns, max(1, round(1000 / period_ms / s.ethercat_snapshot_hz)),
            max(1, round(s.ethercat_state_check_ms / period_ms)), s.ethercat_error_after_lost)
        self._shm = SharedBlock.create()
        self._running = True
        launched = False
        if self._own_link:  # no supervisor to report to: the caller wants the palm in OP, or an exception
            self.link.attempt()
            self._launch(None)
            self._up_since = time.monotonic()
            self.link.opened()
            self._log_in_op()
            launched = True
        t = threading.Thread(target=self._keep, args=(launched,), name="ethercat-monitor", daemon=True)
        t.start()
        self._threads.append(t)

    def _log_in_op(self) -> None:
        ident = self._state.identity
        assert self._proc is not None
        log.info("EtherCAT cycle process %d: palm %s protocol %s serial %s, %s; %s", self._proc.pid,
                 ident.get("palm_name"), ident.get("protocol"), ident.get("serial"), self._state.policy,
                 "; ".join(self._state.warnings) or "realtime settings applied")

    def _launch(self, stop: threading.Event | None) -> None:
        """Start a cycle process on the shared block and wait until it is in OP; then hand it the control
        pipe (no message reaches a cycle before it is in OP: its driver starts with every demand at zero, so
        after a restart the first frames carry zero demands). Raises BackendUnavailable (the process gone)."""
        shm, cfg = self._shm, self._cfg
        assert shm is not None and cfg is not None
        # A killed writer can leave a slot mid-write (an odd sequence, which readers would wait out forever):
        # even again, and the start state and the counters the new cycle starts from (it continues the others).
        shm.repair_slots()
        with self._snap_lock:  # the last process's driver is not the next one's (which starts in its init phase)
            self._snap = self._merged = None
            self._snap_seq = shm.seq("snapshot")
            self._raw_seq = (shm.seq("raw"), self._snap_seq)
        old = self._state  # the hand's identity stays in health while another cycle process starts
        if old.recovery and old.recovery.get("steps"):
            self._ended_recovery = dict(old.recovery)
        shm.write_slot("status", pickle.dumps(_CycleState(identity=dict(old.identity), policy=old.policy,
                                                          warnings=list(old.warnings)), 5))
        for k in ("submits", "consecutive_no_status", "health_error", "in_op"):
            shm.counters_mv[C[k]] = 0
        # A fresh interpreter (not fork: no paho threads or held locks inherited; not multiprocessing
        # spawn: no re-import of the caller's __main__): `python -m services.ethercat_loop.transport.cycle`.
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.ethercat_loop.transport.cycle", str(ctl_r), str(ev_w), str(shm.fd)],
                stdin=subprocess.PIPE, pass_fds=(ctl_r, ev_w, shm.fd), cwd=REPO,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                               os.environ.get("PYTHONPATH")]))})
        except BaseException:
            for fd in (ctl_w, ev_r):
                os.close(fd)
            raise
        finally:
            os.close(ctl_r)
            os.close(ev_w)
        self._proc = proc
        ctl, events = Connection(ctl_w, readable=False), Connection(ev_r, writable=False)
        os.set_blocking(ctl_w, False)
        try:
            assert proc.stdin is not None
            delay = self.start_delays.pop(0) if self.start_delays else 0.0
            proc.stdin.write(pickle.dumps(dataclasses.replace(cfg, start_delay_s=delay) if delay else cfg, 5))
            proc.stdin.close()
            deadline = time.monotonic() + self.start_timeout_s
            while True:
                self._poll_state()
                if self._state.state == "op":
                    break
                if self._state.fatal or proc.poll() is not None:
                    if proc.poll() is None:
                        proc.wait(5)
                    st = self._state
                    raise BackendUnavailable(st.fatal or f"cycle process exited ({proc.returncode}) before OP",
                                             st.fault_kind, st.garbage)
                if time.monotonic() > deadline:
                    raise BackendUnavailable(f"cycle process did not reach OP within {self.start_timeout_s}s")
                if stop is not None and stop.is_set():
                    raise BackendUnavailable("stopping")
                time.sleep(0.02)
        except BaseException:
            ctl.close()
            events.close()
            if proc.poll() is None:  # SIGTERM: it zeroes demands and leaves OP if it got there
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            raise
        with self._lock:
            self._ctl_w, self._events_r = ctl, events
        t = threading.Thread(target=self._pump_events, args=(events,), name="ethercat-events", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """In this order: the fail-safe (the cycle process zeroes every demand for STOP_ZERO_CYCLES exchanged cycles,
        leaves OP and exits), then the readers of the shared memory (the monitor, the event pump), then the shared
        memory closes. Commands that come meanwhile find the link down and the pipe closed: refused, never a
        crash."""
        if self._stopped or self._shm is None:
            return
        self._stopped = True
        self._stop_ev.set()  # no restart and no attempt from now on (one under way ends: its process stopped)
        self._halt(self._proc)
        for t in self._threads:  # the monitor: a start under way ends (its half-started process stopped)
            if t.name == "ethercat-monitor" and t is not threading.current_thread():
                t.join(10)
        self._halt(self._proc)  # a process the monitor had started just before it saw the stop
        self._poll_state()
        self._running = False
        self._teardown()

    def _halt(self, proc: subprocess.Popen[bytes] | None) -> None:
        """Zero the demands and leave OP (the cycle process does both, then exits); wait for it."""
        if proc is None or proc.poll() is not None:
            return
        if self._ctl_w is not None and proc is self._proc:
            self._send(_Stop("stop"), force=True)
        else:
            proc.terminate()  # SIGTERM: it zeroes demands and leaves OP too, if it got there
        try:
            proc.wait(max(3.0, 3 * STOP_ZERO_CYCLES * self.period_ns / 1e9))
        except subprocess.TimeoutExpired:
            log.error("cycle process did not stop in time: killing it")
            proc.kill()
            proc.wait(5)

    def _teardown(self) -> None:
        for t in self._threads:
            t.join(1.0)
        with self._lock:  # not under a submit's feet
            for conn in (self._ctl_w, self._events_r):
                if conn is not None:
                    conn.close()
            self._ctl_w = self._events_r = None
        if self._shm is not None:
            with self._lock, self._snap_lock:
                self._read_snapshot()  # the last of it, for the views that outlive the cycle
                with self._shm_lock:
                    shm, self._shm = self._shm, None
                    if shm is not None:
                        shm.close()
        while self.cleanups:
            self.cleanups.pop()()

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
        data = submit_frame(msg, time.monotonic_ns())
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
                shm = self._shm
                if shm is not None:  # after the write: the cycle reads the pipe only when this count moved
                    shm.counters_mv[C["submits"]] += 1
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
        with self._shm_lock:
            shm = self._shm
            got = shm.read_slot("status") if shm is not None and shm.seq("status") != self._state_seq else None
        if got is not None and got[0] != self._state_seq:
            self._state_seq = got[0]
            new: _CycleState = pickle.loads(got[1])
            old = self._state
            if new.state_issue != old.state_issue:
                if new.state_issue:
                    log.warning("EtherCAT: %s", new.state_issue)
                else:
                    log.info("EtherCAT: every slave in OP, process data valid")
            seen = int(old.recovery.get("seq", 0)) if old.recovery else 0
            steps = new.recovery.get("steps", []) if new.recovery else []
            fresh = int(new.recovery.get("seq", 0)) - seen if new.recovery else 0
            for _t, text in steps[-fresh:] if fresh > 0 else []:  # every recovery step, once
                log.warning("EtherCAT recovery: %s", text)
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
        if raw is not None and len(raw[1]) < RAW_HEAD.size:
            # Seen once in a benchmark (an empty payload under an even sequence, cause not found): a slot
            # that cannot hold a status is skipped and counted, the last good snapshot stands.
            self.bad_raw_reads += 1
            log.warning("EtherCAT: raw status slot of %d bytes skipped (%d so far)", len(raw[1]), self.bad_raw_reads)
            raw = None
        if self._snap is not None and raw is not None and (raw[0], self._snap_seq) != self._raw_seq:
            self._raw_seq = (raw[0], self._snap_seq)
            self._merged = self._merge(self._snap, raw[1])
        return self._merged or self._snap

    def _merge(self, base: PalmSnapshot, raw: bytes) -> PalmSnapshot | None:
        """The last full snapshot refreshed with the newest status (decoded here, off the realtime process,
        by the same `status_fields` the driver's own snapshot uses). Every accepted status is written raw,
        so the raw slot always holds the driver's latest status."""
        cycle, now_ns, statuses = RAW_HEAD.unpack_from(raw)
        st = unpack_status(raw[RAW_HEAD.size :], base.protocol)
        if isinstance(st, DecodeError) or st.dropped:
            return None
        if cycle < base.cycle:
            cycle, now_ns, statuses = base.cycle, base.now_ns, base.status_count
        return dataclasses.replace(base, cycle=cycle, now_ns=now_ns, status_count=statuses,
                                   **status_fields(st, self._cal, base.joints))

    def snapshot(self, motors: bool = True) -> PalmSnapshot | None:
        # the motors come with the cycle's lean snapshot (10 Hz) at no extra cost here: always included
        with self._snap_lock:  # not the submit lock: decoding must never delay a demand
            return self._read_snapshot()

    # ---- the link: (re)connecting, supervising the cycle process --------------------------------------
    def _keep(self, launched: bool) -> None:
        """The one loop that keeps a cycle process in OP. Bring-up attempts follow the link supervisor's back-off
        (and, once the palm is unreachable, its probe period); each attempt is a cycle process that opens the
        NIC, scans the bus and brings the palm to OP, and its failure is reported to the link by kind (absent,
        garbage, wrong kind; counted, never an error but for the wrong kind). A cycle process that ends because
        its re-scan found no palm (`LOST_EXIT`) is a lost link: reconnect the same way. One that dies of anything
        else (a bug, the OOM killer, kill -9) is restarted on its own back-off (`ethercat_restart_backoff_ms`,
        doubled per restart without a good run, capped), the link `recovering` meanwhile."""
        dead = ""  # why the last cycle process died: the next start is a restart
        while not self._stop_ev.is_set():
            if not launched:
                if not self._attempt(dead):
                    if self._restarting:  # a restart that failed for another reason than the palm: again
                        dead = self.last_exit
                        continue
                    dead = ""
                    continue
                dead = ""
            launched = False
            proc = self._proc
            assert proc is not None
            while proc.poll() is None and not self._stop_ev.is_set():
                self._poll_state()
                self._stop_ev.wait(0.05)
            if self._stop_ev.is_set() or self._stopped:
                return
            self._poll_state()
            with self._lock:
                for conn in (self._ctl_w, self._events_r):
                    if conn is not None:
                        conn.close()
                self._ctl_w = self._events_r = None
            st = self._state
            if proc.returncode == LOST_EXIT:
                log.error("EtherCAT: %s; reconnecting", st.fatal or "bus lost")
                self._report_failure(BackendUnavailable(st.fatal or "bus lost", st.fault_kind, st.garbage),
                                     closed=True)
                continue
            dead = _exit_text(proc.returncode)
            self.last_exit = dead
            now = time.monotonic()
            if self._up_since is not None and now - self._up_since >= self.settings.ethercat_restart_good_run_s:
                self._failures = 0
            self._up_since = None
            log.error("EtherCAT: cycle process %d died (%s)", proc.pid, dead)

    def _attempt(self, dead: str) -> bool:
        """One start of a cycle process: a restart after `dead` (its own back-off), or a bring-up attempt (the
        link's). True when it is in OP."""
        s = self.settings
        if dead:
            delay = min(s.ethercat_restart_backoff_max_ms, s.ethercat_restart_backoff_ms * 2 ** self._failures) / 1000
            self._failures += 1
            self._restarting = f"cycle process died ({dead}); restarting in {delay:.1f} s"
            log.warning("EtherCAT: %s", self._restarting)
            self.link.recovering(self._restarting)
        else:
            delay = self.link.next_attempt_in()
        if self._stop_ev.wait(delay):
            return False
        if dead:
            self.restarts += 1
            self._restarting = f"cycle process died ({dead}); restart {self.restarts} under way"
        else:
            self.link.attempt()
        try:
            self._launch(self._stop_ev)
        except (BackendUnavailable, OSError) as exc:
            if self._stop_ev.is_set():
                return False
            kind = exc.kind if isinstance(exc, BackendUnavailable) else ""
            if dead and not kind:  # the process itself would not start: retried on the restart back-off
                self.last_exit = f"restart {self.restarts} failed: {exc}"
                log.error("EtherCAT: %s", self.last_exit)
                return False
            if dead:  # no palm to restart on: from here on, a link to bring up again
                self._restarting = ""
                self.link.recovered()
            self._report_failure(exc if isinstance(exc, BackendUnavailable) else BackendUnavailable(str(exc)))
            return False
        self._up_since = time.monotonic()
        self._restarting = ""
        self.link.clear_fault()
        if dead:
            self.link.recovered()
            assert self._proc is not None
            log.warning("EtherCAT: cycle process %d in OP (restart %d); demands start from zero", self._proc.pid,
                        self.restarts)
        else:
            self._log_in_op()
        self.link.opened()
        return True

    def _report_failure(self, exc: BackendUnavailable, closed: bool = False) -> None:
        """A bring-up that failed, or a bus that was lost, by kind: counted by the link, an error only for a
        device of the wrong kind."""
        why = str(exc)
        if exc.kind == "garbage":
            self.link.garbage(f"{exc.garbage} frames on the NIC, none a slave's answer")
        if exc.kind == "wrong_kind":
            self.link.fault(f"not the palm configured: {why}")
        else:
            self.link.clear_fault()
        if closed:
            self.link.closed(why)
        else:
            self.link.failed(why)
        log.warning("EtherCAT: %s (next attempt in %.1f s)", why, self.link.next_attempt_in())

    def stats(self) -> EthercatLoopStats:
        """The last full 1 s window plus totals since start and the cycle's realtime policy."""
        with self._shm_lock:  # copies only: a demand's check of the link waits for this lock, never for numpy
            shm = self._shm
            if shm is None:
                return self._window.last
            c = shm.counters_dict()
            hist = {k: v.copy() for k, v in shm.hist.items()}
            recent = shm.overruns()
        win = self._window.roll(time.monotonic_ns(), c, hist["wake"])
        cycles = max(1, c["cycles"])
        totals = {
            **{k: c[k] for k in ("cycles", "overruns", "skipped_cycles", "frames", "lost", "stale", "late",
                                 "wkc_errors", "no_status", "dropped", "recoveries", "left_op", "escalations",
                                 "rescans", "max_consecutive_no_status",
                                 "commands_applied", "state_checks", "events_dropped",
                                 "overrun_late_wake", "overrun_slow_exchange", "overrun_lost_frame",
                                 "overrun_slack_work", "late_starts", "superseded")},
            "wake_us": percentiles(hist["wake"]), "cpu_us": percentiles(hist["cpu"]),
            "wake_over_period": int(hist["wake"][self.period_ns // 1000 :].sum()),
            "rtt_us": percentiles(hist["rtt"]), "command_us": percentiles(hist["command"]),
            **self._overrun_view(recent),
            "cpu_mean_us": round(c["cpu_ns_sum"] / cycles / 1000, 1),
            "cpu_max_us": c["cpu_ns_max"] / 1000, "wake_max_us": c["wake_ns_max"] / 1000,
            "dropped_submits": self.dropped_submits, "bad_raw_reads": self.bad_raw_reads, "restarts": self.restarts,
        }
        return win.model_copy(update={"totals": totals, "realtime": {
            "policy": self._state.policy, "mqtt_policy": self._mqtt_policy,
            "warnings": list(self._state.warnings) + self._mqtt_warnings}})

    @staticmethod
    def _overrun_view(recent: list[dict[str, int | bool]]) -> dict[str, Any]:
        """The kept overrun records (cycle_shm.OVERRUN_FIELDS: release in CLOCK_MONOTONIC ns, then µs after
        it the wake-up, frame sent, exchange done and end; periods skipped; lost frame; slack work)."""
        return {"recent_overruns": recent[-OVERRUNS_SHOWN:], "overrun_releases_ns": [o["release_ns"] for o in recent]}

    def histograms(self) -> dict[str, Any]:
        """Raw 1 µs histograms (wake, cpu, rtt) for the benchmark."""
        with self._shm_lock:
            shm = self._shm
            return {k: v.copy() for k, v in shm.hist.items()} if shm is not None else {}

    def info(self) -> dict[str, Any]:
        self._poll_state()
        st = self._state
        ident = st.identity
        # the cycle flips the flag in place: read it once, so that `connected`, `state` and `no_data` of one
        # health message agree (three reads could straddle a flip: seen once in a power-cycle test)
        no_data = self._no_data() or bool(self._restarting)
        return {"vendor": ident.get("vendor"), "product": ident.get("product"), "revision": ident.get("revision"),
                "serial": ident.get("serial"), "protocol": ident.get("protocol", self.settings.ethercat_protocol),
                "backend": self.settings.backend, "connected": self.connected(no_data),
                "state": self._link_state(no_data),
                "error": self._restarting or st.error or st.fatal, "no_data": no_data,
                "issue": self._restarting or st.state_issue, "restarts": self.restarts, "last_exit": self.last_exit,
                "recovery": self._recovery_view(st),
                "warnings": list(st.warnings) + self._mqtt_warnings,
                "mapping": ident.get("mapping"), "slaves": ident.get("slaves"), "realtime_policy": st.policy}

    def _recovery_view(self, st: _CycleState) -> dict[str, Any] | None:
        """What recovery did: the running cycle process's steps, else those of the last one that ended (until a
        new one has steps of its own); the counts are the running one's."""
        if st.recovery and st.recovery.get("steps"):
            return dict(st.recovery)
        if self._ended_recovery is not None:
            return {**(st.recovery or {}), "steps": list(self._ended_recovery["steps"])}
        return dict(st.recovery) if st.recovery else None

    def _link_state(self, no_data: bool) -> str:
        """The cycle's state, with `no_data` for a cycle in OP that exchanges no valid process data (before
        the recovery has named an issue)."""
        st = self._state.state
        if self._restarting:
            return "recovering"  # the cycle process died; another is being started
        if not self._running and st in ("op", "recovering", "rescanning"):
            return "error"  # the cycle process is gone
        return "no_data" if st == "op" and no_data else st

    def _no_data(self) -> bool:
        """No valid status for `error_after_lost` cycles in a row (the cycle sets the flag in place)."""
        with self._shm_lock:
            shm = self._shm
            return shm is not None and bool(shm.get("health_error"))

    def on_can_rx(self, handler: CanRxHandler) -> None:
        self._rx_handler = handler

    def valid_statuses(self) -> int:
        """The raw status slot's sequence: the cycle writes every valid status there (one shared-memory read)."""
        with self._shm_lock:
            shm = self._shm
            return shm.seq("raw") if shm is not None else 0

    def last_valid_status(self) -> tuple[int, float | None]:
        """The raw status slot's sequence and the cycle's own stamp of that status (CLOCK_MONOTONIC: the clock of
        time.monotonic() in every process): one consistent read of the slot's head."""
        with self._shm_lock:
            shm = self._shm
            got = shm.raw_stamp() if shm is not None else None
            seq = shm.seq("raw") if shm is not None else 0
        return (seq, None) if got is None else (got[0], got[1] / 1e9)

    def stop_sent_ns(self, seq: int) -> int | None:
        """The cycle writes the time, then the stop's number, in the cycle that sent its first frame."""
        with self._shm_lock:
            shm = self._shm
            if shm is None or shm.get("stop_seq") < seq:
                return None
            return shm.get("stop_sent_ns")

    def connected(self, no_data: bool | None = None) -> bool:
        """Valid process data are being exchanged: the cycle is in OP (by its own account, kept current by
        the monitor thread every 50 ms) and the last `error_after_lost` cycles were not all without a valid
        status. One counter read from shared memory (or the caller's); no unpickling on a command's path."""
        st = self._state
        if no_data is None:
            no_data = self._no_data()
        return self._running and not self._restarting and st.state in ("op", "stopping") and not no_data

    def _pump_events(self, conn: Connection) -> None:
        while self._running or not self._stopped:
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




def _exit_text(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def nic_backend(settings: EthercatSettings, hooks: BackendHooks) -> ProcessBackend:
    """Transport `ethercat-loop.nic` (ROBOBUS_ETHERCAT_BACKEND=nic; entry point `robobus.transports`): the realtime
    cycle process on the NIC ROBOBUS_ETHERCAT_IFNAME names (in ROBOBUS_ETHERCAT_NETNS, if set)."""
    return ProcessBackend(settings, hooks.calibration)
