"""Read recordings back: `robobus replay`, `robobus inspect`, `robobus recover`.

Replay republishes with the original timing (log times, scaled by `rate`), optionally under another
topic root so that a replay never collides with live devices. Commands and inbound streams (what a
node *receives*: channel metadata `robobus.node_receives`) are skipped unless asked for, since
replaying a command moves hardware. MQTT 5 properties come back from the `_robobus/mqtt_properties`
side channel; Response Topics under the recorded root are moved to the new root too. Channels the
recorder derived (the camera as foxglove.CompressedImage beside its raw bytes: `robobus.derived`) are
not bus traffic and are never republished; the raw channel of the same topic is.

Timing: each message has a due time t0 + (log_time - first) / rate on the monotonic clock (absolute, so
a late message does not shift the ones after it); the publishing thread sleeps until then and writes
the PUBLISH to the socket itself (shared.mqtt.lean), with the next messages already decoded by a
read-ahead thread that filled its queue before the clock started.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import paho.mqtt.client as mqtt
from mcap.exceptions import McapError
from mcap.reader import make_reader
from mcap.records import Attachment, Channel, Message, Metadata, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import CompressionType, IndexType, Writer

from shared.mqtt.lean import LeanPublisher
from shared.mqtt.session import MqttSession, reply_properties, unique_client_id
from shared.mqtt.wire import MqttProtocolError
from shared.settings import KitSettings
from shared.tools.bus_catalog import (
    META_CONTENT_TYPE,
    META_DERIVED,
    META_KIND,
    META_QOS,
    META_RECEIVES,
    META_RETAIN,
)
from shared.tools.recorder import PROPS_TOPIC, RECORDING_META

log = logging.getLogger("robobus.replay")

READ_AHEAD = 50_000  # messages decoded ahead of the publishing thread (and before the clock starts)


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
    realtime: bool = False  # SCHED_FIFO for the publishing thread, where the host allows it


@dataclass
class ReplayStats:
    published: int = 0
    skipped_commands: int = 0
    skipped_outside_root: int = 0
    skipped_derived: int = 0  # messages of derived channels (foxglove.CompressedImage): never bus traffic
    loops: int = 0
    late_ns: list[int] = field(default_factory=list)  # publish time minus due time, per message


@dataclass
class _Plan:
    topic: str
    qos: int
    retain: bool
    content_type: str | None = None  # a binary channel's MQTT Content Type, sent with each message


class Replayer:
    """Republish one recording. `publish(topic, payload, qos, retain, properties)` is the sink
    (an MQTT session by default; tests and the benchmark pass their own)."""

    def __init__(self, path: Path, opts: ReplayOptions,
                 publish: Callable[[str, bytes, int, bool, dict[str, Any] | None], None]) -> None:
        if opts.rate < 0:
            raise ValueError("rate must be >= 0")
        self.realtime_note = ""
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
            if md.get(META_DERIVED) == "true":
                self.stats.skipped_derived += summary.statistics.channel_message_counts.get(ch.id, 0) \
                    if summary.statistics else 0
                continue
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

    def _properties(self, reader: Any, old_root: str) -> dict[tuple[int, int], dict[str, Any]]:
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for _schema, _ch, msg in reader.iter_messages(topics=[PROPS_TOPIC], log_time_order=False):
            try:
                rec = json.loads(msg.data)
                props: dict[str, Any] = {}
                if rec.get("response_topic"):
                    props["response_topic"] = self._move(rec["response_topic"], old_root) or rec["response_topic"]
                if "correlation_data" in rec:
                    props["correlation_data"] = bytes.fromhex(rec["correlation_data"])
                if rec.get("user_properties"):
                    props["user_property"] = [(str(k), str(v)) for k, v in rec["user_properties"]]
                if "message_expiry" in rec:
                    props["message_expiry"] = int(rec["message_expiry"])
                if "payload_format" in rec:
                    props["payload_format"] = int(rec["payload_format"])
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
            props = self._properties(reader, old_root)
            for cid in plans:
                ctype = summary.channels[cid].metadata.get(META_CONTENT_TYPE)
                if ctype and not ctype.startswith("application/json"):
                    plans[cid].content_type = ctype
            topics = sorted({summary.channels[cid].topic for cid in plans})
            # the GIL is handed over every 5 ms by default: the read-ahead thread decoding a chunk would
            # hold the publishing thread back that long; 0.2 ms keeps a due message on time
            previous = sys.getswitchinterval()
            sys.setswitchinterval(0.0002)
            try:
                while not stop.is_set():
                    self._once(f, plans, topics, props, stop)
                    self.stats.loops += 1
                    if not self.opts.loop:
                        break
            finally:
                sys.setswitchinterval(previous)
        return self.stats

    def _once(self, f: IO[bytes], plans: dict[int, _Plan], topics: list[str],
              props: dict[tuple[int, int], dict[str, Any]], stop: threading.Event) -> None:
        """One pass. A read-ahead thread decodes chunks into a bounded queue, so that decompressing
        and parsing the next chunk never happens between two due messages on the publishing thread."""
        items: queue.Queue[tuple[int, _Plan, bytes, dict[str, Any] | None] | None] = queue.Queue(maxsize=READ_AHEAD)
        done = threading.Event()
        f.seek(0)
        reader = make_reader(f)

        def read_ahead() -> None:
            try:
                for _schema, ch, msg in reader.iter_messages(topics=topics, log_time_order=True):
                    plan = plans.get(ch.id)
                    if plan is None:
                        continue
                    p = props.get((ch.id, msg.sequence))
                    if plan.content_type:
                        p = {**(p or {}), "content_type": plan.content_type}
                    while not stop.is_set():
                        try:
                            items.put((msg.log_time, plan, msg.data, p), timeout=0.2)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            finally:
                done.set()
                items.put(None)

        th = threading.Thread(target=read_ahead, name="replay-read", daemon=True)
        th.start()
        # fill the read-ahead before the clock starts: the first chunks decode while nothing is due
        while not (done.is_set() or items.full() or stop.is_set()):
            time.sleep(0.005)
        policy = os.sched_getscheduler(0), os.sched_getparam(0)
        spin_ns = 0
        if self.opts.realtime:
            self.realtime_note = _realtime_thread()  # this thread only: the read-ahead stays SCHED_OTHER
            if self.realtime_note.startswith("SCHED_FIFO"):
                spin_ns = SPIN_NS
        slack = _set_timer_slack(1)
        try:
            self._publish_loop(items, stop, spin_ns)
        finally:
            if self.opts.realtime:
                with contextlib.suppress(OSError):
                    os.sched_setscheduler(0, *policy)
            if slack:
                _set_timer_slack(slack)
            th.join(5)

    def _publish_loop(self, items: queue.Queue[tuple[int, _Plan, bytes, dict[str, Any] | None] | None],
                      stop: threading.Event, spin_ns: int = 0) -> None:
        rate = self.opts.rate
        first: int | None = None
        t0 = 0
        late = self.stats.late_ns
        publish = self.publish
        while True:
            item = items.get()
            if item is None:
                break
            log_time, plan, data, p = item
            if first is None:
                first = log_time
                t0 = time.monotonic_ns()
            if rate:
                due = t0 + int((log_time - first) / rate)
                _wait_until(due, stop, spin_ns)
                if stop.is_set():
                    break
            publish(plan.topic, data, plan.qos, plan.retain, p)
            if rate:
                late.append(time.monotonic_ns() - due)
            self.stats.published += 1


def _realtime_thread(priority: int = 10) -> str:
    """SCHED_FIFO for the calling thread (Linux applies pid 0 to the calling thread): a due message then
    preempts ordinary work instead of waiting its turn. Needs root or CAP_SYS_NICE; a refusal is only
    reported, the replay goes on at normal priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        return f"SCHED_FIFO {priority}"
    except (OSError, AttributeError) as exc:
        log.warning("realtime scheduling refused, replaying at normal priority: %s", exc)
        return f"normal priority (SCHED_FIFO refused: {exc})"


