"""Home Assistant discovery: configs in the shape Home Assistant expects, templates that read the real
messages (rendered with Jinja2, Home Assistant's template engine), availability from the node's status
topic, re-publication when Home Assistant comes online, bad input counted, bad settings refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import jinja2
import jsonschema
import pytest

from shared import __version__
from shared.rpc import RpcClient, wait_for
from shared.tools.dashboard.homeassistant import FieldCatalog, device_entities
from shared.tools.localbroker import REPO, Broker

# What Home Assistant's MQTT discovery needs of every entity we publish (binary_sensor and sensor platforms).
AVAILABILITY = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["topic"],
    "properties": {"topic": {"type": "string", "pattern": "^[^#+]+$"}, "value_template": {"type": "string"}}}}
ENTITY = {
    "type": "object",
    "required": ["name", "unique_id", "state_topic", "availability", "device", "value_template"],
    "properties": {
        "unique_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
        "state_topic": {"type": "string", "pattern": "^[^#+]+$"},
        "availability": AVAILABILITY,
        "availability_mode": {"enum": ["all", "any", "latest"]},
        "device": {"type": "object", "required": ["identifiers", "name"],
                   "properties": {"identifiers": {"type": "array", "minItems": 1, "items": {"type": "string"}}}},
        "device_class": {"type": "string"},
        "state_class": {"enum": ["measurement", "total", "total_increasing"]},
        "unit_of_measurement": {"type": "string"},
        "entity_category": {"enum": ["config", "diagnostic"]},
    },
}
BINARY_CLASSES = {"connectivity", "running", "problem"}
CONFIG_TOPIC = re.compile(r"^(?P<prefix>[^/]+)/(?P<component>binary_sensor|sensor)/[A-Za-z0-9_-]+/"
                          r"[A-Za-z0-9_-]+/config$")
JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)


def check_entity(topic: str, cfg: dict[str, Any]) -> str:
    m = CONFIG_TOPIC.match(topic)
    assert m, f"{topic} is not <prefix>/<component>/<node_id>/<object_id>/config"
    jsonschema.validate(cfg, ENTITY)
    if m["component"] == "binary_sensor":
        assert cfg["device_class"] in BINARY_CLASSES, cfg
    return m["component"]


def render(template: str, payload: bytes) -> str:
    return JINJA.from_string(template).render(value_json=json.loads(payload)).strip()


HEALTH = {"connection": True, "operational": True, "state": "running", "error": False, "error_message": "",
          "service": "epuck-gateway", "node": "epuck-gateway", "device": "epuck1", "version": "0.1.0", "ts": 1.0,
          "details": {"host": "127.0.0.1"}}


def test_every_service_gets_well_formed_entities() -> None:
    catalog = FieldCatalog()
    assert {"epuck-gateway", "ethercat-loop"} <= set(catalog.states)
    for service in catalog.states:
        ents, problems = device_entities("robobus", "homeassistant", service, "dev1", {**HEALTH, "service": service},
                                         catalog, None, __version__)
        assert problems == []
        ids = [e.config["unique_id"] for e in ents]
        assert len(ids) == len(set(ids)), "unique_id must be unique"
        for e in ents:
            assert check_entity(e.topic, e.config) == e.component
            assert e.config["availability"][0]["topic"] == f"robobus/{service}/status"
    # the health flags and the default numeric fields of the e-puck (units from the field names)
    ents, _ = device_entities("robobus", "homeassistant", "epuck-gateway", "epuck1", HEALTH, catalog, None, "x")
    names = {e.config["name"]: e.config for e in ents}
    assert {"connection", "operational", "problem", "state", "error message"} <= set(names)
    assert names["sensors temperature_c"]["unit_of_measurement"] == "°C"
    assert names["sensors battery_v"]["unit_of_measurement"] == "V"
    assert "sensors seq" not in names and "sensors ts" not in names


def test_health_templates_read_real_health_and_status() -> None:
    catalog = FieldCatalog()
    ents, _ = device_entities("robobus", "homeassistant", "epuck-gateway", "epuck1", HEALTH, catalog, None, "x")
    bad = {**HEALTH, "error": True, "connection": False, "error_message": "link lost"}
    by = {e.config["name"]: e.config for e in ents}
    assert render(by["problem"]["value_template"], json.dumps(HEALTH).encode()) == "OFF"
    assert render(by["problem"]["value_template"], json.dumps(bad).encode()) == "ON"
    assert render(by["connection"]["value_template"], json.dumps(bad).encode()) == "OFF"
    assert render(by["error message"]["value_template"], json.dumps(bad).encode()) == "link lost"
    assert json.loads(render(by["state"]["json_attributes_template"], json.dumps(HEALTH).encode())) == HEALTH["details"]
    avail = by["problem"]["availability"][0]["value_template"]
    assert render(avail, b'{"online": true}') == "online"
    assert render(avail, b'{"online": false, "reason": "connection lost"}') == "offline"


def test_chosen_fields_are_checked_against_the_document() -> None:
    catalog = FieldCatalog()
    fields = ["ethercat-loop/joints/joints.FFJ3.position", "ethercat-loop/joints/nope",
              "ethercat-loop/joints/joints.FFJ3.name", "ethercat-loop/nothing/x", "epuck-gateway/sensors/proximity.2"]
    ents, problems = device_entities("robobus", "homeassistant", "ethercat-loop", "rh",
                                     {**HEALTH, "service": "ethercat-loop"}, catalog, fields, "x")
    assert len(problems) == 3, problems
    assert any("no field 'nope'" in p for p in problems) and any("not numeric" in p for p in problems)
    sensors = [e for e in ents if e.config.get("state_class")]
    assert [e.config["name"] for e in sensors] == ["joints joints.FFJ3.position"]
    joints = {"ts": 1.0, "cycle": 3, "sensors_raw": {}, "joints": [
        {"name": "FFJ2", "position": 0.5, "raw": [1]}, {"name": "FFJ3", "position": 0.25, "raw": [2]}]}
    assert float(render(sensors[0].config["value_template"], json.dumps(joints).encode())) == 0.25
    ents, _ = device_entities("robobus", "homeassistant", "epuck-gateway", "epuck1", HEALTH, catalog, fields, "x")
    prox = [e for e in ents if e.config.get("state_class")]
    assert render(prox[0].config["value_template"], json.dumps({"proximity": [5, 6, 7]}).encode()) == "7"


def _ha(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "shared.tools.cli", "homeassistant", *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_bad_field_setting_stops_with_one_clear_line(broker_session: Broker) -> None:
    p = _ha({"ROBOBUS_MQTT_URL": broker_session.url,
             "ROBOBUS_HOMEASSISTANT_FIELDS": '["ethercat-loop/joints/joints.FFJ3.speed"]'})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "invalid setting homeassistant_fields" in out.decode() and "speed" in out.decode()


@pytest.mark.slow
def test_process_publishes_republishes_and_tracks_availability(broker_session: Broker, client: RpcClient,
                                                               spawn: Any) -> None:
    tag = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    node, prefix = f"hand-ha-{tag}", f"ha{tag}"
    hand = spawn(["-m", "services.ethercat_loop"], {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node,
                                                    "ROBOBUS_ETHERCAT_BACKEND": "model"})
    env = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_HOMEASSISTANT_PREFIX": prefix,
           "ROBOBUS_HOMEASSISTANT_FIELDS": json.dumps(["ethercat-loop/joints/joints.FFJ3.position"])}
    ha = _ha(env)
    try:
        configs: dict[str, dict[str, Any]] = {}
        arrivals: list[str] = []

        def on(msg: Any) -> None:
            if f"robobus_robobus_{node.replace('-', '_')}" in msg.topic.replace("-", "_"):
                configs[msg.topic] = json.loads(msg.payload)
                arrivals.append(msg.topic)

        client.subscribe_before(f"{prefix}/#", on)
        # health flags (5) + the chosen joint
        assert wait_for(lambda: len(configs) >= 6, 60), (configs.keys(), hand.text())
        for topic, cfg in configs.items():
            check_entity(topic, cfg)
        # retained: a Home Assistant that starts later still finds them
        # (a filter of its own: collect() unsubscribes its filter when done)
        retained = [t for t, _p, r in client.collect_retained(f"{prefix}/+/#") if r and node.replace("-", "_") in
                    t.replace("-", "_")]
        assert len(retained) >= 6
        # the templates read the node's real messages
        health = client.collect_retained(f"robobus/{node}/rh/health")[-1][1]
        state = next(p for _t, p, _r in client.collect(f"robobus/{node}/rh/state/joints", 2.0))
        by = {c["name"]: c for c in configs.values()}
        assert render(by["connection"]["value_template"], health) in ("ON", "OFF")
        float(render(by["joints joints.FFJ3.position"]["value_template"], state))
        avail = by["problem"]["availability"][0]
        status = client.collect_retained(avail["topic"])[-1][1]
        assert render(avail["value_template"], status) == "online"
        # Home Assistant restarts: everything again
        before = len(arrivals)
        client.session.publish(f"{prefix}/status", "online", qos=1)
        assert wait_for(lambda: len(arrivals) >= before + 6, 30), (ha.poll(), len(arrivals), before)
        # garbage on a health topic is counted and skipped; the process stays up
        client.session.publish(f"robobus/{node}/junk/health", b"\xff not json", qos=1)
        client.session.publish(f"robobus/{node}/rh/state/joints", b"\xff not json", qos=1)  # not retained
        time.sleep(0.5)
        assert ha.poll() is None
        # the node dies: its Will makes every entity unavailable
        os.killpg(hand.proc.pid, signal.SIGKILL)
        assert wait_for(lambda: render(avail["value_template"], client.collect_retained(avail["topic"])[-1][1])
                        == "offline", 15)
    finally:
        ha.send_signal(signal.SIGTERM)
        out, _ = ha.communicate(timeout=20)
        # cleanup: clear this test's retained configs
        for t in configs:
            client.session.publish(t, b"", qos=1, retain=True)
    text = out.decode()
    assert ha.returncode == 0, text
    assert "ignoring health" in text and "ignoring state" in text


def _health(service: str = "epuck-gateway") -> bytes:
    return json.dumps({"service": service, "version": "1.0", "connection": True, "operational": True,
                       "error": False, "state": "streaming", "error_message": "", "details": {},
                       "ts": time.time()}).encode()


def _status(devices: list[str] | None) -> bytes:
    if devices is None:
        return json.dumps({"online": False, "reason": "connection lost", "ts": time.time()}).encode()
    return json.dumps({"online": True, "service": "epuck-gateway", "devices": devices, "ts": time.time()}).encode()


def test_configs_of_vanished_devices_are_removed(broker_session: Broker, client: RpcClient) -> None:
    """Home Assistant's rule: an empty retained payload on a config topic deletes the entity. A device that
    leaves its node's device list, whose health is cleared, or whose node's status is cleared, has every
    config removed, also when that happened while the discovery process was not running; a node merely
    offline keeps its entities."""
    from shared.tools.dashboard.homeassistant import Discovery, HomeAssistantSettings

    tag = f"{os.getpid()}x{time.monotonic_ns() % 100000}"
    root, prefix, node = f"hadel{tag}", f"hadelp{tag}", "gw"
    latest: dict[str, bytes] = {}
    lock = __import__("threading").Lock()

    def on(msg: Any) -> None:
        with lock:
            latest[msg.topic] = bytes(msg.payload)

    client.subscribe_before(f"{prefix}/#", on)

    def live(device: str) -> set[str]:
        """The config topics of `device` whose last payload is a config (not a removal)."""
        ident = f"robobus_{root}_{node}_{device}"
        with lock:
            return {t for t, p in latest.items()
                    if t.endswith("/config") and p and json.loads(p)["device"]["identifiers"] == [ident]}

    def removed(topics: set[str]) -> bool:
        with lock:
            return all(latest.get(t) == b"" for t in topics)

    def pub(topic: str, payload: bytes) -> None:
        client.session.publish(f"{root}/{topic}", payload, qos=1, retain=True)

    settings = HomeAssistantSettings(mqtt_url=broker_session.url, topic_root=root, homeassistant_prefix=prefix)
    pub(f"{node}/status", _status(["e1", "e2", "e3"]))
    for dev in ("e1", "e2", "e3"):
        pub(f"{node}/{dev}/health", _health())
    d1 = Discovery(settings, __version__)
    d1.start()
    try:
        assert wait_for(lambda: all(len(live(d)) >= 5 for d in ("e1", "e2", "e3")), 30), latest.keys()
        made = {d: live(d) for d in ("e1", "e2", "e3")}
        # e3 leaves the node's contract: its node comes online without it
        pub(f"{node}/status", _status(["e1", "e2"]))
        assert wait_for(lambda: removed(made["e3"]), 15), made["e3"]
        # e2's retained health is cleared (the operator decommissions it)
        pub(f"{node}/e2/health", b"")
        assert wait_for(lambda: removed(made["e2"]), 15)
        assert live("e1") == made["e1"]
        # the empty payloads were retained: the broker no longer holds these configs
        retained = {t for t, p, r in client.collect_retained(f"{prefix}/+/+/+/config") if r and p}
        assert retained >= made["e1"] and not retained & (made["e2"] | made["e3"])
    finally:
        d1.stop()
    # e1 vanishes while no discovery process runs (its stale retained health stays); the next run removes it
    pub(f"{node}/status", _status([]))
    d2 = Discovery(settings, __version__)
    d2.start()
    try:
        assert wait_for(lambda: removed(made["e1"]), 15), made["e1"]
        # a node merely offline keeps its entities (unavailable); a cleared status removes them
        pub(f"{node}/status", _status(["e4"]))
        pub(f"{node}/e4/health", _health())
        assert wait_for(lambda: len(live("e4")) >= 5, 15)
        e4 = live("e4")
        pub(f"{node}/status", _status(None))
        rounds = d2.rounds
        client.session.publish(f"{prefix}/status", "online", qos=1)  # something observable after the offline
        assert wait_for(lambda: d2.rounds > rounds, 15)
        assert live("e4") == e4
        pub(f"{node}/status", b"")
        assert wait_for(lambda: removed(e4), 15), e4
        assert d2.removed >= len(e4) + len(made["e1"])
    finally:
        d2.stop()
        for t in list(latest):
            client.session.publish(t, b"", qos=1, retain=True)
        for dev in ("e1", "e2", "e3", "e4"):
            pub(f"{node}/{dev}/health", b"")
        pub(f"{node}/status", b"")


def _timestamp_utc(value: Any) -> str:
    """Home Assistant's `timestamp_utc` filter."""
    import datetime

    return datetime.datetime.fromtimestamp(float(value), datetime.UTC).isoformat()


