"""The motion deadman against the simulators, end to end through the gateway process:

- a raw ASCII `D` over serial arms it and shows in the actuator state (a robot driven with `ascii` was
  never stopped, while the state said speed 0);
- at Bluetooth's 115200 baud with the default camera rate, the stop is not held behind an image;
- over WiFi with a slow image stream (one robot cycle per image, 2 s) the stop leaves at once, and
  `motion_timeout` is published when it has left, with that time;
- `flash` with no programmer configured is `unavailable` (a state of the installation).
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from services.epuck_gateway.sim.serial import EpuckSerialSimConfig, EpuckSerialSimRobot, EpuckSerialSimThread
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimRobot, EpuckSimThread
from services.epuck_gateway.transport.serial import default_image_fps
from shared.rpc import RpcClient
from tests.epuck_gateway.conftest import GATEWAY, BusRecorder, wait_until
from tests.fixtures import Broker

NODE = "epuck-deadman-gw"


def start_gateway(broker: Broker, spawn: Any, client: RpcClient, robots: list[dict[str, Any]],
                  timeout_ms: int) -> tuple[Any, BusRecorder]:
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{NODE}/#", bus.on)
    proc = spawn(GATEWAY, {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": NODE,
                           "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots), "ROBOBUS_HEALTH_INTERVAL_S": "1",
                           "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3",
                           "ROBOBUS_EPUCK_MOTION_TIMEOUT_MS": str(timeout_ms)})
    for r in robots:
        assert bus.wait_json(f"/{r['id']}/health", lambda d: d["state"] == "streaming", timeout=20), proc.text()
    assert bus.wait_json(f"{NODE}/status", lambda d: d["online"], timeout=20), proc.text()
    return proc, bus


def stop_after(robot: EpuckSerialSimRobot, since: int, after: float = 0.0) -> float | None:
    """When the robot applied the first -0x09 with speeds 0 among those from index `since` and later than
    `after` (monotonic). The simulator's thread appends to `received`, then to `received_at`: the commands read are
    those whose time is already there."""
    n = len(robot.received_at)
    for cmd, at in zip(robot.received[since:n], robot.received_at[since:n], strict=True):
        if cmd.left == 0 and cmd.right == 0 and at > after:
            return at
    return None


def line_time(robot: EpuckSerialSimRobot, line: str) -> float:
    """When the robot executed the last ASCII line `line` (monotonic)."""
    return max(t for t, text in robot.lines if text == line)


def cycled(robot: EpuckSimRobot, cycles: int) -> bool:
    return robot.stats.cycles >= cycles


def test_an_ascii_motion_arms_the_deadman_and_shows_in_the_state(broker_session: Broker, spawn: Any,
                                                                client: RpcClient, tmp_path: Path) -> None:
    serial = EpuckSerialSimThread(1, str(tmp_path / "ttyEPUCK")).start()
    robot = serial.robots[0]
    # The robot's speed and the state are read after the line's answer, while the deadman (armed before the line
    # went) runs: two seconds leave a busy machine room for the answer and one more call before it fires.
    timeout_s = 2.0
    try:
        proc, bus = start_gateway(broker_session, spawn, client,
                                  [{"id": "usb1", "transport": "serial", "port": robot.link}], int(timeout_s * 1000))
        for line in ("D,250,250", "d,250,250"):  # the firmware upper-cases the letter: `d` is `D` too
            mark, since = bus.mark(), len(robot.received)
            rep = client.call(NODE, "usb1", "ascii", {"line": line}, timeout=10)
            t_reply = time.monotonic()
            assert rep.ok and rep.result["reply"] == "d", rep.raw
            assert robot.world.speed_left == 250  # the robot drives (it set the speed before it answered `d`)
            state = client.call(NODE, "usb1", "stream", {}, timeout=10)  # an empty `stream` reads the state
            assert state.ok, state.raw
            assert state.result["left_speed"] == 250 and state.result["right_speed"] == 250, state.result
            assert state.result["motion_expires_in_ms"] is not None
            # the deadman sends speed 0 within motion_timeout (+ a margin for a busy machine); a -0x09 the
            # previous round's state read left pending may be applied before the line, so: after the line
            driven = line_time(robot, line)
            assert wait_until(partial(stop_after, robot, since, driven), 10), robot.received[since:]
            stopped = stop_after(robot, since, driven)
            assert stopped is not None
            assert stopped - t_reply <= timeout_s + 0.5, stopped - t_reply
            assert robot.world.speed_left == 0 and robot.world.speed_right == 0
            assert bus.wait_json("/usb1/event/fault", lambda d: d["kind"] == "motion_timeout", mark)
            state = client.call(NODE, "usb1", "stream", {}, timeout=10)
            assert state.result["left_speed"] == 0 and state.result["motion_expires_in_ms"] is None
        # `S` (the firmware's stop) shows in the state too
        assert client.call(NODE, "usb1", "ascii", {"line": "D,100,100"}, timeout=10).ok
        assert client.call(NODE, "usb1", "ascii", {"line": "S"}, timeout=10).result["reply"] == "s"
        state = client.call(NODE, "usb1", "stream", {}, timeout=10)
        assert state.result["left_speed"] == 0 and state.result["motion_expires_in_ms"] is None
        assert robot.world.speed_left == 0
        # lines the deadman could not cover are refused, and never reach the robot
        lines_before = len(robot.lines)
        for line in ("D,250", "D", "D,2000,0", "P,0,0", "p,10,10"):
            rep = client.call(NODE, "usb1", "ascii", {"line": line}, timeout=10)
            assert rep.error is not None and rep.error["code"] == "invalid_request", (line, rep.raw)
        assert len(robot.lines) == lines_before and robot.world.speed_left == 0
        # no programmer configured: the installation cannot flash this robot (not a bad request)
        rep = client.call(NODE, "usb1", "flash", {"elf_base64": "AAAA"}, timeout=10)
        assert rep.error is not None and rep.error["code"] == "unavailable", rep.raw
        assert "no programmer" in rep.error["message"]
        assert proc.stop() == 0
    finally:
        serial.close()


def test_at_bluetooth_speed_the_deadman_stop_is_not_held_behind_an_image(
        broker_session: Broker, spawn: Any, client: RpcClient, tmp_path: Path) -> None:
    """115200 baud, the robot's replies paced at that rate, the settings' defaults (image stream on, the
    camera rate the baud implies): the stop reaches the robot within motion_timeout + the documented
    bound (one sensors exchange, ~10 ms) + slack for a busy machine, where an image is 278 ms."""
    serial = EpuckSerialSimThread(1, str(tmp_path / "ttyBT"), EpuckSerialSimConfig(selector=3,
                                                                                    line_baud=115200)).start()
    robot = serial.robots[0]
    timeout_s = 0.4
    try:
        _proc, bus = start_gateway(broker_session, spawn, client,
                                   [{"id": "bt1", "transport": "serial", "port": robot.link, "baud": 115200}],
                                   int(timeout_s * 1000))
        assert default_image_fps(115200) <= 0.5
        assert bus.wait_json("/bt1/state/image_info", lambda d: d["width"] == 40, timeout=15)  # images still come
        lateness = []
        for i in range(12):
            # phases spread over an image period (0.5 s at 2 fps), so that some deadline would fall in an
            # image if images were started regardless of it (trials in a fixed rhythm can lock onto images)
            time.sleep(i * 0.5 / 12)
            since = len(robot.received)
            rep = client.call(NODE, "bt1", "set_speed", {"left": 200, "right": 200}, timeout=10)
            t_reply = time.monotonic()
            assert rep.ok, rep.raw
            assert wait_until(partial(stop_after, robot, since), 10)
            stopped = stop_after(robot, since)
            assert stopped is not None
            lateness.append(stopped - t_reply - timeout_s)
        # held behind an image, about half the deadlines fall in one and come up to 278 ms late (a quarter of the
        # trials beyond 0.15 s); a busy machine may stall one trial: one outlier is allowed, none beyond an image
        late = sorted(lateness)
        assert late[-2] <= 0.15 and late[-1] <= 0.6, [round(x, 3) for x in lateness]
        link = bus.wait_json("/bt1/state/link", lambda d: d["sensors_per_s"] > 30)
        assert link is not None, "sensors starved by the camera at 115200 baud"
    finally:
        serial.close()


def test_over_wifi_at_a_slow_image_rate_the_stop_leaves_at_once_and_is_reported_then(
        broker_session: Broker, spawn: Any, client: RpcClient) -> None:
    """0.5 fps with the sensors riding on each image (the firmware's cycle waits for the image): one robot
    cycle every 2 s. The stop is written when the deadman decides it, not at the next image, and
    `motion_timeout` carries the time it was written."""
    wifi = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=0.5, image_holds_cycle=True)).start()
    robot = wifi.robots[0]
    timeout_s = 0.6
    try:
        _proc, bus = start_gateway(broker_session, spawn, client,
                                   [{"id": "wifi1", "host": "127.0.0.1", "port": robot.port}], int(timeout_s * 1000))
        for _ in range(2):
            mark = bus.mark()
            # the first command with speeds 0 from now on, stamped with the kernel's time of its arrival at the
            # robot's socket (the simulator's loop may read it late on a busy machine)
            robot.stop_watch.arm()
            rep = client.call(NODE, "wifi1", "set_speed", {"left": 200, "right": 200}, timeout=10)
            t_reply = time.time()
            assert rep.ok, rep.raw
            assert wait_until(lambda: robot.stop_watch.seen is not None, 10, 0.005)
            cycles_at_stop = robot.stats.cycles
            seen = robot.stop_watch.seen
            assert seen is not None
            arrived = seen.ts
            assert arrived - t_reply <= timeout_s + 0.3, arrived - t_reply
            fault = bus.wait_json("/wifi1/event/fault", lambda d: d["kind"] == "motion_timeout", mark)
            assert fault is not None and "written" in fault["message"], fault
            assert abs(fault["ts"] - arrived) <= 0.2, (fault["ts"], arrived)  # the time it left, not decided
            assert wait_until(lambda: robot.world.speed_left == 0, 5)
            # applied at the robot's next cycle: the stop replaces a set_speed the robot had not taken yet (written
            # 5 times, so the firmware drops the older), it does not wait behind it (transport/wifi.py)
            assert robot.stats.cycles <= cycles_at_stop + 1, (robot.stats.cycles, cycles_at_stop)
            # the robot has taken both commands and the gateway has seen it (one cycle more) before the next
            # round, or that round's set_speed would wait its turn behind them (two untaken at most)
            assert wait_until(partial(cycled, robot, robot.stats.cycles + 2), 10)
    finally:
        wifi.close()
