"""The three WiFi link defects, each against a simulated robot set to the same behaviour.

- slow images (1 fps with sensors riding on each image, as the firmware's cycle does) must not flap
  the link, yet a robot that sends nothing at all is found within the allowed silence;
- a one-shot (sound) followed at once by a burst of commands is never lost: commands coalesce and go
  at most once per robot cycle, so the firmware's queue never reaches its flush at 5;
- health says connected-but-silent until data arrives, and a hung robot does not toggle.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import pytest

from services.epuck_gateway.protocol.wifi import LED_BITS, SOUND_MARIO, EpuckController
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from services.epuck_gateway.transport.wifi import EpuckLink, EpuckLinkConfig

States = list[tuple[float, bool, str, str]]


def make_link(port: int, ctl: EpuckController, states: States) -> EpuckLink:
    cfg = EpuckLinkConfig("127.0.0.1", port, connect_timeout_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3)
    return EpuckLink("r1", cfg, ctl, lambda p, t: None,
                     lambda c, s, m: states.append((time.monotonic(), c, s, m)), lambda e: None)


async def wait_for(pred: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.01)
    return bool(pred())  # type: ignore[operator]


@pytest.fixture
def slow_robot() -> Iterator[EpuckSimThread]:
    """One image a second, the sensors packet following each image (the firmware's cycle)."""
    s = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=1, image_holds_cycle=True)).start()
    yield s
    s.close()


@pytest.fixture
def fast_robot() -> Iterator[EpuckSimThread]:
    s = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    yield s
    s.close()


def test_slow_images_do_not_flap_and_a_dead_robot_is_found(slow_robot: EpuckSimThread) -> None:
    robot = slow_robot.robots[0]

    async def main() -> None:
        states: States = []
        link = make_link(robot.port, EpuckController(), states)  # image + sensors requested
        link.start()
        assert await wait_for(lambda: link.stats.images >= 2)
        t0 = time.monotonic()
        await asyncio.sleep(6.0)  # the issue saw 8 link_lost in 8 s here
        assert link.stats.images >= 4 and link.stats.sensors >= 4
        assert link.stats.sensors <= link.stats.images + 1  # the sensors packet rides on the image
        assert [s for s in states if s[0] > t0] == [] and link.stats.silences == 0
        assert link.stats.reconnects == 0 and robot.stats.connections == 1
        # the robot dies without a FIN: nothing at all arrives
        allowed = link.liveness.allowed_silence()
        assert allowed <= link.config.stale_timeout_s + 1.0 + 0.5  # follows the 1 s image interval
        robot.silent = True
        assert await wait_for(lambda: any(s[2] == "silent" for s in states), allowed + 5.0)
        found = next(s for s in states if s[2] == "silent")
        # detected at the allowed silence after the last byte (generous slack for a busy machine)
        assert found[0] - link.last_rx == pytest.approx(allowed, abs=0.5)
        assert found[1] is True and "no valid data" in found[3]
        assert f"allowed {link.sup.details()['liveness_s']:.1f} s" in found[3]
        robot.silent = False
        assert await wait_for(lambda: states[-1][2] == "streaming", 10)
        assert link.stats.reconnects == 0  # a silence is not a reason to reconnect
        await link.close()

    asyncio.run(main())


def test_a_dead_sensors_stream_is_found_within_the_stale_timeout(fast_robot: EpuckSimThread) -> None:
    robot = fast_robot.robots[0]

    async def main() -> None:
        states: States = []
        ctl = EpuckController()
        ctl.set_stream(image=False, sensors=True)
        link = make_link(robot.port, ctl, states)
        link.start()
        assert await wait_for(lambda: link.stats.sensors >= 10)
        assert link.liveness.allowed_silence() == link.config.stale_timeout_s
        robot.silent = True
        assert await wait_for(lambda: any(s[2] == "silent" for s in states), 5.0)
        found = next(s for s in states if s[2] == "silent")
        assert found[0] - link.last_rx == pytest.approx(link.config.stale_timeout_s, abs=0.5)
        robot.silent = False
        await link.close()

    asyncio.run(main())


