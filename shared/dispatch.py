"""Command dispatch: an MQTT request in, one validated reply out, at the request's QoS.

paho's network thread only routes: a request is handed to the command pool (waiting up to
`command_handoff_ms` for an idle worker to answer it, so that the handler has the GIL to itself; or, for handlers bound
`inline`, handled on the network thread itself; or, for `async def` handlers of a service with an event
loop, straight to that loop, where the handler runs anyway: no pool thread blocks on it and the request
makes one thread hop instead of three), validated straight from its bytes with `model_validate_json`,
run, and answered on its Response Topic (or `<topic>/reply`) with its Correlation Data. A motion command or job
passes the bus stop's gate (shared/stop.py) right before its handler runs; a command that moves for some requests
only (`motion=BY_REQUEST`) does when its device's `@moves_when` predicate says this request moves.

A command has an age: a request that carries a deadline (the `robobus-deadline` User Property, Unix ms, which
robobus clients set; else its Message Expiry Interval, counted from when it was read) is answered `expired` and
never run once that deadline passed, e.g. one that sat in a stalled node's socket. While its handler runs,
`request_deadline()` gives the deadline on the monotonic clock, so that a handler that hands the request on (a
demand to a realtime cycle) can make it expire there too."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import paho.mqtt.client as mqtt
from pydantic import BaseModel, ValidationError

from shared.counters import Counters
from shared.device import Device
from shared.errors import CommandError, ErrorCode
from shared.messages import JobAccepted
from shared.mqtt.session import DEADLINE_PROPERTY, MqttSession, PublishProperties
from shared.payloads import Serialized, describe_validation_error, dump, error_info
from shared.stop import StopLatch
from shared.workers import CommandPool

OK_PREFIX = b'{"ok":true,"result":'
_TOPICS_MAX = 4096  # parsed command topics kept (a node has a few dozen; garbage topics are not kept forever)
_MALFORMED = float("-inf")  # a deadline property that is not a whole number of milliseconds
_deadline: ContextVar[float | None] = ContextVar("robobus_request_deadline", default=None)


def request_deadline() -> float | None:
    """In a command handler: the `time.monotonic()` time after which the request being handled must not take
    effect (None: the client gave it no age). CLOCK_MONOTONIC is system-wide: another process may compare it."""
    return _deadline.get()


def deadline_of(props: Any, received: float) -> float | None:
    """A request's deadline on the monotonic clock, from its properties, read at `received` (monotonic)."""
    user = getattr(props, "UserProperty", None)
    if user:
        for name, value in user:
            if name == DEADLINE_PROPERTY:
                try:
                    ms = int(value)
                except ValueError:
                    return _MALFORMED
                return received + (ms / 1000.0 - time.time())
    expiry = getattr(props, "MessageExpiryInterval", None)
    if expiry is not None:  # what the broker says is left of it: whole seconds, from when it was read
        return received + float(expiry)
    return None


def check_age(deadline: float | None) -> None:
    """Refuse a request whose deadline passed (`expired`) or whose deadline property is unreadable."""
    if deadline is None:
        return
    if deadline == _MALFORMED:
        raise CommandError(ErrorCode.INVALID_REQUEST, f"the {DEADLINE_PROPERTY} user property must be a whole "
                                                      "number of milliseconds since the Unix epoch")
    late = time.monotonic() - deadline
    if late > 0:
        raise CommandError(ErrorCode.EXPIRED, f"the request expired {late * 1000:.0f} ms before the node could run "
                                              "it (its age: the robobus-deadline user property or Message Expiry "
                                              "Interval): not executed")


