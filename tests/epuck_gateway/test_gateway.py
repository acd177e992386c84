"""The gateway process against simulated robots and a real broker: the MQTT surface end to end."""

from __future__ import annotations

import base64
import io
import itertools
import json
import time
from typing import Any

import pytest
from PIL import Image

from services.epuck_gateway.image import rgb565_image
from services.epuck_gateway.protocol.wifi import SET_CALIBRATE_IR, SOUND_MARIO, SOUND_STOP, EpuckCommand
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from shared.rpc import RpcClient
from shared.tools.asyncapi import ContractValidator, build_document
from tests.epuck_gateway.conftest import GATEWAY, NODE, Gateway, gateway_env, wait_until
from tests.fixtures import Broker, free_port


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    pa, pb = a.convert("RGB").tobytes(), b.convert("RGB").tobytes()
    assert len(pa) == len(pb)
    return sum(abs(x - y) for x, y in zip(pa, pb, strict=True)) / len(pa)


def test_five_robots_stream_sensors_images_and_link(gateway: Gateway) -> None:
    mark = gateway.bus.mark()
    names = [r.name for r in gateway.sim.robots]
    assert len(names) == 5

    def every_robot_has(suffix: str) -> bool:
        return all(gateway.bus.since(mark, f"/{n}/state/{suffix}") for n in names)

    assert wait_until(lambda: every_robot_has("sensors") and every_robot_has("image")
                      and every_robot_has("image_info") and every_robot_has("link"), 10)
    s = gateway.bus.latest_json("/epuck3/state/sensors", mark)
    assert s is not None
    assert s["selector"] == 15 and s["acc_g"]["z"] == pytest.approx(1.0) and len(s["proximity"]) == 8
    assert set(s["microphones"]) == {"right", "left", "back", "front"}
    assert s["battery_v"] == pytest.approx(3400 / 819.2, abs=1e-3) and s["sd_card"] is True
    link = gateway.bus.wait_json("/epuck3/state/link", lambda d: d["sensors_per_s"] > 0, mark)
    assert link is not None and link["connected"] and link["framing_errors"] == 0


def test_every_published_message_matches_the_contract(gateway: Gateway) -> None:
    doc = build_document()
    validator = ContractValidator(doc)
    mark = gateway.bus.mark()
    wait_until(lambda: gateway.bus.since(mark, "/state/link"), 15)
    rep = gateway.call("epuck1", "leds", {"led1": True})
    validator.validate_reply(doc, f"{NODE}_cmd_leds", rep.raw)
    bad = gateway.call("epuck1", "set_speed", {"left": 5000, "right": 0})
    validator.validate_reply(doc, f"{NODE}_cmd_set_speed", bad.raw)
    time.sleep(1.2)
    seen = set()
    for m in gateway.bus.messages:
        if m.topic.startswith(f"robobus/{NODE}/") and "/cmd/" not in m.topic:  # requests are the tests' own
            seen.add(validator.validate(m.topic, m.payload))
    assert {f"{NODE}_state_sensors", f"{NODE}_state_image", f"{NODE}_state_image_info",
            f"{NODE}_state_link"} <= seen


def test_image_topic_is_jpeg_of_the_simulators_picture(gateway: Gateway) -> None:
    robot = gateway.sim.robots[4]
    mark = gateway.bus.mark()
    wait_until(lambda: gateway.bus.since(mark, "/epuck5/state/image"), 15)
    msg = gateway.bus.since(mark, "/epuck5/state/image")[-1]
    assert msg.content_type == "image/jpeg"
    jpeg = Image.open(io.BytesIO(msg.payload))
    assert jpeg.format == "JPEG" and jpeg.size == (160, 120)
    # the robot stands still, so every frame is the picture of its current pose
    truth = rgb565_image(gateway.sim.call(robot.world.camera))
    assert mean_abs_diff(jpeg, truth) < 4.0
    other = rgb565_image(gateway.sim.call(gateway.sim.robots[0].world.camera))
    assert mean_abs_diff(jpeg, other) > 10.0  # a different pose is a different picture
    info = gateway.bus.latest_json("/epuck5/state/image_info", mark)
    assert info is not None and info["width"] == 160 and info["content_type"] == "image/jpeg"


