"""The TCP link to one e-puck2: connect, stream-parse at line rate, pace commands, watch liveness.

asyncio, one `EpuckLink` per robot, all on the service's loop. An `asyncio.Protocol` is fed by the
loop as soon as bytes arrive (up to 256 KiB per read), so the socket's receive buffer never fills
and no backlog of stale packets can build up (the published Python client reads one packet per call
and lags exactly there). What to do with the packets is the listener's business; it keeps only the
newest.

Commands are written as soon as they are decided, as GCtronic's monitor does (reference section 4,
MON): a command handler changes the controller's state and asks for a write, and the link writes the
whole state (latest values plus every pending one-shot) at once, unless it is the state last written
(a renewed set_speed writes nothing). What the firmware does with queued commands bounds this: it
takes one queued command per cycle and flushes the older ones when 5 or more are queued (reference
section 4), so writing every command as it came lost one-shots (a sound followed by six LED changes
within 15 ms never played). The link therefore keeps at most `MAX_UNTAKEN` written commands that the
robot has not yet taken (one is taken per robot cycle, i.e. per packet that ends a cycle and began
after the write); beyond that, changes coalesce into the next write, which goes when the robot takes
one. With the robot's count off by at most the cycle in progress, and one liveness probe, its queue
stays below 5, and `request_write(on_written)` says when a state left.

Motion does not queue: a robot cycle is one image at a slow image rate (2 s at 0.5 fps), and a speed that waited
behind one or two untaken commands ran that much longer or later than asked (a 1 s deadman stopped a robot after
2.7 s). A command whose wheel speeds (or obstacle avoidance) differ from the last written, while the robot has
untaken commands none of which carries a one-shot, replaces them: it is written `FIRMWARE_FLUSH` times in one
write, so the firmware finds 5 queued at its next cycle, drops the older ones and takes it (a whole state: the
dropped ones held nothing it lacks). The stops go that way whatever is queued (a stop beats a melody not yet
played): the deadman's (`request_write(urgent=True)`), the bus stop (`write_stop`), the stop before a close or a
reset. The bus stop is written first from the stop's own thread (`write_stop_from_thread`), ahead of whatever the
loop has queued, when nothing of the loop's is half written in the socket; the loop's pass writes it again. A robot
whose link is down keeps its last speeds (no watchdog on the robot); its stop is the next
connection's first command, which always has speeds 0.

One-shots (sound, IR calibration, step-counter write) are level-triggered on the robot: the radio module
re-sends the last command it took to the F407 on every exchange (reference section 3), and takes a new one once
per cycle of its own. A command that carries a one-shot therefore asks for no image (protocol/wifi.py
`EpuckController.build`): the cycle that applies it is short (the sensors packet, or 0x03), and the clear that
follows it (with the streams asked for) is taken at the next; with the image in it, the one-shot stayed for a
whole image period (at 0.5 fps a melody restarted 50-100 times).

Health is the kit's link supervisor's (shared/link.py, docs/kit.md "Health"): the link reports what
happens (attempt, opened, failed, data, garbage, closed) and reconnects on the supervisor's back-off,
probing once per probe period once the robot is `unreachable`. The budget it gives the supervisor is the
allowed silence for what the robot was asked to send (liveness.py), set again as the images actually
seen change it (`set_budget`): a healthy slow image stream does not flap the link, and a robot that
sends nothing at all is `silent` within the allowance in force. Valid data is a plausible sensors packet
(protocol/wifi.implausible_sensors), or an image or 0x03 that another packet completes after (random bytes
hold the ids 0x01/0x02/0x03 too); anything else is garbage, counted, and resets the link. A silent link is
kept, not reset: a hung robot keeps its TCP connection and reconnecting would only make the health
toggle; one probe (the current state again) goes out, and TCP_USER_TIMEOUT makes the kernel drop a
connection whose peer stopped acknowledging, which then reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from services.epuck_gateway.protocol.wifi import (
    REQ_SENSORS,
    SET_OBSTACLE_AVOIDANCE,
    SET_STEPS,
    EmptyPacket,
    EpuckCommand,
    EpuckController,
    EpuckStreamParser,
    FramingError,
    ImagePacket,
    Packet,
    ProtocolError,
    SensorsPacket,
    implausible_sensors,
    stop_command,
)
from services.epuck_gateway.transport.base import (
    ErrorHandler,
    LinkHooks,
    OwedHandler,
    PacketsHandler,
    RobotLink,
    StateHandler,
    budget_s,
    link_policy,
)
from services.epuck_gateway.transport.liveness import LinkLiveness
from shared.link import SupervisedLink
from shared.transport import OpenFailed

if TYPE_CHECKING:
    from services.epuck_gateway.settings import EpuckSettings, EpuckWifiRobot

log = logging.getLogger("robobus.epuck.link")
STOP_LINGER_S = 0.2
LOWAT_MIN = 1024  # only an image's remainder is worth a setsockopt; sensors packets are 105 bytes
LOWAT_MAX = 65536  # below the receive buffer, so the mark can always be met
MAX_UNTAKEN = 2  # written commands the robot has not taken yet; its firmware flushes at 5 queued (module doc)
FIRMWARE_FLUSH = 5  # queued commands from which the firmware keeps only the newest (reference section 4)


@dataclass
class EpuckLinkConfig:
    host: str
    port: int = 1000
    connect_timeout_s: float = 3.0
    reconnect_min_s: float = 0.2  # the supervisor's back-off after a failed attempt or a lost link
    reconnect_max_s: float = 2.0
    probe_period_s: float = 2.0  # an unreachable robot: one connection attempt per period
    # Silence beyond the expected gap between packets (liveness.py) that makes a link `silent`.
    stale_timeout_s: float = 0.8
    image_gap_max_s: float = 6.0
    # Unacknowledged data older than this makes the kernel drop the connection (TCP_USER_TIMEOUT).
    tcp_user_timeout_s: float = 10.0
    stop_drain_s: float = 0.5


class _Wire(asyncio.Protocol):
    """Feeds the link while its connection is the link's current one (a connection being left after a
    framing error lingers a moment, and its bytes must not reach the next connection's parser)."""

    def __init__(self, link: EpuckLink) -> None:
        self.link = link
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def _current(self) -> bool:
        return self.transport is not None and self.link._transport is self.transport

    def data_received(self, data: bytes) -> None:
        if self._current():
            self.link._on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._current():
            self.link._lose(f"connection lost: {exc}" if exc else "connection closed by the robot")


