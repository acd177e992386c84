"""EpuckLink against hand-written robots (no broker): robots that differ from the simulator."""

from __future__ import annotations

import asyncio
import contextlib
import os

from services.epuck_gateway.protocol.wifi import (
    COMMAND_SIZE,
    EpuckCommand,
    EpuckController,
    EpuckRawSensors,
    FramingError,
    Packet,
    SensorsPacket,
    stop_command,
)
from services.epuck_gateway.transport.wifi import EpuckLink, EpuckLinkConfig


def make_link(port: int, ctl: EpuckController, states: list[tuple[bool, str, str]],
              packets: list[Packet] | None = None, errors: list[FramingError] | None = None,
              stale: float = 0.4) -> EpuckLink:
    return EpuckLink("r1", EpuckLinkConfig("127.0.0.1", port, connect_timeout_s=1.0, reconnect_min_s=0.05,
                                           reconnect_max_s=0.2, stale_timeout_s=stale, stop_drain_s=0.5),
                     ctl, lambda p, t: (packets if packets is not None else []).extend(p),
                     lambda c, s, m: states.append((c, s, m)),
                     lambda e: (errors if errors is not None else []).append(e))


async def wait_for(pred: object, timeout: float = 5.0) -> bool:
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        if pred():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.01)
    return bool(pred())  # type: ignore[operator]


def test_ack_only_robot_keeps_the_link_alive_and_gets_a_stop() -> None:
    """A robot that only answers each command with 0x03 (no streaming): the link probes it."""

    async def main() -> None:
        received: list[bytes] = []

        async def robot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    received.append(await reader.readexactly(COMMAND_SIZE))
                    writer.write(b"\x03")

        server = await asyncio.start_server(robot, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=False)
        states: list[tuple[bool, str, str]] = []
        link = make_link(port, ctl, states)
        link.start()
        assert await wait_for(lambda: link.connected)
        await asyncio.sleep(1.5)  # several stale periods
        assert link.connected and link.stats.reconnects == 0
        assert len(received) >= 3  # the probes
        await link.close()
        assert EpuckCommand.decode(received[-1]) == stop_command()
        assert not any(s[0] is False and s[1] == "disconnected" for s in states)
        server.close()

    asyncio.run(main())


def test_robot_that_accepts_but_never_talks_stays_connected_and_silent() -> None:
    """A robot busy with another client leaves us in its accept backlog: keep our place, say silent.

    Reconnecting would only make the health toggle and lose the place in the robot's backlog."""

    async def main() -> None:
        conns: list[asyncio.StreamWriter] = []

        async def robot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conns.append(writer)
            with contextlib.suppress(ConnectionError):
                await reader.read()  # never answers

        server = await asyncio.start_server(robot, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        states: list[tuple[bool, str, str]] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)  # with an image asked for, the first may take seconds
        link = make_link(port, ctl, states, stale=0.3)
        link.start()
        assert await wait_for(lambda: any(s == "unreachable" for _, s, _ in states))
        await asyncio.sleep(1.0)
        assert len(conns) == 1 and link.connected
        # never sent valid data: unreachable (the kit's table), with the link kept open
        assert [s for _, s, _ in states] == ["connecting", "connected", "unreachable"]
        assert all(c for c, s, _ in states if s != "connecting")
        await link.close()
        server.close()

    asyncio.run(main())


