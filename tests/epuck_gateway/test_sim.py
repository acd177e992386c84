"""The simulator behaves like the robot's firmware as the reference describes it."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import pytest

from services.epuck_gateway.protocol.wifi import (
    EMPTY_ID,
    IMAGE_ID,
    SENSORS_ID,
    SET_CALIBRATE_IR,
    EmptyPacket,
    EpuckCommand,
    EpuckRawSensors,
    EpuckStreamParser,
    ImagePacket,
    ParserEvent,
    SensorsPacket,
)
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from services.epuck_gateway.sim.world import MM_PER_STEP, EpuckWorld
from tests.epuck_gateway.conftest import wait_until


@pytest.fixture
def sim() -> Iterator[EpuckSimThread]:
    s = EpuckSimThread(1, EpuckSimConfig(sensors_hz=100, image_fps=20)).start()
    yield s
    s.close()


def connect(sim: EpuckSimThread) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", sim.robots[0].port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_events(s: socket.socket, parser: EpuckStreamParser, n: int) -> list[ParserEvent]:
    out: list[ParserEvent] = []
    while len(out) < n:
        out += parser.feed(s.recv(65536))
    return out


def quiet(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return True
    finally:
        s.settimeout(5)


def test_silent_until_a_valid_first_command(sim: EpuckSimThread) -> None:
    s = connect(sim)
    assert quiet(s, 0.2)
    s.sendall(b"\x81" + bytes(20))  # not a command: ignored
    assert quiet(s, 0.2)
    s.sendall(EpuckCommand(request=0).encode())
    assert s.recv(1) == bytes([EMPTY_ID])  # nothing requested: 0x03 packets
    s.close()


def test_image_then_sensors_order_and_sizes(sim: EpuckSimThread) -> None:
    s = connect(sim)
    s.sendall(EpuckCommand(request=3).encode())
    events = read_events(s, EpuckStreamParser(), 8)
    assert isinstance(events[0], ImagePacket) and isinstance(events[1], SensorsPacket)
    assert all(isinstance(e, ImagePacket | SensorsPacket) for e in events)
    sensors = EpuckRawSensors.decode(next(e for e in events if isinstance(e, SensorsPacket)).data)
    assert sensors.selector == 15 and sensors.acc[2] == 768
    s.close()
    assert IMAGE_ID == 1 and SENSORS_ID == 2


def test_one_client_at_a_time(sim: EpuckSimThread) -> None:
    a = connect(sim)
    a.sendall(EpuckCommand(request=0).encode())
    assert a.recv(1) == b"\x03"
    b = connect(sim)  # lands in the listen(1) backlog
    b.sendall(EpuckCommand(request=0).encode())
    assert quiet(b, 0.3)
    a.close()
    assert b.recv(1) == b"\x03"  # served once the first client left
    b.close()


def test_flags_are_level_triggered_until_cleared(sim: EpuckSimThread) -> None:
    robot = sim.robots[0]
    s = connect(sim)
    s.sendall(EpuckCommand(request=2, settings=SET_CALIBRATE_IR, sound=0x01).encode())
    assert wait_until(lambda: robot.world.calibrations >= 5 and robot.world.sound_starts >= 5, 5)
    s.sendall(EpuckCommand(request=2).encode())
    assert wait_until(lambda: robot.command == EpuckCommand(request=2), 5)
    c, n = robot.world.calibrations, robot.world.sound_starts
    time.sleep(0.1)
    assert (robot.world.calibrations, robot.world.sound_starts) == (c, n)
    s.close()


def test_five_queued_commands_flush_the_older_ones(sim: EpuckSimThread) -> None:
    robot = sim.robots[0]
    s = connect(sim)
    s.sendall(EpuckCommand(request=0).encode())
    assert s.recv(1) == b"\x03"
    s.sendall(b"".join(EpuckCommand(request=0, left=i).encode() for i in range(1, 9)))
    assert wait_until(lambda: robot.command is not None and robot.command.left == 8, 5)
    assert robot.stats.flushed_commands >= 1
    s.close()


def test_motors_keep_running_after_the_client_leaves(sim: EpuckSimThread) -> None:
    robot = sim.robots[0]
    s = connect(sim)
    s.sendall(EpuckCommand(request=0, left=200, right=200).encode())
    assert wait_until(lambda: robot.world.speed_left == 200, 5)
    s.close()
    assert wait_until(lambda: not robot.connected, 5)
    assert robot.world.speed_left == 200  # no watchdog on the robot


def test_empty_packets_parse(sim: EpuckSimThread) -> None:
    s = connect(sim)
    s.sendall(EpuckCommand(request=0).encode())
    assert all(isinstance(e, EmptyPacket) for e in read_events(s, EpuckStreamParser(), 5))
    s.close()


# -- the world, without sockets ----------------------------------------------------------------------
def test_steps_follow_speeds_and_the_robot_moves() -> None:
    w = EpuckWorld(x=300, y=300, theta=0.0)
    w.apply(EpuckCommand(left=500, right=500))
    w.advance(1.0)
    assert round(w.steps_left) == 500 and round(w.steps_right) == 500
    assert w.x == pytest.approx(300 + 500 * MM_PER_STEP) and w.y == pytest.approx(300)
    w.apply(EpuckCommand(left=-300, right=300))
    w.advance(0.5)
    assert w.theta > 0.5  # turned left
    w.apply(EpuckCommand(left=5000, right=5000))
    assert w.speed_left == 1100  # the F407 clamps at MOTOR_SPEED_LIMIT


def test_proximity_sees_the_wall_and_calibration_zeroes_it() -> None:
    near = EpuckWorld(x=60, y=500, theta=math.pi)  # facing the west wall, 23 mm away
    far = EpuckWorld(x=500, y=200, theta=0.0)
    assert min(near.proximity()[0], near.proximity()[7]) > 300
    assert max(far.proximity()) < 100
    assert near.tof_mm() == 23 and far.tof_mm() > 400
    far.apply(EpuckCommand(settings=SET_CALIBRATE_IR))
    assert max(far.proximity()) == 0


def test_camera_follows_the_pose() -> None:
    a = EpuckWorld(x=300, y=300, theta=0.0).camera()
    b = EpuckWorld(x=300, y=300, theta=math.pi / 2).camera()
    c = EpuckWorld(x=800, y=300, theta=0.0).camera()
    assert len(a) == 38400 and a != b and a != c


def test_step_counters_wrap_like_int16() -> None:
    w = EpuckWorld()
    w.steps_left = 33000.0
    assert w.sensors().steps[0] == 33000 - 65536
