"""Simulated e-puck2 robots: the radio module's TCP server (port 1000 on a real robot), on a real socket.

Behaviour copied from the ESP32 WiFi firmware as the reference describes it (section 4):
- `listen(1)` and one client at a time; the next client is accepted only after the current one left;
- nothing is sent before the first command, which must be 21 bytes starting with 0x80;
- then the robot streams with the last command it got: each cycle it takes one queued command
  (if 5 or more are queued, the older ones are flushed), applies it to the "F407", and sends the image
  (id byte, then 9 x 4092 + 1572 bytes), then the sensors packet, or 0x03 when nothing is requested;
  with the image requested, the cycle waits for the next image (`image_fps`), so the sensors packet
  comes once per image, as on the robot (`image_holds_cycle`; off = sensors every cycle, images when
  due, a load profile for benchmarks);
- the radio module's UART task sends the last command it took to the F407 on every exchange of its own
  (`uart_hz`, reference section 3), whatever the socket cycle does: every flag is level-triggered, so
  calibration, sound and a step-counter write are applied again at each exchange until a command that
  clears them is taken (at 0.5 fps with the image in the command, 100 times at 50 Hz);
- on a disconnect the motors keep their last speeds (no watchdog on the robot).

For the bus stop's measurements (`StopWatch`): once armed, a robot time-stamps the first stop it receives
(a command that sets both wheel speeds to 0), when its bytes arrive, not when a cycle applies it: the kernel's
arrival time of the bytes that carried it (SO_TIMESTAMPNS), not the moment this one loop serving every robot got
round to it (a robot's radio reads its own socket). Linux gives a read the time of the newest segment it took, so
while the watch is armed the robot reads one command (21 bytes) at a time: a stop read together with a command
that arrived after it was stamped with that command's arrival. Segments that wait unread are merged by the kernel
into one with the newest's time (tcp_try_coalesce): a simulator starved for tens of milliseconds still times a
stop late, which is why bench/stop.py runs it above the nodes' priority. Armed in
code with `robot.stop_watch.arm()`; from the command line, SIGUSR2 arms every robot and each prints
`{"stop_seen": {"robot", "ts" (Unix time), "monotonic" (CLOCK_MONOTONIC, comparable across processes)}}`.

Run several robots: python -m services.epuck_gateway.sim --count 2 --base-port 11000
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.epuck_gateway.protocol.wifi import (
    COMMAND_ID,
    COMMAND_SIZE,
    EMPTY_ID,
    IMAGE_ID,
    IMAGE_SEGMENTS,
    REQ_IMAGE,
    REQ_SENSORS,
    SENSORS_ID,
    SET_STEPS,
    EpuckCommand,
)
from services.epuck_gateway.sim.harness import SimRobots, SimThread
from services.epuck_gateway.sim.stop_watch import StopWatch
from services.epuck_gateway.sim.world import EpuckWorld, initial_world

log = logging.getLogger("robobus.epuck.sim")
T = TypeVar("T")
QUEUE_FLUSH = 5  # firmware: with >= 5 commands queued, the older ones are dropped


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: the kernel's receive time of the bytes read
_ANC_SPACE = socket.CMSG_SPACE(16)  # one struct timespec


@functools.cache
def keep_kernel_stamps() -> socket.socket | None:
    """One socket with SO_TIMESTAMPNS, held (cached) for the process's life. Linux stamps received bytes at their
    arrival only while some socket asks for it, and turns that on from a deferred work item: bytes that arrive
    before it ran are stamped when read instead. Asked at the first robot, it is on long before a stop arrives."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        s.close()
        return None
    return s


class _StampedSocket(socket.socket):
    """A connection whose reads note the kernel's arrival time of the newest bytes read (`arrival`, Unix time;
    None where the kernel gives none): asyncio's transport reads with `recv`, which this answers with recvmsg."""

    arrival: float | None = None
    read_limit: Callable[[], int | None] | None = None  # the most one read takes, when it says (else asyncio's)

    @classmethod
    def adopt(cls, conn: socket.socket) -> socket.socket:
        try:
            conn.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        except OSError:
            return conn  # no kernel times here: stamped when read
        s = cls(conn.family, conn.type, conn.proto, fileno=conn.detach())
        s.setblocking(False)
        return s

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        limit = self.read_limit() if self.read_limit is not None else None
        data, anc, _flags, _addr = self.recvmsg(min(bufsize, limit) if limit else bufsize, _ANC_SPACE, flags)
        for level, kind, cmsg in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(cmsg) >= 16:
                sec, nsec = struct.unpack_from("@qq", cmsg)
                self.arrival = float(sec) + float(nsec) / 1e9
        return data


