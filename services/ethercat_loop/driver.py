"""The per-cycle palm logic (what SR06 packCommand/unpackState did), pure: no I/O, no clock.

`PalmDriver.cycle(status, now_ns)` decodes the previous status (None = lost frame) and returns the next
command bytes; control messages (control.py) change it through its `DriverControls` operations
(`msg.apply(driver)`); `snapshot()` is a picklable view (snapshot.py).

Fixed defects of the original (docs/reference/shadow_ethercat.md §2.3): demands expire (deadman) and a halt zeroes
them (the
original ignored its halt flag); torque is not updated from SLOW_MISC/READBACK replies, whose `torque`
word holds a type; a demand is sent at least every MAX_NON_DEMAND_CYCLES cycles so queued configs or
controls can never starve the motors into their 20 ms no-demand stop; queues are bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import POLL_TYPES, CanFrame, CanRxFrame, ControlMode
from services.ethercat_loop.protocol import (
    CONFIG_FIRST,
    CONFIG_TYPES,
    NO_CAN,
    NUM_MOTORS,
    PROTOCOLS,
    SERIOUS_ERROR_FLAGS,
    SLOW_DATA_LAST,
    CanBridgeFrame,
    EdcCommand,
    FromMotorDataType,
    FromMotorSlowDataType,
    PalmStatus,
    SystemControl,
    ToMotorDataType,
    command_packer,
    flag_names,
    pack_command_fields,
    s16,
    status_head,
    unpack_status,
)
from services.ethercat_loop.snapshot import (
    PalmJointSnapshot,
    PalmMotorSnapshot,
    PalmSnapshot,
    calibrated_joints,
    status_fields,
)

MAX_NON_DEMAND_CYCLES = 12  # one whole config push (11 cycles) + 1; well under the motors' 20 ms timeout
CONFIG_PUSH_CYCLES = len(CONFIG_TYPES) + 1
INIT_TIMEOUT_NS = 5_000_000_000  # like the original's 5 s "Motor Initialization Timeout"
CAN_TX_QUEUE_MAX = 4096
CAN_RX_KEEP = 4096
_ZERO_WORDS = (0,) * NUM_MOTORS
_FOREVER = 1 << 62
_NO_FRAMES: list[CanRxFrame] = []  # never appended to: callers only test and iterate it


# types applied at once: each SLOW_MISC reply carries another slow value, READBACK is asked for and awaited
_EAGER_KINDS = frozenset((int(FromMotorDataType.SLOW_MISC), int(FromMotorDataType.READBACK_LAST_CONFIG)))
_HALF_MASK = (sum(1 << i for i in range(0, NUM_MOTORS, 2)), sum(1 << i for i in range(1, NUM_MOTORS, 2)))
_FLAG_NAMES: dict[int, tuple[str, ...]] = {}


def _flag_names(flags: int) -> tuple[str, ...]:
    """flag_names, memoised: a snapshot asks for 20 motors' names, and the flags rarely change."""
    names = _FLAG_NAMES.get(flags)
    if names is None:
        if len(_FLAG_NAMES) > 4096:  # 16-bit words: bounded anyway, but keep it small
            _FLAG_NAMES.clear()
        names = _FLAG_NAMES[flags] = tuple(flag_names(flags))
    return names


def _per_1000(v: int) -> float:
    return v / 1000.0


def _per_256(v: int) -> float:
    return v / 256.0


# the FROM_MOTOR types whose misc word sets one field (attribute, conversion); the rest: PalmDriver._misc
_SIMPLE_MISC: dict[int, tuple[str, Callable[[int], int | float] | None]] = {
    FromMotorDataType.SGL: ("sgl", None), FromMotorDataType.SGR: ("sgr", None), FromMotorDataType.PWM: ("pwm", s16),
    FromMotorDataType.FLAGS: ("flags", None), FromMotorDataType.CURRENT: ("current", _per_1000),
    FromMotorDataType.VOLTAGE: ("voltage", _per_256), FromMotorDataType.TEMPERATURE: ("temperature", _per_256),
    FromMotorDataType.CAN_NUM_RECEIVED: ("can_received", None),
    FromMotorDataType.CAN_NUM_TRANSMITTED: ("can_transmitted", None),
}

