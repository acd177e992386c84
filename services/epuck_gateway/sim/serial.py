"""Simulated e-puck2 on a serial port: the F407's asercom v2 (selector 8 = USB, 3 = Bluetooth) on a pty.

The device side of asercom2 as `Asercom2.c` runs it (docs/reference/epuck2.md §6): it prints its welcome banner when
it starts, answers a binary chain (negative codes ended by 0x00) with every reply concatenated, LSB
first, applies -0x09 once when it arrives, and answers ASCII lines (`D,200,200\\r` -> `d\\r\\n`).
The world (motion, sensors, camera) is the WiFi simulator's `EpuckWorld` (world.py).

A pseudo-terminal stands in for /dev/ttyACMn or /dev/rfcommN; the stable path the gateway opens is
a symlink to the pty's slave (as udev's /dev/serial/by-id links are). `unplug()` closes the pty and
removes the link (the host's reads fail with EIO, as on a USB unplug); `plug()` makes a new one.

A pty moves bytes at memory speed; `line_baud` makes the robot's output take its time on the line
(8N1, baud/10 bytes a second) and, as the F407 does, read no further input until its reply has gone
(Asercom2.c sends with `while (e_uart_sending())`), so a Bluetooth link's timing is reproduced.
`inject_input()` puts bytes in the robot's input as if another program had written them into the port
(GDB packets from a flasher: the robot is then left in the middle of an ASCII line; `f7 00 00`, a chain cut
inside -0x09's arguments: the parser holds the partial argument list and takes the host's next bytes, whatever
they are, as the missing ones, as the firmware's blocking reads do). `stall_next_image(s)` holds the F407 for
`s` seconds before it answers the next chain with a camera image (it reads nothing meanwhile), as a busy robot
does; `stats.max_unanswered` is the most chains waiting for their reply at once (queued or being answered).

`stop_watch` (stop_watch.py) time-stamps the first stop the robot receives once armed: a `-0x09` or a
binary `-D` with both speeds 0, or an ASCII `S` or `D,0,0` line, when its bytes arrive (before a reply in
progress lets the F407 read them). From the command line, SIGUSR2 arms every robot; each prints a
`{"stop_seen": ...}` line.

Run two: python -m services.epuck_gateway.sim --count 0 --serial-count 2 --serial-link /tmp/robobus-epuck-serial
(robots at /tmp/robobus-epuck-serial1 and 2).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import struct
import time
import tty
from dataclasses import dataclass
from typing import TypeVar

from services.epuck_gateway.protocol.asercom import (
    CAM_RGB565,
    DEFAULT_IMAGE,
    AsercomChainParser,
    AsercomCommand,
    all_sensors_block,
    parse_ascii_reply,
)
from services.epuck_gateway.protocol.wifi import (
    COMMAND_ID,
    IMAGE_HEIGHT,
    IMAGE_WIDTH,
    SET_STEPS,
    EpuckCommand,
    EpuckRawSensors,
    ProtocolError,
)
from services.epuck_gateway.sim.harness import SimRobots, SimThread
from services.epuck_gateway.sim.stop_watch import StopWatch
from services.epuck_gateway.sim.world import EpuckWorld, initial_world

log = logging.getLogger("robobus.epuck.sim_serial")
T = TypeVar("T")

BANNER = b'\x0c\x07WELCOME to the SerCom protocol on e-Puck\r\nthe EPFL education robot type "H" for help\r\n'
HELP = b'\n"D,#,#"          Set motor speed left,right\r\n"N"               Proximity\r\n"H"               Help\r\n'


@dataclass
class EpuckSerialSimConfig:
    selector: int = 8  # USB
    stamp: bool = False  # benchmarks: magnetometer X carries the send time (unix time mod 1000 s)
    line_baud: int | None = None  # the robot's output paced at this baud (8N1); None = as fast as the pty takes it


PACE_CHUNK = 32  # bytes a pacing step writes (2.8 ms at 115200 baud)


@dataclass
class EpuckSerialSimStats:
    plugs: int = 0
    chains: int = 0
    ascii_lines: int = 0
    actuator_commands: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    max_unanswered: int = 0  # most chains with a reply owed at once: queued unread, or the one being answered


class EpuckSerialSimRobot:
    """One robot on a pty, served on the running asyncio loop (add_reader / add_writer)."""

    def __init__(self, name: str, link: str, config: EpuckSerialSimConfig | None = None,
                 world: EpuckWorld | None = None) -> None:
        self.name = name
        self.link = link
        self.config = config or EpuckSerialSimConfig()
        self.world = world or EpuckWorld()
        self.stats = EpuckSerialSimStats()
        self.received: list[EpuckCommand] = []  # every -0x09 as a WiFi-style command (request 0)
        self.received_at: list[float] = []  # time.monotonic() each of `received` was applied
        self.lines: list[tuple[float, str]] = []  # every ASCII line the robot executed, with its time
        self.hung = False  # tests: reads, never answers
        self.late_replies = 0  # tests: answer this many chains late (after `late_s`): the F407 stalls before each
        self.late_s = 0.6
        self.plugged = False
        self._master = -1
        self._slave = -1
        self._parser = AsercomChainParser()
        self._out = bytearray()
        self._writing = False
        self._inbox: collections.deque[list[AsercomCommand] | str] = collections.deque()
        self._pacer: asyncio.TimerHandle | None = None
        self._line_t: float | None = None  # paced line: when it is done with the bytes written so far
        self._last_physics = time.monotonic()
        self._stall_image_s = 0.0  # tests: hold the next chain with an image this long (stall_next_image)
        self._stalled_until = 0.0
        self._stalled_item: object = None  # the chain a stall was served before
        self._answering = False  # a chain's reply is still going out (paced line)
        self.stop_watch = StopWatch(name)

    # -- the device comes and goes ----------------------------------------------------------------------
    def plug(self) -> None:
        if self.plugged:
            return
        master, slave = os.openpty()
        tty.setraw(slave)  # no echo, no line editing: bytes as they are, as a CDC-ACM port
        os.set_blocking(master, False)
        self._master, self._slave = master, slave
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.link)
        os.symlink(os.ttyname(slave), self.link)
        self._parser = AsercomChainParser()
        self._out.clear()
        self._inbox.clear()
        self._writing = False
        self._stalled_until = 0.0
        self._answering = False
        asyncio.get_running_loop().add_reader(master, self._readable)
        self.plugged = True
        self.stats.plugs += 1
        self._send(BANNER)  # Asercom2.c prints it when it starts

    def unplug(self) -> None:
        if not self.plugged:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._master)
        if self._writing:
            loop.remove_writer(self._master)
        if self._pacer is not None:
            self._pacer.cancel()
            self._pacer = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.link)
        for fd in (self._master, self._slave):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._master = self._slave = -1
        self.plugged = False

    async def start(self) -> None:
        self.plug()

    async def stop(self) -> None:
        self.unplug()

    # -- I/O ----------------------------------------------------------------------------------------------
    def _readable(self) -> None:
        try:
            data = os.read(self._master, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return  # no slave open right now (we keep one, so only while unplugging)
        self.stats.bytes_in += len(data)
        self._receive(data)

    def inject_input(self, data: bytes) -> None:
        """Tests: bytes in the robot's input as if another program had written them into its port."""
        self._receive(data)

    def stall_next_image(self, seconds: float) -> None:
        """Tests: the F407 stops for `seconds` before it answers the next chain asking for an image (a busy robot);
        it reads nothing meanwhile, and answers every queued chain in order afterwards."""
        self._stall_image_s = seconds

    @property
    def pending_args(self) -> int:
        """Argument bytes a binary command is still waiting for (a chain cut inside its arguments)."""
        return self._parser.pending_args

    @property
    def in_line(self) -> bool:
        """The robot is in the middle of an ASCII line (it swallows everything up to a CR or LF)."""
        return self._parser.in_line

    def _receive(self, data: bytes) -> None:
        items = self._parser.feed(data)
        if self.stop_watch.armed:
            for item in items:
                self._watch(item)
        self._inbox.extend(items)
        self._count_unanswered()
        self._work()

    def _count_unanswered(self) -> None:
        owed = sum(1 for item in self._inbox if not isinstance(item, str) and any(c.reply_size != 0 for c in item))
        self.stats.max_unanswered = max(self.stats.max_unanswered, owed + int(self._answering and bool(self._out)))

    def _watch(self, item: list[AsercomCommand] | str) -> None:
        """Tell the stop watch about the wheel speeds a received chain or line sets."""
        if isinstance(item, str):
            try:
                letter, args = parse_ascii_reply(item)
            except ProtocolError:
                return
            if letter.upper() == "S":
                self.stop_watch.received(0, 0)
            elif letter.upper() == "D" and len(args) == 2:
                self.stop_watch.received(args[0], args[1])
            return
        for c in item:
            if c.code == 0x09 and len(c.args) == 19 and not c.args[0] & SET_STEPS:
                cmd = EpuckCommand.decode(bytes([COMMAND_ID, 0]) + c.args)
                self.stop_watch.received(cmd.left, cmd.right)
            elif c.code == ord("D") and len(c.args) == 4:
                left, right = struct.unpack("<2h", c.args)
                self.stop_watch.received(left, right)

    def _work(self) -> None:
        while self._inbox:
            if self.config.line_baud and self._out:
                return  # the F407 finishes sending a reply before it reads on
            now = time.monotonic()
            if now < self._stalled_until:
                return  # busy: reads on when the stall ends
            item = self._inbox[0]
            if self._stalls(item, now):
                return
            self._inbox.popleft()
            if self.hung:
                continue
            if isinstance(item, str):
                self.stats.ascii_lines += 1
                self.lines.append((time.monotonic(), item))
                self._send(self._ascii(item))
            else:
                self.stats.chains += 1
                reply = self._chain(item)
                if reply:
                    self._answering = True
                    self._send(reply)

    def _stalls(self, item: list[AsercomCommand] | str, now: float) -> bool:
        """A stall starts before this chain (late_replies, stall_next_image): the F407 is busy for a while and
        reads nothing, then answers it and everything queued after it, in order (one thread, one output)."""
        if isinstance(item, str) or item is self._stalled_item or not any(c.reply_size != 0 for c in item):
            return False
        if self.late_replies > 0:
            self.late_replies -= 1
            hold = self.late_s
        elif self._stall_image_s and any(c.code == ord("I") for c in item):
            hold, self._stall_image_s = self._stall_image_s, 0.0
        else:
            return False
        self._stalled_item = item
        self._stalled_until = now + hold
        asyncio.get_running_loop().call_later(hold, self._work)
        return True

    def _send(self, data: bytes) -> None:
        self._out += data
        self._flush()

    def _pace(self) -> None:
        """One step of a paced line: write what the line has carried since the last step (a chunk at
        least), then wait until it has carried that too. `_line_t` is when the line is done with every
        byte written so far; a late step writes more, so the long-run rate is the baud's, not the timers'."""
        self._pacer = None
        if not self._out or self._master < 0:
            self._line_t = None
            self._answering = False
            self._work()  # the reply is out: the F407 reads on
            return
        assert self.config.line_baud
        rate = self.config.line_baud / 10  # 8N1
        now = time.monotonic()
        if self._line_t is None:
            self._line_t = now
        n = min(len(self._out), PACE_CHUNK + int(max(0.0, now - self._line_t) * rate))
        try:
            n = os.write(self._master, bytes(self._out[:n]))
        except BlockingIOError:
            n = 0
        except OSError:
            self._out.clear()
            return
        self.stats.bytes_out += n
        del self._out[:n]
        self._line_t += max(n, 1) / rate
        self._pacer = asyncio.get_running_loop().call_later(max(0.0, self._line_t - now), self._pace)

    def _flush(self) -> None:
        if self.config.line_baud:
            if self._pacer is None:
                self._pace()
            return
        while self._out:
            try:
                n = os.write(self._master, self._out)
            except BlockingIOError:
                break
            except OSError:
                self._out.clear()
                break
            self.stats.bytes_out += n
            del self._out[:n]
        loop = asyncio.get_running_loop()
        if self._out and not self._writing:
            loop.add_writer(self._master, self._flush)
            self._writing = True
        elif not self._out and self._writing:
            loop.remove_writer(self._master)
            self._writing = False

    # -- the F407's asercom2 -------------------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.monotonic()
        self.world.advance(now - self._last_physics)
        self._last_physics = now

    def _sensors(self) -> EpuckRawSensors:
        stamp = (time.time() % 1000.0) if self.config.stamp else None
        s = self.world.sensors(stamp)
        return dataclasses.replace(s, selector=self.config.selector)

    def _chain(self, chain: list[AsercomCommand]) -> bytes:
        self._advance()
        out = bytearray()
        sensors: EpuckRawSensors | None = None

        def snap() -> EpuckRawSensors:
            nonlocal sensors
            if sensors is None:
                sensors = self._sensors()
            return sensors

        for c in chain:
            code, args = c.code, c.args
            if code == 0x08:
                block, _button = all_sensors_block(snap().encode())
                out += block
            elif code == 0x09:
                cmd = EpuckCommand.decode(bytes([COMMAND_ID, 0]) + args)
                self.world.apply(cmd)
                self.received.append(cmd)
                self.received_at.append(time.monotonic())
                self.stats.actuator_commands += 1
            elif code == 0x0A:
                self.world.rgb = tuple((args[i], args[i + 1], args[i + 2]) for i in range(0, 12, 3))
            elif code == 0x0B:
                out.append(snap().button)
            elif code == 0x0C:
                out += struct.pack("<4H", *snap().mic)
            elif code == 0x0D:
                out += struct.pack("<H", snap().tof)
            elif code == 0x0E:
                out.append(snap().sd_state)
            elif code in (0x0F, 0x10, 0x11):
                out.append(args[0])
            elif code == ord("N"):
                out += struct.pack("<8H", *snap().proximity)
            elif code == ord("O"):
                out += struct.pack("<8H", *snap().ambient)
            elif code == ord("a"):
                out += struct.pack("<3h", *snap().acc)
            elif code == ord("g"):
                out += struct.pack("<3h", *snap().gyro)
            elif code == ord("Q"):
                out += struct.pack("<2h", *snap().steps)
            elif code == ord("b"):
                out += struct.pack("<H", snap().battery)
            elif code == ord("u"):
                out += struct.pack("<3H", *snap().mic[:3])
            elif code == ord("t"):
                out += struct.pack("<b", snap().temperature)
            elif code == ord("D"):
                left, right = struct.unpack("<2h", args)
                self.world.speed_left, self.world.speed_right = left, right
            elif code == ord("P"):
                left, right = struct.unpack("<2h", args)
                self.world.steps_left, self.world.steps_right = float(left), float(right)
            elif code == ord("L"):
                self._led(args[0], args[1])
            elif code == ord("I"):
                out += self._image()
            # anything else: silently ignored, as the firmware does
        return bytes(out)

    def _led(self, number: int, state: int) -> None:
        bits = {0: 0x01, 2: 0x02, 4: 0x04, 6: 0x08, 8: 0x10, 9: 0x20}  # ring LEDs 1/3/5/7 are 0/2/4/6
        bit = bits.get(number)
        if bit is None:
            return
        on = (not self.world.leds & bit) if state == 2 else bool(state)
        self.world.leds = (self.world.leds | bit) if on else (self.world.leds & ~bit)

    def _image(self) -> bytes:
        """asercom2's default camera: 40x40 RGB565; the 160x120 world picture, centre crop, every 3rd pixel."""
        mode, w, h = DEFAULT_IMAGE
        frame = self.world.camera()
        x0, y0, step = (IMAGE_WIDTH - 3 * w) // 2, (IMAGE_HEIGHT - 3 * h) // 2, 3
        out = bytearray([CAM_RGB565 if mode == CAM_RGB565 else mode, w, h])
        for y in range(h):
            row = (y0 + y * step) * IMAGE_WIDTH
            for x in range(w):
                i = 2 * (row + x0 + x * step)
                out += frame[i:i + 2]
        return bytes(out)

    def _ascii(self, line: str) -> bytes:
        try:
            letter, args = parse_ascii_reply(line)
        except ProtocolError:
            return b"z,Command not found\r\n"
        letter = letter if letter in ("b", "g") else letter.upper()
        s = self._sensors()
        if letter == "D" and len(args) == 2:
            self.world.speed_left, self.world.speed_right = args
            return b"d\r\n"
        if letter == "S":  # stop: speeds 0, body LED off
            self.world.speed_left = self.world.speed_right = 0
            self.world.leds &= ~0x10
            return b"s\r\n"
        if letter == "P" and len(args) == 2:  # the step counters ("set motor position")
            self.world.steps_left, self.world.steps_right = float(args[0]), float(args[1])
            return b"p\r\n"
        if letter == "E":
            return f"e,{self.world.speed_left},{self.world.speed_right}\r\n".encode()
        if letter == "N":
            return ("n," + ",".join(map(str, s.proximity)) + "\r\n").encode()
        if letter == "O":
            return ("o," + ",".join(map(str, s.ambient)) + "\r\n").encode()
        if letter == "Q":
            return f"q,{s.steps[0]},{s.steps[1]}\r\n".encode()
        if letter == "C":
            return f"c,{self.config.selector}\r\n".encode()
        if letter == "b":
            return f"b,{s.battery}\r\n".encode()
        if letter == "H":
            return HELP
        return b"z,Command not found\r\n"


class EpuckSerialSimulator(SimRobots[EpuckSerialSimRobot]):
    """Several serial robots, links `<prefix>1`, `<prefix>2`, ..."""

    def __init__(self, count: int, prefix: str, config: EpuckSerialSimConfig | None = None) -> None:
        super().__init__([EpuckSerialSimRobot(f"epuck-serial{i + 1}", f"{prefix}{i + 1}", config,
                                              initial_world(i + 5)) for i in range(count)])


class EpuckSerialSimThread(SimThread[EpuckSerialSimRobot]):
    """Tests and benchmarks: serial robots on their own loop (harness.py)."""

    def __init__(self, count: int, prefix: str, config: EpuckSerialSimConfig | None = None) -> None:
        super().__init__(EpuckSerialSimulator(count, prefix, config), "epuck-serial-sim")
