"""Shadow Dexterous Hand palm protocol (0220 / 0230): pure codecs, enums and tables. No I/O, no clock.

Every layout here follows docs/reference/shadow_ethercat.md §1 byte for byte (packed, little-endian,
enums 4 bytes). The seed's 0200 `..._PALM_EDC_INCOMING/OUTGOING` structs (44-byte command, MOTOR_DATA_OUT
motor[20] status) come from an old mainpage only; no current firmware uses them, so they are not here.

Decoders never raise: they return a `DecodeError` that the caller counts.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import TypeVar

T = TypeVar("T")

NUM_MOTORS = 20
NUM_SENSORS = 37  # SENSORS_NUM_0220 = 36 plus the IGNORE slot
CAN_BRIDGE_SIZE = 12
TACTILE_SENSORS = 5
NO_DEMAND_TIMEOUT_MS = 20  # PALM_0200_EDC_NO_DEMAND_TIMEOUT_MS: the motors stop themselves after this


# --------------------------------------------------------------------------------------------- enums
class EdcCommand(IntEnum):
    """EDC_COMMAND (common_edc_ethercat_protocol.h)."""

    INVALID = 0  # an empty ET1200 mailbox reads as zero: a status with 0 here is a dropped status
    SENSOR_DATA = 1
    SENSOR_CHANNEL_NUMBERS = 2
    SENSOR_ADC_CHANNEL_CS = 3
    # Followed the current header over the old mainpage (docs/reference/shadow_ethercat.md §1.1), which has
    # TEST_RESULTS = 4 and
    # CAN_TEST_MODE = 5; current headers comment TEST_RESULTS out, so CAN direct mode is 4.
    CAN_DIRECT_MODE = 4


EDC_COMMAND = EdcCommand


class FromMotorDataType(IntEnum):
    """FROM_MOTOR_DATA_TYPE: what the polled motors put in `misc` (their `torque` is always sent)."""

    INVALID = 0x0
    SGL = 0x1
    SGR = 0x2
    PWM = 0x3
    FLAGS = 0x4
    CURRENT = 0x5  # mA
    VOLTAGE = 0x6  # driver divides by 256
    TEMPERATURE = 0x7  # 8.8 fixed point
    CAN_NUM_RECEIVED = 0x8
    CAN_NUM_TRANSMITTED = 0x9
    SLOW_MISC = 0xA  # torque = FromMotorSlowDataType, misc = its value
    READBACK_LAST_CONFIG = 0xB  # torque = ToMotorDataType, misc = value
    CAN_ERROR_COUNTERS = 0xC  # LSB TX errors, MSB RX errors
    PTERM = 0xD
    ITERM = 0xE
    DTERM = 0xF


class FromMotorSlowDataType(IntEnum):
    INVALID = 0x0
    SVN_REVISION = 0x1
    SVN_SERVER_REVISION = 0x2
    SVN_MODIFIED = 0x3
    SERIAL_NUMBER_LOW = 0x4
    SERIAL_NUMBER_HIGH = 0x5
    GEAR_RATIO = 0x6
    ASSEMBLY_DATE_YYYY = 0x7
    ASSEMBLY_DATE_MMDD = 0x8
    CONTROLLER_F = 0x9
    CONTROLLER_P = 0xA
    CONTROLLER_I = 0xB
    CONTROLLER_IMAX = 0xC
    CONTROLLER_D = 0xD
    CONTROLLER_DEADSIGN = 0xE
    CONTROLLER_FREQUENCY = 0xF
    STRAIN_GAUGE_TYPE = 0x10  # 0x0C coupled, 0x0D decoupled; also MOTOR_SLOW_DATA_LAST


SLOW_DATA_LAST = FromMotorSlowDataType.STRAIN_GAUGE_TYPE


class ToMotorDataType(IntEnum):
    """TO_MOTOR_DATA_TYPE: what `motor_data[20]` of the command carries."""

    INVALID = 0x0  # an all-zero packet is ignored
    DEMAND_TORQUE = 0x1
    DEMAND_PWM = 0x2
    SYSTEM_RESET = 0x3  # demand = 0x5200 | bus-local motor id
    SYSTEM_CONTROLS = 0x4
    CONFIG_TORQUE_LIMIT = 0x5  # MOTOR_CONFIG_FIRST_VALUE
    CONFIG_TORQUE_LIMITER_GAIN = 0x6
    CONFIG_MAX_PWM = 0x7
    CONFIG_SG_REFS = 0x8  # LSB SGL ref, MSB SGR ref
    CONFIG_F = 0x9
    CONFIG_P = 0xA
    CONFIG_I = 0xB
    CONFIG_D = 0xC
    CONFIG_IMAX = 0xD
    CONFIG_DEADBAND_SIGN = 0xE  # LSB deadband, MSB sign; MOTOR_CONFIG_LAST_VALUE
    CONFIG_CRC = 0xF


CONFIG_FIRST = ToMotorDataType.CONFIG_TORQUE_LIMIT
CONFIG_LAST = ToMotorDataType.CONFIG_DEADBAND_SIGN
CONFIG_TYPES = tuple(ToMotorDataType(v) for v in range(CONFIG_FIRST, CONFIG_LAST + 1))
SYSTEM_RESET_MAGIC = 0x5200

# Valid ranges of motor_data per TO_MOTOR type (docs/reference/shadow_ethercat.md §1.8), as signed int16 values.
DEMAND_RANGES: dict[ToMotorDataType, tuple[int, int]] = {
    ToMotorDataType.DEMAND_TORQUE: (-0x7FFF, 0x7FFF),
    ToMotorDataType.DEMAND_PWM: (-0x3FF, 0x3FF),
    ToMotorDataType.CONFIG_TORQUE_LIMIT: (0, 0x7FFF),
    ToMotorDataType.CONFIG_TORQUE_LIMITER_GAIN: (-0x200, 0x200),
    ToMotorDataType.CONFIG_MAX_PWM: (0, 0x3FF),
    ToMotorDataType.CONFIG_F: (0, 0x7FFF),
    ToMotorDataType.CONFIG_P: (0, 0x7FFF),
    ToMotorDataType.CONFIG_I: (0, 0x7FFF),
    ToMotorDataType.CONFIG_D: (0, 0x7FFF),
    ToMotorDataType.CONFIG_IMAX: (0, 0x3FFF),
}


class SystemControl(IntFlag):
    """MOTOR_SYSTEM_CONTROLS bits."""

    BACKLASH_COMPENSATION_ENABLE = 0x01
    BACKLASH_COMPENSATION_DISABLE = 0x02
    SGL_TRACKING_INC = 0x04
    SGL_TRACKING_DEC = 0x08
    SGR_TRACKING_INC = 0x10
    SGR_TRACKING_DEC = 0x20
    INITIATE_JIGGLING = 0x40
    EEPROM_WRITE = 0x80


class MotorFlag(IntFlag):
    """MOTOR_DATA_FLAGS bits; the top group switches the motor off."""

    CURRENT_CHOKE = 0x000F  # informational: current-choke top bits
    EEPROM_WRITING = 0x0010
    LAST_CONFIG_CRC_FAILED = 0x0020
    LAST_CONFIG_OUT_OF_RANGE = 0x0040
    JIGGLING_IN_PROGRESS = 0x0080
    MOTOR_ID_INVALID = 0x0200
    NO_DEMAND_SEEN = 0x0400  # > 20 ms without a demand
    SGL_FAULT = 0x0800  # not implemented in firmware
    SGR_FAULT = 0x1000  # not implemented in firmware
    A3950_NFAULT = 0x2000
    EEPROM_CONFIG_BAD_CRC = 0x4000
    OVER_TEMPERATURE = 0x8000


SERIOUS_ERROR_FLAGS = 0x0400 | 0x2000 | 0x4000 | 0x8000  # PALM_0200_EDC_SERIOUS_ERROR_FLAGS
_FLAG_NAMES: tuple[tuple[int, str], ...] = tuple(
    (int(f.value), str(f.name).lower()) for f in MotorFlag if f is not MotorFlag.CURRENT_CHOKE)


def flag_names(flags: int) -> list[str]:
    """Names of the set bits (current-choke bits report as `current_choke_<n>`)."""
    out = [name for bit, name in _FLAG_NAMES if flags & bit]
    if flags & 0x000F:
        out.insert(0, f"current_choke_{flags & 0x000F}")
    return out


def serious_flags(flags: int) -> list[str]:
    return flag_names(flags & SERIOUS_ERROR_FLAGS)


# --------------------------------------------------------------------------------------------- sensors
SENSOR_NAMES: tuple[str, ...] = (
    "FFJ1", "FFJ2", "FFJ3", "FFJ4",
    "MFJ1", "MFJ2", "MFJ3", "MFJ4",
    "RFJ1", "RFJ2", "RFJ3", "RFJ4",
    "LFJ1", "LFJ2", "LFJ3", "LFJ4", "LFJ5",
    "THJ1", "THJ2", "THJ3", "THJ4", "THJ5A", "THJ5B",
    "WRJ1A", "WRJ1B", "WRJ2",
    "ACCX", "ACCY", "ACCZ",
    "GYRX", "GYRY", "GYRZ",
    "AN0", "AN1", "AN2", "AN3",  # SENSOR_NAME_ENUM ANA0..ANA3, printed as "AN0".."AN3"
    "IGNORE",
)
SENSOR_INDEX = {n: i for i, n in enumerate(SENSOR_NAMES)}

JOINT_NAMES: tuple[str, ...] = (
    "FFJ0", "FFJ1", "FFJ2", "FFJ3", "FFJ4",
    "MFJ0", "MFJ1", "MFJ2", "MFJ3", "MFJ4",
    "RFJ0", "RFJ1", "RFJ2", "RFJ3", "RFJ4",
    "LFJ0", "LFJ1", "LFJ2", "LFJ3", "LFJ4", "LFJ5",
    "THJ1", "THJ2", "THJ3", "THJ4", "THJ5",
    "WRJ1", "WRJ2",
)
# The 20 motor-driven joints (J1 and J2 of the fingers share one motor through J0).
ACTUATED_JOINTS: tuple[str, ...] = (
    "FFJ0", "FFJ3", "FFJ4", "MFJ0", "MFJ3", "MFJ4", "RFJ0", "RFJ3", "RFJ4",
    "LFJ0", "LFJ3", "LFJ4", "LFJ5", "THJ1", "THJ2", "THJ3", "THJ4", "THJ5", "WRJ1", "WRJ2",
)

# SENSOR_CHANNEL_NUMBERS test mode: each sensor reports (channel << 8) | adc. Only LFJ5 = 0x0605
# (channel 6 of ADC 5) is documented (docs/reference/shadow_ethercat.md §1.1); the rest is our palm model's
# wiring, and the
# `test_adc_channels` command compares against this table.
_CHANNEL_GROUPS: tuple[tuple[tuple[str, ...], int, int], ...] = (
    (("FFJ1", "FFJ2", "FFJ3", "FFJ4"), 1, 0),
    (("MFJ1", "MFJ2", "MFJ3", "MFJ4"), 2, 0),
    (("RFJ1", "RFJ2", "RFJ3", "RFJ4"), 3, 0),
    (("THJ1", "THJ2", "THJ3", "THJ4", "THJ5A", "THJ5B"), 4, 0),
    (("LFJ1", "LFJ2", "LFJ3", "LFJ4", "LFJ5"), 5, 2),
    (("WRJ1A", "WRJ1B", "WRJ2"), 6, 0),
    (("AN0", "AN1", "AN2", "AN3"), 6, 4),
    (("ACCX", "ACCY", "ACCZ", "GYRX", "GYRY", "GYRZ"), 7, 0),
)
EXPECTED_CHANNELS: dict[str, tuple[int, int]] = {
    name: (adc, first + k) for names, adc, first in _CHANNEL_GROUPS for k, name in enumerate(names)
}
EXPECTED_CHANNELS["IGNORE"] = (0, 0)


def channel_word(adc: int, channel: int) -> int:
    return ((channel & 0xFF) << 8) | (adc & 0xFF)


def split_channel_word(word: int) -> tuple[int, int]:
    """-> (adc, channel)"""
    return word & 0xFF, (word >> 8) & 0xFF


# --------------------------------------------------------------------------------------------- CAN SID
class CanDirection(IntEnum):
    """SID bits [10:9]; the header enum is authoritative (the old mainpage has them the other way round)."""

    DATA_REQUEST = 0
    TO_MOTOR = 1
    FROM_MOTOR = 2
    BOOTLOADER = 3


# The bootloader's commands (SID bits [3:0] when the direction is BOOTLOADER) are defined once, in
# can-bootloader's protocol module (BootCommand), which owns the bootloader; the palm only forwards them.


SID_ACK = 0x10


def make_sid(direction: int, motor_id: int, kind: int, ack: bool = False) -> int:
    return ((direction & 3) << 9) | ((motor_id & 0xF) << 5) | (SID_ACK if ack else 0) | (kind & 0xF)


def split_sid(sid: int) -> tuple[int, int, bool, int]:
    """-> (direction, motor_id, ack, kind)"""
    return (sid >> 9) & 3, (sid >> 5) & 0xF, bool(sid & SID_ACK), sid & 0xF


# --------------------------------------------------------------------------------------------- CRC
def config_crc(values: dict[int, int] | list[int]) -> int:
    """CRC of a motor config (INSERT_CRC_CALCULATION_HERE over types 0x5..0xE, low byte then high byte).

    `values` maps each config type to its 16-bit word (or is the ten words in type order). 0 means
    "ignore this config" to the motor, so a result of 0 is sent as 1 (generate_force_control_config)."""
    words = [values[t] for t in CONFIG_TYPES] if isinstance(values, dict) else list(values)
    crc = 0
    for word in words:
        for byte in (word & 0xFF, (word >> 8) & 0xFF):
            i = (crc & 0xFF) ^ byte
            crc >>= 8
            for bit, poly in _CRC_TABLE:
                if i & bit:
                    crc ^= poly
    return crc or 1


_CRC_TABLE = ((0x01, 0x3096), (0x02, 0x612C), (0x04, 0xC419), (0x08, 0x8832),
              (0x10, 0x1064), (0x20, 0x20C8), (0x40, 0x4190), (0x80, 0x8320))


def s16(v: int) -> int:
    """A 16-bit word as signed int16 (motor_data is int16s on the wire)."""
    v &= 0xFFFF
    return v - 0x10000 if v & 0x8000 else v


# --------------------------------------------------------------------------------------------- structs
@dataclass(frozen=True)
class CanBridgeFrame:
    """ETHERCAT_CAN_BRIDGE_DATA (12 B). `message_id == 0 and message_length == 0` means "nothing"."""

    can_bus: int = 0
    message_length: int = 0
    message_id: int = 0
    data: bytes = b""

    STRUCT = struct.Struct("<BBH8s")

    def __post_init__(self) -> None:
        if len(self.data) != 8:  # always the 8 wire bytes, so a decoded frame equals the one packed
            object.__setattr__(self, "data", bytes(self.data[:8]).ljust(8, b"\0"))

    @property
    def empty(self) -> bool:
        return self.message_id == 0 and self.message_length == 0

    @property
    def payload(self) -> bytes:
        return self.data[: min(self.message_length, 8)]

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.can_bus, self.message_length, self.message_id, self.data[:8].ljust(8, b"\0"))

    @classmethod
    def unpack(cls, buf: bytes) -> CanBridgeFrame | DecodeError:
        if len(buf) != CAN_BRIDGE_SIZE:
            return DecodeError("can_bridge", f"need {CAN_BRIDGE_SIZE} bytes, got {len(buf)}")
        bus, length, sid, data = cls.STRUCT.unpack(buf)
        if length > 8:
            return DecodeError("can_bridge", f"message_length {length} > 8")
        return cls(bus, length, sid, bytes(data))


NO_CAN = CanBridgeFrame()


@dataclass(frozen=True)
class DecodeError:
    """What a decoder returns instead of raising; the caller counts it."""

    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclass(frozen=True)
class ProtocolInfo:
    """One palm protocol. Sizes INCLUDE the 12-byte CAN bridge (the agreed sizes on the wire)."""

    name: str
    product_codes: tuple[int, ...]
    command_size: int
    status_size: int
    command_struct_size: int  # without the CAN bridge
    status_struct_size: int

    @property
    def sync_managers(self) -> tuple[tuple[int, int, int], ...]:
        """(physical address, length, control byte) of SM0..SM3, all mailbox mode
        (docs/reference/shadow_ethercat.md §2.2)."""
        c, s = self.command_struct_size, self.status_struct_size
        return ((0x1000, c, 0x26), (0x1000 + c, CAN_BRIDGE_SIZE, 0x26),
                (0x1000 + c + CAN_BRIDGE_SIZE, s, 0x02), (0x1000 + CAN_BRIDGE_SIZE + c + s, CAN_BRIDGE_SIZE, 0x02))


PROTOCOLS: dict[str, ProtocolInfo] = {
    "0220": ProtocolInfo("0220", (6,), 70, 232, 58, 220),
    # ETHERCAT_*_0230_AGREED_SIZE (62/416) exclude the CAN bridge despite their comment: 74/428 on the wire.
    "0230": ProtocolInfo("0230", (0x01000000, 0x01000001), 74, 428, 62, 416),
}
BRIDGE_PRODUCT_CODE = 0  # SRBridge, the EtherCAT -> E-Bus bridge (no process data)


def protocol_for_product(code: int) -> ProtocolInfo:
    for info in PROTOCOLS.values():
        if code in info.product_codes:
            return info
    raise KeyError(f"no palm protocol for product code {code:#x} (known: 6, 0x01000000, 0x01000001)")


@dataclass(frozen=True)
class PalmCommand:
    """The host -> palm command (0220: 58 B, 0230: 62 B) plus its CAN bridge frame."""

    edc_command: int = EdcCommand.SENSOR_DATA
    from_motor_data_type: int = FromMotorDataType.INVALID
    which_motors: int = 0  # 0 = even, 1 = odd
    to_motor_data_type: int = ToMotorDataType.INVALID
    motor_data: tuple[int, ...] = (0,) * NUM_MOTORS  # int16s each
    tactile_data_type: int = 0
    aux_data_type: int = 0  # 0230 only
    can: CanBridgeFrame = NO_CAN


@dataclass(frozen=True)
class PalmStatus:
    """The palm -> host status. Fields a protocol lacks keep their defaults."""

    edc_command: int = 0
    sensors: tuple[int, ...] = (0,) * NUM_SENSORS  # int16u each
    motor_data_type: int = 0
    which_motors: int = 0
    which_motor_data_arrived: int = 0
    which_motor_data_had_errors: int = 0
    motor_data_packet: tuple[tuple[int, int], ...] = ((0, 0),) * 10  # (torque int16s, misc int16u)
    tactile_data_type: int = 0
    tactile_data_valid: int = 0
    tactile: tuple[tuple[int, ...], ...] = ((0,) * 8,) * TACTILE_SENSORS  # v1: 8 words, v2 (0230): 16
    idle_time_us: int = 0
    tactile_mid_prox: tuple[tuple[int, ...], ...] = ()  # 0230: 5 x 8 words
    aux_spi_data_type: int = 0  # 0230
    aux_spi_sensor: tuple[int, ...] = ()  # 0230: 16 words
    can: CanBridgeFrame = field(default=NO_CAN)

    @property
    def dropped(self) -> bool:
        return self.edc_command == EdcCommand.INVALID


_CMD_0220 = struct.Struct("<IIhI20hI")
_CMD_0230 = struct.Struct("<IIhIII20h")
_ST_0220 = struct.Struct("<I37HIhII" + "hH" * 10 + "IH40HH")
_ST_0230 = struct.Struct("<I37H40HIH80HI16HIhII" + "hH" * 10 + "H")
assert _CMD_0220.size == 58 and _CMD_0230.size == 62 and _ST_0220.size == 220 and _ST_0230.size == 416


def _words(vals: Sequence[T], n: int, what: str) -> list[T]:
    if len(vals) != n:
        raise ValueError(f"{what}: need {n} values, got {len(vals)}")
    return list(vals)


def pack_command(cmd: PalmCommand, protocol: str = "0220") -> bytes:
    """Command + CAN bridge, exactly `PROTOCOLS[protocol].command_size` bytes. Raises ValueError on bad input
    (the driver builds commands itself; bad values there are bugs)."""
    md = [s16(v) for v in _words(cmd.motor_data, NUM_MOTORS, "motor_data")]
    if protocol == "0220":
        body = _CMD_0220.pack(cmd.edc_command, cmd.from_motor_data_type, cmd.which_motors, cmd.to_motor_data_type,
                              *md, cmd.tactile_data_type)
    elif protocol == "0230":
        body = _CMD_0230.pack(cmd.edc_command, cmd.from_motor_data_type, cmd.which_motors, cmd.to_motor_data_type,
                              cmd.tactile_data_type, cmd.aux_data_type, *md)
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    return body + cmd.can.pack()


def _check_size(buf: bytes, size: int, what: str) -> DecodeError | None:
    if len(buf) != size:
        return DecodeError(what, f"need {size} bytes, got {len(buf)}")
    return None


def unpack_command(buf: bytes, protocol: str = "0220") -> PalmCommand | DecodeError:
    info = PROTOCOLS.get(protocol)
    if info is None:
        return DecodeError("command", f"unknown protocol {protocol!r}")
    err = _check_size(buf, info.command_size, "command")
    if err:
        return err
    can = CanBridgeFrame.unpack(buf[info.command_struct_size:])
    if isinstance(can, DecodeError):
        return can
    if protocol == "0220":
        v = _CMD_0220.unpack_from(buf)
        return PalmCommand(v[0], v[1], v[2], v[3], tuple(v[4:24]), v[24], 0, can)
    v = _CMD_0230.unpack_from(buf)
    return PalmCommand(v[0], v[1], v[2], v[3], tuple(v[6:26]), v[4], v[5], can)


def _pairs(flat: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...]:
    return tuple((flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2))


def _chunks(flat: tuple[int, ...] | list[int], n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(flat[i:i + n]) for i in range(0, len(flat), n))


def pack_status(st: PalmStatus, protocol: str = "0220") -> bytes:
    """Status + CAN bridge (the palm model's side). Raises ValueError on bad input."""
    packets = [w for p in _words(list(st.motor_data_packet), 10, "motor_data_packet") for w in p]
    sensors = _words(st.sensors, NUM_SENSORS, "sensors")
    if protocol == "0220":
        tact = [w for t in _words(list(st.tactile), 5, "tactile") for w in _words(t, 8, "tactile v1")]
        body = _ST_0220.pack(st.edc_command, *sensors, st.motor_data_type, st.which_motors,
                             st.which_motor_data_arrived, st.which_motor_data_had_errors, *packets,
                             st.tactile_data_type, st.tactile_data_valid, *tact, st.idle_time_us)
    elif protocol == "0230":
        mid = st.tactile_mid_prox or ((0,) * 8,) * 5
        aux = st.aux_spi_sensor or (0,) * 16
        mp = [w for t in _words(list(mid), 5, "tactile_mid_prox") for w in _words(t, 8, "mid_prox")]
        tact = [w for t in _words(list(st.tactile), 5, "tactile") for w in _words(t, 16, "tactile v2")]
        body = _ST_0230.pack(st.edc_command, *sensors, *mp, st.tactile_data_type, st.tactile_data_valid, *tact,
                             st.aux_spi_data_type, *_words(aux, 16, "aux_spi_sensor"), st.motor_data_type,
                             st.which_motors, st.which_motor_data_arrived, st.which_motor_data_had_errors,
                             *packets, st.idle_time_us)
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    return body + st.can.pack()


def unpack_status(buf: bytes, protocol: str = "0220") -> PalmStatus | DecodeError:
    """Decode one status + CAN bridge. All zeros (an empty mailbox) decodes to a status with `dropped`;
    a wrong size, an unknown EDC_command or motor data type, or a bad bridge length is a DecodeError."""
    info = PROTOCOLS.get(protocol)
    if info is None:
        return DecodeError("status", f"unknown protocol {protocol!r}")
    err = _check_size(buf, info.status_size, "status")
    if err:
        return err
    can = CanBridgeFrame.unpack(buf[info.status_struct_size:])
    if isinstance(can, DecodeError):
        return can
    if protocol == "0220":
        v = _ST_0220.unpack_from(buf)
        st = PalmStatus(edc_command=v[0], sensors=tuple(v[1:38]), motor_data_type=v[38], which_motors=v[39],
                        which_motor_data_arrived=v[40], which_motor_data_had_errors=v[41],
                        motor_data_packet=_pairs(v[42:62]), tactile_data_type=v[62], tactile_data_valid=v[63],
                        tactile=_chunks(v[64:104], 8), idle_time_us=v[104], can=can)
    else:
        v = _ST_0230.unpack_from(buf)
        st = PalmStatus(edc_command=v[0], sensors=tuple(v[1:38]), tactile_mid_prox=_chunks(v[38:78], 8),
                        tactile_data_type=v[78], tactile_data_valid=v[79], tactile=_chunks(v[80:160], 16),
                        aux_spi_data_type=v[160], aux_spi_sensor=tuple(v[161:177]), motor_data_type=v[177],
                        which_motors=v[178], which_motor_data_arrived=v[179], which_motor_data_had_errors=v[180],
                        motor_data_packet=_pairs(v[181:201]), idle_time_us=v[201], can=can)
    if st.edc_command > EdcCommand.CAN_DIRECT_MODE:
        return DecodeError("status", f"unknown EDC_command {st.edc_command}")
    if st.motor_data_type > FromMotorDataType.DTERM:
        return DecodeError("status", f"unknown motor_data_type {st.motor_data_type}")
    if st.which_motors not in (0, 1):
        return DecodeError("status", f"which_motors {st.which_motors} is neither 0 nor 1")
    return st


# ------------------------------------------------------------------ the cycle's fast path (no objects)
# What the driver needs of every status (the motor data block and the EDC echo) and the whole command,
# with precompiled structs and no PalmStatus / PalmCommand built per cycle: the 1 kHz cycle's CPU budget.
# Same layouts as above (the offsets are computed from the same format prefixes), same validation.
_MOTOR_BLOCK = struct.Struct("<IhII" + "hH" * 10)  # motor_data_type, which_motors, arrived, had_errors, packets
_MOTOR_BLOCK_AT = {"0220": struct.calcsize("<I37H"), "0230": struct.calcsize("<I37H40HIH80HI16H")}
_U32 = struct.Struct("<I")
_CMD_FAST = {"0220": struct.Struct("<IIhI20hI" + "BBH8s"), "0230": struct.Struct("<IIhIII20h" + "BBH8s")}
assert _ST_0220.format.endswith("hII" + "hH" * 10 + "IH40HH")  # the motor block follows sensors in 0220


def status_head(buf: bytes, protocol: str = "0220") -> tuple[int, tuple[int, ...]] | None:
    """(EDC echo, motor block: motor_data_type, which_motors, arrived, had_errors, 10 x (torque, misc))
    of a status that `unpack_status` would accept; None when it would not (call it for the DecodeError)."""
    info = PROTOCOLS.get(protocol)
    if info is None or len(buf) != info.status_size or buf[info.status_struct_size + 1] > 8:
        return None
    edc = _U32.unpack_from(buf)[0]
    block = _MOTOR_BLOCK.unpack_from(buf, _MOTOR_BLOCK_AT[protocol])
    if edc > EdcCommand.CAN_DIRECT_MODE or block[0] > FromMotorDataType.DTERM or block[1] not in (0, 1):
        return None
    return edc, block


def command_packer(protocol: str) -> struct.Struct:
    """The precompiled command + CAN bridge struct; `pack_command_fields` fills it."""
    return _CMD_FAST[protocol]


def pack_command_fields(packer: struct.Struct, protocol: str, edc: int, from_type: int, which: int, to_type: int,
                        motor_data: Sequence[int], tactile: int, can: CanBridgeFrame = NO_CAN,
                        aux: int = 0) -> bytes:
    """`pack_command(PalmCommand(...))` without the PalmCommand; motor_data already int16 (s16)."""
    if protocol == "0220":
        return packer.pack(edc, from_type, which, to_type, *motor_data, tactile,
                           can.can_bus, can.message_length, can.message_id, can.data)
    return packer.pack(edc, from_type, which, to_type, tactile, aux, *motor_data,
                       can.can_bus, can.message_length, can.message_id, can.data)


_ST_FAST = {"0220": struct.Struct(_ST_0220.format + "BBH8s"), "0230": struct.Struct(_ST_0230.format + "BBH8s")}


def command_head(buf: bytes, protocol: str = "0220") -> tuple[int, int, int, int, tuple[int, ...], int, int] | None:
    """(edc, from_motor_data_type, which_motors, to_motor_data_type, motor_data, tactile_data_type, aux_data_type)
    of a command `unpack_command` would accept (None when it would not), without building it (the palm
    model's per-frame path; the CAN bridge frame is `unpack_command`'s, for CAN direct mode)."""
    info = PROTOCOLS.get(protocol)
    if info is None or len(buf) != info.command_size or buf[info.command_struct_size + 1] > 8:
        return None
    if protocol == "0220":
        v = _CMD_0220.unpack_from(buf)
        return v[0], v[1], v[2], v[3], v[4:24], v[24], 0
    v = _CMD_0230.unpack_from(buf)
    return v[0], v[1], v[2], v[3], v[6:26], v[4], v[5]


def pack_status_fields(protocol: str, edc: int, sensors: Sequence[int], block: Sequence[int], tactile_type: int,
                       tactile_valid: int, tactile_flat: Sequence[int], idle_time_us: int,
                       can: CanBridgeFrame = NO_CAN, aux_type: int = 0) -> bytes:
    """`pack_status(PalmStatus(...))` from flat fields (the palm model's per-frame path): `block` is
    motor_data_type, which_motors, arrived, had_errors, then 10 x (torque, misc); `tactile_flat` 40 (0220)
    or 80 (0230) words; the 0230 mid-prox and aux SPI words are zero, as the model sends them."""
    packer = _ST_FAST[protocol]
    can_fields = (can.can_bus, can.message_length, can.message_id, can.data)
    if protocol == "0220":
        return packer.pack(edc, *sensors, *block, tactile_type, tactile_valid, *tactile_flat,
                           idle_time_us, *can_fields)
    return packer.pack(edc, *sensors, *_ZERO_40, tactile_type, tactile_valid, *tactile_flat, aux_type, *_ZERO_16,
                       *block, idle_time_us, *can_fields)


_ZERO_40 = (0,) * 40
_ZERO_16 = (0,) * 16