class EpuckLink(RobotLink[asyncio.Transport]):
    """One robot's TCP link. `run()` until `close()`; `request_write()` after changing the controller."""

    def __init__(self, name: str, config: EpuckLinkConfig, controller: EpuckController,
                 on_packets: PacketsHandler, on_state: StateHandler, on_framing_error: ErrorHandler,
                 supervisor: SupervisedLink | None = None) -> None:
        super().__init__(name, controller, on_packets, on_state, on_framing_error, supervisor,
                         link_policy(config.stale_timeout_s, config.reconnect_min_s, config.reconnect_max_s,
                                     config.probe_period_s))
        self.config = config
        self.parser = EpuckStreamParser()
        self.liveness = LinkLiveness(config.stale_timeout_s, config.image_gap_max_s)
        self.last_rx = 0.0  # time.monotonic() of the last valid data
        self._confirmed = False  # this connection has brought valid data
        self._held: Packet | None = None  # the connection's first packet, an image or 0x03 not yet confirmed
        self._transport: asyncio.Transport | None = None
        self._stop_mark: int | None = None  # packet count when the stop command left
        self._stopped = asyncio.Event()
        self._watchdog: asyncio.TimerHandle | None = None
        self._accepted = False  # the robot answered this connection's first command
        # per written command the robot has not taken yet: the packet count it must see a cycle end beyond, and
        # whether it carries a one-shot (it must not be flushed by a replacing write)
        self._untaken: collections.deque[tuple[int, bool]] = collections.deque()
        self._last_written = b""
        self._session_writes = 0  # commands written on this connection (the first must be alone: reference §3)
        self._written_request = 0
        self._probed_at = -1.0
        self._sock: Any = None  # the connection's socket (asyncio's TransportSocket), for SO_RCVLOWAT
        self._lowat = 1
        # Every write to the connection holds this: the stop's thread writes the socket directly
        # (`write_stop_from_thread`), and its bytes must never land inside a command the loop is writing. `_tail`:
        # what of such a write the socket did not take, written by the loop before anything else. Re-entrant: a
        # transport's write may call back into its protocol (pause_writing) on the loop's own thread.
        self._write_lock = threading.RLock()
        self._tail = b""
        self._loop: asyncio.AbstractEventLoop | None = None  # the session's (the stop's thread hands a tail to it)
        self.thread_stops = 0  # bus stops written from the stop's thread (tests, logs)

    # -- public ---------------------------------------------------------------------------------
    def _write_soon(self) -> None:
        """At once, coalesced while the robot has `MAX_UNTAKEN` commands not yet taken (module doc)."""
        self._flush()

    def write_stop(self, on_owed: OwedHandler) -> float | None:
        """The bus stop, already in the controller (speeds 0, no one-shots): write the whole state now, past the
        limit of untaken commands and even if it is the state last written, and return the time it left. The
        robot applies it at its next cycle (the firmware takes one queued command per cycle, and flushes all but
        the newest at 5 queued: reference epuck2.md §4, so the stop, written last, is what it ends with).
        No link: None, and `on_owed(time)` when the next connection's first command (speeds 0) has left."""
        if not self.connected or self._transport is None or self._closing:
            self.owed_stop = on_owed
            return None
        self.stats.commands_requested += 1
        if not self._accepted and self._session_writes <= 1:
            # Only the connection's first command (speeds 0, from on_link_up) has gone: the robot holds the stop
            # already, and a second command in the first's TCP segment would make it refuse both (reference §3).
            self._dirty = True
            return time.time()
        return self._write_state(force=True, replace=True)

    def write_stop_from_thread(self) -> float | None:
        """On the stop's own thread (the kit's stop connection), before the loop's pass: the controller's state
        with speeds 0 and obstacle avoidance off, written to the socket from here, `FIRMWARE_FLUSH` times when the
        robot has untaken commands (so it takes the stop at its next cycle, as `write_stop`). Only on a link whose
        first command has been answered and with nothing of the loop's waiting in the transport's buffer (a command
        half written); else None, and the pass writes it. The controller is the loop's: read, not changed (the
        pass sets it); a state read mid-change is written whole again by the pass right after."""
        with self._write_lock:
            t, sock, loop = self._transport, self._sock, self._loop
            if (t is None or sock is None or loop is None or t.is_closing() or not self.connected or self._closing
                    or not self._accepted or t.get_write_buffer_size() or self._tail):
                return None
            data = replace(self.controller.level(), left=0, right=0, settings=0).encode()
            data *= FIRMWARE_FLUSH if self._untaken else 1
            try:
                n = os.write(sock.fileno(), data)
            except OSError:  # full (BlockingIOError), reset or closed meanwhile: the pass writes it
                return None
            if n < len(data):  # the rest goes first in the loop's next write, or on its own
                self._tail = data[n:]
                loop.call_soon_threadsafe(self._write_tail)
            self.thread_stops += 1
            return time.time()

    async def close(self) -> None:
        """Stop the robot (speeds 0, LEDs off, stop sound, request 0), wait for its 0x03, close."""
        self._stop_reconnecting()
        if self.connected and self._transport is not None:
            self._stop_mark = self.parser.packets + (1 if self.parser.in_packet else 0)
            self._stopped.clear()
            self._write_replacing(stop_command().encode())  # the last word: not paced, nothing queued before it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.config.stop_drain_s)
            self._drop_transport()
        await self._end_task()

    # -- connection (under the kit's reconnect loop: RobotLink.run) ------------------------------------------------
    async def _open(self) -> asyncio.Transport:
        cfg = self.config
        try:
            transport, _ = await asyncio.wait_for(
                asyncio.get_running_loop().create_connection(lambda: _Wire(self), cfg.host, cfg.port),
                cfg.connect_timeout_s)
        except TimeoutError:  # (before OSError: TimeoutError is one) its text is empty
            raise OpenFailed(f"cannot connect to {cfg.host}:{cfg.port}: no answer to the TCP connect within "
                             f"{cfg.connect_timeout_s:g} s (connect timeout)") from None
        except OSError as exc:
            raise OpenFailed(f"cannot connect to {cfg.host}:{cfg.port}: {str(exc) or type(exc).__name__}") from None
        assert isinstance(transport, asyncio.Transport)
        sock = transport.get_extra_info("socket")
        self._sock, self._lowat = sock, 1
        if sock is not None:
            with contextlib.suppress(OSError):  # 21-byte commands must not wait for Nagle
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError, AttributeError):  # Linux: give up on a peer that stopped ACKing
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(cfg.tcp_user_timeout_s * 1000))
        return transport

    def _set_budget(self) -> None:
        """The budget the supervisor applies: while the link is open, the allowed silence for what the robot
        was asked to send and the images seen (liveness.py); while it is not, `stale_timeout_s` (no data is
        due from a robot that has no link: it is `unreachable` once that passes, and probed)."""
        allowed = self.liveness.allowed_silence() if self.connected else self.config.stale_timeout_s
        budget = budget_s(allowed)
        before = self.sup.sup.policy.liveness_s
        if budget != before:
            self.sup.set_budget(budget)
            if budget < before and self._watchdog is not None:  # the deadline came forward
                self._watchdog.cancel()
                self._arm_watchdog(0.0)

    async def _session(self, transport: asyncio.Transport) -> str:
        loop = asyncio.get_running_loop()
        self._transport, self._loop = transport, loop
        self._lost = loop.create_future()
        if transport.is_closing():  # closed by the robot before the link took it over
            self._transport = None
            return "connection closed by the robot"
        self.parser.reset()
        self.last_rx = time.monotonic()
        self.connected = True
        self._confirmed = False
        self._held = None
        self._probed_at = -1.0
        self._accepted = False
        self._dirty = False
        self._untaken.clear()
        self._session_writes = 0
        self._tail = b""
        # The robot sends nothing until its first command: send it at once, alone in its segment (the
        # firmware takes the first command only as exactly 21 bytes). Later writes wait for its packets.
        first = self.controller.on_link_up()
        self.liveness.reset(first.request)
        self._set_budget()
        # Open is not streaming: the health says `connected` until the robot's first valid data.
        self.sup.opened()
        self._report()
        self._written_request = first.request
        self._last_written = first.encode()
        self._write(self._last_written)
        self._untaken.append((self.parser.packets, False))
        self.controller.sent(self.parser.packets, False)
        owed, self.owed_stop = self.owed_stop, None
        if owed is not None:  # a stop decided while the link was down: this first command (speeds 0) is it
            owed(time.time())
        log.info("robot connected", extra={"robot": self.name, "host": self.config.host, "port": self.config.port})
        self._arm_watchdog(self.liveness.allowed_silence())
        try:
            return await self._lost
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            self.connected = False
            self._held = None
            self._tell_written(None)  # requested, never written
            if not self._closing:
                self._drop_transport()

    # -- writes: at once, within what the robot's command queue takes ----------------------------------
    def _flush(self) -> None:
        if not (self._dirty and self._accepted) or self._closing:
            return  # nothing new, or the first command not answered yet
        if self._urgent:
            self._write_state(force=False, replace=True)
            return
        if self._untaken and not any(oneshot for _mark, oneshot in self._untaken) and self._moves():
            self._write_state(force=False, replace=True)  # a new speed replaces the untaken ones (module doc)
            return
        if len(self._untaken) >= MAX_UNTAKEN:
            return  # the robot's queue is full enough: wait for a cycle
        self._write_state(force=False)

    def _moves(self) -> bool:
        """The state to write sets other wheel speeds (or obstacle avoidance) than the last one written."""
        try:
            last = EpuckCommand.decode(self._last_written)
        except ProtocolError:
            return True
        if last.settings & SET_STEPS:
            return True  # its speed bytes were step counters: the speeds it leaves are older ones
        level = self.controller.level()
        return ((last.left, last.right, last.settings & SET_OBSTACLE_AVOIDANCE)
                != (level.left, level.right, level.settings & SET_OBSTACLE_AVOIDANCE))

    def _write_state(self, force: bool, replace: bool = False) -> float:
        """Write the controller's whole state (unless it is the state last written and not `force`); `replace`:
        so that the robot takes it at its next cycle, dropping what it had not taken (module doc). Tell the
        waiting listeners; the time it left."""
        cmd = self.controller.build()
        data = cmd.encode()
        self._dirty = False
        self._urgent = False
        if force or data != self._last_written:
            self._written_request = cmd.request
            self.liveness.set_request(cmd.request)
            self._set_budget()
            self._last_written = data
            mark = self.parser.packets + (1 if self.parser.in_packet else 0)
            if replace:
                self._write_replacing(data)
                self._untaken.clear()
            else:
                self._write(data)
            self._untaken.append((mark, self.controller.awaiting_clear))
            self.controller.sent(self.parser.packets, self.parser.in_packet)
        ts = time.time()
        self._tell_written(ts)  # written now, or the robot already holds this very state
        return ts

    def _write_replacing(self, data: bytes) -> None:
        """A command the robot takes at its next cycle, whatever was queued before it: written `FIRMWARE_FLUSH`
        times at once when the robot has untaken commands (the firmware keeps only the newest of 5 or more
        queued), once when it has none."""
        self._write(data * (FIRMWARE_FLUSH if self._untaken else 1))

    def _ends_cycle(self, p: Packet) -> bool:
        """The robot's cycle ends with the sensors packet, or the image when no sensors follow it, or 0x03."""
        if isinstance(p, ImagePacket):
            return not self._written_request & REQ_SENSORS
        return True

    # -- watchdog: one timer per link, for the supervisor's deadline and the probe ---------------------------
    def _arm_watchdog(self, delay: float) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(max(delay, 0.005), self._watchdog_fired)

    def _watchdog_fired(self) -> None:
        """The node's housekeeping applies the supervisor's deadlines to the health; this timer applies them on
        the loop as well, so that the service's fail-safe follows at once (and a link bound to no node is
        judged too), and sends the probe."""
        self._watchdog = None
        if not self.connected or self._closing:
            return
        due = self.sup.tick()
        self._report()
        allowed = self.sup.sup.policy.liveness_s
        silent = time.monotonic() - self.last_rx
        # One probe per silence, unpaced: the current state again. With nothing requested it is sent at
        # half the allowed silence, since the robot answers it with 0x03 (a robot that only acknowledges
        # commands stays alive this way). Otherwise a slow robot just queues it (the same state, and one
        # probe only, so a stalled robot's queue never reaches the firmware's flush at 5), and a dead one
        # leaves it unacknowledged, so TCP_USER_TIMEOUT ends the connection, which then reconnects.
        probe_at = allowed if self.liveness.request else allowed / 2
        waits = [] if due is None else [due + 0.001]
        if self._probed_at != self.last_rx:
            if silent >= probe_at:
                self._probed_at = self.last_rx
                self._write(self.controller.level().encode())
            else:
                waits.append(probe_at - silent)
        self._arm_watchdog(min(waits) if waits else allowed)

    def _reset_link(self) -> None:
        """Leave a link we no longer trust: tell the robot to stop first, then close a moment later.

        Closing at once with the robot's stream unread in our receive buffer makes the kernel send an
        RST, which can discard the stop command before the robot has read it. The left connection keeps
        draining (its bytes go nowhere) for `STOP_LINGER_S`, so it ends with a FIN after the stop."""
        self._write_replacing(stop_command().encode())
        with self._write_lock:
            t, self._transport = self._transport, None
            self.connected = False
        if t is not None:
            asyncio.get_running_loop().call_later(STOP_LINGER_S, t.close)

    def _drop_transport(self) -> None:
        with self._write_lock:
            t, self._transport = self._transport, None
            self.connected = False
            self._tail = b""
        if t is not None:
            t.close()

    def _write_tail(self) -> None:
        with self._write_lock:
            if self._tail and self._transport is not None and not self._transport.is_closing():
                self._transport.write(self._tail)
            self._tail = b""

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            if self._transport is not None and not self._transport.is_closing():
                tail, self._tail = self._tail, b""
                self._transport.write(tail + data)
                self.stats.commands_sent += 1
                self._session_writes += 1

    # -- protocol callbacks -------------------------------------------------------------------
    def _wake_on_whole_image(self) -> None:
        """Mid-image, let the kernel wake the loop only once the rest of the image is in (SO_RCVLOWAT):
        the robot sends a frame in ten writes, and a read that completes nothing is a wasted wake-up
        (20 simulated robots on 127.0.0.1, 50 Hz + 10 fps: 1,517 reads/s before, 1,197 with the mark,
        for 1,200 packets/s). A closed or reset connection still wakes the loop at once; between
        packets the mark is back at 1 byte, so a sensors packet is never held."""
        missing = self.parser.missing()
        want = min(missing, LOWAT_MAX) if missing >= LOWAT_MIN else 1
        if want != self._lowat and self._sock is not None:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                self._sock = None  # not supported here: plain reads, as before
                return
            self._lowat = want

    def _on_data(self, data: bytes) -> None:
        now = time.time()
        mono = time.monotonic()
        self.stats.bytes += len(data)
        events = self.parser.feed(data)
        self._wake_on_whole_image()
        packets: list[Packet] = []
        error: FramingError | None = None
        for ev in events:
            if isinstance(ev, FramingError):
                error = ev
                break
            if isinstance(ev, SensorsPacket) and (why := implausible_sensors(ev.data)):
                # an id the protocol knows, content no robot sends: out of step, or not an e-puck2
                error = FramingError(bad_id=0x02, offset=self.parser.bytes_in, reason=why)
                self.stats.garbage_bytes += 1 + len(ev.data)
                break
            packets.append(ev)
        base = self.parser.packets - sum(1 for ev in events if not isinstance(ev, FramingError))
        for i, p in enumerate(packets, 1):
            self.liveness.on_packet(mono, isinstance(p, ImagePacket))
            if isinstance(p, SensorsPacket):
                self.stats.sensors += 1
            elif isinstance(p, ImagePacket):
                self.stats.images += 1
            elif isinstance(p, EmptyPacket):
                self.stats.empty += 1
                if self._stop_mark is not None and base + i > self._stop_mark:
                    self._stopped.set()
            if self._ends_cycle(p) and self._untaken and base + i > self._untaken[0][0]:
                self._untaken.popleft()  # the robot's cycle that began after that write took it
        self.stats.packets += len(packets)
        valid = self._valid(packets)
        if valid and not self._closing:
            self.last_rx = mono
            self.sup.data()
            self._set_budget()  # the allowance follows the images seen
            self._report()
            self._accepted = True
            self._on_packets(valid, now)
            if self.controller.clear_due(self.parser.packets):
                self._dirty = True  # the one-shots the robot has applied must now be cleared
            self._flush()
        if error is not None:
            self.stats.framing_errors += 1
            what = error.describe()
            log.warning("framing error, resetting the link", extra={"robot": self.name, "error": what})
            self.sup.garbage(what)
            self._on_framing_error(error)
            self._reset_link()
            self._lose(f"framing error: {what}")

    def _valid(self, packets: list[Packet]) -> list[Packet]:
        """The packets that prove the robot alive (module doc): a plausible sensors packet (checked by the
        caller), or an image or 0x03 once another packet has completed after it on this connection. Only the
        connection's first packet can wait for that: it is held until the next one completes. A 0x03 proves
        nothing while streams are requested (the robot sends it only when nothing is)."""
        if self._written_request:
            packets = [p for p in packets if not isinstance(p, EmptyPacket)]
        if self._held is not None and packets:
            packets = [self._held, *packets]
            self._held = None
        if not self._confirmed and packets:
            if len(packets) == 1 and not isinstance(packets[0], SensorsPacket):
                self._held = packets[0]
                return []
            self._confirmed = True
        return packets


def wifi_link(settings: EpuckSettings, hooks: LinkHooks) -> EpuckLink:
    """Transport `epuck-gateway.wifi` (a robot's `"transport": "wifi"`, the default; entry point
    `robobus.transports`): the radio module's TCP server."""
    robot = cast("EpuckWifiRobot", hooks.robot)
    return EpuckLink(robot.id, EpuckLinkConfig(
        host=robot.host, port=robot.port, connect_timeout_s=settings.epuck_connect_timeout_s,
        reconnect_min_s=settings.epuck_reconnect_min_s, reconnect_max_s=settings.epuck_reconnect_max_s,
        probe_period_s=settings.epuck_probe_period_s,
        stale_timeout_s=settings.epuck_stale_timeout_s, image_gap_max_s=settings.epuck_image_gap_max_s,
        tcp_user_timeout_s=settings.epuck_tcp_user_timeout_s), hooks.controller, hooks.on_packets, hooks.on_state,
        hooks.on_framing_error, hooks.supervisor)