@dataclass
class EpuckSimConfig:
    sensors_hz: float = 50.0  # cycle rate; 0 = as fast as the socket takes it (benchmarks)
    image_fps: float = 10.0  # 0 = an image every cycle
    stamp: bool = False  # benchmarks: magnetometer X carries the send time (unix time mod 1000 s)
    nodelay: bool = True  # the ESP32's lwIP uses Nagle; the sim does not, so latency figures are the gateway's
    image_holds_cycle: bool = True  # firmware: a cycle with the image requested waits for the image
    uart_hz: float = 50.0  # the radio module's exchanges with the F407, each re-applying the last command (0: off)


@dataclass
class EpuckSimStats:
    connections: int = 0
    commands: int = 0
    bad_commands: int = 0
    flushed_commands: int = 0
    images_sent: int = 0
    sensors_sent: int = 0
    empty_sent: int = 0
    cycles: int = 0
    max_queued: int = 0  # most commands waiting at the start of a cycle (the firmware flushes at 5)
    received: collections.deque[EpuckCommand] = field(default_factory=lambda: collections.deque(maxlen=2000))
    received_at: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2000))  # time.time()

    def summary(self) -> dict[str, int]:
        return {"connections": self.connections, "commands": self.commands, "bad_commands": self.bad_commands,
                "flushed_commands": self.flushed_commands, "images_sent": self.images_sent,
                "sensors_sent": self.sensors_sent, "empty_sent": self.empty_sent}


