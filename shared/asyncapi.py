"""AsyncAPI 3.0 document and JSON Schemas, generated from the declared service APIs.

The way FastStream does it: every pydantic model gives its JSON Schema, `$defs` are hoisted into
`components/schemas` and references rewritten. Channels use address parameters for the parts a
deployment chooses ({root}, {node}, {device}); commands are `receive` operations with an MQTT 5
reply (Response Topic + Correlation Data)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared.codegen_schema import name_inline_schemas, pascal
from shared.contract import BinarySpec, CommandSpec, JobSpec, ServiceAPI, StateSpec, command_errors
from shared.messages import CancelReply, ErrorReply, Health, JobAccepted, JobResult, NodeStats, OkReply, Status
from shared.registry import service_apis

REF = "#/components/schemas/{model}"
MQTT_BINDING = "0.2.0"


def discover_apis() -> list[ServiceAPI]:
    """Every registered service's contract (the `robobus.services` entry points)."""
    return service_apis()


def _cid(*parts: str) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9_-]", "-", p) for p in parts)


def reply_names(reply: type[BaseModel]) -> tuple[str, str]:
    """Component names of a reply model's success envelope and of its success-or-error union.
    Derived from the model's name alone, so every command answering with it shares the two types."""
    return f"{reply.__name__}Ok", f"{reply.__name__}OrError"


REPLY_TOPIC = ("the request's MQTT 5 Response Topic; a request without one is answered on "
               "`<request topic>/reply` (MQTT 3 clients)")
REPLY_QOS = "the request's QoS: 0 for a QoS 0 request, else 1"


PARAMS = {
    "root": {"description": "Topic root (ROBOBUS_TOPIC_ROOT), e.g. 'robobus' or 'site1/robobus'",
             "default": "robobus"},
    "node": {"description": "Node name (ROBOBUS_NODE); defaults to the service name"},
    "device": {"description": "Device name, one per piece of hardware the node serves"},
}


class DocBuilder:
    def __init__(self, title: str, version: str) -> None:
        self.title = title
        self.version = version
        self.models: dict[str, type[BaseModel]] = {}
        self.extra_schemas: dict[str, dict[str, Any]] = {}
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}

    def model(self, m: type[BaseModel]) -> dict[str, str]:
        prev = self.models.get(m.__name__)
        if prev is not None and prev is not m:
            raise ValueError(f"two different models are named {m.__name__}: {prev} and {m}; rename one")
        self.models[m.__name__] = m
        return {"$ref": REF.format(model=m.__name__)}

    def message(self, mid: str, payload: dict[str, Any], *, summary: str, title: str,
                content_type: str = "application/json", correlated: bool = False) -> dict[str, str]:
        msg: dict[str, Any] = {"name": mid, "title": title, "summary": summary or mid,
                               "contentType": content_type, "payload": payload}
        mqtt: dict[str, Any] = {}
        if content_type != "application/json":
            mqtt["contentType"] = content_type  # set as the MQTT 5 Content Type property
        if correlated:
            msg["correlationId"] = {"description": "MQTT 5 Correlation Data, echoed in the reply",
                                    "location": "$message.header#/correlationData"}
            mqtt["correlationData"] = {"type": "string", "format": "binary",
                                       "description": "Any bytes; the reply carries the same"}
        if mqtt:
            msg["bindings"] = {"mqtt": {**mqtt, "bindingVersion": MQTT_BINDING}}
        self.messages[mid] = msg
        return {"$ref": f"#/components/messages/{mid}"}

    def channel(self, cid: str, address: str | None, messages: dict[str, dict[str, str]], description: str,
                *, retain: bool = False, qos: int = 0, kind: str) -> None:
        """`x-robobus` says how the channel is used: what kind of topic, whether messages on it are
        retained and at which QoS they are published (the operation's MQTT binding says the same)."""
        params = {p: PARAMS[p] for p in re.findall(r"{(\w+)}", address or "")}
        ch: dict[str, Any] = {"address": address, "messages": messages, "description": description,
                              "x-robobus": {"kind": kind, "retain": retain, "qos": qos}}
        if kind == "reply":
            ch["x-robobus"]["qos"] = REPLY_QOS
        if params:
            ch["parameters"] = params
        self.channels[cid] = ch

    def operation(self, oid: str, action: str, cid: str, summary: str, *, reply_cid: str | None = None,
                  qos: int = 0, retain: bool = False, contract: dict[str, Any] | None = None) -> None:
        op: dict[str, Any] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{cid}"},
            "summary": summary,
            "messages": [{"$ref": f"#/channels/{cid}/messages/{k}"} for k in self.channels[cid]["messages"]],
            "bindings": {"mqtt": {"qos": qos, "retain": retain, "bindingVersion": MQTT_BINDING}},
        }
        if reply_cid:
            op["reply"] = {
                "address": {"description": f"The reply topic: {REPLY_TOPIC}",
                            "location": "$message.header#/responseTopic"},
                "channel": {"$ref": f"#/channels/{reply_cid}"},
                "messages": [{"$ref": f"#/channels/{reply_cid}/messages/{k}"}
                             for k in self.channels[reply_cid]["messages"]],
            }
        if contract:
            op["x-robobus"] = contract
        self.operations[oid] = op

    def reply_union(self, reply: type[BaseModel]) -> dict[str, str]:
        """`{"ok": true, "result": <reply>} | {"ok": false, "error": ...}` as two named components."""
        ok_name, union_name = reply_names(reply)
        self.extra_schemas[ok_name] = {
            "type": "object",
            "description": f"A successful reply carrying {reply.__name__}",
            "required": ["ok", "result"],
            "properties": {"ok": {"const": True, "type": "boolean", "title": "Ok"},
                           "result": self.model(reply)},
        }
        self.extra_schemas[union_name] = {
            "description": f"The reply to a command answering with {reply.__name__}: success or an error",
            "oneOf": [{"$ref": REF.format(model=ok_name)}, self.model(ErrorReply)],
        }
        return {"$ref": REF.format(model=union_name)}

    # -- the kit's own channels, common to every service --------------------------------------
    def kit(self) -> None:
        self.channel("status", "{root}/{node}/status",
                     {"Status": self.message("Status", self.model(Status), summary="Node birth / death",
                                             title="Node status")},
                     "Retained. Published on connect (online=true); the Last Will says online=false.",
                     retain=True, qos=1, kind="status")
        self.operation("publishStatus", "send", "status", "Node liveness", qos=1, retain=True)
        self.channel("health", "{root}/{node}/{device}/health",
                     {"Health": self.message("Health", self.model(Health), summary="Device health",
                                             title="Device health")},
                     "Retained. On change and on the heartbeat (ROBOBUS_HEALTH_INTERVAL_S).", retain=True, qos=1,
                     kind="health")
        self.operation("publishHealth", "send", "health", "Device health", qos=1, retain=True)
        self.channel("nodeStats", "{root}/{node}/_node/state/stats",
                     {"NodeStats": self.message("NodeStats", self.model(NodeStats), summary="Kit counters",
                                                title="Node statistics")},
                     "Retained, on the heartbeat: command outcomes, publishes, decode errors, reconnects.",
                     retain=True, kind="state")
        self.operation("publishNodeStats", "send", "nodeStats", "Kit statistics", retain=True)
        self.model(ErrorReply)
        self.model(OkReply)
        # the kit's own replies (a job's JobAccepted, cancel's CancelReply) are kit types in every document,
        # so a service's schemas are only its own models and their envelopes
        self.reply_union(JobAccepted)
        self.reply_union(CancelReply)

    def service(self, api: ServiceAPI) -> None:
        svc = api.service
        dev = "{root}/{node}/{device}"
        for name, st in sorted(api.states.items()):
            cid = _cid(svc, "state", name)
            mid = _cid(svc, "state", name)
            if isinstance(st, BinarySpec):
                # a named component, so generators give the payload a type name of its own
                bname = f"{pascal(svc)}{pascal(name)}Bytes"
                self.extra_schemas[bname] = {"type": "string", "format": "binary",
                                             "description": f"{svc} {name}: raw bytes, {st.content_type}"}
                payload: dict[str, Any] = {"$ref": REF.format(model=bname)}
                ctype = st.content_type
            else:
                assert isinstance(st, StateSpec)
                payload = self.model(st.model)
                ctype = "application/json"
            rate = f" Rate cap {st.rate_hz:g} Hz (ROBOBUS_STATE_RATES)." if st.rate_hz else ""
            self.channel(cid, f"{dev}/state/{name}",
                         {mid: self.message(mid, payload, summary=st.doc or name, content_type=ctype,
                                            title=f"{svc} state {name}")},
                         f"{svc}: {st.doc or name}.{rate}{' Retained.' if st.retain else ''}",
                         retain=st.retain, qos=st.qos, kind="state")
            self.operation(_cid(svc, "publish", name), "send", cid, st.doc or name, qos=st.qos, retain=st.retain)
        for name, ev in sorted(api.events.items()):
            cid = _cid(svc, "event", name)
            self.channel(cid, f"{dev}/event/{name}",
                         {cid: self.message(cid, self.model(ev.model), summary=ev.doc or name,
                                            title=f"{svc} event {name}")},
                         f"{svc}: {ev.doc or name}", qos=ev.qos, kind="event")
            self.operation(_cid(svc, "emit", name), "send", cid, ev.doc or name, qos=ev.qos)
        calls: list[CommandSpec | JobSpec] = [*api.commands.values(), *api.jobs.values()]
        for spec in sorted(calls, key=lambda c: c.name):
            self.command(svc, dev, spec)
        for name, sp in sorted(api.streams.items()):
            cid = _cid(svc, "stream", name)
            self.channel(cid, f"{dev}/stream/{name}",
                         {cid: self.message(cid, self.model(sp.model), summary=sp.doc or name,
                                            title=f"{svc} stream {name}")},
                         f"{svc}: {sp.doc or name} (stream, {'into' if sp.direction == 'in' else 'out of'} "
                         "the node)", qos=sp.qos, kind="stream")
            self.operation(_cid(svc, "stream", name), "receive" if sp.direction == "in" else "send", cid,
                           sp.doc or name, qos=sp.qos)

    def command(self, svc: str, dev: str, spec: CommandSpec | JobSpec) -> None:
        """One command: its request channel, its reply channel, and what a client cannot guess
        (job or not, the error codes, the reply topic and QoS) in the operation's `x-robobus`."""
        name = spec.name
        cid = _cid(svc, "cmd", name)
        rid = _cid(svc, "cmd", name, "reply")
        doc = spec.doc or name
        codes = [c.value for c in command_errors(spec)]
        contract: dict[str, Any] = {"job": isinstance(spec, JobSpec), "errors": codes,
                                    "replyTopic": REPLY_TOPIC, "replyQos": REPLY_QOS}
        if isinstance(spec, JobSpec):  # the immediate reply is JobAccepted, the result comes as an event
            reply_model: type[BaseModel] = JobAccepted
            self.model(JobResult)
            contract.update({
                "events": ["job_progress", "job_result"],
                "result": self.model(spec.result),
                "cancel": "cmd/cancel",
            })
            doc += (f" (job: replies with a job id; streams event/job_progress; ends with one event/job_result "
                    f"whose result is {spec.result.__name__}; cancel with cmd/cancel)")
        else:
            reply_model = spec.reply
        doc += f". Error codes: {', '.join(codes)}."
        self.channel(cid, f"{dev}/cmd/{name}",
                     {cid: self.message(cid, self.model(spec.request), summary=doc, correlated=True,
                                        title=f"{svc} command {name}")},
                     f"{svc}: {doc}", qos=1, kind="cmd")
        self.channel(rid, None,
                     {rid: self.message(rid, self.reply_union(reply_model), summary=f"reply to {name}",
                                        correlated=True, title=f"{svc} reply to {name}")},
                     f"Reply to {svc} {name}, on {REPLY_TOPIC}, at {REPLY_QOS}", qos=1, kind="reply")
        self.operation(cid, "receive", cid, doc, reply_cid=rid, qos=1, contract=contract)

    def schemas(self) -> dict[str, Any]:
        pairs = [(m, "validation") for _, m in sorted(self.models.items())]
        _, top = models_json_schema(pairs, ref_template=REF)  # type: ignore[arg-type]
        defs: dict[str, Any] = dict(top.get("$defs", {}))
        for name, schema in self.extra_schemas.items():
            if name in defs:
                raise ValueError(f"schema name {name!r} is both a model and a generated envelope; rename the model")
            defs[name] = schema
        return dict(sorted(name_inline_schemas(defs).items()))

    def document(self) -> dict[str, Any]:
        return {
            "asyncapi": "3.0.0",
            "info": {
                "title": self.title,
                "version": self.version,
                "description": (
                    "robobus: every robot transport behind its own process, all speaking pydantic-validated "
                    "JSON over MQTT 5. Generated from the services' pydantic models by `make schema`; "
                    "do not edit by hand."
                ),
            },
            "defaultContentType": "application/json",
            "servers": {
                "local": {"host": "127.0.0.1:1883", "protocol": "mqtt", "protocolVersion": "5",
                          "description": "The broker `make run` starts (also websockets on 9001)"},
            },
            "channels": self.channels,
            "operations": self.operations,
            "components": {"schemas": self.schemas(), "messages": dict(sorted(self.messages.items()))},
        }


