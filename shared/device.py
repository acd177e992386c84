"""One piece of hardware served by a node: its health, rate-capped state, events, streams and handlers."""

from __future__ import annotations

import inspect
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import paho.mqtt.client as mqtt
from pydantic import BaseModel, ValidationError

from shared.contract import (
    BY_REQUEST,
    CANCEL,
    JOB_PROGRESS,
    JOB_RESULT,
    BinarySpec,
    CommandSpec,
    EventSpec,
    JobSpec,
    KindSpec,
    ServiceAPI,
    StateSpec,
    StreamSpec,
    check_name,
)
from shared.counters import Counters
from shared.errors import CommandError, ErrorCode
from shared.jobs import JobCancelled, JobContext
from shared.link import LinkPolicy, SupervisedLink
from shared.messages import CancelReply, CancelRequest, ErrorInfo, Health, JobAccepted, JobResult
from shared.mqtt.session import MqttSession, PublishProperties
from shared.payloads import describe_validation_error, dump, error_info
from shared.ratecap import FlushSchedule, RateSlot
from shared.settings import KitSettings
from shared.stop import StopAction, StopLatch

log = logging.getLogger("robobus.device")

HEALTH_FIELDS = ("connection", "operational", "state", "error", "error_message", "details")

Handler = Callable[..., Any]
F = TypeVar("F", bound=Callable[..., Any])

BINDINGS_ATTR = "__robobus_bindings__"


_health_props: dict[int, PublishProperties] = {}


def health_properties(settings: KitSettings) -> PublishProperties | None:
    """A health message's properties: its expiry, `health_expiry_beats` heartbeats (whole seconds, rounded up,
    at least one beat and 2 s more, so that a heartbeat a little late never lets it lapse); None: no expiry."""
    if not settings.health_expiry_beats:
        return None
    expiry = math.ceil(settings.health_interval_s * settings.health_expiry_beats + 2.0)
    props = _health_props.get(expiry)
    if props is None:
        props = _health_props[expiry] = PublishProperties(None, None, None, expiry_s=expiry)
    return props


@dataclass(frozen=True)
class Binding:
    """What `@handles` / `@runs` / `@moves_when` put on a method: the spec it answers, and how (`Device.bind_all`
    reads it). `inline` / `admit` may name an attribute of the object, read when it is bound (a setting, a method).
    `predicate`: the method is the spec's `@moves_when` predicate, not its handler."""

    spec: CommandSpec | JobSpec
    inline: bool | str = False
    admit: str | None = None
    predicate: bool = False


def _mark(fn: F, binding: Binding) -> F:
    setattr(fn, BINDINGS_ATTR, (*getattr(fn, BINDINGS_ATTR, ()), binding))
    return fn


def handles(spec: CommandSpec, *, inline: bool | str = False) -> Callable[[F], F]:
    """Mark a method as the handler of a declared command; `Device.bind_all(obj)` binds it (as `Device.bind`).
    `inline=True` runs it on the MQTT network thread (it must be synchronous and only validate and enqueue);
    `inline="attr"` reads the object's attribute `attr` when it is bound (a setting). Stack to answer several
    commands with one method."""
    if not isinstance(spec, CommandSpec):
        raise TypeError(f"@handles takes a command spec, not {spec!r} (a job is @runs)")

    def mark(fn: F) -> F:
        if inline is True and inspect.iscoroutinefunction(fn):
            raise ValueError(f"command {spec.name!r}: an inline handler must be synchronous ({fn.__qualname__})")
        return _mark(fn, Binding(spec, inline))
    return mark


def runs(spec: JobSpec, *, admit: str | None = None) -> Callable[[F], F]:
    """Mark a method as the body of a declared job, `run(request, job)`; `Device.bind_all(obj)` binds it (as
    `Device.bind_job`). `admit`: the name of the object's method that admits a request first (raise CommandError,
    e.g. `busy`, to refuse it before a job id exists)."""
    if not isinstance(spec, JobSpec):
        raise TypeError(f"@runs takes a job spec, not {spec!r} (a command is @handles)")

    def mark(fn: F) -> F:
        return _mark(fn, Binding(spec, admit=admit))
    return mark