def test_counters_timestamps_and_ids_get_their_own_classes() -> None:
    """Counters are total_increasing (a window's counts stay measurements), timestamps a timestamp device class,
    ids, kinds, bit masks and switches no state class; readings and rates measurements."""
    catalog = FieldCatalog()

    def by_name(service: str) -> dict[str, dict[str, Any]]:
        ents, problems = device_entities("robobus", "homeassistant", service, "d", {**HEALTH, "service": service},
                                         catalog, None, "x")
        assert problems == []
        return {e.config["name"]: e.config for e in ents}

    expected: dict[str, dict[str, str | None]] = {
        "epuck-gateway": {"link images_received": "total_increasing", "link framing_errors": "total_increasing",
                          "link reconnects": "total_increasing", "link sensors_per_s": "measurement",
                          "sensors battery_v": "measurement", "sensors selector": None},
        "ethercat-loop": {"loop_stats total_cycles": "total_increasing", "loop_stats total_overruns":
                          "total_increasing", "loop_stats decode_errors": "measurement",
                          "loop_stats jitter_max_us": "measurement", "tactile type": None, "tactile valid": None},
        "roi-modules": {"link sent": "total_increasing", "link lost_packets_since_connect": "total_increasing",
                        "power voltage": "measurement"},
        "dexter-gateway": {"status instruction_id": None, "status robot_time": None},
    }
    for service, classes in expected.items():
        got = by_name(service)
        for name, cls in classes.items():
            assert got[name].get("state_class") == cls, (service, name, got[name])
    dexter = by_name("dexter-gateway")
    robot_time = dexter["status robot_time"]
    assert robot_time["device_class"] == "timestamp" and "unit_of_measurement" not in robot_time
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["timestamp_utc"] = _timestamp_utc
    shown = env.from_string(robot_time["value_template"]).render(value_json={"robot_time": 1700000000.5})
    assert shown == "2023-11-14T22:13:20.500000+00:00"
    assert "device_class" not in dexter["status instruction_id"]