def build_document(apis: Iterable[ServiceAPI] | None = None) -> dict[str, Any]:
    from shared import __version__

    b = DocBuilder("robobus", __version__)
    b.kit()
    for api in apis if apis is not None else discover_apis():
        b.service(api)
    return b.document()


def render_yaml(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


def write_docs(out_dir: Path, apis: Iterable[ServiceAPI] | None = None) -> list[Path]:
    """docs/asyncapi.yaml plus one standalone JSON Schema per model in docs/schemas/."""
    doc = build_document(apis)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "asyncapi.yaml"]
    paths[0].write_text(render_yaml(doc))
    sdir = out_dir / "schemas"
    sdir.mkdir(exist_ok=True)
    for old in sdir.glob("*.json"):
        old.unlink()
    schemas = doc["components"]["schemas"]
    for name in schemas:
        standalone = _standalone(name, schemas)
        p = sdir / f"{name}.json"
        p.write_text(json.dumps(standalone, indent=2, sort_keys=True) + "\n")
        paths.append(p)
    return paths


def standalone_schema(payload: dict[str, Any], schemas: dict[str, Any], title: str = "") -> dict[str, Any]:
    """A message payload schema with the component schemas it uses inlined as local `$defs`."""
    needed: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#/components/schemas/"):
                    ref = v.rsplit("/", 1)[-1]
                    if ref not in needed:
                        needed[ref] = None
                        needed[ref] = walk(schemas[ref])
                    out[k] = f"#/$defs/{ref}"
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    root = walk(payload)
    out: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    if title:
        out["title"] = title
    out.update(root)
    if needed:
        out["$defs"] = dict(sorted(needed.items()))
    return out


