"""ethercat-loop's MQTT surface: health, rate-capped state, commands and the leased CAN bridge.

Everything here runs off the cycle: handlers turn requests into driver messages (`backend.submit`),
a publisher thread turns driver snapshots into state at the configured rates.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.ethercat_loop.backend import EthercatSettings, HandBackend, overrun_threshold
from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.driver import (
    CanFrame,
    CanRxFrame,
    CanTx,
    ControlMessage,
    MotorConfig,
    NullifyDemands,
    PalmSnapshot,
    ResetMotors,
    SetCanDirect,
    SetControlMode,
    SetDemands,
    SetMotorConfig,
    SetTestMode,
    SystemControls,
    check_message,
)
from services.ethercat_loop.protocol import (
    ACTUATED_JOINTS,
    EXPECTED_CHANNELS,
    NUM_MOTORS,
    SENSOR_NAMES,
    EdcCommand,
    MotorFlag,
    SystemControl,
    config_crc,
    serious_flags,
    split_channel_word,
)
from shared import CommandError, Device, ErrorCode, Node, ServiceAPI

log = logging.getLogger("robobus.ethercat")
HEX8 = r"^([0-9a-fA-F]{2}){0,8}$"
SEND_CAN_HOLDER = "_send_can"
TEST_HOLDER = "_test_adc_channels"


# ------------------------------------------------------------------------------------------- state models
class PalmJoint(BaseModel):
    name: str
    position: float | None = Field(description="rad (None before the first sensor data)")
    raw: list[int] = Field(description="the raw sensor words it was computed from")


class PalmJoints(BaseModel):
    """Calibrated joint positions (J0 = J1 + J2; THJ5 and WRJ1 from their A/B sensors), plus raw sensors."""

    ts: float
    cycle: int
    joints: list[PalmJoint]
    sensors_raw: dict[str, int] = Field(description="all 37 sensor words by name")


class PalmMotor(BaseModel):
    id: int
    joint: str | None
    torque: int | None = Field(description="strain-gauge units (raw int16)")
    demand: int = Field(description="latest demand asked for (before the deadman)")
    demand_sent: int = Field(description="what the last demand cycle sent")
    flags: int | None
    flag_names: list[str]
    serious: bool = Field(description="a flag that switches the motor off is set")
    temperature: float | None = Field(description="°C")
    current: float | None = Field(description="A")
    voltage: float | None = Field(description="V")
    pwm: int | None
    sgl: int | None
    sgr: int | None
    last_seen_s: float | None = Field(description="seconds since the motor last answered")
    missed: int
    data_errors: int
    slow: dict[str, int] = Field(description="slow data: firmware revision, serial, gear ratio, controller terms")
    can_received: int | None
    can_transmitted: int | None
    can_errors: list[int] | None = Field(description="[tx, rx] CAN error counters")
    terms: dict[str, int]


class PalmMotors(BaseModel):
    """The 20 motors."""

    ts: float
    mode: Literal["torque", "pwm"]
    phase: str = Field(description="init (polling init-only data) or operation")
    motors: list[PalmMotor]


class PalmTactile(BaseModel):
    """Tactile sensors (fingertips FF, MF, RF, LF, TH)."""

    ts: float
    type: int
    valid: int = Field(description="bit0 FF .. bit4 TH")
    sensors: list[list[int]] = Field(description="5 x 8 words (0220) or 5 x 16 words (0230)")
    mid_prox: list[list[int]] = Field(default_factory=list, description="0230: 5 x (4 middle + 4 proximal)")
    aux_spi_type: int = 0
    aux_spi: list[int] = Field(default_factory=list, description="0230: auxiliary SPI sensor words")


class PalmExtras(BaseModel):
    """IMU and auxiliary analog inputs from the sensor array, and the palm's idle time."""

    ts: float
    accel: list[int]
    gyro: list[int]
    analog: list[int]
    idle_time_us: int


