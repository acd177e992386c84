"""roi-modules' payloads: state topics, commands, jobs, events (names prefixed Roi: one schema namespace)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.roi_modules import protocol as p
from shared.contract import NAME_RE

ModuleKind = Literal["gpio", "odrive", "actuator"]
PinModeName = Literal["input", "input_pullup", "output"]
PIN_MODE_CODES = {"input": p.PinMode.INPUT, "input_pullup": p.PinMode.INPUT_PULLUP, "output": p.PinMode.OUTPUT}
PIN_MODE_NAMES = {0: "unknown", **{int(v): k for k, v in PIN_MODE_CODES.items()}}


def _finite(v: float) -> float:
    if not p.fits_f32(v):
        raise ValueError("must be a finite number a float32 can carry")
    return v


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- configuration -------------------------------------------------------------------------------------------
class RoiModuleConfig(BaseModel):
    """One module: ROBOBUS_ROI_MODULES='[{"name":"wheel_fl","octet":70,"type":"odrive"}]'."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key fails at start (the launch file's did not, §5.5)
    name: str = Field(pattern=NAME_RE.pattern, description="Device name on the bus")
    octet: int = Field(ge=1, le=254, description="Last octet of the module's address")
    type: ModuleKind
    channel: int = Field(0, ge=0, le=1, description="Sub-device: the actuator (0/1); the ODrive is always 0")
    max_position: int = Field(p.ACTUATOR_FIRMWARE_MAX_TICKS, ge=1, le=0xFFFF,
                              description="Actuator: encoder ticks of 100 % (the firmware hard-codes 150)")
    default_velocity: float = Field(33.3, gt=0, le=1000,
                                    description="Actuator: %/s the position estimate assumes until a velocity is set")
    max_velocity: float | None = Field(None, gt=0, description="ODrive: |velocity| limit in rev/s for commands")
    max_torque: float | None = Field(None, gt=0, description="ODrive: |torque| limit in Nm for commands")
    tolerance: float | None = Field(None, gt=0, description="Jobs: done within this (rev or %); default from settings")
    pin_modes: dict[int, PinModeName] = Field(
        default_factory=dict, description="GPIO: pin modes the service sets when the module is blank (at start and "
                                          "after every reset), e.g. {\"3\": \"output\"}; configures the module")
    initial_mode: Literal["velocity", "torque"] | None = Field(
        None, description="ODrive: when the module is blank, switch it to this mode at a zero demand (0 rev/s or "
                          "0 Nm); configures the module")
    liveness_s: float | None = Field(None, gt=0, le=60,
                                     description="This module's liveness budget in s (default: roi_liveness_s)")
    stop_outputs: dict[int, Literal[0, 1]] = Field(
        default_factory=dict, description="GPIO: the level each of these output pins is set to when the bus stop "
                                          "becomes active (pins that drive something that moves), e.g. {\"3\": 0}; "
                                          "each must be an output in pin_modes. While the stop is active these "
                                          "pins take no set_pin_output / set_pin_mode (stopped). Other pins are "
                                          "left as they are")
    length_feedback: Literal["auto", "on", "off"] = Field(
        "auto", description="Actuator: GET_CURRENT_LENGTH replies as the measured position: on, off, or auto (from "
                            "the first non-zero length the module answers; released firmware answers 0)")

    @field_validator("pin_modes")
    @classmethod
    def _pins(cls, v: dict[int, PinModeName]) -> dict[int, PinModeName]:
        bad = sorted(pin for pin in v if pin not in p.GPIO_PINS)
        if bad:
            raise ValueError(f"pin(s) {bad} do not exist; valid: 0..7, 10..17")
        return v

    @model_validator(mode="after")
    def _per_type(self) -> RoiModuleConfig:
        # a key that does nothing for this module type is a mistake, refused at start like a misspelt one
        if self.pin_modes and self.type != "gpio":
            raise ValueError(f"module {self.name!r}: pin_modes is a GPIO setting, this module is {self.type}")
        if self.initial_mode is not None and self.type != "odrive":
            raise ValueError(f"module {self.name!r}: initial_mode is an ODrive setting, this module is {self.type}")
        if self.stop_outputs and self.type != "gpio":
            raise ValueError(f"module {self.name!r}: stop_outputs is a GPIO setting, this module is {self.type}")
        for pin in sorted(self.stop_outputs):
            if pin not in p.GPIO_OUTPUT_PINS:
                raise ValueError(f"module {self.name!r}: stop_outputs pin {pin} cannot be an output; valid: 0..7, "
                                 "10..15")
            if self.pin_modes.get(pin) != "output":
                raise ValueError(f"module {self.name!r}: stop_outputs pin {pin} must be an output in pin_modes "
                                 f"({{\"{pin}\": \"output\"}}), so that the service makes it one at start and "
                                 "after every reset and the stop's SET_OUTPUT is not refused")
        if self.length_feedback != "auto" and self.type != "actuator":
            raise ValueError(f"module {self.name!r}: length_feedback is an actuator setting, this module is "
                             f"{self.type}")
        return self


# -- state ---------------------------------------------------------------------------------------------------
class RoiPinStates(BaseModel):
    """GPIO pin modes by sub-device id 0..17 (8, 9 reserved): 0 unknown, 1 input, 2 input_pullup, 3 output."""

    modes: list[int] = Field(min_length=p.GPIO_COUNT, max_length=p.GPIO_COUNT)
    names: list[str] = Field(min_length=p.GPIO_COUNT, max_length=p.GPIO_COUNT)
    ts: float


class RoiPinValues(BaseModel):
    """GPIO values by sub-device id: 0/1 digital, 0..1023 analog; null for reserved or not yet read."""

    values: list[int | None] = Field(min_length=p.GPIO_COUNT, max_length=p.GPIO_COUNT)
    ts: float