class Deferred(Exception):
    """Raised by an `inline` handler that cannot finish at once on the network thread (it must never block it
    long): `finish()` completes the command on the command pool and returns what the handler would have
    returned; its reply (or error) is published there, as for any pooled handler."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        super().__init__("deferred to the command pool")
        self.finish = finish


class CommandDispatcher:
    """Routes `{base}/{device}/cmd/{name}` requests to the devices' bound handlers and jobs."""

    def __init__(self, node_name: str, base: str, devices: Mapping[str, Device], session: MqttSession,
                 counters: Counters, run_coro: Callable[[Awaitable[Any], float | None], Any], workers: int,
                 get_loop: Callable[[], asyncio.AbstractEventLoop | None] | None = None,
                 handoff_s: float = 0.001, stop: StopLatch | None = None) -> None:
        self.node_name = node_name
        self.stop = stop
        self.handoff_s = handoff_s  # (workers.CommandPool.handoff)
        self.get_loop = get_loop
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
        self.devices = devices
        self.session = session
        self.counters = counters
        self.run_coro = run_coro
        self._prefix = len(base) + 1
        self._topics: dict[str, tuple[str, str]] = {}  # topic -> (device, command), parsed once
        self._pool = CommandPool(workers, "cmd")

    def shutdown(self) -> None:
        self._pool.shutdown()

    def on_message(self, msg: mqtt.MQTTMessage) -> None:
        """Network thread: copy what we need and hand over at once (or, inline, answer right here)."""
        if msg.retain:
            return  # a retained request is stale by definition; never act on it
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None)
        correlation = getattr(props, "CorrelationData", None)
        deadline = deadline_of(props, time.monotonic())
        # the reply goes at the request's QoS: a caller streaming at QoS 0 (setpoints superseded a few ms
        # later) chose no acknowledgements, a QoS 1 caller gets its reply at least once (QoS 2 -> 1)
        qos = 1 if msg.qos else 0
        topic = msg.topic
        route = self._topics.get(topic)
        if route is None:
            route = topic[self._prefix:].partition("/cmd/")[::2]
            if len(self._topics) >= _TOPICS_MAX:  # garbage topics must not grow it without bound
                self._topics = {}
            self._topics[topic] = route
        device_name, command = route
        dev = self.devices.get(device_name)
        if dev is not None and command in dev.inline:
            self.handle(topic, device_name, command, msg.payload, response_topic, correlation, qos, deadline)
            return
        entry = dev.commands.get(command) if dev is not None and command not in dev.jobs else None
        loop = self.get_loop() if self.get_loop is not None and entry is not None else None
        if entry is not None and loop is not None and inspect.iscoroutinefunction(entry[1]) and loop.is_running():
            args = (topic, device_name, command, msg.payload, response_topic, correlation, qos, deadline)
            try:
                loop.call_soon_threadsafe(self._start_async, args)
                return
            except RuntimeError:  # the loop closed meanwhile: the pool answers (unavailable)
                pass
        try:
            self._pool.handoff(self.handle, topic, device_name, command, msg.payload, response_topic,
                               correlation, qos, deadline, wait_s=self.handoff_s)
        except RuntimeError:  # pool shut down: we are stopping
            pass

    def handle(self, topic: str, device_name: str, command: str, payload: bytes | bytearray, response_topic: str | None,
               correlation: bytes | None, qos: int = 1, deadline: float | None = None) -> None:
        """Validate, run, answer; the reply is packed once and written by this thread (shared/mqtt/session.py)."""
        try:
            if deadline is None:
                body = OK_PREFIX + self.dispatch(device_name, command, payload) + b"}"
            else:
                check_age(deadline)
                token = _deadline.set(deadline)
                try:
                    body = OK_PREFIX + self.dispatch(device_name, command, payload) + b"}"
                finally:
                    _deadline.reset(token)
            self.counters.ok()
        except Deferred as d:
            args = (topic, device_name, command, d.finish, response_topic, correlation, qos)
            try:
                self._pool.submit(self._finish, *args)
            except RuntimeError:  # the pool is shut down (stopping): finish anyway, so the handler can clean up
                threading.Thread(target=self._finish, args=args, daemon=True).start()
            return
        except Exception as exc:
            body = self._failure(exc, device_name, command)
        self._answer(topic, response_topic, correlation, qos, body)

    def _finish(self, topic: str, device_name: str, command: str, finish: Callable[[], Any],
                response_topic: str | None, correlation: bytes | None, qos: int) -> None:
        """A `Deferred` inline handler's rest, on the pool: same result check, errors and reply as `handle`."""
        try:
            body = OK_PREFIX + _result(self.devices[device_name].commands[command][0].reply, finish()) + b"}"
            self.counters.ok()
        except Exception as exc:
            body = self._failure(exc, device_name, command)
        self._answer(topic, response_topic, correlation, qos, body)

    def _failure(self, exc: Exception, device_name: str, command: str) -> bytes:
        """A failed command's reply body (the error counted by its stable code)."""
        err = error_info(exc, f"{device_name}/{command}")
        self.counters.failed(err.code.value)
        return b'{"ok":false,"error":' + err.model_dump_json().encode() + b"}"

    def _answer(self, topic: str, response_topic: str | None, correlation: bytes | None, qos: int,
                body: bytes) -> None:
        """Publish a reply where the request asked (its Response Topic, else `<topic>/reply`), written now."""
        self.session.publish(response_topic or f"{topic}/reply", body, qos=qos,
                             properties=PublishProperties(None, correlation, "application/json"), now=True)

    def _start_async(self, args: tuple[Any, ...]) -> None:
        task = asyncio.ensure_future(self.handle_async(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def handle_async(self, topic: str, device_name: str, command: str, payload: bytes | bytearray,
                           response_topic: str | None, correlation: bytes | None, qos: int,
                           deadline: float | None = None) -> None:
        """`handle` for an `async def` handler, on the service's loop: same validation, errors and reply."""
        try:
            check_age(deadline)
            _deadline.set(deadline)  # this task's own context
            dev = self.devices[device_name]
            cspec, handler = dev.commands[command]
            req = _validate_request(cspec.request, payload)
            gen = self._admit() if cspec.motion and (cspec.motion is True or dev.moves_when[command](req)) else None
            try:
                out = await handler(req)
            finally:
                if gen is not None and self.stop is not None:
                    self.stop.done(dev, gen)
            body = OK_PREFIX + _result(cspec.reply, out) + b"}"
            self.counters.ok()
        except Exception as exc:
            body = self._failure(exc, device_name, command)
        self._answer(topic, response_topic, correlation, qos, body)

    def dispatch(self, device_name: str, command: str, payload: bytes | bytearray) -> bytes:
        """Validate and run one request; the reply's `result` as JSON bytes, or raise CommandError."""
        dev = self.devices.get(device_name)
        if dev is None:
            raise CommandError(ErrorCode.NOT_FOUND, f"no device {device_name!r} on node {self.node_name} "
                                                    f"(devices: {sorted(self.devices)})")
        entry = dev.commands.get(command)
        job = dev.jobs.get(command)
        if entry is None and job is None:
            known = sorted(set(dev.commands) | set(dev.jobs))
            raise CommandError(ErrorCode.NOT_FOUND, f"unknown command {command!r} (known: {known})")
        req_model = entry[0].request if entry else job[0].request  # type: ignore[index]
        req = _validate_request(req_model, payload)
        if job is not None:
            spec, run, admit = job
            gen = self._admit() if spec.motion else None
            if admit is not None:
                r = admit(req)
                if inspect.isawaitable(r):
                    self.run_coro(r, 30.0)
            return dump(JobAccepted, dev.start_job(spec, run, req, gen))
        cspec, handler = entry  # type: ignore[misc]
        # a plain command pays the one attribute read it always did; BY_REQUEST: the device's predicate says
        if cspec.motion and (cspec.motion is True or dev.moves_when[command](req)):
            return self._motion(dev, cspec.reply, handler, req)
        out = handler(req)
        if inspect.isawaitable(out):
            out = self.run_coro(out, None)
        return _result(cspec.reply, out)

    def _admit(self) -> int:
        """The bus stop's gate: `stopped` while it is active, `unavailable` until it is known."""
        if self.stop is None:
            return 0
        return self.stop.admit()

    def _motion(self, dev: Device, reply: type[BaseModel], handler: Callable[[Any], Any], req: BaseModel) -> bytes:
        """A motion command: through the gate, and if a stop came while it ran, the device's stop action again
        when it returns (for an inline handler's `Deferred`, when its rest returns)."""
        gen = self._admit()
        stop = self.stop
        try:
            out = handler(req)
            if inspect.isawaitable(out):
                out = self.run_coro(out, None)
        except Deferred as d:
            rest = d.finish

            def finish() -> Any:
                try:
                    return rest()
                finally:
                    if stop is not None:
                        stop.done(dev, gen)
            d.finish = finish
            raise
        except BaseException:
            if stop is not None:
                stop.done(dev, gen)
            raise
        if stop is not None:
            stop.done(dev, gen)
        return _result(reply, out)


def _result(model: type[BaseModel], out: Any) -> bytes:
    if type(out) is Serialized:  # already the reply model's bytes (shared/payloads.py)
        return out
    try:
        return dump(model, {} if out is None else out)
    except ValidationError as exc:
        raise CommandError(ErrorCode.INTERNAL,
                           f"reply failed its own schema: {describe_validation_error(exc)}") from None


def _validate_request(model: type[BaseModel], payload: bytes | bytearray) -> BaseModel:
    """One pass from bytes to model (`model_validate_json`); the clear messages of the old two-step path
    (not UTF-8, not JSON, not an object) are kept for the errors a person makes by hand."""
    if not payload.strip():
        payload = b"{}"
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        errors = exc.errors()
        kind = errors[0]["type"] if errors else ""
        if kind == "json_invalid":
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError as uexc:
                raise CommandError(ErrorCode.INVALID_REQUEST,
                                   f"payload is not UTF-8 text (byte {uexc.start})") from None
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"payload is not JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}"
                               ) from None
        if kind == "model_type":
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"payload must be a JSON object, got {_json_kind(payload)}") from None
        raise CommandError(ErrorCode.INVALID_REQUEST, describe_validation_error(exc)) from None


def _json_kind(payload: bytes | bytearray) -> str:
    c = bytes(payload.lstrip()[:1])
    return {b"[": "list", b'"': "str", b"t": "bool", b"f": "bool", b"n": "NoneType"}.get(c, "number")
