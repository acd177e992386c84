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

A node (`StopLatch`, made by shared/node.py) reads both topics on a connection of its own (client id `<node's
client id>-stop`, its own paho network thread), subscribed to them and to its own reply topic only: a stop never
waits behind commands in the broker's queue for the node's main connection, in that connection's socket, or behind
their processing. The node's answer and the inline stop actions go on that connection too. While the stop is
active, the kit refuses every motion command and job (`CommandSpec.motion`) with `stopped` before its handler runs,
cancels the running motion jobs, overlays each motion device's health (state `stopped`, source and reason), and
calls each motion device's stop action (`Device.on_stop`) at once: on a thread of its own (default), on the MQTT
network thread (`inline=True`: for actions that only enqueue), or, for an `async def` action, on the service's
loop. The action returns when the stop reached the device (a float, Unix time), None (it has: stamped when the
action returned) or `LATER` (the service calls `Device.stop_written(at)` when its deadman reports the write; a
later successful write clears an earlier failure). A
motion command or job that was running when the stop came gets the device's stop action again when it returns,
so that a command racing the stop cannot leave the device moving. A release (`active: false`) removes the
overlay; nothing moves by itself: a device moves again only on a new command.

Start-up and reconnects: until the node knows the stop state, a motion command waits for it (at most
`ADMIT_WAIT_S`; an `inline` handler on the network thread cannot wait) and is then answered `unavailable` (not
`stopped`: no stop may exist, and `stopped` tells a client to wait for a release that may never come). The node
knows it once a message it sends itself on the stop connection after the broker acknowledged its subscriptions
(both stop topics among them) comes back: the broker queues a subscription's retained message while it handles
the SUBSCRIBE, before it reads the node's next packet, and delivers one connection's QoS 1 messages in order. The
message goes to the stop connection's own reply topic, `{root}/_client/<client id>-stop/reply`, which every client
may use. Across the two connections: after each (re)connect of the main connection (commands), the state is known
again only once such a round trip, sent after that connect, came back on the stop connection (a stop connection
that went stale while the main one reconnected is found so before a command is admitted); a reconnect of the stop
connection alone makes the state unknown until its own round trip, the main connection's state untouched.

The stop path checks itself: a round trip on its reply topic every `PROBE_EVERY_S`; a path that is disconnected, or
whose round trip takes longer than `LAG_S` (or has not come back after `LAG_S`), lags, and every motion device's
health says so (`details.stop_path`, a note in `error_message`; `error` is not touched: it is not the device's
fault). A lagging path is good again only after its round trips stayed within the bound for `RECOVER_S` (no
flapping). Counted in the node's stats (`stop_path_lags`).

A broker that restarts without the retained stop (no persistence, killed before its autosave) does not release a
node: the absence of a message is not a release. A node that holds an active stop and finds its latch's topic empty
after a reconnect keeps holding it and says so (`broker_lost` in its answer and in `details.stop` of the health)
until a message arrives on that latch.

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
import os
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
from shared.mqtt.address import ClientSettings
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
# the stop path's own check (StopPath): a round trip every PROBE_EVERY_S; one longer than LAG_S (or not back after
# LAG_S) makes the path lag; it is good again once its round trips stayed within LAG_S for RECOVER_S
PROBE_EVERY_S = 1.0
LAG_S = 0.5
RECOVER_S = 3.0
START_GRACE_S = 2.0  # a stop connection not made within this long of the start lags
STOP_SUFFIX = "-stop"  # the stop connection's client id: the node's main client id and this


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
    stop_note: str

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


