"""Home Assistant discovery of the bus stop: a `button` whose press (Home Assistant renders its command_template and
publishes it, retained, QoS 1) sets the site's stop that the nodes obey, and a `binary_sensor` on each latch's
retained stop (the site's {root}/_stop and the fleet centre's {root}/_stop/fleet); templates rendered with Jinja2,
Home Assistant's template engine, against the real messages."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any

import jinja2
import paho.mqtt.client as mqtt

from shared import Node, __version__
from shared.messages import StopState
from shared.rpc import RpcClient, wait_for
from shared.stop import answer_topic, fleet_stop_topic, stop_topic
from shared.tools.dashboard.homeassistant import Discovery, HomeAssistantSettings, stop_entities
from shared.tools.localbroker import Broker
from tests.kit.motion_node import API, build

JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)
DEADLINE = 30.0


def press(template: str, when: float) -> bytes:
    """What Home Assistant publishes when the button is pressed: its command_template rendered (`value` is
    payload_press; now() the press time)."""
    now = datetime.datetime.fromtimestamp(when, datetime.UTC)
    return JINJA.from_string(template).render(value="PRESS", now=lambda: now).encode()


def sensor_state(cfg: dict[str, Any], payload: bytes) -> str:
    """The binary_sensor's state from a message on its state_topic (Home Assistant sets value_json only for a JSON
    payload)."""
    try:
        variables = {"value_json": json.loads(payload)}
    except ValueError:
        variables = {}
    return JINJA.from_string(cfg["value_template"]).render(value=payload.decode(), **variables).strip()


def test_the_button_and_binary_sensor_configs() -> None:
    button, sensor, fleet = stop_entities("site1", "homeassistant", __version__)
    assert button.component == "button" and sensor.component == "binary_sensor" and fleet.component == "binary_sensor"
    assert button.topic == "homeassistant/button/robobus_site1__stop/stop/config"
    assert sensor.topic == "homeassistant/binary_sensor/robobus_site1__stop/stop/config"
    assert fleet.topic == "homeassistant/binary_sensor/robobus_site1__stop/fleet_stop/config"
    b, s, f = button.config, sensor.config, fleet.config
    # the button writes the site's latch only; the fleet's is the centre's (its sensor only reads it)
    assert b["command_topic"] == "site1/_stop" and b["retain"] is True and b["qos"] == 1
    assert s["state_topic"] == "site1/_stop" and f["state_topic"] == "site1/_stop/fleet"
    assert f["json_attributes_topic"] == "site1/_stop/fleet" and "command_topic" not in f
    assert len({b["unique_id"], s["unique_id"], f["unique_id"]}) == 3 and b["device"] == s["device"] == f["device"]
    assert "availability" not in b  # pressing stop must work whatever is online
    # the press is a valid StopState: active, from Home Assistant, stamped with the press time
    stop = StopState.model_validate_json(press(b["command_template"], 1_800_000_000.25))
    assert stop.active and stop.source == "homeassistant" and stop.ts == 1_800_000_000.25
    # the sensor: ON while active, OFF when released, OFF when there is no stop at all (empty retained message)
    assert sensor_state(s, stop.model_dump_json().encode()) == "ON"
    released = StopState(active=False, source="ops", ts=1.0).model_dump_json().encode()
    assert sensor_state(s, released) == "OFF"
    assert sensor_state(s, b"") == "OFF"
    # fail safe, as the nodes read it: a message that is not a StopState is an active stop
    assert sensor_state(s, b"{not json") == "ON" and sensor_state(s, b'{"reason": "x"}') == "ON"
    assert sensor_state(f, stop.model_dump_json().encode()) == "ON" and sensor_state(f, released) == "OFF"
    assert sensor_state(f, b"") == "OFF"
    attrs = JINJA.from_string(s["json_attributes_template"]).render(value_json=json.loads(stop.model_dump_json()))
    assert json.loads(attrs)["reason"] == "stop button in Home Assistant"


def test_the_button_stops_the_nodes_and_the_sensor_follows(broker_session: Broker, client: RpcClient) -> None:
    tag = f"{os.getpid()}x{time.monotonic_ns() % 1000000}"
    root, prefix = f"hastop{tag}", f"hastopp{tag}"
    latest: dict[str, bytes] = {}
    lock = threading.Lock()

    def on(msg: mqtt.MQTTMessage) -> None:
        with lock:
            latest[msg.topic] = bytes(msg.payload)

    client.subscribe_before(f"{prefix}/#", on)
    client.subscribe_before(f"{root}/#", on)
    node = Node(API, broker_session.settings(topic_root=root, node="mover"))
    wheels = build(node)
    node.start()
    d = Discovery(HomeAssistantSettings(mqtt_url=broker_session.url, topic_root=root, homeassistant_prefix=prefix),
                  __version__)
    d.start()
    button_topic, sensor_topic, fleet_topic = (e.topic for e in d.stop_entities)
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        assert wait_for(lambda: {button_topic, sensor_topic, fleet_topic} <= set(latest), DEADLINE), latest.keys()
        button, sensor = json.loads(latest[button_topic]), json.loads(latest[sensor_topic])
        fleet_sensor = json.loads(latest[fleet_topic])
        # retained: a Home Assistant that starts later finds them
        retained = {t for t, p, r in client.collect_retained(f"{prefix}/+/+/+/config") if r and p and "_stop" in t}
        assert retained == {button_topic, sensor_topic, fleet_topic}
        # the press, as Home Assistant publishes it
        when = time.time()
        client.session.publish(button["command_topic"], press(button["command_template"], when),
                               qos=button["qos"], retain=button["retain"])
        assert wait_for(lambda: node.stop_latch.active, DEADLINE)
        assert wait_for(lambda: all(w.speed == 0.0 and w.stops for w in wheels.values()), DEADLINE)
        with RpcClient(broker_session.settings(topic_root=root), name="ha-stop") as c:
            r = c.call("mover", "wheel1", "move", {"speed": 1}, timeout=DEADLINE)
        assert not r.ok and r.error is not None and r.error["code"] == "stopped", r.raw
        assert "homeassistant" in r.error["message"]
        # the node answered the press
        assert wait_for(lambda: json.loads(latest.get(answer_topic(root, "mover")) or b"{}").get("source")
                        == "homeassistant", DEADLINE)
        # the binary_sensor reads the retained stop: ON; after the release: OFF
        assert sensor_state(sensor, latest[stop_topic(root)]) == "ON"
        client.session.publish_wait(stop_topic(root), StopState(active=False, source="ops", ts=time.time())
                                    .model_dump_json(), qos=1, retain=True)
        assert wait_for(lambda: not node.stop_latch.active, DEADLINE)
        assert wait_for(lambda: sensor_state(sensor, latest[stop_topic(root)]) == "OFF", DEADLINE)
        # the fleet centre's stop (as the site's bridge brings it in): the nodes stop, the fleet's sensor is ON and
        # the site's stays OFF; the site's release does not lift it
        fleet = StopState(active=True, source="centre-op@hq", reason="fleet drill", ts=time.time())
        client.session.publish_wait(fleet_stop_topic(root), fleet.model_dump_json(), qos=1, retain=True)
        assert wait_for(lambda: node.stop_latch.active and node.stop_latch.channel == "fleet", DEADLINE)
        assert wait_for(lambda: sensor_state(fleet_sensor, latest.get(fleet_stop_topic(root), b"")) == "ON", DEADLINE)
        assert sensor_state(sensor, latest[stop_topic(root)]) == "OFF"
        client.session.publish_wait(fleet_stop_topic(root), StopState(active=False, source="centre-op@hq",
                                                                      ts=time.time()).model_dump_json(),
                                    qos=1, retain=True)
        assert wait_for(lambda: not node.stop_latch.active, DEADLINE)
        assert wait_for(lambda: sensor_state(fleet_sensor, latest[fleet_stop_topic(root)]) == "OFF", DEADLINE)
        # Home Assistant restarts: the stop's entities are published again with the devices'
        with lock:
            latest.pop(button_topic)
            latest.pop(fleet_topic)
        client.session.publish(f"{prefix}/status", "online", qos=1)
        assert wait_for(lambda: button_topic in latest and fleet_topic in latest, DEADLINE)
    finally:
        d.stop()
        node.stop()
        with lock:
            topics = list(latest)
        for t in topics:
            client.session.publish(t, b"", qos=1, retain=True)
        client.session.publish_wait(stop_topic(root), b"", qos=1, retain=True)
        client.session.publish_wait(fleet_stop_topic(root), b"", qos=1, retain=True)
