"""Home Assistant MQTT discovery for every robobus device (`robobus homeassistant`).

A small process between the bus and Home Assistant. It watches the retained `{root}/+/status` and
`{root}/+/+/health` topics and, for every device it sees, publishes retained discovery configs under
`{prefix}/<component>/<node_id>/<object_id>/config`: binary sensors for the health flags (connection,
operational, problem) and text sensors for the health state and message, read from the node's own health topic;
and sensors for the numeric fields of the device's JSON states. Everything is re-published when Home Assistant
announces itself on `{prefix}/status` ("online"), as Home Assistant asks integrations to do after it restarts.

State sensors tell the truth (shared/tools/dashboard/README.md, "Home Assistant discovery", has the rules):
- Announced only for what the device publishes. A service's contract declares its states per service, not per
  device kind (roi-modules' `power` exists for an ODrive, never for a GPIO module), so the process subscribes to
  each JSON state of a device once its health shows up, and announces a state's sensors when that state's topic
  is first seen (retained states arrive at once). A state sensor left on the broker by an earlier run whose state
  is not seen within SETTLE_S of subscribing is removed.
- At Home Assistant's own rate: the process republishes each state's latest message, unchanged and retained, on
  `{prefix}/robobus/<root>/<node>/<device>/<state>` at most ROBOBUS_HOMEASSISTANT_RATE_HZ (default 1) times a
  second, and the sensors read that topic: a 50 Hz e-puck costs Home Assistant one message a second per state.
- Available only while their node is online (its status and Last Will), the process is online (its own retained
  `{prefix}/robobus/<root>/availability`, "offline" as its Last Will and at shutdown), the site is reachable
  and, for a field the contract allows to be null, while the last value is not null (`availability_mode: all`).
- State classes from the field: counters (`total_*`, `*_received`, `*_errors`, ...; not in a state that reports a
  window, `window_s`) are `total_increasing`; rates and readings `measurement`; timestamps (`*_time`) are
  `device_class: timestamp`; ids, kinds, bit masks and switches (`*_id`, `type`, `valid`, `selector`, `*_io`) have
  no state class.
Health entities read the node's retained health directly: they are available while the node is online and its
site reachable, whether the discovery process runs or not.

The site's reachability: at a fleet's centre, `{root}/_bridge/reachable` (fleet-watch's verdict, "1"/"0") says
whether the site's broker is heard; while it is "0" what the centre holds of the site is its last known, not its
present. The process mirrors it, retained, on `{prefix}/robobus/<root>/reachable` ("offline" for "0", "online"
otherwise, and "online" where no fleet-watch speaks: a site's own broker), and every device entity lists it in
its availability: a cut site's devices read unavailable in Home Assistant until it is back.

The bus-wide software stop of the topic root (shared/stop.py; not a hardware emergency stop) gets three entities of
its own, on a device "robobus <root>": a `button` that sets the site's stop (Home Assistant publishes a StopState,
retained, on `{root}/_stop`; its MQTT user must be allowed to write there: the operator role of
deploy/make_secrets.py's ACL), a `binary_sensor` that reads the site's retained stop, and one that reads the fleet
centre's, `{root}/_stop/fleet` (each on while its latch is active; the nodes are stopped while either is). The
button acts on the site's latch only: the fleet's is set and released at the fleet's centre. There is no release
button: a release is `robobus stop --release` (the site's latch too).

A device gone for good has its configs (and its republished states) removed the way Home Assistant's discovery
asks: an empty retained payload on each topic (Home Assistant deletes the entity, the broker the retained
message). Gone for good means: its node comes online with a device list without it (it left the node's contract),
its retained health is cleared, or its node's retained status is cleared (the node is decommissioned). A node that
is merely offline (Last Will, shutdown) keeps its entities, unavailable. The process also reads back the retained
configs under its own node ids, so configs left by an earlier run for a device that is gone are removed too.

Which state fields become sensors comes from the services' contracts (shared.registry, the `ServiceAPI` state
specs and their pydantic models): by default every top-level numeric field of every JSON state (not `ts`/`seq`);
ROBOBUS_HOMEASSISTANT_FIELDS picks others, e.g.
`["ethercat-loop/joints/joints.FFJ3.position", "epuck-gateway/sensors/battery_v"]` (a segment after an
array of named items is the item's name). A field that is not in a contract is reported and skipped."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import paho.mqtt.client as mqtt
import typer
from pydantic import Field

from shared import __version__
from shared.contract import ServiceAPI, StateSpec
from shared.mqtt.session import MqttSession, Will, unique_client_id
from shared.settings import KitSettings, load_settings

log = logging.getLogger("robobus.homeassistant")

SKIP_FIELDS = {"ts", "seq", "session", "cycle"}
AVAILABILITY_TEMPLATE = "{{ 'online' if value_json.online else 'offline' }}"
ONLINE, OFFLINE = "online", "offline"  # Home Assistant's default payload_available / payload_not_available
# A state sensor from an earlier run whose state this run has not seen this long after subscribing to the
# device's states is removed (retained states arrive at once; a state published only now and then announces its
# sensors again when it comes).
SETTLE_S = 10.0
# units Home Assistant understands, from the field-name conventions the services use
UNITS = [(re.compile(p), u) for p, u in (
    (r"_v$|_volts$|(^|_)voltage$", "V"), (r"(^|_)current$", "A"), (r"_c$|(^|_)temperature$", "°C"),
    (r"_deg$", "°"), (r"_dps$", "°/s"), (r"_mm$", "mm"), (r"_ut$", "µT"), (r"_g$", "g"), (r"_ms$", "ms"),
    (r"_us$", "µs"), (r"_per_s$", "/s"), (r"_s$", "s"), (r"_hz$", "Hz"), (r"_pct$|_percent$", "%"))]
# What a numeric field is, from its name (the services' conventions): see `field_class`.
TIMESTAMP = re.compile(r"(^|_)(time|timestamp)$")
NOT_MEASURED = re.compile(r"(^|_)(id|type|valid|selector|io|flags|mode|index)$")
RATE = re.compile(r"_per_s$")
COUNTER = re.compile(r"^total_|(^|_)(received|published|sent|resent|requested|dropped|errors|timeouts|"
                     r"reconnects|silences|replies|unmatched|bad_checksum|garbage_bytes|accumulated|since_connect)$")
WINDOW_FIELD = "window_s"  # a state with it reports counts over a window: they go up and down


class HomeAssistantSettings(KitSettings):
    """ROBOBUS_HOMEASSISTANT_* (the broker and topic root are the kit's)."""

    homeassistant_prefix: str = Field("homeassistant", description="Home Assistant's discovery prefix")
    homeassistant_fields: list[str] | None = Field(
        None, description="State fields as sensors, 'service/state/path'; default: every top-level numeric field")
    homeassistant_rate_hz: float = Field(
        1.0, gt=0, le=50, description="Messages per second per state that Home Assistant gets, at most")


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


def ha_base(prefix: str, root: str) -> str:
    """Where the process publishes for Home Assistant: its availability and the rate-capped states."""
    return f"{prefix}/robobus/{_slug(root)}"


def reachable_topic(prefix: str, root: str) -> str:
    """The process's retained mirror of the site's reachability (fleet-watch's {root}/_bridge/reachable)."""
    return f"{ha_base(prefix, root)}/reachable"


def availability_topic(prefix: str, root: str) -> str:
    return f"{ha_base(prefix, root)}/availability"


def ha_state_topic(prefix: str, root: str, node: str, device: str, state: str) -> str:
    return f"{ha_base(prefix, root)}/{node}/{device}/{state}"


def field_class(leaf: str, schema: dict[str, Any], siblings: Iterable[str]) -> dict[str, str]:
    """Home Assistant's state_class / device_class of a numeric field, from its name and type.

    Counters only count up (a restart of the service starts them again, which `total_increasing` takes as a
    reset); a count in a state that reports a window (`window_s`) goes up and down, a measurement. Timestamps,
    ids and codes are not measurements: long-term statistics of them would mean nothing."""
    if TIMESTAMP.search(leaf) or "since 1970" in str(schema.get("description", "")):
        return {"device_class": "timestamp"}
    if NOT_MEASURED.search(leaf):
        return {}
    if (schema.get("type") == "integer" and not RATE.search(leaf) and COUNTER.search(leaf)
            and (leaf.startswith("total_") or WINDOW_FIELD not in siblings)):
        return {"state_class": "total_increasing"}
    return {"state_class": "measurement"}


@dataclass(frozen=True)
class FieldInfo:
    """What a value_template reads: its Jinja expression, the field's schema, its siblings' names."""

    expr: str
    schema: dict[str, Any]
    nullable: bool
    siblings: tuple[str, ...]


class FieldCatalog:
    """Numeric fields of every JSON state per service, from the services' contracts (`ServiceAPI` state specs
    and their pydantic models, as published), with the Jinja expressions that read them."""

    def __init__(self, apis: Iterable[ServiceAPI] | None = None) -> None:
        if apis is None:
            from shared.registry import service_apis
            apis = service_apis()
        self.states: dict[str, dict[str, dict[str, Any]]] = {}  # service -> state name -> JSON schema
        self.defs: dict[str, dict[str, dict[str, Any]]] = {}  # service -> state -> the schema's $defs
        self.specs: dict[str, dict[str, StateSpec]] = {}
        for api in apis:
            for name, spec in api.states.items():
                if not isinstance(spec, StateSpec):  # binary (camera frames): nothing for a sensor
                    continue
                schema = spec.model.model_json_schema(mode="serialization")
                self.states.setdefault(api.service, {})[name] = schema
                self.defs.setdefault(api.service, {})[name] = schema.get("$defs", {})
                self.specs.setdefault(api.service, {})[name] = spec

    def resolve(self, schema: dict[str, Any], defs: dict[str, Any] | None = None) -> tuple[dict[str, Any], bool]:
        """The schema behind refs and a nullable union; and whether null is allowed."""
        nullable = False
        for _ in range(16):
            ref = schema.get("$ref")
            if ref and defs is not None:
                schema = defs[ref.rsplit("/", 1)[-1]]
                continue
            alts = schema.get("anyOf")
            if alts:
                rest = [a for a in alts if a.get("type") != "null"]
                if len(rest) == 1:
                    nullable = nullable or len(rest) < len(alts)
                    schema = {**{k: v for k, v in schema.items() if k != "anyOf"}, **rest[0]}
                    continue
            break
        types = schema.get("type")
        if isinstance(types, list) and "null" in types:  # {"type": ["number", "null"]}
            rest_t = [t for t in types if t != "null"]
            if len(rest_t) == 1:
                return {**schema, "type": rest_t[0]}, True
        return schema, nullable

    def default_fields(self, service: str) -> list[tuple[str, str]]:
        out = []
        for state, schema in sorted(self.states.get(service, {}).items()):
            defs = self.defs[service][state]
            for name, prop in self.resolve(schema, defs)[0].get("properties", {}).items():
                if name not in SKIP_FIELDS and self.resolve(prop, defs)[0].get("type") in ("number", "integer"):
                    out.append((state, name))
        return out

    def field(self, service: str, state: str, path: str) -> FieldInfo:
        """How to read `path` in `state`; ValueError when the contract has no such numeric field."""
        schema = self.states.get(service, {}).get(state)
        if schema is None:
            raise ValueError(f"{service} has no JSON state {state!r}")
        defs = self.defs[service][state]
        expr = "value_json"
        nullable = False
        siblings: tuple[str, ...] = ()
        for seg in path.split("."):
            s, _ = self.resolve(schema, defs)
            if s.get("type") == "array":
                items, _ = self.resolve(s.get("items", {}), defs)
                if "name" in items.get("properties", {}):
                    expr = f"({expr} | selectattr('name', 'equalto', {json.dumps(seg)}) | first)"
                elif seg.isdigit():
                    expr = f"{expr}[{int(seg)}]"
                else:
                    raise ValueError(f"{service}/{state}: {seg!r} does not index the list at {expr}")
                schema = items
                siblings = ()
                continue
            props = s.get("properties", {})
            if seg in props:
                expr = f"{expr}[{json.dumps(seg)}]"
                schema = props[seg]
                siblings = tuple(props)
            elif isinstance(s.get("additionalProperties"), dict):
                expr = f"{expr}[{json.dumps(seg)}]"
                schema = s["additionalProperties"]
                siblings = ()
            else:
                raise ValueError(f"{service}/{state}: no field {seg!r}")
        leaf, nullable = self.resolve(schema, defs)
        if leaf.get("type") not in ("number", "integer"):
            raise ValueError(f"{service}/{state}/{path} is not numeric")
        return FieldInfo(expr, leaf, nullable, siblings)

    def template(self, service: str, state: str, path: str) -> str:
        """The plain value_template for `path` in `state` (ValueError when there is no such numeric field)."""
        return "{{ " + self.field(service, state, path).expr + " }}"


def chosen_fields(catalog: FieldCatalog, service: str, fields: list[str] | None) -> list[tuple[str, str]]:
    """(state, path) of every field that becomes a sensor for a device of `service`."""
    if fields is None:
        return catalog.default_fields(service)
    chosen = []
    for spec in fields:
        svc, _, rest = spec.partition("/")
        state, _, path = rest.partition("/")
        if svc == service and state and path:
            chosen.append((state, path))
    return chosen


STOP_SOURCE = "homeassistant"
STOP_REASON = "stop button in Home Assistant"


def stop_entities(root: str, prefix: str, version: str) -> list[Entity]:
    """The bus stop's discovery configs for one topic root: a `button` that sets the site's stop (Home Assistant
    renders `command_template` into a StopState with the press time, published retained at QoS 1 on `{root}/_stop`),
    a `binary_sensor` on the site's retained stop and one on the fleet centre's, `{root}/_stop/fleet` (each ON while
    its latch is active; OFF when released or when no stop was ever set). The nodes obey both latches; the button
    writes only the site's (a release lifts only its own latch: shared/stop.py)."""
    from shared.stop import fleet_stop_topic, stop_topic

    topic = stop_topic(root)
    fleet = fleet_stop_topic(root)
    node_id = _slug(f"robobus_{root}__stop")
    ident = _slug(f"robobus_{root}__bus")
    common = {
        "device": {"identifiers": [ident], "name": f"robobus {root}", "manufacturer": "robobus",
                   "model": "bus-wide software stop", "sw_version": version},
        "origin": {"name": "robobus", "sw_version": version},
    }
    # Home Assistant's own template engine: now() is the press time; the payload is a StopState (shared/messages.py)
    press = ('{"active": true, "source": "' + STOP_SOURCE + '", "reason": "' + STOP_REASON
             + '", "ts": {{ now().timestamp() }}}')
    button = {"name": "stop everything", "unique_id": f"{ident}_stop_button", "command_topic": topic,
              "command_template": press, "payload_press": "PRESS", "retain": True, "qos": 1,
              "icon": "mdi:octagon", **common}

    def sensor(name: str, uid: str, state_topic: str) -> dict[str, Any]:
        # read as the nodes read it: no message (empty) is no stop; a message that is not a StopState with a false
        # `active` (not JSON, no `active`) is held as an active stop
        return {"name": name, "unique_id": f"{ident}_{uid}", "state_topic": state_topic, "qos": 1,
                "value_template": "{{ 'OFF' if value == '' else ('ON' if value_json is not defined or "
                                  "value_json.active is not defined or value_json.active else 'OFF') }}",
                "json_attributes_topic": state_topic,
                "json_attributes_template": "{{ value_json | tojson if value_json is defined else '{}' }}",
                "icon": "mdi:octagon", **common}

    return [Entity("button", f"{prefix}/button/{node_id}/stop/config", button),
            Entity("binary_sensor", f"{prefix}/binary_sensor/{node_id}/stop/config",
                   sensor("bus stop", "stop_state", topic)),
            Entity("binary_sensor", f"{prefix}/binary_sensor/{node_id}/fleet_stop/config",
                   sensor("fleet bus stop", "fleet_stop_state", fleet))]


def device_entities(root: str, prefix: str, node: str, device: str, health: dict[str, Any],
                    catalog: FieldCatalog, fields: list[str] | None, version: str,
                    states: Iterable[str] | None = None) -> tuple[list[Entity], list[str]]:
    """Discovery configs for one device; and the problems with chosen fields (reported, skipped).

    `states`: the states the device has been seen publishing (None: every state of its service); only their
    fields become sensors."""
    service = str(health.get("service", ""))
    base = f"{root}/{node}/{device}"
    node_id = _slug(f"robobus_{root}_{node}")
    ident = _slug(f"robobus_{root}_{node}_{device}")
    node_avail = {"topic": f"{root}/{node}/status", "value_template": AVAILABILITY_TEMPLATE}
    site_avail = {"topic": reachable_topic(prefix, root)}  # the site reachable (its mirror; "online" at a site)
    common = {
        "device": {"identifiers": [ident], "name": f"{node} {device}", "manufacturer": "robobus",
                   "model": service, "sw_version": str(health.get("version", ""))},
        "origin": {"name": "robobus", "sw_version": version},
    }
    entities: list[Entity] = []

    def add(component: str, key: str, name: str, extra: dict[str, Any]) -> None:
        object_id = _slug(f"{device}_{key}")
        cfg = {"name": name, "unique_id": f"{ident}_{_slug(key)}", **extra, **common}
        entities.append(Entity(component, f"{prefix}/{component}/{node_id}/{object_id}/config", cfg))

    # health: the node's own retained topic, true while the node is online (the process need not run)
    health_topic = f"{base}/health"
    health_common = {"state_topic": health_topic, "availability": [node_avail, site_avail],
                     "availability_mode": "all"}
    flags = (("connection", "connection", "connectivity"), ("operational", "operational", "running"))
    for key, fld, cls in flags:
        add("binary_sensor", key, key, {**health_common, "device_class": cls,
                                        "value_template": f"{{{{ 'ON' if value_json.{fld} else 'OFF' }}}}",
                                        "entity_category": "diagnostic"})
    add("binary_sensor", "problem", "problem", {**health_common, "device_class": "problem",
                                                "value_template": "{{ 'ON' if value_json.error else 'OFF' }}"})
    add("sensor", "state", "state", {**health_common, "value_template": "{{ value_json.state }}",
                                     "json_attributes_topic": health_topic,
                                     "json_attributes_template": "{{ value_json.details | tojson }}"})
    add("sensor", "error_message", "error message",
        {**health_common, "value_template": "{{ value_json.error_message }}", "entity_category": "diagnostic"})

    problems: list[str] = []
    seen = None if states is None else set(states)
    for state, path in chosen_fields(catalog, service, fields):
        try:
            info = catalog.field(service, state, path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if seen is not None and state not in seen:
            continue
        leaf = path.rsplit(".", 1)[-1]
        topic = ha_state_topic(prefix, root, node, device, state)
        avail: list[dict[str, Any]] = [node_avail, {"topic": availability_topic(prefix, root)}, site_avail]
        if info.nullable:  # no value is unavailable, not a number "None"
            avail.append({"topic": topic, "value_template":
                          f"{{% set v = {info.expr} %}}{{{{ '{ONLINE}' if v is defined and v is not none "
                          f"else '{OFFLINE}' }}}}"})
        kind = field_class(leaf, info.schema, info.siblings)
        value = f"{info.expr} | timestamp_utc" if kind.get("device_class") == "timestamp" else info.expr
        extra: dict[str, Any] = {"state_topic": topic, "value_template": "{{ " + value + " }}",
                                 "availability": avail, "availability_mode": "all", **kind}
        unit = _unit(leaf)
        if unit and kind.get("state_class"):
            extra["unit_of_measurement"] = unit
        add("sensor", f"{state}_{path}", f"{state} {path}", extra)
    return entities, problems


class Discovery:
    """The process: watch status/health/states, publish configs per device, republish states at Home
    Assistant's rate, again everything when Home Assistant comes back."""

    def __init__(self, settings: HomeAssistantSettings, version: str,
                 apis: Iterable[ServiceAPI] | None = None) -> None:
        self.settings = settings
        self.root = settings.topic_root
        self.prefix = settings.homeassistant_prefix
        self.catalog = FieldCatalog(apis)
        self.version = version
        self.interval = 1.0 / settings.homeassistant_rate_hz
        self.availability = availability_topic(self.prefix, self.root)
        self.reachable = reachable_topic(self.prefix, self.root)
        self.site_reachable = ONLINE  # fleet-watch's verdict mirrored; online where none speaks
        self.ha_base = ha_base(self.prefix, self.root)
        self.session = MqttSession(settings, unique_client_id("robobus-homeassistant"),
                                   will=Will(self.availability, OFFLINE.encode(), qos=1, retain=True))
        self.session.on_connect(self._on_connect)
        self.health: dict[tuple[str, str], dict[str, Any]] = {}
        self.sent: dict[tuple[str, str], str] = {}  # device -> service/version its configs were made for
        self.published = 0
        self.removed = 0
        self.rounds = 0
        self.bad = 0
        self.forwarded = 0  # state messages republished for Home Assistant
        self.node_devices: dict[str, set[str]] = {}  # node -> devices of its last online status
        self.topics: dict[tuple[str, str], set[str]] = {}  # device -> config topics it has on the broker
        self.current: dict[tuple[str, str], set[str]] = {}  # device -> config topics of its last publication
        self.seen: dict[tuple[str, str], set[str]] = {}  # device -> states it has been seen publishing
        self.watched: dict[tuple[str, str], tuple[str, set[str]]] = {}  # device -> (service, state topics)
        self.settle_at: dict[tuple[str, str], float] = {}  # device -> when unseen states' sensors go
        self.ha_topics: dict[tuple[str, str], set[str]] = {}  # device -> its republished (retained) states
        self.pending: dict[str, bytes] = {}  # Home Assistant topic -> newest state not yet republished
        self.last_sent: dict[str, float] = {}  # Home Assistant topic -> when it was last republished
        self._node_id_prefix = _slug(f"robobus_{self.root}_")
        self.stop_entities = stop_entities(self.root, self.prefix, version)
        self._stop_topics = {e.topic for e in self.stop_entities}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="ha-flush", daemon=True)

    def start(self) -> None:
        self.session.subscribe(f"{self.root}/+/status", self._on_status)
        self.session.subscribe(f"{self.root}/+/+/health", self._on_health)
        # our own retained configs, including an earlier run's: what a removal has to clear
        self.session.subscribe(f"{self.prefix}/+/+/+/config", self._on_config)
        self.session.subscribe(f"{self.prefix}/status", self._on_ha_status)
        self.session.subscribe(f"{self.root}/_bridge/reachable", self._on_reachable)
        self.session.start()
        self._flusher.start()

    def stop(self) -> None:
        """Say offline (retained, as the Last Will would), then disconnect."""
        self._stop.set()
        if self.session.connected.is_set():
            self.session.publish_wait(self.availability, OFFLINE, qos=1, retain=True)
        self.session.stop()
        if self._flusher.is_alive():
            self._flusher.join(5)

    def _on_connect(self) -> None:
        self.session.publish(self.reachable, self.site_reachable, qos=1, retain=True)
        self.session.publish(self.availability, ONLINE, qos=1, retain=True)
        self.publish_stop()

    def _on_reachable(self, msg: mqtt.MQTTMessage) -> None:
        """fleet-watch's verdict on the site, mirrored for Home Assistant (retained): "0" offline, else online
        (an empty payload: the verdict withdrawn, nobody says the site is cut)."""
        value = bytes(msg.payload).strip()
        if value not in (b"0", b"1", b""):
            self.bad += 1
            log.warning("ignoring %s = %r: not 0 or 1 (%d bad so far)", msg.topic, value[:40], self.bad)
            return
        mirrored = OFFLINE if value == b"0" else ONLINE
        if mirrored != self.site_reachable:
            log.warning("the site %s is %s", self.root, "unreachable: its devices unavailable" if mirrored == OFFLINE
                        else "reachable")
        self.site_reachable = mirrored
        self.session.publish(self.reachable, mirrored, qos=1, retain=True)

    def publish_stop(self) -> None:
        """The bus stop's button and binary_sensor (retained)."""
        for e in self.stop_entities:
            self.session.publish(e.topic, json.dumps(e.config), qos=1, retain=True)

    # -- the bus -------------------------------------------------------------------------------
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

    def _device_of(self, state_topic: str) -> tuple[str, str, str | None] | None:
        """(node, device, republished state or None) from an entity's state_topic."""
        for base, republished in ((self.ha_base, True), (self.root, False)):
            if state_topic.startswith(f"{base}/"):
                where = state_topic[len(base) + 1:].split("/")
                if republished and len(where) == 3:
                    return where[0], where[1], state_topic
                if not republished and len(where) >= 3:
                    return where[0], where[1], None
        return None

    def _on_config(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) != 5 or not parts[2].startswith(self._node_id_prefix) or msg.topic in self._stop_topics:
            return  # another integration's entity, or the bus stop's (not a device's)
        if not msg.payload:
            with self._lock:
                for topics in self.topics.values():
                    topics.discard(msg.topic)
            return
        try:
            cfg = json.loads(msg.payload)
            found = self._device_of(str(cfg["state_topic"]))
            if found is None:
                raise ValueError(f"state_topic {cfg['state_topic']!r} is not a device's")
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring discovery config on %s: %s", msg.topic, exc)
            return
        key = (found[0], found[1])
        with self._lock:
            if found[2] is not None:
                self.ha_topics.setdefault(key, set()).add(found[2])
            current = self.current.get(key)
            # an entity this run no longer makes for a device it has published (a state sensor whose state is
            # not seen yet is given until the device settles)
            outdated = current is not None and msg.topic not in current and key not in self.settle_at
            if not outdated:
                self.topics.setdefault(key, set()).add(msg.topic)
            stale = not self._listed(*key) and key not in self.health
        if outdated:
            self.session.publish(msg.topic, b"", qos=1, retain=True)
            self.removed += 1
        elif stale:  # an earlier run's config for a device that has left its node
            self.remove_device(*key, why="no longer in its node's device list")

    def remove_device(self, node: str, device: str, why: str) -> int:
        """Delete a device's entities from Home Assistant: an empty retained payload on each config topic (and
        on its republished states)."""
        key = (node, device)
        with self._lock:
            self.health.pop(key, None)
            self.sent.pop(key, None)
            self.current.pop(key, None)
            self.seen.pop(key, None)
            self.settle_at.pop(key, None)
            topics = sorted(self.topics.pop(key, set()))
            ha_topics = sorted(self.ha_topics.pop(key, set()))
            for t in ha_topics:
                self.pending.pop(t, None)
                self.last_sent.pop(t, None)
        self._watch(key, None)
        for topic in topics + ha_topics:
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
        self._watch(key, str(health.get("service", "")))  # first: a device being watched is settling
        self.publish_device(*key)

    def _watch(self, key: tuple[str, str], service: str | None) -> None:
        """Subscribe to the JSON states of `service` that have sensors, for this device (None: to none)."""
        states = sorted({s for s, _ in chosen_fields(self.catalog, service, self.settings.homeassistant_fields)}
                        & set(self.catalog.states.get(service, {}))) if service else []
        wanted = {f"{self.root}/{key[0]}/{key[1]}/state/{s}" for s in states}
        with self._lock:
            old_service, old = self.watched.get(key, ("", set()))
            if service is None:
                self.watched.pop(key, None)
            else:
                self.watched[key] = (service, wanted)
                if old_service != service:
                    self.seen[key] = set()
                if wanted - old:
                    self.settle_at[key] = time.monotonic() + SETTLE_S
        for topic in sorted(old - wanted):
            self.session.unsubscribe(topic)
        for topic in sorted(wanted - old):
            self.session.subscribe(topic, self._on_state, qos=0)

    def _on_state(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(self.root) + 1:].split("/")
        if len(parts) != 4 or not msg.payload:
            return
        node, device, _, state = parts
        key = (node, device)
        try:
            if not isinstance(json.loads(msg.payload), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            self.bad += 1
            log.warning("ignoring state on %s: %s (%d bad so far)", msg.topic, exc, self.bad)
            return
        topic = ha_state_topic(self.prefix, self.root, node, device, state)
        now = time.monotonic()
        with self._lock:
            if key not in self.watched:
                return
            seen = self.seen.setdefault(key, set())
            new = state not in seen
            seen.add(state)
            self.ha_topics.setdefault(key, set()).add(topic)
            due = now - self.last_sent.get(topic, -1e9) >= self.interval
            if due:
                self.last_sent[topic] = now
                self.pending.pop(topic, None)
            else:
                self.pending[topic] = bytes(msg.payload)
        if due:
            self._forward(topic, bytes(msg.payload))
        if new:
            log.info("discovery: %s/%s publishes %s", node, device, state)
            self.publish_device(node, device)

    def _forward(self, topic: str, payload: bytes) -> None:
        self.session.publish(topic, payload, qos=0, retain=True)
        self.forwarded += 1

    def _flush_loop(self) -> None:
        """Republish what waited for its slot; remove the sensors of states a device did not publish."""
        tick = min(0.1, self.interval / 4)
        while not self._stop.wait(tick):
            now = time.monotonic()
            out: list[tuple[str, bytes]] = []
            settled: list[tuple[str, str]] = []
            with self._lock:
                for topic, payload in list(self.pending.items()):
                    if now - self.last_sent.get(topic, -1e9) >= self.interval:
                        out.append((topic, payload))
                        self.last_sent[topic] = now
                        del self.pending[topic]
                for key, at in list(self.settle_at.items()):
                    if now >= at:
                        del self.settle_at[key]
                        settled.append(key)
            for topic, payload in out:
                self._forward(topic, payload)
            for key in settled:
                self._sweep(key)

    def _sweep(self, key: tuple[str, str]) -> None:
        """Remove the config topics of a device that this run does not make (an earlier run's sensors of
        states the device has not published)."""
        with self._lock:
            current = self.current.get(key)
            if current is None:
                return
            known = self.topics.setdefault(key, set())
            gone = sorted(known - current)
            known -= set(gone)
            # and an earlier run's republished states of those states
            seen = {ha_state_topic(self.prefix, self.root, *key, s) for s in self.seen.get(key, set())}
            republished = self.ha_topics.setdefault(key, set())
            unseen = sorted(republished - seen)
            republished -= set(unseen)
        for topic in gone + unseen:
            self.session.publish(topic, b"", qos=1, retain=True)
        self.removed += len(gone)
        if gone:
            log.info("discovery: removed %d entities of %s/%s (states it does not publish)", len(gone), *key)

    def _on_ha_status(self, msg: mqtt.MQTTMessage) -> None:
        if msg.payload.strip().lower() == b"online":
            log.info("Home Assistant is online: publishing every discovery config again")
            self.publish_all()

    def publish_device(self, node: str, device: str) -> int:
        key = (node, device)
        with self._lock:
            health = self.health.get(key)
            seen = set(self.seen.get(key, set()))
            settling = key in self.settle_at
        if health is None:  # removed meanwhile
            return 0
        entities, problems = device_entities(self.root, self.prefix, node, device, health, self.catalog,
                                             self.settings.homeassistant_fields, self.version, seen)
        for p in problems:
            log.warning("homeassistant field skipped: %s", p)
        made = {e.topic for e in entities}
        with self._lock:
            known = self.topics.setdefault(key, set())
            # entities of an earlier field setting or version (those of states not seen yet: once settled)
            dropped = sorted(known - made) if not settling else []
            known.difference_update(dropped)
            known.update(made)
            self.current[key] = made
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
        self.publish_stop()
        for node, device in keys:
            self.publish_device(node, device)
        self.rounds += 1


def homeassistant(
    prefix: Annotated[str | None, typer.Option(help="Discovery prefix (ROBOBUS_HOMEASSISTANT_PREFIX)")] = None,
    broker: Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (ROBOBUS_MQTT_URL)")] = None,
    root: Annotated[str | None, typer.Option(help="Topic root (ROBOBUS_TOPIC_ROOT)")] = None,
) -> None:
    """Publish Home Assistant MQTT discovery configs for every robobus device, until stopped."""
    from shared.logs import setup_logging

    overrides = {k: v for k, v in (("homeassistant_prefix", prefix), ("mqtt_url", broker), ("topic_root", root))
                 if v is not None}
    s = load_settings(HomeAssistantSettings, **overrides)
    setup_logging(s.log_level, s.log_json)
    d = Discovery(s, __version__)
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