def test_a_nullable_field_is_unavailable_when_null() -> None:
    """A field the contract allows to be null has an availability entry on its own state topic: null (or missing)
    is "offline", so Home Assistant shows the sensor unavailable; node and discovery process are the others."""
    catalog = FieldCatalog()
    ents, _ = device_entities("robobus", "homeassistant", "roi-modules", "roi_arm",
                              {**HEALTH, "service": "roi-modules"}, catalog, None, "x")
    by = {e.config["name"]: e.config for e in ents}
    pos = by["state position"]
    assert pos["availability_mode"] == "all"
    node, process, site, value = pos["availability"]
    assert node["topic"] == "robobus/roi-modules/status"
    assert process == {"topic": "homeassistant/robobus/robobus/availability"}
    assert site == {"topic": "homeassistant/robobus/robobus/reachable"}
    assert value["topic"] == pos["state_topic"]
    assert render(value["value_template"], b'{"position": null, "velocity": null, "ts": 1}') == "offline"
    assert render(value["value_template"], b'{"velocity": null, "ts": 1}') == "offline"
    assert render(value["value_template"], b'{"position": 0.0, "velocity": null, "ts": 1}') == "online"
    # a field that is never null has no such entry (its node, the process and the site only)
    assert len(by["power voltage"]["availability"]) == 3
    # health: its node and the site (not the process: it need not run)
    assert [a["topic"] for a in by["connection"]["availability"]] == [
        "robobus/roi-modules/status", "homeassistant/robobus/robobus/reachable"]
    assert by["connection"]["availability_mode"] == "all"