def test_snapshot_returns_png_even_with_the_image_stream_off(gateway: Gateway) -> None:
    assert gateway.call("epuck5", "stream", {"image": False}).ok
    try:
        rep = gateway.call("epuck5", "snapshot", {})
        assert rep.ok, rep.error
        png = Image.open(io.BytesIO(base64.b64decode(rep.result["png_base64"])))
        assert png.format == "PNG" and png.size == (160, 120)
        truth = rgb565_image(gateway.sim.call(gateway.sim.robots[4].world.camera))
        assert mean_abs_diff(png, truth) == 0.0  # PNG is lossless
        assert gateway.sim.robots[4].command is not None
        assert wait_until(lambda: gateway.sim.robots[4].command.request == 2, 15)  # type: ignore[union-attr]
    finally:
        assert gateway.call("epuck5", "stream", {"image": True}).ok


def test_set_speed_moves_the_robot_and_motion_expires(gateway: Gateway) -> None:
    robot = gateway.sim.robots[1]
    mark = gateway.bus.mark()
    rep = gateway.call("epuck2", "set_speed", {"left": 500, "right": 500})
    assert rep.ok and rep.result["left_speed"] == 500 and rep.result["motion_expires_in_ms"] is not None
    assert wait_until(lambda: robot.world.speed_left == 500, 15)
    # nobody renews the demand: the gateway stops the robot (motion_timeout_ms=400 here)
    assert wait_until(lambda: robot.world.speed_left == 0 and robot.world.speed_right == 0, 10)
    fault = gateway.bus.wait_json("/epuck2/event/fault", lambda d: d["kind"] == "motion_timeout", mark)
    assert fault is not None
    s = gateway.bus.wait_json("/epuck2/state/sensors", lambda d: d["steps"]["left_total"] > 0, mark)
    assert s is not None  # the wheels turned


def test_renewed_set_speed_keeps_moving(gateway: Gateway) -> None:
    robot = gateway.sim.robots[1]
    for _ in range(4):  # each demand pushes the 400 ms deadline out again
        rep = gateway.call("epuck2", "set_speed", {"left": -100, "right": 100})
        assert rep.ok and rep.result["motion_expires_in_ms"] > 300
        assert wait_until(lambda: robot.world.speed_left == -100, 15)
        time.sleep(0.1)
    assert gateway.call("epuck2", "set_speed", {"left": 0, "right": 0}).result["motion_expires_in_ms"] is None


def test_leds_rgb_obstacle_reach_the_robot(gateway: Gateway) -> None:
    robot = gateway.sim.robots[0]
    assert gateway.call("epuck1", "leds", {"led3": True, "front": True, "led1": False}).ok
    rep = gateway.call("epuck1", "rgb", {"led2": {"red": 100, "green": 0, "blue": 50}, "led8": {"red": 1, "green": 2,
                                                                                                "blue": 3}})
    assert rep.ok and rep.result["rgb"]["led8"] == {"red": 1, "green": 2, "blue": 3}
    assert gateway.call("epuck1", "obstacle_avoidance", {"enabled": True}).ok
    assert wait_until(lambda: robot.world.obstacle_avoidance, 15)
    assert robot.world.leds == 0x22
    assert robot.world.rgb[0] == (100, 0, 50) and robot.world.rgb[3] == (1, 2, 3)
    assert gateway.call("epuck1", "obstacle_avoidance", {"enabled": False}).ok


