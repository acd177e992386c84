"""ethercat-loop's MQTT surface: health, rate-capped state, commands and the leased CAN bridge.

Everything here runs off the cycle: handlers turn requests into driver messages (`backend.submit`),
a publisher thread turns driver snapshots into state at the configured rates.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal, cast

from services.ethercat_loop.api import (
    API,
    CAN_RX,
    CAN_TX,
    EXTRAS,
    JOINTS,
    LEASE,
    LOOP,
    MOTOR_FAULT,
    MOTORS,
    NULLIFY,
    RELEASE,
    SEND_CAN,
    SET_CONFIG,
    SET_DEMANDS,
    SET_MODE,
    STOPPED,
    SYSTEM,
    TACTILE,
    TEST_ADC,
)
from services.ethercat_loop.backend import BackendUnavailable, HandBackend
from services.ethercat_loop.bridge import BridgeLease, Lease, frame_in, frame_out
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import (
    BusStop,
    CanFrame,
    CanRxFrame,
    CanTx,
    ControlMessage,
    MotorConfig,
    NullifyDemands,
    ResetMotors,
    SetCanDirect,
    SetControlMode,
    SetDemands,
    SetMotorConfig,
    SetTestMode,
    SystemControls,
)
from services.ethercat_loop.models import (
    EthercatLoopStats,
    MotorRef,
    PalmAck,
    PalmAdcChannel,
    PalmAdcTestReply,
    PalmAdcTestRequest,
    PalmBridgeLease,
    PalmBridgeLeaseRequest,
    PalmBridgeReleaseRequest,
    PalmCanFrameIn,
    PalmCanRx,
    PalmCanTx,
    PalmControlModeRequest,
    PalmDemandsReply,
    PalmDemandsRequest,
    PalmEmpty,
    PalmExtras,
    PalmJoint,
    PalmJoints,
    PalmMotor,
    PalmMotorConfigReply,
    PalmMotorConfigRequest,
    PalmMotorFault,
    PalmMotors,
    PalmNullifyRequest,
    PalmSendCanReply,
    PalmSendCanRequest,
    PalmStopped,
    PalmSystemControlsReply,
    PalmSystemControlsRequest,
    PalmTactile,
)
from services.ethercat_loop.protocol import (
    ACTUATED_JOINTS,
    EXPECTED_CHANNELS,
    NUM_MOTORS,
    SENSOR_NAMES,
    CanDirection,
    EdcCommand,
    MotorFlag,
    SystemControl,
    config_crc,
    serious_flags,
    split_channel_word,
    split_sid,
)
from services.ethercat_loop.settings import EthercatSettings, link_policy, overrun_threshold
from services.ethercat_loop.snapshot import PalmSnapshot
from shared import CommandError, Device, ErrorCode, Node, ServiceUnavailable
from shared.device import handles, moves_when
from shared.dispatch import request_deadline
from shared.lifecycle import Hooks
from shared.link import LinkState, SupervisedLink
from shared.messages import StopState
from shared.stop import LATER
from shared.transports import TransportUnavailable, load_transport

__all__ = ["PalmService", "build", "make_backend"]  # the contract is api.py's, the settings settings.py's
log = logging.getLogger("robobus.ethercat")
SEND_CAN_HOLDER = "_send_can"
RECOVERY_STEPS_SHOWN = 12
TEST_HOLDER = "_test_adc_channels"
# the bus stop (docs/kit.md, "Stopping everything"): a BusStop the cycle has not confirmed is sent again this often
# (lost with a cycle process that died, or submitted before the palm was in OP); the write is reported as failed
# after STOP_WRITE_GRACE_S without a frame carrying it, and still sent while the stop holds: the first frame that
# carries it is reported then (the answer's error clears)
STOP_RESEND_S = 0.1
STOP_WRITE_GRACE_S = 5.0
STOP_LATE_LOOK_S = 0.02  # how often a stop reported as failed is looked at again (not the 1 ms of a fresh one)


# ------------------------------------------------------------------------------------------- the service
class _BackendLink:
    """The link events as the backend reports them, to the kit's supervisor; only the fault is kept apart: the
    backend's (a device of the wrong kind) and the service's (motor faults the palm reports) are one `error`,
    set and cleared by `PalmService._apply_fault`."""

    def __init__(self, service: PalmService, link: SupervisedLink) -> None:
        self._svc = service
        self._link = link
        self.attempt, self.opened, self.failed, self.closed = link.attempt, link.opened, link.failed, link.closed
        self.garbage, self.recovering, self.recovered = link.garbage, link.recovering, link.recovered
        self.next_attempt_in = link.next_attempt_in

    def fault(self, message: str) -> None:
        self._svc._apply_fault(kind=message)

    def clear_fault(self) -> None:
        self._svc._apply_fault(kind="")


class PalmService:
    """Binds the commands, publishes state and health, owns the CAN bridge lease."""

    def __init__(self, node: Node, backend: HandBackend, settings: EthercatSettings,
                 calibration: HandCalibration) -> None:
        self.node = node
        self.backend = backend
        self.settings = settings
        self.dev: Device = node.device(settings.ethercat_device)
        self.lease = BridgeLease()
        # the calibration the driver uses (loaded once by `build`): joint names -> motor ids
        self.joint_to_motor = dict(calibration.motor_of_joint)
        self._lease_active: Lease | None = None  # what the driver was last told
        self._lease_lock = threading.Lock()
        self._collect: list[CanRxFrame] | None = None
        self._stop = threading.Event()
        self._direct_until = 0.0  # ignore no-demand flags until then (CAN direct mode just ended)
        self._rates_bad_since: float | None = None  # since when a 1 s window's counts are over their thresholds
        self._known_faults: dict[int, int] = {}
        self._mode: Literal["torque", "pwm"] = settings.ethercat_control_mode
        self._stopped = False
        self._runner: threading.Thread | None = None  # the thread in run(), the publisher
        # health is set by the publisher thread and, last, by shutdown: the final `stopped` must not be
        # overwritten by a check that was under way, and it keeps the last details with the link marked down
        self._health_lock = threading.Lock()
        self._health_final = False
        self._last_details: dict[str, Any] = {}
        self._joints_src: tuple[Any, ...] | None = None  # the snapshot joints the rows below were built from
        self._joints_rows: list[PalmJoint] = []
        # health: the kit's link supervisor (docs/kit.md, "Health"), fed from what this process reads of the
        # cycle (the count of valid statuses, the cycle process's starts, deaths and exits), never from the cycle
        self.link = self.dev.supervise_link(link_policy(settings))
        # the bus stop: the last BusStop submitted, not yet confirmed by the cycle (number, since, last sent, the
        # latch's activation it belongs to, reported as failed)
        self._bus_stop_lock = threading.Lock()
        self._bus_stop_no = 0
        self._bus_stop_pending: tuple[int, float, float, int, bool] | None = None
        self._fault_lock = threading.Lock()
        self._kind_fault = ""  # the backend's: not the palm configured
        self._device_faults = ""  # the palm's: serious motor flags, silent motors
        self._statuses_seen = backend.last_valid_status()[0]
        self._heard_since = time.monotonic()  # valid data flow since (a motor is judged silent only after that)
        # liveness is judged on when the newest valid status arrived (the cycle's own stamp), read again by the node's
        # deadline thread before it judges: a publisher held up on a loaded host is not a silent palm
        self.link.watch(self._arrival)
        backend.attach_link(_BackendLink(self, self.link))
        backend.on_can_rx(self._on_can_rx)
        d = self.dev
        d.bind_all(self)  # the commands marked below (@handles)
        d.on_stream(CAN_TX, self._on_can_tx)
        # only enqueues (the control pipe, as nullify_demands): on the MQTT network thread, at once
        d.on_stop(self._bus_stop, inline=True)

    # -- lifecycle ------------------------------------------------------------------------------------
    def hooks(self) -> Hooks:
        """start() brings the palm up, run() publishes state until the node stops, shutdown() zeroes and leaves OP."""
        return Hooks(start=self.start, run=self.run, shutdown=self.shutdown)

    def start(self) -> None:
        self.backend.start()  # returns at once: the backend brings the palm up on the link's rhythm
        if self.settings.ethercat_push_config_on_start:
            # typical motor_board_effort_controllers values (docs/reference/shadow_ethercat.md §3.3)
            self._submit(SetMotorConfig(tuple(range(NUM_MOTORS)), MotorConfig(
                torque_limit=400, torque_limiter_gain=64, max_pwm=500, f=500, p=6200, deadband=5)))

    def run(self) -> None:
        """Publisher and watchdog loop (node.run body)."""
        self._runner = threading.current_thread()  # shutdown waits for it
        rates = {spec.name: self.settings.state_rates.get(spec.name, spec.rate_hz or 1.0)
                 for spec in (JOINTS, MOTORS, TACTILE, EXTRAS, LOOP)}
        cycle_hz = 1e6 / self.settings.ethercat_period_us
        interval = {n: 1.0 / min(r, cycle_hz) for n, r in rates.items()}
        start = time.monotonic()
        due = dict.fromkeys(rates, start)
        next_health = start
        while not self._stop.is_set():
            now = time.monotonic()
            self._feed_link()
            self._check_lease(now)
            if self._bus_stop_pending is not None:
                self._check_bus_stop(now)
            names = [n for n, t in due.items() if now >= t]
            at = {n: due[n] for n in names}  # when each was meant to go: the kit's rate cap counts that
            for n in names:
                # a fixed schedule, so the rate is the configured one (the kit's rate cap holds back what
                # comes early); after a stall, on from now rather than a burst to catch up
                nxt = due[n] + interval[n]
                due[n] = nxt if nxt > now else now + interval[n]
            # the motors only for the states and the health check that read them (joints, tactile and palm
            # extras, most of the ticks, do not)
            wants_motors = "motors" in names or now >= next_health
            snap = self.backend.snapshot(motors=wants_motors) if names or now >= next_health else None
            # one socket write for the tick's messages, on this thread: no wake-up of paho's network thread
            with self.node.session.batch():
                if snap is not None:
                    self._publish(names, snap, at)
                if now >= next_health:
                    # on the states' 10 ms grid when it is a tick anyway: no wake-up of its own
                    next_health = (min(at.values()) if at else now) + 0.25
                    self._health(snap)
            # awake at least every fifth of the liveness budget, to feed the link whatever the state rates
            feed_by = now + min(0.05, self.settings.ethercat_liveness_s / 5)
            pending = self._bus_stop_pending
            if pending is not None:  # a stop's frame to report: look again soon
                feed_by = now + (STOP_LATE_LOOK_S if pending[4] else 0.001)
            self._stop.wait(max(0.0005, min(*due.values(), next_health, feed_by) - time.monotonic()))

    def _feed_link(self) -> None:
        """Valid process data seen since the last look (the cycle's count of valid statuses moved): the link's
        liveness, with the time the newest of them arrived (the cycle's stamp, not this look's: a look held up
        past the budget must not pass off old data as live). Every tick of the publisher (10 ms at the default
        joints rate), off the cycle."""
        n, at = self.backend.last_valid_status()
        if n != self._statuses_seen:
            self._statuses_seen = n
            now = time.monotonic()
            fresh = at is None or now - at <= self.settings.ethercat_liveness_s
            if fresh and self.link.state is not LinkState.OPERATIONAL:
                # the palm is heard from again: its identity, finer state and faults before `connection` flips
                self._heard_since = now
                self._health(self.backend.snapshot(), arriving=True)
            self.link.data(at=at)

    def _arrival(self) -> float | None:
        """The link's source (docs/kit.md, SupervisedLink.watch), on the node's deadline thread: when the newest valid
        status arrived, while the palm is operational. Coming back is the publisher's (`_feed_link`), which sets
        the palm's finer state and faults first."""
        if self.link.state is not LinkState.OPERATIONAL:
            return None
        return self.backend.last_valid_status()[1]

    # -- the bus stop (docs/kit.md, "Stopping everything") ------------------------------------------------
    def _bus_stop(self, stop: StopState) -> object:
        """The palm's stop action, on the MQTT network thread: a BusStop down the control pipe, the path of
        nullify_demands (the original driver's `nullify_demand`): from the next frame on every demand is zero, and
        stays zero, sent every cycle. The kit refuses every demand meanwhile. Reported (`stop_written`) with the
        time the first frame carrying it left, once the cycle says so (`_check_bus_stop`)."""
        now = time.monotonic()
        with self._bus_stop_lock:
            self._bus_stop_no += 1
            seq = self._bus_stop_no
            self._bus_stop_pending = (seq, now, now, self.node.stop_latch.generation, False)
        self.backend.submit(BusStop(seq))
        return LATER

    def _check_bus_stop(self, now: float) -> None:
        """Publisher thread, while a stop's frame is not reported: report it once the cycle sent it; send the
        stop again while the cycle has not (a cycle process that died took it along, or the palm was not in OP
        yet: a new cycle starts with zero demands anyway). After STOP_WRITE_GRACE_S without that frame the answer
        says why (an error), and the stop is still sent while it holds: a palm that reaches OP late reports its
        first stopped frame then, which clears the error. A released stop is never sent again (a BusStop forgets
        the demands held: after the release those are new ones)."""
        with self._bus_stop_lock:
            pending = self._bus_stop_pending
        if pending is None:
            return
        seq, since, sent, gen, failed = pending
        latch = self.node.stop_latch
        if not latch.active or latch.generation != gen:
            with self._bus_stop_lock:
                if self._bus_stop_pending == pending:
                    self._bus_stop_pending = None  # released (or a newer stop, with its own pending)
            return
        at_ns = self.backend.stop_sent_ns(seq)
        if at_ns is not None:
            with self._bus_stop_lock:
                if self._bus_stop_pending != pending:
                    return  # a newer stop: its own report
                self._bus_stop_pending = None
            self.dev.stop_written(at=time.time() - (time.monotonic_ns() - at_ns) / 1e9)
            return
        connected = self.backend.connected()
        resend = connected and now - sent >= STOP_RESEND_S
        give_up = not failed and now - since >= STOP_WRITE_GRACE_S
        if not (resend or give_up):
            return
        with self._bus_stop_lock:
            if self._bus_stop_pending != pending:
                return
            self._bus_stop_pending = (seq, since, now if resend else sent, gen, failed or give_up)
        if resend:
            self.backend.submit(BusStop(seq))
        if give_up:
            error = ("the cycle did not report the stop's frame within "
                     f"{STOP_WRITE_GRACE_S:.0f} s" if connected else
                     "the palm is not in OP: no frame carried the stop (its motors get no demand at all, and stop "
                     "on their own 20 ms no-demand timeout; a cycle that starts again starts with zero demands)")
            log.error("bus stop not confirmed on the wire: %s", error)
            self.dev.stop_written(error=error)

    def _apply_fault(self, kind: str | None = None, device: str | None = None) -> None:
        """The one `error` of the device: a palm of the wrong kind (the backend) and the faults the palm reports
        (the health check), together."""
        with self._fault_lock:
            if kind is not None:
                self._kind_fault = kind
            if device is not None:
                self._device_faults = device
            if self._health_final:
                return
            text = "; ".join(t for t in (self._kind_fault, self._device_faults) if t)
            if text:
                self.link.fault(text)
            else:
                self.link.clear_fault()

    def shutdown(self) -> None:
        """Node shutdown hook, before the node goes offline, in the fail-safe order: commands that move refused from
        now on; the backend zeroes every demand on the wire and leaves OP, then stops what reads the cycle's shared
        memory and closes it; then the publisher ends; then the stop is said (event, health)."""
        if self._stopped:
            return
        self._stopped = True  # _require_normal refuses from here on: nothing new to the cycle while it halts
        self.backend.stop()
        self._stop.set()
        runner = self._runner
        if runner is not None and runner is not threading.current_thread():
            runner.join(5.0)
        rep = self.backend.stop_report()
        self.dev.emit(STOPPED, PalmStopped(ts=time.time(), zero_demand_cycles=int(rep.get("zero_demand_cycles", 0)),
                                           demands_sent_last=list(rep.get("demands_sent_last", [])),
                                           model_demands=list(rep.get("model_demands", []))))
        with self._health_lock, self._fault_lock:
            self._health_final = True
            details = dict(self._last_details)
            details["bus"] = {**details.get("bus", {}), "issue": "stopped"}
            self.dev.set_health(details=details)
            # stopped: connection false, no valid data (the kit's details.link says so), whatever the last check saw
            self.link.clear_fault()
            self.link.stop("shutdown: demands zeroed, the palm left OP")

    # -- state and health -----------------------------------------------------------------------------
    def _publish(self, names: list[str], s: PalmSnapshot, at: dict[str, float]) -> None:
        ts = time.time()
        if "joints" in names and s.joints:
            if s.joints is not self._joints_src:  # the driver keeps the same tuple while the words are unchanged
                self._joints_src = s.joints
                self._joints_rows = [PalmJoint(name=j.name, position=j.position, raw=list(j.raw)) for j in s.joints]
            # validated PalmJoint instances are taken as they are (pydantic does not revalidate them)
            self.dev.publish(JOINTS, PalmJoints(
                ts=ts, cycle=s.cycle, joints=self._joints_rows,
                sensors_raw=dict(zip(SENSOR_NAMES, s.sensors_raw, strict=True))), at=at["joints"])
        if "motors" in names:
            self.dev.publish(MOTORS, PalmMotors(ts=ts, mode=s.mode, phase=s.phase, motors=[PalmMotor(
                id=m.id, joint=m.joint, torque=m.torque, demand=m.demand, demand_sent=m.demand_sent, flags=m.flags,
                flag_names=list(m.flag_names), serious=m.serious, temperature=m.temperature, current=m.current,
                voltage=m.voltage, pwm=m.pwm, sgl=m.sgl, sgr=m.sgr,
                last_seen_s=None if m.last_seen_ns is None else round((s.now_ns - m.last_seen_ns) / 1e9, 4),
                missed=m.missed, data_errors=m.data_errors, slow=m.slow, can_received=m.can_received,
                can_transmitted=m.can_transmitted, can_errors=list(m.can_errors) if m.can_errors else None,
                terms=m.terms) for m in s.motors]), at=at["motors"])
        if "tactile" in names:
            self.dev.publish(TACTILE, PalmTactile(ts=ts, type=s.tactile_type, valid=s.tactile_valid,
                                                  sensors=[list(t) for t in s.tactile],
                                                  mid_prox=[list(t) for t in s.tactile_mid_prox],
                                                  aux_spi_type=s.aux_spi_type, aux_spi=list(s.aux_spi)),
                             at=at["tactile"])
        if "palm_extras" in names:
            self.dev.publish(EXTRAS, PalmExtras(ts=ts, accel=list(s.imu[:3]), gyro=list(s.imu[3:]),
                                                analog=list(s.analog), idle_time_us=s.idle_time_us),
                             at=at["palm_extras"])
        if "loop_stats" in names:
            self.dev.publish(LOOP, self.backend.stats().model_copy(update={"ts": ts, "counters": dict(s.counters)}),
                             at=at["loop_stats"])

    def _loss_problems(self, stats: EthercatLoopStats) -> tuple[list[str], list[str]]:
        """(problems, warnings) of a link that delivers valid data: what the palm's `operational` and the health
        message say. Whether data flow at all is the link supervisor's (`silent` past the liveness budget), and
        `error` is for faults the palm reports (docs/kit.md, "Health"). Per 1 s window, counts above their
        thresholds (lost frames, wrong working counters, overruns, dropped statuses) are a warning; sustained for
        `ethercat_loss_sustain_s` they are a problem: not operational, the message names each. A healthy link on
        a loaded host loses a burst of frames to a scheduling stall now and then, and health that flips for that
        one second is an alarm nobody can act on. An outage shorter than the budget (20 cycles or more without a
        valid status, the motors' cut-out) is a warning for its window."""
        s = self.settings
        warnings: list[str] = []
        if stats.outages:
            warnings.append(f"warning: {stats.outages} outage(s) of {s.ethercat_error_after_lost} cycles or more "
                            "without valid process data in the last second")
        rates: list[str] = []
        lost = stats.frames_lost
        if lost > s.ethercat_lost_threshold:
            rates.append(f"{lost} frames lost in the last second (threshold {s.ethercat_lost_threshold})")
        wkc = stats.wkc_errors
        if wkc > s.ethercat_lost_threshold:
            rates.append(f"{wkc} frames with a wrong working counter in the last second "
                         f"(threshold {s.ethercat_lost_threshold})")
        overruns, limit = stats.overruns, overrun_threshold(s)
        if overruns > limit:
            rates.append(f"{overruns} overruns in the last second (threshold {limit})")
        drops = stats.drops
        if drops > s.ethercat_drop_threshold:
            rates.append(f"{drops} dropped statuses in the last second (threshold {s.ethercat_drop_threshold})")
        now = time.monotonic()
        if not rates:
            self._rates_bad_since = None
            return [], warnings
        if self._rates_bad_since is None:
            self._rates_bad_since = now
        lasted = now - self._rates_bad_since
        if lasted >= s.ethercat_loss_sustain_s:
            return [f"{r}, for {lasted:.0f} s" for r in rates], warnings
        return [], [f"warning: {r}" for r in rates] + warnings

    @staticmethod
    def _realtime(info: dict[str, Any], stats: EthercatLoopStats) -> dict[str, Any] | None:
        """The cycle's scheduling and the realtime settings it was refused (None: the backend has no
        realtime cycle to report on, e.g. the in-process model)."""
        rt = stats.realtime
        if not isinstance(rt, dict) and "warnings" not in info:
            return None
        rt = rt if isinstance(rt, dict) else {}
        warnings = [str(w) for w in rt.get("warnings") or []]
        warnings += [str(w) for w in info.get("warnings") or [] if str(w) not in warnings]
        return {"policy": rt.get("policy") or info.get("realtime_policy") or "", "warnings": warnings}

    def _health(self, s: PalmSnapshot | None, arriving: bool = False) -> None:
        with self._health_lock:
            if not self._health_final:
                self._health_locked(s, arriving)

    def _health_locked(self, s: PalmSnapshot | None, arriving: bool = False) -> None:
        """The palm's view for the link supervisor, which owns connection, state and error (docs/kit.md): while
        valid data flow, the finer state (initializing, running, ...) and whether the palm can work; the faults it
        reports (serious motor flags, silent motors) as the device's fault; and the details (identity, the bus,
        recovery, realtime, restarts)."""
        info = self.backend.info()
        stats = self.backend.stats()
        problems, warnings = self._loss_problems(stats)
        realtime = self._realtime(info, stats)
        valid = arriving or self.link.state is LinkState.OPERATIONAL
        name = "starting"  # valid data, no snapshot yet
        direct = False
        silent_ns = self.settings.ethercat_silent_motor_ms * 1_000_000
        # after an outage every motor was unseen for its length: silence counts once data have flowed that long
        judge_silence = time.monotonic() - self._heard_since > silent_ns / 1e9
        faults: list[str] = []
        if s is not None and valid:
            direct = s.can_direct
            if direct:
                self._direct_until = time.monotonic() + 1.0
            quiet_flags = MotorFlag.NO_DEMAND_SEEN if time.monotonic() < self._direct_until else 0
            for m in s.motors:
                flags = (m.flags or 0) & ~quiet_flags
                bad = serious_flags(flags)
                if bad:
                    faults.append(f"motor {m.id} ({m.joint}): {', '.join(bad)}")
                    if self._known_faults.get(m.id) != flags:
                        self.dev.emit(MOTOR_FAULT, PalmMotorFault(ts=time.time(), motor=m.id, joint=m.joint,
                                                                  flags=m.flags or 0, serious=bad))
                self._known_faults[m.id] = flags if bad else 0
                if (judge_silence and not direct and s.phase == "operation" and
                        (m.last_seen_ns is None or s.now_ns - m.last_seen_ns > silent_ns) and s.cycle > 1000):
                    faults.append(f"motor {m.id} ({m.joint}) not answering")
            name = "can_direct" if direct else ("test_mode" if s.edc_command != EdcCommand.SENSOR_DATA
                                                else ("initializing" if s.phase == "init" else "running"))
            if info.get("issue"):
                name = "slave_recovery"  # data flow, but a slave is being brought back
        details = {k: info.get(k) for k in ("vendor", "product", "revision", "serial", "protocol", "backend")}
        # the bus as the cycle sees it (the link's own counts are the kit's `details.link`): the cycle's state,
        # what recovery works on, stale replies since start
        bus: dict[str, Any] = {"cycle": str(info.get("state", "")), "issue": info.get("issue") or ""}
        totals = stats.totals or {}
        if "stale" in totals:  # wire backends: replies dropped as not belonging to the frame just sent (since start)
            bus["stale_replies"] = int(totals["stale"])
        details["bus"] = bus
        if "restarts" in info:  # wire backends: cycle processes started again after one died
            details["restarts"] = int(info["restarts"])
            if info.get("last_exit"):
                details["last_exit"] = str(info["last_exit"])
        recovery = info.get("recovery")
        if recovery:
            now = time.monotonic_ns()
            details["recovery"] = {
                **{k: recovery.get(k, 0) for k in ("escalations", "escalation_failures", "rescans", "recoveries")},
                "steps": [{"ago_s": round((now - int(t)) / 1e9, 3), "step": str(text)}
                          for t, text in recovery.get("steps", [])[-RECOVERY_STEPS_SHOWN:]]}
        # refused realtime settings are warnings: in details and the message, never an error by themselves
        warnings += [f"warning: {w}" for w in realtime["warnings"]] if realtime else []
        if realtime is not None:
            details["realtime"] = realtime
        self._last_details = details
        self.dev.set_health(details=details)
        if valid:  # the palm's view, as last seen while it was heard from
            self._apply_fault(device="; ".join(faults[:6]))
            ready = s is not None and s.phase == "operation" and not direct and not problems
            self.link.device_state(name, operational=ready, message="; ".join(problems[:6] + warnings))

    # -- helpers --------------------------------------------------------------------------------------
    def _submit(self, msg: ControlMessage) -> None:
        """Validate once (the cycle applies without checking again), then hand it to the backend."""
        err = msg.validate(self._mode)
        if err:
            raise CommandError(ErrorCode.INVALID_REQUEST, err)
        self.backend.submit(msg)

    def _require_normal(self) -> None:
        if self._stopped:
            raise CommandError(ErrorCode.UNAVAILABLE, "the service is stopping: every demand is zeroed")
        cur = self.lease.holder(time.monotonic())
        if cur is not None:
            raise CommandError(ErrorCode.BUSY, f"the CAN bridge is leased by {cur.holder!r}: the hand is in CAN "
                                               "direct mode and its demands are zero")
        if not self.backend.connected():
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")

    def _motor_ids(self, refs: list[MotorRef]) -> tuple[int, ...]:
        if not refs:
            return tuple(range(NUM_MOTORS))
        cal_map = self._joint_map()
        out = []
        for r in refs:
            if isinstance(r, int):
                if not 0 <= r < NUM_MOTORS:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"motor id {r} not in 0..{NUM_MOTORS - 1}")
                out.append(r)
            elif r in cal_map:
                out.append(cal_map[r])
            else:
                raise CommandError(ErrorCode.INVALID_REQUEST, f"unknown joint {r!r} (actuated joints: "
                                                              f"{list(ACTUATED_JOINTS)})")
        return tuple(dict.fromkeys(out))

    def _joint_map(self) -> dict[str, int]:
        return self.joint_to_motor

    # -- commands -------------------------------------------------------------------------------------
    @handles(SET_MODE)
    def set_control_mode(self, req: PalmControlModeRequest) -> PalmAck:
        self._require_normal()
        self._mode = req.mode
        self._submit(SetControlMode(req.mode))
        return PalmAck(message=f"{req.mode} mode; demands zeroed")

    # set_demands and nullify only validate and enqueue (a non-blocking pipe write, or a queue): on the MQTT
    # network thread, without the hand-over to the command pool (one GIL hand-off less on a demand's way)
    @handles(SET_DEMANDS, inline=True)
    def set_demands(self, req: PalmDemandsRequest) -> PalmDemandsReply:
        self._require_normal()
        demands = dict(req.motors)
        if req.joints:
            jm = self._joint_map()
            for name, v in req.joints.items():
                if name not in jm:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"unknown joint {name!r} (actuated joints: "
                                                                  f"{sorted(jm)})")
                demands[jm[name]] = v
        # the client's deadline for this request (from its send time), to the cycle: the deadman ends there if it
        # comes first, and a demand that reaches the cycle past it never goes out (CLOCK_MONOTONIC: system-wide)
        deadline = request_deadline()
        self._submit(SetDemands(demands, None if deadline is None else int(deadline * 1e9)))
        return PalmDemandsReply(motors=demands, mode=self._mode, timeout_ms=self.settings.ethercat_demand_timeout_ms)

    @handles(NULLIFY, inline=True)
    def nullify(self, req: PalmNullifyRequest) -> PalmAck:
        self._submit(NullifyDemands(req.enable))
        return PalmAck(message="demands nullified" if req.enable else "demands enabled")

    @handles(SET_CONFIG)
    def set_motor_config(self, req: PalmMotorConfigRequest) -> PalmMotorConfigReply:
        self._require_normal()
        motors = self._motor_ids(req.motors)
        cfg = MotorConfig(**req.model_dump(exclude={"motors"}))
        self._submit(SetMotorConfig(motors, cfg))
        return PalmMotorConfigReply(motors=list(motors), crc=config_crc(cfg.words()))

    @moves_when(SYSTEM)
    def system_controls_moves(self, req: PalmSystemControlsRequest) -> bool:
        """A jiggle moves the motors (the kit's bus stop gate, api.py SYSTEM); the other controls do not."""
        return req.jiggle

    @handles(SYSTEM)
    def system_controls(self, req: PalmSystemControlsRequest) -> PalmSystemControlsReply:
        self._require_normal()
        motors = self._motor_ids(req.motors)
        bits = 0
        if req.backlash is not None:
            bits |= SystemControl.BACKLASH_COMPENSATION_ENABLE if req.backlash else \
                SystemControl.BACKLASH_COMPENSATION_DISABLE
        bits |= {1: SystemControl.SGL_TRACKING_INC, -1: SystemControl.SGL_TRACKING_DEC}.get(req.sgl_tracking, 0)
        bits |= {1: SystemControl.SGR_TRACKING_INC, -1: SystemControl.SGR_TRACKING_DEC}.get(req.sgr_tracking, 0)
        if req.jiggle:
            bits |= SystemControl.INITIATE_JIGGLING
        if req.write_eeprom:
            bits |= SystemControl.EEPROM_WRITE
        if not bits and not req.reset:
            raise CommandError(ErrorCode.INVALID_REQUEST, "nothing to do: set reset or a control")
        if req.reset:
            self._submit(ResetMotors(motors))
        if bits:
            self._submit(SystemControls(motors, int(bits)))
        return PalmSystemControlsReply(motors=list(motors), controls=int(bits), reset=req.reset)

    def _wait_snapshot(self, pred: Any, timeout_s: float) -> PalmSnapshot | None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            s = self.backend.snapshot()
            if s is not None and pred(s):
                return s
            time.sleep(0.003)
        return None

    @handles(TEST_ADC)
    def test_adc_channels(self, req: PalmAdcTestRequest) -> PalmAdcTestReply:
        self._require_normal()
        lease = self.lease.acquire(TEST_HOLDER, req.timeout_ms + 1000, time.monotonic())
        try:
            start = self.backend.snapshot()
            base = start.status_count if start else 0
            self.backend.submit(SetTestMode(EdcCommand.SENSOR_CHANNEL_NUMBERS))
            snap = self._wait_snapshot(lambda s: s.edc_echo == EdcCommand.SENSOR_CHANNEL_NUMBERS
                                       and s.status_count >= base + 3, req.timeout_ms / 1000)
        finally:
            self.backend.submit(SetTestMode(EdcCommand.SENSOR_DATA))
            self.lease.release(lease.lease_id)
        if snap is None:
            raise CommandError(ErrorCode.TIMEOUT, f"the palm did not answer in SENSOR_CHANNEL_NUMBERS mode within "
                                                  f"{req.timeout_ms} ms")
        rows = []
        for name, word in zip(SENSOR_NAMES, snap.sensors_raw, strict=True):
            adc, ch = split_channel_word(word)
            ea, ec = EXPECTED_CHANNELS[name]
            rows.append(PalmAdcChannel(name=name, raw=word, adc=adc, channel=ch, expected_adc=ea, expected_channel=ec,
                                       ok=(adc, ch) == (ea, ec)))
        bad = [r.name for r in rows if not r.ok]
        return PalmAdcTestReply(matches=not bad, mismatched=bad, sensors=rows)

    @moves_when(SEND_CAN)
    def send_can_moves(self, req: PalmSendCanRequest) -> bool:
        """A TO_MOTOR frame (a demand, a control) can move a motor (docs/reference/shadow_ethercat.md §1.9): the
        kit's bus stop gate (api.py SEND_CAN); other frames do not."""
        return split_sid(req.sid)[0] == CanDirection.TO_MOTOR

    @handles(SEND_CAN)
    def send_can(self, req: PalmSendCanRequest) -> PalmSendCanReply:
        if not self.backend.connected():
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")
        data = bytes.fromhex(req.data)
        if req.length is not None:
            data = data[:req.length]
        return self._send_can(req, data)

    def _send_can(self, req: PalmSendCanRequest, data: bytes) -> PalmSendCanReply:
        lease = self.lease.acquire(SEND_CAN_HOLDER, req.window_ms + 2000, time.monotonic())
        try:
            with self._lease_lock:
                self._collect = []
                self._lease_active = lease
                self.backend.submit(SetCanDirect(True))
                self.backend.submit(CanTx((CanFrame(req.bus, req.sid, data),)))
            time.sleep(req.window_ms / 1000)
            with self._lease_lock:
                got, self._collect = self._collect or [], None
                self._lease_active = None
                self.backend.submit(SetCanDirect(False))
        finally:
            self.lease.release(lease.lease_id)
        sent = PalmCanFrameIn(bus=req.bus, sid=req.sid, data=data.hex())
        return PalmSendCanReply(sent=sent, frames=[frame_out(f) for f in got])

    @handles(LEASE)
    def bridge_lease(self, req: PalmBridgeLeaseRequest) -> PalmBridgeLease:
        if req.holder.startswith("_"):
            raise CommandError(ErrorCode.INVALID_REQUEST, "holder names starting with '_' are reserved")
        if not self.backend.connected():
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")
        now = time.monotonic()
        lease = self.lease.acquire(req.holder, req.ttl_ms, now)
        with self._lease_lock:
            if self._lease_active is None or self._lease_active.lease_id != lease.lease_id:
                self._lease_active = lease
                self.backend.submit(SetCanDirect(True))
                log.info("CAN bridge leased", extra={"holder": req.holder, "lease_id": lease.lease_id})
        return PalmBridgeLease(lease_id=lease.lease_id, expires_in_ms=round((lease.expires - now) * 1000))

    @handles(RELEASE)
    def bridge_release(self, req: PalmBridgeReleaseRequest) -> PalmEmpty:
        cur = self.lease.holder(time.monotonic())
        if cur is not None and cur.holder.startswith("_"):
            raise CommandError(ErrorCode.NOT_FOUND, f"no lease {req.lease_id!r}")
        if not self.lease.release(req.lease_id):
            raise CommandError(ErrorCode.NOT_FOUND, f"no lease {req.lease_id!r} (expired or released)")
        self._end_direct(req.lease_id, "released")
        return PalmEmpty()

    def _end_direct(self, lease_id: str, why: str) -> None:
        with self._lease_lock:
            if self._lease_active is not None and self._lease_active.lease_id == lease_id:
                self._lease_active = None
                self.backend.submit(SetCanDirect(False))
                log.info("CAN bridge back to normal operation", extra={"lease_id": lease_id, "why": why})

    def _check_lease(self, now: float) -> None:
        gone = self.lease.expire(now)
        if gone is not None and not gone.holder.startswith("_"):
            self._end_direct(gone.lease_id, f"holder {gone.holder!r} quiet for {gone.ttl_s * 1000:.0f} ms")

    # -- the CAN bridge streams -----------------------------------------------------------------------
    def _on_can_tx(self, msg: PalmCanTx) -> None:
        """Network thread: quick. A stale lease id is counted and dropped."""
        if not self.lease.touch(msg.lease_id, time.monotonic()):
            self.node.count_decode_error(f"can_tx for lease {msg.lease_id!r}, which is not held")
            return
        frames = msg.frames
        # the bus stop: no TO_MOTOR frame (docs/reference/shadow_ethercat.md §1.9) leaves
        if frames and self.node.stop_latch.active:
            frames = [f for f in frames if split_sid(f.sid)[0] != CanDirection.TO_MOTOR]
            for _ in range(len(msg.frames) - len(frames)):
                self.node.count_decode_error("can_tx: a TO_MOTOR frame dropped while the bus stop is active")
        if frames:
            self.backend.submit(CanTx(tuple(frame_in(f) for f in frames)))

    def _on_can_rx(self, frames: list[CanRxFrame]) -> None:
        with self._lease_lock:
            lease = self._lease_active
            if self._collect is not None:
                self._collect.extend(frames)
                return
        if lease is not None:
            self.dev.stream_publish(CAN_RX, PalmCanRx(lease_id=lease.lease_id, frames=[frame_out(f) for f in frames]))


