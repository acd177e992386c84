"""Simulated ROI modules: the firmware's side of the wire, one UDP peer per module octet.

Each module binds <prefix>.<octet>:57344 and :57664 (loopback 127.0.2.x for `make run`, another 127.x.y
prefix per test) and behaves as the firmware does (docs/reference/roi.md §6, Modules/*/src at a1c7216):
- a general datagram is imported with the checksum ignored (§2.4) and **always** answered with 64 bytes to
  the sender's address on port 57344, whatever port it came from (§6.2); blacklisted sources are dropped;
- SysAdmin: PING -> PONG [operable, type], STATUS_REPORT -> 14 bytes, BLACK_LIST is applied but never
  answered (the missing `break`, §3.2), FIRMWARE_REPORT only with `head_firmware` (HEAD); replies go to the
  sender on 57664, except BLANK replies, which are never sent;
- status priority of statusManager (§3.3): initialising 5, unconfigured 6 (BLANK_STATE after every start
  until configured), error 4/2, no chain 3, else 1;
- GPIO (§3.5), ODrive (§3.6) and actuator (§3.7) handlers with their payloads, including the
  GET_FET_TEMPERATURE code 0x00 answering as SET_CONTROL_MODE and the actuator getters that reply [0] = 0;
- the 500 ms disconnect watchdog pausing the ODrive axis (IDLE) and resuming it on traffic (§6.3);
- an ODrive motion model (trapezoidal position, velocity ramp, torque) and an actuator model (ticks).

Deviation, on purpose: the firmware's getter switch strips the get bit with `& !GETMASK` (always 0), so every
ODrive GET answers the control mode (§4.5). The simulator answers the getters as intended by default;
`getter_bug=True` reproduces the firmware as it is (see the service README).

The chain is not exchanged on the wire: with `chain=True` each module's neighbour is the next simulated
octet in the ring, and the chain counts as formed when there are at least two modules.

Faults per module: drop (probability or the next n requests), replies lost (every one, or the next n: the request
is applied, its acknowledgement never arrives), delay, corrupt (bad checksum), duplicate replies, reboot into
BLANK_STATE, a module error (ODrive error bits), offline, and another module type at the
octet (`replace`). Actuators answer GET_CURRENT_LENGTH with their length only with `actuator_length` (a
firmware that implements the getter; the released one answers [0] = 0), and `actuator_max_speed` caps them at
a motor's top speed.

Stop bytes, for the bus stop's tests and bench: once armed (`watch_stop()`, or `--watch-stop` on the command
line, re-armed by SIGHUP), each module stamps the first datagram it receives that stops it (ODrive: SET_VELOCITY
0.0; actuator: a length setter, the hold; GPIO: SET_OUTPUT) with the Unix and monotonic time it arrived
(`stop_stamps()`; on the command line one JSON line per module on stdout), and every such datagram goes in the
order they reached the modules' sockets (`stop_log()`). The time is the kernel's, taken as the datagram reached
the module's socket (SO_TIMESTAMPNS), not the moment this one thread for every module got round to reading it:
a real module reads its own socket, and fifty modules' stops queued behind one another here are the simulator's
delay, not the sender's (where the kernel gives no time: when it was read).

The wire log (`record_wire()`, `wire_log()`): every general datagram the modules receive and apply, in order, for
tests that must see what reached a module and when (nothing of a command after the bus stop's datagrams).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import logging
import math
import random
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from services.roi_modules import protocol as p

log = logging.getLogger("robobus.roi.sim")
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: the kernel's receive time of each datagram
_ANC_SPACE = socket.CMSG_SPACE(16)  # one struct timespec


def _arrival(anc: list[tuple[int, int, bytes]]) -> float | None:
    """The kernel's receive time (SCM_TIMESTAMPNS: a struct timespec, Unix time) of a datagram, if it gave one."""
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("@qq", data)
            return float(sec) + float(nsec) / 1e9
    return None

WATCHDOG_S = 0.5  # WatchdogConstants::WATCHDOG_TIMEOUT = MAINTAIN_SLEEP_TIME x 5
KINDS = {"gpio": p.ModuleType.GENERAL_GPIO, "odrive": p.ModuleType.O_DRIVE, "actuator": p.ModuleType.ACTUATOR}


@dataclass
class Faults:
    drop_rate: float = 0.0  # probability that an incoming datagram is lost
    drop_next: int = 0  # lose the next n incoming datagrams
    delay_s: float = 0.0  # answer this late
    corrupt_rate: float = 0.0  # probability that a reply leaves with a wrong checksum
    duplicate: bool = False  # send every reply twice (the second one matches nothing)
    offline: bool = False  # unplugged: nothing is answered
    # replies lost on their way back: the request is applied (it moves the module), its acknowledgement never comes
    drop_replies: bool = False  # every reply
    drop_replies_next: int = 0  # the next n replies


