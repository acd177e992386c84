"""What the contract says about a topic: its AsyncAPI channel, JSON Schema, content type, and whether
it is something nodes *receive* (a command or an inbound stream, which a replay must not resend
unless asked, since replaying a command moves hardware).

The recorder registers one MCAP schema per channel from this (jsonschema encoding, so Foxglove shows
typed fields); the replayer reads the classification back from the channel metadata.

Channel addresses are generic (`{root}/{node}/{device}/state/sensors`), and two services may declare
the same name, so a topic can match channels of several services. The node's retained `status` and
`health` carry its service name: the catalog learns node -> service from them and picks the right one;
before it knows, a node named after its service (the default) decides, else the first match is kept
and the channel metadata lists the candidates."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.tools.asyncapi import standalone_schema

log = logging.getLogger("robobus.record")

# MCAP channel metadata keys (strings only, per the MCAP spec)
META_TOPIC = "mqtt.topic"
META_RETAIN = "mqtt.retain"
META_QOS = "mqtt.qos"
META_CONTENT_TYPE = "mqtt.content_type"
META_CHANNEL = "asyncapi.channel"
META_KIND = "robobus.kind"
META_RECEIVES = "robobus.node_receives"
META_CANDIDATES = "asyncapi.candidates"
# a channel the recorder derives from another (the camera as foxglove.CompressedImage beside its raw bytes):
# not bus traffic, so never republished
META_DERIVED = "robobus.derived"

JSON = "application/json"


@dataclass(frozen=True)
class TopicInfo:
    """How a topic is recorded: the schema to register (None: schema-less) and how replay treats it."""

    kind: str  # status, health, stats, state, event, cmd, reply, stream, other
    channel: str | None = None  # AsyncAPI channel id
    schema_name: str | None = None
    schema: bytes | None = None  # a standalone JSON Schema (draft 2020-12)
    content_type: str = JSON
    node_receives: bool = False  # a command or an inbound stream: not replayed by default
    candidates: tuple[str, ...] = ()


@dataclass
class _Route:
    pattern: re.Pattern[str]
    cid: str
    service: str | None  # None for the kit's own channels (status, health, stats)
    kind: str


@dataclass
class TopicCatalog:
    root: str
    doc: dict[str, Any]
    routes: list[_Route] = field(default_factory=list)
    receives: set[str] = field(default_factory=set)
    node_service: dict[str, str] = field(default_factory=dict)
    _schemas: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    @classmethod
    def from_document(cls, doc: dict[str, Any], root: str) -> TopicCatalog:
        cat = cls(root=root, doc=doc)
        for cid, ch in doc.get("channels", {}).items():
            addr = ch.get("address")
            if not addr:
                continue
            pat = re.escape(addr).replace(re.escape("{root}"), re.escape(root))
            for p in ("node", "device"):
                pat = pat.replace(re.escape("{" + p + "}"), rf"(?P<{p}>[^/]+)")
            service = cid.split("_", 1)[0] if "_" in cid else None
            cat.routes.append(_Route(re.compile(f"^{pat}$"), cid, service, _kind(addr)))
        # the kit's `_node` stats before a service's `{device}` channels; longer (more literal) first
        cat.routes.sort(key=lambda r: (-r.pattern.pattern.count("_node"), -len(r.pattern.pattern)))
        for op in doc.get("operations", {}).values():
            if op.get("action") == "receive":
                cat.receives.add(op["channel"]["$ref"].rsplit("/", 1)[-1])
        return cat

    def learn(self, topic: str, payload: bytes) -> None:
        """Status and health name the service a node runs: remember it (cheap: low-rate topics only)."""
        rest = self._under_root(topic)
        if rest is None:
            return
        parts = rest.split("/")
        if not ((len(parts) == 2 and parts[1] == "status") or (len(parts) == 3 and parts[2] == "health")):
            return
        try:
            service = json.loads(payload).get("service")
        except (ValueError, AttributeError):
            return
        if isinstance(service, str) and service:
            self.node_service[parts[0]] = service

    def _under_root(self, topic: str) -> str | None:
        prefix = self.root + "/"
        return topic[len(prefix):] if topic.startswith(prefix) else None

    def info(self, topic: str) -> TopicInfo:
        reply = topic.endswith("/reply")
        base = topic[: -len("/reply")] if reply else topic
        matches = [r for r in self.routes if r.pattern.match(base)]
        if reply:
            matches = [r for r in matches if r.kind == "cmd"]
        if not matches:
            return self._unknown(topic)
        chosen = self._choose(base, matches)
        cid = f"{chosen.cid}_reply" if reply else chosen.cid
        msg = self._message(cid)
        if msg is None:
            return self._unknown(topic)
        name, schema = self._schema(cid, msg)
        ctype = str(msg.get("contentType", JSON))
        cands = tuple(sorted({r.cid for r in matches})) if len({r.cid for r in matches}) > 1 else ()
        return TopicInfo(
            kind="reply" if reply else chosen.kind, channel=cid,
            schema_name=name if ctype == JSON else None, schema=schema if ctype == JSON else None,
            content_type=ctype, node_receives=(not reply and chosen.cid in self.receives), candidates=cands,
        )

    def _choose(self, topic: str, matches: list[_Route]) -> _Route:
        if len({r.cid for r in matches}) == 1:
            return matches[0]
        m = matches[0].pattern.match(topic)
        node = m.group("node") if m and "node" in m.groupdict() else None
        service = self.node_service.get(node or "", node)
        for r in matches:
            if r.service == service:
                return r
        return matches[0]

    def _message(self, cid: str) -> dict[str, Any] | None:
        ch = self.doc["channels"].get(cid)
        if ch is None:
            return None
        ref = next(iter(ch["messages"].values()))["$ref"].rsplit("/", 1)[-1]
        msg: dict[str, Any] | None = self.doc["components"]["messages"].get(ref)
        return msg

    def _schema(self, cid: str, msg: dict[str, Any]) -> tuple[str, bytes]:
        hit = self._schemas.get(cid)
        if hit is None:
            payload = msg["payload"]
            ref = payload.get("$ref", "") if isinstance(payload, dict) else ""
            name = ref.rsplit("/", 1)[-1] if ref else str(msg.get("name", cid))
            data = standalone_schema(payload, self.doc["components"]["schemas"], title=name)
            hit = self._schemas[cid] = (name, json.dumps(data, sort_keys=True).encode())
        return hit

    def _unknown(self, topic: str) -> TopicInfo:
        """Not in the contract (another tool's topic, an RPC client's reply topic): kind from its levels."""
        levels = topic.split("/")
        if levels[-1] == "reply":
            return TopicInfo(kind="reply")
        # safe default: anything addressed as a command is treated as one (never replayed by default)
        if "cmd" in levels[:-1]:
            return TopicInfo(kind="cmd", node_receives=True)
        return TopicInfo(kind="other")


def _kind(address: str) -> str:
    parts = address.split("/")
    if parts[-1] in ("status", "health"):
        return parts[-1]
    if "_node" in parts:
        return "stats"
    return parts[-2] if len(parts) >= 2 and parts[-2] in ("state", "event", "cmd", "stream") else "other"


def load_document(path: Path | None = None) -> dict[str, Any]:
    """The AsyncAPI document whose schemas the recording carries: the file at `path` if given; else the
    one built from every registered service; when some service cannot be imported here (its extra is
    not installed: a recorder image needs none), the repository's generated docs/asyncapi.yaml if there
    is one, else the document of the services that did import."""
    from shared.registry import service_plugins
    from shared.tools.asyncapi import build_document

    if path is not None:
        doc: dict[str, Any] = yaml.safe_load(path.read_text())
        return doc
    apis = []
    missing = []
    for plugin in service_plugins():
        try:
            apis.append(plugin.load())
        except Exception as exc:  # an ImportError of a service extra, most often
            missing.append(f"{plugin.name} ({exc})")
    if not missing:
        return build_document(apis)
    shipped = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.yaml"
    if shipped.is_file():
        log.warning("not importable here: %s; schemas from %s", ", ".join(missing), shipped)
        loaded: dict[str, Any] = yaml.safe_load(shipped.read_text())
        return loaded
    log.warning("recording without the schemas of %s", ", ".join(missing))
    return build_document(apis)