class StopPath:
    """The stop connection's health: connected, its latest round trip, and whether it lags (the rule in the
    module's docstring). Pure: times (monotonic seconds) are passed in; every method says whether the verdict
    (`lagging`) changed."""

    def __init__(self, now: float) -> None:
        self.started = now
        self.connected = False
        self.ever_connected = False
        self.rtt_ms: float | None = None  # the latest round trip
        self.last_good: float | None = None  # when the latest round trip within LAG_S came back
        self.lagging = False
        self.why = ""  # why it lags (or lagged last)
        self.good_since: float | None = None  # start of the run of good round trips that may end a lag
        self.lags = 0  # times it started lagging

    def _lag(self, why: str) -> bool:
        self.why = why
        self.good_since = None
        if self.lagging:
            return False
        self.lagging = True
        self.lags += 1
        return True

    def up(self, now: float) -> bool:
        self.connected = self.ever_connected = True
        return False  # good again only by its round trips

    def down(self, now: float) -> bool:
        self.connected = False
        return self._lag("the stop connection is down")

    def returned(self, rtt_s: float, now: float) -> bool:
        self.rtt_ms = round(rtt_s * 1000, 3)
        if rtt_s > LAG_S:
            return self._lag(f"a round trip took {rtt_s * 1000:.0f} ms (bound {LAG_S * 1000:.0f} ms)")
        self.last_good = now
        if not self.lagging:
            return False
        if self.good_since is None:
            self.good_since = now
        if self.connected and now - self.good_since >= RECOVER_S:
            self.lagging = False
            self.good_since = None
            return True
        return False

    def check(self, now: float, oldest_sent: float | None) -> bool:
        """A round trip out longer than LAG_S, or no connection since the start's grace: it lags."""
        if oldest_sent is not None and now - oldest_sent > LAG_S:
            return self._lag(f"no round trip back for {(now - oldest_sent) * 1000:.0f} ms "
                             f"(bound {LAG_S * 1000:.0f} ms)")
        if not self.ever_connected and now - self.started > START_GRACE_S:
            return self._lag("the stop connection is not made")
        return False

    def details(self, now: float) -> dict[str, Any]:
        return {"ok": not self.lagging, "connected": self.connected, "rtt_ms": self.rtt_ms,
                "last_good_age_s": None if self.last_good is None else round(now - self.last_good, 3),
                "lags": self.lags, **({"why": self.why} if self.lagging else {})}

    def message(self, now: float) -> str:
        """The note a motion device's error_message carries while the path lags ("" while it does not)."""
        if not self.lagging:
            return ""
        age = "never" if self.last_good is None else f"{now - self.last_good:.1f} s ago"
        return f"the bus stop's path lags ({self.why}; last good round trip {age}): a stop may reach it late"


