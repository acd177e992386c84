"""MQTT 5 session on paho-mqtt 2.x, with the pitfalls of DESIGN.md handled once, here.

- TCP_NODELAY on the socket (paho never sets it; without it a QoS 1 round trip costs ~88 ms).
- Reconnect with capped exponential backoff (paho's own loop, fractional delays).
- Subscriptions are remembered and made again in `on_connect` (paho 2.x forgets them).
- Last Will registered before CONNECT; `on_connect` hooks publish the birth.
- Callbacks must not block: the session only dispatches, callers hand slow work to threads.
- Hot path (docs/kit.md, "Hot paths"): handlers resolved once per topic; PUBLISH properties packed once when built
  (paho's Properties builds its tables per object and re-packs per publish) and read without those tables when
  received (rx.py); a reply or a request is written to the socket by the publishing thread itself, one
  writer at a time, instead of waking paho's network thread. What these need of paho's internals is in
  `shared.mqtt.paho_private`, behind its version check: on a paho it was not tested with they are off and paho's
  public behaviour is used.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode

from shared.mqtt import paho_private
from shared.mqtt import rx as mqtt_rx
from shared.mqtt.address import ClientSettings, bound_client_id
from shared.mqtt.failover import fail_over

log = logging.getLogger("robobus.mqtt")

MessageHandler = Callable[[mqtt.MQTTMessage], None]


@dataclass
class Will:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


def unique_client_id(prefix: str) -> str:
    """Two clients with one id kick each other off forever: always add a random part."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in prefix)[:40]
    return f"{safe}-{uuid.uuid4().hex[:10]}"


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # unix sockets, websockets wrapper
        pass


