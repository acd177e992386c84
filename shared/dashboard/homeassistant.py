"""Home Assistant MQTT discovery for every robobus device (`robobus homeassistant`).

A small process that watches the retained `{root}/+/status` and `{root}/+/+/health` topics and, for every
device it sees, publishes retained discovery configs under `{prefix}/<component>/<node_id>/<object_id>/config`:
binary sensors for the health flags (connection, operational, problem), text sensors for the health state
and message, and sensors for chosen numeric state fields, all with availability from the node's status
topic (its Last Will turns them unavailable). Everything is re-published when Home Assistant announces
itself on `{prefix}/status` ("online"), as Home Assistant asks integrations to do after it restarts.

A device gone for good has its configs removed the way Home Assistant's discovery asks: an empty retained
payload on each of its config topics (Home Assistant deletes the entity, the broker the retained config).
Gone for good means: its node comes online with a device list without it (it left the node's contract), its
retained health is cleared, or its node's retained status is cleared (the node is decommissioned). A node
that is merely offline (Last Will, shutdown) keeps its entities, unavailable. The process also reads back the
retained configs under its own node ids, so configs left by an earlier run for a device that is gone are
removed too.

Which state fields become sensors comes from the AsyncAPI document: by default every top-level numeric
field of every JSON state (not `ts`/`seq`); ROBOBUS_HOMEASSISTANT_FIELDS picks others, e.g.
`["ethercat-loop/joints/joints.FFJ3.position", "epuck-gateway/sensors/battery_v"]` (a segment after an
array of named items is the item's name). A field that is not in the document is reported and skipped."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import paho.mqtt.client as mqtt
import typer
from pydantic import Field

from shared.mqtt import MqttSession, unique_client_id
from shared.settings import KitSettings, load_settings

log = logging.getLogger("robobus.homeassistant")

SKIP_FIELDS = {"ts", "seq", "session", "cycle"}
AVAILABILITY_TEMPLATE = "{{ 'online' if value_json.online else 'offline' }}"
# units Home Assistant understands, from the field-name conventions the services use
UNITS = [(re.compile(p), u) for p, u in (
    (r"_v$|_volts$", "V"), (r"_c$", "°C"), (r"_deg$", "°"), (r"_dps$", "°/s"), (r"_mm$", "mm"), (r"_ut$", "µT"),
    (r"_g$", "g"), (r"_ms$", "ms"), (r"_us$", "µs"), (r"_s$", "s"), (r"_hz$", "Hz"), (r"_pct$|_percent$", "%"),
    (r"_per_s$", "/s"))]


class HomeAssistantSettings(KitSettings):
    """ROBOBUS_HOMEASSISTANT_* (the broker and topic root are the kit's)."""

    homeassistant_prefix: str = Field("homeassistant", description="Home Assistant's discovery prefix")
    homeassistant_fields: list[str] | None = Field(
        None, description="State fields as sensors, 'service/state/path'; default: every top-level numeric field")


@dataclass(frozen=True)
class Entity:
    """One discovery config: where it goes and what it says."""

    component: str
    topic: str
    config: dict[str, Any]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def _unit(name: str) -> str | None:
    for pat, unit in UNITS:
        if pat.search(name):
            return unit
    return None


class FieldCatalog:
    """Numeric state fields per service, from the AsyncAPI document, with the Jinja template that reads each."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.schemas: dict[str, Any] = doc["components"]["schemas"]
        self.states: dict[str, dict[str, Any]] = {}  # service -> state name -> schema
        messages = doc["components"]["messages"]
        for cid, ch in doc["channels"].items():
            m = re.fullmatch(r"\{root\}/\{node\}/\{device\}/state/([^/]+)", ch.get("address") or "")
            if not m or not cid.endswith(f"_state_{m.group(1)}"):
                continue
            msg = messages[next(iter(ch["messages"].values()))["$ref"].rsplit("/", 1)[-1]]
            if msg.get("contentType", "application/json") != "application/json":
                continue
            service = cid[: -len(f"_state_{m.group(1)}")]
            self.states.setdefault(service, {})[m.group(1)] = msg["payload"]

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        for _ in range(16):
            ref = schema.get("$ref")
            if not ref:
                break
            schema = self.schemas[ref.rsplit("/", 1)[-1]]
        alts = [a for a in schema.get("anyOf", []) if a.get("type") != "null"]
        if len(alts) == 1:
            return self.resolve(alts[0])
        types = schema.get("type")
        if isinstance(types, list) and "null" in types:  # a nullable field: {"type": ["number", "null"]}
            rest = [t for t in types if t != "null"]
            if len(rest) == 1:
                return {**schema, "type": rest[0]}
        return schema

    def default_fields(self, service: str) -> list[tuple[str, str]]:
        out = []
        for state, schema in sorted(self.states.get(service, {}).items()):
            for name, prop in self.resolve(schema).get("properties", {}).items():
                if name not in SKIP_FIELDS and self.resolve(prop).get("type") in ("number", "integer"):
                    out.append((state, name))
        return out

    def template(self, service: str, state: str, path: str) -> str:
        """The value_template for `path` in `state`; ValueError when the document has no such numeric field."""
        schema = self.states.get(service, {}).get(state)
        if schema is None:
            raise ValueError(f"{service} has no JSON state {state!r}")
        expr = "value_json"
        for seg in path.split("."):
            s = self.resolve(schema)
            if s.get("type") == "array":
                items = self.resolve(s.get("items", {}))
                if "name" in items.get("properties", {}):
                    expr = f"({expr} | selectattr('name', 'equalto', {json.dumps(seg)}) | first)"
                elif seg.isdigit():
                    expr = f"{expr}[{int(seg)}]"
                else:
                    raise ValueError(f"{service}/{state}: {seg!r} does not index the list at {expr}")
                schema = items
                continue
            props = s.get("properties", {})
            if seg in props:
                expr = f"{expr}[{json.dumps(seg)}]"
                schema = props[seg]
            elif isinstance(s.get("additionalProperties"), dict):
                expr = f"{expr}[{json.dumps(seg)}]"
                schema = s["additionalProperties"]
            else:
                raise ValueError(f"{service}/{state}: no field {seg!r}")
        if self.resolve(schema).get("type") not in ("number", "integer"):
            raise ValueError(f"{service}/{state}/{path} is not numeric")
        return "{{ " + expr + " }}"


def device_entities(root: str, prefix: str, node: str, device: str, health: dict[str, Any],
                    catalog: FieldCatalog, fields: list[str] | None, version: str) -> tuple[list[Entity], list[str]]:
    """Discovery configs for one device; and the problems with chosen fields (reported, skipped)."""
    service = str(health.get("service", ""))
    base = f"{root}/{node}/{device}"
    node_id = _slug(f"robobus_{root}_{node}")
    ident = _slug(f"robobus_{root}_{node}_{device}")
    common = {
        "availability": [{"topic": f"{root}/{node}/status", "value_template": AVAILABILITY_TEMPLATE}],
        "device": {"identifiers": [ident], "name": f"{node} {device}", "manufacturer": "robobus",
                   "model": service, "sw_version": str(health.get("version", ""))},
        "origin": {"name": "robobus", "sw_version": version},
    }
    entities: list[Entity] = []

    def add(component: str, key: str, name: str, extra: dict[str, Any]) -> None:
        object_id = _slug(f"{device}_{key}")
        cfg = {"name": name, "unique_id": f"{ident}_{_slug(key)}", **extra, **common}
        entities.append(Entity(component, f"{prefix}/{component}/{node_id}/{object_id}/config", cfg))

    health_topic = f"{base}/health"
    flags = (("connection", "connection", "connectivity"), ("operational", "operational", "running"))
    for key, fld, cls in flags:
        add("binary_sensor", key, key, {"state_topic": health_topic, "device_class": cls,
                                        "value_template": f"{{{{ 'ON' if value_json.{fld} else 'OFF' }}}}",
                                        "entity_category": "diagnostic"})
    add("binary_sensor", "problem", "problem", {"state_topic": health_topic, "device_class": "problem",
                                                "value_template": "{{ 'ON' if value_json.error else 'OFF' }}"})
    add("sensor", "state", "state", {"state_topic": health_topic, "value_template": "{{ value_json.state }}",
                                     "json_attributes_topic": health_topic,
                                     "json_attributes_template": "{{ value_json.details | tojson }}"})
    add("sensor", "error_message", "error message",
        {"state_topic": health_topic, "value_template": "{{ value_json.error_message }}",
         "entity_category": "diagnostic"})

    problems: list[str] = []
    if fields is None:
        chosen = [(state, path) for state, path in catalog.default_fields(service)]
    else:
        chosen = []
        for spec in fields:
            svc, _, rest = spec.partition("/")
            state, _, path = rest.partition("/")
            if svc == service and state and path:
                chosen.append((state, path))
    for state, path in chosen:
        try:
            template = catalog.template(service, state, path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        leaf = path.rsplit(".", 1)[-1]
        extra: dict[str, Any] = {"state_topic": f"{base}/state/{state}", "value_template": template,
                                 "state_class": "measurement"}
        unit = _unit(leaf)
        if unit:
            extra["unit_of_measurement"] = unit
        add("sensor", f"{state}_{path}", f"{state} {path}", extra)
    return entities, problems


class Discovery:
    """The process: watch status/health, publish configs per device, again when Home Assistant comes back."""

    def __init__(self, settings: HomeAssistantSettings, doc: dict[str, Any], version: str) -> None:
        self.settings = settings
        self.root = settings.topic_root
        self.prefix = settings.homeassistant_prefix
        self.catalog = FieldCatalog(doc)
        self.version = version
        self.session = MqttSession(settings, unique_client_id("robobus-homeassistant"))
        self.health: dict[tuple[str, str], dict[str, Any]] = {}
        self.sent: dict[tuple[str, str], str] = {}  # device -> service/version its configs were made for
        self.published = 0
        self.removed = 0
        self.rounds = 0
        self.bad = 0
        self.node_devices: dict[str, set[str]] = {}  # node -> devices of its last online status
        self.topics: dict[tuple[str, str], set[str]] = {}  # device -> config topics it has on the broker
        self.current: dict[tuple[str, str], set[str]] = {}  # device -> config topics of its last publication
        self._node_id_prefix = _slug(f"robobus_{self.root}_")
        self._lock = threading.Lock()

    def start(self) -> None:
        self.session.subscribe(f"{self.root}/+/status", self._on_status)
        self.session.subscribe(f"{self.root}/+/+/health", self._on_health)
        # our own retained configs, including an earlier run's: what a removal has to clear
        self.session.subscribe(f"{self.prefix}/+/+/+/config", self._on_config)
        self.session.subscribe(f"{self.prefix}/status", self._on_ha_status)
        self.session.start()

    def stop(self) -> None:
        self.session.stop()

    def _on_status(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(self.root) + 1:].split("/")
        if len(parts) != 2:
            return
        node = parts[0]
        if not msg.payload:  # the retained status cleared: the node is gone for good
            with self._lock:
                self.node_devices.pop(node, None)
                gone = [k for k in self._known() if k[0] == node]
            for key in gone:
                self.remove_device(*key, why="its node's status was cleared")
            return
        try:
            status = json.loads(msg.payload)
            devices = status["devices"] if status.get("online") else None
            if devices is not None and not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
                raise ValueError("devices is not a list of names")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            self.bad += 1
            log.warning("ignoring status on %s: %s (%d bad so far)", msg.topic, exc, self.bad)
            return
        if devices is None:  # offline: its entities turn unavailable through availability, and stay
            return
        with self._lock:
            self.node_devices[node] = set(devices)
            gone = [k for k in self._known() if k[0] == node and k[1] not in devices]
        for key in gone:
            self.remove_device(*key, why="no longer in its node's device list")

    def _known(self) -> set[tuple[str, str]]:
        """Every device with health seen or configs on the broker (under the lock)."""
        return set(self.health) | {k for k, t in self.topics.items() if t}

    def _listed(self, node: str, device: str) -> bool:
        """False when the node's last online status leaves the device out (under the lock)."""
        listed = self.node_devices.get(node)
        return listed is None or device in listed

    def _on_config(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) != 5 or not parts[2].startswith(self._node_id_prefix):
            return  # another integration's entity
        if not msg.payload:
            with self._lock:
                for topics in self.topics.values():
                    topics.discard(msg.topic)
            return
        try:
            cfg = json.loads(msg.payload)
            where = str(cfg["state_topic"])[len(self.root) + 1:].split("/")
            if not str(cfg["state_topic"]).startswith(f"{self.root}/") or len(where) < 3:
                raise ValueError(f"state_topic {cfg['state_topic']!r} is not a device's")
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring discovery config on %s: %s", msg.topic, exc)
            return
        key = (where[0], where[1])
        with self._lock:
            current = self.current.get(key)
            if current is not None and msg.topic not in current:
                outdated = True  # an entity this run no longer makes for a device it has published
            else:
                outdated = False
                self.topics.setdefault(key, set()).add(msg.topic)
            stale = not self._listed(*key) and key not in self.health
        if outdated:
            self.session.publish(msg.topic, b"", qos=1, retain=True)
            self.removed += 1
        elif stale:  # an earlier run's config for a device that has left its node
            self.remove_device(*key, why="no longer in its node's device list")

    def remove_device(self, node: str, device: str, why: str) -> int:
        """Delete a device's entities from Home Assistant: an empty retained payload on each config topic."""
        with self._lock:
            self.health.pop((node, device), None)
            self.sent.pop((node, device), None)
            self.current.pop((node, device), None)
            topics = sorted(self.topics.pop((node, device), set()))
        for topic in topics:
            self.session.publish(topic, b"", qos=1, retain=True)
        self.removed += len(topics)
        if topics:
            log.info("discovery: removed %d entities of %s/%s (%s)", len(topics), node, device, why)
        return len(topics)

    def _on_health(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(self.root) + 1:].split("/")
        if len(parts) != 3:
            return
        if not msg.payload:  # the retained health cleared: the device is gone for good
            self.remove_device(parts[0], parts[1], why="its health was cleared")
            return
        try:
            health = json.loads(msg.payload)
            if not isinstance(health, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            self.bad += 1
            log.warning("ignoring health on %s: %s (%d bad so far)", msg.topic, exc, self.bad)
            return
        key = (parts[0], parts[1])
        with self._lock:
            listed = self._listed(*key)
        if not listed:  # a stale retained health of a device its node no longer has
            self.remove_device(*key, why="no longer in its node's device list")
            return
        with self._lock:
            self.health[key] = health
            ident = f"{health.get('service')}/{health.get('version')}"
            if self.sent.get(key) == ident:
                return
            self.sent[key] = ident
        self.publish_device(*key)

    def _on_ha_status(self, msg: mqtt.MQTTMessage) -> None:
        if msg.payload.strip().lower() == b"online":
            log.info("Home Assistant is online: publishing every discovery config again")
            self.publish_all()

    def publish_device(self, node: str, device: str) -> int:
        with self._lock:
            health = self.health.get((node, device))
        if health is None:  # removed meanwhile
            return 0
        entities, problems = device_entities(self.root, self.prefix, node, device, health, self.catalog,
                                             self.settings.homeassistant_fields, self.version)
        for p in problems:
            log.warning("homeassistant field skipped: %s", p)
        made = {e.topic for e in entities}
        with self._lock:
            known = self.topics.setdefault((node, device), set())
            dropped = sorted(known - made)  # entities of an earlier field setting or version
            known.clear()
            known.update(made)
            self.current[(node, device)] = made
        for topic in dropped:
            self.session.publish(topic, b"", qos=1, retain=True)
        self.removed += len(dropped)
        for e in entities:
            self.session.publish(e.topic, json.dumps(e.config), qos=1, retain=True)
        self.published += len(entities)
        log.info("discovery: %d entities for %s/%s", len(entities), node, device)
        return len(entities)

    def publish_all(self) -> None:
        with self._lock:
            keys = sorted(self.health)
        for node, device in keys:
            self.publish_device(node, device)
        self.rounds += 1


def homeassistant(
    prefix: Annotated[str | None, typer.Option(help="Discovery prefix (ROBOBUS_HOMEASSISTANT_PREFIX)")] = None,
    broker: Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (ROBOBUS_MQTT_URL)")] = None,
    root: Annotated[str | None, typer.Option(help="Topic root (ROBOBUS_TOPIC_ROOT)")] = None,
) -> None:
    """Publish Home Assistant MQTT discovery configs for every robobus device, until stopped."""
    from shared import __version__
    from shared.asyncapi import build_document
    from shared.logs import setup_logging

    overrides = {k: v for k, v in (("homeassistant_prefix", prefix), ("mqtt_url", broker), ("topic_root", root))
                 if v is not None}
    s = load_settings(HomeAssistantSettings, **overrides)
    setup_logging(s.log_level, s.log_json)
    d = Discovery(s, build_document(), __version__)
    catalog_problems = [p for f in s.homeassistant_fields or [] for p in _check_field(d.catalog, f)]
    if catalog_problems:
        print(f"robobus: invalid setting homeassistant_fields: {'; '.join(catalog_problems)}", file=sys.stderr)
        raise typer.Exit(2)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    d.start()
    log.info("Home Assistant discovery under %s/ for %s/ on %s", s.homeassistant_prefix, s.topic_root, s.mqtt_url)
    stop.wait()
    d.stop()


def _check_field(catalog: FieldCatalog, spec: str) -> list[str]:
    svc, _, rest = spec.partition("/")
    state, _, path = rest.partition("/")
    if not (svc and state and path):
        return [f"{spec!r} is not 'service/state/field.path'"]
    try:
        catalog.template(svc, state, path)
    except ValueError as exc:
        return [str(exc)]
    return []