class EthercatLoopStats(BaseModel):
    """Loop statistics over the last 1 s window."""

    model_config = ConfigDict(extra="allow")
    ts: float
    period_us: float = 0.0
    target_period_us: float = 0.0
    jitter_p50_us: float = 0.0
    jitter_p99_us: float = 0.0
    jitter_max_us: float = 0.0
    overruns: int = 0
    drops: int = 0
    frames_lost: int = 0
    decode_errors: int = 0
    cycles: int = 0
    window_s: float = 0.0
    counters: dict[str, int] = Field(default_factory=dict, description="driver counters since start")


class PalmMotorFault(BaseModel):
    """A motor raised a serious flag (it switched itself off)."""

    ts: float
    motor: int
    joint: str | None
    flags: int
    serious: list[str]


class PalmStopped(BaseModel):
    """Sent once at shutdown, after the zero demands and before the node goes offline."""

    ts: float
    zero_demand_cycles: int
    demands_sent_last: list[int] = Field(default_factory=list)
    model_demands: list[int] = Field(default_factory=list)


# ------------------------------------------------------------------------------------------- command models
class PalmAck(BaseModel):
    message: str = ""


class PalmControlModeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["torque", "pwm"]


MotorRef = int | str


class PalmDemandsRequest(BaseModel):
    """Demands by joint name and/or motor id; each stays valid for demand_timeout_ms (deadman)."""

    model_config = ConfigDict(extra="forbid")
    joints: dict[str, int] = Field(default_factory=dict, description="actuated joint (e.g. FFJ0) -> demand")
    motors: dict[int, int] = Field(default_factory=dict, description="motor id 0..19 -> demand")

    @model_validator(mode="after")
    def _some(self) -> PalmDemandsRequest:
        if not self.joints and not self.motors:
            raise ValueError("give joints or motors")
        return self


class PalmDemandsReply(BaseModel):
    motors: dict[int, int] = Field(description="motor id -> demand accepted")
    mode: Literal["torque", "pwm"]
    timeout_ms: float


class PalmNullifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enable: bool = Field(True, description="true: every demand is zero until called with false")


class PalmMotorConfigRequest(BaseModel):
    """One FPID configuration, pushed to the given motors (ids or joint names; empty = all)."""

    model_config = ConfigDict(extra="forbid")
    motors: list[MotorRef] = Field(default_factory=list)
    torque_limit: int = Field(0, ge=0, le=0x7FFF)
    torque_limiter_gain: int = Field(0, ge=-0x200, le=0x200)
    max_pwm: int = Field(0, ge=0, le=0x3FF)
    sgl_ref: int = Field(0, ge=0, le=255)
    sgr_ref: int = Field(0, ge=0, le=255)
    f: int = Field(0, ge=0, le=0x7FFF)
    p: int = Field(0, ge=0, le=0x7FFF)
    i: int = Field(0, ge=0, le=0x7FFF)
    d: int = Field(0, ge=0, le=0x7FFF)
    imax: int = Field(0, ge=0, le=0x3FFF)
    deadband: int = Field(0, ge=0, le=255)
    sign: int = Field(0, ge=0, le=1)


class PalmMotorConfigReply(BaseModel):
    motors: list[int]
    crc: int


class PalmSystemControlsRequest(BaseModel):
    """MOTOR_SYSTEM_CONTROLS (and reset) for the given motors (ids or joint names; empty = all)."""

    model_config = ConfigDict(extra="forbid")
    motors: list[MotorRef] = Field(default_factory=list)
    reset: bool = False
    backlash: bool | None = Field(None, description="backlash compensation on/off")
    sgl_tracking: Literal[-1, 0, 1] = 0
    sgr_tracking: Literal[-1, 0, 1] = 0
    jiggle: bool = Field(False, description="start jiggling (re-zero the strain gauges)")
    write_eeprom: bool = Field(False, description="write the config to EEPROM")


