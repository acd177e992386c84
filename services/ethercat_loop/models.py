"""ethercat-loop's message models: state, events, command requests and replies, bridge streams.

Every model is named Palm*/Ethercat* so it stays unique in the AsyncAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

HEX8 = r"^([0-9a-fA-F]{2}){0,8}$"


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
    overruns: int = Field(0, description="releases missed: cycles that could not start within their own period "
                                         "(skipped, never run back to back); a cycle that merely ran past the "
                                         "next release starts that one late instead")
    drops: int = 0
    frames_lost: int = 0
    decode_errors: int = 0
    cycles: int = 0
    window_s: float = 0.0
    late_frames: int = Field(0, description="replies later than ETHERCAT_LATE_US in the window (wire backends)")
    wkc_errors: int = Field(0, description="replies with a wrong working counter in the window (wire backends)")
    no_status: int = Field(0, description="cycles without a valid status in the window")
    total_cycles: int = 0
    total_overruns: int = 0
    counters: dict[str, int] = Field(default_factory=dict, description="driver counters since start")
    totals: dict[str, Any] | None = Field(None, description="wire backends: counters and percentiles since start")
    realtime: dict[str, Any] | None = Field(None, description="wire backends: the cycle's scheduling policy and "
                                                              "the realtime settings it was refused")


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
