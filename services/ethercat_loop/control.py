"""Control messages: what the MQTT side asks of the palm driver, each with its own `validate` and `apply`.

A message is a small frozen dataclass (picklable: it crosses the pipe to the cycle process). The service
validates it once, before submitting (`validate(mode)`: None, or why not, answered as `invalid_request`);
the cycle applies it (`apply(driver)`) without checking again: both ends belong to one node, and the
control mode a demand was checked against travels down the same ordered pipe as the mode switch.

`apply` only calls the operations of `DriverControls`, which `PalmDriver` implements, so this module does
not import the driver (no import cycle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

from services.ethercat_loop.protocol import (
    CONFIG_TYPES,
    DEMAND_RANGES,
    NUM_MOTORS,
    SYSTEM_RESET_MAGIC,
    EdcCommand,
    FromMotorDataType,
    ToMotorDataType,
    config_crc,
)

ControlMode = Literal["torque", "pwm"]

# motor_data_polling.yaml keys -> FROM_MOTOR data types
POLL_TYPES: dict[str, FromMotorDataType] = {
    "sgl": FromMotorDataType.SGL, "sgr": FromMotorDataType.SGR, "pwm": FromMotorDataType.PWM,
    "flags": FromMotorDataType.FLAGS, "current": FromMotorDataType.CURRENT, "voltage": FromMotorDataType.VOLTAGE,
    "temperature": FromMotorDataType.TEMPERATURE, "can_num_received": FromMotorDataType.CAN_NUM_RECEIVED,
    "can_num_transmitted": FromMotorDataType.CAN_NUM_TRANSMITTED, "slow_data": FromMotorDataType.SLOW_MISC,
    "can_error_counters": FromMotorDataType.CAN_ERROR_COUNTERS, "pterm": FromMotorDataType.PTERM,
    "iterm": FromMotorDataType.ITERM, "dterm": FromMotorDataType.DTERM,
}


class DriverControls(Protocol):
    """The operations control messages perform on the driver (implemented by `PalmDriver`)."""

    mode: ControlMode
    nullified: bool
    edc_mode: int

    def queue_demands(self, demands: dict[int, int], deadline_ns: int | None = None) -> None: ...
    def set_mode(self, mode: ControlMode) -> None: ...
    def halt(self, enable: bool) -> None: ...
    def bus_stop(self, seq: int) -> None: ...
    def queue_to_motors(self, kind: int, words: dict[int, int], config: bool) -> None: ...
    def set_can_direct(self, enable: bool, flush: bool) -> None: ...
    def queue_can_tx(self, frames: tuple[CanFrame, ...]) -> None: ...
    def set_polling(self, rates: dict[str, float]) -> None: ...
    def reinitialize(self) -> None: ...


def _motors_ok(ms: tuple[int, ...]) -> str | None:
    bad = [m for m in ms if not 0 <= m < NUM_MOTORS]
    return f"motor ids {bad} not in 0..{NUM_MOTORS - 1}" if bad else None


class _Message(ABC):
    """Base: valid unless a message says otherwise."""

    def validate(self, mode: ControlMode) -> str | None:
        return None

    @abstractmethod
    def apply(self, d: DriverControls) -> None:
        """Change the driver's controls (in the cycle process; validated before it was sent)."""


@dataclass(frozen=True)
class SetControlMode(_Message):
    """Torque (the motors' FPID loop) or PWM (straight to the H-bridge). Switching zeroes all demands."""

    mode: ControlMode

    def validate(self, mode: ControlMode) -> str | None:
        return None if self.mode in ("torque", "pwm") else f"unknown control mode {self.mode!r}"

    def apply(self, d: DriverControls) -> None:
        d.set_mode(self.mode)


@dataclass(frozen=True)
class SetDemands(_Message):
    """motor id -> demand; each value stays valid for `demand_timeout_ms` from the cycle it reached, and never past
    `deadline_ns` (CLOCK_MONOTONIC ns: the client's own deadline for the request, from its send time; None: it gave
    none). One whose deadline passed before it reached the cycle never takes effect."""

    demands: dict[int, int]
    deadline_ns: int | None = None

    def validate(self, mode: ControlMode) -> str | None:
        err = _motors_ok(tuple(self.demands))
        if err:
            return err
        lo, hi = DEMAND_RANGES[ToMotorDataType.DEMAND_TORQUE if mode == "torque" else ToMotorDataType.DEMAND_PWM]
        bad = {m: v for m, v in self.demands.items() if not lo <= v <= hi}
        return f"demands {bad} out of the {mode} range {lo}..{hi}" if bad else None

    def apply(self, d: DriverControls) -> None:
        d.queue_demands(self.demands, self.deadline_ns)