def test_oneshot_flags_are_cleared_by_the_next_command(gateway: Gateway) -> None:
    robot = gateway.sim.robots[0]
    n = len(robot.stats.received)
    assert gateway.call("epuck1", "sound", {"sound": "mario"}).ok
    assert gateway.call("epuck1", "calibrate_ir", {}).ok

    def cleared() -> bool:
        sent = list(robot.stats.received)[n:]
        cal = [k for k, c in enumerate(sent) if c.settings & SET_CALIBRATE_IR]
        return bool(cal) and len(sent) > cal[-1] + 1

    assert wait_until(cleared, 15)
    sent = list(robot.stats.received)[n:]
    i = next(k for k, c in enumerate(sent) if c.sound == SOUND_MARIO)
    assert sent[i + 1].sound == 0  # the very next command clears it
    j = next(k for k, c in enumerate(sent) if c.settings & SET_CALIBRATE_IR)
    assert not sent[j + 1].settings & SET_CALIBRATE_IR and sent[j + 1].sound == 0
    # the robot takes one queued command per cycle: wait for both to be applied
    # (the gateway goes on sending: the robot's command is a later one, with neither one-shot flag set)
    assert wait_until(lambda: robot.world.sound_starts >= 1 and robot.world.calibrations >= 1
                      and robot.command is not None and robot.command.sound == 0
                      and not robot.command.settings & SET_CALIBRATE_IR, 15)
    starts, cals = robot.world.sound_starts, robot.world.calibrations
    time.sleep(0.3)
    assert (robot.world.sound_starts, robot.world.calibrations) == (starts, cals)  # not re-applied
    # calibrated against open space: proximity now reads ~0
    mark = gateway.bus.mark()
    s = gateway.bus.wait_json("/epuck1/state/sensors", lambda d: True, mark)
    assert s is not None and max(s["proximity"]) <= 5


def test_set_steps_overwrites_the_counters(gateway: Gateway) -> None:
    robot = gateway.sim.robots[2]
    assert gateway.call("epuck3", "set_steps", {"left": -1234, "right": 4321}).ok
    mark = gateway.bus.mark()
    s = gateway.bus.wait_json("/epuck3/state/sensors", lambda d: d["steps"]["left"] == -1234, mark)
    assert s is not None and s["steps"]["right"] == 4321
    assert wait_until(lambda: robot.command is not None and not robot.command.settings & 0x04, 15)


@pytest.mark.parametrize("command,payload", [
    ("set_speed", {"left": 1001, "right": 0}),
    ("set_speed", {"left": -1001, "right": 0}),
    ("set_speed", {"left": "100", "right": 0}),
    ("set_speed", {"left": 1.5, "right": 0}),
    ("set_speed", {"left": 10}),
    ("set_speed", {"left": 10, "right": 10, "turbo": True}),
    ("set_steps", {"left": 40000, "right": 0}),
    ("rgb", {"led2": {"red": 101, "green": 0, "blue": 0}}),
    ("rgb", {"led3": {"red": 1, "green": 0, "blue": 0}}),
    ("leds", {"led2": True}),
    ("sound", {"sound": "beethoven"}),
    ("stream", {"image": "yes"}),
    ("snapshot", {"timeout_s": 100}),
    ("set_speed", b"not json"),
    ("set_speed", b"[1, 2]"),
])
def test_bad_commands_get_invalid_request(gateway: Gateway, command: str, payload: object) -> None:
    rep = gateway.call("epuck1", command, payload)
    assert not rep.ok and rep.error["code"] == "invalid_request", rep.raw


def test_unknown_device_and_unknown_command(gateway: Gateway) -> None:
    assert gateway.call("nobody", "set_speed", {"left": 0, "right": 0}).error["code"] == "not_found"
    assert gateway.call("epuck1", "fly", {}).error["code"] == "not_found"


def test_unreachable_robot_is_unavailable_and_unhealthy(gateway: Gateway) -> None:
    rep = gateway.call("ghost", "set_speed", {"left": 10, "right": 10})
    assert not rep.ok and rep.error["code"] == "unavailable"
    # never reached within the budget: unreachable (probed once per probe period), a failed attempt counted,
    # never an error (docs/kit.md "Health")
    h = gateway.bus.wait_json("/ghost/health", lambda d: d["state"] == "unreachable", 0)
    assert h is not None and not h["connection"] and not h["error"] and "cannot connect" in h["error_message"]
    assert h["details"]["link"]["failures"] >= 1
    assert not any(json.loads(m.payload)["error"] for m in gateway.bus.since(0, "/ghost/health"))


def test_disconnect_and_reconnect(gateway: Gateway) -> None:
    robot = gateway.sim.robots[2]
    mark = gateway.bus.mark()
    gateway.sim.call(robot.drop_client)
    down = gateway.bus.wait_json("/epuck3/health", lambda d: not d["connection"], mark)
    assert down is not None and down["state"] == "lost" and not down["error"]
    up = gateway.bus.wait_json("/epuck3/health", lambda d: d["connection"], mark)
    assert up is not None
    assert gateway.bus.wait_json("/epuck3/event/fault", lambda d: d["kind"] == "link_lost", mark)
    link = gateway.bus.wait_json("/epuck3/state/link", lambda d: d["reconnects"] >= 1 and d["connected"], mark)
    assert link is not None
    # the robot's process goes away and comes back on the same port: the gateway keeps retrying
    mark = gateway.bus.mark()
    gateway.sim.run(robot.stop)
    assert gateway.bus.wait_json("/epuck3/health", lambda d: "cannot connect" in d["error_message"], mark)
    mark = gateway.bus.mark()  # health heartbeats from before the stop must not count as "back"
    gateway.sim.run(robot.start)
    assert gateway.bus.wait_json("/epuck3/health", lambda d: d["state"] == "streaming", mark)
    assert gateway.call("epuck3", "leds", {"body": True}).ok


def test_silent_robot_is_reported_silent_and_stopped(gateway: Gateway) -> None:
    robot = gateway.sim.robots[3]
    wait_until(lambda: robot.connected, 15)
    mark = gateway.bus.mark()
    assert gateway.call("epuck4", "set_speed", {"left": 200, "right": 200}).ok
    robot.silent = True  # the socket stays open, nothing arrives (a robot out of WiFi range)
    try:
        down = gateway.bus.wait_json("/epuck4/health", lambda d: d["state"] == "silent", mark)
        assert down is not None and "no valid data" in down["error_message"]
        assert not down["connection"] and not down["operational"] and not down["error"]
        assert gateway.bus.wait_json("/epuck4/event/fault", lambda d: d["kind"] == "link_lost", mark)
        # fail safe: the demand is dropped, so the robot does not drive on when it talks again
        assert wait_until(lambda: robot.command is not None and robot.command.left == 0, 15)
    finally:
        robot.silent = False
    up = gateway.bus.wait_json("/epuck4/health", lambda d: d["state"] == "streaming", mark)
    assert up is not None and up["operational"]


def test_health_says_connected_until_data_and_a_hung_robot_does_not_toggle(gateway: Gateway) -> None:
    robot = gateway.sim.robots[3]
    wait_until(lambda: robot.connected, 15)
    robot.hung = True  # the next connection is taken but nothing is ever sent (no FIN)
    mark = gateway.bus.mark()
    gateway.sim.call(robot.drop_client)
    try:
        got = gateway.bus.wait_json("/epuck4/health", lambda d: d["state"] == "connected", mark)
        assert got is not None and not got["connection"] and not got["operational"] and not got["error"]
        time.sleep(3.0)  # the issue saw streaming <-> disconnected every ~1.2 s
        states = [json.loads(m.payload)["state"] for m in gateway.bus.since(mark, "/epuck4/health")]
        after = states[states.index("connected"):]
        assert set(after) <= {"connected", "silent"}, states
        assert sum(1 for a, b in itertools.pairwise(after) if a != b) <= 1, states
    finally:
        robot.hung = False
    assert gateway.bus.wait_json("/epuck4/health", lambda d: d["state"] == "streaming", mark)


def test_framing_error_is_counted_reported_and_the_link_reset(gateway: Gateway) -> None:
    robot = gateway.sim.robots[3]
    wait_until(lambda: robot.connected, 15)
    mark = gateway.bus.mark()
    conns = robot.stats.connections
    gateway.sim.call(lambda: robot.inject(b"\x7f"))
    fault = gateway.bus.wait_json("/epuck4/event/fault", lambda d: d["kind"] == "framing_error", mark)
    assert fault is not None and "0x7f" in fault["message"]
    assert wait_until(lambda: robot.stats.connections > conns and robot.connected, 10)
    link = gateway.bus.wait_json("/epuck4/state/link", lambda d: d["framing_errors"] >= 1 and d["connected"], mark)
    assert link is not None
    # the robot was told to stop before the link was closed
    assert any(c.sound == SOUND_STOP and c.request == 0 for c in robot.stats.received)