def moves_when(spec: CommandSpec) -> Callable[[F], F]:
    """Mark a method `(request) -> bool` as the predicate of a command declared `motion=BY_REQUEST` ("request"):
    whether this request moves. `Device.bind_all(obj)` binds it beside the command's handler (as
    `Device.bind_moves_when`), and the node does not start while such a command has none. The dispatcher calls it
    with the validated request before the handler, on the handler's thread (the network thread for an inline
    handler, the loop for an `async def` one: it must be quick and synchronous, and send nothing): True, the
    request takes the motion path (the bus stop's gate before, `StopLatch.done` after); False, the plain one. A
    CommandError it raises is the request's answer; anything else it raises is answered `internal`."""
    if not isinstance(spec, CommandSpec):
        raise TypeError(f"@moves_when takes a command spec, not {spec!r} (a job moves for every request or none)")
    if spec.motion != BY_REQUEST:
        raise ValueError(f"@moves_when({spec.name!r}): the command is not declared motion={BY_REQUEST!r} "
                         f"(its motion is {spec.motion!r})")

    def mark(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            raise ValueError(f"command {spec.name!r}: a moves_when predicate must be synchronous ({fn.__qualname__})")
        return _mark(fn, Binding(spec, predicate=True))
    return mark


def bindings_of(obj: object) -> list[tuple[Binding, Handler]]:
    """The marked methods of `obj`, bound to it. A method's marks are those of its most derived definition that has
    any: an unmarked override in a subclass answers what the method it overrides was marked for."""
    found: list[tuple[Binding, Handler]] = []
    for attr in dir(type(obj)):
        for cls in type(obj).__mro__:
            fn = cls.__dict__.get(attr)
            if isinstance(fn, (staticmethod, classmethod)):
                fn = fn.__func__
            marks: tuple[Binding, ...] = getattr(fn, BINDINGS_ATTR, ()) if callable(fn) else ()
            if marks:
                found.extend((binding, getattr(obj, attr)) for binding in marks)
                break
    return found


class NodeServices(Protocol):
    """What a device uses of its node (shared/node.py's Node provides it): the session, the contract, the
    rate-cap flusher, the counters. A protocol, so that the node imports its devices and never the reverse."""

    api: ServiceAPI
    settings: KitSettings
    name: str
    base: str
    version: str
    session: MqttSession
    counters: Counters
    flush_schedule: FlushSchedule
    stop_latch: StopLatch

    def publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
                content_type: str | None = "application/json") -> None: ...

    def send_slot(self, slot: RateSlot, value: Any) -> None: ...

    def count_decode_error(self, what: str) -> None: ...

    def run_coro(self, aw: Awaitable[Any], timeout: float | None) -> Any: ...


