"""The asercom v2 serial link against the pty simulator: polling, coalesced actuators, garbage, a
device that goes away (USB unplug) and comes back, a robot that stops answering."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.epuck_gateway.port_lock import PortBusy, hold_port
from services.epuck_gateway.protocol.wifi import SOUND_MARIO, EpuckController, EpuckRawSensors, Packet, SensorsPacket
from services.epuck_gateway.sim.serial import EpuckSerialSimConfig, EpuckSerialSimThread
from services.epuck_gateway.transport.serial import EpuckSerialConfig, EpuckSerialLink

States = list[tuple[float, bool, str, str]]


@pytest.fixture
def serial_sim(tmp_path: Path) -> Iterator[EpuckSerialSimThread]:
    s = EpuckSerialSimThread(1, str(tmp_path / "ttyEPUCK")).start()
    yield s
    s.close()


def make_link(port: str, ctl: EpuckController, states: States, packets: list[Packet],
              poll_hz: float = 50.0) -> EpuckSerialLink:
    cfg = EpuckSerialConfig(port, poll_hz=poll_hz, reopen_min_s=0.05, reopen_max_s=0.3)
    return EpuckSerialLink("s1", cfg, ctl, lambda p, t: packets.extend(p),
                           lambda c, s, m: states.append((time.monotonic(), c, s, m)), lambda e: None)


async def wait_for(pred: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.01)
    return bool(pred())  # type: ignore[operator]


def test_polls_sensors_and_writes_actuators_coalesced(serial_sim: EpuckSerialSimThread) -> None:
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 5)
        kinds = [s[2] for s in states]
        assert kinds[:3] == ["connecting", "connected", "streaming"], kinds
        s = EpuckRawSensors.decode(packets[-1].data)  # type: ignore[union-attr]
        assert isinstance(packets[-1], SensorsPacket) and s.selector == 8 and s.battery == 3400
        assert link.stats.garbage_bytes == 0  # the welcome banner was flushed at open
        # a sound then six LED changes at once: one -0x09 carries them all, the sound plays once
        before = robot.stats.actuator_commands
        ctl.play(SOUND_MARIO)
        link.request_write()
        for bit in range(6):
            ctl.leds |= 1 << bit
            link.request_write()
        assert await wait_for(lambda: robot.world.leds == 0x3F and SOUND_MARIO in robot.world.melodies)
        assert robot.stats.actuator_commands - before <= 2 and robot.world.melodies.count(SOUND_MARIO) == 1
        ctl.set_speed(300, -300)
        link.request_write()
        assert await wait_for(lambda: (robot.world.speed_left, robot.world.speed_right) == (300, -300))
        assert await wait_for(lambda: link.stats.sensors >= 20)
        await link.close()
        # stopped at close: speeds 0, stop sound
        assert await wait_for(lambda: robot.received[-1].sound == 0x20 and robot.received[-1].left == 0)
        assert (robot.world.speed_left, robot.world.speed_right) == (0, 0)

    asyncio.run(main())


def test_garbage_on_the_line_is_counted_and_the_link_recovers(serial_sim: EpuckSerialSimThread) -> None:
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        for _ in range(5):  # unasked bytes (a banner after a robot reset, line noise)
            serial_sim.call(lambda: robot._send(os.urandom(57)))
            await asyncio.sleep(0.05)
        assert await wait_for(lambda: link.stats.garbage_bytes > 0 or link.stats.reply_timeouts > 0)
        n = len(packets)
        assert await wait_for(lambda: len(packets) >= n + 10)  # polling goes on with good replies
        for p in packets[n + 5:]:
            s = EpuckRawSensors.decode(p.data)  # type: ignore[union-attr]
            assert s.selector == 8 and s.battery == 3400  # no reply was mixed with garbage
        assert link.connected and link.stats.reconnects == 0
        await link.close()

    asyncio.run(main())


def test_a_late_reply_is_never_taken_for_the_next_one(serial_sim: EpuckSerialSimThread) -> None:
    """asercom has no sequence numbers: after a timeout the link waits the late reply out."""
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        stamps: list[tuple[float, float]] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link._on_packets = lambda p, t: stamps.extend((time.time() % 1000.0, EpuckRawSensors.decode(x.data).mag[0])
                                                      for x in p if isinstance(x, SensorsPacket))
        robot.config.stamp = True
        link.start()
        assert await wait_for(lambda: len(stamps) >= 3)
        robot.late_replies = 3  # three replies come 0.6 s late (the reply timeout is ~0.25 s)
        assert await wait_for(lambda: link.stats.reply_timeouts >= 3 and robot.late_replies == 0)
        n = len(stamps)
        assert await wait_for(lambda: len(stamps) >= n + 20)
        ages = [(now - sent) % 1000.0 for now, sent in stamps[n:]]
        assert max(ages) < 0.3, ages  # every reply taken after the stall is fresh, none a late one
        assert link.stats.garbage_bytes >= 3 * 104
        await link.close()

    asyncio.run(main())


def test_device_unplugged_and_plugged_back(serial_sim: EpuckSerialSimThread) -> None:
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        serial_sim.call(robot.unplug)
        assert await wait_for(lambda: any(s[2] == "lost" for s in states))
        assert await wait_for(lambda: any("cannot open" in s[3] for s in states))  # the path is gone
        assert not link.connected
        serial_sim.call(robot.plug)
        n = len(packets)
        assert await wait_for(lambda: len(packets) >= n + 3 and link.connected)
        assert states[-1][2] == "streaming" and link.stats.reconnects == 1
        ctl.set_speed(100, 100)
        link.request_write()
        assert await wait_for(lambda: robot.world.speed_left == 100)
        await link.close()

    asyncio.run(main())


def test_a_robot_that_stops_answering_is_silent_and_comes_back(serial_sim: EpuckSerialSimThread) -> None:
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        robot.hung = True
        assert await wait_for(lambda: states[-1][2] == "silent")
        assert states[-1][1] is True and "no valid data" in states[-1][3]
        await asyncio.sleep(1.5)
        assert states[-1][2] == "silent" and link.stats.reconnects == 0  # no toggling
        robot.hung = False
        assert await wait_for(lambda: states[-1][2] == "streaming")
        await link.close()

    asyncio.run(main())


def test_a_robot_left_in_the_middle_of_a_line_is_resynchronised(serial_sim: EpuckSerialSimThread) -> None:
    """A flasher that took no lock wrote GDB packets into the robot's asercom port: the F407 takes the
    first byte for the start of an ASCII line and swallows every later chain waiting for its end. The
    link must bring it back in step (`RESYNC`) without an unplug, and restore the actuator state."""
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        ctl.set_speed(100, 100)
        link.request_write()
        assert await wait_for(lambda: robot.world.speed_left == 100)
        serial_sim.call(lambda: robot.inject_input(b"+$qSupported:multiprocess+;swbreak+;hwbreak+#c9"))
        assert serial_sim.call(lambda: robot.in_line)
        commands_before = len(robot.received)
        n = len(packets)
        assert await wait_for(lambda: link.stats.resyncs >= 1 and len(packets) >= n + 10, 15), link.stats
        assert not serial_sim.call(lambda: robot.in_line)
        assert link.connected and link.stats.reconnects == 0 and states[-1][2] == "streaming"
        # the stuck line was ended and answered (garbage, flushed); the whole state went again after it
        assert any(line.startswith("+$qSupported") for _t, line in robot.lines)
        assert len(robot.received) > commands_before and robot.received[-1].left == 100
        for p in packets[n:]:
            s = EpuckRawSensors.decode(p.data)  # type: ignore[union-attr]
            assert s.selector == 8 and s.battery == 3400  # no reply mixed with the robot's answers to the line
        await link.close()

    asyncio.run(main())


def test_the_port_is_held_by_one_process_at_a_time(serial_sim: EpuckSerialSimThread) -> None:
    """The gateway's link and a flasher (port_lock.hold_port) refuse a port the other holds."""
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        link = make_link(robot.link, EpuckController(), states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        with pytest.raises(PortBusy) as busy, hold_port(robot.link):
            pass
        assert f"pid {os.getpid()}" in str(busy.value)  # the holder is named
        await link.close()
        with hold_port(robot.link):  # free once the link has closed it
            states2: States = []
            link2 = make_link(robot.link, EpuckController(), states2, [])
            link2.start()
            assert await wait_for(lambda: any(s[2] == "unreachable" for s in states2))  # never opened
            down = next(s for s in states2 if s[2] == "unreachable")
            assert "cannot open" in down[3] and f"held by pid {os.getpid()}" in down[3], down
            assert not link2.connected
        assert await wait_for(lambda: link2.connected and states2[-1][2] == "streaming")  # reopened once free
        await link2.close()

    asyncio.run(main())


def test_a_write_that_fails_tells_its_listener_the_state_was_never_written(serial_sim: EpuckSerialSimThread) -> None:
    # The deadman waits to hear when its stop left (`request_write(on_written)`): a chain whose write fails (the port
    # went away under it) must tell it None (never written), as a link that goes down before the write does; the
    # link then reopens the port. A listener that raises is logged, and the link carries on.
    robot = serial_sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        told: list[float | None] = []

        def refuse(data: bytes) -> int:
            raise OSError(5, "Input/output error")

        assert link._serial is not None
        link._serial.write = refuse  # type: ignore[method-assign]
        ctl.set_speed(0, 0)
        assert link.request_write(told.append)
        assert await wait_for(lambda: told == [None]), told
        # reopened: the next listener hears the time its chain left, and one that raises does not stop the poller
        assert await wait_for(lambda: link.connected and link.stats.connects >= 2)

        def broken(ts: float | None) -> None:
            raise RuntimeError("a listener's own bug")

        ctl.set_speed(100, 100)
        assert link.request_write(broken) and link.request_write(told.append)
        assert await wait_for(lambda: len(told) == 2 and told[1] is not None), told
        assert await wait_for(lambda: (robot.world.speed_left, robot.world.speed_right) == (100, 100))
        before = link.stats.sensors
        assert await wait_for(lambda: link.stats.sensors >= before + 5)
        await link.close()

    asyncio.run(main())


def test_a_chain_cut_inside_its_arguments_is_ended_harmlessly_and_the_state_written_again(tmp_path: Path) -> None:
    """`f7 00 00` in the robot's input (a chain cut inside -0x09's arguments, a Bluetooth glitch): the F407 holds
    the partial argument list and takes the gateway's next bytes as the rest (its polls: a speed of -2048 from a
    poll's 0xF8). The link sees no reply, and must end that argument list harmlessly, get the robot's `c,N`
    answer before it polls again, and write the whole actuator state again: the robot ends with the gateway's
    state (speeds 0, its LEDs), not with speeds made of poll bytes and its LEDs off."""
    sim = EpuckSerialSimThread(1, str(tmp_path / "ttyBT"), EpuckSerialSimConfig(line_baud=115200)).start()
    robot = sim.robots[0]

    async def main() -> None:
        states: States = []
        packets: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.link, ctl, states, packets)
        link.start()
        assert await wait_for(lambda: len(packets) >= 3)
        ctl.leds = 0x3F
        ctl.set_rgb([(10, 20, 30), None, None, None])
        link.request_write()
        assert await wait_for(lambda: robot.world.leds == 0x3F)
        resyncs = link.stats.resyncs
        before = len(robot.received)
        sim.call(lambda: robot.inject_input(bytes([0xF7, 0x00, 0x00])))
        assert await wait_for(lambda: link.stats.resyncs > resyncs, 10), link.stats
        n = len(packets)
        assert await wait_for(lambda: len(packets) >= n + 10, 10), link.stats
        assert sim.call(lambda: robot.pending_args) == 0
        world = robot.world
        assert (world.speed_left, world.speed_right, world.leds) == (0, 0, 0x3F), (world, robot.received[-4:])
        assert world.rgb[0] == (10, 20, 30)
        # nothing the robot applied after the cut stayed: the command made of poll bytes was followed at once
        # (same write) by the state
        received, at = list(robot.received)[before:], list(robot.received_at)[before:]
        assert received, "the cut command was never completed"
        for i, cmd in enumerate(received[:-1]):
            if (cmd.left, cmd.right, cmd.leds) != (0, 0, 0x3F):
                assert at[i + 1] - at[i] < 0.05, (cmd, received[i + 1], at[i + 1] - at[i])
        for p in packets[n:]:
            s = EpuckRawSensors.decode(p.data)  # type: ignore[union-attr]
            assert s.selector == 8 and s.battery == 3400
        assert link.connected and link.stats.reconnects == 0
        await link.close()

    try:
        asyncio.run(main())
    finally:
        sim.close()


