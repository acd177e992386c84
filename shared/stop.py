"""The bus-wide software stop: one latched, retained message per topic root that every motion device obeys.

It is a software stop: it never replaces a hardware emergency stop. docs/kit.md, "Stopping everything", is the
user's side; this module is the one piece of code every service's stop goes through.

    {root}/_stop                     StopState, retained, QoS 1: the site's stop, written by the operator role
                                     only (the ACL)
    {root}/_stop/fleet               StopState, retained, QoS 1: the fleet centre's stop of this site, written
                                     only by the site's bridge (the centre's {root}/_stop, remapped)
    {root}/{node}/_node/state/stop   StopAnswer, retained: each node's answer, per motion device

The two topics are two latches ("channels", `site` and `fleet`): a node keeps one state per channel, each with its
own stale-release guard and fail-safe parsing, and is stopped while ANY channel is active; the effective stop (what
health, the `stopped` errors and the stop actions use) is the active one, the newest if both are. A release lifts
only its own channel. So the centre's retained state, which the bridge brings down again on every reconnect, lands
on its own channel and never replaces a stop the site's operator set.

A node (`StopLatch`, made by shared/node.py) reads both topics with its other subscriptions. While the stop is
active, the kit refuses every motion command and job (`CommandSpec.motion`) with `stopped` before its handler runs,
cancels the running motion jobs, overlays each motion device's health (state `stopped`, source and reason), and
calls each motion device's stop action (`Device.on_stop`) at once: on a thread of its own (default), on the MQTT
network thread (`inline=True`: for actions that only enqueue), or, for an `async def` action, on the service's
loop. The action returns when the stop reached the device (a float, Unix time), None (it has: stamped when the
action returned) or `LATER` (the service calls `Device.stop_written(at)` when its deadman reports the write). A
motion command or job that was running when the stop came gets the device's stop action again when it returns,
so that a command racing the stop cannot leave the device moving. A release (`active: false`) removes the
overlay; nothing moves by itself: a device moves again only on a new command.

Start-up and reconnects: until the node knows the stop state, a motion command waits for it (at most
`ADMIT_WAIT_S`; an `inline` handler on the network thread cannot wait) and is then answered `unavailable` (not
`stopped`: no stop may exist, and `stopped` tells a client to wait for a release that may never come). The node
knows it once a message arrived on each channel, or once a message it sends itself after the broker acknowledged
its subscriptions (both stop topics among them) comes back: the broker queues a subscription's retained message
while it handles the SUBSCRIBE, before it reads the node's next packet, and delivers one connection's QoS 1
messages in order. The message goes to the node's own reply topic, `{root}/_client/<client id>/reply`, which every
client may use.

Fail safe: an unreadable message on either topic (not JSON, not a StopState) counts as an active stop of its
channel (counted as a decode error) until a valid one replaces it; an empty retained message (the stop removed
from the broker) counts as a release of its channel. A node that loses the broker stops its motion devices through
their deadmen, as before."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from pydantic import ValidationError

from shared.counters import Counters
from shared.errors import CommandError, ErrorCode
from shared.messages import StopAnswer, StopDeviceAnswer, StopState
from shared.mqtt.session import MqttSession, reply_properties
from shared.payloads import describe_validation_error

log = logging.getLogger("robobus.stop")

STOP = "_stop"
FLEET = "fleet"  # {root}/_stop/fleet: the fleet centre's stop, as the site's bridge brings it in
SITE_CHANNEL, FLEET_CHANNEL = "site", "fleet"
ANSWER_STATE = "stop"  # {root}/{node}/_node/state/stop
SYNC_PAYLOAD = b'{"ok":true,"result":{}}'  # a valid reply, as RpcClient's own settle message
# a motion command that comes before the stop state is known (a client that acts on a device's health before the
# node's birth) waits this long for it: the state is normally known within a round trip of the connect
ADMIT_WAIT_S = 2.0


def stop_topic(root: str) -> str:
    return f"{root}/{STOP}"


def fleet_stop_topic(root: str) -> str:
    return f"{root}/{STOP}/{FLEET}"


def answer_topic(root: str, node: str) -> str:
    return f"{root}/{node}/_node/state/{ANSWER_STATE}"


def read_stop(topic: str, payload: bytes) -> tuple[StopState | None, str]:
    """A message of a stop latch as every reader takes it (the nodes, `robobus status`): None when it is empty (a
    release of the retained state), the StopState, or, unreadable, an active stop of source `unknown` and why."""
    if not payload:
        return None, ""
    try:
        return StopState.model_validate_json(payload), ""
    except ValidationError as exc:
        why = describe_validation_error(exc)
        return StopState(active=True, source="unknown", ts=0.0,
                         reason=f"unreadable stop message on {topic} ({why[:200]}): held stopped until a valid "
                                "release"), why


class _Later:
    def __repr__(self) -> str:
        return "LATER"


LATER: Any = _Later()  # a stop action's return: the service reports the write later (Device.stop_written)

StopAction = Callable[[StopState], Any]


class MotionDevice(Protocol):
    """What the latch uses of a device (shared/device.py's Device)."""

    name: str
    stop_action: StopAction | None
    stop_inline: bool

    @property
    def motion(self) -> bool: ...

    def publish_health(self) -> None: ...

    def cancel_motion_jobs(self, why: str) -> None: ...


def describe(stop: StopState) -> str:
    return f"{stop.source}: {stop.reason}" if stop.reason else stop.source


class _Channel:
    """One stop latch of a node: the site's ({root}/_stop) or the fleet centre's ({root}/_stop/fleet)."""

    def __init__(self, name: str, topic: str, lift: str) -> None:
        self.name = name
        self.topic = topic
        self.lift = lift  # how an operator releases it (said in the `stopped` errors)
        self.state: StopState | None = None  # the latest valid message read on it (None: none on the broker)
        self.read = False  # a message arrived on it since the last (re)connect


class StopLatch:
    """One node's view of its root's stop: the gate of motion commands, the devices' stop actions, the answer."""

    def __init__(self, root: str, node: str, service: str, session: MqttSession,
                 devices: Callable[[], Iterable[MotionDevice]], counters: Counters,
                 get_loop: Callable[[], asyncio.AbstractEventLoop | None]) -> None:
        self.topic = stop_topic(root)
        self.fleet_topic = fleet_stop_topic(root)
        self.channels = {SITE_CHANNEL: _Channel(SITE_CHANNEL, self.topic, "robobus stop --release"),
                         FLEET_CHANNEL: _Channel(FLEET_CHANNEL, self.fleet_topic,
                                                 f"at the fleet's centre: robobus stop --root {root} --release")}
        self.answer_topic = answer_topic(root, node)
        self.node = node
        self.service = service
        self.session = session
        self.devices = devices
        self.counters = counters
        self.get_loop = get_loop
        self.known = False  # the stop state has been read since the last (re)connect
        self.generation = 0  # counts activations: a motion command admitted under an older one raced a stop
        self._last_active: StopState | None = None  # the effective stop of the latest activation
        self._last_read: _Channel | None = None  # the channel of the latest valid message (a release shows it)
        self._lock = threading.Lock()
        self._answer: StopAnswer | None = None
        self._entries: dict[str, StopDeviceAnswer] = {}
        self._sync_topic = f"{root}/_client/{session.client_id}/reply"
        self._sync_token = b""
        self._sync_no = 0
        self.known_event = threading.Event()  # set with `known` (tests and tools wait on it)
        self._when_known: list[Callable[[], None]] = []
        self._net_thread: int | None = None  # the network thread (seen on connect): it must never wait
        for ch in self.channels.values():  # both before the round trip that makes the state known (_on_connect)
            session.subscribe(ch.topic, functools.partial(self._on_stop, ch), qos=1)
        session.subscribe(self._sync_topic, self._on_sync, qos=1)
        session.on_connect(self._on_connect)
        session.on_disconnect(self._on_disconnect)

    def _effective(self) -> _Channel | None:
        """The channel that holds the node stopped (the newest active stop), else the one read last with a
        message (a release), else None."""
        active = [ch for ch in self.channels.values() if ch.state is not None and ch.state.active]
        if active:
            return max(active, key=lambda ch: ch.state.ts if ch.state is not None else 0.0)
        return self._last_read

    @property
    def state(self) -> StopState | None:
        """The effective stop: the active one (the newest if both channels are active), else the latest release
        read, else None (no stop message on the broker)."""
        ch = self._effective()
        return ch.state if ch is not None else None

    @property
    def channel(self) -> str:
        """The channel of `state` ("site" or "fleet"; "" with no stop message)."""
        ch = self._effective()
        return ch.name if ch is not None and ch.state is not None else ""

    @property
    def active(self) -> bool:
        return any(ch.state is not None and ch.state.active for ch in self.channels.values())

    def _refusal(self) -> CommandError | None:
        ch = self._effective()
        s = ch.state if ch is not None else None
        if ch is None or s is None or not s.active:
            return None
        which = "the bus stop" if ch.name == SITE_CHANNEL else f"the fleet's bus stop ({ch.topic})"
        return CommandError(ErrorCode.STOPPED, f"{which} is active ({describe(s)}): motion commands are refused "
                                               f"until it is released ({ch.lift})")

    # -- the gate (command threads) ------------------------------------------------------------
    def admit(self) -> int:
        """Before a motion command's handler (or a motion job's admit) runs: raise `stopped` while the stop is
        active, `unavailable` until the stop state is known; else the activation count to hand to `done`."""
        gen = self.generation  # read before the state: an activation sets the state first, then counts
        refused = self._refusal()
        if refused is not None:
            raise refused
        if not self.known and threading.get_ident() != self._net_thread:
            self.known_event.wait(ADMIT_WAIT_S)  # the stop message, when it comes, arrives on the network thread
            gen = self.generation
            refused = self._refusal()
            if refused is not None:
                raise refused
        if not self.known:
            raise CommandError(ErrorCode.UNAVAILABLE, f"the node has not read the bus stop ({self.topic} and "
                                                      f"{self.fleet_topic}) since it connected; try again")
        return gen

    def done(self, dev: MotionDevice, gen: int) -> None:
        """After a motion command or job admitted at `gen` returned: if a stop came meanwhile, whatever it sent
        after the stop action must not keep the device moving: the stop action runs again."""
        if self.generation == gen:
            return
        stop = self._last_active
        if stop is None:
            return
        log.warning("a motion command ran across the stop: stopping its device again",
                    extra={"device": dev.name})
        self._run_action(dev, stop, self.generation)

    # -- the stop message (network thread) -----------------------------------------------------
    def _parse(self, topic: str, payload: bytes) -> StopState | None:
        state, why = read_stop(topic, payload)
        if why:
            self.counters.decode_error()
            log.error("unreadable stop message: held as an active stop", extra={"topic": topic, "error": why})
        return state

    def when_known(self, fn: Callable[[], None]) -> None:
        """Call `fn` once the stop state is known (at once if it is): the node's birth waits for it, so that a
        client that sees the node online is never told `unavailable` for a motion command."""
        with self._lock:
            if not self.known:
                self._when_known.append(fn)
                return
        fn()

    def _fire_known(self) -> None:
        with self._lock:
            if not self.known or not self._when_known:
                return
            fns, self._when_known = self._when_known, []
        for fn in fns:
            try:
                fn()
            except Exception:
                log.exception("a callback waiting for the stop state failed")

    def _on_stop(self, ch: _Channel, msg: mqtt.MQTTMessage) -> None:
        try:
            self._on_stop_message(ch, msg)
        finally:
            self._fire_known()  # after the state (and an activation) is applied

    def _on_stop_message(self, ch: _Channel, msg: mqtt.MQTTMessage) -> None:
        new = self._parse(ch.topic, bytes(msg.payload))
        received = time.time()
        with self._lock:
            old = ch.state
            ch.read = True
            if all(c.read for c in self.channels.values()):
                self.known = True
                self.known_event.set()
            if new == old and self._answer is not None:
                return  # the same stop again (redelivered on reconnect): answered already
            if (old is not None and old.active and new is not None and not new.active and new.ts < old.ts):
                # a release older than the stop it would lift is stale (each channel has its own guard)
                self.counters.decode_error()
                log.warning("stale release ignored: older than the active stop",
                            extra={"channel": ch.name, "release_ts": new.ts, "stop_ts": old.ts,
                                   "source": new.source})
                return
            ch.state = new
            if new is not None:
                self._last_read = ch
            effective = self.state
            held = effective is not None and effective.active
            if new is not None and new.active:
                self._last_active = effective
                self.generation += 1
            gen = self.generation
        if new is not None and new.active and effective is not None:
            self._activate(ch, new, effective, gen, received)
        elif held and effective is not None:
            self._held(ch, new, effective, received)
        else:
            self._release(ch, new, received)

    def _activate(self, ch: _Channel, msg: StopState, stop: StopState, gen: int, received: float) -> None:
        """A stop on channel `ch` (message `msg`): every motion device's stop action runs with the effective stop
        (`stop`: `msg`, or the other channel's newer active stop), and the node answers `msg`."""
        devs = [d for d in self.devices() if d.motion]
        log.warning("bus stop active", extra={"channel": ch.name, "source": msg.source, "reason": msg.reason,
                                              "devices": [d.name for d in devs]})
        with self._lock:
            self._entries = {d.name: StopDeviceAnswer(device=d.name, stopped=True, pending=True) for d in devs}
            self._answer = StopAnswer(node=self.node, service=self.service, active=True, stop_ts=msg.ts,
                                      source=msg.source, reason=msg.reason, channel=ch.name, received_ts=received,
                                      devices=[], ts=received)
        for d in devs:  # the stop first, then what reports it
            self._run_action(d, stop, gen)
        for d in devs:
            d.cancel_motion_jobs(f"cancelled by the bus stop ({describe(stop)})")
            d.publish_health()
        self._publish_answer()

    def adopt(self, dev: MotionDevice) -> None:
        """A device that became a motion device (its stop action or a motion command bound) while the stop is
        active: made after the activation (a robot found later, a module added at run time), it is stopped now,
        and the answer lists it. Before the node knows the stop state, or with no stop, nothing to do."""
        with self._lock:
            stop = self._last_active
            if self.state is None or not self.state.active or stop is None or self._answer is None:
                return
            gen = self.generation
            self._entries[dev.name] = StopDeviceAnswer(device=dev.name, stopped=True, pending=True)
        log.warning("a motion device made during the bus stop: stopping it", extra={"device": dev.name})
        self._run_action(dev, stop, gen)
        self._publish_answer()

    def _held(self, ch: _Channel, stop: StopState | None, holder: StopState, received: float) -> None:
        """A release on channel `ch` while the other channel's stop is active: it lifts only its own channel. The
        devices stay stopped (their entries are the active stop's); the node answers the release with them."""
        other = next(c for c in self.channels.values() if c is not ch)
        log.warning("bus stop released on one channel: still stopped by the other",
                    extra={"channel": ch.name, "source": stop.source if stop else "", "held_by": other.name,
                           "holder": describe(holder)})
        with self._lock:
            self._answer = StopAnswer(
                node=self.node, service=self.service, active=False, stop_ts=stop.ts if stop else 0.0,
                source=stop.source if stop else "",
                reason=(stop.reason if stop else "the stop message was removed") + (
                    f" (still stopped by the {other.name} stop on {other.topic}: {describe(holder)})"),
                channel=ch.name, received_ts=received, devices=[], ts=received)
        for d in self.devices():
            if d.motion:
                d.publish_health()  # the overlay now names the stop that holds
        self._publish_answer()

    def _release(self, ch: _Channel, stop: StopState | None, received: float) -> None:
        devs = [d for d in self.devices() if d.motion]
        log.warning("bus stop released", extra={"channel": ch.name, "source": stop.source if stop else "",
                                                "devices": len(devs)})
        with self._lock:
            self._entries = {d.name: StopDeviceAnswer(device=d.name, stopped=False, pending=False) for d in devs}
            self._answer = StopAnswer(
                node=self.node, service=self.service, active=False, stop_ts=stop.ts if stop else 0.0,
                source=stop.source if stop else "", reason=stop.reason if stop else "the stop message was removed",
                channel=ch.name, received_ts=received, devices=[], ts=received)
        for d in devs:
            d.publish_health()
        self._publish_answer()

    # -- the devices' stop actions ---------------------------------------------------------------
    def _run_action(self, dev: MotionDevice, stop: StopState, gen: int) -> None:
        action = dev.stop_action
        if action is None:
            self.report(dev.name, gen, None, "the service gave this device no stop action (Device.on_stop): its "
                                             "motion commands are refused, but nothing was sent to it")
            return
        if inspect.iscoroutinefunction(action):
            loop = self.get_loop()
            if loop is None or not loop.is_running():
                self.report(dev.name, gen, None, "the stop action needs the service's event loop, which is not "
                                                 "running")
                return
            fut = asyncio.run_coroutine_threadsafe(action(stop), loop)

            def finished(f: Future[Any]) -> None:
                try:
                    self._finished(dev, gen, f.result(), None)
                except Exception as exc:
                    self._finished(dev, gen, None, exc)
            fut.add_done_callback(finished)
            return
        if dev.stop_inline:
            self._call(dev, action, stop, gen)
            return
        threading.Thread(target=self._call, args=(dev, action, stop, gen), name=f"stop-{dev.name}",
                         daemon=True).start()

    def _call(self, dev: MotionDevice, action: StopAction, stop: StopState, gen: int) -> None:
        try:
            out = action(stop)
        except Exception as exc:
            self._finished(dev, gen, None, exc)
            return
        self._finished(dev, gen, out, None)

    def _finished(self, dev: MotionDevice, gen: int, out: Any, exc: BaseException | None) -> None:
        if exc is not None:
            log.error("stop action failed", extra={"device": dev.name, "error": repr(exc)})
            self.report(dev.name, gen, None, f"{type(exc).__name__}: {exc}")
        elif out is LATER:
            return
        elif isinstance(out, (int, float)) and not isinstance(out, bool):
            self.report(dev.name, gen, float(out))
        else:
            self.report(dev.name, gen, time.time())

    def report(self, device: str, gen: int | None, written_ts: float | None, error: str = "") -> None:
        """A device's stop reached it at `written_ts` (or failed: `error`): update and republish the answer and
        the device's health. `gen` None: the current stop. A report for a stop that is over is dropped."""
        with self._lock:
            if gen is None:
                gen = self.generation
            entry = self._entries.get(device)
            if gen != self.generation or not self.active or entry is None:
                log.info("stop report for a stop that is over: dropped", extra={"device": device})
                return
            self._entries[device] = entry.model_copy(update={
                "pending": False, "written_ts": written_ts if written_ts is not None else entry.written_ts,
                "error": error or entry.error})
        self._publish_answer()
        for d in self.devices():
            if d.name == device:
                d.publish_health()

    def _publish_answer(self) -> None:
        with self._lock:  # one snapshot published at a time, in order: the retained answer is the latest
            if self._answer is None:
                return
            answer = self._answer.model_copy(update={"devices": [self._entries[k] for k in sorted(self._entries)],
                                                     "ts": time.time()})
            self.session.publish(self.answer_topic, answer.model_dump_json(), qos=1, retain=True)

    def answer(self) -> StopAnswer | None:
        with self._lock:
            if self._answer is None:
                return None
            return self._answer.model_copy(update={"devices": [self._entries[k] for k in sorted(self._entries)]})

    def overlay(self, device: str) -> dict[str, Any] | None:
        """The health fields a motion device shows while the stop is active (None: none)."""
        ch = self._effective()
        s = ch.state if ch is not None else None
        if ch is None or s is None or not s.active:
            return None
        entry = self._entries.get(device)
        detail: dict[str, Any] = {"source": s.source, "reason": s.reason, "ts": s.ts, "channel": ch.name}
        message = f"bus stop by {describe(s)}" if ch.name == SITE_CHANNEL else f"fleet bus stop by {describe(s)}"
        if entry is not None:
            detail.update(pending=entry.pending, written_ts=entry.written_ts, error=entry.error)
            if entry.error:
                message += f"; the stop action failed: {entry.error}"
        return {"state": "stopped", "operational": False, "error": False, "error_message": message,
                "stop": detail}

    # -- knowing the state after a (re)connect ---------------------------------------------------
    def _on_connect(self) -> None:
        """Network thread, once the broker acknowledged every subscription (both stop topics among them): a message
        to ourselves; when it is back, the retained stop, or its absence, has been delivered."""
        with self._lock:
            self._sync_no += 1
            self._sync_token = b"robobus-stop-sync-%d" % self._sync_no
            token = self._sync_token
        self.session.publish(self._sync_topic, SYNC_PAYLOAD, qos=1, properties=reply_properties(None, token))

    def _on_sync(self, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        with self._lock:
            if corr is None or bytes(corr) != self._sync_token or self.known:
                return
            self.known = True
            self.known_event.set()
        log.info("bus stop state read", extra={"topics": [self.topic, self.fleet_topic], "active": self.active})
        self._fire_known()

    def _on_disconnect(self) -> None:
        with self._lock:
            self._sync_token = b""
            # the channels' states stay (a node never forgets a stop by losing the broker; while one is active,
            # `admit` refuses `stopped` before it asks whether the state is known); what is known is read again
            for ch in self.channels.values():
                ch.read = False
            self.known = False
            self.known_event.clear()


# -- the client side: set or release the stop and gather the nodes' answers (`robobus stop`) ----------------------
class StopRound:
    """One stop or release sent, and what the online nodes answered."""

    def __init__(self, stop: StopState, online: dict[str, str]) -> None:
        self.stop = stop
        self.online = online  # node -> service, online when the stop was sent
        self.answers: dict[str, StopAnswer] = {}
        self.lock = threading.Lock()
        self.changed = threading.Event()

    def settled(self, node: str) -> bool:
        a = self.answers.get(node)
        return a is not None and not any(d.pending for d in a.devices)

    def silent(self) -> list[str]:
        """Online nodes with no answer, or with a device still pending."""
        with self.lock:
            return sorted(n for n in self.online if not self.settled(n))

    def failed(self) -> list[tuple[str, str, str]]:
        """(node, device, error) of every stop action that failed."""
        with self.lock:
            return [(n, d.device, d.error) for n, a in sorted(self.answers.items()) for d in a.devices if d.error]


def send_stop(client: Any, stop: StopState, timeout: float) -> StopRound:
    """Publish `stop` (retained, QoS 1) on `client`'s topic root (`client`: a connected shared.rpc.RpcClient) and
    wait up to `timeout` s until every node online then has answered it, each device settled."""
    root = client.root
    online: dict[str, str] = {}

    def on_status(msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(root) + 1:].split("/")
        if len(parts) != 2 or not msg.payload:
            return
        try:
            data = json.loads(msg.payload)
        except ValueError:
            return
        if isinstance(data, dict) and data.get("online") is True:
            online[parts[0]] = str(data.get("service", ""))

    status_filter = f"{root}/+/status"
    client.subscribe_before(status_filter, on_status)  # the retained statuses are in once this returns
    client.session.unsubscribe(status_filter)
    rnd = StopRound(stop, dict(online))

    def on_answer(msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(root) + 1:].split("/")
        if len(parts) != 4 or not msg.payload:
            return
        try:
            a = StopAnswer.model_validate_json(msg.payload)
        except ValidationError:
            return
        if a.stop_ts != stop.ts or a.active != stop.active or a.source != stop.source:
            return  # an answer to an earlier stop (retained)
        with rnd.lock:
            rnd.answers[parts[0]] = a
        rnd.changed.set()

    answer_filter = f"{root}/+/_node/state/{ANSWER_STATE}"
    client.subscribe_before(answer_filter, on_answer)
    try:
        if not client.session.publish_wait(stop_topic(root), stop.model_dump_json(), qos=1, retain=True,
                                           timeout=min(timeout, 10.0)):
            raise ConnectionError(f"the broker did not take the stop message on {stop_topic(root)}")
        end = time.monotonic() + timeout
        while rnd.silent():
            left = end - time.monotonic()
            if left <= 0:
                break
            rnd.changed.wait(min(left, 0.2))
            rnd.changed.clear()
    finally:
        client.session.unsubscribe(answer_filter)
    return rnd
