"""The ROI ("Roobot Over IP") wire format: pure code, no I/O, no clock.

Followed byte for byte: docs/reference/roi.md (§2 packet layouts, §3 code tables), which reads the
firmware at UA-NASA-Robotics/Roobot-Over-IP a1c7216 (values identical at HEAD). Where the seed
(002, InterfaceReadMe.md) and the note disagree, the note wins (it says the firmware sends millivolts, not
V x 100, and the MAC is STATUS bytes 8..13, not 7..12).

Two layouts, never mixed (the original host sliced SysAdmin packets into the general layout, §4.5):

    general  (port 57344): subDeviceID u16 | actionCode u16 | checksum u16 | payload[56]
    sysAdmin (port 57664): adminMetaData u16 | originHostOctet u8 | actionCode u16 | checksum u16 | payload[56]

Both big-endian; the checksum is a 16-bit wrap-around sum of the header fields (as whole values) plus every
one of the 56 payload bytes (padding included). Both ends put 64 bytes on the wire (§2.1): the general frame
is 62 meaningful bytes plus 2 stale ones, the sysAdmin frame 63 plus 1.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum

GENERAL_PORT = 57344  # ROI_GENERAL_PORT 0xE000
STREAM_PORT = 57600  # ROI_STREAM_PORT 0xE100: reserved, unused by the firmware
SYSADMIN_PORT = 57664  # ROI_SYS_ADMIN_PORT 0xE140
DATAGRAM_SIZE = 64  # ROI_MAX_PACKET_SIZE: what both ends put on the wire
PAYLOAD_SIZE = 56  # ROI_MAX_PACKET_PAYLOAD
GENERAL_HEADER = 6
SYSADMIN_HEADER = 7

_GENERAL = struct.Struct(">HHH")
_SYSADMIN = struct.Struct(">HBHH")
_F32 = struct.Struct(">f")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class DecodeError(ValueError):
    """Bytes that are not a valid ROI packet; `reason` is a short stable code for counting."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- packets -------------------------------------------------------------------------------------------------
def _pad(payload: bytes) -> bytes:
    if len(payload) > PAYLOAD_SIZE:
        raise ValueError(f"payload is {len(payload)} bytes; a ROI packet carries at most {PAYLOAD_SIZE}")
    return payload + bytes(PAYLOAD_SIZE - len(payload))


def _check_u16(name: str, v: int) -> None:
    if not 0 <= v <= 0xFFFF:
        raise ValueError(f"{name} {v} does not fit in 16 bits")


def general_checksum(sub_device_id: int, action: int, payload: bytes) -> int:
    """§2.3: subDeviceID + actionCode + sum(data[0..55]) mod 2^16 (payload zero-padded to 56 bytes)."""
    return (sub_device_id + action + sum(_pad(payload))) & 0xFFFF


def sysadmin_checksum(meta: int, origin: int, action: int, payload: bytes) -> int:
    """§2.3: adminMetaData + originHostOctet + actionCode + sum(data[0..55]) mod 2^16."""
    return (meta + origin + action + sum(_pad(payload))) & 0xFFFF


@dataclass(frozen=True, slots=True)
class GeneralPacket:
    """A general packet (port 57344). `payload` is what the sender filled in; encode pads it to 56 bytes."""

    sub_device_id: int
    action: int
    payload: bytes = b""

    def __post_init__(self) -> None:
        _check_u16("subDeviceID", self.sub_device_id)
        _check_u16("actionCode", self.action)
        _pad(self.payload)

    @property
    def checksum(self) -> int:
        return general_checksum(self.sub_device_id, self.action, self.payload)

    def encode(self) -> bytes:
        """64 bytes, as both ends send them: header, 56-byte payload, 2 trailing zero bytes."""
        return _GENERAL.pack(self.sub_device_id, self.action, self.checksum) + _pad(self.payload) + b"\0\0"

    def reply(self, payload: bytes = b"") -> GeneralPacket:
        """§2.6 swapReply: same subDeviceID and actionCode, the module fills in the payload."""
        return GeneralPacket(self.sub_device_id, self.action, payload)


