"""The live bus as a Foxglove WebSocket server (the Foxglove SDK's `foxglove.start_server`).

    bridge = FoxgloveBridge(settings, document)    # document: the AsyncAPI document (bus_catalog.load_document)
    bridge.start()                                 # the server listens, the MQTT session connects
    ...
    bridge.stop()

Channels. Every status, health, state and event topic of every node, and the two stop latches, is a Foxglove
channel named by its MQTT topic, with the JSON Schema the contract gives it: the same topic names, schema names,
schema bytes and channel metadata as `robobus record` writes into its MCAP files (both ask
shared.tools.bus_catalog.TopicCatalog), so a layout made on the live view opens a recording too. A channel is
advertised at its topic's first message and withdrawn when its node goes offline (its status says so: Last Will
or shutdown); the node's status channel stays, carrying the offline status. A retained message of a node that is
offline (its last health, kept by the broker until it expires) is the dead node's last word: not advertised. Each
message's log time is when the bridge received it from the broker (ns since the Unix epoch), as the recorder's.
A binary state with an image Content Type (the e-puck camera) is a `foxglove.CompressedImage` (JSON, base64).

Services. Every command of every online node's devices is a Foxglove service named by its command topic
(`{root}/{node}/{device}/cmd/{name}`), with the contract's request schema and its reply schema (`{"ok": true,
"result": ...}` or `{"ok": false, "error": {"code", "message"}}`, the stable codes). A call is sent as an MQTT 5
request (Response Topic, Correlation Data, an age of the call's timeout) and answered with the node's reply as it
came. What the bridge answers itself, in the same shape: `forbidden` when the broker refuses the request (PUBACK
"not authorized": the bridge's MQTT user may not send commands), `unavailable` when the node is offline or the
broker unreachable, `timeout` without a reply, `invalid_request` for a request that is not JSON. Two services
more, `{root}/_stop/stop` and `{root}/_stop/release`, set and release the site's bus stop (`{root}/_stop`,
retained, QoS 1, a StopState whose source names the bridge's MQTT user and the Foxglove client), and answer with
what every online node answered. Who may stop, release or command is the broker's rule, as for every client: only
the operator role of the deployment's ACL may write commands and the stop (deploy/make_secrets.py); the bridge
sends with its own MQTT user, so a bridge that logs in as `viewer` answers every command and the stop
`forbidden`."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import foxglove
import paho.mqtt.client as mqtt
from foxglove import MessageSchema, Schema, Service, ServiceRequest, ServiceSchema, StatusLevel
from foxglove.websocket import Capability, ChannelView, Client, ServerListener, WebSocketServer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import ErrorCode
from shared.messages import ErrorInfo, ErrorReply, StopAnswer, StopState
from shared.mqtt.session import MqttSession, command_properties, unique_client_id
from shared.settings import KitSettings
from shared.stop import ANSWER_STATE, fleet_stop_topic, stop_topic
from shared.tools.bus_catalog import (
    JSON,
    META_CHANNEL,
    META_CONTENT_TYPE,
    META_KIND,
    META_TOPIC,
    TopicCatalog,
)
from shared.tools.foxglove import images

log = logging.getLogger("robobus.foxglove")

NOT_AUTHORIZED = 0x87  # MQTT 5 reason code of a PUBACK the broker's ACL refused


class FoxgloveStopRequest(BaseModel):
    """The request of the stop and release services."""

    model_config = ConfigDict(extra="forbid", title="FoxgloveStopRequest")
    reason: str = Field(default="", max_length=500, description="Why, in the operator's words")


class FoxgloveStopResult(BaseModel):
    """What the stop or release service did: the StopState written, and each online node's answer to it."""

    model_config = ConfigDict(title="FoxgloveStopResult")
    stop: StopState
    online: list[str] = Field(description="The nodes online when it was written")
    answers: dict[str, StopAnswer] = Field(description="Each node's answer to this stop, as far as it came")
    silent: list[str] = Field(description="Online nodes without an answer (or with a device still pending) in time")


class FoxgloveStopOk(BaseModel):
    model_config = ConfigDict(title="FoxgloveStopOk")
    ok: bool = Field(default=True, json_schema_extra={"const": True})
    result: FoxgloveStopResult