def lift_this_thread() -> int | None:
    """Put the calling thread one SCHED_FIFO priority above the one it runs at, when it runs at one (the node was
    started at a realtime priority: `make run`, compose's hand profile). The stop connection's network thread, and
    the stop actions it starts (threads inherit it), then preempt the node's own command threads: after a stall of
    the broker or the node, the backlog of commands that reaches the node at once never holds a core the stop
    needs. At an ordinary priority nothing changes (a thread cannot be put above its peers without realtime
    rights). Returns the new priority, or None; raises OSError where the lift is refused (no CAP_SYS_NICE and an
    RLIMIT_RTPRIO at the node's own priority)."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    if os.sched_getscheduler(0) != os.SCHED_FIFO:  # pid 0: the calling thread (Linux)
        return None
    priority = min(os.sched_getparam(0).sched_priority + 1, os.sched_get_priority_max(os.SCHED_FIFO))
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    return priority


class StopLatch:
    """One node's view of its root's stop: the gate of motion commands, the devices' stop actions, the answer.
    It reads the stop on its own connection (`session`), made from `settings` with client id `client_id`."""

    def __init__(self, root: str, node: str, service: str, settings: ClientSettings, client_id: str,
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
        # the stop's own connection: no will (the main connection's says the node died), no other subscription
        self.session = MqttSession(settings, client_id)
        self.devices = devices
        self.counters = counters
        self.get_loop = get_loop
        self.generation = 0  # counts activations: a motion command admitted under an older one raced a stop
        self._last_active: StopState | None = None  # the effective stop of the latest activation
        self._last_read: _Channel | None = None  # the channel of the latest valid message (a release shows it)
        self._lock = threading.Lock()
        self._answer: StopAnswer | None = None
        self._entries: dict[str, StopDeviceAnswer] = {}
        self._sync_topic = f"{root}/_client/{self.session.client_id}/reply"
        # the round trips on the stop connection: token -> (sent, monotonic; the main connection's count then;
        # periodic, at QoS 0)
        self._probes: dict[bytes, tuple[float, int, bool]] = {}
        self._probe_no = 0
        self._periodic: bytes | None = None  # the periodic round trip out, if any
        self._next_probe = 0.0
        self._conn_no = 0  # the stop connection's (re)connects: a round trip's token names its connection
        self._ready = False  # the stop connection is up and its subscriptions acknowledged
        self._read = False  # the stop state has been read on the stop connection since its last (re)connect
        self._main_epoch = 0  # the main connection's (re)connects (`main_connected`)
        self._synced_epoch = 0  # the main connection's count when the latest round trip back was sent
        self._closing = False
        self._lost: set[str] = set()  # channels active here whose topic the broker had empty after a reconnect
        self.path = StopPath(time.monotonic())
        self.known_event = threading.Event()  # set with `known` (tests and tools wait on it)
        self._when_known: list[Callable[[], None]] = []
        self._no_wait: set[int] = set()  # the two network threads (seen on connect): they must never wait
        self.thread_priority: int | None = None  # the stop connection's thread's SCHED_FIFO priority, if lifted
        self._lift_refused = False
        for ch in self.channels.values():  # both before the round trip that makes the state known (_on_connect)
            self.session.subscribe(ch.topic, functools.partial(self._on_stop, ch), qos=1)
        self.session.subscribe(self._sync_topic, self._on_sync, qos=1)
        self.session.on_connect(self._on_connect)
        self.session.on_disconnect(self._on_disconnect)

    # -- the stop connection's life (shared/node.py: start with the node, close after its fail-safe hooks) -----------
    def start(self) -> None:
        self.path = StopPath(time.monotonic())
        self.session.start()

    def close(self) -> None:
        self._closing = True
        self.session.stop()

    @property
    def known(self) -> bool:
        """The stop state has been read on the stop connection, by a round trip sent after the main connection's
        latest (re)connect (so the main connection's subscriptions, the commands', are made too): a motion command
        received on it may be judged."""
        return self._read and self._main_epoch > 0 and self._synced_epoch >= self._main_epoch

    def main_connected(self) -> None:
        """The main connection (re)connected (its network thread, before the birth): the state is known again once
        a round trip sent on the stop connection from now on is back, so that a stop connection that went stale
        meanwhile is found out before a command received on the new connection is admitted."""
        with self._lock:
            self._no_wait.add(threading.get_ident())
            self._main_epoch += 1
            self.known_event.clear()
        self._probe()

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
        if not self.known and threading.get_ident() not in self._no_wait:
            # the stop message and the round trip come on the stop connection's network thread; the state may be
            # known and unknown again meanwhile (the main connection's connect asks for a fresh round trip)
            end = time.monotonic() + ADMIT_WAIT_S
            while not self.known and (left := end - time.monotonic()) > 0:
                self.known_event.wait(left)
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
                self._read = True
                if self.known:
                    self.known_event.set()
            stale = (old is not None and old.active and new is not None and not new.active and new.ts < old.ts)
            # the broker holds this latch's stop again (set again, or replaced by a valid message): not lost; a
            # stale release leaves it lost (the broker still does not have the stop the node holds)
            was_lost = ch.name in self._lost and not stale
            if was_lost:
                self._lost.discard(ch.name)
            same = new == old and self._answer is not None
        if same:
            if was_lost:  # the operator set the lost stop again: the answer no longer says it is lost
                self._changed_lost()
            return  # the same stop again (redelivered on reconnect): answered already
        if stale:
            # a release older than the stop it would lift is stale (each channel has its own guard)
            self.counters.decode_error()
            log.warning("stale release ignored: older than the active stop",
                        extra={"channel": ch.name, "release_ts": new.ts if new else 0.0,
                               "stop_ts": old.ts if old else 0.0, "source": new.source if new else ""})
            return
        with self._lock:
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
        with self._lock:
            self._entries = {d.name: StopDeviceAnswer(device=d.name, stopped=True, pending=True) for d in devs}
            self._answer = StopAnswer(node=self.node, service=self.service, active=True, stop_ts=msg.ts,
                                      source=msg.source, reason=msg.reason, channel=ch.name, received_ts=received,
                                      devices=[], ts=received)
        for d in devs:  # the stop first, then what reports it (the log line too)
            self._run_action(d, stop, gen)
        log.warning("bus stop active", extra={"channel": ch.name, "source": msg.source, "reason": msg.reason,
                                              "devices": [d.name for d in devs]})
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
        the device's health. The latest report says whether the latest attempt failed: a write after a failed
        attempt clears its error (the device did stop); a failure keeps the time of an earlier write. `gen` None:
        the current stop. A report for a stop that is over is dropped."""
        with self._lock:
            if gen is None:
                gen = self.generation
            entry = self._entries.get(device)
            if gen != self.generation or not self.active or entry is None:
                log.info("stop report for a stop that is over: dropped", extra={"device": device})
                return
            self._entries[device] = entry.model_copy(update={
                "pending": False, "written_ts": written_ts if written_ts is not None else entry.written_ts,
                "error": error})
        self._publish_answer()
        for d in self.devices():
            if d.name == device:
                d.publish_health()

    def _publish_answer(self) -> None:
        with self._lock:  # one snapshot published at a time, in order: the retained answer is the latest
            if self._answer is None:
                return
            answer = self._answer.model_copy(update={"devices": self._devices_answered(),
                                                     "broker_lost": bool(self._broker_lost()),
                                                     "ts": time.time()})
            self.session.publish(self.answer_topic, answer.model_dump_json(), qos=1, retain=True)

    def _devices_answered(self) -> list[StopDeviceAnswer]:
        """The devices' entries, each with its device's note while the stop holds it (under the latch's lock)."""
        notes = {d.name: d.stop_note for d in self.devices() if getattr(d, "stop_note", "")} if self.active else {}
        return [e.model_copy(update={"note": notes[k]}) if k in notes else e
                for k, e in sorted(self._entries.items())]

    def note_changed(self, device: str) -> None:
        """A device's `stop_note` changed (a pending stop's reason, or its end): the answer says it again."""
        if device in self._entries:
            self._publish_answer()

    def answer(self) -> StopAnswer | None:
        with self._lock:
            if self._answer is None:
                return None
            return self._answer.model_copy(update={"devices": self._devices_answered(),
                                                   "broker_lost": bool(self._broker_lost())})

    def _broker_lost(self) -> list[str]:
        """The topics of the active latches the broker had empty after a reconnect (lock held)."""
        return [ch.topic for ch in self.channels.values()
                if ch.name in self._lost and ch.state is not None and ch.state.active]

    def _changed_lost(self) -> None:
        """What says whether the broker lost the stop changed: the answer and the health again."""
        self._publish_answer()
        for d in self.devices():
            if d.motion:
                d.publish_health()

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
        lost = self._broker_lost()
        detail["broker_lost"] = bool(lost)
        if lost:
            message += (f"; the broker lost the retained stop ({', '.join(lost)} empty after it came back): held "
                        "here, set it again (or release it)")
        return {"state": "stopped", "operational": False, "error": False, "error_message": message,
                "stop": detail}

    def dress(self, device: str, h: dict[str, Any], note: str = "") -> None:
        """A motion device's health fields `h` (as Device.health_message builds them), in place: the stop's overlay
        while it is active (`note`: what the stop cannot do on the device), and the stop path's state
        (`details.stop_path`; a note in `error_message` while it lags, `error` untouched)."""
        stopped = self.overlay(device)
        if stopped is not None:  # the bus stop: what the device does now, over what its link says
            detail = stopped.pop("stop")
            if note:
                stopped["error_message"] += f"; {note}"
            h.update(stopped)
            h["details"] = {**h.get("details", {}), "stop": detail}
        now = time.monotonic()
        path = self.path.details(now)
        if self.thread_priority is not None:
            path["priority"] = self.thread_priority  # the stop thread's SCHED_FIFO priority (lift_this_thread)
        h["details"] = {**h.get("details", {}), "stop_path": path}
        lag = self.path.message(now)
        if lag:
            h["error_message"] = f"{h['error_message']}; {lag}" if h.get("error_message") else lag

    # -- knowing the state after a (re)connect, and the stop path's own check -----------------------------------
    def _probe(self, periodic: bool = False) -> None:
        """A message to ourselves on the stop connection: when it is back, every retained stop (or its absence) sent
        before it has been delivered, and its time is the path's round trip. Sent only while the connection is up
        with its subscriptions acknowledged (a token kept across a disconnect could prove nothing)."""
        with self._lock:
            if not self._ready or self._closing:
                return
            self._probe_no += 1
            token = b"robobus-stop-sync-%d-%d" % (self._conn_no, self._probe_no)
            now = time.monotonic()
            self._probes[token] = (now, self._main_epoch, periodic)
            if periodic:
                self._periodic = token
                self._next_probe = now + PROBE_EVERY_S
        on_net = threading.get_ident() in self._no_wait
        # the periodic check at QoS 0 (half the packets: no acknowledgements): it proves the path, not the order
        # of delivery, which only the round trips that make the state known rely on
        self.session.publish(self._sync_topic, SYNC_PAYLOAD, qos=0 if periodic else 1,
                             properties=reply_properties(None, token), now=not on_net)

    def _on_connect(self) -> None:
        """Stop connection's network thread, once the broker acknowledged every subscription (both stop topics
        among them): the round trip that makes the state known."""
        with self._lock:
            self._lift()
            self._no_wait.add(threading.get_ident())
            self._conn_no += 1
            self._probes.clear()
            self._periodic = None
            self._ready = True
            self.path.up(time.monotonic())
        self._probe()

    def _lift(self) -> None:
        """The stop connection's thread one priority above the node's (`lift_this_thread`), once it can be."""
        if self.thread_priority is not None or self._lift_refused:
            return
        try:
            self.thread_priority = lift_this_thread()
        except OSError as exc:
            self._lift_refused = True
            log.warning("the stop connection's thread stays at the node's priority: %s", exc)

    def _on_sync(self, msg: mqtt.MQTTMessage) -> None:
        self._lift()  # again on every round trip: the process may be put at a realtime priority after the connect
        corr = getattr(msg.properties, "CorrelationData", None)
        now = time.monotonic()
        token = bytes(corr) if corr is not None else b""
        with self._lock:
            sent = self._probes.pop(token, None)
            if sent is None:
                return  # not ours, or sent on a connection that is gone
            if self._periodic == token:
                self._periodic = None
            sent_at, epoch, periodic = sent
            was_known, first = self.known, not self._read and not periodic
            self._read = self._read or not periodic  # QoS 0 proves the path, not the order of delivery
            self._synced_epoch = max(self._synced_epoch, epoch)
            lost = set()
            if first:  # the broker delivered what it holds: an active latch with nothing retained was lost by it
                lost = {ch.name for ch in self.channels.values()
                        if not ch.read and ch.state is not None and ch.state.active}
                self._lost |= lost
            known = self.known
            if known:
                self.known_event.set()
            changed = self.path.returned(now - sent_at, now)
        if known and not was_known:
            log.info("bus stop state read", extra={"topics": [self.topic, self.fleet_topic], "active": self.active})
        if lost:
            log.warning("the broker lost the retained stop: still held here (set it again, or release it)",
                        extra={"channels": sorted(lost)})
            self._changed_lost()
        if changed:
            self._path_changed()
        self._fire_known()

    def _on_disconnect(self) -> None:
        with self._lock:
            self._ready = False
            self._probes.clear()
            self._periodic = None
            # the channels' states stay (a node never forgets a stop by losing the broker; while one is active,
            # `admit` refuses `stopped` before it asks whether the state is known); what is known is read again
            for ch in self.channels.values():
                ch.read = False
            self._read = False
            self.known_event.clear()
            changed = not self._closing and self.path.down(time.monotonic())
        if changed:
            self._path_changed()

    def tick(self) -> float:
        """The node's housekeeping: the periodic round trip when due, and the lag of one that is out. Returns the
        seconds until the next call is due."""
        now = time.monotonic()
        with self._lock:
            out = self._probes.get(self._periodic) if self._periodic is not None else None
            if out is not None and now - out[0] > 2 * PROBE_EVERY_S:
                # a QoS 0 round trip may be lost (the broker drops QoS 0 for a client whose queue is full): the lag
                # says so meanwhile; a new one goes
                self._probes.pop(self._periodic or b"", None)
                self._periodic = None
            due = self._ready and self._periodic is None and now >= self._next_probe
            if due:
                self._next_probe = now + PROBE_EVERY_S  # also if it cannot go (closing): no busy loop
            oldest = min((t for t, _, _ in self._probes.values()), default=None)
            changed = not self._closing and self.path.check(now, oldest)
        if due:
            self._probe(periodic=True)
        if changed:
            self._path_changed()
        with self._lock:
            # the next periodic round trip (while connected and none is out), else a look a period later (the
            # start's grace, a lost one); and the moment the one out would lag
            waits = [self._next_probe - now if self._ready and self._periodic is None else PROBE_EVERY_S]
            oldest = min((t for t, _, _ in self._probes.values()), default=None)
            if oldest is not None and not self.path.lagging:
                waits.append(oldest + LAG_S - now)
        return max(min(waits), 0.01)

    def _path_changed(self) -> None:
        now = time.monotonic()
        if self.path.lagging:
            log.warning("the bus stop's path lags", extra={"why": self.path.why, **self.path.details(now)})
        else:
            log.info("the bus stop's path is good again", extra=self.path.details(now))
        for d in self.devices():
            if d.motion:
                d.publish_health()


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