@dataclass(frozen=True, slots=True)
class SysAdminPacket:
    """A SysAdmin packet (port 57664), in its own layout (§2.2)."""

    action: int
    payload: bytes = b""
    meta: int = 0  # NO_CHAIN_META
    origin: int = 0  # originHostOctet: who started a chain message

    def __post_init__(self) -> None:
        _check_u16("adminMetaData", self.meta)
        _check_u16("actionCode", self.action)
        if not 0 <= self.origin <= 0xFF:
            raise ValueError(f"originHostOctet {self.origin} does not fit in 8 bits")
        _pad(self.payload)

    @property
    def checksum(self) -> int:
        # always computed: the firmware computes it only when its uninitialised field happens to be 0 (§2.2)
        return sysadmin_checksum(self.meta, self.origin, self.action, self.payload)

    @property
    def chained(self) -> bool:
        return bool(self.meta & CHAIN_MESSAGE_META)

    def encode(self) -> bytes:
        """64 bytes: 7-byte header, 56-byte payload, 1 trailing zero byte."""
        return _SYSADMIN.pack(self.meta, self.origin, self.action, self.checksum) + _pad(self.payload) + b"\0"


def decode_general(data: bytes, *, verify: bool = True) -> tuple[GeneralPacket, bool]:
    """Parse a general datagram -> (packet with the full 56-byte payload, checksum ok).

    Like the firmware's import: at least 6 bytes, up to 56 payload bytes (a shorter payload is zero-filled,
    the bytes past 62 are the stale tail). With `verify`, a checksum mismatch raises (the host side enforces
    it, §2.4); the module side (the simulator) passes verify=False, as the firmware ignores it."""
    if len(data) < GENERAL_HEADER:
        raise DecodeError("short", f"general packet of {len(data)} bytes; the header alone is {GENERAL_HEADER}")
    if len(data) > DATAGRAM_SIZE:
        raise DecodeError("long", f"general packet of {len(data)} bytes; ROI datagrams are at most {DATAGRAM_SIZE}")
    sub, action, checksum = _GENERAL.unpack_from(data)
    payload = _pad(bytes(data[GENERAL_HEADER:GENERAL_HEADER + PAYLOAD_SIZE]))
    pkt = GeneralPacket(sub, action, payload)
    ok = pkt.checksum == checksum
    if verify and not ok:
        raise DecodeError("checksum", f"general packet checksum 0x{checksum:04x}, computed 0x{pkt.checksum:04x} "
                                      f"(sub-device {sub}, action 0x{action:04x})")
    return pkt, ok


def decode_sysadmin(data: bytes, *, verify: bool = True) -> tuple[SysAdminPacket, bool]:
    """Parse a SysAdmin datagram -> (packet, checksum ok); at least 7 bytes (§2.2)."""
    if len(data) < SYSADMIN_HEADER:
        raise DecodeError("short", f"sysAdmin packet of {len(data)} bytes; the header alone is {SYSADMIN_HEADER}")
    if len(data) > DATAGRAM_SIZE:
        raise DecodeError("long", f"sysAdmin packet of {len(data)} bytes; ROI datagrams are at most {DATAGRAM_SIZE}")
    meta, origin, action, checksum = _SYSADMIN.unpack_from(data)
    payload = _pad(bytes(data[SYSADMIN_HEADER:SYSADMIN_HEADER + PAYLOAD_SIZE]))
    pkt = SysAdminPacket(action, payload, meta, origin)
    ok = pkt.checksum == checksum
    if verify and not ok:
        raise DecodeError("checksum", f"sysAdmin packet checksum 0x{checksum:04x}, computed 0x{pkt.checksum:04x} "
                                      f"(action 0x{action:04x})")
    return pkt, ok


# -- scalars (§2.5: IEEE-754 single, MSB first; integers big-endian) ------------------------------------------
def f32(value: float) -> bytes:
    return _F32.pack(value)


def read_f32(payload: bytes, offset: int = 0) -> float:
    return float(_F32.unpack_from(payload, offset)[0])


def u16(value: int) -> bytes:
    return _U16.pack(value)


def read_u16(payload: bytes, offset: int = 0) -> int:
    return int(_U16.unpack_from(payload, offset)[0])


def u32(value: int) -> bytes:
    return _U32.pack(value)