SPIN_NS = 200_000  # with SCHED_FIFO, the last stretch before a due time is spun, not slept


def _set_timer_slack(ns: int) -> int:
    """PR_SET_TIMERSLACK for the calling thread; returns the previous slack (0 where unavailable). A normal
    thread's sleeps end up to 50 us late by default (the kernel groups timer expiries); 1 ns makes
    time.sleep end when asked. Realtime threads have no slack anyway."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = int(libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0))
        if previous < 0 or libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
            return 0
        return previous
    except (OSError, AttributeError):
        return 0


PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30


def _wait_until(due_ns: int, stop: threading.Event, spin_ns: int = 0) -> None:
    """Sleep until the due time (looking at `stop` at least every 0.2 s), the last `spin_ns` spun.
    At normal priority sleeping, not spinning: on a loaded machine the scheduler favours a task that slept
    when it wakes, while a spinning one uses up its share and gets preempted (with a spin, the null-sink
    lateness median here was 0.5-0.8 ms; sleeping, 0.1-0.2 ms). With SCHED_FIFO (--realtime) nothing
    ordinary preempts the spin, and it removes the wake-up latency from the last 0.2 ms."""
    while not stop.is_set():
        left = due_ns - time.monotonic_ns()
        if left <= spin_ns:
            break
        time.sleep(min(left - spin_ns, 200_000_000) / 1e9)
    while not stop.is_set() and time.monotonic_ns() < due_ns:
        pass


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, qos: int, retain: bool, props: dict[str, Any] | None) -> None: ...

    def drain(self, timeout: float = 10.0) -> bool: ...

    def close(self) -> None: ...


class PahoPublisher:
    """For TLS brokers: an SSL socket must not be written and read from two threads at once, so the
    replay publishes through the kit's paho session there (a hand-off to paho's network thread).

    `drain` waits for paho's on_publish of every message it accepted (QoS 0: written; QoS 1: acknowledged);
    a message paho refused (its queue full, QoS 0 while disconnected) is counted in `dropped`."""

    def __init__(self, settings: KitSettings, client_id: str) -> None:
        self.session = MqttSession(settings, client_id)
        self.dropped = 0
        self._done = threading.Condition()
        self._pending: set[int] = set()  # message ids accepted by paho, their on_publish not seen yet
        self._early: set[int] = set()  # on_publish seen before publish() returned the id (network thread first)
        self.session.client.on_publish = self._on_publish
        self.session.start()
        if not self.session.wait_connected(10):
            self.session.stop()
            b = self.session.broker
            raise ConnectionError(f"cannot use the MQTT broker at {b.host}:{b.port} "
                                  f"({self.session.last_error or 'no answer'})")

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool, props: dict[str, Any] | None) -> None:
        pp = None
        if props:
            pp = reply_properties(props.get("response_topic"), props.get("correlation_data"),
                                  props.get("content_type"))
            for kv in props.get("user_property", []):
                pp.UserProperty = tuple(kv)
            if "message_expiry" in props:
                pp.MessageExpiryInterval = props["message_expiry"]
            if "payload_format" in props:
                pp.PayloadFormatIndicator = props["payload_format"]
        info = self.session.client.publish(topic, payload, qos=qos, retain=retain, properties=pp)
        # QoS 1 queued while disconnected (NO_CONN) is kept by paho and sent after the reconnect
        accepted = info.rc == mqtt.MQTT_ERR_SUCCESS or (qos > 0 and info.rc == mqtt.MQTT_ERR_NO_CONN)
        with self._done:
            if not accepted:
                self.dropped += 1
            elif info.mid in self._early:
                self._early.discard(info.mid)
            else:
                self._pending.add(info.mid)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        with self._done:
            if mid in self._pending:
                self._pending.discard(mid)
                if not self._pending:
                    self._done.notify_all()
            else:
                self._early.add(mid)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until paho has written every accepted QoS 0 message and the broker acknowledged every QoS 1."""
        deadline = time.monotonic() + timeout
        with self._done:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
            return True

    def close(self) -> None:
        self.session.stop()


