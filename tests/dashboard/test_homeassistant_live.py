"""Home Assistant discovery against live services: what Home Assistant would show, computed from what it reads.

One stack for the module: a real mosquitto (the session's), two simulated e-puck2 robots on TCP with
epuck-gateway (sensors at its default 50 Hz), three simulated ROI modules (GPIO, ODrive, actuator) with
roi-modules, and `robobus homeassistant`, each in its own process, on a topic root and discovery prefix of the
module's own. `HomeAssistantView` plays Home Assistant's part: it subscribes to what the configs name (state
topics, availability topics) and evaluates each entity the way Home Assistant's MQTT sensor does (the value
template on the last message; availability per entry, `availability_mode`, "online"/"offline")."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import pytest

from shared.rpc import RpcClient, wait_for
from shared.tools.localbroker import Broker, NodeProcess
from tests.dashboard.stack import ROI_MODULES, free_ports, roi_prefix

UNAVAILABLE = "unavailable"


def _timestamp_utc(value: Any) -> str:
    """Home Assistant's `timestamp_utc` filter."""
    return datetime.datetime.fromtimestamp(float(value), datetime.UTC).isoformat()


JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)
JINJA.filters["timestamp_utc"] = _timestamp_utc


def render(template: str, payload: bytes) -> str:
    return JINJA.from_string(template).render(value_json=json.loads(payload)).strip()


@dataclass
class HomeAssistantView:
    """Every message on the module's root and prefix: the last payload per topic and when each arrived."""

    root: str
    prefix: str
    latest: dict[str, bytes] = field(default_factory=dict)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, msg: Any) -> None:
        with self.lock:
            self.latest[msg.topic] = bytes(msg.payload)
            self.arrivals.setdefault(msg.topic, []).append(time.monotonic())

    def configs(self, device: str | None = None) -> dict[str, dict[str, Any]]:
        """The live discovery configs (of `device`, a robobus device name), by entity name."""
        with self.lock:
            items = [(t, p) for t, p in self.latest.items() if t.startswith(f"{self.prefix}/") and
                     t.endswith("/config") and p]
        out = {}
        for _t, p in items:
            cfg = json.loads(p)
            node_device = cfg["device"]["name"]
            if device is None or node_device.split(" ", 1)[1] == device:
                out[f"{node_device}: {cfg['name']}"] = cfg
        return out

    def payload(self, topic: str) -> bytes | None:
        with self.lock:
            return self.latest.get(topic)

    def available(self, cfg: dict[str, Any]) -> bool:
        """Home Assistant's availability: each entry online / offline from its last message (no message yet:
        not available); `availability_mode` all (every entry) or latest/any (one is enough here)."""
        states = []
        for entry in cfg.get("availability", []):
            p = self.payload(entry["topic"])
            if not p:
                states.append(False)
                continue
            text = render(entry["value_template"], p) if "value_template" in entry else p.decode()
            states.append(text == entry.get("payload_available", "online"))
        if not states:
            return True
        return all(states) if cfg.get("availability_mode") == "all" else any(states)

    def state(self, cfg: dict[str, Any]) -> str | None:
        """What Home Assistant shows: unavailable, the rendered value, or None (no message yet: unknown)."""
        if not self.available(cfg):
            return UNAVAILABLE
        p = self.payload(cfg["state_topic"])
        return None if not p else render(cfg["value_template"], p)

    def count(self, topics: set[str], since: float) -> int:
        with self.lock:
            return sum(1 for t in topics for a in self.arrivals.get(t, []) if a >= since)


@dataclass
class Stack:
    broker: Broker
    root: str
    prefix: str
    view: HomeAssistantView
    procs: dict[str, NodeProcess]
    env: dict[str, dict[str, str]]
    args: dict[str, list[str]]

    def start(self, name: str) -> NodeProcess:
        self.procs[name] = NodeProcess(self.args[name], self.env[name])
        return self.procs[name]

    def kill(self, name: str) -> None:
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.text()[-3000:]}" for n, p in self.procs.items())


EPUCKS = ["epuck1", "epuck2"]
ROI = [name for name, _octet, _kind in ROI_MODULES]


