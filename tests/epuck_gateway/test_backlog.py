"""A stop queued while every robot's socket holds a backlog (the gateway's loop was stalled while the robots
streamed) is written after one turn of each robot's backlog, not after all of it (links/wifi.py `_Wire`), and
the backlog is then handled in full, in order (nothing dropped, framing intact)."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time

from services.epuck_gateway.links.wifi import TURN_BYTES, EpuckLink, EpuckLinkConfig
from services.epuck_gateway.protocols.wifi import (
    COMMAND_SIZE,
    EpuckCommand,
    EpuckController,
    EpuckRawSensors,
    FramingError,
    Packet,
    SensorsPacket,
)

ROBOTS = 5
BACKLOG = 3000  # sensors packets each robot streams while the loop is stalled (315 KB)
PACKET = b"\x02" + EpuckRawSensors(tof=77, selector=15, proximity=tuple(range(8))).encode()
ONE_TURN = TURN_BYTES // len(PACKET) + 1  # the most packets one turn can complete


class FloodRobot:
    """A robot on plain sockets in threads of its own (it keeps running while the gateway's loop is stalled):
    one sensors packet per command until `flood()`, then `BACKLOG` packets at once; it records every command."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.conn: socket.socket | None = None
        self.commands: list[EpuckCommand] = []
        self.buffered = threading.Event()  # the kernel holds all it would take without a read
        self.buffered_packets = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        self.conn = conn
        buf = b""
        while True:
            try:
                data = conn.recv(4096)
            except OSError:
                return
            if not data:
                return
            buf += data
            while len(buf) >= COMMAND_SIZE:
                cmd, buf = EpuckCommand.decode(buf[:COMMAND_SIZE]), buf[COMMAND_SIZE:]
                self.commands.append(cmd)
                if not self.buffered.is_set() and self.buffered_packets == 0:
                    conn.sendall(PACKET)  # a live robot: one packet per command before the flood

    def flood(self) -> None:
        threading.Thread(target=self._flood, daemon=True).start()

    def _flood(self) -> None:
        assert self.conn is not None
        data = PACKET * BACKLOG
        self.buffered_packets = -1  # no more packets per command
        sent = 0
        try:
            while sent < len(data):
                try:  # as much as the kernel takes without a read on the gateway's side
                    sent += self.conn.send(data[sent:], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
        finally:
            self.buffered_packets = sent // len(PACKET)
            self.buffered.set()
        self.conn.sendall(data[sent:])


def test_a_stop_queued_behind_every_robots_backlog_goes_after_one_turn_of_each() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        robots = [FloodRobot() for _ in range(ROBOTS)]
        delivered = [0] * ROBOTS  # sensors packets the gateway has handed on, per robot
        at_stop: dict[int, int] = {}  # robot -> packets handed on when its stop was written
        errors: list[FramingError] = []
        stalled = False
        ctls = [EpuckController() for _ in robots]
        links: list[EpuckLink] = []

        def stop_all() -> None:  # what the gateway's stop pass does (shared/stop_pass.py), per robot
            for i, (link, ctl) in enumerate(zip(links, ctls, strict=True)):
                ctl.set_speed(0, 0)
                assert link.write_stop(lambda t: None) is not None
                at_stop[i] = delivered[i]

        def on_packets(i: int, packets: list[Packet]) -> None:
            nonlocal stalled
            delivered[i] += sum(isinstance(p, SensorsPacket) for p in packets)
            if stalled:  # the first packets after the stall: the stop comes meanwhile (from the MQTT thread)
                stalled = False
                loop.call_soon_threadsafe(stop_all)

        def handed_on(i: int, packets: list[Packet], ts: float) -> None:
            on_packets(i, packets)

        for i, (r, ctl) in enumerate(zip(robots, ctls, strict=True)):
            ctl.set_stream(image=False, sensors=True)
            links.append(EpuckLink(f"r{i}", EpuckLinkConfig("127.0.0.1", r.port, stale_timeout_s=5.0), ctl,
                                   functools.partial(handed_on, i), lambda c, s, m: None, errors.append))
        for link in links:
            link.start()
        deadline = time.monotonic() + 10
        while not all(link.connected and d > 0 for link, d in zip(links, delivered, strict=True)):
            assert time.monotonic() < deadline, [link.stats for link in links]
            await asyncio.sleep(0.01)
        for link, ctl in zip(links, ctls, strict=True):
            ctl.set_speed(300, 300)
            link.request_write()
        while not all(any(c.left == 300 for c in r.commands) for r in robots):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

        # The stall: the loop blocked while every robot streams its backlog into the gateway's socket.
        before = list(delivered)
        for r in robots:
            r.flood()
        for r in robots:
            assert r.buffered.wait(5)
        stalled = True

        while sum(delivered) < sum(before) + ROBOTS * BACKLOG:  # then everything is handled, nothing dropped
            assert time.monotonic() < deadline + 20, (delivered, errors)
            await asyncio.sleep(0.01)
        while not all(any(c.left == 0 and c.right == 0 and n > 0 for n, c in enumerate(r.commands)) for r in robots):
            assert time.monotonic() < deadline + 20
            await asyncio.sleep(0.01)
        assert not errors
        stale = {i: at_stop[i] - before[i] for i in range(ROBOTS)}
        buffered = [r.buffered_packets for r in robots]
        assert all(b > 2 * ONE_TURN for b in buffered), buffered  # each backlog was more than a turn's worth
        # the stop left after at most one turn of each robot's backlog, not after the whole of any
        assert all(n <= ONE_TURN for n in stale.values()), (stale, ONE_TURN, buffered)
        assert sum(link.backlog_turns for link in links) > 0
        for link in links:
            await link.close()

    asyncio.run(main())