@dataclass(frozen=True)
class NullifyDemands(_Message):
    """While enabled, every demand is zero (the original `nullify_demand` service)."""

    enable: bool = True

    def apply(self, d: DriverControls) -> None:
        d.nullified = self.enable


@dataclass(frozen=True)
class BusStop(_Message):
    """The bus-wide software stop (docs/kit.md, "Stopping everything"): every demand zero from the next frame on
    and kept zero (the original `nullify_demand`'s effect), the demands held so far forgotten (nothing resumes
    after the release: a motor moves again only on a new demand), queued jiggling dropped. `seq` numbers the
    stops: the cycle reports when the first frame built after it left (`PalmDriver.stop_seq`)."""

    seq: int

    def apply(self, d: DriverControls) -> None:
        d.bus_stop(self.seq)


@dataclass(frozen=True)
class MotorConfig:
    """The FPID configuration of one motor (TO_MOTOR config types 0x5..0xE)."""

    torque_limit: int = 0
    torque_limiter_gain: int = 0
    max_pwm: int = 0
    sgl_ref: int = 0
    sgr_ref: int = 0
    f: int = 0
    p: int = 0
    i: int = 0
    d: int = 0
    imax: int = 0
    deadband: int = 0
    sign: int = 0

    def words(self) -> dict[int, int]:
        t = ToMotorDataType
        return {
            t.CONFIG_TORQUE_LIMIT: self.torque_limit & 0xFFFF,
            t.CONFIG_TORQUE_LIMITER_GAIN: self.torque_limiter_gain & 0xFFFF,
            t.CONFIG_MAX_PWM: self.max_pwm & 0xFFFF,
            t.CONFIG_SG_REFS: (self.sgl_ref & 0xFF) | ((self.sgr_ref & 0xFF) << 8),
            t.CONFIG_F: self.f & 0xFFFF, t.CONFIG_P: self.p & 0xFFFF, t.CONFIG_I: self.i & 0xFFFF,
            t.CONFIG_D: self.d & 0xFFFF, t.CONFIG_IMAX: self.imax & 0xFFFF,
            t.CONFIG_DEADBAND_SIGN: (self.deadband & 0xFF) | ((self.sign & 0xFF) << 8),
        }

    def check(self) -> str | None:
        t = ToMotorDataType
        vals = {t.CONFIG_TORQUE_LIMIT: self.torque_limit, t.CONFIG_TORQUE_LIMITER_GAIN: self.torque_limiter_gain,
                t.CONFIG_MAX_PWM: self.max_pwm, t.CONFIG_F: self.f, t.CONFIG_P: self.p, t.CONFIG_I: self.i,
                t.CONFIG_D: self.d, t.CONFIG_IMAX: self.imax}
        for k, v in vals.items():
            lo, hi = DEMAND_RANGES[k]
            if not lo <= v <= hi:
                return f"{k.name.lower()[7:]} {v} out of range {lo}..{hi}"
        for name, v, hi in (("sgl_ref", self.sgl_ref, 255), ("sgr_ref", self.sgr_ref, 255),
                            ("deadband", self.deadband, 255), ("sign", self.sign, 1)):
            if not 0 <= v <= hi:
                return f"{name} {v} out of range 0..{hi}"
        return None


@dataclass(frozen=True)
class SetMotorConfig(_Message):
    """Push a config to some motors: one type per cycle, ending with the CRC."""

    motors: tuple[int, ...]
    config: MotorConfig

    def validate(self, mode: ControlMode) -> str | None:
        return _motors_ok(self.motors) or self.config.check()

    def apply(self, d: DriverControls) -> None:
        words = self.config.words()
        for t in CONFIG_TYPES:
            d.queue_to_motors(t, dict.fromkeys(self.motors, words[t]), config=True)
        d.queue_to_motors(ToMotorDataType.CONFIG_CRC, dict.fromkeys(self.motors, config_crc(words)), config=True)