@pytest.mark.parametrize("image_fps", [10.0, 1.0], ids=["fast", "one-image-a-second"])
def test_a_sound_is_not_lost_in_a_burst_of_commands(image_fps: float) -> None:
    sim = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=image_fps, image_holds_cycle=True)).start()
    robot = sim.robots[0]

    async def main() -> None:
        states: States = []
        ctl = EpuckController()
        link = make_link(robot.port, ctl, states)
        link.start()
        assert await wait_for(lambda: link.stats.sensors >= 2)
        received_before = robot.stats.commands
        cycles_before = robot.stats.cycles
        # cmd/sound then, within 15 ms, six cmd/leds (each a different LED pattern)
        ctl.play(SOUND_MARIO)
        link.request_write()
        names = list(LED_BITS)
        for i in range(6):
            ctl.set_leds(**{names[i]: True})
            link.request_write()
            await asyncio.sleep(0.002)
        want_leds = sum(LED_BITS.values())
        assert await wait_for(lambda: robot.world.leds == want_leds and SOUND_MARIO in robot.world.melodies, 10)
        assert robot.world.melodies.count(SOUND_MARIO) == 1
        assert await wait_for(lambda: robot.command is not None and robot.command.sound == 0, 10)  # cleared
        written = robot.stats.commands - received_before
        cycles = robot.stats.cycles - cycles_before
        assert link.stats.commands_requested >= 7
        assert written <= cycles + 1  # at most one write per robot cycle
        assert written < 7  # coalesced
        assert robot.stats.flushed_commands == 0 and robot.stats.max_queued <= 2
        await link.close()

    try:
        asyncio.run(main())
    finally:
        sim.close()


def test_health_is_connected_but_silent_until_data_and_a_hung_robot_does_not_toggle(
        fast_robot: EpuckSimThread) -> None:
    robot = fast_robot.robots[0]
    robot.hung = True  # takes the connection, never sends a byte (no FIN)

    async def main() -> None:
        states: States = []
        link = make_link(robot.port, EpuckController(), states)
        link.start()
        assert await wait_for(lambda: any(s[2] == "connected" for s in states))
        first = next(s for s in states if s[2] == "connected")
        assert first[1] is True and "no valid data" in first[3]
        await asyncio.sleep(3.0)  # the issue saw streaming <-> disconnected every ~1.2 s
        kinds = [s[2] for s in states]
        assert "streaming" not in kinds and "lost" not in kinds, kinds
        assert kinds.count("connected") == 1 and kinds.count("unreachable") <= 1
        assert robot.stats.connections == 1 and link.stats.reconnects == 0
        robot.hung = False
        assert await wait_for(lambda: states[-1][2] == "streaming", 10)
        await link.close()

    asyncio.run(main())


def test_a_robot_hanging_right_after_connect_is_silent_within_the_allowance_its_images_set(
        fast_robot: EpuckSimThread) -> None:
    """The no-image-yet allowance (stale + the 6 s cap) set at connect must not be the one judged once images
    come: a robot hanging 1 s after connect at 10 fps was `silent` only 5.8 s later, its message saying
    "allowed 1.0 s". The allowance follows the images seen, and the message says the one applied."""
    robot = fast_robot.robots[0]

    async def main() -> None:
        states: States = []
        link = make_link(robot.port, EpuckController(), states)  # image + sensors requested
        link.start()
        assert await wait_for(lambda: link.connected)
        connected_at = time.monotonic()
        assert await wait_for(lambda: link.stats.images >= 3)
        await asyncio.sleep(max(0.0, connected_at + 1.0 - time.monotonic()))
        robot.silent = True  # hangs: the connection stays, nothing comes
        hung_at = time.monotonic()
        assert await wait_for(lambda: any(s[2] == "silent" for s in states), 10.0)
        found = next(s for s in states if s[2] == "silent")
        m = re.search(r"for ([\d.]+) s \(allowed ([\d.]+) s", found[3])
        assert m is not None, found[3]
        silence, allowed = float(m.group(1)), float(m.group(2))
        assert allowed < 2.0, "10 fps images: the allowance is stale + ~0.1 s, not the 6 s cap"
        # the silence judged is the allowance stated (a busy machine may add to it, not multiply it)
        assert silence == pytest.approx(allowed, abs=0.3), found[3]
        assert found[0] - hung_at < allowed + 1.0, f"silent {found[0] - hung_at:.1f} s after the hang: {found[3]}"
        robot.silent = False
        assert await wait_for(lambda: states[-1][2] == "streaming", 10)
        await link.close()

    asyncio.run(main())


@pytest.fixture
def half_fps_robot() -> Iterator[EpuckSimThread]:
    """One image every 2 s, the sensors packet following it: one robot cycle (one command taken) per 2 s; the
    radio module re-applies the command it took to the F407 at 50 Hz meanwhile."""
    s = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=0.5, image_holds_cycle=True, uart_hz=50)).start()
    yield s
    s.close()