def connect_publisher(settings: KitSettings) -> Publisher:
    """The lean publisher on plain TCP (publishes leave on the replay thread: exact timing); paho on TLS."""
    client_id = unique_client_id("robobus-replay")
    if settings.broker().tls:
        return PahoPublisher(settings, client_id)
    try:
        return LeanPublisher(settings, client_id)
    except (OSError, MqttProtocolError) as exc:
        b = settings.broker()
        raise ConnectionError(f"cannot use the MQTT broker at {b.host}:{b.port} ({exc})") from None


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
    derived: bool  # made by the recorder from another channel of the topic (not bus traffic, not replayed)
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
    for ch in sorted(summary.channels.values(), key=lambda c: (c.topic, c.id)):
        count = stats.channel_message_counts.get(ch.id, 0) if stats else 0
        schema = summary.schemas.get(ch.schema_id)
        chans.append(ChannelSummary(
            id=ch.id, topic=ch.topic, count=count, rate_hz=count / duration if duration > 0 else 0.0,
            encoding=ch.message_encoding, schema=f"{schema.name} ({schema.encoding})" if schema else "-",
            kind=ch.metadata.get(META_KIND, ""), retain=ch.metadata.get(META_RETAIN) == "true",
            node_receives=ch.metadata.get(META_RECEIVES) == "true",
            derived=ch.metadata.get(META_DERIVED) == "true", metadata=dict(ch.metadata)))
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
        w.finish()  # type: ignore[no-untyped-call]
    shutil.move(tmp, dst)
    return RecoverResult(messages=messages, channels=len(channel_ids), error=error)
