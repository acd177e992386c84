"""The palm model: a Shadow palm (PIC32 + 20 motor boards on two CAN buses) as pure code, no I/O.

`PalmModel.exchange(command) -> status` is one 1 ms EtherCAT cycle: it takes the command + CAN-bridge
bytes the host wrote and returns the status + CAN-bridge bytes the palm loaded. The model backend
(model_backend.py) calls it directly; the virtual EtherCAT hand (sim/) calls it behind its mailboxes.

What it models (docs/reference/shadow_ethercat.md §1, §1.10, §2.3): EDC_command, data type and parity echoed; the
requested
data type answered by the polled parity with arrived/error bits; torque that follows the demand and
joints that tendons pull; the 20 ms no-demand stop; config with CRC; system controls; slow data;
sensor channel-number test mode; CAN direct mode, where the bridge frame goes onto a simulated CAN bus
and received frames come back one per cycle, one cycle later; injectable faults.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.protocol import (
    CONFIG_TYPES,
    DEMAND_RANGES,
    EXPECTED_CHANNELS,
    NO_CAN,
    NO_DEMAND_TIMEOUT_MS,
    NUM_MOTORS,
    PROTOCOLS,
    SENSOR_NAMES,
    SERIOUS_ERROR_FLAGS,
    SYSTEM_RESET_MAGIC,
    CanBridgeFrame,
    CanDirection,
    EdcCommand,
    FromMotorDataType,
    FromMotorSlowDataType,
    MotorFlag,
    PalmCommand,
    SystemControl,
    ToMotorDataType,
    channel_word,
    command_head,
    config_crc,
    make_sid,
    pack_status_fields,
    split_sid,
    unpack_command,
)

CanReply = tuple[int, int, bytes]  # (bus 1|2, sid, data)


class CanNode(Protocol):
    """A peer on the simulated CAN buses (e.g. the PIC18F bootloader model of can-bootloader)."""

    def on_can_frame(self, bus: int, sid: int, data: bytes) -> list[CanReply]: ...


AMBIENT_C = 30.0
OVER_TEMPERATURE_C = 60.0  # firmware cut-out ("increased temperature cutout to 60 °C")
TORQUE_TAU_CYCLES = 5.0  # first-order torque response
RAD_PER_TORQUE_S = 0.004  # joint speed (rad/s) per unit of tendon torque
PWM_TO_TORQUE = 1.5
# plain ints: IntFlag arithmetic costs microseconds per operation, and this runs 20 times a cycle
F_CRC_FAILED = int(MotorFlag.LAST_CONFIG_CRC_FAILED)
F_OUT_OF_RANGE = int(MotorFlag.LAST_CONFIG_OUT_OF_RANGE)
F_JIGGLING = int(MotorFlag.JIGGLING_IN_PROGRESS)
F_EEPROM = int(MotorFlag.EEPROM_WRITING)
F_NO_DEMAND = int(MotorFlag.NO_DEMAND_SEEN)
F_OVER_TEMP = int(MotorFlag.OVER_TEMPERATURE)
T_TORQUE = int(ToMotorDataType.DEMAND_TORQUE)
T_PWM = int(ToMotorDataType.DEMAND_PWM)
SERIOUS = int(SERIOUS_ERROR_FLAGS)
_DEMAND_MODES = (T_TORQUE, T_PWM)
# FROM_MOTOR types as plain ints (an IntEnum member lookup per motor and frame adds up)
K_SLOW_MISC = int(FromMotorDataType.SLOW_MISC)
K_READBACK = int(FromMotorDataType.READBACK_LAST_CONFIG)
K_SGL, K_SGR, K_PWM, K_FLAGS = (int(FromMotorDataType.SGL), int(FromMotorDataType.SGR), int(FromMotorDataType.PWM),
                                int(FromMotorDataType.FLAGS))
K_CURRENT, K_VOLTAGE, K_TEMPERATURE = (int(FromMotorDataType.CURRENT), int(FromMotorDataType.VOLTAGE),
                                       int(FromMotorDataType.TEMPERATURE))
K_CAN_RX, K_CAN_TX = int(FromMotorDataType.CAN_NUM_RECEIVED), int(FromMotorDataType.CAN_NUM_TRANSMITTED)
K_PTERM, K_ITERM, K_DTERM = int(FromMotorDataType.PTERM), int(FromMotorDataType.ITERM), int(FromMotorDataType.DTERM)
_NOT_TIMED_FLAGS = ~(F_JIGGLING | F_EEPROM)
_NOT_NO_DEMAND = ~F_NO_DEMAND
_NO_BLOCK: tuple[int, ...] = (0,) * 24


@dataclass
class PalmMotorModel:
    """One motor board (PIC18F simplemotor) as the palm sees it."""

    id: int
    torque: float = 0.0
    demand: int = 0
    mode: int = ToMotorDataType.INVALID
    last_demand_cycle: int = -10_000
    flags: int = 0
    temperature: float = AMBIENT_C
    current: float = 0.0
    voltage: float = 24.0
    pwm: int = 0
    pending: dict[int, int] = field(default_factory=dict)
    config: dict[int, int] = field(default_factory=dict)
    config_accepted: int = 0
    last_config: tuple[int, int] = (0, 0)
    backlash: bool = True
    jiggle_left: int = 0
    eeprom_left: int = 0
    eeprom_writes: int = 0
    sg_tracking: int = 0
    resets: int = 0
    slow_index: int = 0
    can_rx: int = 0
    can_tx: int = 0
    silent: bool = False
    overheat: bool = False
    data_error: bool = False

    @property
    def running(self) -> bool:
        return not (self.flags & SERIOUS)

    def slow_value(self, kind: int) -> int:
        c = self.config
        values = {
            FromMotorSlowDataType.SVN_REVISION: 1930, FromMotorSlowDataType.SVN_SERVER_REVISION: 1930,
            FromMotorSlowDataType.SVN_MODIFIED: 0, FromMotorSlowDataType.SERIAL_NUMBER_LOW: 2000 + self.id,
            FromMotorSlowDataType.SERIAL_NUMBER_HIGH: 0, FromMotorSlowDataType.GEAR_RATIO: 131,
            FromMotorSlowDataType.ASSEMBLY_DATE_YYYY: 2013, FromMotorSlowDataType.ASSEMBLY_DATE_MMDD: 415,
            FromMotorSlowDataType.CONTROLLER_F: c.get(ToMotorDataType.CONFIG_F, 0),
            FromMotorSlowDataType.CONTROLLER_P: c.get(ToMotorDataType.CONFIG_P, 0),
            FromMotorSlowDataType.CONTROLLER_I: c.get(ToMotorDataType.CONFIG_I, 0),
            FromMotorSlowDataType.CONTROLLER_IMAX: c.get(ToMotorDataType.CONFIG_IMAX, 0),
            FromMotorSlowDataType.CONTROLLER_D: c.get(ToMotorDataType.CONFIG_D, 0),
            FromMotorSlowDataType.CONTROLLER_DEADSIGN: c.get(ToMotorDataType.CONFIG_DEADBAND_SIGN, 0),
            FromMotorSlowDataType.CONTROLLER_FREQUENCY: 5000,
            FromMotorSlowDataType.STRAIN_GAUGE_TYPE: 0x0C,
        }
        return values.get(FromMotorSlowDataType(kind), 0) & 0xFFFF

    def sg(self, left: bool) -> int:
        half = self.torque / 2
        return max(0, min(0xFFFF, int(2048 + (half if left else -half))))

    def answer(self, kind: int) -> tuple[int, int]:
        """(torque word, misc word) for a FROM_MOTOR request."""
        t = max(-0x8000, min(0x7FFF, round(self.torque)))
        if kind == K_SLOW_MISC:
            self.slow_index = self.slow_index % int(FromMotorSlowDataType.STRAIN_GAUGE_TYPE) + 1
            return self.slow_index, self.slow_value(self.slow_index)
        if kind == K_READBACK:
            return self.last_config[0], self.last_config[1] & 0xFFFF
        if kind == K_FLAGS:
            misc = self.flags
        elif kind in (K_SGL, K_SGR):
            misc = self.sg(kind == K_SGL)
        elif kind == K_PWM:
            misc = self.pwm
        elif kind == K_CURRENT:
            misc = int(self.current * 1000)
        elif kind == K_VOLTAGE:
            misc = int(self.voltage * 256)
        elif kind == K_TEMPERATURE:
            misc = int(self.temperature * 256)
        elif kind == K_CAN_RX:
            misc = self.can_rx
        elif kind == K_CAN_TX:
            misc = self.can_tx
        elif kind == K_PTERM:
            misc = int(self.torque * 3)
        elif kind == K_ITERM:
            misc = 0x0100
        elif kind == K_DTERM:
            misc = -0x80
        else:  # INVALID, CAN_ERROR_COUNTERS (no errors on a simulated bus)
            misc = 0
        return t, misc & 0xFFFF


class PalmModel:
    """A simulated palm. Not thread-safe: one caller (the cycle) drives `exchange`; fault injection
    from another thread only flips plain attributes, which is safe under the GIL."""

    def __init__(self, protocol: str = "0220", can_nodes: list[CanNode] | None = None,
                 calibration: HandCalibration | None = None, motor_can_replies: bool = True) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r} (known: {sorted(PROTOCOLS)})")
        self.protocol = protocol
        self.info = PROTOCOLS[protocol]
        self.cal = calibration or HandCalibration.load()
        self.can_nodes: list[CanNode] = list(can_nodes or [])
        self.motor_can_replies = motor_can_replies
        self.motors = [PalmMotorModel(i) for i in range(NUM_MOTORS)]
        self.cycle = 0
        self.command_errors = 0
        self.drop_next = 0
        self.channel_overrides: dict[str, tuple[int, int]] = {}
        self.bus_log: deque[tuple[int, int, int, bytes]] = deque(maxlen=256)  # (cycle, bus, sid, data)
        self._rx: deque[tuple[int, int, int, bytes]] = deque(maxlen=4096)  # (ready cycle, bus, sid, data)
        self.edc_command = 0
        # joint angles (rad) of every calibrated joint; J0 is J1 + J2
        self.angles = {n: self._rest(n) for n in self.cal.tables}
        # joint -> (angle, raw ADC): the inverse calibration runs only for joints that moved (most of them
        # rest most of the time; the virtual hand runs this model in every 1 ms frame)
        self._raw_cache: dict[str, tuple[float, int]] = {}
        self._tactile_cache: tuple[int, tuple[tuple[int, ...], ...]] | None = None
        self._tactile_flat_cache: tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] | None = None
        # (wobble, every joint angle) -> the sensor words: a palm at rest sends the same words
        self._sensor_cache: tuple[tuple[int, tuple[float, ...]], tuple[int, ...]] | None = None

    # -- wiring and faults ----------------------------------------------------------------------------
    def add_can_node(self, node: CanNode) -> None:
        self.can_nodes.append(node)

    def drop_status(self, n: int = 1) -> None:
        """The next `n` statuses read as an empty mailbox (all zeros), as when the palm is late."""
        self.drop_next += n

    def silence_motor(self, motor: int, silent: bool = True) -> None:
        """The motor stops answering (not on the EtherCAT status, not on CAN)."""
        self.motors[motor].silent = silent

    def overheat_motor(self, motor: int, on: bool = True) -> None:
        m = self.motors[motor]
        m.overheat = on
        if not on:
            m.temperature = AMBIENT_C
            m.flags &= ~F_OVER_TEMP

    def corrupt_motor_data(self, motor: int, on: bool = True) -> None:
        """The motor sends the wrong data type (its had-errors bit is set)."""
        self.motors[motor].data_error = on

    # -- the cycle ------------------------------------------------------------------------------------
    def exchange(self, command: bytes) -> bytes:
        self.cycle += 1
        head = command_head(command, self.protocol)
        if head is None:
            self.command_errors += 1
            self._physics(ToMotorDataType.INVALID)
            return bytes(self.info.status_size)
        edc, from_type, which, to_type, motor_data, tactile_type, aux_type = head
        self.edc_command = edc
        block: tuple[int, ...] = _NO_BLOCK
        can_out = NO_CAN
        if edc == EdcCommand.CAN_DIRECT_MODE:
            cmd = unpack_command(bytes(command), self.protocol)
            if isinstance(cmd, PalmCommand) and not cmd.can.empty:
                self._bus_send(cmd.can.can_bus, cmd.can.message_id, cmd.can.payload)
            can_out = self._bus_receive()
            self._physics(ToMotorDataType.INVALID)  # a pure bridge: no demands reach the motors
        elif edc in (EdcCommand.SENSOR_DATA, EdcCommand.SENSOR_CHANNEL_NUMBERS, EdcCommand.SENSOR_ADC_CHANNEL_CS):
            self._to_motors(to_type, motor_data)
            self._physics(to_type)
            block = self._poll(from_type, which)
        else:
            self._physics(ToMotorDataType.INVALID)
        if self.drop_next > 0 or edc == EdcCommand.INVALID:
            self.drop_next = max(0, self.drop_next - 1)
            return bytes(self.info.status_size)
        return pack_status_fields(self.protocol, edc, self._sensors(edc), block, tactile_type, 0x1F,
                                  self._tactile_flat(), 180 + self.cycle % 40, can_out, aux_type)

    # -- motors ---------------------------------------------------------------------------------------
    def _to_motors(self, kind: int, data: tuple[int, ...]) -> None:
        t = ToMotorDataType
        if kind in _DEMAND_MODES:  # nearly every frame: one tight loop
            cycle = self.cycle
            for m in self.motors:
                if not m.silent:
                    m.can_rx += 1
                    m.mode, m.demand, m.last_demand_cycle = kind, data[m.id], cycle
                    m.flags &= _NOT_NO_DEMAND
            return
        for m in self.motors:
            if m.silent:
                continue
            v = data[m.id]
            m.can_rx += 1
            if kind in (t.DEMAND_TORQUE, t.DEMAND_PWM):
                m.mode, m.demand, m.last_demand_cycle = kind, v, self.cycle
                m.flags &= ~F_NO_DEMAND
            elif kind == t.SYSTEM_RESET and (v & 0xFFFF) == SYSTEM_RESET_MAGIC | (m.id % 10):
                self._reset(m)
            elif kind == t.SYSTEM_CONTROLS and v:
                self._controls(m, v & 0xFF)
            elif t.CONFIG_TORQUE_LIMIT <= kind <= t.CONFIG_DEADBAND_SIGN:
                m.pending[kind] = v & 0xFFFF
                m.last_config = (kind, v & 0xFFFF)
            elif kind == t.CONFIG_CRC and v:
                self._crc(m, v & 0xFFFF)

    def _reset(self, m: PalmMotorModel) -> None:
        m.resets += 1
        m.flags = F_OVER_TEMP if m.overheat else 0
        m.demand, m.torque, m.pwm, m.pending = 0, 0.0, 0, {}
        m.last_demand_cycle = self.cycle

    def _controls(self, m: PalmMotorModel, bits: int) -> None:
        if bits & SystemControl.BACKLASH_COMPENSATION_ENABLE:
            m.backlash = True
        if bits & SystemControl.BACKLASH_COMPENSATION_DISABLE:
            m.backlash = False
        for inc, dec in ((SystemControl.SGL_TRACKING_INC, SystemControl.SGL_TRACKING_DEC),
                         (SystemControl.SGR_TRACKING_INC, SystemControl.SGR_TRACKING_DEC)):
            m.sg_tracking += (1 if bits & inc else 0) - (1 if bits & dec else 0)
        if bits & SystemControl.INITIATE_JIGGLING:
            m.jiggle_left = 200
        if bits & SystemControl.EEPROM_WRITE:
            m.eeprom_left, m.eeprom_writes = 30, m.eeprom_writes + 1

    def _crc(self, m: PalmMotorModel, crc: int) -> None:
        words: dict[int, int] = {int(k): m.pending.get(k, 0) for k in CONFIG_TYPES}
        m.pending = {}
        if crc != config_crc(words):
            m.flags |= F_CRC_FAILED
            return
        m.flags &= ~F_CRC_FAILED
        for k, (lo, hi) in DEMAND_RANGES.items():
            v = words.get(k)
            signed = v - 0x10000 if v is not None and v & 0x8000 else v
            if signed is not None and not lo <= signed <= hi:
                m.flags |= F_OUT_OF_RANGE
                return
        m.flags &= ~F_OUT_OF_RANGE
        m.config, m.config_accepted = words, m.config_accepted + 1

    def _physics(self, kind: int) -> None:
        dt = 0.001
        cycle = self.cycle
        for m in self.motors:
            if cycle - m.last_demand_cycle > NO_DEMAND_TIMEOUT_MS:
                m.flags |= F_NO_DEMAND
            if (m.torque == 0.0 and not m.overheat and not m.jiggle_left and not m.eeprom_left
                    and (not m.demand or m.silent or m.flags & SERIOUS or m.mode not in _DEMAND_MODES)):
                # at rest (no target, no torque): the general step below reduces to exactly this
                if m.temperature > OVER_TEMPERATURE_C:
                    m.flags |= F_OVER_TEMP
                m.flags &= _NOT_TIMED_FLAGS
                m.pwm, m.current = 0, 0.0
                if m.temperature != AMBIENT_C:
                    m.temperature += (0.0 - (m.temperature - AMBIENT_C) * 0.001) * dt * 10
                continue
            if m.overheat:
                m.temperature = min(m.temperature + 0.5, 70.0)
            if m.temperature > OVER_TEMPERATURE_C:
                m.flags |= F_OVER_TEMP
            m.flags = (m.flags & ~F_JIGGLING) | (
                F_JIGGLING if m.jiggle_left > 0 else 0)
            m.flags = (m.flags & ~F_EEPROM) | (F_EEPROM if m.eeprom_left > 0 else 0)
            m.jiggle_left, m.eeprom_left = max(0, m.jiggle_left - 1), max(0, m.eeprom_left - 1)
            target, m.pwm = 0.0, 0
            if m.running and not m.silent:
                if m.mode == T_TORQUE:
                    limit = m.config.get(ToMotorDataType.CONFIG_TORQUE_LIMIT, 0)
                    target = float(max(-limit, min(limit, m.demand)) if limit else m.demand)
                    m.pwm = max(-0x3FF, min(0x3FF, round((target - m.torque) * 0.5)))
                elif m.mode == T_PWM:
                    m.pwm = max(-0x3FF, min(0x3FF, m.demand))
                    target = m.pwm * PWM_TO_TORQUE
            m.torque += (target - m.torque) / TORQUE_TAU_CYCLES
            if abs(m.torque) < 0.05 and target == 0.0:
                m.torque = 0.0
            m.current = abs(m.pwm) / 0x3FF * 1.2
            if not m.overheat:  # copper heats with current, cools towards ambient
                m.temperature += (m.current * m.current * 0.02 - (m.temperature - AMBIENT_C) * 0.001) * dt * 10
            self._move(m, dt)

    def _move(self, m: PalmMotorModel, dt: float) -> None:
        joint = self.cal.joint_of_motor.get(m.id)
        if joint is None or m.torque == 0.0:
            return
        names = [f"{joint[:2]}J1", f"{joint[:2]}J2"] if joint.endswith("J0") else [joint]
        for n in names:
            lo, hi = self.cal.tables[n].range_rad
            self.angles[n] = max(lo, min(hi, self.angles[n] + m.torque * RAD_PER_TORQUE_S * dt / len(names)))

    def _poll(self, kind: int, which: int) -> tuple[int, ...]:
        """motor_data_type, which_motors, arrived, had_errors, then 10 x (torque, misc)."""
        arrived = errors = 0
        packets = [0] * 20
        for m in self.motors[which::2]:
            if m.silent:
                continue
            arrived |= 1 << m.id
            m.can_tx += 1
            half = m.id >> 1
            packets[2 * half], packets[2 * half + 1] = m.answer(kind)
            if m.data_error:
                # the driver tests bit motor_id/2 of had_errors (docs/reference/shadow_ethercat.md §2.3); we set that
                # bit
                errors |= 1 << half
        return (kind, which, arrived, errors, *packets)

    # -- sensors --------------------------------------------------------------------------------------
    def _rest(self, name: str) -> float:
        lo, hi = self.cal.tables[name].range_rad
        return max(lo, min(hi, 0.1))

    def joint_raw(self, name: str) -> int:
        return max(0, min(4095, round(self.cal.tables[name].inverse(self.angles[name]))))

    def _sensors(self, edc: int) -> tuple[int, ...]:
        if edc == EdcCommand.SENSOR_CHANNEL_NUMBERS:
            return tuple(channel_word(*self.channel_overrides.get(n, EXPECTED_CHANNELS[n])) for n in SENSOR_NAMES)
        if edc == EdcCommand.SENSOR_ADC_CHANNEL_CS:
            return tuple(self.channel_overrides.get(n, EXPECTED_CHANNELS[n])[0] for n in SENSOR_NAMES)
        wobble = round(20 * math.sin(self.cycle / 500))
        key = (wobble, tuple(self.angles.values()))
        if self._sensor_cache is not None and self._sensor_cache[0] == key:
            return self._sensor_cache[1]
        cache = self._raw_cache
        raw: dict[str, int] = {}
        for n, angle in self.angles.items():
            hit = cache.get(n)
            if hit is None or hit[0] != angle:
                hit = cache[n] = (angle, self.joint_raw(n))
            raw[n] = hit[1]
        extra = {"THJ5A": raw["THJ5"], "THJ5B": raw["THJ5"], "WRJ1A": raw["WRJ1"], "WRJ1B": raw["WRJ1"],
                 "ACCX": wobble & 0xFFFF, "ACCY": 0, "ACCZ": 16384, "GYRX": (-wobble) & 0xFFFF, "GYRY": 3,
                 "GYRZ": 0, "AN0": 1000, "AN1": 1001, "AN2": 1002, "AN3": 1003, "IGNORE": 0}
        out = tuple(raw[n] if n in raw else extra[n] for n in SENSOR_NAMES)
        self._sensor_cache = (key, out)
        return out

    def _tactile_flat(self) -> tuple[int, ...]:
        t = self._tactile()
        if self._tactile_flat_cache is None or self._tactile_flat_cache[0] is not t:
            self._tactile_flat_cache = (t, tuple(w for words in t for w in words))
        return self._tactile_flat_cache[1]

    def _tactile(self) -> tuple[tuple[int, ...], ...]:
        step = (self.cycle // 100) % 10  # the pattern moves every 100 cycles
        if self._tactile_cache is None or self._tactile_cache[0] != step:
            words = 16 if self.protocol == "0230" else 8
            self._tactile_cache = (step, tuple(tuple((100 * (t + 1) + k + step) & 0xFFFF for k in range(words))
                                               for t in range(5)))
        return self._tactile_cache[1]

    # -- CAN direct mode ------------------------------------------------------------------------------
    def _bus_send(self, bus: int, sid: int, data: bytes) -> None:
        self.bus_log.append((self.cycle, bus, sid, data))
        replies: list[CanReply] = []
        if self.motor_can_replies:
            replies += self._motor_boards(bus, sid)
        for node in self.can_nodes:
            replies += node.on_can_frame(bus, sid, data)
        for rbus, rsid, rdata in replies:
            self._rx.append((self.cycle + 1, rbus, rsid & 0x7FF, bytes(rdata[:8])))

    def _motor_boards(self, bus: int, sid: int) -> list[CanReply]:
        """Application firmware on the motor boards: a DATA_REQUEST gets one FROM_MOTOR frame per
        board on that bus (torque, misc little-endian)."""
        direction, _, _, kind = split_sid(sid)
        if direction != CanDirection.DATA_REQUEST or bus not in (1, 2):
            return []
        out: list[CanReply] = []
        for m in self.motors[(bus - 1) * 10: bus * 10]:
            if m.silent:
                continue
            torque, misc = m.answer(kind)
            data = (torque & 0xFFFF).to_bytes(2, "little") + misc.to_bytes(2, "little")
            out.append((bus, make_sid(CanDirection.FROM_MOTOR, m.id % 10, kind), data))
        return out

    def _bus_receive(self) -> CanBridgeFrame:
        """One received frame per cycle, and never before the cycle after it was sent."""
        if self._rx and self._rx[0][0] <= self.cycle:
            _, bus, sid, data = self._rx.popleft()
            return CanBridgeFrame(bus, len(data), sid, data)
        return NO_CAN

    # -- views for tests and the stop report ---------------------------------------------------------
    @property
    def at_rest(self) -> bool:
        """No motor moving or counting down, no fault or CAN reply pending."""
        return self.drop_next == 0 and not self._rx and all(
            m.torque == 0.0 and not m.jiggle_left and not m.eeprom_left and not m.overheat for m in self.motors)

    @property
    def demands(self) -> list[int]:
        return [m.demand for m in self.motors]
