"""AsyncAPI 3.0 document and JSON Schemas, generated from the declared service APIs.

The way FastStream does it: every pydantic model gives its JSON Schema, `$defs` are hoisted into
`components/schemas` and references rewritten. Channels use address parameters for the parts a
deployment chooses ({root}, {node}, {device}); commands are `receive` operations with an MQTT 5
reply (Response Topic + Correlation Data).

A channel parameter is one topic level to the tools that match topics against addresses (as MQTT's `+`
is), so `{root}` stands for a one-level root only. The document for a given root (`build_document(root=
"site1/robobus")`, `robobus schema --root`, the dashboard's `/api/asyncapi.json`) writes the root into
every address instead, so a multi-level root matches too.

Replies have addresses of their own: `{root}/{node}/{device}/cmd/<name>/reply` (a request without a
Response Topic) and `{root}/_client/{client}/reply` (the Response Topic robobus's clients name). The
operation's `reply` keeps the runtime address (the request's Response Topic) on the address-less
`responseTopic` channel, as AsyncAPI requires of a reply with an `address`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared import __version__
from shared.contract import (
    NAME_RE,
    BinarySpec,
    CommandSpec,
    JobSpec,
    ServiceAPI,
    StateSpec,
    command_errors,
    motion_kind,
)
from shared.messages import (
    CancelReply,
    ErrorReply,
    Health,
    JobAccepted,
    JobResult,
    NodeStats,
    OkReply,
    Status,
    StopAnswer,
    StopState,
)
from shared.registry import service_apis
from shared.tools.codegen_schema import name_inline_schemas, pascal

REF = "#/components/schemas/{model}"
# 3.0.0, not 3.1.0: the parser here (@asyncapi/parser 3.6.3) takes 3.1.0, but Modelina 5.10.1 (the latest release,
# and what `asyncapi generate models` runs) reads AsyncAPI input up to 3.0.0 only (tests/contract/test_generic_tools.py)
ASYNCAPI_VERSION = "3.0.0"
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
REPLY_QOS_MAX = 1  # the number in a reply channel's `x-robobus.qos`: QoS 1 and 2 requests are answered at 1
CLIENT_REPLY = "{root}/_client/{client}/reply"  # the Response Topic of RpcClient, the CLI and the dashboard


PARAMS = {
    "root": {"description": ("Topic root (ROBOBUS_TOPIC_ROOT) when it is one topic level, e.g. 'robobus'. "
                             "A root of several levels (e.g. 'site1/robobus') is written into the addresses of "
                             "the document made for it: `robobus schema --root site1/robobus`, "
                             "`make schema ROOT=site1/robobus`, or the dashboard's /api/asyncapi.json"),
             "default": "robobus", "examples": ["robobus"]},
    "node": {"description": "Node name (ROBOBUS_NODE); defaults to the service name"},
    "device": {"description": "Device name, one per piece of hardware the node serves"},
    "client": {"description": "The requester's MQTT client id: robobus's clients (the `robobus` CLI, "
                              "shared.rpc.RpcClient, the dashboard) name `{root}/_client/<client id>/reply` "
                              "as their requests' Response Topic"},
}


def check_root(root: str) -> str:
    """A topic root as ROBOBUS_TOPIC_ROOT accepts it: one or more `/`-separated names, no wildcards."""
    if not root or any(not NAME_RE.match(p) for p in root.split("/")):
        raise ValueError(f"topic root {root!r} must be one or more '/'-separated names matching "
                         f"{NAME_RE.pattern} (no wildcards, no empty levels)")
    return root


class DocBuilder:
    def __init__(self, title: str, version: str, root: str | None = None) -> None:
        """`root`: write this topic root into every address; None: the `{root}` parameter (one level)."""
        self.title = title
        self.version = version
        self.root = check_root(root) if root is not None else None
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
        retained and at which QoS they are published (the operation's MQTT binding says the same; a
        reply goes at the request's QoS, so a reply channel gives the highest, 1)."""
        if address is not None and self.root is not None:
            address = address.replace("{root}", self.root)
        params = {p: PARAMS[p] for p in re.findall(r"{(\w+)}", address or "")}
        ch: dict[str, Any] = {"address": address, "messages": messages, "description": description,
                              "x-robobus": {"kind": kind, "retain": retain, "qos": qos}}
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
            # the address is the request's Response Topic (a runtime expression), so the reply's channel is
            # the address-less `responseTopic` (AsyncAPI: "the address property of the channel referenced
            # MUST be either null or not defined"); the addressed reply channels are for topic matching
            op["reply"] = {
                "address": {"description": f"The reply topic: {REPLY_TOPIC}",
                            "location": "$message.header#/responseTopic"},
                "channel": {"$ref": "#/channels/responseTopic"},
                "messages": [{"$ref": f"#/channels/responseTopic/messages/{k}"}
                             for k in self.channels[reply_cid]["messages"]],
            }
        if contract:
            op["x-robobus"] = contract
        self.operations[oid] = op

    def reply_union(self, reply: type[BaseModel]) -> dict[str, str]:
        """`{"ok": true, "result": <reply>} | {"ok": false, "error": ...}` as two named components."""
        ok_name, union_name = reply_names(reply)
        # `ok` as ErrorReply's: a constant with its default, not required. A required boolean constant has no
        # value in Modelina's default TypeScript classes (the property is never set: `tsc --strict` fails).
        self.extra_schemas[ok_name] = {
            "type": "object",
            "description": f"A successful reply carrying {reply.__name__}",
            "required": ["result"],
            "properties": {"ok": {"const": True, "default": True, "type": "boolean", "title": "Ok"},
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
        # the bus-wide software stop (shared/stop.py; docs/kit.md "Stopping everything"): not a hardware e-stop
        self.channel("stop", "{root}/_stop",
                     {"StopState": self.message("StopState", self.model(StopState), title="Bus stop",
                                                summary="The latched software stop of this topic root")},
                     "Retained, QoS 1: the latched software stop of every motion device under this topic root (it "
                     "does not replace a hardware emergency stop). Written by the operator role only (`robobus "
                     "stop`, `robobus stop --release`, Home Assistant's button); every node reads it before it "
                     "accepts a motion command. While `active`, motion commands answer `stopped`; a release "
                     "(`active: false`) lets a device move again on its next command, never by itself. An "
                     "unreadable message counts as an active stop; an empty retained message as a release.",
                     retain=True, qos=1, kind="stop")
        self.operation("setStop", "receive", "stop", "Set or release the bus stop", qos=1, retain=True)
        self.channel("stopFleet", "{root}/_stop/fleet",
                     {"StopState": self.message("StopState", self.model(StopState), title="Bus stop",
                                                summary="The latched software stop of this topic root")},
                     "Retained, QoS 1: the fleet centre's stop of this site, a latch of its own beside `stop`: the "
                     "site's bridge maps the centre's `{root}/_stop` to it, so that the centre's retained state, "
                     "sent down again on every reconnect, never replaces the site's own stop. No client at the site "
                     "writes it (the centre's operator sets and releases it, at the centre); every node reads it. "
                     "A node is stopped while this or `stop` is active; a release lifts only its own channel. Read "
                     "as `stop` is: an unreadable message counts as an active stop, an empty retained message as a "
                     "release, a release older than the channel's active stop is ignored.",
                     retain=True, qos=1, kind="stop")
        self.operation("setFleetStop", "receive", "stopFleet",
                       "The fleet centre sets or releases the bus stop (through the site's bridge)", qos=1,
                       retain=True)
        self.channel("stopAnswer", "{root}/{node}/_node/state/stop",
                     {"StopAnswer": self.message("StopAnswer", self.model(StopAnswer), title="Stop answer",
                                                 summary="A node's answer to the latest stop or release")},
                     "Retained: a node's answer to the latest StopState it read (`stop_ts` names it), per motion "
                     "device: held stopped, and when the stop reached the device as the service reports it; "
                     "published when read and again as each device reports.", retain=True, qos=1, kind="state")
        self.operation("publishStopAnswer", "send", "stopAnswer", "A node's answer to the bus stop", qos=1,
                       retain=True)
        # every command's reply message joins these two as the commands are added (see command())
        self.channel("responseTopic", None, {},
                     f"A command's reply, on {REPLY_TOPIC}: the address is the request's (operations' "
                     f"`reply.address`). At {REPLY_QOS}.", qos=REPLY_QOS_MAX, kind="reply")
        self.channel("clientReply", CLIENT_REPLY, {},
                     "Replies to the requests of robobus's own clients (the `robobus` CLI, shared.rpc.RpcClient, "
                     "the dashboard), which name this topic as the MQTT 5 Response Topic: any command's reply. "
                     f"At {REPLY_QOS}.", qos=REPLY_QOS_MAX, kind="reply")
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
            kinds = None
            if api.kinds:  # the kinds of device that answer it (ServiceAPI.kind)
                kinds = sorted(k.name for k in api.kinds.values()
                               if spec.name in (k.jobs if isinstance(spec, JobSpec) else k.commands))
            self.command(svc, dev, spec, kinds)
        for name, sp in sorted(api.streams.items()):
            cid = _cid(svc, "stream", name)
            self.channel(cid, f"{dev}/stream/{name}",
                         {cid: self.message(cid, self.model(sp.model), summary=sp.doc or name,
                                            title=f"{svc} stream {name}")},
                         f"{svc}: {sp.doc or name} (stream, {'into' if sp.direction == 'in' else 'out of'} "
                         "the node)", qos=sp.qos, kind="stream")
            self.operation(_cid(svc, "stream", name), "receive" if sp.direction == "in" else "send", cid,
                           sp.doc or name, qos=sp.qos)

    def command(self, svc: str, dev: str, spec: CommandSpec | JobSpec, kinds: list[str] | None = None) -> None:
        """One command: its request channel, its reply channel, and what a client cannot guess
        (job or not, whether it moves: `motion` never / always / request, i.e. the bus stop refuses none, every or
        some of its requests; the error codes, the reply topic and QoS, and for a service with kinds of device the
        kinds that answer it) in the operation's `x-robobus`."""
        name = spec.name
        cid = _cid(svc, "cmd", name)
        rid = _cid(svc, "cmd", name, "reply")
        doc = spec.doc or name
        codes = [c.value for c in command_errors(spec)]
        contract: dict[str, Any] = {"job": isinstance(spec, JobSpec), "motion": motion_kind(spec), "errors": codes,
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
        if kinds is not None:  # a device of another kind answers not_found
            contract["kinds"] = kinds
            doc += f" Devices of kind: {', '.join(kinds)}."
        self.channel(cid, f"{dev}/cmd/{name}",
                     {cid: self.message(cid, self.model(spec.request), summary=doc, correlated=True,
                                        title=f"{svc} command {name}")},
                     f"{svc}: {doc}", qos=1, kind="cmd")
        reply_msg = self.message(rid, self.reply_union(reply_model), summary=f"reply to {name}", correlated=True,
                                 title=f"{svc} reply to {name}")
        self.channel(rid, f"{dev}/cmd/{name}/reply", {rid: reply_msg},
                     f"Reply to {svc} {name} when the request has no MQTT 5 Response Topic (MQTT 3 clients); "
                     f"otherwise it goes to the Response Topic (channels responseTopic, clientReply). "
                     f"At {REPLY_QOS}.", qos=REPLY_QOS_MAX, kind="reply")
        for shared_cid in ("responseTopic", "clientReply"):
            self.channels[shared_cid]["messages"][rid] = reply_msg
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
            "asyncapi": ASYNCAPI_VERSION,
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


def build_document(apis: Iterable[ServiceAPI] | None = None, root: str | None = None) -> dict[str, Any]:
    """The document of `apis` (default: every registered service). `root`: the document for that topic root,
    written into every address (the one a deployment with a multi-level root hands to generic tools);
    None: the `{root}` parameter (the committed docs/asyncapi.yaml)."""
    b = DocBuilder("robobus", __version__, root)
    b.kit()
    for api in apis if apis is not None else discover_apis():
        b.service(api)
    doc = b.document()
    if root is not None:
        doc["info"]["description"] += f" Made for the topic root {root!r}: every address starts with it."
    return doc


def render_yaml(doc: dict[str, Any]) -> str:
    import yaml  # here: the dashboard builds the document, never its YAML (~2 MB resident)

    class NoAnchors(yaml.SafeDumper):
        """A schema shared by two messages is written out twice, not as `&id062` / `*id062`: generated anchor
        numbers shift with every change elsewhere, so a new service's diff would renumber unrelated lines."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(doc, Dumper=NoAnchors, sort_keys=False, allow_unicode=True, width=100)


def write_docs(out_dir: Path, apis: Iterable[ServiceAPI] | None = None, root: str | None = None) -> list[Path]:
    """docs/asyncapi.yaml plus one standalone JSON Schema per model in docs/schemas/."""
    doc = build_document(apis, root)
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
    Tests use it to prove that every message on the bus is what the document says. `{root}` matches a root
    of any depth here (the tests' own reading); every other parameter is one topic level."""

    def __init__(self, doc: dict[str, Any]) -> None:
        import jsonschema

        self._jsonschema = jsonschema
        self.schemas = doc["components"]["schemas"]
        # (address pattern, the channel's messages, channel id)
        self.routes: list[tuple[re.Pattern[str], list[dict[str, Any]], str]] = []
        self.node_services: dict[str, str] = {}  # node -> service, from the status and health messages validated
        msgs = doc["components"]["messages"]
        for cid, ch in doc["channels"].items():
            addr = ch.get("address")
            if not addr:
                continue
            pat = re.escape(addr).replace(re.escape("{root}"), r"(?P<root>.+?)")
            pat = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", pat)
            refs = [m["$ref"].rsplit("/", 1)[-1] for m in ch["messages"].values()]
            self.routes.append((re.compile(f"^{pat}$"), [msgs[r] for r in refs], cid))
        # most specific first: the kit's `_node` stats before a service's `{device}` channels
        self.routes.sort(key=lambda r: (-r[0].pattern.count("_node"), -len(r[0].pattern)))

    def channels_for(self, topic: str) -> list[tuple[str, list[dict[str, Any]]]]:
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

    def channel_for(self, topic: str) -> tuple[str, list[dict[str, Any]]] | None:
        hits = self.channels_for(topic)
        return hits[0] if hits else None

    def validate(self, topic: str, payload: bytes) -> str:
        """Return the channel id; raise AssertionError when the topic or payload is not in the contract. Where
        services share an address, the node's service (learnt from its status or health messages seen here)
        picks the channel; before that, the payload must be valid for one of them. On a channel of several
        messages (`clientReply`: any command's reply) the payload must be valid for one of them."""
        hits = self.channels_for(topic)
        if not hits:
            raise AssertionError(f"topic {topic!r} is not in the AsyncAPI document")
        failures = []
        for cid, messages in hits:
            for msg in messages:
                if msg.get("contentType", "application/json") != "application/json":
                    return cid
                try:
                    data = json.loads(payload)
                except ValueError as exc:
                    raise AssertionError(f"{topic}: payload is not JSON ({exc})") from None
                schema = {**msg["payload"], "components": {"schemas": self.schemas}}
                errors = sorted(self._jsonschema.Draft202012Validator(schema).iter_errors(data), key=str)
                if not errors:
                    if isinstance(data, dict) and isinstance(data.get("service"), str) \
                            and isinstance(data.get("node"), str):
                        self.node_services[data["node"]] = data["service"]
                    return cid
                failures.append(f"{topic} ({cid}): {errors[0].message} at {list(errors[0].absolute_path)}")
        raise AssertionError("; ".join(failures[:3]) + (f" (and {len(failures) - 3} more)" if len(failures) > 3
                                                        else ""))

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