def test_never_more_than_one_poll_outstanding_when_a_robot_stalls_before_an_image(tmp_path: Path) -> None:
    """A robot busy for 2.5 s before it answers a chain with the camera image (Bluetooth pace, 115200 baud): the
    link must not write another poll until that chain's reply and a resynchronisation's answer are in (polls
    written meanwhile would be answered by the image's bytes, 104 at a time, and pile up in the robot: 16 went out
    during one image reply). The robot never holds more than one chain owing a reply; the link repeats its
    resynchronisation, backing off, until answered, and streams fresh data again."""
    sim = EpuckSerialSimThread(1, str(tmp_path / "ttyBT"), EpuckSerialSimConfig(line_baud=115200)).start()
    robot = sim.robots[0]

    async def main() -> None:
        states: States = []
        stamps: list[tuple[float, float]] = []
        images: list[Packet] = []
        ctl = EpuckController()
        ctl.set_stream(image=True, sensors=True)
        cfg = EpuckSerialConfig(robot.link, baud=115200, image_fps=2.0, reopen_min_s=0.05, reopen_max_s=0.3)

        def got(p: list[Packet], t: float) -> None:
            stamps.extend((time.time() % 1000.0, EpuckRawSensors.decode(x.data).mag[0])
                          for x in p if isinstance(x, SensorsPacket))
            images.extend(x for x in p if not isinstance(x, SensorsPacket))

        link = EpuckSerialLink("s1", cfg, ctl, got, lambda c, s, m: states.append((time.monotonic(), c, s, m)),
                               lambda e: None)
        robot.config.stamp = True
        link.start()
        assert await wait_for(lambda: len(images) >= 1 and len(stamps) >= 3)
        sim.call(lambda: robot.stall_next_image(2.5))
        assert await wait_for(lambda: link.stats.resyncs_unanswered >= 2, 10), link.stats
        assert link.resync_since is not None and link.resync_unanswered >= 2  # what the health's details show
        n, k = len(stamps), len(images)
        assert await wait_for(lambda: len(stamps) >= n + 20 and len(images) >= k + 2, 15), link.stats
        assert link.resync_since is None
        assert robot.stats.max_unanswered <= 1, robot.stats
        ages = [(now - sent) % 1000.0 for now, sent in stamps[n:]]
        assert max(ages) < 0.5, ages  # no reply taken after the stall is an old one
        assert link.connected and link.stats.reconnects == 0
        await link.close()

    try:
        asyncio.run(main())
    finally:
        sim.close()
