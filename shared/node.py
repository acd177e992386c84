"""A robobus node: one process, one transport, many devices, one MQTT session.

The node owns the bus side (EdgeX style: the SDK owns the bus, the driver owns the device):
status birth and will, per-device health with heartbeat, rate-capped state, events, command
dispatch with validated requests and replies, jobs, and a clean, fail-safe shutdown.

Threads: paho's network thread only routes messages; command handlers run on a pool, jobs on
their own threads, coroutine handlers on the service's asyncio loop; one housekeeping thread
flushes rate-capped state and sends heartbeats.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
from pydantic import BaseModel, ValidationError

from shared.contract import (
    CANCEL,
    JOB_PROGRESS,
    JOB_RESULT,
    BinarySpec,
    CommandSpec,
    EventSpec,
    JobSpec,
    ServiceAPI,
    StateSpec,
    StreamSpec,
    check_name,
)
from shared.errors import CommandError, ErrorCode
from shared.messages import (
    CancelReply,
    CancelRequest,
    ErrorInfo,
    Health,
    JobAccepted,
    JobProgress,
    JobResult,
    NodeStats,
    Status,
)
from shared.mqtt import MqttSession, Will, reply_properties, unique_client_id
from shared.settings import KitSettings, hostname

log = logging.getLogger("robobus.node")

M = TypeVar("M", bound=BaseModel)
NODE_DEVICE = "_node"  # reserved device name for the node's own state (kit statistics)
HEALTH_FIELDS = ("connection", "operational", "state", "error", "error_message", "details")

Handler = Callable[..., Any]


def now() -> float:
    return time.time()


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{loc}: {err['msg']}")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def dump(spec_model: type[BaseModel], value: BaseModel | dict[str, Any]) -> bytes:
    """Validate (dicts) and serialise. A model instance of the right class is already valid."""
    if isinstance(value, spec_model):
        return value.model_dump_json().encode()
    if isinstance(value, dict):
        return spec_model.model_validate(value).model_dump_json().encode()
    if isinstance(value, BaseModel):
        return spec_model.model_validate(value.model_dump()).model_dump_json().encode()
    raise TypeError(f"expected {spec_model.__name__} or dict, got {type(value).__name__}")


class JobCancelled(Exception):
    """Raised by `JobContext.check_cancelled()`; the kit turns it into a cancelled result."""


RATE_CAP_SLACK = 0.1  # a value this fraction of the interval early is sent at once, counted at its due time


@dataclass
class _Slot:
    """Rate cap for one state topic: send now if the slot is free, else keep only the newest."""

    topic: str
    interval: float
    retain: bool
    qos: int
    encode: Callable[[Any], bytes]
    content_type: str | None = None
    last_sent: float = 0.0
    pending: Any = None
    has_pending: bool = False
    last_payload: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class JobContext:
    """Handed to a job function: report progress, check for cancellation."""

    def __init__(self, device: Device, job_id: str, command: str, progress_hz: float = 10.0) -> None:
        self.device = device
        self.job_id = job_id
        self.command = command
        self.started = time.monotonic()
        self._cancel = threading.Event()
        self._progress_interval = 1.0 / progress_hz
        self._last_progress = 0.0
        self._last_phase = ""

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled(f"job {self.job_id} cancelled")

    def wait(self, seconds: float) -> bool:
        """Sleep that a cancel interrupts; True if cancelled."""
        return self._cancel.wait(seconds)

    def progress(self, phase: str, done: float = 0.0, total: float = 0.0, *, force: bool = False,
                 **info: Any) -> None:
        """Publish progress; rate-capped, but a new phase or `force` always goes out."""
        t = time.monotonic()
        if not force and phase == self._last_phase and t - self._last_progress < self._progress_interval:
            return
        self._last_phase = phase
        self._last_progress = t
        self.device.emit(JOB_PROGRESS, JobProgress(job_id=self.job_id, command=self.command, phase=phase,
                                                   done=done, total=total, info=info, ts=now()))


class Device:
    """One piece of hardware served by the node: its health, state, events and handlers."""

    def __init__(self, node: Node, name: str) -> None:
        self.node = node
        self.name = check_name("device", name)
        self.base = f"{node.base}/{name}"
        self._health: dict[str, Any] = {
            "connection": False, "operational": False, "state": "starting",
            "error": False, "error_message": "", "details": {},
        }
        self._health_lock = threading.Lock()
        self._commands: dict[str, tuple[CommandSpec, Handler]] = {}
        self._inline: set[str] = set()
        self._jobs: dict[str, tuple[JobSpec, Handler, Handler | None]] = {}
        self._running: dict[str, JobContext] = {}
        self._slots: dict[str, _Slot] = {}

    # -- health --------------------------------------------------------------------------------
    @property
    def health(self) -> dict[str, Any]:
        with self._health_lock:
            return dict(self._health)

    def set_health(self, **fields: Any) -> None:
        """Update health fields; publishes at once when anything changed (heartbeat otherwise)."""
        unknown = set(fields) - set(HEALTH_FIELDS)
        if unknown:
            raise TypeError(f"unknown health fields {sorted(unknown)}")
        with self._health_lock:
            changed = any(self._health.get(k) != v for k, v in fields.items())
            self._health.update(fields)
        if changed:
            self.publish_health()

    def health_message(self) -> Health:
        with self._health_lock:
            h = dict(self._health)
        return Health(service=self.node.api.service, node=self.node.name, device=self.name,
                      version=self.node.version, ts=now(), **h)

    def publish_health(self) -> None:
        self.node.session.publish(f"{self.base}/health", self.health_message().model_dump_json(),
                                  qos=1, retain=True)

    # -- state, events, streams ------------------------------------------------------------------
    def _slot(self, spec: StateSpec | BinarySpec) -> _Slot:
        slot = self._slots.get(spec.name)
        if slot is None:
            if self.node.api.states.get(spec.name) is not spec:
                raise KeyError(f"state {spec.name!r} is not declared on {self.node.api.service}'s API")
            rate = self.node.settings.state_rates.get(spec.name, spec.rate_hz)
            if isinstance(spec, BinarySpec):
                enc: Callable[[Any], bytes] = bytes
                ctype: str | None = spec.content_type
            else:
                model = spec.model

                def enc(v: Any, _m: type[BaseModel] = model) -> bytes:
                    return dump(_m, v)
                ctype = "application/json"
            slot = _Slot(topic=f"{self.base}/state/{spec.name}", interval=(1.0 / rate) if rate else 0.0,
                         retain=spec.retain, qos=spec.qos, encode=enc, content_type=ctype)
            self._slots[spec.name] = slot
        return slot

    def publish(self, spec: StateSpec | BinarySpec, value: BaseModel | dict[str, Any] | bytes) -> None:
        """Publish state under its rate cap: too soon, and only the newest value is kept for later.
        Serialisation happens only for values that are actually sent."""
        slot = self._slot(spec)
        t = time.monotonic()
        with slot.lock:
            due = slot.last_sent + slot.interval
            if t >= due - slot.interval * RATE_CAP_SLACK:
                # on time, or early by no more than scheduling jitter: send now rather than hand it to the
                # flusher thread (a second GIL hop for every message of a publisher on a fixed schedule);
                # an early one counts at its due time, so the long-run rate never exceeds the cap
                slot.last_sent = t if t >= due else due
                slot.has_pending = False
                slot.pending = None
                send = True
            else:
                slot.pending = value
                slot.has_pending = True
                send = False
        if send:
            self.node._send_slot(slot, value)
        else:
            self.node._schedule(slot, slot.last_sent + slot.interval)

    def emit(self, spec: EventSpec, value: BaseModel | dict[str, Any]) -> None:
        if self.node.api.events.get(spec.name) is not spec and spec not in (JOB_PROGRESS, JOB_RESULT):
            raise KeyError(f"event {spec.name!r} is not declared on {self.node.api.service}'s API")
        self.node._publish(f"{self.base}/event/{spec.name}", dump(spec.model, value), qos=spec.qos)

    def stream_publish(self, spec: StreamSpec, value: BaseModel | dict[str, Any]) -> None:
        self.node._publish(f"{self.base}/stream/{spec.name}", dump(spec.model, value), qos=spec.qos)

    def on_stream(self, spec: StreamSpec, handler: Callable[[Any], None]) -> None:
        """Subscribe to an inbound stream; handler gets validated models on the network thread,
        so it must be quick (queue the work). Bad payloads are counted and dropped."""
        model = spec.model

        def _recv(msg: mqtt.MQTTMessage) -> None:
            try:
                value = model.model_validate_json(msg.payload)
            except ValidationError as exc:
                self.node.count_decode_error(f"stream {spec.name}: {describe_validation_error(exc)}")
                return
            handler(value)

        self.node.session.subscribe(f"{self.base}/stream/{spec.name}", _recv, qos=spec.qos)

    # -- commands and jobs -----------------------------------------------------------------------
    def bind(self, spec: CommandSpec, handler: Handler, *, inline: bool = False) -> None:
        """handler(request_model) -> reply model or dict; may be `async def` (runs on node.loop).

        `inline=True` runs a synchronous handler on the MQTT network thread, skipping the hand-over to
        the command pool: for handlers that only validate and enqueue (a demand for a realtime cycle),
        where the hop's latency matters. Such a handler must never block or do slow work: while it runs,
        no message is received. Validation and the reply are the same either way."""
        if self.node.api.commands.get(spec.name) is not spec:
            raise KeyError(f"command {spec.name!r} is not declared on {self.node.api.service}'s API")
        if inline and inspect.iscoroutinefunction(handler):
            raise ValueError(f"command {spec.name!r}: an inline handler must be synchronous")
        self._commands[spec.name] = (spec, handler)
        if inline:
            self._inline.add(spec.name)
        else:
            self._inline.discard(spec.name)

    def bind_job(self, spec: JobSpec, run: Handler, admit: Handler | None = None) -> None:
        """run(request, job: JobContext) -> result, on its own thread. `admit(request)` runs first,
        synchronously: raise CommandError there (e.g. `busy`) to refuse before a job id exists."""
        if self.node.api.jobs.get(spec.name) is not spec:
            raise KeyError(f"job {spec.name!r} is not declared on {self.node.api.service}'s API")
        self._jobs[spec.name] = (spec, run, admit)
        if CANCEL.name not in self._commands:
            self._commands[CANCEL.name] = (CANCEL, self._cancel)

    def running_jobs(self) -> list[str]:
        return list(self._running)

    def _cancel(self, req: CancelRequest) -> CancelReply:
        if req.job_id is not None:
            job = self._running.get(req.job_id)
            if job is None:
                raise CommandError(ErrorCode.NOT_FOUND, f"no running job {req.job_id!r} on {self.name}")
            job.cancel()
            return CancelReply(cancelled=[req.job_id])
        ids = list(self._running)
        for jid in ids:
            self._running[jid].cancel()
        return CancelReply(cancelled=ids)

    def _start_job(self, spec: JobSpec, run: Handler, req: BaseModel) -> JobAccepted:
        job_id = uuid.uuid4().hex[:12]
        ctx = JobContext(self, job_id, spec.name)
        self._running[job_id] = ctx

        def body() -> None:
            t0 = time.monotonic()
            try:
                result = run(req, ctx)
                if inspect.iscoroutine(result):
                    result = self.node._run_coro(result, None)
                ctx.check_cancelled()
                payload = json.loads(dump(spec.result, result))
                res = JobResult(job_id=job_id, command=spec.name, ok=True, result=payload,
                                duration_s=time.monotonic() - t0, ts=now())
            except JobCancelled:
                res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=True,
                                error=ErrorInfo(code=ErrorCode.BUSY, message="cancelled by request"),
                                duration_s=time.monotonic() - t0, ts=now())
            except Exception as exc:
                err = self.node._error_for(exc, f"job {spec.name}")
                res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=ctx.cancelled,
                                error=err, duration_s=time.monotonic() - t0, ts=now())
            finally:
                self._running.pop(job_id, None)
            if not res.ok:
                self.node.stats_failed(res.error.code.value if res.error else "internal")
            self.emit(JOB_RESULT, res)
            log.info("job finished", extra={"device": self.name, "job": spec.name, "job_id": job_id,
                                            "ok": res.ok, "duration_s": round(res.duration_s, 3)})

        threading.Thread(target=body, name=f"job-{spec.name}-{job_id}", daemon=True).start()
        return JobAccepted(job_id=job_id, command=spec.name)


class Node:
    """The process-wide bus side of a service. Build, add devices, bind handlers, then `run()`."""

    def __init__(self, api: ServiceAPI, settings: KitSettings, version: str | None = None) -> None:
        from shared import __version__

        self.api = api
        self.settings = settings
        self.version = version or __version__
        self.name = settings.node or api.service
        check_name("node", self.name)
        self.base = f"{settings.topic_root}/{self.name}"
        self.devices: dict[str, Device] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_requested = threading.Event()
        self._started_at = time.monotonic()
        self._session_no = 0
        self._shutdown_hooks: list[Callable[[], Any]] = []
        self._stats_lock = threading.Lock()
        self._ok = 0
        self._failed: dict[str, int] = {}
        self._published = 0
        self._decode_errors = 0
        self._due: dict[int, tuple[float, _Slot]] = {}
        self._due_lock = threading.Lock()
        self._wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=settings.command_workers, thread_name_prefix="cmd")
        self._stopped = False
        will = Will(f"{self.base}/status", self._status(False, "connection lost").model_dump_json().encode())
        self.session = MqttSession(settings, unique_client_id(f"{api.service}-{self.name}"), will)
        self.session.on_connect(self._on_connected)
        self.session.subscribe(f"{self.base}/+/cmd/+", self._on_command_message, qos=1)
        self._house = threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True)

    # -- building ------------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        if name == NODE_DEVICE:
            raise ValueError(f"{NODE_DEVICE!r} is reserved")
        dev = self.devices.get(name)
        if dev is None:
            dev = Device(self, name)
            self.devices[name] = dev
            if self.session.connected.is_set():
                self._publish_status()
                dev.publish_health()
        return dev

    def on_shutdown(self, fn: Callable[[], Any]) -> None:
        """Run at shutdown before the node says offline (fail safe: zero demands here)."""
        self._shutdown_hooks.append(fn)

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Coroutine handlers run on this loop (a service built on asyncio)."""
        self.loop = loop

    def count_decode_error(self, what: str) -> None:
        """Services count bad bytes from devices here; they show in `_node/state/stats`."""
        with self._stats_lock:
            self._decode_errors += 1
        log.debug("decode error", extra={"what": what})

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.session.start()
        self._house.start()

    def request_stop(self, *_: Any) -> None:
        self.stop_requested.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
            self.stop_requested.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self, body: Callable[[], Any] | None = None) -> None:
        """Start, run `body` in a thread if given, block until SIGTERM/SIGINT, then stop cleanly."""
        self.install_signal_handlers()
        self.start()
        if body is not None:
            def wrapped() -> None:
                try:
                    body()
                except Exception:
                    log.exception("service body crashed")
                finally:
                    self.stop_requested.set()
            threading.Thread(target=wrapped, name="service", daemon=True).start()
        while not self.stop_requested.wait(0.5):
            pass
        self.stop("shutdown")

    def run_async(self, main: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run an asyncio service: `main()` runs until SIGTERM/SIGINT cancels it, then stop()."""
        loop = asyncio.new_event_loop()
        self.attach_loop(loop)

        async def runner() -> None:
            task = asyncio.ensure_future(main())
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            self.start()
            try:
                await task
            except asyncio.CancelledError:
                pass
            finally:
                self.stop_requested.set()
            # shutdown hooks may be coroutines needing the loop: run them here
            await self._run_shutdown_hooks_async()

        try:
            loop.run_until_complete(runner())
        finally:
            self.stop("shutdown", hooks=False)
            loop.close()

    async def _run_shutdown_hooks_async(self) -> None:
        hooks, self._shutdown_hooks = self._shutdown_hooks, []
        for fn in hooks:
            try:
                r = fn()
                if inspect.isawaitable(r):
                    await asyncio.wait_for(r, 5.0)
            except Exception:
                log.exception("shutdown hook failed")

    def stop(self, reason: str = "shutdown", hooks: bool = True) -> None:
        """Fail-safe order: service hooks (zero demands), offline status, disconnect."""
        if self._stopped:
            return
        self._stopped = True
        self.stop_requested.set()
        if hooks:
            for fn in self._shutdown_hooks:
                try:
                    r = fn()
                    if inspect.isawaitable(r):
                        self._run_coro(r, 5.0)
                except Exception:
                    log.exception("shutdown hook failed")
        for dev in self.devices.values():
            for ctx in list(dev._running.values()):
                ctx.cancel()
        if self.session.connected.is_set():
            self.session.publish_wait(f"{self.base}/status",
                                      self._status(False, reason).model_dump_json(), qos=1, retain=True)
        self.session.stop()
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        log.info("stopped", extra={"node": self.name, "reason": reason})

    # -- status and stats ----------------------------------------------------------------------
    def _status(self, online: bool, reason: str | None = None) -> Status:
        return Status(online=online, node=self.name, service=self.api.service, version=self.version,
                      ts=now(), session=self._session_no, devices=sorted(self.devices), pid=os.getpid(),
                      host=hostname(), reason=reason)

    def _publish_status(self) -> None:
        self.session.publish(f"{self.base}/status", self._status(True).model_dump_json(), qos=1, retain=True)

    def _on_connected(self) -> None:
        self._session_no += 1
        self._publish_status()
        for dev in list(self.devices.values()):
            dev.publish_health()
            for slot in list(dev._slots.values()):  # a restarted broker may have lost retained values
                if slot.retain and slot.last_payload is not None:
                    self.session.publish(slot.topic, slot.last_payload, qos=slot.qos, retain=True,
                                         properties=_content_props(slot.content_type or "application/json"))

    def stats(self) -> NodeStats:
        with self._stats_lock:
            return NodeStats(commands_ok=self._ok, commands_failed=dict(self._failed),
                             jobs_running=sum(len(d._running) for d in self.devices.values()),
                             published=self._published, publish_dropped=self.session.dropped,
                             decode_errors=self._decode_errors, reconnects=self.session.reconnects,
                             uptime_s=round(time.monotonic() - self._started_at, 3), ts=now())

    def stats_failed(self, code: str) -> None:
        with self._stats_lock:
            self._failed[code] = self._failed.get(code, 0) + 1

    # -- publishing ----------------------------------------------------------------------------
    def _publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
                 content_type: str | None = "application/json") -> None:
        props = _content_props(content_type) if content_type else None
        if self.session.publish(topic, payload, qos=qos, retain=retain, properties=props):
            with self._stats_lock:
                self._published += 1

    def _send_slot(self, slot: _Slot, value: Any) -> None:
        try:
            payload = slot.encode(value)
        except (ValidationError, TypeError) as exc:
            log.error("state value rejected by its model", extra={"topic": slot.topic, "error": str(exc)})
            return
        slot.last_payload = payload if slot.retain else None
        self._publish(slot.topic, payload, qos=slot.qos, retain=slot.retain, content_type=slot.content_type)

    def _schedule(self, slot: _Slot, due: float) -> None:
        with self._due_lock:
            if id(slot) not in self._due:
                self._due[id(slot)] = (due, slot)
                self._wake.set()

    def _flush_due(self) -> float:
        """Send pending rate-capped values whose time has come; return seconds to the next one."""
        t = time.monotonic()
        nxt = 0.5
        with self._due_lock:
            ready = [s for d, s in self._due.values() if d <= t]
            for s in ready:
                del self._due[id(s)]
            if self._due:
                nxt = min(nxt, min(d for d, _ in self._due.values()) - t)
        for slot in ready:
            with slot.lock:
                if not slot.has_pending:
                    continue
                value, slot.pending, slot.has_pending = slot.pending, None, False
                # keep the cadence: the slot's time is when it was due, not when the flusher got to it
                # (else every held-back value stretches the period and 100 Hz becomes ~97 Hz); never
                # further back than one interval, so a late flusher cannot cause a burst
                now_t = time.monotonic()
                slot.last_sent = max(slot.last_sent + slot.interval, now_t - slot.interval)
            self._send_slot(slot, value)
        return max(nxt, 0.0005)

    def _housekeeping(self) -> None:
        next_beat = time.monotonic() + self.settings.health_interval_s
        while not self._stopped:
            wait = self._flush_due()
            t = time.monotonic()
            if t >= next_beat:
                next_beat = t + self.settings.health_interval_s
                if self.session.connected.is_set():
                    for dev in list(self.devices.values()):
                        dev.publish_health()
                    self._publish(f"{self.base}/{NODE_DEVICE}/state/stats",
                                  self.stats().model_dump_json().encode(), qos=0, retain=True)
            self._wake.wait(min(wait, max(next_beat - t, 0.0005)))
            self._wake.clear()

    # -- commands ------------------------------------------------------------------------------
    def _on_command_message(self, msg: mqtt.MQTTMessage) -> None:
        # Network thread: copy what we need and hand over at once.
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        if msg.retain:
            return  # a retained request is stale by definition; never act on it
        # the reply goes at the request's QoS: a caller streaming at QoS 0 (setpoints superseded a few ms
        # later) chose no acknowledgements, a QoS 1 caller gets its reply at least once (QoS 2 -> 1)
        qos = min(int(msg.qos), 1)
        if self._is_inline(msg.topic):
            self._handle_command(msg.topic, bytes(msg.payload), response_topic, correlation, qos)
            return
        try:
            self._pool.submit(self._handle_command, msg.topic, bytes(msg.payload), response_topic,
                              correlation, qos)
        except RuntimeError:  # pool shut down: we are stopping
            pass

    def _is_inline(self, topic: str) -> bool:
        device_name, _, command = topic[len(self.base) + 1:].partition("/cmd/")
        dev = self.devices.get(device_name)
        return dev is not None and command in dev._inline

    def _handle_command(self, topic: str, payload: bytes, response_topic: str | None,
                        correlation: bytes | None, qos: int = 1) -> None:
        device_name, command = topic[len(self.base) + 1:].split("/cmd/", 1)
        try:
            result = self._dispatch(device_name, command, payload)
            body = b'{"ok":true,"result":' + result + b"}"
            with self._stats_lock:
                self._ok += 1
        except Exception as exc:
            err = self._error_for(exc, f"{device_name}/{command}")
            self.stats_failed(err.code.value)
            body = json.dumps({"ok": False, "error": err.model_dump(mode="json")}).encode()
        reply_to = response_topic or f"{topic}/reply"
        self.session.publish(reply_to, body, qos=qos,
                             properties=reply_properties(None, correlation, "application/json"))

    def _dispatch(self, device_name: str, command: str, payload: bytes) -> bytes:
        dev = self.devices.get(device_name)
        if dev is None:
            raise CommandError(ErrorCode.NOT_FOUND,
                               f"no device {device_name!r} on node {self.name} (devices: {sorted(self.devices)})")
        entry = dev._commands.get(command)
        job = dev._jobs.get(command)
        if entry is None and job is None:
            known = sorted(set(dev._commands) | set(dev._jobs))
            raise CommandError(ErrorCode.NOT_FOUND, f"unknown command {command!r} (known: {known})")
        req_model = entry[0].request if entry else job[0].request  # type: ignore[index]
        try:
            text = payload.decode("utf-8") if payload else "{}"
        except UnicodeDecodeError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"payload is not UTF-8 text (byte {exc.start})") from None
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, f"payload is not JSON: {exc.msg} at {exc.pos}") from None
        if not isinstance(data, dict):
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"payload must be a JSON object, got {type(data).__name__}")
        try:
            req = req_model.model_validate(data)
        except ValidationError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, describe_validation_error(exc)) from None
        if job is not None:
            spec, run, admit = job
            if admit is not None:
                r = admit(req)
                if inspect.isawaitable(r):
                    self._run_coro(r, 30.0)
            return dump(JobAccepted, dev._start_job(spec, run, req))
        cspec, handler = entry  # type: ignore[misc]
        out = handler(req)
        if inspect.isawaitable(out):
            out = self._run_coro(out, None)
        if out is None:
            out = {}
        try:
            return dump(cspec.reply, out)
        except ValidationError as exc:
            raise CommandError(ErrorCode.INTERNAL,
                               f"reply failed its own schema: {describe_validation_error(exc)}") from None

    def _run_coro(self, aw: Awaitable[Any], timeout: float | None) -> Any:
        if self.loop is None or not self.loop.is_running():
            raise CommandError(ErrorCode.UNAVAILABLE, "the service's event loop is not running")
        fut = asyncio.run_coroutine_threadsafe(_as_coro(aw), self.loop)
        return fut.result(timeout)

    def _error_for(self, exc: BaseException, where: str) -> ErrorInfo:
        if isinstance(exc, CommandError):
            return ErrorInfo(code=exc.code, message=exc.message)
        if isinstance(exc, ValidationError):
            return ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=describe_validation_error(exc))
        if isinstance(exc, TimeoutError):
            return ErrorInfo(code=ErrorCode.TIMEOUT, message=str(exc) or "timed out")
        log.exception("handler raised", extra={"where": where}, exc_info=exc)
        return ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")


_CONTENT_PROPS: dict[str, Any] = {}


def _content_props(content_type: str) -> Any:
    """One Properties object per content type: paho packs it at publish time and never changes it,
    and building one per message costs a few percent of CPU at 1,000 messages/s."""
    props = _CONTENT_PROPS.get(content_type)
    if props is None:
        props = _CONTENT_PROPS[content_type] = reply_properties(content_type=content_type)
    return props


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw
