"""The gateway process with a robot on WiFi and one on a serial port (asercom v2 on a pty): the same
MQTT surface for both, and a USB unplug / replug seen through health."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

from PIL import Image

from services.epuck_gateway.image import rgb565_image
from services.epuck_gateway.protocol.wifi import SOUND_MARIO
from services.epuck_gateway.sim.serial import EpuckSerialSimThread
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from shared.rpc import RpcClient
from shared.tools.asyncapi import ContractValidator, build_document
from tests.epuck_gateway.conftest import GATEWAY, BusRecorder, wait_until
from tests.fixtures import Broker

NODE = "epuck-serial-gw"


def test_serial_robot_on_the_bus_like_a_wifi_one(broker_session: Broker, spawn: Any, client: RpcClient,
                                                tmp_path: Path) -> None:
    wifi = EpuckSimThread(1, EpuckSimConfig()).start()
    serial = EpuckSerialSimThread(1, str(tmp_path / "ttyEPUCK")).start()
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{NODE}/#", bus.on)
    robot = serial.robots[0]
    robots = [{"id": "wifi1", "host": "127.0.0.1", "port": wifi.robots[0].port},
              {"id": "usb1", "transport": "serial", "port": robot.link, "poll_hz": 40}]
    try:
        proc = spawn(GATEWAY, {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": NODE,
                               "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots), "ROBOBUS_HEALTH_INTERVAL_S": "1",
                               "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3", "ROBOBUS_EPUCK_MOTION_TIMEOUT_MS": "500"})
        up = bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", timeout=20)
        assert up is not None, proc.text()
        # commands only once the node's birth is out: it follows the SUBACK of its command subscription
        assert bus.wait_json(f"{NODE}/status", lambda d: d["online"], timeout=20), proc.text()
        assert up["details"]["transport"] == "serial" and up["details"]["address"] == f"{robot.link}@115200"
        s = bus.wait_json("/usb1/state/sensors", lambda d: d["selector"] == 8)
        assert s is not None and len(s["proximity"]) == 8
        assert bus.wait_json("/wifi1/state/sensors", lambda d: d["selector"] == 15)
        # commands: the same contract as over WiFi
        rep = client.call(NODE, "usb1", "set_speed", {"left": 250, "right": 250}, timeout=10)
        assert rep.ok and rep.result["left_speed"] == 250
        assert wait_until(lambda: robot.world.speed_left == 250, 5)
        assert client.call(NODE, "usb1", "sound", {"sound": "mario"}, timeout=10).ok
        assert client.call(NODE, "usb1", "leds", {"body": True}, timeout=10).ok
        assert wait_until(lambda: SOUND_MARIO in robot.world.melodies and robot.world.leds & 0x10, 5)
        # the motion deadman works over serial too
        assert wait_until(lambda: robot.world.speed_left == 0, 5)
        assert bus.wait_json("/usb1/event/fault", lambda d: d["kind"] == "motion_timeout")
        # the ASCII mode, as a person types it
        rep = client.call(NODE, "usb1", "ascii", {"line": "D,120,-120"}, timeout=10)
        assert rep.ok and rep.result["reply"] == "d", rep.raw
        assert wait_until(lambda: (robot.world.speed_left, robot.world.speed_right) == (120, -120), 5)
        assert client.call(NODE, "usb1", "ascii", {"line": "D,0,0"}, timeout=10).ok
        rep = client.call(NODE, "usb1", "ascii", {"line": "N"}, timeout=10)
        assert rep.ok and rep.result["reply"].startswith("n,") and len(rep.result["reply"].split(",")) == 9
        assert client.call(NODE, "usb1", "ascii", {"line": "D,1;rm"}, timeout=10).error["code"] == "invalid_request"
        assert client.call(NODE, "wifi1", "ascii", {"line": "N"}, timeout=10).error["code"] == "invalid_request"
        # the camera: asercom's 40x40 RGB565 (-'I'), as JPEG on state/image and PNG in a snapshot
        info = bus.wait_json("/usb1/state/image_info", lambda d: True)
        assert info is not None and (info["width"], info["height"]) == (40, 40)
        snap = client.call(NODE, "usb1", "snapshot", {}, timeout=10)
        assert snap.ok and (snap.result["width"], snap.result["height"]) == (40, 40)
        png = Image.open(io.BytesIO(base64.b64decode(snap.result["png_base64"])))
        truth = serial.call(robot._image)  # header + pixels, what the robot answers to -'I'
        assert png.size == (40, 40) and png.tobytes() == rgb565_image(truth[3:], 40, 40).tobytes()
        link = bus.wait_json("/usb1/state/link", lambda d: d["sensors_per_s"] > 0 and d["transport"] == "serial")
        assert link is not None and link["address"].startswith(robot.link)
        # USB unplugged: lost with the reason (not an error: docs/kit.md "Health"), then back
        mark = bus.mark()
        serial.call(robot.unplug)
        down = bus.wait_json("/usb1/health", lambda d: not d["connection"], mark)
        assert down is not None and down["state"] == "lost" and not down["error"], down
        assert bus.wait_json("/usb1/event/fault", lambda d: d["kind"] == "link_lost", mark)
        assert client.call(NODE, "usb1", "leds", {"led1": True}, timeout=10).error["code"] == "unavailable"
        serial.call(robot.plug)
        assert bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", mark, timeout=15)
        assert client.call(NODE, "usb1", "leds", {"led1": True}, timeout=10).ok
        assert wait_until(lambda: robot.world.leds & 0x01, 5)
        # everything published validates against the contract
        validator = ContractValidator(build_document())
        for m in bus.messages:
            if "/cmd/" not in m.topic:
                validator.validate(m.topic, m.payload)
        assert proc.stop() == 0
        assert wait_until(lambda: robot.received and robot.received[-1].sound == 0x20, 5)  # stopped on exit
    finally:
        serial.close()
        wifi.close()