@dataclass(frozen=True)
class StopStamp:
    """The first stop bytes a module received after the watch was armed."""

    octet: int
    kind: str
    action: int
    unix: float
    monotonic: float


@dataclass(frozen=True)
class WireRecord:
    """One general datagram a module received and applied (the wire log, `RoiSim.record_wire`)."""

    octet: int
    sub_device_id: int
    action: int
    payload: bytes
    unix: float  # when it reached the module's socket (the kernel's time where given)
    stop: bool  # the datagram stops the module (as the stop watch counts it)


@dataclass
class ModuleCounters:
    general_rx: int = 0
    sysadmin_rx: int = 0
    bad_checksum_rx: int = 0
    dropped: int = 0
    replies: int = 0
    replies_dropped: int = 0
    blacklisted_dropped: int = 0


class ModuleFirmware:
    """One module's firmware state: the infrastructure (status, blacklist, watchdog) and a type handler."""

    module_type: p.ModuleType = p.ModuleType.GENERAL_GPIO

    def __init__(self, octet: int, now: float, *, supply_mv: int = 4950, mac: bytes | None = None,
                 watchdog_s: float = WATCHDOG_S, head_firmware: bool = False) -> None:
        self.octet = octet
        self.supply_mv = supply_mv
        # macGen.cpp: a generated MAC is locally administered unicast
        self.mac = mac or bytes([0x02, 0x52, 0x4F, 0x49, 0x00, octet])
        self.watchdog_s = watchdog_s
        self.head_firmware = head_firmware
        self.faults = Faults()
        self.counters = ModuleCounters()
        self.blacklist: set[int] = set()
        self.neighbour = 0
        self.chain_ok = False
        self.boots = 0
        self.reboot(now)

    # -- infrastructure ------------------------------------------------------------------------------
    def reboot(self, now: float) -> None:
        """Power cycle: BLANK_STATE until configured again, uptime from zero, handler state reset."""
        self.boot_time = now
        self.initialised = True
        self.configured = False
        self.error = False
        self.inoperable = False
        self.last_general_rx = now
        self.watchdog_tripped = False
        self.boots += 1
        self.reset_handler()

    def reset_handler(self) -> None:
        """Type-specific state after a boot."""

    def status(self) -> int:
        """statusManager::getSystemStatus, in its priority order."""
        if not self.initialised:
            return p.ModuleState.INITIALIZING
        if not self.configured:
            return p.ModuleState.BLANK_STATE
        if self.error:
            return p.ModuleState.NOT_OPERABLE if self.inoperable else p.ModuleState.OPERATING_WITH_ERRORS
        if not self.chain_ok:
            return p.ModuleState.OPERATING_WITHOUT_CHAIN
        return p.ModuleState.OPERATING

    @property
    def operable(self) -> bool:
        return self.initialised and not (self.error and self.inoperable)

    def status_report(self, now: float) -> p.StatusReport:
        up_ms = int((now - self.boot_time) * 1000)
        return p.StatusReport(state=self.status(), hours=(up_ms // 3_600_000) & 0xFF, minutes=(up_ms // 60_000) % 60,
                              seconds=(up_ms // 1000) % 60, supply_mv=self.supply_mv, module_type=self.module_type,
                              neighbour=self.neighbour, mac=self.mac)

    def tick(self, now: float) -> None:
        """The watchdog (§6.3): no general packet for watchdog_s -> disconnect callback, once."""
        if not self.watchdog_tripped and now - self.last_general_rx > self.watchdog_s:
            self.watchdog_tripped = True
            self.on_disconnect(self.last_general_rx + self.watchdog_s)

    def on_disconnect(self, at: float) -> None:
        """Disconnect callback; the ODrive pauses its axis."""

    def on_reconnect(self, now: float) -> None:
        """Reconnect callback; the ODrive resumes."""

    # -- packets -------------------------------------------------------------------------------------
    def handle_general(self, pkt: p.GeneralPacket, now: float) -> p.GeneralPacket:
        self.tick(now)
        self.last_general_rx = now
        if self.watchdog_tripped:
            self.watchdog_tripped = False
            self.on_reconnect(now)
        return self.handle(pkt, now)

    def handle(self, pkt: p.GeneralPacket, now: float) -> p.GeneralPacket:
        return pkt.reply()

    def is_stop(self, pkt: p.GeneralPacket) -> bool:
        """The datagram stops this module (what the stop watch stamps)."""
        return False

    def handle_sysadmin(self, pkt: p.SysAdminPacket, now: float) -> p.SysAdminPacket | None:
        """sysAdminHandler: the reply keeps meta and origin (§2.6); None when the reply would be BLANK."""
        self.tick(now)
        act = pkt.action
        if act == p.SysAdminAction.PING:
            return p.SysAdminPacket(p.SysAdminAction.PONG, p.Pong(self.operable, self.module_type).encode(),
                                    pkt.meta, pkt.origin)
        if act == p.SysAdminAction.STATUS_REPORT:
            return p.SysAdminPacket(act, self.status_report(now).encode(), pkt.meta, pkt.origin)
        if act == p.SysAdminAction.BLACK_LIST:
            op, octet = pkt.payload[0], pkt.payload[1]
            if op == p.BlacklistOp.ADD:
                self.blacklist.add(octet)
            elif op == p.BlacklistOp.REMOVE:
                self.blacklist.discard(octet)
            return None  # no `break`: falls through to default, the reply is BLANK and never sent (§3.2)
        if act == p.SysAdminAction.FIRMWARE_REPORT and self.head_firmware:
            return p.SysAdminPacket(act, p.encode_firmware_report("12:00:00", "Oct 23 2025"), pkt.meta, pkt.origin)
        return None


class GpioFirmware(ModuleFirmware):
    """Modules/GPIO ROI Module/src/main.cpp (§3.5)."""

    module_type = p.ModuleType.GENERAL_GPIO

    def reset_handler(self) -> None:
        self.modes = [0] * p.GPIO_COUNT
        self.outputs = [0] * p.GPIO_COUNT
        # what the outside world drives onto a digital input (None: floating); tests may set these
        self.external: list[int | None] = [None] * p.GPIO_COUNT
        self.analog = {pin: (137 * (pin - 9) + self.octet) % 1024 for pin in p.ANALOG_PINS}

    def is_stop(self, pkt: p.GeneralPacket) -> bool:
        return pkt.action == p.GpioAction.SET_OUTPUT

    def read(self, pin: int) -> int:
        if self.modes[pin] == p.PinMode.OUTPUT:
            return self.outputs[pin]
        if pin >= 10:
            return self.analog[pin]
        ext = self.external[pin]
        if ext is None:  # floating: the pull-up reads high, a plain input low
            return 1 if self.modes[pin] == p.PinMode.INPUT_PULLUP else 0
        return 1 if ext else 0

    def handle(self, pkt: p.GeneralPacket, now: float) -> p.GeneralPacket:
        pin, act = pkt.sub_device_id, pkt.action
        valid = pin < 8 or 10 <= pin <= 17
        if act == p.GpioAction.SET_PIN_MODE:
            mode = pkt.payload[0]
            if not valid or mode > 3:
                return pkt.reply(b"\x00")
            self.modes[pin] = mode
            self.configured = True  # a successful SET_PIN_MODE leaves BLANK_STATE
            return pkt.reply(b"\x01")
        if act == p.GpioAction.SET_OUTPUT:
            if not valid or pin > 15 or self.modes[pin] != p.PinMode.OUTPUT:
                return pkt.reply(b"\x00")
            self.outputs[pin] = 1 if pkt.payload[0] else 0
            return pkt.reply(b"\x01")
        if act == p.GpioAction.READ:
            value = self.read(pin) if valid else 0
            return pkt.reply(p.u16(value) if pin >= 8 else bytes([value, 0]))  # always 2 bytes
        return pkt.reply()


class OdriveFirmware(ModuleFirmware):
    """Modules/ODrive ROI Module (oDriveController.cpp, §3.6) with a motion model of the axis."""

    module_type = p.ModuleType.O_DRIVE
    max_velocity = 10.0  # rev/s, the axis' velocity limit when no feed-forward is given
    accel = 20.0  # rev/s^2 of the velocity ramp
    torque_gain = 40.0  # rev/s^2 per Nm against viscous friction
    friction = 2.0  # 1/s

    def __init__(self, *args: Any, getter_bug: bool = False, **kw: Any) -> None:
        self.getter_bug = getter_bug
        super().__init__(*args, **kw)

    def reset_handler(self) -> None:
        self.control_mode = int(p.ControlMode.POSITION)
        self.input_mode = int(p.InputMode.AUTO_BEST_FIT)  # the controller's constructor default
        self.pos_sp = 0.0
        self.vel_sp = 0.0
        self.torque_sp = 0.0
        self.pos = 0.0  # incremental encoder: position restarts at 0 with the module
        self.vel = 0.0
        self.errors = 0
        self.paused = False
        self.bus_voltage = 24.0
        self.fet_temp = 35.0
        self.motor_temp = 30.0
        self.t_model = self.boot_time

    @property
    def current(self) -> float:
        return round(0.2 + 0.15 * abs(self.vel) + 0.5 * abs(self.torque_sp if self.control_mode == 2 else 0.0), 4)

    def advance(self, now: float) -> None:
        """Integrate the axis from the last model time to `now` (in small steps, so stops are exact)."""
        t = self.t_model
        if now <= t:
            return
        stalled = self.paused or (self.error and self.inoperable)
        while t < now:
            dt = min(0.01, now - t)
            t += dt
            if stalled:
                self.vel = 0.0  # axis IDLE: the motor is off
                continue
            if self.control_mode == p.ControlMode.POSITION:
                vmax = abs(self.vel_sp) if self.vel_sp else self.max_velocity
                err = self.pos_sp - self.pos
                want = max(-vmax, min(vmax, err / max(dt, 0.05)))
                # trapezoidal: accelerate toward `want`, and never overshoot the set-point
                step = max(-self.accel * dt, min(self.accel * dt, want - self.vel))
                self.vel += step
                self.vel = max(-math.sqrt(2 * self.accel * abs(err)), min(math.sqrt(2 * self.accel * abs(err)),
                                                                          self.vel))
                move = self.vel * dt
                if abs(move) >= abs(err):
                    self.pos, self.vel = self.pos_sp, 0.0
                else:
                    self.pos += move
            elif self.control_mode == p.ControlMode.VELOCITY:
                step = max(-self.accel * dt, min(self.accel * dt, self.vel_sp - self.vel))
                self.vel += step
                self.pos += self.vel * dt
            else:
                self.vel += (self.torque_gain * self.torque_sp - self.friction * self.vel) * dt
                self.vel = max(-self.max_velocity, min(self.max_velocity, self.vel))
                self.pos += self.vel * dt
        self.fet_temp = 35.0 + min(30.0, 2.0 * abs(self.vel))
        self.t_model = now

    def on_disconnect(self, at: float) -> None:
        self.advance(at)
        self.paused = True  # odrive.setState(AXIS_STATE_IDLE)

    def on_reconnect(self, now: float) -> None:
        self.t_model = max(self.t_model, now)
        self.paused = False  # AXIS_STATE_CLOSED_LOOP_CONTROL

    def is_stop(self, pkt: p.GeneralPacket) -> bool:
        return pkt.action == p.OdriveAction.SET_VELOCITY and pkt.sub_device_id == 0 and p.read_f32(pkt.payload) == 0.0

    def set_error(self, bits: int, operable: bool) -> None:
        self.errors = bits
        self.error = bits != 0
        self.inoperable = bits != 0 and not operable

    def handle(self, pkt: p.GeneralPacket, now: float) -> p.GeneralPacket:
        self.advance(now)
        act, data = pkt.action, pkt.payload
        if pkt.sub_device_id != 0:  # ODriveContainer<1>: an invalid id is answered [0] = 0
            return pkt.reply(b"\x00")
        if not p.odrive_is_get(act):
            self.configured = True  # every set marks the module configured
            if act == p.OdriveAction.SET_CONTROL_MODE:  # also what GET_FET_TEMPERATURE (0x00) lands on
                self.control_mode = data[0]
                if self.control_mode == p.ControlMode.POSITION:
                    self.pos_sp = self.pos  # a switch holds the axis where it is
            elif act == p.OdriveAction.SET_INPUT_MODE:
                self.input_mode = data[0]
            elif act == p.OdriveAction.SET_TORQUE:
                self.torque_sp = p.read_f32(data)
            elif act == p.OdriveAction.SET_POSITION:
                self.pos_sp = p.read_f32(data)
            elif act == p.OdriveAction.SET_VELOCITY:
                self.vel_sp = p.read_f32(data)
            elif act == p.OdriveAction.SET_RELATIVE_POSITION:
                self.pos_sp += p.read_f32(data)
            elif act == p.OdriveAction.CLEAR_ERRORS:
                self.set_error(0, True)
            else:
                return pkt.reply()  # unknown setter: the reply stays zero
            return pkt.reply(b"\x01")
        ref = 0 if self.getter_bug else p.odrive_ref(act)  # firmware: `action & !GETMASK` == 0
        if ref == p.OdriveRef.CONTROL_MODE:
            return pkt.reply(bytes([self.control_mode]))
        if ref == p.OdriveRef.INPUT_MODE:
            return pkt.reply(bytes([self.input_mode]))
        floats: dict[int, float] = {p.OdriveRef.TORQUE: self.torque_sp, p.OdriveRef.POSITION_SETPOINT: self.pos_sp,
                  p.OdriveRef.VELOCITY_SETPOINT: self.vel_sp, p.OdriveRef.POSITION: self.pos,
                  p.OdriveRef.VELOCITY: self.vel, p.OdriveRef.BUS_VOLTAGE: self.bus_voltage,
                  p.OdriveRef.CURRENT: self.current, p.OdriveRef.MOTOR_TEMPERATURE: self.motor_temp}
        if ref in floats:
            return pkt.reply(p.f32(floats[ref]))
        if ref == p.OdriveRef.ERROR:
            return pkt.reply(p.u32(self.errors))
        if ref == p.OdriveRef.KINEMATIC_FEEDBACK:
            return pkt.reply(p.f32(self.pos) + p.f32(self.vel))
        if ref == p.OdriveRef.ALL:
            return pkt.reply(p.OdriveAll(self.pos, self.vel, self.bus_voltage, self.current, self.fet_temp,
                                         self.motor_temp, self.errors).encode())
        return pkt.reply()


class ActuatorFirmware(ModuleFirmware):
    """Modules/Actuator ROI Module (ActuatorContainer<2>, §3.7): every reply is [0] = 0, getters unimplemented,
    and the firmware never calls notifySystemConfigured, so the module stays in BLANK_STATE.

    `length_feedback=True` answers GET_CURRENT_LENGTH with the current length as uint16 BE ticks, the layout
    the ROS node at 6ec908d reads (a firmware that implements the getter); False is the released firmware.
    `max_speed` (ticks/s) caps the motion as a real actuator's motor does, whatever velocity was commanded."""

    module_type = p.ModuleType.ACTUATOR
    default_speed = 50.0  # ticks/s when no velocity was set

    def __init__(self, *args: Any, length_feedback: bool = False, max_speed: float | None = None,
                 **kw: Any) -> None:
        self.length_feedback = length_feedback
        self.max_speed = max_speed
        super().__init__(*args, **kw)

    def reset_handler(self) -> None:
        self.length = [0.0] * p.ACTUATOR_CHANNELS
        self.target = [0.0] * p.ACTUATOR_CHANNELS
        self.speed = [0.0] * p.ACTUATOR_CHANNELS
        self.t_model = self.boot_time

    def is_stop(self, pkt: p.GeneralPacket) -> bool:
        return pkt.action in (p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.ActuatorAction.SET_RELATIVE_LENGTH)

    def advance(self, now: float) -> None:
        dt = now - self.t_model
        self.t_model = now
        if dt <= 0:
            return
        for i in range(p.ACTUATOR_CHANNELS):
            v = abs(self.speed[i]) or self.default_speed
            if self.max_speed is not None:
                v = min(v, self.max_speed)
            err = self.target[i] - self.length[i]
            self.length[i] += max(-v * dt, min(v * dt, err))

    def handle(self, pkt: p.GeneralPacket, now: float) -> p.GeneralPacket:
        self.advance(now)
        ch, act, data = pkt.sub_device_id, pkt.action, pkt.payload
        reply = pkt.reply(b"\x00")
        if ch >= p.ACTUATOR_CHANNELS:
            return reply
        limit = float(p.ACTUATOR_FIRMWARE_MAX_TICKS)
        if act == p.ActuatorAction.SET_RELATIVE_LENGTH:
            self.target[ch] = max(0.0, min(limit, self.target[ch] + p.read_u16(data)))
        elif act == p.ActuatorAction.SET_ABSOLUTE_LENGTH:
            self.target[ch] = max(0.0, min(limit, float(p.read_u16(data))))
        elif act == p.ActuatorAction.SET_VELOCITY:
            v = p.read_f32(data)
            self.speed[ch] = v if math.isfinite(v) else 0.0
        elif act == p.ActuatorAction.GET_CURRENT_LENGTH and self.length_feedback:
            return pkt.reply(p.u16(round(self.length[ch])))
        return reply


@dataclass
class SimModuleSpec:
    octet: int
    kind: str  # gpio | odrive | actuator

    @classmethod
    def parse(cls, text: str) -> SimModuleSpec:
        kind, _, octet = text.partition(":")
        if kind not in KINDS or not octet.isdigit() or not 1 <= int(octet) <= 254:
            raise ValueError(f"module spec {text!r}: want <gpio|odrive|actuator>:<octet 1..254>")
        return cls(int(octet), kind)


@dataclass(order=True)
class _Delayed:
    due: float
    seq: int
    sock: socket.socket = field(compare=False)
    data: bytes = field(compare=False)
    addr: tuple[str, int] = field(compare=False)


class RoiSim:
    """Every simulated module of a network prefix, served by one thread (`start()`) or `serve_forever()`."""

    def __init__(self, prefix: str, modules: list[SimModuleSpec], *, chain: bool = True, seed: int | None = None,
                 getter_bug: bool = False, head_firmware: bool = False, watchdog_s: float = WATCHDOG_S,
                 actuator_length: bool = False, actuator_max_speed: float | None = None) -> None:
        self.prefix = prefix
        self.getter_bug = getter_bug
        self.head_firmware = head_firmware
        self.watchdog_s = watchdog_s
        self.actuator_length = actuator_length
        self.actuator_max_speed = actuator_max_speed
        self.lock = threading.RLock()
        self.rng = random.Random(seed)
        self.sel = selectors.DefaultSelector()
        self.modules: dict[int, ModuleFirmware] = {}
        self._socks: list[socket.socket] = []
        self._delayed: list[_Delayed] = []
        self._seq = 0
        self._next_tick = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watching = False
        self._stamps: dict[int, StopStamp] = {}
        self._stop_log: list[StopStamp] = []
        self._armed_at = 0.0
        self._on_stamp: Callable[[StopStamp], None] | None = None
        self._wire: list[WireRecord] | None = None  # every general datagram applied, once record_wire() is called
        self._on_record: Callable[[WireRecord], None] | None = None
        now = time.monotonic()
        for spec in modules:
            if spec.octet in self.modules:
                raise ValueError(f"octet {spec.octet} given twice")
            self.modules[spec.octet] = self._firmware(spec.kind, spec.octet, now)
        if chain and len(self.modules) >= 2:
            ring = sorted(self.modules)
            for i, o in enumerate(ring):
                self.modules[o].neighbour = ring[(i + 1) % len(ring)]
                self.modules[o].chain_ok = True
        for octet in self.modules:
            for port in (p.GENERAL_PORT, p.SYSADMIN_PORT):
                # no SO_REUSEADDR: with it Linux lets a second UDP socket bind the same address and
                # silently takes the datagrams; a second simulator on these addresses must fail instead
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:
                    s.bind((self.address(octet), port))
                except OSError:
                    s.close()
                    self.close()
                    raise
                s.setblocking(False)
                with contextlib.suppress(OSError):  # the kernel's arrival time of each datagram (the stop watch)
                    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self._socks.append(s)
                self.sel.register(s, selectors.EVENT_READ, (octet, port))

    def _firmware(self, kind: str, octet: int, now: float) -> ModuleFirmware:
        kw: dict[str, Any] = {"watchdog_s": self.watchdog_s, "head_firmware": self.head_firmware}
        if kind == "odrive":
            return OdriveFirmware(octet, now, getter_bug=self.getter_bug, **kw)
        if kind == "actuator":
            return ActuatorFirmware(octet, now, length_feedback=self.actuator_length,
                                    max_speed=self.actuator_max_speed, **kw)
        if kind == "gpio":
            return GpioFirmware(octet, now, **kw)
        raise ValueError(f"module kind {kind!r}: want gpio, odrive or actuator")

    def replace(self, octet: int, kind: str) -> ModuleFirmware:
        """Another module (of `kind`, just booted) at `octet`: a module swapped, or an octet selector set to
        another module's address. It keeps the octet's place in the chain."""
        with self.lock:
            old = self.modules[octet]
            fw = self._firmware(kind, octet, time.monotonic())
            fw.neighbour, fw.chain_ok = old.neighbour, old.chain_ok
            self.modules[octet] = fw
            return fw

    def address(self, octet: int) -> str:
        return f"{self.prefix}.{octet}"

    def module(self, octet: int) -> ModuleFirmware:
        return self.modules[octet]

    # -- serving ---------------------------------------------------------------------------------------
    def start(self) -> RoiSim:
        self._thread = threading.Thread(target=self.serve_forever, name="roi-sim", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            timeout = 0.05
            if self._delayed:
                timeout = max(0.0, min(timeout, self._delayed[0].due - time.monotonic()))
            for key, _ in self.sel.select(timeout):
                octet, port = key.data
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                for _ in range(64):  # drain what is there, then look at the other sockets
                    try:
                        data, anc, _flags, addr = sock.recvmsg(2048, _ANC_SPACE)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    self._on_datagram(octet, port, sock, data, addr, _arrival(anc))
            self._send_due()
            now = time.monotonic()
            if now >= self._next_tick:  # the firmware's loop: the watchdog runs without traffic too
                self._next_tick = now + 0.05
                with self.lock:
                    for fw in self.modules.values():
                        fw.tick(now)

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0].due <= now:
            d = heapq.heappop(self._delayed)
            self._sendto(d.sock, d.data, d.addr)

    @staticmethod
    def _sendto(sock: socket.socket, data: bytes, addr: tuple[str, int]) -> None:
        try:
            sock.sendto(data, addr)
        except OSError as exc:  # nobody listens there (ICMP) or the socket is closed: like a real module, move on
            log.debug("reply not sent", extra={"to": addr, "error": str(exc)})

    def _on_datagram(self, octet: int, port: int, sock: socket.socket, data: bytes, addr: tuple[str, int],
                     arrived: float | None = None) -> None:
        """`arrived`: the Unix time the datagram reached the module's socket (the kernel's), if known."""
        with self.lock:
            fw = self.modules[octet]
            f = fw.faults
            if f.offline:
                return
            if f.drop_next > 0:
                f.drop_next -= 1
                fw.counters.dropped += 1
                return
            if f.drop_rate and self.rng.random() < f.drop_rate:
                fw.counters.dropped += 1
                return
            src_octet = int(addr[0].rsplit(".", 1)[1])
            if src_octet in fw.blacklist:
                fw.counters.blacklisted_dropped += 1
                return
            now = time.monotonic()
            out: bytes | None = None
            if port == p.GENERAL_PORT:
                try:
                    pkt, ok = p.decode_general(data, verify=False)
                except p.DecodeError:
                    return  # import failed (< 6 bytes): nothing to handle
                fw.counters.general_rx += 1
                fw.counters.bad_checksum_rx += not ok
                if self._wire is not None:
                    rec = WireRecord(octet, pkt.sub_device_id, pkt.action, pkt.payload,
                                     time.time() if arrived is None else arrived, fw.is_stop(pkt))
                    self._wire.append(rec)
                    if self._on_record is not None:
                        self._on_record(rec)
                if self._watching and fw.is_stop(pkt) and (arrived is None or arrived >= self._armed_at):
                    unix = time.time()
                    at = unix if arrived is None else min(arrived, unix)
                    stamp = StopStamp(octet, _kind_name(fw), pkt.action, at, now - (unix - at))
                    self._stop_log.append(stamp)
                    if octet not in self._stamps:
                        self._stamps[octet] = stamp
                        if self._on_stamp is not None:
                            self._on_stamp(stamp)
                out = fw.handle_general(pkt, now).encode()
                dest = (addr[0], p.GENERAL_PORT)  # always the general port (§6.2)
            else:
                try:
                    spkt, ok = p.decode_sysadmin(data, verify=False)
                except p.DecodeError:
                    return
                fw.counters.sysadmin_rx += 1
                fw.counters.bad_checksum_rx += not ok
                rep = fw.handle_sysadmin(spkt, now)
                if rep is None:
                    return
                out = rep.encode()
                dest = (addr[0], p.SYSADMIN_PORT)
            if f.corrupt_rate and self.rng.random() < f.corrupt_rate:
                b = bytearray(out)
                b[4 if port == p.GENERAL_PORT else 5] ^= 0x5A
                out = bytes(b)
            if f.drop_replies or f.drop_replies_next > 0:  # applied above; its acknowledgement is lost
                f.drop_replies_next = max(0, f.drop_replies_next - 1)
                fw.counters.replies_dropped += 1
                return
            fw.counters.replies += 1
            copies = 2 if f.duplicate else 1
            delay = f.delay_s
        for _ in range(copies):
            if delay > 0:
                self._seq += 1
                heapq.heappush(self._delayed, _Delayed(time.monotonic() + delay, self._seq, sock, out, dest))
            else:
                self._sendto(sock, out, dest)

    # -- the stop watch (thread-safe) ------------------------------------------------------------------
    def watch_stop(self, on_stamp: Callable[[StopStamp], None] | None = None) -> None:
        """Arm the watch (again): forget the stamps so far; each module stamps the first stop bytes it receives
        from now on. `on_stamp(stamp)` is called on the simulator's thread as each one arrives."""
        with self.lock:
            self._stamps.clear()
            self._stop_log.clear()
            self._armed_at = time.time()  # a datagram that arrived before (read late) is not this watch's
            self._on_stamp = on_stamp
            self._watching = True

    def stop_log(self) -> list[StopStamp]:
        """Every stop datagram received since the watch was armed, in the order it reached its module."""
        with self.lock:
            return sorted(self._stop_log, key=lambda st: st.unix)

    def stop_stamps(self) -> dict[int, StopStamp]:
        """octet -> its first stop bytes since the watch was armed."""
        with self.lock:
            return dict(self._stamps)

    # -- the wire log (thread-safe): what each module received, in order ----------------------------------
    def record_wire(self, on_record: Callable[[WireRecord], None] | None = None) -> None:
        """Log (again, from empty) every general datagram the modules receive and apply, from now on.
        `on_record(record)` is called on the simulator's thread, under its lock, before the module handles the
        datagram (a test may change the module's faults there: `set_faults` from it applies to this reply)."""
        with self.lock:
            self._wire = []
            self._on_record = on_record

    def wire_log(self, octet: int | None = None) -> list[WireRecord]:
        """The general datagrams received since `record_wire()` (of `octet`, or of every module), in the order
        they were applied."""
        with self.lock:
            return [r for r in self._wire or [] if octet is None or r.octet == octet]

    # -- fault injection and inspection (thread-safe) --------------------------------------------------
    def call(self, octet: int, fn: Any) -> Any:
        """Run fn(firmware) under the simulator's lock (state reads and changes from tests)."""
        with self.lock:
            fw = self.modules[octet]
            now = time.monotonic()
            fw.tick(now)
            if isinstance(fw, OdriveFirmware | ActuatorFirmware):
                fw.advance(now)
            return fn(fw)

    def set_faults(self, octet: int, **faults: Any) -> None:
        with self.lock:
            f = self.modules[octet].faults
            for k, v in faults.items():
                if not hasattr(f, k):
                    raise AttributeError(f"no fault {k!r}")
                setattr(f, k, v)

    def set_loss(self, rate: float) -> None:
        with self.lock:
            for fw in self.modules.values():
                fw.faults.drop_rate = rate

    def reboot(self, octet: int) -> None:
        with self.lock:
            self.modules[octet].reboot(time.monotonic())

    def set_error(self, octet: int, bits: int, operable: bool = False) -> None:
        """An ODrive error (bits as §3.6); on other modules a generic hardware error."""
        with self.lock:
            fw = self.modules[octet]
            if isinstance(fw, OdriveFirmware):
                fw.advance(time.monotonic())
                fw.set_error(bits, operable)
            else:
                fw.error = bits != 0
                fw.inoperable = bits != 0 and not operable

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        for s in self._socks:
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._socks.clear()


def _kind_name(fw: ModuleFirmware) -> str:
    return next(k for k, t in KINDS.items() if t == fw.module_type)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.roi_modules.sim",
                                 description="Simulated ROI modules on <prefix>.<octet>, ports 57344/57664")
    ap.add_argument("--prefix", default="127.0.2", help="network prefix (three octets), default 127.0.2")
    ap.add_argument("--modules", default="gpio:10,odrive:20,actuator:30",
                    help="comma-separated <gpio|odrive|actuator>:<octet>")
    ap.add_argument("--loss", type=float, default=0.0, help="probability that a request is lost")
    ap.add_argument("--signal-loss", type=float, default=0.05,
                    help="loss set by SIGUSR1 (SIGUSR2 sets 0): benchmarks switch loss on and off")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--getter-bug", action="store_true", help="ODrive getters answer the control mode (firmware)")
    ap.add_argument("--head-firmware", action="store_true", help="answer FIRMWARE_REPORT (HEAD firmware)")
    ap.add_argument("--actuator-length", action="store_true",
                    help="actuators answer GET_CURRENT_LENGTH with their length (uint16 BE ticks), as a firmware that "
                         "implements the getter does (make run's demo); without it they answer 0, as the released "
                         "firmware does, and a service that never moved them cannot hold them at the bus stop")
    ap.add_argument("--actuator-max-speed", type=float, default=None,
                    help="ticks/s an actuator moves at most, whatever velocity is commanded")
    ap.add_argument("--watch-stop", action="store_true",
                    help="print one JSON line on stdout per module when it receives its first stop bytes "
                         '({"event": "stop_bytes", "octet", "kind", "action", "unix", "monotonic"}); SIGHUP '
                         "re-arms the watch")
    return ap


def from_args(args: argparse.Namespace, prefix: str | None = None) -> RoiSim:
    """The simulator the command line describes (`prefix`: another network prefix than its --prefix)."""
    specs = [SimModuleSpec.parse(t.strip()) for t in args.modules.split(",") if t.strip()]
    sim = RoiSim(prefix or args.prefix, specs, seed=args.seed, getter_bug=args.getter_bug,
                 head_firmware=args.head_firmware, actuator_length=args.actuator_length,
                 actuator_max_speed=args.actuator_max_speed)
    sim.set_loss(args.loss)
    return sim


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s roi-sim %(message)s")
    sim = from_args(args)
    specs = list(sim.modules)
    signal.signal(signal.SIGTERM, lambda *_: sim._stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: sim.set_loss(args.signal_loss))
    signal.signal(signal.SIGUSR2, lambda *_: sim.set_loss(0.0))
    if args.watch_stop:
        def emit(stamp: StopStamp) -> None:
            print(json.dumps({"event": "stop_bytes", **asdict(stamp)}), flush=True)
        sim.watch_stop(emit)
        signal.signal(signal.SIGHUP, lambda *_: sim.watch_stop(emit))
    log.info("serving %d modules on %s.x: %s", len(specs), args.prefix,
             ", ".join(f"{_kind_name(sim.modules[o])}@{o}" for o in specs))
    try:
        sim.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        sim.close()


if __name__ == "__main__":
    main()