@dataclass(frozen=True)
class SystemControls(_Message):
    """MOTOR_SYSTEM_CONTROLS bits for some motors (backlash, gauge tracking, jiggle, EEPROM write)."""

    motors: tuple[int, ...]
    controls: int

    def validate(self, mode: ControlMode) -> str | None:
        return _motors_ok(self.motors) or (None if 0 < self.controls <= 0xFF else "controls must be 1..0xFF")

    def apply(self, d: DriverControls) -> None:
        d.queue_to_motors(ToMotorDataType.SYSTEM_CONTROLS, dict.fromkeys(self.motors, self.controls), config=False)


@dataclass(frozen=True)
class ResetMotors(_Message):
    motors: tuple[int, ...]

    def validate(self, mode: ControlMode) -> str | None:
        return _motors_ok(self.motors)

    def apply(self, d: DriverControls) -> None:
        d.queue_to_motors(ToMotorDataType.SYSTEM_RESET, {m: SYSTEM_RESET_MAGIC | (m % 10) for m in self.motors},
                          config=False)


@dataclass(frozen=True)
class SetTestMode(_Message):
    """EDC_command for the coming cycles: SENSOR_DATA (normal), SENSOR_CHANNEL_NUMBERS or SENSOR_ADC_CHANNEL_CS."""

    edc_command: int

    def validate(self, mode: ControlMode) -> str | None:
        ok = (EdcCommand.SENSOR_DATA, EdcCommand.SENSOR_CHANNEL_NUMBERS, EdcCommand.SENSOR_ADC_CHANNEL_CS)
        return None if self.edc_command in ok else f"EDC_command {self.edc_command} is not a sensor mode"

    def apply(self, d: DriverControls) -> None:
        d.edc_mode = self.edc_command


@dataclass(frozen=True)
class SetCanDirect(_Message):
    """CAN direct mode (the bridge lease): no demands, the CAN-bridge frames go to and from the buses."""

    enable: bool
    flush: bool = True  # drop frames still queued for the wire

    def apply(self, d: DriverControls) -> None:
        d.set_can_direct(self.enable, self.flush)


@dataclass(frozen=True)
class CanFrame:
    bus: int  # 1 or 2
    sid: int  # 11-bit
    data: bytes  # up to 8 bytes


@dataclass(frozen=True)
class CanTx(_Message):
    """Frames for the bridge, one per cycle in CAN direct mode."""

    frames: tuple[CanFrame, ...]

    def validate(self, mode: ControlMode) -> str | None:
        for f in self.frames:
            if f.bus not in (1, 2) or not 0 <= f.sid <= 0x7FF or len(f.data) > 8:
                return f"bad CAN frame {f}"
        return None

    def apply(self, d: DriverControls) -> None:
        d.queue_can_tx(self.frames)


@dataclass(frozen=True)
class CanRxFrame:
    bus: int
    sid: int
    data: bytes
    cycle: int  # the driver cycle whose status carried it


@dataclass(frozen=True)
class Halt(_Message):
    """Zero every demand from the next cycle on (shutdown, leaving OP)."""

    enable: bool = True

    def apply(self, d: DriverControls) -> None:
        d.halt(self.enable)


@dataclass(frozen=True)
class SetPolling(_Message):
    """Replace the motor data polling schedule (keys and semantics of motor_data_polling.yaml)."""

    rates: dict[str, float]

    def validate(self, mode: ControlMode) -> str | None:
        bad_keys = sorted(set(self.rates) - set(POLL_TYPES))
        if bad_keys:
            return f"unknown polling keys {bad_keys}"
        bad_vals = {k: v for k, v in self.rates.items() if not (v in (-1, -2) or v > 0)}
        return f"polling rates must be -1, -2 or > 0 s: {bad_vals}" if bad_vals else None

    def apply(self, d: DriverControls) -> None:
        d.set_polling(self.rates)


@dataclass(frozen=True)
class ReinitializeMotors(_Message):
    """Start the initialisation phase again (after a motor was flashed or reset)."""

    def apply(self, d: DriverControls) -> None:
        d.reinitialize()


ControlMessage = (SetControlMode | SetDemands | NullifyDemands | BusStop | SetMotorConfig | SystemControls | ResetMotors
                  | SetTestMode | SetCanDirect | CanTx | Halt | SetPolling | ReinitializeMotors)
