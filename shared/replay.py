"""Read recordings back: `robobus replay`, `robobus inspect`, `robobus recover`.

Replay republishes with the original timing (log times, scaled by `rate`), optionally under another
topic root so that a replay never collides with live devices. Commands and inbound streams (what a
node *receives*: channel metadata `robobus.node_receives`) are skipped unless asked for, since
replaying a command moves hardware. MQTT 5 properties come back from the `_robobus/mqtt_properties`
side channel; Response Topics under the recorded root are moved to the new root too.

Timing: each message has a due time t0 + (log_time - first) / rate on the monotonic clock; the replayer
sleeps until ~1 ms before it and yields the CPU in a short spin for the rest, so a busy machine's
timer slack does not become replay jitter.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import paho.mqtt.client as mqtt
from mcap.exceptions import McapError
from mcap.reader import make_reader
from mcap.records import Attachment, Channel, Message, Metadata, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import CompressionType, IndexType, Writer

from shared.bus_catalog import META_CONTENT_TYPE, META_KIND, META_QOS, META_RECEIVES, META_RETAIN
from shared.mqtt import MqttSession, reply_properties, unique_client_id
from shared.recorder import PROPS_TOPIC, RECORDING_META
from shared.settings import KitSettings

log = logging.getLogger("robobus.replay")

SPIN_S = 0.001  # the last stretch before a due time is spent yielding instead of sleeping


class RecordingError(Exception):
    """A file that is not a readable recording (with what to do about it)."""


def _open_reader(f: IO[bytes]) -> Any:
    try:
        reader = make_reader(f)
        summary = reader.get_summary()
    except (McapError, ValueError, EOFError, OSError) as exc:
        raise RecordingError(f"not a complete MCAP file ({exc}); a recorder that was killed leaves such a "
                             "file: `robobus recover FILE -o FIXED.mcap` repairs it") from None
    if summary is None:
        raise RecordingError("the MCAP file has no summary; run `robobus recover` on it")
    return reader


def recording_metadata(reader: Any) -> dict[str, str]:
    for m in reader.iter_metadata():
        if m.name == RECORDING_META:
            return dict(m.metadata)
    return {}


# -- replay ---------------------------------------------------------------------------------------
@dataclass
class ReplayOptions:
    rate: float = 1.0  # 0 = as fast as possible
    topics: Sequence[str] = ()  # MQTT filters on the recorded topics; empty = all
    loop: bool = False
    root: str | None = None  # republish under this root instead of the recorded one
    from_root: str | None = None  # the recorded root (default: the file's metadata)
    include_commands: bool = False
    retain: bool = True  # republish retained what was published retained


@dataclass
class ReplayStats:
    published: int = 0
    skipped_commands: int = 0
    skipped_outside_root: int = 0
    loops: int = 0
    late_ns: list[int] = field(default_factory=list)  # publish time minus due time, per message


@dataclass
class _Plan:
    topic: str
    qos: int
    retain: bool


class Replayer:
    """Republish one recording. `publish(topic, payload, qos, retain, properties)` is the sink
    (an MQTT session by default; tests and the benchmark pass their own)."""

    def __init__(self, path: Path, opts: ReplayOptions,
                 publish: Callable[[str, bytes, int, bool, Any], None]) -> None:
        if opts.rate < 0:
            raise ValueError("rate must be >= 0")
        self.path = path
        self.opts = opts
        self.publish = publish
        self.stats = ReplayStats()

    def _plan(self, reader: Any) -> tuple[dict[int, _Plan], str]:
        summary = reader.get_summary()
        meta = recording_metadata(reader)
        old_root = self.opts.from_root or meta.get("root", "")
        plans: dict[int, _Plan] = {}
        for ch in summary.channels.values():
            if ch.topic == PROPS_TOPIC:
                continue
            md = ch.metadata
            if self.opts.topics and not any(mqtt.topic_matches_sub(f, ch.topic) for f in self.opts.topics):
                continue
            if md.get(META_RECEIVES) == "true" and not self.opts.include_commands:
                self.stats.skipped_commands += summary.statistics.channel_message_counts.get(ch.id, 0) \
                    if summary.statistics else 0
                continue
            topic = self._move(ch.topic, old_root)
            if topic is None:
                self.stats.skipped_outside_root += summary.statistics.channel_message_counts.get(ch.id, 0) \
                    if summary.statistics else 0
                continue
            plans[ch.id] = _Plan(topic, int(md.get(META_QOS, "1")),
                                 self.opts.retain and md.get(META_RETAIN) == "true")
        return plans, old_root

    def _move(self, topic: str, old_root: str) -> str | None:
        new = self.opts.root
        if not new or new == old_root:
            return topic
        if old_root and topic.startswith(old_root + "/"):
            return new + topic[len(old_root):]
        return None  # outside the recorded root: publishing it unchanged could reach live devices

    def _properties(self, reader: Any, old_root: str) -> dict[tuple[int, int], Any]:
        out: dict[tuple[int, int], Any] = {}
        for _schema, _ch, msg in reader.iter_messages(topics=[PROPS_TOPIC], log_time_order=False):
            try:
                rec = json.loads(msg.data)
                rt = rec.get("response_topic")
                if rt:
                    rt = self._move(rt, old_root) or rt
                corr = bytes.fromhex(rec["correlation_data"]) if "correlation_data" in rec else None
                props = reply_properties(rt, corr)
                for k, v in rec.get("user_properties", []):
                    props.UserProperty = (k, v)
                if "message_expiry" in rec:
                    props.MessageExpiryInterval = int(rec["message_expiry"])
                if "payload_format" in rec:
                    props.PayloadFormatIndicator = int(rec["payload_format"])
                out[(int(rec["channel"]), int(rec["sequence"]))] = props
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("unreadable MQTT properties record skipped: %s", exc)
        return out

    def run(self, stop: threading.Event | None = None) -> ReplayStats:
        stop = stop or threading.Event()
        with open(self.path, "rb") as f:
            reader = _open_reader(f)
            plans, old_root = self._plan(reader)
            if not plans:
                return self.stats
            summary = reader.get_summary()
            ctypes = {cid: summary.channels[cid].metadata.get(META_CONTENT_TYPE) for cid in plans}
            props = self._properties(reader, old_root)
            topics = sorted({summary.channels[cid].topic for cid in plans})
            while not stop.is_set():
                self._once(reader, plans, topics, props, ctypes, stop)
                self.stats.loops += 1
                if not self.opts.loop:
                    break
        return self.stats

    def _once(self, reader: Any, plans: dict[int, _Plan], topics: list[str], props: dict[tuple[int, int], Any],
              ctypes: dict[int, str | None], stop: threading.Event) -> None:
        rate = self.opts.rate
        first: int | None = None
        t0 = 0
        late = self.stats.late_ns
        for _schema, ch, msg in reader.iter_messages(topics=topics, log_time_order=True):
            plan = plans.get(ch.id)
            if plan is None:
                continue
            if first is None:
                first = msg.log_time
                t0 = time.monotonic_ns()
            if rate:
                due = t0 + int((msg.log_time - first) / rate)
                _wait_until(due, stop)
                if stop.is_set():
                    return
            p = props.get((ch.id, msg.sequence))
            ctype = ctypes.get(ch.id)
            if ctype and ctype != "application/json":
                if p is None:
                    p = reply_properties()
                p.ContentType = ctype
            self.publish(plan.topic, msg.data, plan.qos, plan.retain, p)
            if rate:
                late.append(time.monotonic_ns() - due)
            self.stats.published += 1


def _wait_until(due_ns: int, stop: threading.Event) -> None:
    while True:
        left = (due_ns - time.monotonic_ns()) / 1e9
        if left <= 0:
            return
        if left > SPIN_S:
            # wake a bit early (timer slack, scheduler), and look at `stop` at least every 0.2 s
            if stop.wait(min(left - SPIN_S, 0.2)):
                return
        else:
            time.sleep(0)


def mqtt_publisher(settings: KitSettings) -> tuple[MqttSession, Callable[[str, bytes, int, bool, Any], None]]:
    session = MqttSession(settings, unique_client_id("robobus-replay"))
    session.start()
    if not session.wait_connected(10):
        session.stop()
        b = session.broker
        raise ConnectionError(f"cannot use the MQTT broker at {b.host}:{b.port} "
                              f"({session.last_error or 'no answer'})")

    def publish(topic: str, payload: bytes, qos: int, retain: bool, props: Any) -> None:
        session.publish(topic, payload, qos=qos, retain=retain, properties=props)

    return session, publish


def drain(session: MqttSession, timeout: float = 10.0) -> bool:
    """Wait until the broker has acknowledged every QoS 1 publish (paho's outgoing queue is empty)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not session.client._out_messages:  # noqa: SLF001 - paho has no public "all sent" query
            return True
        time.sleep(0.01)
    return False


# -- inspect --------------------------------------------------------------------------------------
@dataclass
class ChannelSummary:
    id: int
    topic: str
    count: int
    rate_hz: float
    encoding: str
    schema: str
    kind: str
    retain: bool
    node_receives: bool
    metadata: dict[str, str]


@dataclass
class FileSummary:
    path: str
    size: int
    messages: int
    start_ns: int
    end_ns: int
    duration_s: float
    chunks: int
    compression: str
    channels: list[ChannelSummary]
    metadata: dict[str, str]
    attachments: list[str]
    library: str


def inspect(path: Path) -> FileSummary:
    with open(path, "rb") as f:
        reader = _open_reader(f)
        summary = reader.get_summary()
        header = reader.get_header()
        meta = recording_metadata(reader)
        attachments = [a.name for a in summary.attachment_indexes]
    stats = summary.statistics
    start, end = (stats.message_start_time, stats.message_end_time) if stats else (0, 0)
    duration = max((end - start) / 1e9, 0.0)
    compressions = sorted({c.compression or "none" for c in summary.chunk_indexes})
    chans = []
    for ch in sorted(summary.channels.values(), key=lambda c: c.topic):
        count = stats.channel_message_counts.get(ch.id, 0) if stats else 0
        schema = summary.schemas.get(ch.schema_id)
        chans.append(ChannelSummary(
            id=ch.id, topic=ch.topic, count=count, rate_hz=count / duration if duration > 0 else 0.0,
            encoding=ch.message_encoding, schema=f"{schema.name} ({schema.encoding})" if schema else "-",
            kind=ch.metadata.get(META_KIND, ""), retain=ch.metadata.get(META_RETAIN) == "true",
            node_receives=ch.metadata.get(META_RECEIVES) == "true", metadata=dict(ch.metadata)))
    return FileSummary(path=str(path), size=path.stat().st_size, messages=stats.message_count if stats else 0,
                       start_ns=start, end_ns=end, duration_s=duration, chunks=len(summary.chunk_indexes),
                       compression=",".join(compressions) or "-", channels=chans, metadata=meta,
                       attachments=attachments, library=header.library)


# -- recover --------------------------------------------------------------------------------------
@dataclass
class RecoverResult:
    messages: int
    channels: int
    error: str  # why reading stopped ("" when the file was complete)


def iter_records_until_damage(f: IO[bytes]) -> Iterator[Any]:
    """Every record of an MCAP stream up to the first damaged or missing byte."""
    reader = StreamReader(f, skip_magic=False, validate_crcs=True)
    yield from reader.records


def recover(src: Path, dst: Path, compression: str = "zstd") -> RecoverResult:
    """Copy every readable record of `src` (a file a killed recorder left: no summary, maybe a torn
    last chunk) into a complete, indexed `dst`. Like `mcap recover` of the official CLI."""
    if src.resolve() == dst.resolve():
        raise ValueError("write the recovered file to another path")
    comp = {"zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4, "none": CompressionType.NONE}[compression]
    messages = 0
    error = ""
    schema_ids: dict[int, int] = {}
    channel_ids: dict[int, int] = {}
    tmp = dst.with_name(dst.name + ".partial")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        w = Writer(fout, compression=comp, index_types=IndexType.ALL)
        w.start(profile="", library="robobus-recover")
        try:
            for rec in iter_records_until_damage(fin):
                if isinstance(rec, Schema) and rec.id not in schema_ids:
                    schema_ids[rec.id] = w.register_schema(rec.name, rec.encoding, rec.data)
                elif isinstance(rec, Channel) and rec.id not in channel_ids:
                    channel_ids[rec.id] = w.register_channel(rec.topic, rec.message_encoding,
                                                             schema_ids.get(rec.schema_id, 0), dict(rec.metadata))
                elif isinstance(rec, Message) and rec.channel_id in channel_ids:
                    w.add_message(channel_ids[rec.channel_id], rec.log_time, rec.data, rec.publish_time, rec.sequence)
                    messages += 1
                elif isinstance(rec, Metadata):
                    w.add_metadata(rec.name, dict(rec.metadata))
                elif isinstance(rec, Attachment):
                    w.add_attachment(rec.create_time, rec.log_time, rec.name, rec.media_type, rec.data)
        except Exception as exc:  # the damage: a torn record, a bad CRC, the end of a truncated file
            error = f"{type(exc).__name__}: {exc}".rstrip(": ") or type(exc).__name__
        w.finish()
    shutil.move(tmp, dst)
    return RecoverResult(messages=messages, channels=len(channel_ids), error=error)