class FoxgloveStopReply(BaseModel):
    """The stop and release services' reply, in the contract's shape."""

    model_config = ConfigDict(title="FoxgloveStopReply")
    reply: FoxgloveStopOk | ErrorReply


def _model_schema(model: type[BaseModel], name: str) -> bytes:
    return json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": name,
                       **model.model_json_schema()}, sort_keys=True).encode()


def _reply_schema() -> bytes:
    """`FoxgloveStopOk | ErrorReply` as one standalone schema."""
    wrapped = FoxgloveStopReply.model_json_schema()
    body = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "FoxgloveStopReply",
            "anyOf": wrapped["properties"]["reply"]["anyOf"], "$defs": wrapped.get("$defs", {})}
    return json.dumps(body, sort_keys=True).encode()


def error_reply(code: ErrorCode, message: str) -> bytes:
    return ErrorReply(error=ErrorInfo(code=code, message=message)).model_dump_json().encode()


class FoxgloveSettings(KitSettings):
    """`robobus foxglove`: ROBOBUS_FOXGLOVE_* on top of the kit's broker settings and topic root."""

    section = "foxglove"
    # compose's choice of broker user for the bridge (deploy/compose.foxglove.yaml), not read by the process
    unchecked_env = frozenset({"ROBOBUS_FOXGLOVE_USER", "ROBOBUS_FOXGLOVE_BIND"})
    foxglove_host: str = Field("127.0.0.1", description="Address the Foxglove WebSocket server binds")
    foxglove_port: int = Field(8765, ge=0, le=65535, description="Its port (0 = any free port)")
    foxglove_commands: bool = Field(True, description="Offer every command and the bus stop as Foxglove services "
                                                       "(the broker still decides who may send them)")
    foxglove_call_timeout_s: float = Field(10.0, gt=0, le=300, description="How long a service call waits for the "
                                                                             "node's reply (also the request's age)")
    foxglove_stop_wait_s: float = Field(3.0, ge=0, le=60, description="How long the stop and release services wait "
                                                                       "for every online node's answer")


@dataclass
class _Node:
    service: str = ""
    devices: list[str] = field(default_factory=list)
    online: bool = True
    services: list[str] = field(default_factory=list)  # the Foxglove services advertised for it


