"""The serial link to one e-puck2 (asercom v2): Bluetooth SPP (/dev/rfcommN) or USB (/dev/ttyACMn).

Same surface as the WiFi `EpuckLink` (start, close, request_write, connected, stats, the same packet
and state callbacks), so a robot device on the bus looks the same whichever way it is reached.

asercom is request/response: the link polls at `poll_hz` with one chain per poll, e.g.
`[-0x09 + 19 actuator bytes] -0x08 -0x0B 0x00` (actuators only when the state changed, so commands
coalesce into at most one write per poll), and turns the 103-byte block plus the button into the
WiFi sensors layout, so one decoder and one MQTT state serve both transports; only the newest
reply is published. The port is opened with pyserial and read on the asyncio loop (`add_reader` on
its file descriptor): no thread, and all controller access stays on the loop.

Over serial the F407 applies `-0x09` once, when it arrives (no radio module re-sends the last
command), so one-shot flags need no clearing command.

The port is the link's alone: opened `exclusive` (an flock, the one `port_lock.hold_port` checks for a
flasher) and in the tty's exclusive mode (TIOCEXCL), so no other program's bytes (GDB packets) reach
the robot's asercom. If bytes did (or a Bluetooth glitch cut a chain), the F407 may sit in the middle
of an ASCII line or a binary chain, swallowing every poll: after a reply timeout that no late reply
explains, the link resynchronises (`RESYNC`, below) instead of staying silent.

Writes are never held back for pacing: a command (a stop, a one-shot) pokes the poller, which writes
it in the next chain at once, between two replies. While a motion deadline is near (`motion_deadline`,
set by the service's deadman) no camera image is started that could not be in before the deadline,
so the deadman's stop never waits behind an image (at 115200 baud an image takes 278 ms).

The bus stop (`write_stop`) does not wait for the poller at all: its `-0x09` chain is written at once, even
while a reply (an image) is on the line. The F407 reads its input in order and answers a chain only once it
has read all of it (Asercom2.c), so the stop is the next chain it reads, and `-0x09` has no reply: the reply
the poller waits for is unchanged. The next chain repeats it (in case a line in progress swallowed it).
Typed ASCII lines that move the robot and wait for their slot are dropped (`LineDropped`).

Health is the kit's link supervisor's, as over WiFi (base.py, wifi.py): the link reports attempt, opened,
failed, data (a complete reply whose sensors block is plausible), garbage and closed. Its budget is
`stale_timeout_s` plus the longest exchange on the line (the image chain's transfer while the image stream
is on). A device that goes away (USB unplugged, Bluetooth out of range) makes the port error or hang up:
the link is `lost` with the reason and reopens the same path on the supervisor's back-off, once per probe
period once `unreachable` (a udev /dev/serial/by-id path keeps its name across replugs; /dev/ttyACMn may
not). A device that stays open but stops answering is `silent`, as over WiFi.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import serial

from services.epuck_gateway.port_lock import exclusive_tty, port_holder
from services.epuck_gateway.protocol.asercom import (
    CAM_RGB565,
    DEFAULT_IMAGE,
    AsercomCommand,
    AsercomImage,
    AsercomReplyReader,
    encode_chain,
    end_pending,
    expected_size,
    get_all_sensors,
    get_button,
    get_image,
    sensors_packet,
    set_all_actuators,
)
from services.epuck_gateway.protocol.wifi import (
    REQ_IMAGE,
    REQ_SENSORS,
    EpuckController,
    ImagePacket,
    Packet,
    ProtocolError,
    SensorsPacket,
    implausible_sensors,
    stop_command,
)
from services.epuck_gateway.transport.base import (
    ErrorHandler,
    LineDropped,
    LinkHooks,
    OwedHandler,
    PacketsHandler,
    RobotLink,
    StateHandler,
    budget_s,
    link_policy,
)
from shared.link import SupervisedLink
from shared.transport import OpenFailed

if TYPE_CHECKING:
    from services.epuck_gateway.settings import EpuckSerialRobot, EpuckSettings

log = logging.getLogger("robobus.epuck.serial")

# Resynchronisation (docs/reference/epuck2.md §6, as Asercom2.c reads its input): zeros complete any argument list
# the robot is waiting for (a chain cut inside a command's arguments) with zeros, then one more ends the binary
# chain it may be stuck in (an idle robot ignores them: asercom.end_pending); `\r` ends an ASCII line it may be
# stuck in (a robot that was idle skips it and takes the next byte as the start of a line); `C\r` is then a whole
# line in every case, a harmless query (the selector) whose answer `c,N\r\n` marks the point from which
# the line is in step again. Everything before it is garbage, and is flushed.
RESYNC_QUERY = b"\rC\r"
RESYNC = end_pending() + RESYNC_QUERY  # the link writes the level actuator state between the two (_resync_bytes)
_SYNCED = re.compile(rb"c,\d+\r\n")
RESYNC_MAX_S = 2.0  # the longest wait for an answer before the resynchronisation is written again
SLOW_LINK_BAUD = 230400  # below: Bluetooth SPP's 115200 and slower (see default_image_fps)


def _answered(line: bytearray, count: int) -> bool:
    """`count` resynchronisations answered in `line`."""
    return len(_SYNCED.findall(line)) >= count


def default_image_fps(baud: int) -> float:
    """Camera polls per second when the robot's settings name none. A 40x40 RGB565 image is 3203 bytes:
    278 ms at 115200 baud, so 2 fps would fill 56 % of a Bluetooth line and starve the sensors (~21 Hz);
    0.5 fps takes 14 %. From 230400 baud (USB, whose line runs at USB speed whatever the baud) 2 fps."""
    return 0.5 if baud < SLOW_LINK_BAUD else 2.0



@dataclass
class EpuckSerialConfig:
    port: str
    baud: int = 115200
    poll_hz: float = 50.0  # chains per second; the reply to -0x08 -0x0B is 104 bytes (~9 ms at 115200 baud)
    image_fps: float | None = None  # -'I' at most this often while the image stream is on (0 = never;
    # None = default_image_fps(baud))
    reply_timeout_s: float = 0.25  # beyond the reply's transfer time at `baud`
    stale_timeout_s: float = 0.8  # no complete reply for this long beyond the longest exchange: silent
    reopen_min_s: float = 0.2  # the supervisor's back-off
    reopen_max_s: float = 2.0
    probe_period_s: float = 2.0  # an unreachable port: one open attempt per period
    stop_drain_s: float = 0.5


class EpuckSerialLink(RobotLink[serial.Serial]):
    """One robot over asercom v2. `run()` until `close()`; `request_write()` after changing the controller."""

    def __init__(self, name: str, config: EpuckSerialConfig, controller: EpuckController,
                 on_packets: PacketsHandler, on_state: StateHandler, on_framing_error: ErrorHandler,
                 supervisor: SupervisedLink | None = None) -> None:
        super().__init__(name, controller, on_packets, on_state, on_framing_error, supervisor,
                         link_policy(config.stale_timeout_s, config.reopen_min_s, config.reopen_max_s,
                                     config.probe_period_s))
        self.config = config
        self.last_reply = 0.0
        self.last_image: AsercomImage | None = None
        self.image_fps = default_image_fps(config.baud) if config.image_fps is None else config.image_fps
        self._serial: serial.Serial | None = None
        self._fd = -1
        self._reader: AsercomReplyReader | None = None
        self._reply: asyncio.Future[None] | None = None
        self._poke = asyncio.Event()
        self._next_image = 0.0
        # typed lines waiting for a slot between polls, and whether each moves the robot
        self._ascii: list[tuple[bytes, asyncio.Future[str], bool]] = []
        self._line: bytearray | None = None  # the ASCII reply being read
        self._line_event = asyncio.Event()
        # the line may be out of step (a reply late, garbled or followed by unasked bytes): no poll until a
        # resynchronisation is answered
        self._out_of_step = False
        self.resync_since: float | None = None  # time.monotonic() a resynchronisation began, while it lasts
        self.resync_unanswered = 0  # its writes not answered so far

    # -- public ---------------------------------------------------------------------------------------
    def _write_soon(self) -> None:
        """In the next chain, at once: the poller is woken (no waiting for the next poll slot)."""
        self._poke.set()

    def image_transfer_s(self) -> float:
        """An image's reply on the line at `baud` (8N1)."""
        return expected_size([get_image()], DEFAULT_IMAGE) * 10 / self.config.baud

    async def ascii(self, line: bytes, timeout_s: float = 1.0, motion: bool = False) -> str:
        """One ASCII-mode command (`D,200,200\r`) between two polls; the robot's reply lines, CR/LF stripped.
        `motion`: the line moves the robot, so a bus stop that comes before it is written drops it (LineDropped)."""
        if not self.connected:
            raise ConnectionError(f"{self.config.port} is not open")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._ascii.append((line, fut, motion))
        self._poke.set()
        return await asyncio.wait_for(fut, timeout_s + 2 * self._reply_timeout([]))

    async def _exchange_ascii(self, line: bytes, fut: asyncio.Future[str]) -> None:
        """Write the line, read until its reply ends (CR LF, then a quiet moment: `H` answers many lines)."""
        self._line = bytearray()
        self._line_event.clear()
        try:
            assert self._serial is not None
            self._serial.write(line)
            deadline = time.monotonic() + self._reply_timeout([]) + 0.5
            quiet = 0.05
            while time.monotonic() < deadline:
                self._line_event.clear()
                ended = self._line.endswith(b"\n")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._line_event.wait(), quiet if ended else deadline - time.monotonic())
                    continue
                if ended:
                    break
            text = self._line.decode("ascii", "replace").replace("\r", "").strip("\n")
            if not fut.done():
                if text:
                    fut.set_result(text)
                else:
                    fut.set_exception(TimeoutError(f"no ASCII reply from the robot on {self.config.port}"))
            if not text:
                self._out_of_step = True  # an answer may still come, and be taken for a poll's
        except (serial.SerialException, OSError) as exc:
            if not fut.done():
                fut.set_exception(ConnectionError(f"write to {self.config.port} failed: {exc}"))
        finally:
            self._line = None

    def write_stop(self, on_owed: OwedHandler) -> float | None:
        """The bus stop, already in the controller (speeds 0, no one-shots): write it now in a chain of its own,
        between or during the poller's exchanges (module doc), drop the waiting ASCII lines that move the robot,
        and return the time it left. Port closed: None, and `on_owed(time)` when the next session's first chain
        (its actuators with speeds 0) has been written."""
        kept: list[tuple[bytes, asyncio.Future[str], bool]] = []
        for line, fut, motion in self._ascii:
            if not motion:
                kept.append((line, fut, motion))
            elif not fut.done():
                fut.set_exception(LineDropped(f"the bus stop came before {line!r} was written: not sent"))
        self._ascii = kept
        if not self.connected or self._serial is None or self._closing:
            self.owed_stop = on_owed
            return None
        self.stats.commands_requested += 1
        # zeros first: a robot whose chain was cut inside a command's arguments would take the stop's own bytes
        # as the missing ones (a speed from its id byte); they end that command and chain with zeros instead
        data = end_pending() + encode_chain([set_all_actuators(self.controller.build())])
        self.controller.drop_oneshots()  # applied once on arrival: nothing to clear (module doc)
        try:
            self._serial.write(data)
        except (serial.SerialException, OSError) as exc:
            self.owed_stop = on_owed
            self._lose(f"write to {self.config.port} failed: {exc}")
            return None
        self.stats.commands_sent += 1
        ts = time.time()
        self._dirty = True  # the next chain repeats it: a robot stuck in a line may have swallowed this one
        self._tell_written(ts)
        self._poke.set()
        return ts

    async def close(self) -> None:
        """Stop the robot (speeds 0, LEDs off, stop sound) and close the port."""
        self._stop_reconnecting()
        self._poke.set()
        await self._end_task()
        ser = self._serial
        if ser is not None:
            with contextlib.suppress(serial.SerialException, OSError):
                ser.write(end_pending() + encode_chain([set_all_actuators(stop_command())]))
                self.stats.commands_sent += 1
                ser.flush()
            self._close_port()

    # -- port lifecycle (under the kit's reconnect loop: RobotLink.run) ---------------------------------------------
    async def _open(self) -> serial.Serial:
        cfg = self.config
        try:
            # exclusive: the flock port_lock.hold_port checks (a flasher on this host must not write GDB
            # packets into the robot's asercom); TIOCEXCL keeps out programs that take no lock
            ser = serial.Serial(cfg.port, cfg.baud, timeout=0, write_timeout=1.0, exclusive=True)
            exclusive_tty(ser.fileno())
        except (serial.SerialException, OSError, ValueError) as exc:
            holder = port_holder(cfg.port)
            raise OpenFailed(f"cannot open {cfg.port}: {exc}" + (f"; held by {holder}" if holder else "")) from None
        return ser

    def _session_ended(self, reason: str) -> None:
        self._close_port()
        if not self._closing:
            log.warning("serial link lost", extra={"robot": self.name, "port": self.config.port, "reason": reason})

    def _set_budget(self) -> None:
        """`stale_timeout_s` beyond the longest exchange: a reply comes every poll, but a chain with the camera
        image holds the line for the image's transfer (278 ms at 115200 baud)."""
        longest = self.image_transfer_s() if self.controller.request & REQ_IMAGE and self.image_fps > 0 else 0.0
        self.sup.set_budget(budget_s(self.config.stale_timeout_s + longest))

    async def _session(self, ser: serial.Serial) -> str:
        loop = asyncio.get_running_loop()
        self._serial = ser
        self._fd = ser.fileno()
        self._lost = loop.create_future()
        with contextlib.suppress(serial.SerialException, OSError):
            ser.reset_input_buffer()  # the robot's welcome banner, or a reply to a previous host
        self.connected = True
        self.last_reply = time.monotonic()
        self.controller.on_link_up()  # never resume motion or replay one-shots from a past link
        self._set_budget()
        self.sup.opened()
        self._report()
        self._dirty = True
        # A link that dropped (Bluetooth out of range) or a host that went away may have cut a chain: the robot
        # may be waiting for arguments. The session's first exchange is a resynchronisation.
        self._out_of_step = True
        loop.add_reader(self._fd, self._readable)
        poller = asyncio.ensure_future(self._poll())
        try:
            waits: list[asyncio.Future[Any]] = [poller, self._lost]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self._lost.done():
                return self._lost.result()
            exc = poller.exception()
            return f"poller stopped: {exc}"
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await poller
            self.connected = False
            for _line, fut, _motion in self._ascii:
                if not fut.done():
                    fut.set_exception(ConnectionError(f"{self.config.port} closed"))
            self._ascii.clear()
            self._tell_written(None)  # requested, never written

    def _close_port(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = -1
        ser, self._serial = self._serial, None
        if ser is not None:
            with contextlib.suppress(Exception):
                ser.close()

    # -- polling -------------------------------------------------------------------------------------------
    def _chain(self, now: float) -> list[AsercomCommand]:
        chain: list[AsercomCommand] = []
        if self._dirty:
            self._dirty = False
            chain.append(set_all_actuators(self.controller.build()))
            self.controller.drop_oneshots()  # applied once on arrival: nothing to clear (module doc)
        request = self.controller.request
        if request & REQ_SENSORS or not request & REQ_IMAGE:
            # With nothing requested the button (1 byte) still tells a live robot from a dead one.
            chain += [get_all_sensors(), get_button()] if request & REQ_SENSORS else [get_button()]
        if request & REQ_IMAGE and self.image_fps > 0 and now >= self._next_image and not self._stop_due(now):
            self._next_image = max(self._next_image + 1.0 / self.image_fps, now)
            chain.append(get_image())
        return chain

    def _stop_due(self, now: float) -> bool:
        """The deadman's stop falls within an image's transfer: the image waits, the stop must not."""
        deadline = self.motion_deadline
        return deadline is not None and now + self._reply_timeout([get_image()]) >= deadline

    def _reply_timeout(self, chain: list[AsercomCommand]) -> float:
        transfer = expected_size(chain, DEFAULT_IMAGE) * 10 / self.config.baud  # 8N1: 10 bits a byte
        return self.config.reply_timeout_s + 1.5 * transfer

    async def _poll(self) -> None:
        """One exchange at a time: a chain is written only once the previous one's reply has come in full and
        nothing unasked came after it. Anything else (no reply in time, a reply no robot sends, unasked bytes)
        leaves the line out of step, and no poll goes out until a resynchronisation has been answered
        (`_resync`): asercom replies carry no sequence number, so a poll written then could be answered by the
        bytes of an older reply, and the next one too (16 polls went out during one late image reply)."""
        period = 1.0 / self.config.poll_hz if self.config.poll_hz > 0 else 0.0
        next_poll = time.monotonic()
        while not self._closing:
            if self._out_of_step:
                await self._resync()
                if self._closing:
                    break
            while self._ascii and not self._out_of_step:
                line, fut, _motion = self._ascii.pop(0)
                if not fut.done():
                    await self._exchange_ascii(line, fut)
            if self._out_of_step:
                continue
            if not await self._exchange(time.monotonic()):
                return
            self._set_budget()
            self.sup.tick()  # the supervisor's deadline, on the loop too: the service's fail-safe follows at once
            self._report()
            next_poll += period
            delay = next_poll - time.monotonic()
            if delay < -period:
                next_poll = time.monotonic()  # fell behind: do not burst
                delay = 0.0
            self._poke.clear()
            if delay > 0 and not self._dirty and not self._ascii and not self._out_of_step:
                with contextlib.suppress(TimeoutError):
                    # A command wakes the poller early: it goes in the next chain at once.
                    await asyncio.wait_for(self._poke.wait(), delay)

    async def _exchange(self, now: float) -> bool:
        """Write one chain and wait for its reply; False when the port failed (the session is lost)."""
        chain = self._chain(now)
        self._reader = AsercomReplyReader(chain)
        self._reply = asyncio.get_running_loop().create_future()
        actuators = any(c.code == 0x09 for c in chain)
        try:
            assert self._serial is not None
            self._serial.write(encode_chain(chain))
        except (serial.SerialException, OSError) as exc:
            self._lose(f"write to {self.config.port} failed: {exc}")
            return False
        if actuators:
            self.stats.commands_sent += 1
            ts = time.time()
            self._tell_written(ts)
            owed, self.owed_stop = self.owed_stop, None
            if owed is not None:  # a stop decided while the port was closed: a session's first chain is it
                owed(ts)
        try:
            await asyncio.wait_for(asyncio.shield(self._reply), self._reply_timeout(chain))
        except TimeoutError:
            self._timed_out()
        else:
            self._delivered(self._reader, time.time())
        self._reader = None
        return True

    def _timed_out(self) -> None:
        """No complete reply in time. A late one would be taken for the next chain's, so the line is out of step
        until a resynchronisation is answered; the late reply, if it comes, is garbage before that answer."""
        self.stats.reply_timeouts += 1
        self.stats.framing_errors += 1
        log.debug("reply timeout", extra={"robot": self.name})
        self.sup.garbage("no complete reply in time")
        r = self._reader
        if r is not None:
            self.stats.garbage_bytes += r.pending
        self._reader = None
        self._out_of_step = True

    def _resync_bytes(self) -> bytes:
        """`RESYNC` with the level actuator state inside: zeros end any argument list and chain the robot is in
        the middle of (a poll swallowed as arguments may have set any speed), the state's chain puts the wanted
        speeds back at once, and `\r C \r` (module doc of `RESYNC`) is answered `c,N` whatever state the robot
        was in. A robot stuck in an ASCII line takes all of it into the line, up to the `\r`."""
        state = encode_chain([set_all_actuators(self.controller.level())])
        return end_pending() + state + RESYNC_QUERY

    async def _resync(self) -> None:
        """Bring the robot back in step: write the resynchronisation (`_resync_bytes`) and read until its `c,N`
        answer; unanswered, write it again, the window doubling up to `RESYNC_MAX_S`, until it is answered (the
        health's details say since when, and how many went unanswered). Polling resumes only then: the bytes
        before the answer are garbage (a late reply, the answer to a stuck line), and the answers to earlier,
        unanswered resynchronisations, which a stalled robot still owes, are read out first. Then the whole
        actuator state goes again in the next chain."""
        line = self._line = bytearray()
        window = self._reply_timeout([]) + 0.1
        written = 0
        self.resync_since = time.monotonic()
        try:
            while not self._closing:
                assert self._serial is not None
                self._serial.write(self._resync_bytes())
                written += 1
                self.stats.resyncs += 1
                if await self._read_until(lambda: _SYNCED.search(line) is not None, window):
                    # a robot that was stalled answers every resynchronisation it read, one right after another
                    await self._read_until(partial(_answered, line, written), RESYNC_MAX_S,
                                           quiet=self._reply_timeout([]))
                    break
                self.stats.resyncs_unanswered += 1
                self.resync_unanswered = written
                log.info("no answer to a resynchronisation; trying again",
                         extra={"robot": self.name, "port": self.config.port, "unanswered": written})
                self._set_budget()
                self.sup.tick()
                self._report()
                window = min(window * 2, RESYNC_MAX_S)
        except (serial.SerialException, OSError, AssertionError):
            pass  # a port that went away is reported by its reader
        finally:
            self._line = None
            self.resync_since = None
            self.resync_unanswered = 0
        answers = sum(len(m) for m in _SYNCED.findall(line))
        self.stats.garbage_bytes += len(line) - answers
        with contextlib.suppress(serial.SerialException, OSError, AttributeError):
            assert self._serial is not None
            self._serial.reset_input_buffer()
        self._out_of_step = False
        self._dirty = True
        log.info("line resynchronised", extra={"robot": self.name, "port": self.config.port, "writes": written})

    async def _read_until(self, done: Callable[[], bool], timeout: float, quiet: float | None = None) -> bool:
        """Wait for `done()` as bytes come into the line being read; False after `timeout`, or after `quiet`
        seconds without a byte."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._line_event.clear()
            try:
                await asyncio.wait_for(self._line_event.wait(), left if quiet is None else min(left, quiet))
            except TimeoutError:
                if quiet is not None:
                    return False
        return True

    def _delivered(self, reader: AsercomReplyReader, ts: float) -> None:
        values = {cmd.name: value for cmd, value in reader.results}
        packets: list[Packet] = []
        if "all_sensors" in values:
            try:
                data = sensors_packet(values["all_sensors"], values.get("button", 0))
            except ProtocolError as exc:  # cannot happen with a complete reply; counted all the same
                log.warning("bad sensors block", extra={"robot": self.name, "error": str(exc)})
                data = b""
            why = implausible_sensors(data) if data else "bad sensors block"
            if why:  # a reply of the right length that no robot sends: garbage, not a live robot
                self.stats.garbage_bytes += expected_size(reader.commands)
                self.sup.garbage(why)
                self._out_of_step = True  # the real reply may still be coming
                return
            packets.append(SensorsPacket(data))
            self.stats.sensors += 1
        elif "button" in values:
            self.stats.empty += 1
        self.last_reply = time.monotonic()
        self.sup.data()
        self._report()
        if "image" in values:
            img: AsercomImage = values["image"]
            self.last_image = img
            if img.mode == CAM_RGB565 and img.width and img.height:
                packets.append(ImagePacket(img.pixels, img.width, img.height))
                self.stats.images += 1
            else:  # grey or YUV: asercom's camera was reconfigured by someone else; not a 565 picture
                self.stats.framing_errors += 1
        self.stats.packets += 1
        if packets:
            self._on_packets(packets, ts)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:  # EIO: the device went away (USB unplugged, pty closed)
            self._lose(f"{self.config.port} went away: {exc}")
            return
        if not data:
            self._lose(f"{self.config.port} hung up")
            return
        self.stats.bytes += len(data)
        if self._line is not None:
            self._line += data
            self._line_event.set()
            return
        r = self._reader
        if r is None or r.done:
            self.stats.garbage_bytes += len(data)  # nothing was asked: not a reply, and the line is out of step
            self._out_of_step = True
            return
        if r.feed(data) is not None and self._reply is not None and not self._reply.done():
            if r.extra:
                self.stats.garbage_bytes += r.extra
                self._out_of_step = True
            self._reply.set_result(None)


def serial_link(settings: EpuckSettings, hooks: LinkHooks) -> EpuckSerialLink:
    """Transport `epuck-gateway.serial` (a robot's `"transport": "serial"`; entry point `robobus.transports`):
    asercom v2 on a serial port (Bluetooth SPP, USB)."""
    robot = cast("EpuckSerialRobot", hooks.robot)
    return EpuckSerialLink(robot.id, EpuckSerialConfig(
        port=robot.port, baud=robot.baud, poll_hz=robot.poll_hz, image_fps=robot.image_fps,
        stale_timeout_s=settings.epuck_stale_timeout_s, reopen_min_s=settings.epuck_reconnect_min_s,
        reopen_max_s=settings.epuck_reconnect_max_s, probe_period_s=settings.epuck_probe_period_s),
        hooks.controller, hooks.on_packets, hooks.on_state, hooks.on_framing_error, hooks.supervisor)