@pytest.fixture(scope="module")
def stack(broker_session: Broker) -> Iterator[Stack]:
    tag = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    root, prefix = f"halive{tag}", f"halivep{tag}"
    base = free_ports(2, consecutive=True)[0]
    robots = [{"id": d, "host": "127.0.0.1", "port": base + i} for i, d in enumerate(EPUCKS)]
    net = roi_prefix()
    common = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root}
    args = {
        "epuck-sim": ["-m", "services.epuck_gateway.sim", "--count", "2", "--base-port", str(base),
                      "--free-sensors"],
        "epuck-gateway": ["-m", "services.epuck_gateway"],
        "roi-sim": ["-m", "services.roi_modules.sim", "--prefix", net, "--modules",
                    ",".join(f"{kind}:{octet}" for _, octet, kind in ROI_MODULES)],
        "roi-modules": ["-m", "services.roi_modules"],
        "homeassistant": ["-m", "shared.tools.cli", "homeassistant"],
    }
    env = {
        "epuck-sim": {},
        "epuck-gateway": {**common, "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots)},
        "roi-sim": {},
        "roi-modules": {**common, "ROBOBUS_ROI_NETWORK": net, "ROBOBUS_ROI_HOST_OCTET": "100",
                        "ROBOBUS_ROI_MODULES": json.dumps([{"name": n, "octet": o, "type": k}
                                                           for n, o, k in ROI_MODULES])},
        "homeassistant": {**common, "ROBOBUS_HOMEASSISTANT_PREFIX": prefix},
    }
    view = HomeAssistantView(root, prefix)
    client = RpcClient(broker_session.settings(), name="ha-live")
    client.connect()
    s = Stack(broker_session, root, prefix, view, {}, env, args)
    try:
        client.subscribe_before(f"{root}/#", view.on)
        client.subscribe_before(f"{prefix}/#", view.on)
        for name in args:
            s.start(name)
        devices = EPUCKS + ROI
        # every device's health entities announced, and the states' sensors the tests read (the e-pucks'
        # sensors, the ODrive's power, the actuator's state: states the devices publish within a few seconds)
        assert wait_for(lambda: all(len(view.configs(d)) >= 5 for d in devices)
                        and all(any("sensors battery_v" in k for k in view.configs(d)) for d in EPUCKS)
                        and any("power voltage" in k for k in view.configs("roi_wheel"))
                        and any(k.endswith("state position") for k in view.configs("roi_arm")), 90), s.logs()
        yield s
    finally:
        for p in s.procs.values():
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        for p in s.procs.values():
            with contextlib.suppress(Exception):
                p.proc.wait(10)
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(5)
        # clear the module's retained messages
        with view.lock:
            retained = [t for t, p in view.latest.items() if p]
        for t in retained:
            client.session.publish(t, b"", qos=1, retain=True)
        time.sleep(0.5)
        client.close()


def _sensors(view: HomeAssistantView, device: str) -> dict[str, dict[str, Any]]:
    """The state sensors (not the health entities) of a device."""
    return {k: c for k, c in view.configs(device).items() if "/health" not in c["state_topic"]}


def _published_states(view: HomeAssistantView, root: str, node: str, device: str) -> set[str]:
    with view.lock:
        return {t.rsplit("/", 1)[1] for t, p in view.latest.items()
                if t.startswith(f"{root}/{node}/{device}/state/") and p}


def test_only_what_a_device_publishes_is_announced_and_every_entity_gets_a_value(stack: Stack) -> None:
    """A ROI GPIO module never publishes `power`, `state` or `temperature` (ODrive and actuator states): none of
    their sensors is announced for it; every announced sensor's state is one the device publishes, and each
    gets a value or is unavailable (never unknown for good)."""
    view = stack.view
    io = _sensors(view, "roi_io")
    assert not [k for k in io if any(f" {s} " in k for s in ("power", "state", "temperature"))], sorted(io)
    roi_published = {d: _published_states(view, stack.root, "roi-modules", d) for d in ROI}
    assert "power" not in roi_published["roi_io"] and "power" in roi_published["roi_wheel"], roi_published

    def all_valued() -> bool:
        return all(view.state(cfg) is not None for d in ROI + EPUCKS for cfg in _sensors(view, d).values())

    assert wait_for(all_valued, 30), {k: view.state(c) for d in ROI + EPUCKS for k, c in _sensors(view, d).items()}
    for node, devices in (("roi-modules", ROI), ("epuck-gateway", EPUCKS)):
        for d in devices:
            published = _published_states(view, stack.root, node, d)
            for name, cfg in _sensors(view, d).items():
                state = cfg["state_topic"].rsplit("/", 1)[1]
                assert state in published, (name, published)


def test_a_field_without_a_value_is_unavailable_not_null(stack: Stack) -> None:
    """The actuator's position is unknown until it has moved (`position: null`): Home Assistant shows the
    sensor unavailable, never a value "None"; a numeric value is shown as a number."""
    view = stack.view
    arm = _sensors(view, "roi_arm")
    pos = next(c for k, c in arm.items() if k.endswith("state position"))
    payload = view.payload(pos["state_topic"])
    assert payload is not None
    if json.loads(payload)["position"] is None:  # the actuator has not moved since it started
        assert view.state(pos) == UNAVAILABLE
    else:
        float(view.state(pos) or "")
    # and no sensor anywhere shows "None": a value, a number unless a timestamp, or unavailable
    for d in ROI + EPUCKS:
        for name, cfg in _sensors(view, d).items():
            shown = view.state(cfg)
            assert shown is not None, name
            if shown == UNAVAILABLE:
                continue
            assert shown not in ("None", ""), (name, shown)
            if cfg.get("device_class") != "timestamp":
                float(shown)


def test_home_assistant_gets_its_own_capped_rate(stack: Stack) -> None:
    """The e-pucks publish sensors at 50 Hz; Home Assistant's topics carry at most 1 message/s per state, so it
    evaluates at most one template per entity and second (not 50)."""
    view = stack.view
    window = 5.0
    configs = {k: c for d in EPUCKS for k, c in view.configs(d).items()}
    ha_topics = {c["state_topic"] for c in configs.values()} | {a["topic"] for c in configs.values()
                                                                for a in c["availability"]}
    source = {f"{stack.root}/epuck-gateway/{d}/state/sensors" for d in EPUCKS}
    start = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - start
    per_topic = {t: view.count({t}, start) for t in ha_topics}
    ha_rate = sum(per_topic.values()) / elapsed
    templates = sum(view.count({c["state_topic"]}, start) for c in configs.values()) / elapsed
    src_rate = view.count(source, start) / elapsed
    links = [view.payload(f"{stack.root}/epuck-gateway/{d}/state/link") for d in EPUCKS]
    received = [json.loads(p).get("sensors_per_s") for p in links if p]
    print(f"\nHome Assistant's topics: {ha_rate:.1f} messages/s, {templates:.0f} value templates/s for "
          f"{len(configs)} entities; the e-pucks' sensors: {src_rate:.1f} messages/s (received from the robots: "
          f"{received} packets/s)")
    # one message a second per state at most (the first of the window may fall at its very start)
    for t, n in per_topic.items():
        assert n <= window + 1, (t, n)
    sensors_ha = {c["state_topic"] for k, c in configs.items() if " sensors " in k}
    assert len(sensors_ha) == len(EPUCKS)
    assert view.count(sensors_ha, start) < view.count(source, start), "the sensors were not faster than the cap"
    assert view.count(sensors_ha, start) >= len(EPUCKS), "Home Assistant got no sensors in the window"


def test_unavailable_when_a_node_or_the_discovery_process_dies_and_back(stack: Stack) -> None:
    """kill -9 of epuck-gateway: its Last Will makes every e-puck entity unavailable (not its last values), and
    they come back when it does. kill -9 of the discovery process: its own Last Will makes the sensors it feeds
    unavailable (the health entities read the node's topics and stay true); back when it returns."""
    view = stack.view

    def shown(device: str) -> dict[str, str | None]:
        return {k: view.state(c) for k, c in view.configs(device).items()}

    assert wait_for(lambda: all(v not in (None, UNAVAILABLE) for d in EPUCKS for k, v in shown(d).items()
                                if "acceleration" not in k), 30), shown("epuck1")
    stack.kill("epuck-gateway")
    assert wait_for(lambda: all(v == UNAVAILABLE for d in EPUCKS for v in shown(d).values()), 30), shown("epuck1")
    stack.start("epuck-gateway")
    assert wait_for(lambda: all(v not in (None, UNAVAILABLE) for d in EPUCKS for k, v in shown(d).items()
                                if "acceleration" not in k), 60), (shown("epuck1"), stack.logs())

    stack.kill("homeassistant")
    avail = f"{stack.prefix}/robobus/{stack.root}/availability"
    assert wait_for(lambda: view.payload(avail) == b"offline", 30)
    for d in EPUCKS + ROI:
        for name, cfg in view.configs(d).items():
            expect_unavailable = "/health" not in cfg["state_topic"]
            assert (view.state(cfg) == UNAVAILABLE) == expect_unavailable, (name, view.state(cfg))
    stack.start("homeassistant")
    assert wait_for(lambda: view.payload(avail) == b"online", 30), stack.logs()
    assert wait_for(lambda: all(v not in (None, UNAVAILABLE) for d in EPUCKS for k, v in shown(d).items()
                                if "acceleration" not in k), 60), shown("epuck1")


def test_a_cut_site_s_devices_are_unavailable_until_it_is_back(stack: Stack) -> None:
    """At a fleet's centre fleet-watch says a cut site unreachable on {root}/_bridge/reachable: every entity of
    every device, health included, is unavailable (what the centre holds is the last known), and each that showed
    a value shows one again when the site is reachable."""
    view = stack.view

    def shown() -> dict[str, str | None]:
        return {k: view.state(c) for d in EPUCKS + ROI for k, c in view.configs(d).items()}

    mirror = f"{stack.prefix}/robobus/{stack.root}/reachable"
    health = ("connection", "operational", "problem", "state", "error message")
    assert wait_for(lambda: sum(k.endswith(health) and v not in (None, UNAVAILABLE) for k, v in shown().items())
                    >= 5 * len(EPUCKS + ROI), 60), shown()
    before = {k for k, v in shown().items() if v not in (None, UNAVAILABLE)}
    assert view.payload(mirror) == b"online"
    client = RpcClient(stack.broker.settings(), name="ha-live-watch")
    client.connect()
    try:  # published as fleet-watch would, retained
        client.session.publish(f"{stack.root}/_bridge/reachable", b"0", qos=1, retain=True)
        assert wait_for(lambda: all(v == UNAVAILABLE for v in shown().values()), 30), shown()
        assert view.payload(mirror) == b"offline"
        client.session.publish(f"{stack.root}/_bridge/reachable", b"1", qos=1, retain=True)
        assert wait_for(lambda: all(shown()[k] not in (None, UNAVAILABLE) for k in before), 30), shown()
    finally:
        client.session.publish(f"{stack.root}/_bridge/reachable", b"", qos=1, retain=True)
        client.close()