class PalmSystemControlsReply(BaseModel):
    motors: list[int]
    controls: int
    reset: bool


class PalmAdcTestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout_ms: int = Field(1000, ge=20, le=10_000)


class PalmAdcChannel(BaseModel):
    name: str
    raw: int
    adc: int
    channel: int
    expected_adc: int
    expected_channel: int
    ok: bool


class PalmAdcTestReply(BaseModel):
    matches: bool
    mismatched: list[str]
    sensors: list[PalmAdcChannel]


class PalmCanFrameIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bus: Literal[1, 2] = 1
    sid: int = Field(ge=0, le=0x7FF)
    data: str = Field("", pattern=HEX8, description="up to 8 bytes as hex")


class PalmCanFrameOut(BaseModel):
    bus: int
    sid: int
    data: str
    cycle: int


class PalmSendCanRequest(BaseModel):
    """The seed's SendCanMessage: SID, length, data (hex)."""

    model_config = ConfigDict(extra="forbid")
    bus: Literal[1, 2] = 1
    sid: int = Field(ge=0, le=0x7FF)
    length: int | None = Field(None, ge=0, le=8, description="defaults to the data length")
    data: str = Field("", pattern=HEX8)
    window_ms: int = Field(50, ge=2, le=5000, description="how long to collect received frames")

    @model_validator(mode="after")
    def _length(self) -> PalmSendCanRequest:
        if self.length is not None and self.length > len(self.data) // 2:
            raise ValueError(f"length {self.length} but only {len(self.data) // 2} data bytes")
        return self


class PalmSendCanReply(BaseModel):
    sent: PalmCanFrameIn
    frames: list[PalmCanFrameOut]


class PalmBridgeLeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    holder: str = Field(min_length=1, max_length=100)
    ttl_ms: int = Field(2000, ge=100, le=60_000)


class PalmBridgeLease(BaseModel):
    lease_id: str
    expires_in_ms: int


class PalmBridgeReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lease_id: str


class PalmEmpty(BaseModel):
    pass


class PalmCanTx(BaseModel):
    """Frames for the leased bridge; queued, one to the wire per cycle; renews the lease."""

    lease_id: str
    frames: list[PalmCanFrameIn] = Field(max_length=4096)


class PalmCanRx(BaseModel):
    """Frames the bridge received since the last message (at most one message per cycle)."""

    lease_id: str
    frames: list[PalmCanFrameOut]


# ------------------------------------------------------------------------------------------- the contract
API = ServiceAPI("ethercat-loop", device_doc="one Shadow Dexterous Hand palm (EtherCAT, protocol 0220/0230)",
                 doc="Drives a Shadow hand palm at 1 kHz over EtherCAT; leases its CAN bridge to can-bootloader.")
JOINTS = API.state("joints", PalmJoints, rate_hz=100,
                   doc="Calibrated joint positions (rad) and the raw sensor words")
MOTORS = API.state("motors", PalmMotors, rate_hz=10,
                   doc="The 20 motors: torque, demands, flags, temperature, current, voltage, slow data")
TACTILE = API.state("tactile", PalmTactile, rate_hz=25, doc="Fingertip tactile sensors")
EXTRAS = API.state("palm_extras", PalmExtras, rate_hz=10, doc="IMU, auxiliary analog inputs, palm idle time")
LOOP = API.state("loop_stats", EthercatLoopStats, rate_hz=1,
                 doc="Cycle period, jitter p50/p99/max, overruns, drops and lost frames per 1 s window")
MOTOR_FAULT = API.event("motor_fault", PalmMotorFault)
STOPPED = API.event("stopped", PalmStopped)
SET_MODE = API.command("set_control_mode", PalmControlModeRequest, PalmAck,
                       doc="Torque or PWM control; switching zeroes every demand")
SET_DEMANDS = API.command("set_demands", PalmDemandsRequest, PalmDemandsReply,
                          doc="Demands by joint or motor id, range-checked for the mode; they expire after "
                              "demand_timeout_ms (default 100) unless renewed")