def _standalone(name: str, schemas: dict[str, Any]) -> dict[str, Any]:
    """One model with the definitions it uses, refs rewritten to local $defs."""
    return standalone_schema(schemas[name], schemas)


class ContractValidator:
    """Match a published topic to its channel and validate the payload against its schema.
    Tests use it to prove that every message on the bus is what the document says."""

    def __init__(self, doc: dict[str, Any]) -> None:
        import jsonschema

        self._jsonschema = jsonschema
        self.schemas = doc["components"]["schemas"]
        self.routes: list[tuple[re.Pattern[str], dict[str, Any], str]] = []
        self.node_services: dict[str, str] = {}  # node -> service, from the status and health messages validated
        msgs = doc["components"]["messages"]
        for cid, ch in doc["channels"].items():
            addr = ch.get("address")
            if not addr:
                continue
            pat = re.escape(addr)
            pat = pat.replace(re.escape("{root}"), r"(?P<root>.+?)")
            for p in ("node", "device"):
                pat = pat.replace(re.escape("{" + p + "}"), rf"(?P<{p}>[^/]+)")
            ref = next(iter(ch["messages"].values()))["$ref"].rsplit("/", 1)[-1]
            self.routes.append((re.compile(f"^{pat}$"), msgs[ref], cid))
        # most specific first: the kit's `_node` stats before a service's `{device}` channels
        self.routes.sort(key=lambda r: (-r[0].pattern.count("_node"), -len(r[0].pattern)))

    def channels_for(self, topic: str) -> list[tuple[str, dict[str, Any]]]:
        """Every channel whose address matches, most specific first. Several services may declare the same
        relative address with different payloads (`{device}/state/link`, `{device}/event/fault`)."""
        hits = []
        best: tuple[int, int] | None = None
        for pat, msg, cid in self.routes:
            m = pat.match(topic)
            if not m:
                continue
            rank = (pat.pattern.count("_node"), len(pat.pattern))
            if best is None:
                best = rank
            if rank == best:
                hits.append((cid, msg, m.groupdict().get("node")))
        node = hits[0][2] if hits else None
        service = self.node_services.get(node or "")
        if service is not None and len(hits) > 1:
            own = [h for h in hits if h[0].startswith(f"{service}_")]
            hits = own or hits
        return [(cid, msg) for cid, msg, _ in hits]

    def channel_for(self, topic: str) -> tuple[str, dict[str, Any]] | None:
        hits = self.channels_for(topic)
        return hits[0] if hits else None

    def validate(self, topic: str, payload: bytes) -> str:
        """Return the channel id; raise AssertionError when the topic or payload is not in the contract. Where
        services share an address, the node's service (learnt from its status or health messages seen here)
        picks the channel; before that, the payload must be valid for one of them."""
        hits = self.channels_for(topic)
        if not hits:
            raise AssertionError(f"topic {topic!r} is not in the AsyncAPI document")
        failures = []
        for cid, msg in hits:
            if msg.get("contentType", "application/json") != "application/json":
                return cid
            try:
                data = json.loads(payload)
            except ValueError as exc:
                raise AssertionError(f"{topic}: payload is not JSON ({exc})") from None
            schema = {**msg["payload"], "components": {"schemas": self.schemas}}
            errors = sorted(self._jsonschema.Draft202012Validator(schema).iter_errors(data), key=str)
            if not errors:
                if isinstance(data, dict) and isinstance(data.get("service"), str) and isinstance(data.get("node"),
                                                                                                    str):
                    self.node_services[data["node"]] = data["service"]
                return cid
            failures.append(f"{topic} ({cid}): {errors[0].message} at {list(errors[0].absolute_path)}")
        raise AssertionError("; ".join(failures))

    def validate_reply(self, doc: dict[str, Any], command_cid: str, payload: bytes) -> None:
        """Validate a command reply against `{command_cid}_reply` of the document; an error reply's code
        must be one the command's operation lists in `x-robobus.errors`."""
        msg = doc["components"]["messages"][f"{command_cid}_reply"]
        schema = {**msg["payload"], "components": {"schemas": self.schemas}}
        data = json.loads(payload)
        errors = list(self._jsonschema.Draft202012Validator(schema).iter_errors(data))
        if errors:
            raise AssertionError(f"reply on {command_cid}: {errors[0].message}")
        if data.get("ok") is False:
            declared = doc["operations"][command_cid]["x-robobus"]["errors"]
            code = data["error"]["code"]
            if code not in declared:
                raise AssertionError(f"reply on {command_cid}: error code {code!r} is not declared "
                                     f"(the document lists {declared}); add it to the command's `errors`")
