"""`robobus record`: the bus into MCAP files (chunked, zstd or lz4, summary and message indexes).

    sub = LeanSubscriber(settings, filters, recorder.write)   # MQTT 5, QoS 1, retain-as-published
    recorder = Recorder(RecordOptions(path=...), catalog)     # one MCAP channel per topic
    sub.run(stop_event, tick=recorder.tick)                   # returns when stop_event is set
    recorder.close()                                          # summary + footer: a clean file

What a file holds:
- one channel per (topic, retain flag, QoS, content type); in practice one per topic. JSON topics use
  message encoding `json` with the contract's JSON Schema (`jsonschema` encoding, standalone with
  `$defs`) registered per AsyncAPI channel; binary topics (the e-puck camera) carry their MQTT 5 Content
  Type as message encoding and channel metadata, with no schema.
- beside each image topic's raw channel, a channel of the same topic with the image as
  `foxglove.CompressedImage` (JSON, the JSON Schema `robobus foxglove` advertises: the same conversion,
  shared.tools.foxglove.images), so a Foxglove layout's Image panel reads a recording as it reads the live
  bridge. Marked `robobus.derived`: not bus traffic, so replay never republishes it.
- log time = publish time = when the recorder received the message from the broker (MQTT carries no
  send time), in ns since the Unix epoch.
- the retain flag as published (subscription option Retain As Published), so a replay republishes
  retained exactly what the original publishers retained; retained messages the broker delivers at
  subscribe time are marked retained too.
- the other MQTT 5 properties of a message (Response Topic, Correlation Data, User Properties, Message
  Expiry, Payload Format) on the side channel `_robobus/mqtt_properties`: one JSON record per message
  that has any, linked by (channel id, sequence), with the same log time.
- metadata `robobus.recording` (root, filters, broker, host, version, part) and the AsyncAPI document as
  an attachment, so the file explains itself.

A chunk is closed at least every `flush_s` (default 1 s) and the file flushed to the OS, so a recorder
killed with SIGKILL loses at most that much; `robobus recover` (shared.tools.replay.recover) turns such a
file into a complete one. Rotation (size or duration) closes the file cleanly and starts the next
numbered part, carrying the latest retained message of each topic so every part stands alone.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

from mcap.writer import CompressionType, IndexType, Writer
from pydantic import Field, field_validator

from shared import __version__
from shared.mqtt.lean import handshake, open_socket
from shared.mqtt.session import unique_client_id
from shared.mqtt.wire import (
    PINGREQ_PACKET,
    Disconnect,
    MqttProtocolError,
    PacketReader,
    Publish,
    SubAck,
    encode_disconnect,
    encode_puback,
    encode_subscribe,
)
from shared.settings import KitSettings
from shared.tools.bus_catalog import (
    JSON,
    META_CANDIDATES,
    META_CHANNEL,
    META_CONTENT_TYPE,
    META_DERIVED,
    META_KIND,
    META_QOS,
    META_RECEIVES,
    META_RETAIN,
    META_TOPIC,
    TopicCatalog,
    TopicInfo,
)
from shared.tools.foxglove import images

log = logging.getLogger("robobus.record")

PROPS_TOPIC = "_robobus/mqtt_properties"
PROPS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "MqttProperties",
    "description": "MQTT 5 properties of one recorded message (linked by channel id and sequence)",
    "type": "object",
    "required": ["channel", "sequence", "topic"],
    "properties": {
        "channel": {"type": "integer"}, "sequence": {"type": "integer"}, "topic": {"type": "string"},
        "response_topic": {"type": "string"}, "correlation_data": {"type": "string", "description": "hex"},
        "user_properties": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        "message_expiry": {"type": "integer"}, "payload_format": {"type": "integer"},
    },
}
RECORDING_META = "robobus.recording"
# properties that vary per message (content type is per channel)
_SIDE_PROPS = ("response_topic", "correlation_data", "user_property", "message_expiry", "payload_format")


class RecordingFailed(Exception):
    """The recording cannot go on (the file cannot be written); the recorder stops with this message."""


class RecorderSettings(KitSettings):
    """`robobus record` / the `recorder` process: ROBOBUS_RECORD_* on top of the kit's settings."""

    record_path: str = Field("recordings/robobus-{time}.mcap",
                             description="Output file; {time} is the start time (UTC, YYYYmmdd-HHMMSS)")
    record_filters: list[str] = Field(default_factory=list,
                                      description="MQTT topic filters; default {root}/#")
    record_max_bytes: int = Field(0, ge=0, description="Rotate to the next numbered file at this size (0 = never)")
    record_max_duration_s: float = Field(0.0, ge=0, description="Rotate after this many seconds (0 = never)")
    record_compression: Literal["zstd", "lz4", "none"] = Field("zstd", description="Chunk compression")
    record_chunk_bytes: int = Field(1 << 20, ge=4096, description="Uncompressed chunk size")
    record_flush_s: float = Field(1.0, gt=0, le=60,
                                  description="Close a chunk at least this often (what a SIGKILL can lose)")
    record_session_expiry_s: int = Field(300, ge=0, description="The broker keeps our subscription and queues "
                                         "QoS 1 messages this long while we reconnect")
    record_asyncapi: Path | None = Field(None, description="AsyncAPI document for the schemas (default: built "
                                         "from the installed services, else docs/asyncapi.yaml)")
    record_foxglove_images: bool = Field(True, description="Beside each image topic's raw bytes, a channel of the "
                                         "same topic as foxglove.CompressedImage (what Foxglove's Image panel reads)")

    @field_validator("record_filters")
    @classmethod
    def _filters(cls, v: list[str]) -> list[str]:
        for f in v:
            if not f or ("#" in f and not (f == "#" or f.endswith("/#"))) or "#" in f[:-1]:
                raise ValueError(f"invalid MQTT topic filter {f!r}")
        return v


@dataclass
class RecordOptions:
    path: Path
    max_bytes: int = 0
    max_duration_s: float = 0.0
    compression: str = "zstd"
    chunk_bytes: int = 1 << 20
    flush_s: float = 1.0
    filters: Sequence[str] = ()
    broker: str = ""
    document: dict[str, Any] | None = None  # attached to every file
    foxglove_images: bool = True  # a derived foxglove.CompressedImage channel beside each image topic

    @classmethod
    def from_settings(cls, s: RecorderSettings, filters: Sequence[str], document: dict[str, Any] | None,
                      path: str | None = None) -> RecordOptions:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        b = s.broker()
        return cls(path=Path((path or s.record_path).replace("{time}", stamp)), max_bytes=s.record_max_bytes,
                   max_duration_s=s.record_max_duration_s, compression=s.record_compression,
                   chunk_bytes=s.record_chunk_bytes, flush_s=s.record_flush_s, filters=tuple(filters),
                   broker=f"{b.scheme}://{b.host}:{b.port}", document=document,
                   foxglove_images=s.record_foxglove_images)


@dataclass
class RecordStats:
    messages: int = 0
    payload_bytes: int = 0
    side_records: int = 0
    derived_records: int = 0  # foxglove.CompressedImage messages written beside the raw images
    finished_bytes: int = 0  # bytes of the files already closed
    files: list[Path] = field(default_factory=list)