class _Requests:
    """Requests in flight: the broker's PUBACK (refused or not) and the node's reply, matched by packet id and
    Correlation Data."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._acks: dict[int, int] = {}  # mid -> PUBACK reason code
        self._replies: dict[bytes, bytes | None] = {}  # correlation -> reply (None: waiting)

    def on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        value = getattr(reason_code, "value", 0)
        with self._cond:
            self._acks[mid] = int(value)
            if len(self._acks) > 10_000:  # only our own requests are acknowledged; never grows past those waited
                self._acks.pop(next(iter(self._acks)))
            self._cond.notify_all()

    def expect(self, corr: bytes) -> None:
        with self._cond:
            self._replies[corr] = None

    def forget(self, corr: bytes) -> None:
        with self._cond:
            self._replies.pop(corr, None)

    def on_reply(self, corr: bytes, payload: bytes) -> None:
        with self._cond:
            if corr in self._replies and self._replies[corr] is None:
                self._replies[corr] = payload
                self._cond.notify_all()

    def wait_ack(self, mid: int, deadline: float) -> int | None:
        with self._cond:
            while mid not in self._acks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._acks.pop(mid)

    def wait_reply(self, corr: bytes, deadline: float) -> bytes | None:
        with self._cond:
            while self._replies.get(corr) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._replies.pop(corr)


class _Listener(ServerListener):
    def __init__(self, bridge: FoxgloveBridge) -> None:
        self.bridge = bridge

    def on_subscribe(self, client: Client, channel: ChannelView) -> None:
        try:
            self.bridge.replay_latest(channel.topic)
        except Exception:  # a callback of the SDK's: never raise into it
            log.exception("replaying the latest message of %s", channel.topic)


class FoxgloveBridge:
    """The bus as Foxglove channels and services (module doc)."""

    def __init__(self, settings: FoxgloveSettings, document: dict[str, Any], *, name: str = "robobus") -> None:
        self.settings = settings
        self.root = settings.topic_root
        self.document = document
        self.catalog = TopicCatalog.from_document(document, self.root)
        self.name = name
        self.ctx = foxglove.Context()
        self.server: WebSocketServer | None = None
        self.session = MqttSession(settings, unique_client_id("foxglove"))
        self.reply_topic = f"{self.root}/_client/{self.session.client_id}/reply"
        self.requests = _Requests()
        self._lock = threading.RLock()
        self.channels: dict[str, foxglove.Channel] = {}
        self.images: dict[str, tuple[str, str]] = {}  # topic -> (frame id, format) for image channels
        # topics the contract retains (status, health, the stop, slow states): their latest message and its log
        # time, given again to a client that subscribes (Foxglove has no retained messages: a status sent once
        # would otherwise never reach a client that connects later)
        self.retained_channels = {cid for cid, ch in document.get("channels", {}).items()
                                  if (ch.get("x-robobus") or {}).get("retain")}
        self.keep: set[str] = set()
        self.latest: dict[str, tuple[bytes, int]] = {}
        self.nodes: dict[str, _Node] = {}
        self.answers: dict[str, StopAnswer] = {}  # node -> its latest answer to a stop or release
        self.answered = threading.Condition(self._lock)
        self.messages = 0
        self.dropped_retained = 0
        self.bad_messages = 0
        self._stop_services = [f"{self.root}/_stop/stop", f"{self.root}/_stop/release"]

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    def start(self) -> None:
        s = self.settings
        caps = [Capability.Services] if s.foxglove_commands else []
        self.server = foxglove.start_server(
            name=self.name, host=s.foxglove_host, port=s.foxglove_port, capabilities=caps,
            supported_encodings=["json"], context=self.ctx, server_listener=_Listener(self),
            services=self._stop_service_list() if s.foxglove_commands else None)
        r = self.root
        # status first: the broker sends each subscription's retained messages in order, so a dead node's
        # offline status is known before its retained health arrives
        for topic_filter in (f"{r}/+/status", f"{r}/+/+/health", f"{r}/+/+/state/#", f"{r}/+/+/event/#",
                             stop_topic(r), fleet_stop_topic(r)):
            self.session.subscribe(topic_filter, self._on_message, qos=1)
        self.session.subscribe(self.reply_topic, self._on_reply, qos=1)
        self.session.client.on_publish = self.requests.on_publish
        self.session.on_connect(self._broker_back)
        self.session.on_disconnect(self._broker_lost)
        self.session.start()

    def _broker_lost(self) -> None:
        """Foxglove's problems list says so: what the channels show is the last that came, not current."""
        if self.server is not None:
            b = self.settings.broker()
            self.server.publish_status(f"robobus: the broker {b.host}:{b.port} is not reached; what is shown is the "
                                       "last that came", StatusLevel.Warning, id="broker")

    def _broker_back(self) -> None:
        if self.server is not None:
            self.server.remove_status(["broker"])

    def stop(self) -> None:
        self.session.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None
        with self._lock:
            for ch in self.channels.values():
                ch.close()
            self.channels.clear()

    def wait_ready(self, timeout: float) -> bool:
        """Connected to the broker with every subscription acknowledged."""
        return self.session.wait_ready(timeout)

    # -- MQTT -> channels (paho's network thread) ----------------------------------------------------
    def _on_message(self, msg: mqtt.MQTTMessage) -> None:
        t_ns = time.time_ns()
        topic = msg.topic
        payload = bytes(msg.payload)
        parts = topic[len(self.root) + 1:].split("/")
        node = parts[0] if parts and not parts[0].startswith("_") else None
        if node is not None and len(parts) == 2 and parts[1] == "status":
            self._status(node, payload)
        elif node is not None:
            n = self.nodes.get(node)
            if n is not None and not n.online:
                if msg.retain:  # the dead node's last word (its health until it expires): not advertised
                    self.dropped_retained += 1
                    return
                n.online = True  # live messages: it is back, whatever its status said last
            if len(parts) == 4 and parts[1:] == ["_node", "state", ANSWER_STATE] and payload:
                self._answer(node, payload)
            if len(parts) == 3 and parts[2] == "health" and payload:
                self.catalog.learn(topic, payload)
        if not payload:  # a retained value cleared: nothing to show
            return
        ch = self.channels.get(topic)
        if ch is None:
            ch = self._advertise(topic, msg)
            if ch is None:
                return
        self.messages += 1
        if topic in self.keep:
            self.latest[topic] = (payload, t_ns)
        img = self.images.get(topic)
        if img is None:
            ch.log(payload, log_time=t_ns)
        elif ch.has_sinks():  # base64 and JSON only for a subscriber
            ch.log(images.compressed_image(payload, t_ns, img[0], img[1]), log_time=t_ns)

    def _advertise(self, topic: str, msg: mqtt.MQTTMessage) -> foxglove.Channel | None:
        info = self.catalog.info(topic)
        ctype = getattr(msg.properties, "ContentType", None) or info.content_type
        meta = {META_TOPIC: topic, META_KIND: info.kind, META_CONTENT_TYPE: ctype}
        if info.channel:
            meta[META_CHANNEL] = info.channel
        fmt = images.image_format(ctype)
        with self._lock:
            if topic in self.channels:
                return self.channels[topic]
            if fmt is not None:
                parts = topic.split("/")
                self.images[topic] = (parts[-3] if len(parts) >= 3 else "", fmt)
                schema = Schema(name=images.SCHEMA_NAME, encoding="jsonschema", data=images.SCHEMA_BYTES)
            elif ctype.startswith(JSON) and info.schema is not None and info.schema_name is not None:
                schema = Schema(name=info.schema_name, encoding="jsonschema", data=info.schema)
            elif ctype.startswith(JSON):
                schema = None  # not in the contract: schema-less JSON
            else:
                log.debug("not shown (binary, no image): %s %s", topic, ctype)
                return None
            ch = foxglove.Channel(topic, schema=schema, message_encoding="json", context=self.ctx, metadata=meta)
            self.channels[topic] = ch
            if info.channel in self.retained_channels or info.kind in ("status", "health"):
                self.keep.add(topic)
            return ch

    def replay_latest(self, topic: str) -> None:
        """A client subscribed: give the topic's latest retained message again, at its own log time."""
        got = self.latest.get(topic)
        ch = self.channels.get(topic)
        if got is None or ch is None:
            return
        payload, t_ns = got
        img = self.images.get(topic)
        ch.log(payload if img is None else images.compressed_image(payload, t_ns, img[0], img[1]), log_time=t_ns)

    def _status(self, node: str, payload: bytes) -> None:
        """A node's status: advertise its services when it is online, withdraw its channels when it is not."""
        try:
            data: dict[str, Any] = json.loads(payload) if payload else {"online": False}
            online = bool(data.get("online"))
            devices = data.get("devices") or []
        except (ValueError, AttributeError):
            self.bad_messages += 1
            return
        if payload:
            self.catalog.learn(f"{self.root}/{node}/status", payload)
        with self._lock:
            n = self.nodes.setdefault(node, _Node())
            n.online = online
            old_services = n.services
            n.services = []
            if online:
                n.service = str(data.get("service", ""))
                n.devices = [d for d in devices if isinstance(d, str) and d != "_node"]
                gone: list[str] = []
            else:
                prefix = f"{self.root}/{node}/"
                keep = f"{prefix}status"
                gone = [t for t in self.channels if t.startswith(prefix) and t != keep]
                for t in gone:
                    self.channels.pop(t).close()
                    self.images.pop(t, None)
                    self.latest.pop(t, None)
                self.answers.pop(node, None)
        if gone:
            log.info("node %s offline: %d channels withdrawn", node, len(gone))
        new = self._node_services(node) if online else []
        if [s.name for s in new] == old_services:  # a status again (our reconnect, its retained copy): as it was
            with self._lock:
                n.services = old_services
            return
        self._replace_services(old_services, new, node)

    def _answer(self, node: str, payload: bytes) -> None:
        try:
            a = StopAnswer.model_validate_json(payload)
        except ValidationError:
            self.bad_messages += 1
            return
        with self.answered:
            self.answers[node] = a
            self.answered.notify_all()

    def _on_reply(self, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        if corr is not None:
            self.requests.on_reply(bytes(corr), bytes(msg.payload))

    # -- services -------------------------------------------------------------------------------------
    def _replace_services(self, old: list[str], new: list[Service], node: str) -> None:
        server = self.server
        if server is None or not self.settings.foxglove_commands:
            return
        if old:
            server.remove_services(old)
        if new:
            server.add_services(new)
        with self._lock:
            n = self.nodes.get(node)
            if n is not None:
                n.services = [s.name for s in new]

    def _node_services(self, node: str) -> list[Service]:
        """One service per command of the node's service, for each of its devices (a device of a kind that does
        not answer a command says so: `not_found`, as to every client)."""
        with self._lock:
            n = self.nodes.get(node)
            if n is None or not n.service:
                return []
            service, devices = n.service, list(n.devices)
        prefix = f"{service}_cmd_"
        commands = sorted(cid[len(prefix):] for cid, ch in self.document.get("channels", {}).items()
                          if cid.startswith(prefix) and not cid.endswith("_reply") and ch.get("address"))
        out = []
        for dev in devices:
            for cmd in commands:
                topic = f"{self.root}/{node}/{dev}/cmd/{cmd}"
                req, rep = self.catalog.info(topic), self.catalog.info(f"{topic}/reply")
                if req.schema is None or rep.schema is None or req.schema_name is None or rep.schema_name is None:
                    continue
                schema = ServiceSchema(
                    req.channel or topic,
                    request=MessageSchema(encoding="json", schema=Schema(name=req.schema_name, encoding="jsonschema",
                                                                         data=req.schema)),
                    response=MessageSchema(encoding="json", schema=Schema(name=rep.schema_name, encoding="jsonschema",
                                                                          data=rep.schema)))
                out.append(Service(topic, schema=schema, handler=self._command_handler(node, topic)))
        return out

    def _command_handler(self, node: str, topic: str) -> Callable[[ServiceRequest], bytes]:
        def handle(req: ServiceRequest) -> bytes:
            try:
                return self.command(node, topic, req.payload, req.encoding)
            except Exception as exc:  # never leave a Foxglove call unanswered
                log.exception("service %s failed", topic)
                return error_reply(ErrorCode.INTERNAL, f"the Foxglove bridge failed: {exc}")
        return handle

    def command(self, node: str, topic: str, payload: bytes, encoding: str = "json") -> bytes:
        """One command sent as an MQTT 5 request; the node's reply bytes, or the bridge's own error reply."""
        if encoding != "json":
            return error_reply(ErrorCode.INVALID_REQUEST, f"requests are JSON, not {encoding!r}")
        try:
            json.loads(payload or b"{}")
        except ValueError as exc:
            return error_reply(ErrorCode.INVALID_REQUEST, f"the request is not JSON: {exc}")
        n = self.nodes.get(node)
        if n is not None and not n.online:
            return error_reply(ErrorCode.UNAVAILABLE, f"node {node} is offline")
        timeout = self.settings.foxglove_call_timeout_s
        deadline = time.monotonic() + timeout
        corr = self._new_corr()
        self.requests.expect(corr)
        try:
            refused = self._publish(topic, payload or b"{}", deadline, corr=corr, age_s=timeout)
            if refused is not None:
                return refused
            reply = self.requests.wait_reply(corr, deadline)
        finally:
            self.requests.forget(corr)
        if reply is None:
            return error_reply(ErrorCode.TIMEOUT, f"no reply from {node} to {topic.rsplit('/', 1)[-1]} within "
                                                  f"{timeout:g} s")
        return reply

    @staticmethod
    def _new_corr() -> bytes:
        return os.urandom(16)  # what uuid4() draws

    def _publish(self, topic: str, payload: bytes, deadline: float, *, corr: bytes | None = None,
                 age_s: float | None = None, retain: bool = False) -> bytes | None:
        """Publish at QoS 1 and wait for the broker's PUBACK: None when taken, else the error reply to give."""
        if not self.session.connected.is_set():
            return error_reply(ErrorCode.UNAVAILABLE, "the Foxglove bridge is not connected to the broker")
        props = command_properties(self.reply_topic if corr else None, corr, age_s)
        info = self.session.client.publish(topic, payload, qos=1, retain=retain, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return error_reply(ErrorCode.UNAVAILABLE, f"the broker connection refused the message ({info.rc})")
        rc = self.requests.wait_ack(info.mid, deadline)
        if rc is None:
            return error_reply(ErrorCode.TIMEOUT, "the broker did not acknowledge the message in time")
        if rc == NOT_AUTHORIZED:
            user = self.settings.broker().username or "anonymous"
            return error_reply(ErrorCode.FORBIDDEN, f"the broker refused {topic} to the bridge's MQTT user {user!r} "
                                                    "(not authorized: only the operator role may send commands and "
                                                    "the bus stop)")
        if rc >= 0x80:
            return error_reply(ErrorCode.UNAVAILABLE, f"the broker refused {topic} (reason code 0x{rc:02x})")
        return None

    # -- the bus stop ----------------------------------------------------------------------------------
    def _stop_service_list(self) -> list[Service]:
        req = MessageSchema(encoding="json", schema=Schema(name="FoxgloveStopRequest", encoding="jsonschema",
                                                           data=_model_schema(FoxgloveStopRequest,
                                                                              "FoxgloveStopRequest")))
        rep = MessageSchema(encoding="json", schema=Schema(name="FoxgloveStopReply", encoding="jsonschema",
                                                           data=_reply_schema()))
        out = []
        for name, active in zip(self._stop_services, (True, False), strict=True):
            out.append(Service(name, schema=ServiceSchema(name, request=req, response=rep),
                               handler=self._stop_handler(active)))
        return out

    def _stop_handler(self, active: bool) -> Callable[[ServiceRequest], bytes]:
        def handle(req: ServiceRequest) -> bytes:
            try:
                return self.set_stop(active, req.payload, f"client {req.client_id}")
            except Exception as exc:
                log.exception("the stop service failed")
                return error_reply(ErrorCode.INTERNAL, f"the Foxglove bridge failed: {exc}")
        return handle

    def set_stop(self, active: bool, payload: bytes, who: str = "") -> bytes:
        """Write the site's stop (or its release) and wait for the online nodes' answers."""
        try:
            body = FoxgloveStopRequest.model_validate_json(payload or b"{}")
        except ValidationError as exc:
            return error_reply(ErrorCode.INVALID_REQUEST, str(exc.errors()[0].get("msg", exc)))
        user = self.settings.broker().username or "anonymous"
        source = f"{user} via foxglove {self.settings.foxglove_host}:{self.port}" + (f" ({who})" if who else "")
        state = StopState(active=active, source=source[:200], reason=body.reason, ts=time.time())
        with self._lock:
            online = sorted(n for n, v in self.nodes.items() if v.online)
        deadline = time.monotonic() + max(self.settings.foxglove_stop_wait_s, 2.0)
        refused = self._publish(stop_topic(self.root), state.model_dump_json().encode(), deadline, retain=True)
        if refused is not None:
            return refused
        log.warning("bus stop %s by %s: %s", "set" if active else "released", source, body.reason)
        answers = self._wait_answers(state, online, time.monotonic() + self.settings.foxglove_stop_wait_s)
        silent = [n for n in online if n not in answers or any(d.pending for d in answers[n].devices)]
        result = FoxgloveStopResult(stop=state, online=online, answers=answers, silent=silent)
        return FoxgloveStopOk(result=result).model_dump_json().encode()

    def _wait_answers(self, state: StopState, online: list[str], deadline: float) -> dict[str, StopAnswer]:
        def current() -> dict[str, StopAnswer]:
            return {n: a for n, a in self.answers.items()
                    if a.stop_ts == state.ts and a.active == state.active and a.source == state.source}

        with self.answered:
            while True:
                got = current()
                if all(n in got and not any(d.pending for d in got[n].devices) for n in online):
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return got
                self.answered.wait(left)