def test_stream_split_anywhere_and_framing_error_resets() -> None:
    """Packets split at odd places decode; a bad id resets the link, which then reconnects."""

    async def main() -> None:
        sessions: list[list[bytes]] = []
        payload = EpuckRawSensors(tof=77, selector=15, proximity=tuple(range(8))).encode()  # a plausible one

        async def robot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got: list[bytes] = []
            sessions.append(got)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                got.append(await reader.readexactly(COMMAND_SIZE))
                if len(sessions) == 1:
                    pkt = b"\x02" + payload
                    for i in range(0, len(pkt) * 3, 7):  # three packets in 7-byte pieces
                        writer.write((pkt * 3)[i:i + 7])
                        await writer.drain()
                    writer.write(b"\x03\x42")  # then garbage
                while True:
                    got.append(await reader.readexactly(COMMAND_SIZE))

        server = await asyncio.start_server(robot, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        packets: list[Packet] = []
        errors: list[FramingError] = []
        link = make_link(port, EpuckController(), [], packets, errors, stale=5.0)
        link.start()
        assert await wait_for(lambda: len(sessions) >= 2 and link.connected)
        assert [p for p in packets if isinstance(p, SensorsPacket)] == [SensorsPacket(payload)] * 3
        assert len(errors) == 1 and errors[0].bad_id == 0x42 and link.stats.framing_errors == 1
        assert EpuckCommand.decode(sessions[0][-1]) == stop_command()  # stopped before the reset
        first = EpuckCommand.decode(sessions[1][0])
        assert first.request == 3 and (first.left, first.right) == (0, 0)
        await link.close()
        server.close()

    asyncio.run(main())


def test_garbage_with_packet_ids_is_not_a_live_robot_and_is_counted() -> None:
    """A peer sending bytes that parse (ids 0x01/0x02/0x03) but no robot sends: a sensors packet out of the
    firmware's ranges, then random bytes, is never `streaming`; each is counted as garbage and resets the link."""

    async def main() -> None:
        sessions = 0

        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sessions
            sessions += 1
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await reader.readexactly(COMMAND_SIZE)
                if sessions % 2:
                    writer.write(b"\x03\x03\x02" + bytes(range(104)) + b"\x02" + bytes(range(104)))
                for _ in range(100):
                    writer.write(os.urandom(64))
                    await writer.drain()
                    await asyncio.sleep(0.02)

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        states: list[tuple[bool, str, str]] = []
        packets: list[Packet] = []
        link = EpuckLink("r1", EpuckLinkConfig("127.0.0.1", port, connect_timeout_s=1.0, reconnect_min_s=0.05,
                                               reconnect_max_s=0.1, probe_period_s=0.2, stale_timeout_s=0.4),
                         EpuckController(), lambda p, t: packets.extend(p), lambda c, s, m: states.append((c, s, m)),
                         lambda e: None)
        link.start()
        assert await wait_for(lambda: sessions >= 4 and any(s == "unreachable" for _, s, _ in states), 20), states
        await link.close()
        server.close()
        kinds = [s for _, s, _ in states]
        assert "streaming" not in kinds and not packets, kinds
        d = link.sup.details()
        assert d["garbage"] >= 2 and link.stats.garbage_bytes >= 105 and link.stats.framing_errors >= 2, d
        assert "unreachable" in kinds, kinds

    asyncio.run(main())


def test_a_connect_timeout_says_what_timed_out() -> None:
    """A robot that never answers the TCP connect (a SYN lost on the way): the failure's reason names the connect
    timeout and its length (it read `cannot connect to host:port: ` with nothing after it: a TimeoutError's text
    is empty)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def no_answer(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        loop.create_connection = no_answer  # type: ignore[method-assign,assignment]
        states: list[tuple[bool, str, str]] = []
        link = EpuckLink("r1", EpuckLinkConfig("127.0.0.1", 9, connect_timeout_s=0.2, reconnect_min_s=0.05,
                                               reconnect_max_s=0.1, stale_timeout_s=0.4),
                         EpuckController(), lambda p, t: None, lambda c, s, m: states.append((c, s, m)),
                         lambda e: None)
        link.start()
        assert await wait_for(lambda: link.stats.connects == 0 and link.sup.details().get("last_failure"), 5)
        reason = link.sup.details()["last_failure"]
        assert reason == ("cannot connect to 127.0.0.1:9: no answer to the TCP connect within 0.2 s "
                          "(connect timeout)"), reason
        assert await wait_for(lambda: any(s == "unreachable" for _c, s, _m in states), 5)
        assert "connect timeout" in next(m for _c, s, m in states if s == "unreachable")
        await link.close()

    asyncio.run(main())