_COMPRESSION = {"zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4, "none": CompressionType.NONE}


class McapFile:
    """One MCAP file being written: channels and schemas registered on first use."""

    def __init__(self, path: Path, opts: RecordOptions, metadata: dict[str, str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.stream: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in finish()
        # no attachment index group when there is no attachment: the writer would point a summary offset
        # at an empty group, which a strict reader (pymcap-cli doctor) reports as an error
        indexes = IndexType.ALL if opts.document is not None else \
            IndexType.CHUNK | IndexType.MESSAGE | IndexType.METADATA
        self.writer = Writer(self.stream, chunk_size=opts.chunk_bytes, compression=_COMPRESSION[opts.compression],
                             index_types=indexes, use_chunking=True, use_statistics=True, use_summary_offsets=True)
        self.writer.start(profile="", library="robobus-record")
        self.writer.add_metadata(RECORDING_META, metadata)
        if opts.document is not None:
            now = time.time_ns()
            self.writer.add_attachment(now, now, "asyncapi.json", JSON,
                                       json.dumps(opts.document, sort_keys=True).encode())
        self.channels: dict[tuple[str, bool, int, str | None], int] = {}
        self.sequence: dict[int, int] = {}
        self.schemas: dict[str, int] = {}
        self.props_channel = 0
        # raw image channel -> (its foxglove.CompressedImage channel, frame id, image format)
        self.derived: dict[int, tuple[int, str, str]] = {}
        self.image_channels: dict[str, int] = {}  # topic -> its foxglove.CompressedImage channel
        self.image_schema = 0
        # registered up front: the mcap writer lists a Schema group in its summary offsets even when it
        # is empty, which a strict reader (pymcap-cli doctor) calls an offset to a missing group
        self.props_schema = self.writer.register_schema("MqttProperties", "jsonschema",
                                                        json.dumps(PROPS_SCHEMA).encode())
        self.started = time.monotonic()
        self.flush()

    def flush(self) -> None:
        """Close the chunk in progress and hand the bytes to the OS (what survives a SIGKILL)."""
        self.writer.flush()  # type: ignore[no-untyped-call]

    def size(self) -> int:
        return self.stream.tell()

    def finish(self) -> int:
        self.writer.finish()  # type: ignore[no-untyped-call]
        size = self.stream.tell()
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        return size


class Recorder:
    """Turns received PUBLISH packets into MCAP messages; rotates; keeps the counters."""

    def __init__(self, opts: RecordOptions, catalog: TopicCatalog) -> None:
        self.opts = opts
        self.catalog = catalog
        self.stats = RecordStats()
        self.part = 0
        self.rotating = bool(opts.max_bytes or opts.max_duration_s)
        self._retained: dict[tuple[str, bool, int, str | None], tuple[bytes, dict[str, Any] | None]] = {}
        self._topics: set[str] = set()
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()  # write() on the network thread, tick()/close() possibly elsewhere
        self.file: McapFile | None = self._open()

    # -- files ------------------------------------------------------------------------------------
    def _part_path(self) -> Path:
        p = self.opts.path
        return p.with_name(f"{p.stem}-{self.part:04d}{p.suffix or '.mcap'}") if self.rotating else p

    def _open(self) -> McapFile:
        path = self._part_path()
        meta = {
            "root": self.catalog.root, "filters": json.dumps(list(self.opts.filters)), "broker": self.opts.broker,
            "hostname": socket.gethostname(), "robobus_version": __version__,
            "started": datetime.now(UTC).isoformat(), "part": str(self.part),
            "previous": self.stats.files[-1].name if self.stats.files else "",
            "subscription": "QoS 1, retain as published",
            "log_time": "recorder receive time, ns since the Unix epoch (publish_time is the same)",
            "properties_topic": PROPS_TOPIC,
        }
        f = McapFile(path, self.opts, meta)
        self.stats.files.append(path)
        log.info("recording to %s", path)
        return f

    def rotate(self) -> None:
        with self._lock:
            if self.file is None:
                return
            self.stats.finished_bytes += self.file.finish()
            self.part += 1
            self.file = self._open()
            now = time.time_ns()
            # every part stands alone: it starts with the latest retained value of each topic
            for key, (payload, props) in list(self._retained.items()):
                self._write(key, payload, props, now, carried=True)

    def tick(self) -> None:
        """Called a few times a second: flush a chunk every flush_s, rotate on size or duration."""
        f = self.file
        if f is None:
            return
        now = time.monotonic()
        if now - self._last_flush >= self.opts.flush_s:
            try:
                with self._lock:
                    if self.file is not None:
                        self.file.flush()
            except OSError as exc:
                raise RecordingFailed(f"cannot write {f.path}: {exc}") from exc
            self._last_flush = now
        if (self.opts.max_duration_s and now - f.started >= self.opts.max_duration_s) or \
                (self.opts.max_bytes and f.size() >= self.opts.max_bytes):
            try:
                self.rotate()
            except OSError as exc:
                raise RecordingFailed(f"cannot start the next part after {f.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self.file is not None:
                self.stats.finished_bytes += self.file.finish()
                self.file = None

    def bytes_written(self) -> int:
        f = self.file
        return self.stats.finished_bytes + (f.size() if f is not None else 0)

    @property
    def topic_count(self) -> int:
        return len(self._topics)

    # -- messages ---------------------------------------------------------------------------------
    def write(self, p: Publish, log_time: int) -> None:
        props = p.props
        ctype = props.get("content_type") if props else None
        key = (p.topic, p.retain, p.qos, ctype)
        try:
            with self._lock:
                self._write(key, p.payload, props, log_time)
        except OSError as exc:  # disk full, file system gone: not a broker problem, so no reconnect loop
            raise RecordingFailed(f"cannot write {self.file.path if self.file else self.opts.path}: {exc}") from exc
        if p.retain:
            if p.payload:
                self._retained[key] = (p.payload, props)
                if len(p.payload) < 4096:
                    self.catalog.learn(p.topic, p.payload)
            else:  # an empty retained message clears the topic's retained value
                self._retained.pop(key, None)

    def _write(self, key: tuple[str, bool, int, str | None], payload: bytes, props: dict[str, Any] | None,
               log_time: int, carried: bool = False) -> None:
        f = self.file
        if f is None:
            return
        cid = f.channels.get(key)
        if cid is None:
            cid = self._register(f, key, payload)
        seq = f.sequence[cid] = f.sequence[cid] + 1
        f.writer.add_message(cid, log_time, payload, log_time, seq)
        st = self.stats
        st.messages += 1
        st.payload_bytes += len(payload)
        if props and any(k in props for k in _SIDE_PROPS):
            self._write_props(f, cid, seq, key[0], props, log_time)
        img = f.derived.get(cid)
        if img is not None and payload:  # an empty payload clears a retained value: no image to show
            dcid, frame_id, fmt = img
            dseq = f.sequence[dcid] = f.sequence[dcid] + 1
            f.writer.add_message(dcid, log_time, images.compressed_image(payload, log_time, frame_id, fmt),
                                 log_time, dseq)
            st.derived_records += 1

    def _write_props(self, f: McapFile, cid: int, seq: int, topic: str, props: dict[str, Any],
                     log_time: int) -> None:
        if not f.props_channel:
            f.props_channel = f.writer.register_channel(PROPS_TOPIC, "json", f.props_schema,
                                                        {META_KIND: "mqtt_properties"})
            f.sequence[f.props_channel] = 0
        rec: dict[str, Any] = {"channel": cid, "sequence": seq, "topic": topic}
        if "response_topic" in props:
            rec["response_topic"] = props["response_topic"]
        if "correlation_data" in props:
            rec["correlation_data"] = bytes(props["correlation_data"]).hex()
        if "user_property" in props:
            rec["user_properties"] = [list(kv) for kv in props["user_property"]]
        if "message_expiry" in props:
            rec["message_expiry"] = props["message_expiry"]
        if "payload_format" in props:
            rec["payload_format"] = props["payload_format"]
        pseq = f.sequence[f.props_channel] = f.sequence[f.props_channel] + 1
        f.writer.add_message(f.props_channel, log_time, json.dumps(rec).encode(), log_time, pseq)
        self.stats.side_records += 1

    def _register(self, f: McapFile, key: tuple[str, bool, int, str | None], payload: bytes) -> int:
        topic, retain, qos, ctype = key
        info = self.catalog.info(topic)
        content_type = ctype or info.content_type
        if ctype is None and info.channel is None:
            # not in the contract and no Content Type: JSON if it parses, else opaque bytes
            try:
                json.loads(payload)
            except ValueError:
                content_type = "application/octet-stream"
        meta = {META_TOPIC: topic, META_RETAIN: str(retain).lower(), META_QOS: str(qos),
                META_CONTENT_TYPE: content_type, META_KIND: info.kind,
                META_RECEIVES: str(info.node_receives).lower()}
        if info.channel:
            meta[META_CHANNEL] = info.channel
        if info.candidates:
            meta[META_CANDIDATES] = ",".join(info.candidates)
        schema_id = 0
        if content_type.startswith(JSON):
            encoding = "json"
            if info.schema is not None and info.channel is not None and info.schema_name is not None:
                schema_id = f.schemas.get(info.channel, 0)
                if not schema_id:
                    schema_id = f.schemas[info.channel] = f.writer.register_schema(
                        info.schema_name, "jsonschema", info.schema)
        else:
            encoding = content_type  # binary: the MQTT Content Type says what the bytes are
        cid = f.writer.register_channel(topic, encoding, schema_id, meta)
        f.channels[key] = cid
        f.sequence[cid] = 0
        self._topics.add(topic)
        fmt = images.image_format(content_type) if self.opts.foxglove_images else None
        if fmt is not None:
            parts = topic.split("/")  # {root}/{node}/{device}/state/{name}: the frame is the device, as live
            f.derived[cid] = (self._image_channel(f, topic, info, content_type), parts[-3] if len(parts) >= 3 else "",
                              fmt)
        return cid

    @staticmethod
    def _image_channel(f: McapFile, topic: str, info: TopicInfo, content_type: str) -> int:
        """The topic's foxglove.CompressedImage channel (one per topic, whatever retain flags its raw channels
        have): the schema, encoding and metadata `robobus foxglove` advertises for it, marked derived."""
        dcid = f.image_channels.get(topic)
        if dcid is None:
            if not f.image_schema:
                f.image_schema = f.writer.register_schema(images.SCHEMA_NAME, "jsonschema", images.SCHEMA_BYTES)
            meta = {META_TOPIC: topic, META_KIND: info.kind, META_CONTENT_TYPE: content_type, META_DERIVED: "true"}
            if info.channel:
                meta[META_CHANNEL] = info.channel
            dcid = f.image_channels[topic] = f.writer.register_channel(topic, "json", f.image_schema, meta)
            f.sequence[dcid] = 0
        return dcid


# -- the subscriber -------------------------------------------------------------------------------
class LeanSubscriber:
    """An MQTT 5 subscriber on a plain (or TLS) socket, built on shared.mqtt.wire.

    QoS 1 with Retain As Published; PUBACKs go out in one write per receive batch, after the batch
    is written to the recorder. A persistent session (Session Expiry) means the broker queues our QoS 1
    messages while we reconnect; on a clean stop the session is ended (expiry 0 on DISCONNECT).
    Reconnects with the kit's capped exponential backoff."""

    def __init__(self, settings: KitSettings, filters: Sequence[str], on_publish: Callable[[Publish, int], None],
                 *, session_expiry_s: int = 300, client_id: str | None = None) -> None:
        if not filters:
            raise ValueError("no topic filters to subscribe to")
        self.settings = settings
        self.filters = list(filters)
        self.on_publish = on_publish
        self.session_expiry_s = session_expiry_s
        self.client_id = client_id or unique_client_id("robobus-record")
        self.subscribed = threading.Event()
        self.connected = threading.Event()
        self.reconnects = 0
        self.protocol_errors = 0
        self.last_error = ""
        self._sock: socket.socket | None = None
        self._ever = False
        self._early: list[Any] = []  # packets that came in the same read as the CONNACK

    def run(self, stop: threading.Event, tick: Callable[[], None] = lambda: None) -> None:
        """Connect, subscribe, record until `stop` is set; reconnect with backoff on any failure."""
        backoff = self.settings.mqtt_reconnect_min_s
        while not stop.is_set():
            reader = PacketReader()
            sock: socket.socket | None = None
            try:
                sock = open_socket(self.settings)
                _ack, self._early = handshake(
                    sock, reader, self.settings, self.client_id, clean=not self._ever,
                    props={"session_expiry": self.session_expiry_s, "receive_maximum": 65535})
                if self._ever:
                    self.reconnects += 1
                self._ever = True
                self._sock = sock
                self.connected.set()
                self.last_error = ""
                backoff = self.settings.mqtt_reconnect_min_s
                # retain handling 1: retained messages only for a subscription the broker did not keep
                sock.sendall(encode_subscribe(1, self.filters, qos=1, retain_as_published=True, retain_handling=1))
                log.info("connected; subscribing", extra={"filters": self.filters})
                self._serve(sock, reader, stop, tick)
            except MqttProtocolError as exc:
                self.protocol_errors += 1
                self.last_error = f"protocol error: {exc}"
                log.error("MQTT protocol error from the broker; reconnecting: %s", exc)
            except (OSError, ConnectionError, TimeoutError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                if not stop.is_set():
                    log.warning("broker connection: %s; reconnecting in %.1f s", self.last_error, backoff)
            finally:
                self.connected.clear()
                self.subscribed.clear()
                self._sock = None
                if sock is not None:
                    if stop.is_set():
                        try:  # end the session: the broker need not queue for us any more
                            sock.sendall(encode_disconnect(0, {"session_expiry": 0}))
                        except OSError:
                            pass
                    sock.close()
            deadline = time.monotonic() + backoff
            while not stop.is_set() and time.monotonic() < deadline:
                tick()
                stop.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, self.settings.mqtt_reconnect_max_s)

    def _serve(self, sock: socket.socket, reader: PacketReader, stop: threading.Event,
               tick: Callable[[], None]) -> None:
        keepalive = float(self.settings.mqtt_keepalive_s)
        last_rx = last_tx = last_tick = time.monotonic()
        sock.settimeout(None)
        sock.setblocking(False)
        pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted, select() cannot see them
        early, self._early = self._early, []
        if early:
            self._handle(sock, early, time.time_ns())
        while not stop.is_set():
            if not (pending and pending()):
                readable, _, _ = select.select([sock], [], [], 0.1)
            else:
                readable = [sock]
            now = time.monotonic()
            if readable:
                try:
                    data = sock.recv(1 << 18)
                except (BlockingIOError, ssl.SSLWantReadError):
                    data = None
                if data is not None:
                    if not data:
                        raise ConnectionError("the broker closed the connection")
                    last_rx = now
                    if self._handle(sock, reader.feed(data), time.time_ns()):
                        last_tx = now
            if now - last_tick >= 0.1:
                tick()
                last_tick = now
            if now - last_tx >= keepalive / 2:
                self._send(sock, PINGREQ_PACKET)
                last_tx = now
            if now - last_rx > keepalive * 1.5:
                raise TimeoutError(f"nothing from the broker for {now - last_rx:.0f} s")

    def _handle(self, sock: socket.socket, packets: list[Any], t_ns: int) -> bool:
        """Record a batch, then acknowledge its QoS 1 messages in one write; True if anything was sent."""
        on_publish = self.on_publish
        acks = []
        for p in packets:
            if type(p) is Publish:
                on_publish(p, t_ns)
                if p.qos:
                    acks.append(encode_puback(p.packet_id))
            else:
                self._control(p)
        if acks:
            self._send(sock, b"".join(acks))
            return True
        return False

    def _control(self, p: Any) -> None:
        if isinstance(p, SubAck):
            refused = [f for f, rc in zip(self.filters, p.reasons, strict=False) if rc >= 0x80]
            if refused:
                self.last_error = f"broker refused the subscription to {refused}"
                log.error(self.last_error)
            self.subscribed.set()
            log.info("subscribed", extra={"filters": self.filters, "granted": p.reasons})
        elif isinstance(p, Disconnect):
            raise ConnectionError(f"the broker disconnected us: reason 0x{p.reason:02x} "
                                  f"{p.props.get('reason_string', '')}".rstrip())

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> None:
        """Non-blocking socket: write it all, waiting for room (acks are small; this rarely loops)."""
        view = memoryview(data)
        while view:
            try:
                n = sock.send(view)
                view = view[n:]
            except (BlockingIOError, ssl.SSLWantWriteError):
                select.select([], [sock], [], 1.0)
