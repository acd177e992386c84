"""The declarative contract of a service: what it publishes and what it answers.

A service declares its surface once, at import time, on a `ServiceAPI`; no broker, no hardware.
The node binds handlers and publishes through these specs at run time, and the schema exporter
reads the same specs to write the AsyncAPI document, so code and document cannot drift apart.

    API = ServiceAPI("epuck-gateway", device_doc="one e-puck2 robot")
    SENSORS = API.state("sensors", Sensors, rate_hz=50)
    SET_SPEED = API.command("set_speed", SetSpeed, Ack)

A service whose devices differ declares its kinds of device, each with the commands and jobs it answers
(`API.kind("odrive", commands=[...], jobs=[...])`); without kinds, every device answers the whole API. The node
refuses to start while a device leaves a command or job of its kind unbound (shared/device.py, `bind_all`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from pydantic import BaseModel

from shared.errors import ErrorCode
from shared.messages import (
    CancelReply,
    CancelRequest,
    JobProgress,
    JobResult,
)

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

# A command that moves for some requests only (docs/kit.md "Stopping everything"): `API.command(...,
# motion=BY_REQUEST)`. Its device binds a predicate `(request) -> bool` beside the handler (`@moves_when`,
# shared/device.py); a request it says moves is gated as a motion command's, any other as a read-only command's.
BY_REQUEST: Final = "request"
Motion: TypeAlias = bool | Literal["request"]  # False: never; True: every request; BY_REQUEST: the predicate says


def check_name(kind: str, name: str) -> str:
    """Topic segments must not hold MQTT wildcards or separators."""
    if not NAME_RE.match(name):
        raise ValueError(f"{kind} name {name!r} must match {NAME_RE.pattern} (no '/', '+', '#', spaces)")
    return name


def _codes(errors: Iterable[ErrorCode | str]) -> tuple[ErrorCode, ...]:
    return tuple(sorted({ErrorCode(e) for e in errors}, key=list(ErrorCode).index))


@dataclass(frozen=True)
class StateSpec:
    """`{device}/state/{name}`: JSON state, rate-capped, latest value retained when `retain`."""

    name: str
    model: type[BaseModel]
    rate_hz: float | None = None  # default cap; None = every update
    retain: bool = True
    qos: int = 0
    doc: str = ""


@dataclass(frozen=True)
class BinarySpec:
    """`{device}/state/{name}`: binary payload (e.g. JPEG) with an MQTT 5 Content Type."""

    name: str
    content_type: str
    rate_hz: float | None = None
    retain: bool = False
    qos: int = 0
    doc: str = ""


@dataclass(frozen=True)
class EventSpec:
    """`{device}/event/{name}`: something happened (never retained)."""

    name: str
    model: type[BaseModel]
    qos: int = 1
    doc: str = ""


@dataclass(frozen=True)
class CommandSpec:
    """`{device}/cmd/{name}`: request with MQTT 5 Response Topic + Correlation Data, one reply."""

    name: str
    request: type[BaseModel]
    reply: type[BaseModel]
    doc: str = ""
    # Error codes the handler may answer with, beyond the kit's own (KIT_ERRORS); the AsyncAPI
    # document lists both, and the contract tests hold the service to them.
    errors: tuple[ErrorCode, ...] = ()
    # Synchronous handlers run on the command pool; the network loop never waits on them.
    # A motion command makes something move: refused with `stopped` while the bus stop is active, and with
    # `unavailable` until the node has read the stop (shared/stop.py), before the handler runs. BY_REQUEST: only the
    # requests its device's `@moves_when` predicate says move are (the others are answered as read-only).
    motion: Motion = False


@dataclass(frozen=True)
class JobSpec:
    """A long command: replies at once with a job id, streams progress, ends with a result event."""

    name: str
    request: type[BaseModel]
    result: type[BaseModel]
    doc: str = ""
    errors: tuple[ErrorCode, ...] = ()  # codes of the refusal (admit) or of the job_result's error
    motion: bool = False  # as CommandSpec.motion; a running motion job is cancelled by the stop (`stopped`)


@dataclass(frozen=True)
class StreamSpec:
    """A raw, high-rate channel outside the request/reply pattern (e.g. a CAN bridge lease).

    `direction` is "in" (the node subscribes) or "out" (the node publishes). The topic is
    `{root}/{node}/{device}/{kind}/{name}` where kind is "stream"."""

    name: str
    model: type[BaseModel]
    direction: str
    qos: int = 0
    doc: str = ""


# Codes the kit itself answers any command with: a request that fails validation (invalid_request), an
# unknown device (not_found), a handler that raised something unexpected (internal), a request older than its age
# (expired: never run, shared/dispatch.py).
KIT_ERRORS = (ErrorCode.INVALID_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.INTERNAL, ErrorCode.EXPIRED)
# A job cancelled by request ends with a job_result whose error code is `cancelled`.
JOB_ERRORS = (ErrorCode.CANCELLED,)
# What the kit answers a motion command (or job) with: `stopped` while the bus stop is active (a motion job the stop
# cancels ends with it too), `unavailable` while the node has not yet read the stop (shared/stop.py).
MOTION_ERRORS = (ErrorCode.STOPPED, ErrorCode.UNAVAILABLE)


def motion_kind(spec: CommandSpec | JobSpec) -> Literal["never", "always", "request"]:
    """How a command moves, as the AsyncAPI document's `x-robobus.motion` says it: never, always (motion=True) or
    request (motion=BY_REQUEST: some requests, its device's predicate decides)."""
    if spec.motion == BY_REQUEST:
        return "request"
    return "always" if spec.motion else "never"


def command_errors(spec: CommandSpec | JobSpec) -> list[ErrorCode]:
    """Every code a command's reply (and, for a job, its job_result) may carry, in ErrorCode order."""
    codes = set(KIT_ERRORS) | set(spec.errors) | (set(JOB_ERRORS) if isinstance(spec, JobSpec) else set())
    if spec.motion:  # True or BY_REQUEST: a moving request passes the stop's gate
        codes |= set(MOTION_ERRORS)
    return [c for c in ErrorCode if c in codes]


JOB_PROGRESS = EventSpec("job_progress", JobProgress, doc="Progress of a running job")
JOB_RESULT = EventSpec("job_result", JobResult, doc="The end of a job: its result or error")
CANCEL = CommandSpec("cancel", CancelRequest, CancelReply, doc="Cancel one job, or every job of the device")


@dataclass(frozen=True)
class KindSpec:
    """A kind of device of a service: the commands and jobs every device of the kind answers (each bound, or the
    node does not start), and no other. `cancel` comes with the jobs."""

    name: str
    commands: tuple[str, ...]
    jobs: tuple[str, ...] = ()
    doc: str = ""


DEFAULT_KIND = "device"  # the one kind of a service that declares none: every command and job of its API


@dataclass
class ServiceAPI:
    """Everything one service publishes and answers, per device."""

    service: str
    device_doc: str = "a device served by this node"
    doc: str = ""
    states: dict[str, StateSpec | BinarySpec] = field(default_factory=dict)
    events: dict[str, EventSpec] = field(default_factory=dict)
    commands: dict[str, CommandSpec] = field(default_factory=dict)
    jobs: dict[str, JobSpec] = field(default_factory=dict)
    streams: dict[str, StreamSpec] = field(default_factory=dict)
    kinds: dict[str, KindSpec] = field(default_factory=dict)

    def _free(self, name: str, table: dict[str, object], kind: str) -> None:
        check_name(kind, name)
        if name in table:
            raise ValueError(f"{self.service}: {kind} {name!r} declared twice")

    def state(
        self,
        name: str,
        model: type[BaseModel],
        *,
        rate_hz: float | None = None,
        retain: bool = True,
        qos: int = 0,
        doc: str = "",
    ) -> StateSpec:
        self._free(name, self.states, "state")  # type: ignore[arg-type]
        spec = StateSpec(name, model, rate_hz, retain, qos, doc or (model.__doc__ or "").strip())
        self.states[name] = spec
        return spec

    def binary(
        self,
        name: str,
        content_type: str,
        *,
        rate_hz: float | None = None,
        retain: bool = False,
        doc: str = "",
    ) -> BinarySpec:
        self._free(name, self.states, "state")  # type: ignore[arg-type]
        spec = BinarySpec(name, content_type, rate_hz, retain, 0, doc)
        self.states[name] = spec
        return spec

    def event(self, name: str, model: type[BaseModel], *, qos: int = 1, doc: str = "") -> EventSpec:
        self._free(name, self.events, "event")  # type: ignore[arg-type]
        spec = EventSpec(name, model, qos, doc or (model.__doc__ or "").strip())
        self.events[name] = spec
        return spec

    def command(
        self, name: str, request: type[BaseModel], reply: type[BaseModel], *, doc: str = "",
        errors: Iterable[ErrorCode | str] = (), motion: Motion = False,
    ) -> CommandSpec:
        """`motion=True`: the command makes something move, so the bus stop refuses it (shared/stop.py).
        `motion=BY_REQUEST` ("request"): some of its requests move; the device binds the predicate that says which
        (`@moves_when`, shared/device.py), and the bus stop refuses those only."""
        if motion is not True and motion is not False and motion != BY_REQUEST:
            raise ValueError(f"{self.service}: command {name!r}: motion must be True, False or {BY_REQUEST!r}, "
                             f"not {motion!r}")
        if name in self.jobs:
            raise ValueError(f"{self.service}: command {name!r} already declared as a job")
        self._free(name, self.commands, "command")  # type: ignore[arg-type]
        spec = CommandSpec(name, request, reply, doc, _codes(errors), motion)
        self.commands[name] = spec
        return spec

    def job(self, name: str, request: type[BaseModel], result: type[BaseModel], *, doc: str = "",
            errors: Iterable[ErrorCode | str] = (), motion: bool = False) -> JobSpec:
        """`motion=True`: refused while the bus stop is active, and cancelled by it while it runs. (A job moves
        for every request or none: the stop cancels the running motion jobs by their spec.)"""
        if not isinstance(motion, bool):
            raise ValueError(f"{self.service}: job {name!r}: motion must be True or False, not {motion!r}")
        if name in self.commands:
            raise ValueError(f"{self.service}: job {name!r} already declared as a command")
        self._free(name, self.jobs, "job")  # type: ignore[arg-type]
        spec = JobSpec(name, request, result, doc, _codes(errors), motion)
        self.jobs[name] = spec
        # Jobs bring the kit's job events and the cancel command with them.
        self.events.setdefault(JOB_PROGRESS.name, JOB_PROGRESS)
        self.events.setdefault(JOB_RESULT.name, JOB_RESULT)
        self.commands.setdefault(CANCEL.name, CANCEL)
        return spec

    def stream(
        self, name: str, model: type[BaseModel], direction: str, *, qos: int = 0, doc: str = ""
    ) -> StreamSpec:
        if direction not in ("in", "out"):
            raise ValueError("stream direction must be 'in' or 'out'")
        self._free(name, self.streams, "stream")  # type: ignore[arg-type]
        spec = StreamSpec(name, model, direction, qos, doc or (model.__doc__ or "").strip())
        self.streams[name] = spec
        return spec

    def kind(self, name: str, *, commands: Iterable[CommandSpec], jobs: Iterable[JobSpec] = (),
             doc: str = "") -> KindSpec:
        """A kind of device: the commands and jobs (declared on this API) each device of the kind answers. A
        service that declares kinds names one for each device it makes (`node.device(name, kind=...)`)."""
        self._free(name, self.kinds, "kind")  # type: ignore[arg-type]
        cmds = list(commands)
        job_list = list(jobs)
        for cmd in cmds:
            if self.commands.get(cmd.name) is not cmd:
                raise ValueError(f"{self.service}: kind {name!r}: command {cmd.name!r} is not declared on the API")
        for job in job_list:
            if self.jobs.get(job.name) is not job:
                raise ValueError(f"{self.service}: kind {name!r}: job {job.name!r} is not declared on the API")
        names = [c.name for c in cmds]
        if job_list and CANCEL.name not in names:
            names.append(CANCEL.name)  # jobs bring the cancel command (bound by Device.bind_job)
        if len(set(names)) != len(names) or len({j.name for j in job_list}) != len(job_list):
            raise ValueError(f"{self.service}: kind {name!r} names a command or job twice")
        kind = KindSpec(name, tuple(names), tuple(j.name for j in job_list), doc)
        self.kinds[name] = kind
        return kind

    def kind_of(self, name: str | None) -> KindSpec:
        """The kind a device is made with: one of the declared kinds by name, or (None) the API's one kind when it
        declares none, every command and job of the API."""
        if name is None:
            if self.kinds:
                raise ValueError(f"{self.service} declares kinds of device {sorted(self.kinds)}: "
                                 "name the device's kind (node.device(name, kind=...))")
            return KindSpec(DEFAULT_KIND, tuple(self.commands), tuple(self.jobs), self.device_doc)
        kind = self.kinds.get(name)
        if kind is None:
            raise ValueError(f"{self.service}: no kind of device {name!r} (declared: {sorted(self.kinds)})")
        return kind