def read_u32(payload: bytes, offset: int = 0) -> int:
    return int(_U32.unpack_from(payload, offset)[0])


def fits_f32(value: float) -> bool:
    """A finite value a float32 can carry (so a request never puts inf on the wire by overflow)."""
    return math.isfinite(value) and abs(value) <= 3.4028234663852886e38


# -- §3.1 SysAdmin -------------------------------------------------------------------------------------------
NO_CHAIN_META = 0x0000
CHAIN_MESSAGE_META = 0x8000


class SysAdminAction(IntEnum):
    BLANK = 0x0000  # never sent: a module does not reply when its reply would be BLANK
    PING = 0x4000
    PONG = 0xC000
    PING_LOOP_BACK = 0x2000
    STATUS_REPORT = 0xA000
    BLACK_LIST = 0x6000
    FIRMWARE_REPORT = 0xE000  # HEAD firmware only


def chain_meta(reply_octet: int) -> int:
    """Chain flag with the reply-host octet OR-ed into the low byte (the firmware used `||`, §6.4)."""
    return CHAIN_MESSAGE_META | (reply_octet & 0xFF)


def sysadmin_reply_action(request_action: int) -> int:
    """The action code a module's reply carries: PING is answered by PONG, the others keep their code."""
    return SysAdminAction.PONG if request_action == SysAdminAction.PING else request_action


# -- §3.3 module states --------------------------------------------------------------------------------------
class ModuleState(IntEnum):
    NULL_CODE = 0
    OPERATING = 1
    OPERATING_WITH_ERRORS = 2
    OPERATING_WITHOUT_CHAIN = 3
    NOT_OPERABLE = 4
    INITIALIZING = 5
    BLANK_STATE = 6


STATE_MESSAGES: dict[int, str] = {  # base.cpp::_statusReportToHealthMessage
    0: "Null Code, Miscommunication, check code.",
    1: "OK",
    2: "Operational, internal error, check hardware.",
    3: "Operational, no chain formed.",
    4: "Not operable, hard error.",
    5: "Initializing, not ready for operation.",
    6: "Blank state, requires configuration before use.",
}
OPERATIONAL_STATES = frozenset({1, 2, 3})
ERROR_STATES = frozenset({2, 4})


def state_name(code: int) -> str:
    try:
        return ModuleState(code).name.lower()
    except ValueError:
        return f"unknown_{code}"


class BlacklistOp(IntEnum):
    NULL_CODE = 0
    BLACKLISTED = 1
    ADD = 2
    REMOVE = 3
    LIST = 4


# -- §3.4 module types ---------------------------------------------------------------------------------------
class ModuleType(IntEnum):
    MASTER_SBC = 2
    GENERAL_GPIO = 3
    O_DRIVE = 4
    ACTUATOR = 5


MODULE_TYPE_NAMES = {2: "master_sbc", 3: "gpio", 4: "odrive", 5: "actuator"}


def module_type_name(code: int) -> str:
    return MODULE_TYPE_NAMES.get(code, "reserved" if code in (0, 1) else f"unknown_{code}")


# -- §3.2 SysAdmin payloads ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pong:
    operable: bool
    module_type: int

    def encode(self) -> bytes:
        return bytes([int(self.operable), self.module_type & 0xFF])

    @classmethod
    def decode(cls, payload: bytes) -> Pong:
        return cls(operable=payload[0] != 0, module_type=payload[1])