NULLIFY = API.command("nullify_demands", PalmNullifyRequest, PalmAck,
                      doc="Zero every demand now and, while enabled, keep them zero")
SET_CONFIG = API.command("set_motor_config", PalmMotorConfigRequest, PalmMotorConfigReply,
                         doc="Push an FPID config (one type per cycle, then the CRC)")
SYSTEM = API.command("system_controls", PalmSystemControlsRequest, PalmSystemControlsReply,
                     doc="Reset motors, backlash compensation, gauge tracking, jiggle, write EEPROM")
TEST_ADC = API.command("test_adc_channels", PalmAdcTestRequest, PalmAdcTestReply,
                       doc="The seed's TestADCChannelNumbers: read every sensor's ADC/channel id in "
                           "SENSOR_CHANNEL_NUMBERS mode and compare with the expected wiring")
SEND_CAN = API.command("send_can", PalmSendCanRequest, PalmSendCanReply,
                       doc="The seed's SendCanMessage: send one frame in CAN direct mode and return the frames "
                           "received within window_ms")
LEASE = API.command("bridge_lease", PalmBridgeLeaseRequest, PalmBridgeLease,
                    doc="Take (or renew) the exclusive CAN bridge: CAN direct mode, demands zero, until released "
                        "or the holder is quiet for ttl_ms; `busy` if another holder has it")
RELEASE = API.command("bridge_release", PalmBridgeReleaseRequest, PalmEmpty,
                      doc="Give the CAN bridge back; the hand returns to normal operation")
CAN_TX = API.stream("can_tx", PalmCanTx, "in",
                    doc="Frames for the leased CAN bridge (one per cycle to the wire); renews the lease")
CAN_RX = API.stream("can_rx", PalmCanRx, "out", doc="Frames received through the leased CAN bridge")


# ------------------------------------------------------------------------------------------- the lease
@dataclass
class _Lease:
    holder: str
    lease_id: str
    ttl_s: float
    expires: float


