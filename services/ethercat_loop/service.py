"""ethercat-loop's MQTT surface: `PalmService`, the wiring of its jobs, and `build` (the kit's hook).

Everything here runs off the cycle: handlers turn requests into driver messages (`backend.submit`), a publisher
thread turns driver snapshots into state at the configured rates. The jobs have modules of their own: the palm's
health (health.py `PalmHealth`), the CAN bridge and its lease (can_bridge.py `CanBridge`), the bus stop's report
(stop_report.py `StopReport`, pure); the handlers stay here and call them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal, cast

from services.ethercat_loop.api import (
    API,
    CAN_TX,
    EXTRAS,
    JOINTS,
    LEASE,
    LOOP,
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
from services.ethercat_loop.backend import BackendHooks, BackendUnavailable, HandBackend
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.can_bridge import CanBridge
from services.ethercat_loop.control import (
    BusStop,
    ControlMessage,
    MotorConfig,
    NullifyDemands,
    ResetMotors,
    SetControlMode,
    SetDemands,
    SetMotorConfig,
    SetTestMode,
    SystemControls,
)
from services.ethercat_loop.health import PalmHealth
from services.ethercat_loop.models import (
    MotorRef,
    PalmAck,
    PalmAdcChannel,
    PalmAdcTestReply,
    PalmAdcTestRequest,
    PalmBridgeLease,
    PalmBridgeLeaseRequest,
    PalmBridgeReleaseRequest,
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
    SystemControl,
    config_crc,
    split_channel_word,
    split_sid,
)
from services.ethercat_loop.settings import EthercatSettings, link_policy
from services.ethercat_loop.snapshot import PalmSnapshot
from services.ethercat_loop.stop_report import STOP_WRITE_GRACE_S, StopReport
from shared import CommandError, Device, ErrorCode, Node, ServiceUnavailable
from shared.device import handles, moves_when
from shared.dispatch import request_deadline
from shared.lifecycle import Hooks
from shared.messages import StopState
from shared.stop import LATER
from shared.transports import TransportUnavailable, load_transport

# the contract is api.py's, the settings settings.py's; STOP_WRITE_GRACE_S is stop_report.py's
__all__ = ["STOP_WRITE_GRACE_S", "PalmService", "build", "make_backend"]
log = logging.getLogger("robobus.ethercat")
TEST_HOLDER = "_test_adc_channels"


# ------------------------------------------------------------------------------------------- the service
class PalmService:
    """Binds the commands and publishes state; holds the palm's health, its CAN bridge and its bus stop's report."""

    def __init__(self, node: Node, backend: HandBackend, settings: EthercatSettings,
                 calibration: HandCalibration) -> None:
        self.node = node
        self.backend = backend
        self.settings = settings
        self.dev: Device = node.device(settings.ethercat_device)
        # the calibration the driver uses (loaded once by `build`): joint names -> motor ids
        self.joint_to_motor = dict(calibration.motor_of_joint)
        self._stop = threading.Event()
        self._mode: Literal["torque", "pwm"] = settings.ethercat_control_mode
        self._stopped = False
        self._runner: threading.Thread | None = None  # the thread in run(), the publisher
        self._joints_src: tuple[Any, ...] | None = None  # the snapshot joints the rows below were built from
        self._joints_rows: list[PalmJoint] = []
        # health: the kit's link supervisor (docs/kit.md, "Health"), fed from what this process reads of the
        # cycle (the count of valid statuses, the cycle process's starts, deaths and exits), never from the cycle
        self.link = self.dev.supervise_link(link_policy(settings))
        self.health = PalmHealth(settings, backend, self.dev, self.link)
        self.bridge = CanBridge(node, self.dev, backend)
        self.bus_stop = StopReport()  # the last BusStop submitted, until the cycle confirms it
        backend.on_can_rx(self.bridge.on_can_rx)
        d = self.dev
        d.bind_all(self)  # the commands marked below (@handles)
        d.on_stream(CAN_TX, self.bridge.on_can_tx)
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
            self.health.feed_link()
            self.bridge.expire(now)
            if self.bus_stop.pending is not None:
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
                    self.health.check(snap)
            # awake at least every fifth of the liveness budget, to feed the link whatever the state rates
            feed_by = now + min(0.05, self.settings.ethercat_liveness_s / 5)
            feed_by = self.bus_stop.look_again(now) or feed_by  # a stop's frame to report: look again soon
            self._stop.wait(max(0.0005, min(*due.values(), next_health, feed_by) - time.monotonic()))

    # -- the bus stop (docs/kit.md, "Stopping everything") ------------------------------------------------
    def _bus_stop(self, stop: StopState) -> object:
        """The palm's stop action, on the MQTT network thread: a BusStop down the control pipe, the path of
        nullify_demands (the original driver's `nullify_demand`): from the next frame on every demand is zero, and
        stays zero, sent every cycle. The kit refuses every demand meanwhile. Reported (`stop_written`) with the
        time the first frame carrying it left, once the cycle says so (`_check_bus_stop`)."""
        seq = self.bus_stop.stop(time.monotonic(), self.node.stop_latch.generation)
        self.backend.submit(BusStop(seq))
        return LATER

    def _check_bus_stop(self, now: float) -> None:
        """Publisher thread, while a stop's frame is not reported: what the cycle and the latch say, to the
        stop's report (stop_report.py), which says whether to report the frame, send the stop again, or say
        that no frame carried it."""
        pending = self.bus_stop.pending
        if pending is None:
            return
        latch = self.node.stop_latch
        verdict = self.bus_stop.check(pending, now, active=latch.active, generation=latch.generation,
                                         sent_at_ns=self.backend.stop_sent_ns(pending.seq),
                                         connected=self.backend.connected())
        if verdict.written_ns is not None:
            self.dev.stop_written(at=time.time() - (time.monotonic_ns() - verdict.written_ns) / 1e9)
        if verdict.resend is not None:
            self.backend.submit(BusStop(verdict.resend))
        if verdict.error:
            log.error("bus stop not confirmed on the wire: %s", verdict.error)
            self.dev.stop_written(error=verdict.error)

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
        self.health.close("shutdown: demands zeroed, the palm left OP")

    # -- state -----------------------------------------------------------------------------------
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
        cur = self.bridge.holder(time.monotonic())
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
        lease = self.bridge.lease.acquire(TEST_HOLDER, req.timeout_ms + 1000, time.monotonic())
        try:
            start = self.backend.snapshot()
            base = start.status_count if start else 0
            self.backend.submit(SetTestMode(EdcCommand.SENSOR_CHANNEL_NUMBERS))
            snap = self._wait_snapshot(lambda s: s.edc_echo == EdcCommand.SENSOR_CHANNEL_NUMBERS
                                       and s.status_count >= base + 3, req.timeout_ms / 1000)
        finally:
            self.backend.submit(SetTestMode(EdcCommand.SENSOR_DATA))
            self.bridge.lease.release(lease.lease_id)
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
        return self.bridge.send_and_collect(req, data)

    @handles(LEASE)
    def bridge_lease(self, req: PalmBridgeLeaseRequest) -> PalmBridgeLease:
        if req.holder.startswith("_"):
            raise CommandError(ErrorCode.INVALID_REQUEST, "holder names starting with '_' are reserved")
        if not self.backend.connected():
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")
        now = time.monotonic()
        lease = self.bridge.open(req.holder, req.ttl_ms, now)
        return PalmBridgeLease(lease_id=lease.lease_id, expires_in_ms=round((lease.expires - now) * 1000))

    @handles(RELEASE)
    def bridge_release(self, req: PalmBridgeReleaseRequest) -> PalmEmpty:
        self.bridge.release(req.lease_id)
        return PalmEmpty()


# ------------------------------------------------------------------------------------------- wiring
def make_backend(settings: EthercatSettings, calibration: HandCalibration | None = None) -> HandBackend:
    """The backend ROBOBUS_ETHERCAT_BACKEND names, through the kit's transport loader (shared/transports.py,
    entry points `ethercat-loop.<name>`): `model` (driver + palm model in-process), `virtual` (the realtime cycle
    process against the virtual hand) or `nic` (a real NIC); each factory gets the settings and the hooks (the
    calibration): the kit's one signature, `factory(settings, hooks)`."""
    cal = calibration or HandCalibration.load(settings.ethercat_calibration)
    try:
        factory = load_transport(API.service, settings.backend)
        return cast(HandBackend, factory(settings, BackendHooks(cal)))
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