# ------------------------------------------------------------------------------------------- wiring
def make_backend(settings: EthercatSettings, calibration: HandCalibration | None = None) -> HandBackend:
    """The backend ROBOBUS_ETHERCAT_BACKEND names, through the kit's transport loader (shared/transports.py,
    entry points `ethercat-loop.<name>`): `model` (driver + palm model in-process), `virtual` (the realtime cycle
    process against the virtual hand) or `nic` (a real NIC); each factory gets the settings and the calibration."""
    cal = calibration or HandCalibration.load(settings.ethercat_calibration)
    try:
        factory = load_transport(API.service, settings.backend)
        return cast(HandBackend, factory(settings, cal))
    except TransportUnavailable as exc:
        raise BackendUnavailable(str(exc)) from exc
    except ImportError as exc:  # a factory's late import (pysoem, the realtime machinery)
        raise BackendUnavailable(f"backend {settings.backend!r} cannot be imported here: {exc}") from exc


def build(node: Node, settings: EthercatSettings) -> PalmService:
    """The kit's hook: the calibration (loaded once), the backend, the MQTT surface. The returned service
    has start() (bring the palm to OP), run() (the state publisher) and shutdown() (zero demands, leave OP)."""
    try:
        cal = HandCalibration.load(settings.ethercat_calibration)
    except (OSError, ValueError) as exc:  # a calibration file that cannot be read or is not valid
        raise ServiceUnavailable(f"calibration {settings.ethercat_calibration}: {exc}") from None
    try:
        backend = make_backend(settings, cal)
    except BackendUnavailable as exc:
        raise ServiceUnavailable(str(exc)) from None
    return PalmService(node, backend, settings, cal)