class BridgeLease:
    """The one exclusive owner of CAN direct mode (a remote holder, send_can or the ADC test)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: _Lease | None = None

    def acquire(self, holder: str, ttl_ms: int, now: float) -> _Lease:
        with self._lock:
            cur = self.current
            if cur is not None and cur.expires > now and cur.holder != holder:
                raise CommandError(ErrorCode.BUSY, f"the CAN bridge is leased by {cur.holder!r} for another "
                                                   f"{(cur.expires - now) * 1000:.0f} ms")
            if cur is not None and cur.holder == holder and cur.expires > now:
                cur.ttl_s, cur.expires = ttl_ms / 1000, now + ttl_ms / 1000
                return cur
            self.current = _Lease(holder, uuid.uuid4().hex[:16], ttl_ms / 1000, now + ttl_ms / 1000)
            return self.current

    def touch(self, lease_id: str, now: float) -> bool:
        with self._lock:
            cur = self.current
            if cur is None or cur.lease_id != lease_id or cur.expires <= now:
                return False
            cur.expires = now + cur.ttl_s
            return True

    def release(self, lease_id: str) -> bool:
        with self._lock:
            if self.current is None or self.current.lease_id != lease_id:
                return False
            self.current = None
            return True

    def expire(self, now: float) -> _Lease | None:
        """Drop the lease if its holder went quiet; returns the expired lease."""
        with self._lock:
            cur = self.current
            if cur is not None and cur.expires <= now:
                self.current = None
                return cur
            return None

    def holder(self, now: float) -> _Lease | None:
        with self._lock:
            cur = self.current
            return cur if cur is not None and cur.expires > now else None


def _frame_out(f: CanRxFrame) -> PalmCanFrameOut:
    return PalmCanFrameOut(bus=f.bus, sid=f.sid, data=f.data.hex(), cycle=f.cycle)


def _frame_in(f: PalmCanFrameIn) -> CanFrame:
    return CanFrame(f.bus, f.sid, bytes.fromhex(f.data))


# ------------------------------------------------------------------------------------------- the service
class PalmService:
    """Binds the commands, publishes state and health, owns the CAN bridge lease."""

    def __init__(self, node: Node, backend: HandBackend, settings: EthercatSettings) -> None:
        self.node = node
        self.backend = backend
        self.settings = settings
        self.dev: Device = node.device(settings.ethercat_device)
        self.lease = BridgeLease()
        # the same file the driver calibrates with (wherever the cycle runs): joint names -> motor ids
        self.joint_to_motor = dict(HandCalibration.load(settings.ethercat_calibration).motor_of_joint)
        self._lease_active: _Lease | None = None  # what the driver was last told
        self._lease_lock = threading.Lock()
        self._collect: list[CanRxFrame] | None = None
        self._stop = threading.Event()
        self._direct_until = 0.0  # ignore no-demand flags until then (CAN direct mode just ended)
        self._known_faults: dict[int, int] = {}
        self._mode: Literal["torque", "pwm"] = settings.ethercat_control_mode
        self._stopped = False
        backend.on_can_rx(self._on_can_rx)
        d = self.dev
        d.bind(SET_MODE, self.set_control_mode)
        d.bind(SET_DEMANDS, self.set_demands)
        d.bind(NULLIFY, self.nullify)
        d.bind(SET_CONFIG, self.set_motor_config)
        d.bind(SYSTEM, self.system_controls)
        d.bind(TEST_ADC, self.test_adc_channels)
        d.bind(SEND_CAN, self.send_can)
        d.bind(LEASE, self.bridge_lease)
        d.bind(RELEASE, self.bridge_release)
        d.on_stream(CAN_TX, self._on_can_tx)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.dev.set_health(connection=False, operational=False, state="starting", error=False, error_message="")
        self.backend.start()
        if self.settings.ethercat_push_config_on_start:
            # typical motor_board_effort_controllers values (reference §3.3)
            self.backend.submit(SetMotorConfig(tuple(range(NUM_MOTORS)), MotorConfig(
                torque_limit=400, torque_limiter_gain=64, max_pwm=500, f=500, p=6200, deadband=5)))

    def run(self) -> None:
        """Publisher and watchdog loop (node.run body)."""
        rates = {spec.name: self.settings.state_rates.get(spec.name, spec.rate_hz or 1.0)
                 for spec in (JOINTS, MOTORS, TACTILE, EXTRAS, LOOP)}
        cycle_hz = 1e6 / self.settings.ethercat_period_us
        tick = 1.0 / min(max(rates.values()), cycle_hz)
        due = dict.fromkeys(rates, 0.0)
        next_health = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            self._check_lease(now)
            names = [n for n, t in due.items() if now >= t]
            for n in names:
                due[n] = now + 1.0 / rates[n]
            snap = self.backend.snapshot() if names or now >= next_health else None
            if snap is not None:
                self._publish(names, snap)
            if now >= next_health:
                next_health = now + 0.25
                self._health(snap)
            self._stop.wait(max(0.0005, tick - (time.monotonic() - now)))

    def shutdown(self) -> None:
        """Node shutdown hook: zero demands, leave OP, say so, before the node goes offline."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self.backend.stop()
        rep = self.backend.stop_report()
        self.dev.emit(STOPPED, PalmStopped(ts=time.time(), zero_demand_cycles=int(rep.get("zero_demand_cycles", 0)),
                                           demands_sent_last=list(rep.get("demands_sent_last", [])),
                                           model_demands=list(rep.get("model_demands", []))))
        self.dev.set_health(connection=False, operational=False, state="stopped", error=False,
                            error_message="stopped: demands zeroed")

    # -- state and health -----------------------------------------------------------------------------
    def _publish(self, names: list[str], s: PalmSnapshot) -> None:
        ts = time.time()
        if "joints" in names and s.joints:
            self.dev.publish(JOINTS, PalmJoints(
                ts=ts, cycle=s.cycle, joints=[PalmJoint(name=j.name, position=j.position, raw=list(j.raw))
                                              for j in s.joints],
                sensors_raw=dict(zip(SENSOR_NAMES, s.sensors_raw, strict=True))))
        if "motors" in names:
            self.dev.publish(MOTORS, PalmMotors(ts=ts, mode=s.mode, phase=s.phase, motors=[PalmMotor(
                id=m.id, joint=m.joint, torque=m.torque, demand=m.demand, demand_sent=m.demand_sent, flags=m.flags,
                flag_names=list(m.flag_names), serious=m.serious, temperature=m.temperature, current=m.current,
                voltage=m.voltage, pwm=m.pwm, sgl=m.sgl, sgr=m.sgr,
                last_seen_s=None if m.last_seen_ns is None else round((s.now_ns - m.last_seen_ns) / 1e9, 4),
                missed=m.missed, data_errors=m.data_errors, slow=m.slow, can_received=m.can_received,
                can_transmitted=m.can_transmitted, can_errors=list(m.can_errors) if m.can_errors else None,
                terms=m.terms) for m in s.motors]))
        if "tactile" in names:
            self.dev.publish(TACTILE, PalmTactile(ts=ts, type=s.tactile_type, valid=s.tactile_valid,
                                                  sensors=[list(t) for t in s.tactile],
                                                  mid_prox=[list(t) for t in s.tactile_mid_prox],
                                                  aux_spi_type=s.aux_spi_type, aux_spi=list(s.aux_spi)))
        if "palm_extras" in names:
            self.dev.publish(EXTRAS, PalmExtras(ts=ts, accel=list(s.imu[:3]), gyro=list(s.imu[3:]),
                                                analog=list(s.analog), idle_time_us=s.idle_time_us))
        if "loop_stats" in names:
            self.dev.publish(LOOP, EthercatLoopStats(ts=ts, counters=dict(s.counters), **self.backend.stats()))

    def _health(self, s: PalmSnapshot | None) -> None:
        info = self.backend.info()
        stats = self.backend.stats()
        problems: list[str] = []
        if info.get("error"):
            problems.append(str(info["error"]))
        if stats.get("frames_lost", 0):
            problems.append(f"{stats['frames_lost']} frames lost in the last second")
        if stats.get("overruns", 0) > overrun_threshold(self.settings):
            problems.append(f"{stats['overruns']} overruns in the last second")
        if stats.get("drops", 0) > self.settings.ethercat_drop_threshold:
            problems.append(f"{stats['drops']} dropped statuses in the last second")
        state = str(info.get("state", "unknown"))
        direct = False
        if s is not None:
            direct = s.can_direct
            if direct:
                self._direct_until = time.monotonic() + 1.0
            quiet_flags = MotorFlag.NO_DEMAND_SEEN if time.monotonic() < self._direct_until else 0
            for m in s.motors:
                flags = (m.flags or 0) & ~quiet_flags
                bad = serious_flags(flags)
                if bad:
                    problems.append(f"motor {m.id} ({m.joint}): {', '.join(bad)}")
                    if self._known_faults.get(m.id) != flags:
                        self.dev.emit(MOTOR_FAULT, PalmMotorFault(ts=time.time(), motor=m.id, joint=m.joint,
                                                                  flags=m.flags or 0, serious=bad))
                self._known_faults[m.id] = flags if bad else 0
                silent_ns = self.settings.ethercat_silent_motor_ms * 1_000_000
                if (not direct and s.phase == "operation" and
                        (m.last_seen_ns is None or s.now_ns - m.last_seen_ns > silent_ns) and s.cycle > 1000):
                    problems.append(f"motor {m.id} ({m.joint}) not answering")
            if info.get("connected"):
                state = "can_direct" if direct else ("test_mode" if s.edc_command != EdcCommand.SENSOR_DATA
                                                     else ("initializing" if s.phase == "init" else "running"))
        connected = bool(info.get("connected"))
        self.dev.set_health(connection=connected, operational=connected and not direct and not problems
                            and (s is not None and s.phase == "operation"), state=state, error=bool(problems),
                            error_message="; ".join(problems[:6]),
                            details={k: info.get(k) for k in ("vendor", "product", "revision", "serial", "protocol",
                                                              "backend")})

    # -- helpers --------------------------------------------------------------------------------------
    def _submit(self, msg: ControlMessage) -> None:
        err = check_message(msg, self._mode)
        if err:
            raise CommandError(ErrorCode.INVALID_REQUEST, err)
        self.backend.submit(msg)

    def _require_normal(self) -> None:
        cur = self.lease.holder(time.monotonic())
        if cur is not None:
            raise CommandError(ErrorCode.BUSY, f"the CAN bridge is leased by {cur.holder!r}: the hand is in CAN "
                                               "direct mode and its demands are zero")
        if not self.backend.info().get("connected"):
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
    def set_control_mode(self, req: PalmControlModeRequest) -> PalmAck:
        self._require_normal()
        self._mode = req.mode
        self._submit(SetControlMode(req.mode))
        return PalmAck(message=f"{req.mode} mode; demands zeroed")

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
        self._submit(SetDemands(demands))
        return PalmDemandsReply(motors=demands, mode=self._mode, timeout_ms=self.settings.ethercat_demand_timeout_ms)

    def nullify(self, req: PalmNullifyRequest) -> PalmAck:
        self._submit(NullifyDemands(req.enable))
        return PalmAck(message="demands nullified" if req.enable else "demands enabled")

    def set_motor_config(self, req: PalmMotorConfigRequest) -> PalmMotorConfigReply:
        self._require_normal()
        motors = self._motor_ids(req.motors)
        cfg = MotorConfig(**req.model_dump(exclude={"motors"}))
        self._submit(SetMotorConfig(motors, cfg))
        return PalmMotorConfigReply(motors=list(motors), crc=config_crc(cfg.words()))

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

    def send_can(self, req: PalmSendCanRequest) -> PalmSendCanReply:
        if not self.backend.info().get("connected"):
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")
        data = bytes.fromhex(req.data)
        if req.length is not None:
            data = data[:req.length]
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
        return PalmSendCanReply(sent=sent, frames=[_frame_out(f) for f in got])

    def bridge_lease(self, req: PalmBridgeLeaseRequest) -> PalmBridgeLease:
        if req.holder.startswith("_"):
            raise CommandError(ErrorCode.INVALID_REQUEST, "holder names starting with '_' are reserved")
        if not self.backend.info().get("connected"):
            raise CommandError(ErrorCode.UNAVAILABLE, "the palm is not in OP")
        now = time.monotonic()
        lease = self.lease.acquire(req.holder, req.ttl_ms, now)
        with self._lease_lock:
            if self._lease_active is None or self._lease_active.lease_id != lease.lease_id:
                self._lease_active = lease
                self.backend.submit(SetCanDirect(True))
                log.info("CAN bridge leased", extra={"holder": req.holder, "lease_id": lease.lease_id})
        return PalmBridgeLease(lease_id=lease.lease_id, expires_in_ms=round((lease.expires - now) * 1000))

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
        if msg.frames:
            self.backend.submit(CanTx(tuple(_frame_in(f) for f in msg.frames)))

    def _on_can_rx(self, frames: list[CanRxFrame]) -> None:
        with self._lease_lock:
            lease = self._lease_active
            if self._collect is not None:
                self._collect.extend(frames)
                return
        if lease is not None:
            self.dev.stream_publish(CAN_RX, PalmCanRx(lease_id=lease.lease_id, frames=[_frame_out(f) for f in frames]))