class EpuckSimRobot:
    """One simulated robot: a listening socket, one client at a time, the streaming loop."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 config: EpuckSimConfig | None = None, world: EpuckWorld | None = None) -> None:
        keep_kernel_stamps()
        self.name = name
        self.host = host
        self.port = port
        self.config = config or EpuckSimConfig()
        self.world = world or EpuckWorld()
        self.stats = EpuckSimStats()
        self.command: EpuckCommand | None = None  # the one the robot repeats
        self.connected = False
        self.silent = False  # tests: keep the socket open but send nothing (a robot out of WiFi range)
        self.hung = False  # tests: like silent, and commands are not taken either (a hung radio module)
        self._sock: socket.socket | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._client: asyncio.StreamWriter | None = None
        self._inject: list[bytes] = []
        self._last_physics = time.monotonic()
        self.stop_watch = StopWatch(name)

    # -- lifecycle (on the simulator's loop) ----------------------------------------------------
    async def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(1)  # the ESP32's backlog: one client at a time
        s.setblocking(False)
        self.port = s.getsockname()[1]
        self._sock = s
        self._server_task = asyncio.ensure_future(self._serve())

    async def stop(self) -> None:
        """The robot goes away: listening socket and current client closed."""
        if self._server_task is not None:
            self._server_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._server_task
            self._server_task = None
        self.drop_client()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def drop_client(self) -> None:
        """Reset the current connection (tests: a lost robot)."""
        w = self._client
        if w is not None:
            with contextlib.suppress(OSError):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            w.transport.abort()

    def inject(self, data: bytes) -> None:
        """Tests: put raw bytes into the stream between two packets (e.g. a bad id)."""
        self._inject.append(data)

    # -- serving --------------------------------------------------------------------------------
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, peer = await loop.sock_accept(self._sock)
            conn = _StampedSocket.adopt(conn)
            if self.config.nodelay:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.stats.connections += 1
            log.info("%s: client connected from %s", self.name, peer)
            try:
                await self._session(conn)
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            finally:
                self.connected = False
                self._client = None
                conn.close()
            log.info("%s: client left", self.name)

    async def _session(self, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        stamped = conn if isinstance(conn, _StampedSocket) else None
        if stamped is not None:  # armed: one command per read, so that its time is that of its own bytes
            stamped.read_limit = lambda: COMMAND_SIZE if self.stop_watch.armed else None
        self._client = writer
        self.connected = True
        queue: collections.deque[EpuckCommand] = collections.deque()
        first = asyncio.Event()

        async def read_commands() -> None:
            while True:
                # A partial command is completed with a blocking MSG_WAITALL recv in the firmware.
                data = await reader.readexactly(COMMAND_SIZE)
                if data[0] != COMMAND_ID:
                    self.stats.bad_commands += 1
                    continue
                cmd = EpuckCommand.decode(data)
                if not cmd.settings & SET_STEPS:  # bytes 3..6 are speeds, not step counters
                    self.stop_watch.received(cmd.left, cmd.right, stamped.arrival if stamped else None)
                self.stats.commands += 1
                self.stats.received.append(cmd)
                self.stats.received_at.append(time.time())
                queue.append(cmd)
                first.set()

        rx = asyncio.ensure_future(read_commands())
        uart = asyncio.ensure_future(self._uart())
        try:
            waiter = asyncio.ensure_future(first.wait())
            await asyncio.wait([rx, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if rx.done():
                rx.result()
                return
            await self._stream(writer, queue, rx)
        finally:
            writer.transport.abort()
            rx.cancel()
            uart.cancel()
            # not `await task` under suppress(CancelledError): a stop() cancelling this session meanwhile would be
            # swallowed, and the server would accept on (a SIGTERM then hung the simulator)
            await asyncio.wait([rx, uart])

    async def _uart(self) -> None:
        """The radio module's UART task: the last command taken goes to the F407 on every exchange, applied there
        each time (its flags are level-triggered)."""
        if self.config.uart_hz <= 0:
            return
        period = 1.0 / self.config.uart_hz
        while True:
            await asyncio.sleep(period)
            if self.command is not None and not self.hung:
                self._apply(self.command)

    def _apply(self, cmd: EpuckCommand) -> None:
        now = time.monotonic()
        self.world.advance(now - self._last_physics)
        self._last_physics = now
        self.world.apply(cmd)

    async def _stream(self, writer: asyncio.StreamWriter, queue: collections.deque[EpuckCommand],
                      rx: asyncio.Task[None]) -> None:
        cfg = self.config
        period = 1.0 / cfg.sensors_hz if cfg.sensors_hz > 0 else 0.0
        img_period = 1.0 / cfg.image_fps if cfg.image_fps > 0 else 0.0
        next_tick = time.monotonic()
        next_image = next_tick
        while not rx.done():
            if self.hung:
                await asyncio.sleep(0.01)
                continue
            cmd = self.command
            if cfg.image_holds_cycle and cmd is not None and cmd.request & REQ_IMAGE and img_period:
                # The firmware's cycle blocks on the image (capture + SPI) before it reads commands again.
                wait = next_image - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            self.stats.cycles += 1
            self.stats.max_queued = max(self.stats.max_queued, len(queue))
            if len(queue) >= QUEUE_FLUSH:
                self.stats.flushed_commands += len(queue) - 1
                while len(queue) > 1:
                    queue.popleft()
            if queue:
                self.command = queue.popleft()
            cmd = self.command
            assert cmd is not None
            self._apply(cmd)  # taken: at once, as the next exchange with the F407 would
            now = time.monotonic()
            while self._inject:
                writer.write(self._inject.pop(0))
            if not self.silent:
                if cmd.request & REQ_IMAGE and now >= next_image:
                    next_image = max(next_image + img_period, now - img_period)
                    frame = self.world.camera()
                    writer.write(bytes([IMAGE_ID]))
                    pos = 0
                    for seg in IMAGE_SEGMENTS:  # the ESP32's send() calls, one per SPI block
                        writer.write(frame[pos:pos + seg])
                        pos += seg
                    self.stats.images_sent += 1
                if cmd.request & REQ_SENSORS:
                    stamp = (time.time() % 1000.0) if cfg.stamp else None
                    writer.write(bytes([SENSORS_ID]) + self.world.sensors(stamp).encode())
                    self.stats.sensors_sent += 1
                if not cmd.request & (REQ_IMAGE | REQ_SENSORS):
                    writer.write(bytes([EMPTY_ID]))
                    self.stats.empty_sent += 1
            await writer.drain()  # a client that does not read stalls the robot, as a blocking send() would
            if period:
                next_tick += period
                delay = next_tick - time.monotonic()
                if delay < -period:  # fell behind (slow client): do not burst to catch up
                    next_tick = time.monotonic()
                    delay = 0.0
                await asyncio.sleep(max(delay, 0.0))
            else:
                await asyncio.sleep(0)


class EpuckSimulator(SimRobots[EpuckSimRobot]):
    """Several robots on consecutive ports of one host, on one asyncio loop."""

    def __init__(self, count: int, host: str = "127.0.0.1", base_port: int = 0,
                 config: EpuckSimConfig | None = None) -> None:
        super().__init__([
            EpuckSimRobot(f"epuck{i + 1}", host, base_port + i if base_port else 0, config, initial_world(i))
            for i in range(count)
        ])

    def summary(self) -> dict[str, Any]:
        return {r.name: {"port": r.port, **r.stats.summary()} for r in self.robots}


class EpuckSimThread(SimThread[EpuckSimRobot]):
    """Tests: WiFi robots on ports of their own (any free ones), on a loop of their own (harness.py)."""

    def __init__(self, count: int, config: EpuckSimConfig | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(EpuckSimulator(count, host, 0, config), "epuck-sim")
