"""dexter-gateway's payloads: settings, the decoded status, commands, jobs. Names start with `Dexter`
(the AsyncAPI document has one schema namespace for every service)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.dexter_gateway.protocol import DEXRUN_PORT, MAX_REQUEST, Firmware
from shared.contract import NAME_RE

JointList = list[float]
ANGLE_LIMIT_DEG = 720.0
# J6 (wrist roll, degrees from its zero) and J7 (gripper) as the typed commands take them; the raw path holds a
# raw move to the same ranges (device.py `check_raw_motion`)
J6_MIN_DEG, J6_MAX_DEG = -150.0, 150.0
J7_MIN_DEG, J7_MAX_DEG = 0.0, 300.0


def _five(v: list[float], what: str, limit: float = ANGLE_LIMIT_DEG) -> list[float]:
    if len(v) != 5:
        raise ValueError(f"{what}: exactly 5 values (J1..J5), got {len(v)}")
    for x in v:
        if not math.isfinite(x) or abs(x) > limit:
            raise ValueError(f"{what}: {x} is not a finite value within ±{limit:g}")
    return v


# -- settings ---------------------------------------------------------------------------------------

class DexterRequest(BaseModel):
    """Every command's request: an unknown key is refused (`invalid_request` naming it), never dropped: a typo in an
    optional key (`j6deg`) must not move the arm without the value the caller meant."""

    model_config = ConfigDict(extra="forbid")


class DexterArmConfig(BaseModel):
    """One arm: where it is and how its link behaves (every timing a setting, so tests can shorten them)."""

    id: str = Field(description="Device name (topic level 3)")
    host: str
    port: int = Field(DEXRUN_PORT, ge=1, le=65535)
    firmware: Firmware = Field(Firmware.NEWEST, description="DexRun branch: stable (2020_02_04_ConeDrive) or "
                               "newest (Stable_Conedrive...): status modes, C/D, float directions")
    connect_timeout_s: float = Field(3.0, gt=0)
    reply_timeout_s: float = Field(2.0, gt=0, description="Per command, for oplets that answer at once")
    motion_timeout_s: float = Field(300.0, gt=0, description="F, w and S RunFile: until the motion FIFO drains")
    fifo_timeout_s: float = Field(120.0, gt=0, description="Queued moves: DexRun withholds the reply while the "
                                  "16-deep FIFO is full")
    keepalive_s: float = Field(10.0, gt=0, lt=30.0, description="A `g` after this much silence "
                               "(DexRun closes a connection idle for 30 s)")
    reconnect_min_s: float = Field(0.2, gt=0, description="First wait after a lost link (the kit's back-off)")
    reconnect_max_s: float = Field(2.0, gt=0, description="Cap of the doubling waits while the arm is lost")
    liveness_s: float = Field(3.0, gt=0, description="The liveness budget: valid DexRun replies must come within "
                              "this, or the arm is `silent` / `lost`, and one never reached (or not again) is "
                              "`unreachable`. The link sends a `g` after liveness_s - reply_timeout_s of silence "
                              "(the status poll sends more), so a hung arm's timeout falls within the budget")
    probe_period_s: float = Field(3.0, gt=0, description="An `unreachable` arm is probed once per period "
                                  "(connect and `g`); an arm that returns is operational within about this")
    queue_limit: int = Field(64, ge=1, le=10000, description="Commands waiting for the link; more get `busy`")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("id must be a single topic level: letters, digits, '_', '-', '.'")
        return v

    @model_validator(mode="after")
    def _budget(self) -> DexterArmConfig:
        if self.reconnect_max_s > self.liveness_s:
            raise ValueError(f"reconnect_max_s ({self.reconnect_max_s:g}) must not exceed liveness_s "
                             f"({self.liveness_s:g}): an arm that returns would not be found within one budget")
        if self.reply_timeout_s >= self.liveness_s:
            raise ValueError(f"reply_timeout_s ({self.reply_timeout_s:g}) must be below liveness_s "
                             f"({self.liveness_s:g}): a `g` that times out must end within one budget")
        return self


# -- status -----------------------------------------------------------------------------------------

class DexterErrorInfo(BaseModel):
    value: int = Field(description="int 5 of the reply as sent")
    code: int = Field(description="error & 255, or the errno for r / W / S RunFile")
    flags: list[str] = Field(default_factory=list, description="firmware_mismatch, span_servo_j7, roll_servo_j6, "
                             "boundary, monitor, stable_boundary, stable_monitor")
    message: str


class DexterJoint(BaseModel):
    angle_deg: float = Field(description="*_POSITION_AT: the current stepped goal")
    angle_rad: float
    angle_arcsec: int
    delta_deg: float = Field(description="position error (J4/J5 in 1/16 arcsec on the wire, as DDE reads them)")
    pid_delta_deg: float
    force_delta_deg: float
    measured_deg: float = Field(description="*_MEASURED_ANGLE (needs calibration)")
    measured_rad: float
    measured_arcsec: int
    sent_raw: int = Field(description="SENT_*: raw FPGA steps (not arcseconds)")
    sin_raw: int
    cos_raw: int


class DexterServo(BaseModel):
    position_units: int = Field(description="Dynamixel present position")
    load_units: int
    error_flags: int
    angle_deg: float
    angle_rad: float


class DexterStatus(BaseModel):
    """The standard status of a DexRun reply (g0 layout), or the raw ints of a firmware-specific g≠0 layout."""

    ts: float
    robot_time: float = Field(description="Robot clock (ints 2-3), seconds since 1970")
    instruction_id: int
    oplet: str
    error: DexterErrorInfo
    status_mode: str = Field(description="'0' = the standard layout; other modes are firmware-specific")
    joints: list[DexterJoint] | None = Field(None, description="J1 base, J2 pivot, J3 end, J4 angle, J5 rot")
    j6: DexterServo | None = Field(None, description="Wrist roll, Dynamixel ID 3 (J6 zero = 512 units)")
    j7: DexterServo | None = Field(None, description="Gripper span, Dynamixel ID 1")
    end_effector_io: int | None = None
    phui_button: bool | None = None
    raw: list[int] | None = Field(None, description="All 60 ints, for g≠0 layouts")


# -- commands ---------------------------------------------------------------------------------------

class DexterEmpty(DexterRequest):
    pass


class DexterMoveAllJoints(DexterRequest):
    joints_deg: JointList = Field(description="J1..J5 in degrees (sent as integer arcseconds)")
    j6_deg: float | None = Field(None, ge=J6_MIN_DEG, le=J6_MAX_DEG, description="Wrist roll, degrees from its zero")
    j7_deg: float | None = Field(None, ge=J7_MIN_DEG, le=J7_MAX_DEG, description="Gripper, degrees")

    @field_validator("joints_deg")
    @classmethod
    def _j(cls, v: list[float]) -> list[float]:
        return _five(v, "joints_deg")


class DexterMoveRelative(DexterRequest):
    joints_deg: JointList = Field(description="J1..J5 deltas in degrees")

    @field_validator("joints_deg")
    @classmethod
    def _j(cls, v: list[float]) -> list[float]:
        return _five(v, "joints_deg")


class DexterPidMove(DexterRequest):
    offsets_deg: JointList = Field(description="J1..J5 offsets added to the `a` position, degrees")
    j6_deg: float | None = Field(None, ge=J6_MIN_DEG, le=J6_MAX_DEG)
    j7_deg: float | None = Field(None, ge=J7_MIN_DEG, le=J7_MAX_DEG)

    @field_validator("offsets_deg")
    @classmethod
    def _j(cls, v: list[float]) -> list[float]:
        return _five(v, "offsets_deg")


class DexterArmPose(DexterRequest):
    right_arm: bool = True
    elbow_up: bool = True
    wrist_out: bool = True


class DexterMoveTo(DexterRequest):
    xyz: list[float] = Field(description="Target, in `units`")
    units: Literal["m", "um"] = "m"
    direction: list[float] = Field(default_factory=lambda: [0.0, 0.0, -1.0],
                                   description="J5 direction (unit vector; integers on the stable DexRun)")
    config: DexterArmPose = Field(default_factory=DexterArmPose)

    @field_validator("xyz", "direction")
    @classmethod
    def _three(cls, v: list[float]) -> list[float]:
        if len(v) != 3 or not all(math.isfinite(x) and abs(x) < 1e7 for x in v):
            raise ValueError("exactly 3 finite values")
        return v


class DexterMoveToStraight(DexterMoveTo):
    tool_speed_um_s: int | None = Field(None, ge=1, description="Sent as DDE's 10th argument (wire units)")
    resolution_um: int | None = Field(None, ge=1, description="DDE's 11th argument (wire units)")
    j6_deg: float | None = Field(None, ge=J6_MIN_DEG, le=J6_MAX_DEG)
    j7_deg: float | None = Field(None, ge=J7_MIN_DEG, le=J7_MAX_DEG)

    @model_validator(mode="after")
    def _positional(self) -> DexterMoveToStraight:
        # the extra arguments are positional: a later one needs every earlier one
        extras = [self.tool_speed_um_s, self.resolution_um, self.j6_deg, self.j7_deg]
        seen_none = False
        for x in extras:
            if x is None:
                seen_none = True
            elif seen_none:
                raise ValueError("tool_speed_um_s, resolution_um, j6_deg, j7_deg are positional: give every "
                                 "earlier one too")
        return self


class DexterSetParameter(DexterRequest):
    name: str = Field(description="A Params[] name (e.g. MaxSpeed, LinkLengths) or its index")
    value: float | None = Field(None, description="One value")
    values: list[float] | None = Field(None, min_length=1, max_length=5, description="Several (LinkLengths: L5..L1)")
    units: Literal["user", "wire"] = Field("user", description="user: deg/s, deg, m, converted as DDE does; "
                                           "wire: sent as given")

    @model_validator(mode="after")
    def _one(self) -> DexterSetParameter:
        if (self.value is None) == (self.values is None):
            raise ValueError("give exactly one of value / values")
        vals = [self.value] if self.value is not None else list(self.values or [])
        if not all(math.isfinite(v) for v in vals):
            raise ValueError("values must be finite")
        return self


class DexterSetBoundaries(DexterRequest):
    high_deg: JointList
    low_deg: JointList

    @model_validator(mode="after")
    def _check(self) -> DexterSetBoundaries:
        _five(self.high_deg, "high_deg")
        _five(self.low_deg, "low_deg")
        for j, (hi, lo) in enumerate(zip(self.high_deg, self.low_deg, strict=True), 1):
            if hi < lo:
                raise ValueError(f"J{j}: high {hi} is below low {lo}")
        return self


class DexterSleep(DexterRequest):
    seconds: float = Field(ge=0, le=3600, description="DexRun usleeps in its socket thread (the FIFO keeps running)")


class DexterWriteFpga(DexterRequest):
    address: int = Field(ge=0, le=89, description="Virtual address (OldMemMapInderection, 90 entries)")
    value: int = Field(ge=-(2**31), le=2**32 - 1)


class DexterStatusModeRequest(DexterRequest):
    mode: str = Field("0", min_length=1, max_length=1, description="'0' = standard; newest DexRun only")


class DexterRawCommand(DexterRequest):
    command: str = Field(min_length=1, max_length=MAX_REQUEST,
                         description="`<oplet> <args…>` (no header; a trailing ';' is allowed)")


class DexterReadBlock(BaseModel):
    error: DexterErrorInfo
    length: int
    text: str | None = None
    base64: str | None = None


class DexterCommandReply(BaseModel):
    request: str = Field(description="The request as sent (without the zero padding)")
    instruction_id: int
    oplet: str
    rtt_ms: float
    error: DexterErrorInfo
    status: DexterStatus | None = None
    read: DexterReadBlock | None = None


# -- jobs -------------------------------------------------------------------------------------------

class DexterWaitMotionDone(DexterRequest):
    timeout_s: float | None = Field(None, gt=0, le=86400, description="Default: the arm's motion_timeout_s")


class DexterMotionDone(BaseModel):
    waited_s: float
    status: DexterStatus | None


class DexterReadFile(DexterRequest):
    path: str = Field(min_length=1, max_length=200, description="A robot path, a #keyword (#POM, #measured_angles…) "
                      "or a backtick shell command (refused unless enabled and allowlisted)")
    encoding: Literal["auto", "text", "base64"] = "auto"
    max_bytes: int = Field(1 << 20, ge=1, le=64 << 20)


class DexterFileContent(BaseModel):
    path: str
    kind: Literal["file", "keyword", "shell"]
    bytes: int
    blocks: int
    text: str | None = None
    base64: str | None = None
    value: Any = Field(None, description="A #keyword decoded: #POM a 4×4 matrix, the others 5 integers")
    exit_status: int | None = Field(None, description="Shell: the wait status at EOF (0 = success)")


class DexterWriteFile(DexterRequest):
    path: str = Field(min_length=1, max_length=200)
    text: str | None = None
    base64: str | None = None
    verify: bool = Field(False, description="Read the file back and compare (DexRun does not report write errors)")

    @model_validator(mode="after")
    def _one(self) -> DexterWriteFile:
        if (self.text is None) == (self.base64 is None):
            raise ValueError("give exactly one of text / base64")
        return self


class DexterFileWritten(BaseModel):
    path: str
    bytes: int
    blocks: int
    verified: bool | None = None


class DexterRunFile(DexterRequest):
    path: str = Field(min_length=1, max_length=200, description="A file of ';'-terminated oplets on the robot")


class DexterRunFileResult(BaseModel):
    path: str
    error: DexterErrorInfo
    status: DexterStatus | None = None


__all__ = [name for name in dir() if name.startswith("Dexter")]