class RoiMotionState(BaseModel):
    """ODrive: rev, rev/s, Nm (torque set-point). Actuator: % and %/s of max_position, estimated from commands
    (the firmware implements no getter, §3.7), torque null."""

    position: float | None
    velocity: float | None
    torque: float | None = None
    unit: Literal["rev", "percent"]
    estimated: bool = Field(description="True when not measured but estimated from the commands sent")
    ts: float


class RoiOdrivePower(BaseModel):
    voltage: float = Field(description="DC bus voltage, V")
    current: float = Field(description="DC bus current, A")
    ts: float


class RoiOdriveTemperature(BaseModel):
    fet_temperature: float = Field(description="degC")
    motor_temperature: float = Field(description="degC")
    ts: float


class RoiLinkStats(BaseModel):
    """The module's UDP link (ConnectionState of §5.2 and more), once a second."""

    connected: bool
    lost_packets_since_connect: int
    lost_packets_accumulated: int
    sent: int
    resent: int
    replies: int
    unmatched: int
    bad_checksum: int
    ts: float


class RoiFault(BaseModel):
    kind: Literal["disconnected", "connected", "module_reset", "module_error", "type_mismatch", "push_failed"]
    message: str
    ts: float


# -- commands ------------------------------------------------------------------------------------------------
class RoiEmpty(_Request):
    pass


class RoiAck(BaseModel):
    """The module acknowledged (its reply arrived) and accepted the command."""

    accepted: bool
    detail: str = ""


class RoiSetPinOutput(_Request):
    pin: int = Field(description="Sub-device id: 0..7 digital, 10..15 analog (16, 17 are read-only)")
    value: int = Field(ge=0, le=1)

    @field_validator("pin")
    @classmethod
    def _pin(cls, v: int) -> int:
        if v not in p.GPIO_OUTPUT_PINS:
            raise ValueError(f"pin {v} cannot be an output; valid: 0..7, 10..15")
        return v


class RoiSetPinMode(_Request):
    pin: int = Field(description="Sub-device id: 0..7 digital, 10..17 analog")
    mode: Literal["input", "input_pullup", "output"]

    @field_validator("pin")
    @classmethod
    def _pin(cls, v: int) -> int:
        if v not in p.GPIO_PINS:
            raise ValueError(f"pin {v} does not exist; valid: 0..7, 10..17")
        return v


class RoiGotoPosition(_Request):
    position: float = Field(description="ODrive: rev; actuator: % of max_position")
    velocity_feedforward: float = Field(0.0, description="ODrive: rev/s; actuator: %/s (0: keep)")
    torque_feedforward: float = Field(0.0, description="ODrive only, Nm")

    _f = field_validator("position", "velocity_feedforward", "torque_feedforward")(_finite)


class RoiSetVelocity(_Request):
    velocity: float = Field(description="ODrive: rev/s (velocity mode); actuator: %/s of later moves")
    torque_feedforward: float = Field(0.0, description="ODrive only, Nm")

    _f = field_validator("velocity", "torque_feedforward")(_finite)


class RoiSetTorque(_Request):
    torque: float = Field(description="Nm (torque mode)")

    _f = field_validator("torque")(_finite)


class RoiMoveRequest(RoiGotoPosition):
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Give up (and stop) after this long")
    tolerance: float | None = Field(None, gt=0, description="Done within this; default: the module's")


class RoiMoveResult(BaseModel):
    target: float
    position: float
    velocity: float
    unit: Literal["rev", "percent"]
    estimated: bool


class RoiQueueGeneral(_Request):
    """A raw general packet (the Queue Serialized Packet service of the original)."""

    sub_device_id: int = Field(0, ge=0, le=0xFFFF)
    action: int = Field(ge=0, le=0xFFFF)
    payload_hex: str = Field("", max_length=2 * p.PAYLOAD_SIZE, pattern=r"^([0-9a-fA-F]{2})*$")
    wait_reply: bool = Field(True, description="False: send once, take a reply if one comes, silence is no loss")
    retries: int | None = Field(None, ge=0, le=50, description="Resends; default the transport's")


class RoiQueueSysAdmin(_Request):
    action: int = Field(ge=0, le=0xFFFF)
    payload_hex: str = Field("", max_length=2 * p.PAYLOAD_SIZE, pattern=r"^([0-9a-fA-F]{2})*$")
    meta: int = Field(0, ge=0, le=0xFFFF)
    origin: int | None = Field(None, ge=0, le=255, description="Default: this host's octet")
    wait_reply: bool = True
    retries: int | None = Field(None, ge=0, le=50)


class RoiRawReply(BaseModel):
    replied: bool
    action: int | None = None
    sub_device_id: int | None = None
    meta: int | None = None
    origin: int | None = None
    payload_hex: str = ""


class RoiPong(BaseModel):
    operable: bool
    module_type: int
    module_type_name: str
    rtt_ms: float


class RoiStatusReport(BaseModel):
    state: int
    state_name: str
    message: str
    hours: int
    minutes: int
    seconds: int
    supply_voltage: float = Field(description="V (the firmware sends millivolts)")
    module_type: int
    module_type_name: str
    chain_neighbour: int
    mac: str


class RoiBlacklistRequest(_Request):
    op: Literal["add", "remove", "list"]
    octet: int | None = Field(None, ge=1, le=254)


class RoiBlacklistReply(BaseModel):
    op: str
    octet: int | None
    sent: bool
    confirmed: bool = Field(description="The module answered (the a1c7216/HEAD firmware never does, §3.2)")
    octets: list[int] = Field(description="LIST: the module's list when it answers, else what this service added")
    note: str = ""


def finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None
