"""EpuckLink against hand-written robots (no broker): robots that differ from the simulator."""

from __future__ import annotations

import asyncio
import contextlib

from services.epuck_gateway.protocol import (
    COMMAND_SIZE,
    EpuckCommand,
    EpuckController,
    FramingError,
    Packet,
    SensorsPacket,
    stop_command,
)
from services.epuck_gateway.transport import EpuckLink, EpuckLinkConfig


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
        assert await wait_for(lambda: any(s == "silent" for _, s, _ in states))
        await asyncio.sleep(1.0)
        assert len(conns) == 1 and link.connected
        assert [s for _, s, _ in states] == ["connecting", "connected", "silent"]
        assert all(c for c, s, _ in states if s != "connecting")
        await link.close()
        server.close()

    asyncio.run(main())


def test_stream_split_anywhere_and_framing_error_resets() -> None:
    """Packets split at odd places decode; a bad id resets the link, which then reconnects."""

    async def main() -> None:
        sessions: list[list[bytes]] = []
        payload = bytes(range(104))

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