STATUS_REPORT_SIZE = 14


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The 14-byte STATUS_REPORT reply (§3.2)."""

    state: int
    hours: int
    minutes: int
    seconds: int
    supply_mv: int  # the firmware measures millivolts (getAccurateVCC); the docs' "V x 100" is wrong
    module_type: int
    neighbour: int
    mac: bytes  # bytes 8..13; the original host read 7..12 and got the neighbour octet in front

    @property
    def supply_volts(self) -> float:
        return self.supply_mv / 1000.0  # the original divided by 100: 10x too high

    @property
    def uptime_s(self) -> int:
        return self.hours * 3600 + self.minutes * 60 + self.seconds

    @property
    def mac_text(self) -> str:
        return ":".join(f"{b:02x}" for b in self.mac)

    def encode(self) -> bytes:
        if len(self.mac) != 6:
            raise ValueError("a MAC is 6 bytes")
        return bytes([self.state, self.hours & 0xFF, self.minutes, self.seconds]) + u16(self.supply_mv) + bytes(
            [self.module_type, self.neighbour]) + self.mac

    @classmethod
    def decode(cls, payload: bytes) -> StatusReport:
        if len(payload) < STATUS_REPORT_SIZE:
            raise DecodeError("short", f"STATUS_REPORT payload of {len(payload)} bytes, need {STATUS_REPORT_SIZE}")
        return cls(state=payload[0], hours=payload[1], minutes=payload[2], seconds=payload[3],
                   supply_mv=read_u16(payload, 4), module_type=payload[6], neighbour=payload[7],
                   mac=bytes(payload[8:14]))


def blacklist_payload(op: BlacklistOp, octet: int = 0) -> bytes:
    if op not in (BlacklistOp.ADD, BlacklistOp.REMOVE, BlacklistOp.LIST):
        raise ValueError(f"blacklist sub-action must be ADD, REMOVE or LIST, got {op!r}")
    if not 0 <= octet <= 255:
        raise ValueError(f"octet {octet} out of range")
    return bytes([op, octet])


def decode_blacklist_list(payload: bytes) -> list[int]:
    """LIST reply: up to 56 blacklisted octets; 0 is no host, so it ends the list."""
    out = []
    for b in payload[:PAYLOAD_SIZE]:
        if b == 0:
            break
        out.append(b)
    return out


def decode_firmware_report(payload: bytes) -> tuple[str, str]:
    """FIRMWARE_REPORT (HEAD): [0] = length, then `__TIME__` "\\n" `__DATE__` -> (time, date)."""
    n = payload[0]
    if n == 0 or n > PAYLOAD_SIZE - 1:
        raise DecodeError("length", f"FIRMWARE_REPORT length byte {n} out of range 1..{PAYLOAD_SIZE - 1}")
    text = bytes(payload[1:1 + n]).decode("ascii", errors="replace")
    time_s, _, date_s = text.partition("\n")
    return time_s, date_s


def encode_firmware_report(time_s: str, date_s: str) -> bytes:
    text = f"{time_s}\n{date_s}".encode("ascii")
    return bytes([len(text)]) + text


# -- §3.5 General GPIO ---------------------------------------------------------------------------------------
class GpioAction(IntEnum):
    SET_PIN_MODE = 0x0001
    SET_OUTPUT = 0x0002
    READ = 0x0003


class PinMode(IntEnum):
    INPUT = 1
    INPUT_PULLUP = 2
    OUTPUT = 3


DIGITAL_PINS = tuple(range(0, 8))
ANALOG_PINS = tuple(range(10, 18))  # 16 and 17 are analog read-only
GPIO_PINS = DIGITAL_PINS + ANALOG_PINS
GPIO_OUTPUT_PINS = tuple(p for p in GPIO_PINS if p <= 15)  # SET_OUTPUT fails above 15
GPIO_COUNT = 18  # GeneralGPIOConstants::COUNT: pin arrays are indexed by sub-device id


def gpio_read_value(pin: int, payload: bytes) -> int:
    """READ reply: digital [0] = 0/1, analog [0..1] = uint16 BE 0..1023."""
    return payload[0] if pin < 8 else read_u16(payload, 0)


# -- §3.6 ODrive ---------------------------------------------------------------------------------------------
ODRIVE_SETMASK = 0x00
ODRIVE_GETMASK = 0x80


class OdriveRef(IntEnum):
    CONTROL_MODE = 0
    INPUT_MODE = 1
    TORQUE = 2
    POSITION_SETPOINT = 3
    VELOCITY_SETPOINT = 4
    POSITION_RELATIVE = 5
    ERROR = 6
    POSITION = 7
    VELOCITY = 8
    BUS_VOLTAGE = 9
    CURRENT = 10
    FET_TEMPERATURE = 11
    MOTOR_TEMPERATURE = 12
    KINEMATIC_FEEDBACK = 13
    ALL = 100


class OdriveAction(IntEnum):
    SET_CONTROL_MODE = 0x00
    SET_INPUT_MODE = 0x01
    SET_TORQUE = 0x02
    SET_POSITION = 0x03
    SET_VELOCITY = 0x04
    SET_RELATIVE_POSITION = 0x05
    CLEAR_ERRORS = 0x06
    GET_CONTROL_MODE = 0x80
    GET_INPUT_MODE = 0x81
    GET_TORQUE_SETPOINT = 0x82
    GET_POSITION_SETPOINT = 0x83
    GET_VELOCITY_SETPOINT = 0x84
    GET_ERROR = 0x86
    GET_POSITION = 0x87
    GET_VELOCITY = 0x88
    GET_BUS_VOLTAGE = 0x89
    GET_CURRENT = 0x8A
    GET_MOTOR_TEMPERATURE = 0x8C
    GET_KINEMATIC_FEEDBACK = 0x8D
    GET_ALL = 0xE4


# The firmware defines GET_FET_TEMPERATURE as GETMASK & FETTemperature (`&` for `|`): 0x80 & 11 == 0x00, the
# code of SET_CONTROL_MODE (§3.6). Sent as is, it would switch the ODrive to POSITION_MODE. The host never
# sends it (FET temperature comes from GET_ALL); `odrive_request` refuses to build it.
GET_FET_TEMPERATURE_FIRMWARE = ODRIVE_GETMASK & OdriveRef.FET_TEMPERATURE
GET_FET_TEMPERATURE_INTENDED = ODRIVE_GETMASK | OdriveRef.FET_TEMPERATURE  # 0x8B, which no firmware answers


def odrive_ref(action: int) -> int:
    """The mask reference of an ODrive action: `code & ~GETMASK` (the original wrote `& !GETMASK`, always 0)."""
    return action & ~ODRIVE_GETMASK & 0xFFFF


def odrive_is_get(action: int) -> bool:
    return bool(action & ODRIVE_GETMASK)


class ControlMode(IntEnum):
    POSITION = 0
    VELOCITY = 1
    TORQUE = 2


class InputMode(IntEnum):
    TRAP_TRAJ = 0
    POS_FILTER = 1
    VELOCITY_RAMP = 2
    TORQUE_RAMP = 3
    AUTO_BEST_FIT = 4


# §7.1: each command first switches the modes, position -> TRAP_TRAJ, velocity -> VEL_RAMP, torque -> TORQUE_RAMP
COMMAND_MODES: dict[str, tuple[ControlMode, InputMode]] = {
    "position": (ControlMode.POSITION, InputMode.TRAP_TRAJ),
    "velocity": (ControlMode.VELOCITY, InputMode.VELOCITY_RAMP),
    "torque": (ControlMode.TORQUE, InputMode.TORQUE_RAMP),
}

ODRIVE_ERRORS: dict[int, str] = {  # ODrive 0.6 ODriveError flags (§3.6)
    0x1: "INITIALIZING",
    0x2: "SYSTEM_LEVEL",
    0x4: "TIMING_ERROR",
    0x8: "MISSING_ESTIMATE",
    0x10: "BAD_CONFIG",
    0x20: "DRV_FAULT",
    0x40: "MISSING_INPUT",
    0x100: "DC_BUS_OVER_VOLTAGE",
    0x200: "DC_BUS_UNDER_VOLTAGE",
    0x400: "DC_BUS_OVER_CURRENT",
    0x800: "DC_BUS_OVER_REGEN_CURRENT",
    0x1000: "CURRENT_LIMIT_VIOLATION",
    0x2000: "MOTOR_OVER_TEMP",
    0x4000: "INVERTER_OVER_TEMP",
    0x8000: "VELOCITY_LIMIT_VIOLATION",
    0x10000: "POSITION_LIMIT_VIOLATION",
    0x1000000: "WATCHDOG_TIMER_EXPIRED",
    0x2000000: "ESTOP_REQUESTED",
    0x4000000: "SPINOUT_DETECTED",
    0x8000000: "BRAKE_RESISTOR_DISARMED",
    0x10000000: "THERMISTOR_DISCONNECTED",
    0x40000000: "CALIBRATION_ERROR",
}


def odrive_error_names(bits: int) -> list[str]:
    """Decode ODrive error bits to names; bits without a name show as hex."""
    names = [name for bit, name in ODRIVE_ERRORS.items() if bits & bit]
    unknown = bits & ~sum(ODRIVE_ERRORS)
    if unknown:
        names.append(f"UNKNOWN_0x{unknown:x}")
    return names


def odrive_error_text(bits: int) -> str:
    return "ODrive error: " + ", ".join(odrive_error_names(bits)) if bits else ""


ODRIVE_ALL_SIZE = 28


@dataclass(frozen=True, slots=True)
class OdriveAll:
    """GET_ALL reply, 28 bytes: pos, vel, bus V, current, FET degC, motor degC (float BE), error (u32 BE)."""

    position: float
    velocity: float
    bus_voltage: float
    current: float
    fet_temperature: float
    motor_temperature: float
    error: int

    def encode(self) -> bytes:
        return b"".join(f32(v) for v in (self.position, self.velocity, self.bus_voltage, self.current,
                                          self.fet_temperature, self.motor_temperature)) + u32(self.error)

    @classmethod
    def decode(cls, payload: bytes) -> OdriveAll:
        if len(payload) < ODRIVE_ALL_SIZE:
            raise DecodeError("short", f"GET_ALL payload of {len(payload)} bytes, need {ODRIVE_ALL_SIZE}")
        pos, vel, volts, amps, fet, motor = (read_f32(payload, 4 * i) for i in range(6))
        return cls(pos, vel, volts, amps, fet, motor, read_u32(payload, 24))


def odrive_request(action: int, value: float | int | None = None, sub_device_id: int = 0) -> GeneralPacket:
    """Build an ODrive request with the payload its action takes (§3.6 payload table)."""
    if action == GET_FET_TEMPERATURE_FIRMWARE and value is None:
        raise ValueError("GET_FET_TEMPERATURE is 0x00 in the firmware, the code of SET_CONTROL_MODE: "
                         "read the FET temperature from GET_ALL")
    act = OdriveAction(action)
    if act in (OdriveAction.SET_CONTROL_MODE, OdriveAction.SET_INPUT_MODE):
        if value is None or not 0 <= int(value) <= 255:
            raise ValueError(f"{act.name} needs a mode code 0..255")
        payload = bytes([int(value)])
    elif act in (OdriveAction.SET_POSITION, OdriveAction.SET_RELATIVE_POSITION, OdriveAction.SET_VELOCITY,
                 OdriveAction.SET_TORQUE):
        if value is None or not fits_f32(float(value)):
            raise ValueError(f"{act.name} needs a finite float32 value, got {value!r}")
        payload = f32(float(value))
    else:
        payload = b""
    return GeneralPacket(sub_device_id, act, payload)


# -- §3.7 Actuator -------------------------------------------------------------------------------------------
ACTUATOR_SET_MASK = 0x0000
ACTUATOR_GET_MASK = 0x8000


class ActuatorAction(IntEnum):
    SET_RELATIVE_LENGTH = 0x0000
    SET_ABSOLUTE_LENGTH = 0x0001
    GET_TARGET_LENGTH = 0x8002  # not implemented in firmware (reply [0] = 0)
    GET_CURRENT_LENGTH = 0x8003  # not implemented in firmware
    SET_SPEED_PID = 0x0004  # not implemented
    SET_LENGTH_PID = 0x0005  # not implemented
    GET_SPEED_PID = 0x8006  # not implemented
    GET_LENGTH_PID = 0x8007  # not implemented
    SET_VELOCITY = 0x0010
    GET_TARGET_VELOCITY = 0x8011  # not implemented
    GET_CURRENT_VELOCITY = 0x8012  # not implemented in firmware
    GET_LAST_HOME = 0x8020  # not implemented
    SET_CONTROL = 0x0030
    GET_CONTROL = 0x8031  # not implemented


class ActuatorControl(IntEnum):
    LENGTH_MODE = 0
    VELOCITY_MODE = 1


ACTUATOR_CHANNELS = 2  # ActuatorContainer<2>
ACTUATOR_FIRMWARE_MAX_TICKS = 150  # Actuator(... min 0, max 150) hard-coded in the firmware