def test_sensors_follow_the_states_a_device_publishes(broker_session: Broker, client: RpcClient,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPIO module's health and its `link` state on the bus: the link's sensors are announced and fed from the
    process's republished topic; an earlier run's `power` sensor for it (a state it never publishes) is removed
    once its states have settled; the `power` sensors come as soon as the state does."""
    from shared.tools.dashboard import homeassistant
    from shared.tools.dashboard.homeassistant import Discovery, HomeAssistantSettings

    monkeypatch.setattr(homeassistant, "SETTLE_S", 1.0)
    tag = f"{os.getpid()}s{time.monotonic_ns() % 100000}"
    root, prefix, node, dev = f"haseen{tag}", f"haseenp{tag}", "roi", "io"
    latest: dict[str, bytes] = {}
    lock = __import__("threading").Lock()

    def on(msg: Any) -> None:
        with lock:
            latest[msg.topic] = bytes(msg.payload)

    client.subscribe_before(f"{prefix}/#", on)

    def names() -> set[str]:
        with lock:
            return {json.loads(p)["name"] for t, p in latest.items() if t.endswith("/config") and p}

    node_id = f"robobus_{root}_{node}"
    old_power = f"{prefix}/sensor/{node_id}/{dev}_power_voltage/config"
    old_cfg = {"name": "power voltage", "unique_id": f"{node_id}_{dev}_power_voltage",
               "state_topic": f"{root}/{node}/{dev}/state/power", "value_template": "{{ value_json.voltage }}",
               "device": {"identifiers": [f"{node_id}_{dev}"], "name": f"{node} {dev}"}}
    retained = [old_power, f"{root}/{node}/status", f"{root}/{node}/{dev}/health", f"{root}/{node}/{dev}/state/link"]
    client.session.publish(old_power, json.dumps(old_cfg), qos=1, retain=True)
    client.session.publish(retained[1], json.dumps({"online": True, "devices": [dev]}), qos=1, retain=True)
    client.session.publish(retained[2], _health("roi-modules"), qos=1, retain=True)
    link = {"connected": True, "lost_packets_since_connect": 0, "lost_packets_accumulated": 2, "sent": 10,
            "resent": 1, "replies": 9, "unmatched": 0, "bad_checksum": 0, "ts": time.time()}
    client.session.publish(retained[3], json.dumps(link), qos=1, retain=True)
    settings = HomeAssistantSettings(mqtt_url=broker_session.url, topic_root=root, homeassistant_prefix=prefix)
    d = Discovery(settings, __version__)
    d.start()
    try:
        assert wait_for(lambda: "link sent" in names(), 30), names()
        link_cfg = next(json.loads(p) for t, p in latest.items() if t.endswith("/config") and p
                        and json.loads(p)["name"] == "link sent")
        assert link_cfg["state_topic"] == f"{prefix}/robobus/{root}/{node}/{dev}/link"
        assert wait_for(lambda: latest.get(link_cfg["state_topic"]) == json.dumps(link).encode(), 15)
        assert wait_for(lambda: latest.get(old_power) == b"", 30), "the never-published state's sensor stayed"
        assert not {n for n in names() if n.startswith(("power", "state ", "temperature"))}, names()
        power = f"{root}/{node}/{dev}/state/power"
        retained.append(power)
        client.session.publish(power, json.dumps({"voltage": 24.0, "current": 0.5, "ts": time.time()}), qos=1,
                               retain=True)
        assert wait_for(lambda: {"power voltage", "power current"} <= names(), 15), names()
    finally:
        d.stop()
        with lock:
            ours = [t for t, p in latest.items() if p]
        for t in ours + retained:
            client.session.publish(t, b"", qos=1, retain=True)