# The current per-hand defaults (sr_hand_config/2106/rates/motor_data_polling.yaml):
# -1 important (round robin), -2 initialisation only, >0 period in seconds.
DEFAULT_POLLING: dict[str, float] = {
    "sgl": -1, "sgr": -1, "pwm": -1, "flags": -1, "current": -1, "voltage": 2, "temperature": 1,
    "can_num_received": 0.1, "can_num_transmitted": 0.1, "slow_data": -2, "can_error_counters": 0.1,
    "pterm": -2, "iterm": -2, "dterm": -2,
}

# ------------------------------------------------------------------------------------------- state
@dataclass
class _Motor:
    id: int
    torque: int | None = None
    flags: int | None = None
    temperature: float | None = None
    current: float | None = None
    voltage: float | None = None
    pwm: int | None = None
    sgl: int | None = None
    sgr: int | None = None
    last_seen_ns: int | None = None
    missed: int = 0
    data_errors: int = 0
    slow: dict[str, int] = field(default_factory=dict)
    last_config: tuple[int, int] | None = None
    can_received: int | None = None
    can_transmitted: int | None = None
    can_errors: tuple[int, int] | None = None
    terms: dict[str, int] = field(default_factory=dict)
    demand: int = 0
    demand_until: int | None = None  # CLOCK_MONOTONIC ns the demand holds until (None: no demand armed)
    demand_sent: int = 0


