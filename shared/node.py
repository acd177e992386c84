"""A robobus node: one process, one transport, many devices, one MQTT session.

The node owns the bus side (EdgeX style: the SDK owns the bus, the driver owns the device): the session,
status birth and will, the devices (shared/device.py), command dispatch (shared/dispatch.py), jobs
(shared/jobs.py), rate-capped state (shared/ratecap.py), counters, and a clean, fail-safe shutdown.
`shared.lifecycle.run_service` builds and runs one; tests build nodes directly.

Threads: paho's network thread only routes messages; command handlers run on a pool, jobs on their own
threads, coroutine handlers on the service's asyncio loop; one housekeeping thread flushes rate-capped
state and sends heartbeats.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from types import FrameType
from typing import Any

from pydantic import ValidationError

from shared import __version__
from shared.contract import ServiceAPI, check_name
from shared.counters import Counters
from shared.device import HEALTH_FIELDS, Device
from shared.dispatch import CommandDispatcher
from shared.errors import CommandError, ErrorCode
from shared.jobs import JobCancelled, JobContext
from shared.messages import NodeStats, Status
from shared.mqtt.session import MqttSession, Will, unique_client_id
from shared.payloads import content_props, describe_validation_error, dump
from shared.ratecap import FlushSchedule, RateSlot
from shared.settings import KitSettings, hostname
from shared.stop import STOP_SUFFIX, StopLatch

log = logging.getLogger("robobus.node")

NODE_DEVICE = "_node"  # reserved device name for the node's own state (kit statistics)
BIRTH_WAIT_MAX_S = 2.0  # the birth waits for the bus stop's state at most this long after a (re)connect

__all__ = ["HEALTH_FIELDS", "NODE_DEVICE", "Device", "JobCancelled", "JobContext", "Node", "UnboundCommands",
           "describe_validation_error", "dump"]


class UnboundCommands(Exception):
    """A device leaves a command or job of its kind without a handler: the node does not start."""


class Node:
    """The process-wide bus side of a service. Build, add devices, bind handlers, then `run()`."""

    def __init__(self, api: ServiceAPI, settings: KitSettings, version: str | None = None) -> None:
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
        self.counters = Counters()
        self.flush_schedule = FlushSchedule()
        self._stopped = False
        will = Will(f"{self.base}/status", self._status(False, "connection lost").model_dump_json().encode())
        self.session = MqttSession(settings, unique_client_id(f"{api.service}-{self.name}"), will)
        self.session.on_connect(self._on_connected)
        # the bus stop (shared/stop.py): read on a connection of its own (never queued behind commands), before the
        # first motion command and before the birth
        self.stop_latch = StopLatch(settings.topic_root, self.name, api.service, settings,
                                    f"{self.session.client_id}{STOP_SUFFIX}", lambda: list(self.devices.values()),
                                    self.counters, lambda: self.loop)
        self.dispatcher = CommandDispatcher(self.name, self.base, self.devices, self.session, self.counters,
                                            self.run_coro, settings.command_workers, lambda: self.loop,
                                            handoff_s=settings.command_handoff_ms / 1000, stop=self.stop_latch)
        self.session.subscribe(f"{self.base}/+/cmd/+", self.dispatcher.on_message, qos=1)
        self._house = threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True)

    # -- building ------------------------------------------------------------------------------
    def device(self, name: str, kind: str | None = None) -> Device:
        """The device `name`, made on first use. `kind`: one of the API's kinds of device (ServiceAPI.kind), whose
        commands and jobs it answers; None for a service that declares none (every command and job)."""
        if name == NODE_DEVICE:
            raise ValueError(f"{NODE_DEVICE!r} is reserved")
        dev = self.devices.get(name)
        if dev is not None and kind is not None and dev.kind.name != kind:
            raise ValueError(f"device {name!r} is of kind {dev.kind.name!r}, not {kind!r}")
        if dev is None:
            dev = Device(self, name, self.api.kind_of(kind))
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
        self.counters.decode_error()
        log.debug("decode error", extra={"what": what})

    def check_bindings(self) -> None:
        """Every device answers every command and job of its kind, or the node refuses to start (UnboundCommands):
        a command declared and never bound would otherwise be found out by the first client to send it."""
        missing = []
        for dev in self.devices.values():
            cmds, jobs = dev.unbound()
            if cmds or jobs:
                what = ", ".join([*(f"command {c}" for c in cmds), *(f"job {j}" for j in jobs)])
                missing.append(f"device {dev.name!r} (kind {dev.kind.name!r}) has no handler for {what}")
        if missing:
            raise UnboundCommands(f"{self.api.service}: " + "; ".join(missing) + " (mark the handlers with "
                                  "@handles / @runs and bind them with Device.bind_all, or Device.bind / bind_job)")

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.check_bindings()  # before the session: no birth for a node that cannot answer its contract
        for dev in self.devices.values():
            if dev.motion and dev.stop_action is None:
                log.warning("motion device without a stop action (Device.on_stop): the bus stop refuses its motion "
                            "commands but sends it nothing", extra={"device": dev.name})
        self.stop_latch.start()  # first: the stop state is read on it before the birth
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
                        self.run_coro(r, 5.0)
                except Exception:
                    log.exception("shutdown hook failed")
        for dev in self.devices.values():
            dev.cancel_all_jobs()
        if self.session.connected.is_set():
            self.session.publish_wait(f"{self.base}/status",
                                      self._status(False, reason).model_dump_json(), qos=1, retain=True)
        self.session.stop()
        self.stop_latch.close()  # after the fail-safe hooks: a stop that comes meanwhile is still obeyed
        self.flush_schedule.wake.set()
        self.dispatcher.shutdown()
        log.info("stopped", extra={"node": self.name, "reason": reason})

    # -- status and stats ----------------------------------------------------------------------
    def _status(self, online: bool, reason: str | None = None) -> Status:
        return Status(online=online, node=self.name, service=self.api.service, version=self.version,
                      ts=time.time(), session=self._session_no, devices=sorted(self.devices), pid=os.getpid(),
                      host=hostname(), reason=reason)

    def _publish_status(self) -> None:
        self.session.publish(f"{self.base}/status", self._status(True).model_dump_json(), qos=1, retain=True)

    def _on_connected(self) -> None:
        self._session_no += 1
        session = self._session_no
        born = threading.Event()

        def birth() -> None:
            if session == self._session_no and not self._stopped and not born.is_set():
                born.set()
                self._publish_status()

        def birth_anyway() -> None:
            if not born.is_set() and session == self._session_no and self.session.connected.is_set():
                log.warning("the bus stop's state is not known yet: online anyway (motion commands are answered "
                            "unavailable until it is)", extra={"node": self.name})
                birth()

        # online once the bus stop's state is known (one round trip on the stop connection, sent after this
        # connect): a client that sees the node online may send a motion command at once; a broker that never lets
        # the node know still sees it online, later
        self.stop_latch.main_connected()
        self.stop_latch.when_known(birth)
        timer = threading.Timer(BIRTH_WAIT_MAX_S, birth_anyway)
        timer.daemon = True
        timer.start()
        for dev in list(self.devices.values()):
            dev.publish_health()
            for slot in list(dev.slots.values()):  # a restarted broker may have lost retained values
                if slot.retain and slot.last_payload is not None:
                    self.session.publish(slot.topic, slot.last_payload, qos=slot.qos, retain=True,
                                         properties=content_props(slot.content_type or "application/json"))

    def stats(self) -> NodeStats:
        c = self.counters
        return NodeStats(commands_ok=c.commands_ok, commands_failed=c.failed_by_code(),
                         jobs_running=sum(len(d.running) for d in self.devices.values()),
                         published=c.published, publish_dropped=self.session.dropped,
                         decode_errors=c.decode_errors, reconnects=self.session.reconnects,
                         uptime_s=round(time.monotonic() - self._started_at, 3),
                         stop_path_lags=self.stop_latch.path.lags, stop_path_rtt_ms=self.stop_latch.path.rtt_ms,
                         ts=time.time())

    # -- publishing ----------------------------------------------------------------------------
    def publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
                content_type: str | None = "application/json") -> None:
        props = content_props(content_type) if content_type else None
        if self.session.publish(topic, payload, qos=qos, retain=retain, properties=props):
            self.counters.sent()

    def send_slot(self, slot: RateSlot, value: Any) -> None:
        try:
            payload = slot.encode(value)
        except (ValidationError, TypeError) as exc:
            log.error("state value rejected by its model", extra={"topic": slot.topic, "error": str(exc)})
            return
        slot.last_payload = payload if slot.retain else None
        self.publish(slot.topic, payload, qos=slot.qos, retain=slot.retain, content_type=slot.content_type)

    def _housekeeping(self) -> None:
        next_beat = time.monotonic() + self.settings.health_interval_s
        while not self._stopped:
            wait = self.flush_schedule.flush(self.send_slot)
            wait = min(wait, self.stop_latch.tick())  # the stop path's round trip, and its lag
            for dev in list(self.devices.values()):  # supervised links: silent / unreachable when due
                if dev.link is not None:
                    due = dev.link.tick()
                    if due is not None:
                        wait = min(wait, due + 0.001)
            t = time.monotonic()
            if t >= next_beat:
                next_beat = t + self.settings.health_interval_s
                if self.session.connected.is_set():
                    for dev in list(self.devices.values()):
                        dev.publish_health()
                    self.publish(f"{self.base}/{NODE_DEVICE}/state/stats",
                                  self.stats().model_dump_json().encode(), qos=0, retain=True)
            self.flush_schedule.wake.wait(min(wait, max(next_beat - t, 0.0005)))
            self.flush_schedule.wake.clear()

    def run_coro(self, aw: Awaitable[Any], timeout: float | None) -> Any:
        """Run a coroutine on the service's loop from another thread (coroutine handlers, async hooks)."""
        if self.loop is None or not self.loop.is_running():
            raise CommandError(ErrorCode.UNAVAILABLE, "the service's event loop is not running")
        fut = asyncio.run_coroutine_threadsafe(_as_coro(aw), self.loop)
        return fut.result(timeout)


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw
