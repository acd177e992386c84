"""Client side of the contract: call commands, follow jobs, read retained status and health.

Used by the CLI, the tests, the benchmarks and by services that talk to another node
(can-bootloader leasing ethercat-loop's CAN bridge)."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import paho.mqtt.client as mqtt
from pydantic import Field, field_validator

from shared.mqtt.failover import parse_brokers
from shared.mqtt.session import MqttSession, command_properties, reply_properties, unique_client_id
from shared.settings import KitSettings


class FailoverSettings(KitSettings):
    """A client of a clustered centre (the `robobus` CLI, the dashboard, fleet-watch, fleet-gate): its nodes in
    ROBOBUS_FLEET_BROKERS, each reached with ROBOBUS_MQTT_URL's scheme, user and TLS."""

    fleet_brokers: str = Field("", description="A clustered centre's nodes, 'HOST:PORT,HOST:PORT,...': connect to "
                                               "the first and, when its node fails, to the next in turn (as a "
                                               "site's bridge, round_robin); empty: ROBOBUS_MQTT_URL's broker")

    @field_validator("fleet_brokers")
    @classmethod
    def _brokers(cls, v: str) -> str:
        parse_brokers(v)
        return v

    def brokers(self) -> list[tuple[str, int]]:
        """Where to connect, in order: ROBOBUS_FLEET_BROKERS' nodes, else ROBOBUS_MQTT_URL's broker."""
        b = self.broker()
        return parse_brokers(self.fleet_brokers) or [(b.host, b.port)]


class RpcError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Reply:
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    raw: bytes = b""

    def unwrap(self) -> dict[str, Any]:
        if not self.ok:
            err = self.error or {}
            raise RpcError(str(err.get("code", "internal")), str(err.get("message", "")))
        return self.result


_HANDOFF_S = 0.001  # how long the network thread waits for the woken caller to run again (see _Waiter.put)


class _Waiter:
    """One call's rendezvous: a lock the caller blocks on until the network thread drops the reply in
    (cheaper than a Queue or an Event per call: no Condition, one acquire each side), and a second one the
    caller releases once it runs again."""

    __slots__ = ("lock", "reply", "running")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.running = threading.Lock()
        self.running.acquire()
        self.reply: Reply | None = None

    def put(self, rep: Reply) -> None:
        """Network thread. After waking the caller it waits (briefly) until the caller runs: going on at once to
        its PUBACK and loop, it would hold the GIL when the caller wakes, and the caller would sleep again until
        the GIL is dropped (a second wake-up on the round trip's path, bench/rpc_stages.py)."""
        if self.reply is None:  # a duplicate (QoS 1 redelivery) changes nothing
            self.reply = rep
            self.lock.release()
            self.running.acquire(timeout=_HANDOFF_S)

    def get(self, timeout: float) -> Reply | None:
        if not self.lock.acquire(timeout=timeout):
            return None
        self.running.release()
        return self.reply


class RpcClient:
    """A connected MQTT client that can call `{root}/{node}/{device}/cmd/{name}`. With FailoverSettings it
    connects to the first of its brokers that answers and, on a drop, to the next in turn."""

    def __init__(self, settings: KitSettings | None = None, name: str = "robobus-client") -> None:
        self.settings = settings or KitSettings()
        self.root = self.settings.topic_root
        brokers = self.settings.brokers() if isinstance(self.settings, FailoverSettings) else None
        self.session = MqttSession(self.settings, unique_client_id(name), brokers=brokers)
        self.reply_topic = f"{self.root}/_client/{self.session.client_id}/reply"
        self._pending: dict[bytes, _Waiter] = {}  # correlation data -> the call waiting for it
        self._lock = threading.Lock()
        self.session.subscribe(self.reply_topic, self._on_reply, qos=1)

    def __enter__(self) -> RpcClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout: float = 10.0) -> None:
        self.session.start()
        if not self.session.wait_connected(timeout):
            self.session.stop()
            where = ", ".join(f"{h}:{p}" for h, p in self.session.brokers)
            why = self.session.last_error or "no answer"
            raise ConnectionError(f"cannot use the MQTT broker at {where} ({why}) after {timeout:g} s")
        # The SUBACK for the reply topic must be in before the first request goes out.
        self._settle()

    def _settle(self, timeout: float = 5.0) -> bool:
        """A marker to our own reply topic, back: the broker has handled every packet we sent before it (a
        subscription is in, and the retained messages it brought were sent ahead of the marker). False when the
        marker did not come back within `timeout`."""
        corr = b"__settle__" + os.urandom(6).hex().encode()
        w = _Waiter()
        with self._lock:
            self._pending[corr] = w
        self.session.publish(self.reply_topic, b'{"ok":true,"result":{}}', qos=1,
                             properties=reply_properties(None, corr))
        try:
            return w.get(timeout=timeout) is not None
        finally:
            with self._lock:
                self._pending.pop(corr, None)

    def close(self) -> None:
        self.session.stop()

    def _on_reply(self, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        w = self._pending.get(bytes(corr)) if corr is not None else None  # a dict read needs no lock (GIL)
        if w is None:
            return
        try:
            data = json.loads(msg.payload)
            rep = Reply(ok=bool(data.get("ok")), result=data.get("result") or {}, error=data.get("error"),
                        raw=bytes(msg.payload))
        except (ValueError, AttributeError):
            rep = Reply(ok=False, error={"code": "internal", "message": "unparseable reply"},
                        raw=bytes(msg.payload))
        w.put(rep)

    def topic(self, node: str, device: str, kind: str, name: str) -> str:
        return f"{self.root}/{node}/{device}/{kind}/{name}"

    def call(self, node: str, device: str, command: str, payload: dict[str, Any] | bytes | str | None = None,
             timeout: float = 10.0, max_age_s: float | Literal["timeout"] | None = "timeout") -> Reply:
        """Send one request and wait for its reply (TimeoutError if none comes). The request has an age,
        `max_age_s` (by default the time this call waits: nothing runs after its caller gave up; None: no age): a
        node that reads it later answers `expired` and never runs it (shared/dispatch.py)."""
        corr = os.urandom(16)  # what uuid4() draws, without building the UUID
        w = _Waiter()
        with self._lock:
            self._pending[corr] = w
        age = timeout if max_age_s == "timeout" else max_age_s
        try:
            self.session.publish(self.topic(node, device, "cmd", command), _body(payload), qos=1,
                                 properties=command_properties(self.reply_topic, corr, age), now=True)
            rep = w.get(timeout)
            if rep is None:
                raise TimeoutError(f"no reply from {node}/{device} to {command} within {timeout} s")
            return rep
        finally:
            with self._lock:
                self._pending.pop(corr, None)

    def send(self, node: str, device: str, command: str, payload: dict[str, Any] | bytes | str | None = None,
             max_age_s: float | None = 0.1, qos: int = 0) -> None:
        """Send a request and wait for nothing (a stream of setpoints, each superseding the last): no reply is
        asked for (it goes to `<topic>/reply`, which nobody need read). Its age (`max_age_s`, 100 ms by default,
        the setpoint's own lifetime) keeps a setpoint that reaches the node late from ever taking effect."""
        self.session.publish(self.topic(node, device, "cmd", command), _body(payload), qos=qos,
                             properties=command_properties(None, None, max_age_s), now=True)

    def collect(self, topic_filter: str, duration: float, until: Callable[[str, bytes], bool] | None = None
                ) -> list[tuple[str, bytes, bool]]:
        """Subscribe, gather (topic, payload, retained) for `duration` s or until `until` says so."""
        out: list[tuple[str, bytes, bool]] = []
        done = threading.Event()

        def on(msg: mqtt.MQTTMessage) -> None:
            out.append((msg.topic, bytes(msg.payload), bool(msg.retain)))
            if until is not None and until(msg.topic, bytes(msg.payload)):
                done.set()

        self.session.subscribe(topic_filter, on, qos=1)
        done.wait(duration)
        self.session.unsubscribe(topic_filter)
        return out

    def collect_retained(self, *topic_filters: str, timeout: float = 5.0) -> list[tuple[str, bytes, bool]]:
        """What the broker holds retained on `topic_filters` now, as (topic, payload, retained): subscribed, then
        gathered until our marker comes back (`_settle`), which the broker sends after the retained messages of
        the subscriptions before it; anything published meanwhile is in too. At most `timeout` s."""
        out: list[tuple[str, bytes, bool]] = []

        def on(msg: mqtt.MQTTMessage) -> None:
            out.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

        for f in topic_filters:
            self.session.subscribe(f, on, qos=1)
        try:
            self._settle(timeout)
        finally:
            for f in topic_filters:
                self.session.unsubscribe(f)
        return list(out)

    def call_job(self, node: str, device: str, command: str, payload: dict[str, Any] | None,
                 on_progress: Callable[[dict[str, Any]], None], timeout: float = 3600.0,
                 accept_timeout: float = 10.0) -> tuple[Reply, dict[str, Any] | None]:
        """Start a job and wait for its result event, feeding progress events to `on_progress`.
        Subscribes to the device's events before the request, so no event can be missed.
        Returns (the immediate reply, the result event or None when the job was refused)."""
        events: queue.Queue[dict[str, Any]] = queue.Queue()

        def on(msg: mqtt.MQTTMessage) -> None:
            try:
                data = json.loads(msg.payload)
            except ValueError:
                return
            if isinstance(data, dict) and "job_id" in data:
                data["_kind"] = msg.topic.rsplit("/", 1)[-1]
                events.put(data)

        filt = f"{self.root}/{node}/{device}/event/+"
        self.subscribe_before(filt, on)
        try:
            rep = self.call(node, device, command, payload, timeout=accept_timeout)
            if not rep.ok or not is_job_accepted(rep.result, command):
                return rep, None
            job_id = rep.result["job_id"]
            end = time.monotonic() + timeout
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job_id} gave no result within {timeout} s")
                try:
                    ev = events.get(timeout=left)
                except queue.Empty:
                    continue
                if ev.get("job_id") != job_id:
                    continue
                kind = ev.pop("_kind")
                if kind == "job_result":
                    return rep, ev
                on_progress(ev)
        finally:
            self.session.unsubscribe(filt)

    def subscribe_before(self, topic_filter: str, handler: Callable[[mqtt.MQTTMessage], None]) -> None:
        """Subscribe and wait until the broker has the subscription (so nothing after is missed)."""
        self.session.subscribe(topic_filter, handler, qos=1)
        self._settle()


def _body(payload: dict[str, Any] | bytes | str | None) -> bytes | str:
    if payload is None:
        return b"{}"
    if isinstance(payload, dict):
        return json.dumps(payload)
    return payload


def is_job_accepted(result: dict[str, Any], command: str) -> bool:
    """A job command's immediate reply is exactly {job_id, command}."""
    return set(result) == {"job_id", "command"} and result.get("command") == command


def wait_for(pred: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()