def test_at_half_an_image_a_second_the_deadmans_stop_is_taken_at_the_next_cycle(
        half_fps_robot: EpuckSimThread) -> None:
    """Two LED changes in the image period fill the link's limit of untaken commands: the deadman's stop
    (`request_write(urgent=True)`) must not wait behind them (it did: taken two or three cycles later, 4-6 s), and
    must not leave them to be taken first either: the robot takes it at its next cycle, with every LED set."""
    robot = half_fps_robot.robots[0]

    async def main() -> None:
        states: States = []
        ctl = EpuckController()
        link = make_link(robot.port, ctl, states)
        link.start()
        assert await wait_for(lambda: link.stats.sensors >= 1, 10)
        ctl.set_speed(200, 200)
        link.request_write()
        assert await wait_for(lambda: robot.world.speed_left == 200, 10)
        written = robot.stats.commands
        for name in ("led1", "led3"):
            ctl.set_leds(**{name: True})
            link.request_write()
        assert await wait_for(lambda: robot.stats.commands >= written + 2, 2)  # both written: the limit is full
        told: list[float | None] = []
        cycles = robot.stats.cycles
        ctl.set_speed(0, 0)
        assert link.request_write(told.append, urgent=True)
        assert told and told[0] is not None  # written at once
        assert await wait_for(lambda: robot.world.speed_left == 0, 10)
        assert robot.stats.cycles <= cycles + 1, (robot.stats.cycles, cycles)  # the next cycle took it
        assert robot.world.leds == LED_BITS["led1"] | LED_BITS["led3"]  # the stop carries the whole state
        await link.close()

    asyncio.run(main())


def test_at_half_an_image_a_second_a_newer_speed_replaces_the_untaken_ones(half_fps_robot: EpuckSimThread) -> None:
    """A teleop stream (a new speed every 250 ms for 3 s) to a robot that takes one command per 2 s: each cycle
    takes the newest speed, never one an older write queued, and the last one is taken at the first cycle after
    it was written (it waited two cycles behind older speeds)."""
    robot = half_fps_robot.robots[0]

    async def main() -> None:
        states: States = []
        ctl = EpuckController()
        link = make_link(robot.port, ctl, states)
        link.start()
        assert await wait_for(lambda: link.stats.sensors >= 1, 10)
        values = [100 + 20 * i for i in range(12)]
        written_at: dict[int, float] = {}
        seen: list[tuple[int, float]] = []  # speed the robot drives at, from when

        async def watch() -> None:
            while True:
                if not seen or seen[-1][0] != robot.world.speed_left:
                    seen.append((robot.world.speed_left, time.monotonic()))
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        for v in values:
            ctl.set_speed(v, v)
            written_at[v] = time.monotonic()
            link.request_write()
            await asyncio.sleep(0.25)
        cycles = robot.stats.cycles
        assert await wait_for(lambda: robot.world.speed_left == values[-1], 10)
        assert robot.stats.cycles <= cycles + 1, (robot.stats.cycles, cycles)
        watcher.cancel()
        # every speed the robot took was the newest written before it took it
        for v, t in seen:
            if v in written_at:
                newer = [w for w in values if written_at[w] > written_at[v] and written_at[w] < t - 0.05]
                assert not newer, (v, newer, seen)
        await link.close()

    asyncio.run(main())


def test_at_half_an_image_a_second_a_one_shot_is_applied_by_one_short_cycle(half_fps_robot: EpuckSimThread) -> None:
    """Sound and IR calibration are level-triggered on the robot: the radio module re-sends the last command it
    took at every exchange with the F407 (50 Hz here) until it takes the next, once per cycle of its own, and a
    cycle with the image lasts the image period. With the image in the one-shot's command a melody restarted ~100
    times; without it the cycle that applies it is short and the clear is taken right after."""
    robot = half_fps_robot.robots[0]

    async def main() -> None:
        states: States = []
        images: list[object] = []
        ctl = EpuckController()
        link = make_link(robot.port, ctl, states)
        link._on_packets = lambda p, t: images.extend(x for x in p if type(x).__name__ == "ImagePacket")
        link.start()
        assert await wait_for(lambda: len(images) >= 1, 10)
        ctl.play(SOUND_MARIO)
        ctl.calibrate_ir()
        link.request_write()
        assert await wait_for(lambda: robot.world.sound_starts >= 1 and robot.world.calibrations >= 1, 10)
        assert await wait_for(lambda: robot.command is not None and robot.command.sound == 0, 5)  # cleared
        n = len(images)
        assert await wait_for(lambda: len(images) >= n + 2, 10)  # the stream goes on, two image periods later
        # Each robot cycle (50 Hz) that still holds the one-shot restarts it: the fix takes a round trip (a few
        # cycles quiet, more on a loaded host); the defect took an image period, ~100 cycles. A quarter of that
        # tells them apart on any host.
        assert robot.world.sound_starts <= 25 and robot.world.calibrations <= 25, robot.world
        assert robot.world.melodies.count(SOUND_MARIO) == 1
        await link.close()

    asyncio.run(main())