def test_gateway_stop_sends_stop_command(broker_session: Broker, spawn: Any, client: RpcClient) -> None:
    sim = EpuckSimThread(2, EpuckSimConfig()).start()
    try:
        proc = spawn(GATEWAY, gateway_env(broker_session, sim, ROBOBUS_NODE="epuck-stop")[0])
        assert wait_until(lambda: all(r.connected and r.command is not None for r in sim.robots), 15), proc.text()
        # the node is on the bus once its retained health says the robot is connected
        assert client.collect("robobus/epuck-stop/epuck1/health", 10,
                              until=lambda t, p: json.loads(p)["connection"])
        assert client.call("epuck-stop", "epuck1", "set_speed", {"left": 300, "right": 300}).ok
        assert wait_until(lambda: sim.robots[0].world.speed_left == 300, 15)
        assert proc.stop() == 0  # well inside the 1 s motion timeout: the stop comes from the shutdown
        for r in sim.robots:
            last = r.stats.received[-1]
            assert last == EpuckCommand(request=0, settings=0, left=0, right=0, leds=0, sound=SOUND_STOP)
        assert wait_until(lambda: sim.robots[0].world.speed_left == 0, 2)
        assert "all robots stopped" in proc.text()
    finally:
        sim.close()


def test_jpeg_on_encoder_threads_when_configured(broker_session: Broker, spawn: Any, client: RpcClient) -> None:
    """The default encodes on the loop (the module fixture's gateway); EPUCK_ENCODE_WORKERS > 0 hands frames
    to threads: the same JPEG stream and image_info, at the fps cap."""
    sim = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    try:
        proc = spawn(GATEWAY, gateway_env(broker_session, sim, ROBOBUS_NODE="epuck-pool",
                                          ROBOBUS_EPUCK_ENCODE_WORKERS="2")[0])
        infos = client.collect("robobus/epuck-pool/epuck1/state/image_info", 15,
                               until=lambda t, p: json.loads(p)["seq"] >= 5)
        assert infos and json.loads(infos[-1][1])["seq"] >= 5, proc.text()
        frames = client.collect("robobus/epuck-pool/epuck1/state/image", 5, until=lambda t, p: True)
        assert frames and Image.open(io.BytesIO(frames[-1][1])).size == (160, 120)
    finally:
        sim.close()


def test_gateway_retries_until_the_simulator_is_up(broker_session: Broker, spawn: Any) -> None:
    sim = EpuckSimThread(1, EpuckSimConfig())
    port = sim.robots[0].port = free_port()
    robots = [{"id": "late", "host": "127.0.0.1", "port": port}]
    proc = spawn(GATEWAY, {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots),
                           "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3"})
    try:
        time.sleep(1.0)
        assert proc.alive()
        sim.start()
        assert wait_until(lambda: sim.robots[0].connected and sim.robots[0].command is not None, 10), proc.text()
    finally:
        proc.stop()
        sim.close()


@pytest.mark.parametrize("robots", [
    '[{"id": "a/b", "host": "x"}]',
    '[{"id": "a", "host": "x"}, {"id": "a", "host": "y"}]',
    '[{"id": "a", "host": "x"}, {"id": "b", "host": "x"}]',
    '[]',
    'not json',
])
def test_bad_configuration_exits_with_a_clear_message(broker_session: Broker, spawn: Any, robots: str) -> None:
    proc = spawn(GATEWAY, {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_EPUCK_ROBOTS": robots})
    code = proc.proc.wait(20)
    proc.stop()
    assert code == 2 and "epuck_robots" in proc.text() and "Traceback" not in proc.text(), proc.text()