class PollSchedule:
    """Which FROM_MOTOR type to ask for next (generic_updater semantics)."""

    def __init__(self, rates: dict[str, float], now_ns: int = 0) -> None:
        self.important = [POLL_TYPES[k] for k, v in rates.items() if v == -1]
        self.init_types = [POLL_TYPES[k] for k, v in rates.items() if v == -2]
        self.timers = {POLL_TYPES[k]: int(v * 1e9) for k, v in rates.items() if v > 0}
        self.due = {t: now_ns + p for t, p in self.timers.items()}
        self.queue: deque[FromMotorDataType] = deque()
        self.rr = 0
        self.init_rr = 0

    def next(self, now_ns: int, init: list[FromMotorDataType]) -> FromMotorDataType:
        for t, due in self.due.items():
            if now_ns >= due:
                self.due[t] = now_ns + self.timers[t]
                if t not in self.queue:
                    self.queue.append(t)
        if self.queue:  # queued "unimportant" types take priority, as in the original
            return self.queue.popleft()
        if init and self.init_rr % 2 == 0:  # during initialisation, every other slot is an init type
            self.init_rr += 1
            return init[(self.init_rr // 2) % len(init)]
        self.init_rr += 1
        if not self.important:
            return init[0] if init else FromMotorDataType.FLAGS
        self.rr = (self.rr + 1) % len(self.important)
        return self.important[self.rr]


class PalmDriver:
    """One palm's per-cycle logic. Not thread-safe: the cycle owner calls everything (apply from the
    same thread or under its own lock)."""

    def __init__(self, protocol: str = "0220", calibration: HandCalibration | None = None,
                 polling: dict[str, float] | None = None, demand_timeout_ms: float = 100.0,
                 mode: ControlMode = "pwm", tactile_data_type: int = 0) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}")
        self.protocol = protocol
        self.info = PROTOCOLS[protocol]
        self.cal = calibration or HandCalibration.load()
        self.rates = dict(DEFAULT_POLLING if polling is None else polling)
        self.demand_timeout_ns = int(demand_timeout_ms * 1e6)
        self.mode: ControlMode = mode
        self.tactile_data_type = tactile_data_type
        self.motors = [_Motor(i) for i in range(NUM_MOTORS)]
        self.schedule = PollSchedule(self.rates)
        self.cycle_no = 0
        self.now_ns = 0
        self.which = 1  # the first command asks the even motors
        self.data_type: FromMotorDataType = FromMotorDataType.FLAGS
        self.edc_mode: int = EdcCommand.SENSOR_DATA
        self.can_direct = False
        self.halted = False
        self.nullified = False
        self.stop_seq = 0  # the last bus stop applied (control.BusStop): the backends report its first frame
        self.non_demand_streak = 0
        self.start_ns: int | None = None
        self.phase = "init"
        self._init_seen: dict[int, set[int]] = {}
        self._slow_seen: list[set[int]] = [set() for _ in range(NUM_MOTORS)]
        self._fresh: dict[int, tuple[int, int]] = {}  # motor -> (demand, its deadline or _FOREVER), newest wins
        self._controls: deque[tuple[int, dict[int, int]]] = deque(maxlen=64)  # (to_motor type, motor -> word)
        self._config_steps: deque[tuple[int, dict[int, int]]] = deque(maxlen=64 * 11)
        self._can_tx: deque[CanFrame] = deque()
        self._can_rx: deque[CanRxFrame] = deque(maxlen=CAN_RX_KEEP)
        # the last valid status and the last SENSOR_DATA one, kept raw: decoded only when a snapshot asks
        self._last_raw: bytes | None = None
        self._last: PalmStatus | None = None
        self._sensor_raw: bytes | None = None
        self._packer = command_packer(protocol)
        self._out: tuple[int, ...] = _ZERO_WORDS  # the demand words of the last demand cycle ...
        self._out_until = -1  # ... valid until this CLOCK_MONOTONIC ns (the first deadman due) ...
        self._out_zero = False  # ... computed with this halt / nullify state
        self._joints_cache: tuple[tuple[int, ...], tuple[PalmJointSnapshot, ...]] | None = None
        # (which_motors, motor_data_type) -> (block, ns): motor data not yet applied to `motors`
        self._pending_blocks: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        self.c: dict[str, int] = dict.fromkeys(
            ("cycles", "statuses", "dropped", "lost", "decode_errors", "motor_missing", "motor_data_errors",
             "demands_expired", "demands_late", "configs_sent", "controls_sent", "resets_sent", "init_timeout",
             "can_tx", "can_rx", "can_tx_overflow", "non_demand_cycles", "halt_zero_cycles"), 0)
        self.last_error = ""
        self._reset_init()

    # -- control operations (DriverControls: what control messages do; see control.py) ---------------
    def queue_demands(self, demands: dict[int, int], deadline_ns: int | None = None) -> None:
        """Demands for the next command; each holds `demand_timeout_ms` from that cycle and never past `deadline_ns`
        (CLOCK_MONOTONIC): one already past it then never reaches the wire."""
        until = _FOREVER if deadline_ns is None else deadline_ns
        fresh = self._fresh
        for mid, v in demands.items():
            fresh[mid] = (v, until)

    def set_mode(self, mode: ControlMode) -> None:
        if mode != self.mode:
            self.mode = mode
            self._zero_demands()

    def halt(self, enable: bool) -> None:
        self.halted = enable
        if enable:
            self._zero_demands()

    def bus_stop(self, seq: int) -> None:
        """The bus stop: every demand zero from this cycle's frame on, and forgotten (the deadman's state too),
        so nothing resumes by itself; a jiggle not yet sent is dropped (the other controls, resets and configs
        move nothing). Demand frames go on every cycle, all zero, as long as no new demand comes."""
        self.stop_seq = seq
        self._zero_demands()
        jiggle = int(SystemControl.INITIATE_JIGGLING)
        kept: deque[tuple[int, dict[int, int]]] = deque(maxlen=self._controls.maxlen)
        for kind, words in self._controls:
            if kind == ToMotorDataType.SYSTEM_CONTROLS:
                words = {m: v & ~jiggle for m, v in words.items() if v & ~jiggle}
                if not words:
                    continue
            kept.append((kind, words))
        self._controls = kept

    def queue_to_motors(self, kind: int, words: dict[int, int], config: bool) -> None:
        """One TO_MOTOR word per motor for one cycle: a config step (pushed whole, in order) or a system
        control / reset (priority over configs, as in packCommand)."""
        (self._config_steps if config else self._controls).append((kind, words))

    def set_can_direct(self, enable: bool, flush: bool) -> None:
        if self.can_direct and not enable:
            self._reset_init()  # like reinitialize_boards() after a flash: firmware data may have changed
        self.can_direct = enable
        if flush:
            self._can_tx.clear()
        self._zero_demands()

    def queue_can_tx(self, frames: tuple[CanFrame, ...]) -> None:
        for f in frames:
            if len(self._can_tx) >= CAN_TX_QUEUE_MAX:
                self.c["can_tx_overflow"] += 1
            else:
                self._can_tx.append(f)

    def set_polling(self, rates: dict[str, float]) -> None:
        self.rates = {**self.rates, **rates}
        self.schedule = PollSchedule(self.rates, self.now_ns)
        self._reset_init()

    def reinitialize(self) -> None:
        self._reset_init()

    def _zero_demands(self) -> None:
        self._fresh.clear()
        self._out_until = -1  # the cached demand words are stale
        for m in self.motors:
            m.demand, m.demand_until = 0, None

    def _reset_init(self) -> None:
        self.phase = "init"
        self.start_ns = None
        self._init_seen = {int(t): set() for t in self.schedule.init_types}
        self._slow_seen = [set() for _ in range(NUM_MOTORS)]

    # -- the cycle ------------------------------------------------------------------------------------
    def cycle(self, status: bytes | None, now_ns: int) -> bytes:
        """Decode the previous cycle's status (None: the frame was lost) and build the next command."""
        self.cycle_no += 1
        c = self.c
        c["cycles"] += 1
        self.now_ns = now_ns
        if self.start_ns is None:
            self.start_ns = now_ns
        if status is None:
            c["lost"] += 1
        else:
            self._unpack(status, now_ns)
        return self._pack(now_ns)

    @property
    def last(self) -> PalmStatus | None:
        """The last valid status, decoded (on demand: the cycle itself reads only its motor block)."""
        if self._last is None and self._last_raw is not None:
            st = unpack_status(self._last_raw, self.protocol)
            self._last = st if isinstance(st, PalmStatus) else None
        return self._last

    @property
    def last_sensor_data(self) -> tuple[int, ...] | None:
        """Sensors of the last SENSOR_DATA status (a test-mode status carries channel ids, not positions)."""
        if self._sensor_raw is None:
            return None
        st = self.last if self._sensor_raw is self._last_raw else unpack_status(self._sensor_raw, self.protocol)
        return st.sensors if isinstance(st, PalmStatus) else None

    def _unpack(self, buf: bytes, now_ns: int) -> None:
        head = status_head(buf, self.protocol)
        if head is None:  # the full decoder says why
            err = unpack_status(buf, self.protocol)
            self.c["decode_errors"] += 1
            self.last_error = str(err)
            return
        edc, block = head
        if edc == EdcCommand.INVALID:  # empty mailbox: count and skip, like the original (no halt)
            self.c["dropped"] += 1
            return
        self.c["statuses"] += 1
        self._last_raw, self._last = buf, None
        if edc == EdcCommand.SENSOR_DATA:
            self._sensor_raw = buf
        elif edc == EdcCommand.CAN_DIRECT_MODE:
            st = self.last
            if st is not None and not st.can.empty:
                self.c["can_rx"] += 1
                self._can_rx.append(CanRxFrame(st.can.can_bus, st.can.message_id, st.can.payload, self.cycle_no))
            return
        self._motor_block(block, now_ns)

    def _motor_block(self, block: tuple[int, ...], now_ns: int) -> None:
        """block: motor_data_type, which_motors, arrived, had_errors, then (torque, misc) x 10.

        A complete, error-free block of a type whose last value is all that counts (most of them, out of
        initialisation) is only kept, the newest per (half, type), and applied to the motors when someone
        looks (`_apply_pending`: snapshot): the same motor state, without a loop over motors in the cycle."""
        kind, which = block[0], block[1]
        if (self.phase != "init" and kind not in _EAGER_KINDS and block[2] & _HALF_MASK[which] == _HALF_MASK[which]
                and not block[3] & 0x3FF):
            key = (which, kind)
            pending = self._pending_blocks
            if key in pending:
                del pending[key]  # re-inserted last: applied in arrival order (torque, last seen)
            pending[key] = (block, now_ns)
            return
        self._apply_pending()
        self._apply_block(block, now_ns, self.phase == "init")

    def _apply_pending(self) -> None:
        if self._pending_blocks:
            for block, now_ns in self._pending_blocks.values():
                self._apply_block(block, now_ns, False)
            self._pending_blocks.clear()

    def _apply_block(self, block: tuple[int, ...], now_ns: int, init: bool) -> None:
        kind, which, arrived, had_errors = block[0], block[1], block[2], block[3]
        keep_torque = kind not in (FromMotorDataType.SLOW_MISC, FromMotorDataType.READBACK_LAST_CONFIG)
        simple = _SIMPLE_MISC.get(kind)  # one field of the motor, as _misc sets it
        c = self.c
        for m in self.motors[which::2]:
            mid = m.id
            if not arrived & (1 << mid):
                m.missed += 1
                c["motor_missing"] += 1
                continue
            half = mid >> 1
            # bit motor_id/2 of had_errors, as the original reads it (docs/reference/shadow_ethercat.md §2.3)
            if had_errors & (1 << half):
                m.data_errors += 1
                c["motor_data_errors"] += 1
                continue
            torque, misc = block[4 + 2 * half], block[5 + 2 * half]
            m.last_seen_ns = now_ns
            if keep_torque:
                m.torque = torque  # in SLOW_MISC / READBACK replies `torque` holds a type, not a torque
            if simple is None:
                self._misc(m, kind, torque, misc)
            else:
                setattr(m, simple[0], misc if simple[1] is None else simple[1](misc))
            if init:
                self._note_init(m, kind, torque)

    def _misc(self, m: _Motor, kind: int, torque: int, misc: int) -> None:
        k = FromMotorDataType
        if kind == k.SGL:
            m.sgl = misc
        elif kind == k.SGR:
            m.sgr = misc
        elif kind == k.PWM:
            m.pwm = s16(misc)
        elif kind == k.FLAGS:
            m.flags = misc
        elif kind == k.CURRENT:
            m.current = misc / 1000.0
        elif kind == k.VOLTAGE:
            m.voltage = misc / 256.0
        elif kind == k.TEMPERATURE:
            m.temperature = misc / 256.0
        elif kind == k.CAN_NUM_RECEIVED:
            m.can_received = misc
        elif kind == k.CAN_NUM_TRANSMITTED:
            m.can_transmitted = misc
        elif kind == k.CAN_ERROR_COUNTERS:
            m.can_errors = (misc & 0xFF, misc >> 8)
        elif kind == k.SLOW_MISC:
            if 0 < torque <= SLOW_DATA_LAST:
                m.slow[FromMotorSlowDataType(torque).name.lower()] = misc
        elif kind == k.READBACK_LAST_CONFIG:
            m.last_config = (torque & 0xFFFF, misc)
        elif kind in (k.PTERM, k.ITERM, k.DTERM):
            m.terms[k(kind).name.lower()] = s16(misc)

    def _note_init(self, m: _Motor, kind: int, torque: int) -> None:
        if kind == FromMotorDataType.SLOW_MISC:
            if 0 < torque <= SLOW_DATA_LAST:
                self._slow_seen[m.id].add(torque)
            if len(self._slow_seen[m.id]) < int(SLOW_DATA_LAST):
                return
        seen = self._init_seen.get(kind)
        if seen is not None:
            seen.add(m.id)

    def _init_pending(self) -> list[FromMotorDataType]:
        return [FromMotorDataType(t) for t, seen in self._init_seen.items() if len(seen) < NUM_MOTORS]

    def _pack(self, now_ns: int) -> bytes:
        self.which ^= 1
        if self.phase == "init":
            pending = self._init_pending()
            if not pending:
                self.phase = "operation"
            elif self.start_ns is not None and now_ns - self.start_ns > INIT_TIMEOUT_NS:
                self.phase = "operation"  # like the original: go on anyway, and say so
                self.c["init_timeout"] += 1
        if self.which == 0:  # a new pair (even, then odd) asks for the next type
            self.data_type = self.schedule.next(now_ns, self._init_pending() if self.phase == "init" else [])
        if self.can_direct:
            frame = NO_CAN
            if self._can_tx:
                f = self._can_tx.popleft()
                frame = CanBridgeFrame(f.bus, len(f.data), f.sid, f.data)
                self.c["can_tx"] += 1
            return pack_command_fields(self._packer, self.protocol, EdcCommand.CAN_DIRECT_MODE, self.data_type,
                                       self.which, ToMotorDataType.INVALID, _ZERO_WORDS, self.tactile_data_type,
                                       frame)
        kind, data = self._to_motors(now_ns)
        return pack_command_fields(self._packer, self.protocol, self.edc_mode, self.data_type, self.which, kind, data,
                                   self.tactile_data_type)

    def _to_motors(self, now_ns: int) -> tuple[int, tuple[int, ...]]:
        if self.non_demand_streak < MAX_NON_DEMAND_CYCLES:
            # priority as in packCommand: system controls, then resets, then one config type per cycle
            step = None
            mid_push = bool(self._config_steps) and self._config_steps[0][0] != CONFIG_FIRST
            if self._controls and not mid_push:
                step = self._controls.popleft()
            elif self._config_steps and (self._config_steps[0][0] != CONFIG_FIRST or  # a push is never split
                                         self.non_demand_streak + CONFIG_PUSH_CYCLES <= MAX_NON_DEMAND_CYCLES):
                step = self._config_steps.popleft()
            if step is not None:
                kind, words = step
                self.non_demand_streak += 1
                self.c["non_demand_cycles"] += 1
                key = {ToMotorDataType.SYSTEM_CONTROLS: "controls_sent", ToMotorDataType.SYSTEM_RESET: "resets_sent",
                       ToMotorDataType.CONFIG_CRC: "configs_sent"}.get(ToMotorDataType(kind))
                if key:
                    self.c[key] += 1
                if kind == ToMotorDataType.SYSTEM_RESET:
                    self._reset_init()
                return kind, tuple(s16(words.get(i, 0)) for i in range(NUM_MOTORS))
        self.non_demand_streak = 0
        zero = self.halted or self.nullified
        # nothing new, no deadman due, same halt state: the words of the last demand cycle (most cycles)
        if not self._fresh and now_ns <= self._out_until and zero == self._out_zero:
            out = self._out
        else:
            out = self._demand_words(now_ns, zero)
        if self.halted:
            self.c["halt_zero_cycles"] += 1
        kind = ToMotorDataType.DEMAND_TORQUE if self.mode == "torque" else ToMotorDataType.DEMAND_PWM
        return kind, out

    def _demand_words(self, now_ns: int, zero: bool) -> tuple[int, ...]:
        """Fresh demands in, expired ones (deadman) out; the words to send, and until when they hold."""
        motors = self.motors
        if self._fresh:
            # the deadman from this cycle, cut at the client's deadline; one past it already never takes effect
            hold = now_ns + self.demand_timeout_ns
            for mid, (v, deadline) in self._fresh.items():
                if deadline < now_ns:
                    self.c["demands_late"] += 1
                    continue
                motors[mid].demand, motors[mid].demand_until = v, min(hold, deadline)
            self._fresh.clear()
        out = []
        until = _FOREVER
        for m in motors:
            v = m.demand
            t = m.demand_until
            if t is None or t < now_ns:
                if t is not None:
                    self.c["demands_expired"] += 1
                    m.demand, m.demand_until = 0, None
                v = 0
            else:
                until = min(until, t)
                if zero:
                    v = 0
            m.demand_sent = v
            # validated demands are int16; an out-of-range word wraps on the wire as pack_command's did
            out.append(v if -0x8000 <= v <= 0x7FFF else s16(v))
        self._out, self._out_until, self._out_zero = tuple(out), until, zero
        return self._out

    # -- outputs --------------------------------------------------------------------------------------
    def take_can_rx(self) -> list[CanRxFrame]:
        """Bridge frames received since the last call (CAN direct mode)."""
        if not self._can_rx:
            return _NO_FRAMES  # every cycle calls this: no new list for nothing
        out = list(self._can_rx)
        self._can_rx.clear()
        return out

    @property
    def idle(self) -> bool:
        """Nothing queued, no demand armed, initialisation done: the next cycles depend only on time and
        on the palm's answers (the model backend steps such a palm in batches)."""
        return (self.phase == "operation" and not self.can_direct and not self._fresh and not self._controls
                and not self._config_steps and not self._can_tx and self._out_until >= _FOREVER)

    @property
    def can_tx_pending(self) -> int:
        return len(self._can_tx)

    def snapshot(self, joints: bool = True, motors: bool = True) -> PalmSnapshot:
        """The driver's view. `joints=False` skips the calibration (40 % of the cost): the cycle process's
        lean snapshot, whose joints the MQTT process derives from the raw statuses (`status_fields`).
        `motors=False` leaves `motors` empty (20 motor views, half of the rest): the joints state, 100 Hz."""
        st = self.last or PalmStatus()
        sensor_data = self.last_sensor_data
        if motors:
            self._apply_pending()
        motor_views = () if not motors else tuple(PalmMotorSnapshot(
            id=m.id, joint=self.cal.joint_of_motor.get(m.id), torque=m.torque, demand=m.demand,
            demand_sent=m.demand_sent, flags=m.flags, flag_names=_flag_names(m.flags or 0),
            serious=bool((m.flags or 0) & SERIOUS_ERROR_FLAGS), temperature=m.temperature, current=m.current,
            voltage=m.voltage, pwm=m.pwm, sgl=m.sgl, sgr=m.sgr, last_seen_ns=m.last_seen_ns, missed=m.missed,
            data_errors=m.data_errors, slow=dict(m.slow), last_config=m.last_config, can_received=m.can_received,
            can_transmitted=m.can_transmitted, can_errors=m.can_errors, terms=dict(m.terms)) for m in self.motors)
        # joints from the last SENSOR_DATA status (a test-mode status carries channel ids, not positions)
        last_joints: tuple[PalmJointSnapshot, ...] = ()
        if joints and sensor_data is not None:
            # a palm at rest sends the same joint words: calibrate only when they changed
            key = sensor_data[: self.cal.sensor_span]
            if self._joints_cache is None or self._joints_cache[0] != key:
                self._joints_cache = (key, calibrated_joints(self.cal, sensor_data))
            last_joints = self._joints_cache[1]
        return PalmSnapshot(
            cycle=self.cycle_no, now_ns=self.now_ns, protocol=self.protocol, phase=self.phase, mode=self.mode,
            edc_command=int(EdcCommand.CAN_DIRECT_MODE if self.can_direct else self.edc_mode),
            status_count=self.c["statuses"], can_direct=self.can_direct, halted=self.halted,
            nullified=self.nullified, motors=motor_views, counters={**self.c, "can_tx_pending": len(self._can_tx)},
            **status_fields(st, None, last_joints))