class MqttSession:
    """One paho client with remembered subscriptions and connect hooks."""

    def __init__(self, settings: ClientSettings, client_id: str, will: Will | None = None,
                 brokers: list[tuple[str, int]] | None = None) -> None:
        self.settings = settings
        self.client_id = bound_client_id(settings.broker().username, client_id)
        self.connected = threading.Event()
        self.ready = threading.Event()  # connected AND the broker acknowledged every subscription
        self._pending_subacks: set[int] = set()
        self._hooks_due = False  # connect hooks wait for the SUBACKs of the subscriptions restored on connect
        self.reconnects = 0
        self.last_error = ""  # why the last connection attempt failed (refused, auth, TLS, ...)
        self.dropped = 0
        self._subs: dict[str, tuple[int, MessageHandler]] = {}
        # topic -> its handlers, resolved once; cleared when the subscriptions change (and when it grows past
        # _ROUTES_MAX, so that a flood of distinct topics cannot grow it without bound)
        self._routes: dict[str, tuple[MessageHandler, ...]] = {}
        self._connect_hooks: list[Callable[[], None]] = []
        self._disconnect_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._ever_connected = False
        self._closing = False

        c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
        )
        c.on_socket_open = _nodelay
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        c.on_connect_fail = self._on_connect_fail
        c.max_inflight_messages_set(1000)
        c.max_queued_messages_set(settings.mqtt_max_queued)
        c.reconnect_delay_set(settings.mqtt_reconnect_min_s, settings.mqtt_reconnect_max_s)  # type: ignore[arg-type]
        broker = settings.broker()
        if broker.username:
            c.username_pw_set(broker.username, broker.password)
        if broker.tls:
            c.tls_set(
                ca_certs=str(settings.mqtt_tls_ca) if settings.mqtt_tls_ca else None,
                certfile=str(settings.mqtt_tls_cert) if settings.mqtt_tls_cert else None,
                keyfile=str(settings.mqtt_tls_key) if settings.mqtt_tls_key else None,
                cert_reqs=ssl.CERT_REQUIRED,
            )
            c.tls_insecure_set(settings.mqtt_tls_insecure)
        if will is not None:
            c.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        self.client = c
        # where to connect, in order (a clustered centre's nodes: the next on a failed connect or a drop); one broker:
        # the URL's. self.broker is the one connected to, or tried, now.
        self.brokers = list(brokers) if brokers else [(broker.host, broker.port)]
        self.broker = broker.model_copy(update={"host": self.brokers[0][0], "port": self.brokers[0][1]})
        self._fail_over = fail_over(c, self.brokers, self.client_id, self._moved)
        # Direct writes: paho's publish() from any thread only queues the packet and wakes the network thread to
        # write it (one thread hop per message). Here the publishing thread writes it itself. paho's packet
        # queue takes one writer at a time, so its network thread's loop_write and ours share a lock. Not over
        # TLS (an SSL object must not read and write from two threads at once), and only while no on_publish
        # callback is set (paho would run it, under its callback lock, on the writing thread). They rely on the
        # coalesced wake-ups (paho_private.coalesce_wakes: a packet written at once wakes nobody), so they go
        # without them. Each of the three is off when paho_private's version check says so.
        self._write_lock = threading.Lock()
        # set while this thread queues a packet it will write itself: no wake-up of the network thread for it
        self._writing_now = threading.local()
        self.coalesced_wakes = paho_private.coalesce_wakes(c, self._writing_now)
        self.fast_decode = mqtt_rx.install(c)  # received PUBLISH properties without paho's per-message tables
        packet_write = paho_private.packet_writer(c)
        self.direct_writes = packet_write is not None and not broker.tls and self.coalesced_wakes
        self._packet_write: Callable[[], Any] = packet_write or (lambda: None)
        if self.direct_writes:
            paho_private.serialize_writes(c, self._write_lock)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Connect in the background; paho's thread reconnects for as long as we run."""
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 0
        self.client.connect_async(
            self.broker.host, self.broker.port, keepalive=self.settings.mqtt_keepalive_s, properties=props
        )
        self.client.loop_start()

    def wait_connected(self, timeout: float) -> bool:
        return self.connected.wait(timeout)

    def wait_ready(self, timeout: float) -> bool:
        """Connected, and every subscription made so far is acknowledged by the broker."""
        return self.ready.wait(timeout)

    def stop(self) -> None:
        with self._write_lock:  # from here on write_now writes nothing: see there
            self._closing = True
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def on_connect(self, fn: Callable[[], None]) -> None:
        """Run `fn` on every (re)connect, once the broker has acknowledged the subscriptions restored on
        connect (e.g. publish a birth: whoever sees it can be answered)."""
        self._connect_hooks.append(fn)

    def on_disconnect(self, fn: Callable[[], None]) -> None:
        self._disconnect_hooks.append(fn)

    # -- pub/sub -----------------------------------------------------------------------------
    def subscribe(self, topic: str, handler: MessageHandler, qos: int = 1) -> None:
        with self._lock:
            self._subs[topic] = (qos, handler)
            self._routes = {}
            if self.connected.is_set():
                rc, mid = self.client.subscribe(topic, qos=qos)
                if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                    self._pending_subacks.add(mid)
                    self.ready.clear()

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            self._subs.pop(topic, None)
            self._routes = {}
        if self.connected.is_set():
            self.client.unsubscribe(topic)

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        *,
        qos: int = 0,
        retain: bool = False,
        properties: Properties | None = None,
        now: bool = False,
    ) -> bool:
        """Publish; False (and counted) when paho refused it, e.g. QoS 0 while disconnected.

        `now=True` (a command's reply, a client's request: one message somebody waits for) writes it on this
        thread at once; otherwise paho's network thread writes it, which overlaps the socket write with the
        caller's next message (a stream of state publishes goes faster so)."""
        client = self.client
        if now and self.direct_writes and client.on_publish is None:
            # queued without waking the network thread (it would wake, take the GIL from us and race us for
            # the write lock: two thread switches per message); write_now wakes it if we cannot write it all
            mark = self._writing_now
            before = getattr(mark, "on", False)  # inside batch(): stays set
            mark.on = True
            try:
                info = client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
            finally:
                mark.on = before
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                self.dropped += 1
                return False
            self.write_now()
            return True
        info = client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self.dropped += 1
            return False
        return True

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Publishes made on this thread inside the block are queued without waking paho's network thread and
        written here at its end, in one go (a periodic publisher's tick: one socket write, no thread wake-up,
        instead of one wake-up of the network thread per tick, which is most of an idle node's cost on a VM)."""
        mark = self._writing_now
        if getattr(mark, "on", False) or not self.direct_writes or self.client.on_publish is not None:
            yield
            return
        mark.on = True
        try:
            yield
        finally:
            mark.on = False
            self.write_now()

    def write_now(self) -> None:
        """Write queued packets on this thread, if no other thread is writing. What is left queued (another
        thread holds the write lock and may have looked at the queue already; the socket took only part; an
        error: paho's own loop sees a broken socket and reconnects) is left to the network thread, woken. Once
        the session is closing, nothing is written here: the DISCONNECT queued by `stop` must not be written from
        inside a paho callback (a handler answering on the network thread), where paho's on_disconnect waits for
        the callback lock that very thread holds (the node hung at SIGTERM under a stream of commands)."""
        if self._write_lock.acquire(blocking=False):
            try:
                if not self._closing:
                    self._packet_write()
            except Exception:  # the socket went away under us: paho's loop handles it
                pass
            finally:
                self._write_lock.release()
            if not paho_private.has_queued_output(self.client):
                return
        self._wake_network_thread()

    def _wake_network_thread(self) -> None:
        paho_private.wake_network_thread(self.client)

    def publish_wait(self, topic: str, payload: bytes | str, *, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0) -> bool:
        """Publish and wait until the broker has it (used for the offline status at shutdown)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return False
        try:
            info.wait_for_publish(timeout)
        except (RuntimeError, ValueError):
            return False
        return info.is_published()

    # -- paho callbacks (network thread: never block here) ------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: ReasonCode,
                    properties: Properties | None = None) -> None:
        if rc.is_failure:
            self.last_error = f"broker refused the connection: {rc}"
            log.warning("broker refused connection", extra={"reason": str(rc)})
            return
        self.last_error = ""
        if self._ever_connected:
            self.reconnects += 1
        self._ever_connected = True
        with self._lock:
            subs = list(self._subs.items())
            self._pending_subacks.clear()
            for topic, (qos, _) in subs:
                sub_rc, mid = client.subscribe(topic, qos=qos)
                if sub_rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                    self._pending_subacks.add(mid)
            hooks_now = not self._pending_subacks
            self._hooks_due = not hooks_now
            if hooks_now:
                self.ready.set()
        self.connected.set()
        log.info("connected", extra={"broker": f"{self.broker.host}:{self.broker.port}",
                                     "client_id": self.client_id})
        if hooks_now:
            self._run_connect_hooks()

    def _run_connect_hooks(self) -> None:
        for hook in self._connect_hooks:
            try:
                hook()
            except Exception:
                log.exception("connect hook failed")

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: ReasonCode,
                       properties: Properties | None = None) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        self.ready.clear()
        if was and not self._closing:
            log.warning("disconnected from broker; reconnecting", extra={"reason": str(rc)})
        if not self._closing:
            self._fail_over()
        for hook in self._disconnect_hooks:
            try:
                hook()
            except Exception:
                log.exception("disconnect hook failed")

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        # paho swallows the exception; the socket or TLS error is the most useful thing to report
        import sys

        exc = sys.exc_info()[1]
        self.last_error = f"cannot connect: {exc}" if exc else "cannot connect"
        self._fail_over()

    def _moved(self, host: str, port: int) -> None:
        self.broker = self.broker.model_copy(update={"host": host, "port": port})

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any,
                      properties: Properties | None = None) -> None:
        with self._lock:
            self._pending_subacks.discard(mid)
            run_hooks = False
            if not self._pending_subacks and self.connected.is_set():
                self.ready.set()
                run_hooks, self._hooks_due = self._hooks_due, False
        if run_hooks:
            # the birth (status, health) goes out once the broker has every subscription: a client that sees a
            # node online can command it at once
            self._run_connect_hooks()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic
        handlers = self._routes.get(topic)
        if handlers is None:
            with self._lock:
                handlers = tuple(h for t, (_, h) in self._subs.items() if mqtt.topic_matches_sub(t, topic))
                if len(self._routes) >= _ROUTES_MAX:
                    self._routes = {}
                self._routes[topic] = handlers
        for h in handlers:
            try:
                h(msg)
            except Exception:
                log.exception("message handler failed", extra={"topic": topic})


_ROUTES_MAX = 4096


def _field(ident: int, data: bytes) -> bytes:
    """One property: identifier, two-byte length, the bytes (UTF-8 string or binary data, MQTT 5 2.2.2.2)."""
    if len(data) > 0xFFFF:
        raise ValueError(f"MQTT property {ident} longer than 65535 bytes")
    return bytes((ident,)) + len(data).to_bytes(2, "big") + data


class PublishProperties(paho_private.SharedTablesProperties):
    """PUBLISH properties (Content Type, Response Topic, Correlation Data), packed once when built.

    paho's Properties builds its name tables per object and walks them in every `pack()`, that is per publish
    and again per retry (~20 us a message); this one shares the tables and packs once, in paho's order (by
    identifier), to the same bytes. Setting a property afterwards re-packs. When paho_private's version check
    turns the private paths off it is paho's own `Properties`, built and packed as paho does."""

    def __init__(self, response_topic: str | None = None, correlation: bytes | None = None,
                 content_type: str | None = None, expiry_s: int | None = None,
                 user: list[tuple[str, str]] | None = None) -> None:
        setattr_ = object.__setattr__
        if not paho_private.enabled():  # paho's own tables, and paho's pack() per publish
            setattr_(self, "_packed", None)
            Properties.__init__(self, PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if expiry_s is not None:
                self.MessageExpiryInterval = expiry_s
            if content_type:
                self.ContentType = content_type
            if response_topic:
                self.ResponseTopic = response_topic
            if correlation is not None:
                self.CorrelationData = correlation
            if user:
                self.UserProperty = list(user)
            return
        # no super().__init__: the tables are shared; fields in paho's order (by identifier)
        setattr_(self, "packetType", PacketTypes.PUBLISH)
        buf = b""
        if expiry_s is not None:
            setattr_(self, "MessageExpiryInterval", expiry_s)
            buf += b"\x02" + expiry_s.to_bytes(4, "big")
        if content_type:
            setattr_(self, "ContentType", content_type)
            buf += _field(3, content_type.encode())
        if response_topic:
            setattr_(self, "ResponseTopic", response_topic)
            buf += _field(8, response_topic.encode())
        if correlation is not None:
            setattr_(self, "CorrelationData", correlation)
            buf += _field(9, bytes(correlation))
        if user:
            setattr_(self, "UserProperty", list(user))
            for k, v in user:
                buf += b"&" + _field(38, k.encode())[1:] + _field(38, v.encode())[1:]
        setattr_(self, "_packed", VariableByteIntegers.encode(len(buf)) + buf)  # type: ignore[no-untyped-call]

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # type: ignore[no-untyped-call]
        if object.__getattribute__(self, "_packed") is not None:
            object.__setattr__(self, "_packed", super().pack())  # type: ignore[no-untyped-call]

    def pack(self) -> bytes:
        packed: bytes | None = object.__getattribute__(self, "_packed")
        if packed is None:
            return super().pack()  # type: ignore[no-any-return, no-untyped-call]
        return packed


def reply_properties(response_topic: str | None = None, correlation: bytes | None = None,
                     content_type: str | None = None) -> Properties:
    return PublishProperties(response_topic, correlation, content_type)


# A command's age (docs/kit.md, "A command has an age"): the User Property a robobus client sets on every request,
# the Unix time in milliseconds after which the node must not execute it; the node answers `expired` after.
DEADLINE_PROPERTY = "robobus-deadline"


def command_properties(response_topic: str | None, correlation: bytes | None, max_age_s: float | None,
                       content_type: str | None = "application/json", now: float | None = None) -> Properties:
    """A request's properties: reply address, and, with `max_age_s`, its age: the deadline (User Property, ms
    resolution, judged by the node on its own clock: NTP between hosts) and the Message Expiry Interval (whole
    seconds, rounded up: the broker drops a request it still holds after that, e.g. queued for a stalled node)."""
    if max_age_s is None:
        return PublishProperties(response_topic, correlation, content_type)
    sent = time.time() if now is None else now
    deadline_ms = int((sent + max_age_s) * 1000)
    return PublishProperties(response_topic, correlation, content_type, expiry_s=max(1, math.ceil(max_age_s)),
                             user=[(DEADLINE_PROPERTY, str(deadline_ms))])