class Device:
    """Created by `node.device(name)`. Thread-safe: publish, emit and set_health from any thread."""

    def __init__(self, node: NodeServices, name: str, kind: KindSpec | None = None) -> None:
        self.node = node
        self.name = check_name("device", name)
        # what the device answers: every command and job of its kind is bound before the node starts (Node.start)
        self.kind = kind if kind is not None else node.api.kind_of(None)
        self.base = f"{node.base}/{name}"
        self._health: dict[str, Any] = {
            "connection": False, "operational": False, "state": "starting",
            "error": False, "error_message": "", "details": {},
        }
        self._health_lock = threading.Lock()
        # health is published from several threads (the service's loop, the heartbeat, the connect callback): each
        # publish takes a ticket before it reads the state, and one whose ticket is older than one already sent
        # is dropped, so a snapshot read before a change can never be the retained health after it (publish_health)
        self._health_tickets = 0
        self._health_sent = 0
        self._publish_lock = threading.Lock()
        self.link: SupervisedLink | None = None
        self.commands: dict[str, tuple[CommandSpec, Handler]] = {}
        self.moves_when: dict[str, Callable[[Any], bool]] = {}  # motion=BY_REQUEST command -> its predicate
        self.inline: set[str] = set()
        self.jobs: dict[str, tuple[JobSpec, Handler, Handler | None]] = {}
        self.running: dict[str, JobContext] = {}
        self.slots: dict[str, RateSlot] = {}
        # the bus stop (shared/stop.py): the service's stop action, and the motion jobs it concerns
        self.stop_action: StopAction | None = None
        self.stop_inline = False
        self.stop_note = ""  # what the stop cannot do on this device: said in its health while the stop is active
        self._motion = False
        self._job_gens: dict[str, int] = {}  # motion job id -> the stop activation count it was admitted at
        self._stopped_jobs: dict[str, str] = {}  # motion job id -> why the stop cancelled it

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

    def supervise_link(self, policy: LinkPolicy) -> SupervisedLink:
        """Hand this device's link to the kit's supervisor (shared/link.py): its health is driven from the link's
        state, the same table in every service (docs/kit.md), and `details.link` counts attempts, failures and
        time in each state. The node's housekeeping applies the deadlines."""
        self.link = SupervisedLink(policy, lambda fields: self.set_health(**fields),
                                   wake=self.node.flush_schedule.wake.set, start=False)
        self.link.show()  # after self.link is set: the first health published carries details.link
        self.node.flush_schedule.wake.set()  # the housekeeping loop picks up the new deadline
        return self.link

    def health_message(self) -> Health:
        with self._health_lock:
            h = dict(self._health)
        if self.link is not None:
            h["details"] = {**h.get("details", {}), "link": self.link.details()}
            if h.get("error_message"):  # an age it states, counted to now (not to when the state was entered)
                h["error_message"] = self.link.live_message(str(h["error_message"]))
        if self._motion:  # the bus stop's overlay and its path's state (shared/stop.py, StopLatch.dress)
            self.node.stop_latch.dress(self.name, h, self.stop_note)
        return Health(service=self.node.api.service, node=self.node.name, device=self.name,
                      version=self.node.version, ts=time.time(), **h)

    def publish_health(self) -> None:
        """Retained, with a Message Expiry Interval of a few heartbeats (`health_expiry_beats`): the broker drops
        it when its node dies without a word (kill -9, a cut), so a reader of one device's health is never told a
        dead node's device is live. Nothing while the node is not connected: paho would queue it and send it after
        the connect, behind the fresh health the node publishes then for every device, so the retained health
        would be an older state than the device's (seen: `connecting` after `operational`)."""
        if not self.node.session.connected.is_set():
            return
        with self._publish_lock:
            self._health_tickets += 1
            ticket = self._health_tickets
        payload = self.health_message().model_dump_json()  # outside the lock: it takes the link's own
        with self._publish_lock:
            if ticket < self._health_sent:
                return  # a snapshot begun later has gone out already: this one may be older than it
            self._health_sent = ticket
            self.node.session.publish(f"{self.base}/health", payload,
                                      qos=1, retain=True, properties=health_properties(self.node.settings))

    # -- state, events, streams ------------------------------------------------------------------
    def _slot(self, spec: StateSpec | BinarySpec) -> RateSlot:
        slot = self.slots.get(spec.name)
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
            slot = RateSlot(topic=f"{self.base}/state/{spec.name}", interval=(1.0 / rate) if rate else 0.0,
                            retain=spec.retain, qos=spec.qos, encode=enc, content_type=ctype)
            self.slots[spec.name] = slot
        return slot

    def publish(self, spec: StateSpec | BinarySpec, value: BaseModel | dict[str, Any] | bytes, *,
                at: float | None = None) -> None:
        """Publish state under its rate cap: too soon, and only the newest value is kept for later.
        Serialisation happens only for values that are actually sent. `at` (time.monotonic) is the time a
        publisher on its own fixed schedule at the configured rate meant this value for: the cap counts that,
        not when the thread got there, so its wake-up jitter is not held back for the housekeeping thread
        (each later value would otherwise be judged against the latest wake-up so far, and deferred)."""
        slot = self._slot(spec)
        if slot.offer(value, time.monotonic() if at is None else at):
            self.node.send_slot(slot, value)
        else:
            self.node.flush_schedule.schedule(slot, slot.due())

    def emit(self, spec: EventSpec, value: BaseModel | dict[str, Any]) -> None:
        if self.node.api.events.get(spec.name) is not spec and spec not in (JOB_PROGRESS, JOB_RESULT):
            raise KeyError(f"event {spec.name!r} is not declared on {self.node.api.service}'s API")
        self.node.publish(f"{self.base}/event/{spec.name}", dump(spec.model, value), qos=spec.qos)

    def stream_publish(self, spec: StreamSpec, value: BaseModel | dict[str, Any]) -> None:
        self.node.publish(f"{self.base}/stream/{spec.name}", dump(spec.model, value), qos=spec.qos)

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

    # -- the bus stop (shared/stop.py) -----------------------------------------------------------
    @property
    def motion(self) -> bool:
        """A motion device: it has a stop action or motion commands; the bus stop holds it."""
        return self._motion

    def on_stop(self, action: StopAction, *, inline: bool = False, note: str = "") -> None:
        """The service's stop action for this device: `action(stop: StopState)`, called at once whenever the bus
        stop becomes active (and again after a motion command that ran across it). It runs on a thread of its
        own, on the MQTT network thread with `inline=True` (it must only enqueue), or on the service's loop for
        an `async def`. It returns the Unix time the stop reached the device, None (it has, by the return), or
        `shared.stop.LATER` (then call `stop_written(at)` when the device confirms). `note`: what the stop cannot
        do on this device (a protocol with no way to halt a move in progress), appended to its health's
        `error_message` while the stop is active."""
        if inline and inspect.iscoroutinefunction(action):
            raise ValueError(f"{self.name}: an inline stop action must be synchronous")
        self.stop_action = action
        self.stop_inline = inline
        self.stop_note = note
        self._motion = True
        self.node.stop_latch.adopt(self)  # a device made while the stop is active is stopped at once

    def stop_written(self, at: float | None = None, error: str = "") -> None:
        """The current stop reached the device at `at` (Unix time, default now), or failed (`error`): shows in
        the node's stop answer and the device's health. A failure stamps no write time: the stop did not reach
        the device."""
        written = None if error else (time.time() if at is None else at)
        self.node.stop_latch.report(self.name, None, written, error)

    def cancel_motion_jobs(self, why: str) -> None:
        for job_id, ctx in list(self.running.items()):
            entry = self.jobs.get(ctx.command)
            if entry is not None and entry[0].motion:
                self._stopped_jobs[job_id] = why
                ctx.cancel()

    # -- commands and jobs -----------------------------------------------------------------------
    def bind(self, spec: CommandSpec, handler: Handler, *, inline: bool = False) -> None:
        """handler(request_model) -> reply model or dict; may be `async def` (runs on node.loop).

        `inline=True` runs a synchronous handler on the MQTT network thread, skipping the hand-over to
        the command pool: for handlers that only validate and enqueue (a demand for a realtime cycle),
        where the hop's latency matters. Such a handler must never block or do slow work: while it runs,
        no message is received. Validation and the reply are the same either way."""
        if self.node.api.commands.get(spec.name) is not spec:
            raise KeyError(f"command {spec.name!r} is not declared on {self.node.api.service}'s API")
        if spec.name not in self.kind.commands:
            raise KeyError(f"command {spec.name!r} is not one of kind {self.kind.name!r}'s (device {self.name!r} "
                           f"of {self.node.api.service}: {list(self.kind.commands)})")
        if inline and inspect.iscoroutinefunction(handler):
            raise ValueError(f"command {spec.name!r}: an inline handler must be synchronous")
        self.commands[spec.name] = (spec, handler)
        # a command that moves for some requests only does not make a motion device by itself (a GPIO module with
        # no stop outputs never moves): the device's stop action does (on_stop)
        if spec.motion is True and not self._motion:
            self._motion = True
            self.node.stop_latch.adopt(self)
        if inline:
            self.inline.add(spec.name)
        else:
            self.inline.discard(spec.name)

    def bind_moves_when(self, spec: CommandSpec, predicate: Callable[[Any], bool]) -> None:
        """predicate(request_model) -> bool: whether this request of a command declared `motion=BY_REQUEST` moves
        (see `moves_when`). Bound once per command, beside its handler; the node does not start without it."""
        if self.node.api.commands.get(spec.name) is not spec:
            raise KeyError(f"command {spec.name!r} is not declared on {self.node.api.service}'s API")
        if spec.name not in self.kind.commands:
            raise KeyError(f"command {spec.name!r} is not one of kind {self.kind.name!r}'s (device {self.name!r} "
                           f"of {self.node.api.service}: {list(self.kind.commands)})")
        if spec.motion != BY_REQUEST:
            raise ValueError(f"{self.node.api.service}: device {self.name!r}: command {spec.name!r} is not declared "
                             f"motion={BY_REQUEST!r}: it takes no moves_when predicate")
        if inspect.iscoroutinefunction(predicate):
            raise ValueError(f"command {spec.name!r}: a moves_when predicate must be synchronous")
        self.moves_when[spec.name] = predicate

    def bind_job(self, spec: JobSpec, run: Handler, admit: Handler | None = None) -> None:
        """run(request, job: JobContext) -> result, on its own thread. `admit(request)` runs first,
        synchronously: raise CommandError there (e.g. `busy`) to refuse before a job id exists."""
        if self.node.api.jobs.get(spec.name) is not spec:
            raise KeyError(f"job {spec.name!r} is not declared on {self.node.api.service}'s API")
        if spec.name not in self.kind.jobs:
            raise KeyError(f"job {spec.name!r} is not one of kind {self.kind.name!r}'s (device {self.name!r} "
                           f"of {self.node.api.service}: {list(self.kind.jobs)})")
        self.jobs[spec.name] = (spec, run, admit)
        if spec.motion and not self._motion:
            self._motion = True
            self.node.stop_latch.adopt(self)
        if CANCEL.name not in self.commands:
            self.commands[CANCEL.name] = (CANCEL, self._cancel)

    def bind_all(self, obj: object) -> None:
        """Bind every method of `obj` marked with `@handles` (a command), `@runs` (a job) or `@moves_when` (the
        predicate of a command that moves for some requests), with the checks of `bind` / `bind_job` /
        `bind_moves_when`: each spec declared on the API and of this device's kind, an inline handler
        synchronous, one handler (and one predicate) per command. Whatever the kind has and `obj` does not is
        refused when the node starts (Node.check_bindings)."""
        seen: dict[str, str] = {}
        seen_predicates: dict[str, str] = {}
        for binding, handler in bindings_of(obj):
            spec = binding.spec
            where = f"{type(obj).__qualname__}.{getattr(handler, '__name__', handler)}"
            if binding.predicate:
                if spec.name in seen_predicates:
                    raise ValueError(f"{self.node.api.service}: device {self.name!r}: {spec.name!r} has two "
                                     f"moves_when predicates ({seen_predicates[spec.name]} and {where})")
                seen_predicates[spec.name] = where
                assert isinstance(spec, CommandSpec)  # @moves_when takes commands only
                self.bind_moves_when(spec, handler)
                continue
            if spec.name in seen:
                raise ValueError(f"{self.node.api.service}: device {self.name!r}: {spec.name!r} has two handlers "
                                 f"({seen[spec.name]} and {where})")
            seen[spec.name] = where
            if isinstance(spec, JobSpec):
                admit: Handler | None = None
                if binding.admit is not None:
                    admit = getattr(obj, binding.admit, None)
                    if not callable(admit):
                        raise TypeError(f"{where}: job {spec.name!r}: admit {binding.admit!r} is not a method "
                                        f"of {type(obj).__qualname__}")
                self.bind_job(spec, handler, admit)
            else:
                inline = binding.inline
                if isinstance(inline, str):
                    inline = bool(getattr(obj, inline))
                self.bind(spec, handler, inline=inline)

    def unbound(self) -> tuple[list[str], list[str]]:
        """The commands and jobs of this device's kind that have no handler yet (`cancel` comes with a job), and the
        commands declared `motion=BY_REQUEST` that have no moves_when predicate (named so: the node's refusal to
        start says which is missing)."""
        jobs = [j for j in self.kind.jobs if j not in self.jobs]
        cmds = [c for c in self.kind.commands if c not in self.commands and not (jobs and c == CANCEL.name)]
        cmds += [f"{c}'s @moves_when predicate (it moves for some requests only)" for c in self.kind.commands
                 if self.node.api.commands.get(c, CANCEL).motion == BY_REQUEST and c not in self.moves_when]
        return (cmds, jobs)

    def running_jobs(self) -> list[str]:
        return list(self.running)

    def start_job(self, spec: JobSpec, run: Handler, req: BaseModel, motion_gen: int | None = None) -> JobAccepted:
        """Run `run(req, ctx)` on its own thread; emit exactly one `job_result` when it ends. `motion_gen`: the
        stop's activation count a motion job was admitted at (shared/stop.py)."""
        job_id = uuid.uuid4().hex[:12]
        ctx = JobContext(self.emit, job_id, spec.name)
        if motion_gen is not None:
            self._job_gens[job_id] = motion_gen
        self.running[job_id] = ctx
        threading.Thread(target=self._job_body, args=(spec, run, req, ctx), name=f"job-{spec.name}-{job_id}",
                         daemon=True).start()
        return JobAccepted(job_id=job_id, command=spec.name)

    def _job_body(self, spec: JobSpec, run: Handler, req: BaseModel, ctx: JobContext) -> None:
        t0 = time.monotonic()
        job_id = ctx.job_id
        try:
            result = run(req, ctx)
            if inspect.iscoroutine(result):
                result = self.node.run_coro(result, None)
            ctx.check_cancelled()
            payload = json.loads(dump(spec.result, result))
            res = JobResult(job_id=job_id, command=spec.name, ok=True, result=payload,
                            duration_s=time.monotonic() - t0, ts=time.time())
        except JobCancelled:
            why = self._stopped_jobs.get(job_id)
            error = ErrorInfo(code=ErrorCode.STOPPED, message=why) if why else \
                ErrorInfo(code=ErrorCode.CANCELLED, message="cancelled by request")
            res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=True, error=error,
                            duration_s=time.monotonic() - t0, ts=time.time())
        except Exception as exc:
            res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=ctx.cancelled,
                            error=error_info(exc, f"job {spec.name}"), duration_s=time.monotonic() - t0,
                            ts=time.time())
        finally:
            self.running.pop(job_id, None)
            self._stopped_jobs.pop(job_id, None)
            gen = self._job_gens.pop(job_id, None)
            if gen is not None:
                self.node.stop_latch.done(self, gen)
        if not res.ok:
            self.node.counters.failed(res.error.code.value if res.error else "internal")
        self.emit(JOB_RESULT, res)
        log.info("job finished", extra={"device": self.name, "job": spec.name, "job_id": job_id,
                                        "ok": res.ok, "duration_s": round(res.duration_s, 3)})

    def cancel_all_jobs(self) -> None:
        for ctx in list(self.running.values()):
            ctx.cancel()

    def _cancel(self, req: CancelRequest) -> CancelReply:
        if req.job_id is not None:
            job = self.running.get(req.job_id)
            if job is None:
                raise CommandError(ErrorCode.NOT_FOUND, f"no running job {req.job_id!r} on {self.name}")
            job.cancel()
            return CancelReply(cancelled=[req.job_id])
        ids = list(self.running)
        for jid in ids:
            self.running[jid].cancel()
        return CancelReply(cancelled=ids)
