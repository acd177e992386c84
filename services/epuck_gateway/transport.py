"""The TCP link to one e-puck2: connect, stream-parse at line rate, reconnect, stop before closing.

asyncio, one `EpuckLink` per robot, all on the service's loop. An `asyncio.Protocol` is fed by the
loop as soon as bytes arrive (up to 256 KiB per read), so the socket's receive buffer never fills
and no backlog of stale packets can build up (the published Python client reads one packet per call
and lags exactly there). What to do with the packets is the listener's business; it keeps only the
newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.epuck_gateway.protocol import (
    EpuckController,
    EpuckStreamParser,
    FramingError,
    ImagePacket,
    Packet,
    SensorsPacket,
    stop_command,
)

log = logging.getLogger("robobus.epuck.link")


@dataclass
class EpuckLinkConfig:
    host: str
    port: int = 1000
    connect_timeout_s: float = 3.0
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 2.0
    # The robot streams all the time (0x03 at least), so silence means the link is gone: this is
    # what gets health to "disconnected" within 1 s when a robot drops off WiFi without a FIN.
    stale_timeout_s: float = 0.8
    stop_drain_s: float = 0.5


@dataclass
class EpuckLinkStats:
    connects: int = 0
    reconnects: int = 0
    framing_errors: int = 0
    packets: int = 0
    images: int = 0
    sensors: int = 0
    empty: int = 0
    bytes: int = 0
    commands_sent: int = 0


PacketsHandler = Callable[[list[Packet], float], None]
StateHandler = Callable[[bool, str, str], None]  # connected, state, message
ErrorHandler = Callable[[FramingError], None]


class _Wire(asyncio.Protocol):
    def __init__(self, link: EpuckLink) -> None:
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link._on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._on_lost(f"connection lost: {exc}" if exc else "connection closed by the robot")


class EpuckLink:
    """One robot's TCP link. `run()` until `close()`; `send_state()` sends the controller's command."""

    def __init__(self, name: str, config: EpuckLinkConfig, controller: EpuckController,
                 on_packets: PacketsHandler, on_state: StateHandler, on_framing_error: ErrorHandler) -> None:
        self.name = name
        self.config = config
        self.controller = controller
        self.parser = EpuckStreamParser()
        self.stats = EpuckLinkStats()
        self.connected = False
        self.last_rx = 0.0
        self._on_packets = on_packets
        self._on_state = on_state
        self._on_framing_error = on_framing_error
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Future[str] | None = None
        self._closing = False
        self._wake = asyncio.Event()
        self._stop_mark: int | None = None  # packet count when the stop command left
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._accepted = False  # the robot answered this connection's first command
        self._deferred = False
        self._probed_at = -1.0

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.ensure_future(self.run())
        return self._task

    def send_state(self) -> bool:
        """Send the controller's next command (level state plus pending one-shots)."""
        if not self.connected:
            return False
        if not self._accepted:
            # The firmware takes the first command of a connection only as exactly 21 bytes: nothing
            # may share its TCP segment. Later commands wait for the robot's first packet.
            self._deferred = True
            return True
        self._write(self.controller.build().encode())
        self.controller.sent(self.parser.packets, self.parser.in_packet)
        return True

    async def close(self) -> None:
        """Stop the robot (speeds 0, LEDs off, stop sound, request 0), wait for its 0x03, close."""
        self._closing = True
        self._wake.set()
        if self.connected and self._transport is not None:
            self._stop_mark = self.parser.packets + (1 if self.parser.in_packet else 0)
            self._stopped.clear()
            self._write(stop_command().encode())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.config.stop_drain_s)
            self._drop_transport()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # -- connection loop -------------------------------------------------------------------------
    async def run(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        delay = cfg.reconnect_min_s
        down_reported = False  # while retrying, keep the "disconnected" health and its reason
        while not self._closing:
            if not down_reported:
                self._on_state(False, "connecting", "")
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_connection(lambda: _Wire(self), cfg.host, cfg.port), cfg.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                msg = f"cannot connect to {cfg.host}:{cfg.port}: {exc or 'timeout'}"
                self._on_state(False, "disconnected", msg)
                down_reported = True
                await self._pause(delay)
                delay = min(delay * 2, cfg.reconnect_max_s)
                continue
            assert isinstance(transport, asyncio.Transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):  # 21-byte commands must not wait for Nagle
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.stats.connects:
                self.stats.reconnects += 1
            self.stats.connects += 1
            packets_before = self.stats.packets
            reason = await self._session(transport)
            if self._closing:
                break  # close() reports the end itself
            self._on_state(False, "disconnected", reason)
            down_reported = True
            # A link that carried data was healthy: retry fast. One that never did (a robot busy with
            # another client keeps us in its backlog) backs off like a refused connect.
            delay = cfg.reconnect_min_s if self.stats.packets > packets_before else min(delay * 2,
                                                                                      cfg.reconnect_max_s)
            await self._pause(delay)

    async def _session(self, transport: asyncio.Transport) -> str:
        loop = asyncio.get_running_loop()
        self._transport = transport
        self._lost = loop.create_future()
        self.parser.reset()
        self.last_rx = time.monotonic()
        self.connected = True
        self._accepted = self._deferred = False
        self._on_state(True, "streaming", "")
        # The robot sends nothing until its first command: send it at once.
        self._write(self.controller.on_link_up().encode())
        self.controller.sent(self.parser.packets, False)
        log.info("robot connected", extra={"robot": self.name, "host": self.config.host, "port": self.config.port})
        self._probed_at = -1.0
        self._arm_watchdog(self.config.stale_timeout_s / 2)
        try:
            return await self._lost
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            self.connected = False
            if not self._closing:
                self._drop_transport()

    # -- silence watchdog: one timer per link, re-armed from the last byte's time ------------------
    def _arm_watchdog(self, delay: float) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(delay, self._watchdog_fired)

    def _watchdog_fired(self) -> None:
        self._watchdog = None
        if not self.connected or self._closing:
            return
        stale = self.config.stale_timeout_s
        silent = time.monotonic() - self.last_rx
        if silent >= stale:
            self._on_lost(f"no data from the robot for {silent:.1f} s")
            self._reset_link()
            return
        if silent >= stale / 2 and self._probed_at != self.last_rx:
            # The firmware keeps sending 0x03 with nothing requested; should a robot only acknowledge
            # commands instead, repeating the current command (idempotent: the robot repeats it
            # anyway) draws an 0x03 and tells a quiet link from a dead one.
            self._probed_at = self.last_rx
            self.send_state()
        self._arm_watchdog(max((stale / 2 if silent < stale / 2 else stale) - silent, 0.005))

    def _reset_link(self) -> None:
        """Leave a link we no longer trust: tell the robot to stop first (best effort), then close."""
        self._write(stop_command().encode())
        self._drop_transport()

    def _drop_transport(self) -> None:
        t, self._transport = self._transport, None
        self.connected = False
        if t is not None:
            t.close()

    async def _pause(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self.stats.commands_sent += 1

    # -- protocol callbacks -------------------------------------------------------------------
    def _on_lost(self, reason: str) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(reason)

    def _on_data(self, data: bytes) -> None:
        now = time.time()
        self.last_rx = time.monotonic()
        self.stats.bytes += len(data)
        events = self.parser.feed(data)
        if not events:
            return
        packets: list[Packet] = []
        error: FramingError | None = None
        for ev in events:
            if isinstance(ev, FramingError):
                error = ev
                break
            packets.append(ev)
        base = self.parser.packets - len(packets)
        for i, p in enumerate(packets, 1):
            if isinstance(p, SensorsPacket):
                self.stats.sensors += 1
            elif isinstance(p, ImagePacket):
                self.stats.images += 1
            else:
                self.stats.empty += 1
                if self._stop_mark is not None and base + i > self._stop_mark:
                    self._stopped.set()
        self.stats.packets += len(packets)
        if packets and not self._closing:
            self._accepted = True
            self._on_packets(packets, now)
            if self._deferred or self.controller.clear_due(self.parser.packets):
                self._deferred = False
                self.send_state()  # a deferred command, or the clear of one-shots the robot has applied
        if error is not None:
            self.stats.framing_errors += 1
            log.warning("framing error, resetting the link",
                        extra={"robot": self.name, "bad_id": f"0x{error.bad_id:02x}", "offset": error.offset})
            self._on_framing_error(error)
            self._reset_link()
            self._on_lost(f"framing error: unknown packet id 0x{error.bad_id:02x} at byte {error.offset}")
