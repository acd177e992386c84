"""Every use of paho-mqtt's private API in the kit, in one module, behind one version check.

The kit's hot paths (docs/kit.md, "Hot paths") go past four of paho's own per-message routines. Each one needs
something paho does not publish: a method it calls on itself, a field of its client, a module constant, the
name tables inside `Properties`. They are all here, one small function per use, each saying which internal it
relies on and why; no other module of the kit touches them (tests/kit/test_paho_private.py checks that, and that
every name used here is declared in `CLIENT_METHODS`, `CLIENT_ATTRIBUTES` or `MODULE_NAMES`).

The version check (`verdict()`, decided once per process):
- The private paths are on for the paho versions they were tested with (`TESTED_VERSIONS`), when everything they
  use is there (`missing()`).
- On any other paho they are off: the kit uses paho's public behaviour only (slower, the same messages), and logs
  one warning naming the version. `ROBOBUS_PAHO_PRIVATE=on` turns them on for an untested paho anyway, but only
  when every attribute they use is present with the expected kind and signature (else off, with the warning).
  `ROBOBUS_PAHO_PRIVATE=off` turns them off on any paho (to compare, or to rule them out). The default is `auto`.
- To accept a new paho: install it, run `tests/kit` (test_paho_private.py names what moved, test_hot_paths.py
  and test_mqtt_rx.py check the behaviour), then add the version here and widen the pin in pyproject.toml.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from threading import get_ident
from typing import Any, NamedTuple

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

try:  # paho >= 2.2 keeps its packet decoders in a private module
    from paho.mqtt import _packet as _paho_packet
except ImportError:  # pragma: no cover - another paho: the receive shortcut stays off
    _paho_packet = None  # type: ignore[assignment]

log = logging.getLogger("robobus.mqtt")

TESTED_VERSIONS: tuple[str, ...] = ("2.2.0",)
"""paho-mqtt versions the private paths were tested with (tests/kit: test_paho_private, test_hot_paths,
test_mqtt_rx). pyproject.toml pins paho-mqtt to their series."""

ENV = "ROBOBUS_PAHO_PRIVATE"
MODES = ("auto", "on", "off")

_NONE = type(None)
_LOCK = type(threading.Lock())

# -- what is relied on ------------------------------------------------------------------------------
CLIENT_METHODS: dict[str, tuple[str, ...]] = {
    # name -> its parameters (self first), as this module calls or replaces it
    "_handle_publish": ("self",),  # replaced per client (install_publish_decoder); paho's _packet_handle calls it
    "_packet_queue": ("self", "command", "packet", "mid", "qos", "info"),  # replaced per client (coalesce_wakes)
    "_packet_write": ("self",),  # called by a publishing thread (packet_writer)
    "_call_socket_register_write": ("self",),  # the end of paho's _packet_queue (coalesce_wakes)
    "_handle_on_message": ("self", "message"),  # install_publish_decoder: the callbacks, as paho runs them
    "_send_puback": ("self", "mid"),
    "_send_pubrec": ("self", "mid"),
    "_easy_log": ("self", "level", "fmt", "args"),
    "loop_write": ("self",),  # public, but serialize_writes relies on paho's own loop calling self.loop_write()
}
CLIENT_ATTRIBUTES: dict[str, tuple[type, ...]] = {
    # name -> the types its value may have on a new MQTT 5 client (set in paho's Client.__init__)
    "_out_packet": (collections.deque,),  # the packets waiting for the socket, oldest first
    "_sockpairW": (socket.socket, _NONE),  # the socket that wakes the network thread out of select()
    "_thread": (threading.Thread, _NONE),  # the network thread (loop_start)
    "_on_socket_register_write": (_NONE,),  # an external event loop's callback (None: the kit never sets one)
    "_in_callback_mutex": (_LOCK,),
    "_in_packet": (dict,),  # the packet being read; a new dict per packet
    "_protocol": (int,),
    "_manual_ack": (bool,),
    "_in_message_mutex": (_LOCK,),
    "_in_messages": (collections.OrderedDict, dict),  # QoS 2 messages waiting for their PUBREL
    "_logger": (logging.Logger, _NONE),
    "_host": (str,),  # where the next (re)connect goes (retarget)
    "_port": (int,),
}
MODULE_NAMES: dict[str, tuple[type, ...]] = {
    # paho.mqtt.client.<name> -> its type
    "sockpair_data": (bytes,),  # the byte paho writes to its socketpair
    "time_func": (type(len),),  # paho's clock for MQTTMessage.timestamp (time.monotonic, a builtin)
    "mqtt_ms_wait_for_pubrel": (int,),  # a QoS 2 message's state after PUBREC
}
PACKET_DECODER = ("header", "packet", "protocol")  # paho.mqtt._packet.decode_publish's parameters
PROPERTY_TABLES = ("types", "names", "properties")  # what Properties.__init__ builds per object


class PublishPacket(NamedTuple):
    """A decoded PUBLISH, field for field paho's `_packet.PublishPacket` (equal to it as a tuple)."""

    dup: bool
    qos: int
    retain: bool
    topic: bytes
    mid: int
    properties: Properties | None
    payload: bytes | bytearray


def _params(fn: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _probe_client() -> mqtt.Client:
    from paho.mqtt.enums import CallbackAPIVersion

    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id="robobus-paho-probe", protocol=mqtt.MQTTv5)


def missing(client: mqtt.Client | None = None) -> list[str]:
    """What the private paths need and this paho lacks (a name gone, a method's parameters changed, a field of
    another type): one line each; [] when all is there. Checked on `client`, or on a new, unconnected one."""
    out: list[str] = []
    try:
        c = client if client is not None else _probe_client()
    except Exception as exc:  # another paho's constructor: nothing private can be relied on
        return [f"paho.mqtt.client.Client(VERSION2, protocol=MQTTv5): {type(exc).__name__}: {exc}"]
    for name, params in CLIENT_METHODS.items():
        fn = getattr(type(c), name, None)
        if not callable(fn):
            out.append(f"paho.mqtt.client.Client.{name}: no such method")
        elif _params(fn) != params:
            out.append(f"paho.mqtt.client.Client.{name}{_params(fn)}: expected parameters {params}")
    for name, kinds in CLIENT_ATTRIBUTES.items():
        if name not in vars(c):
            out.append(f"paho.mqtt.client.Client().{name}: no such attribute")
        elif not isinstance(vars(c)[name], kinds):
            out.append(f"paho.mqtt.client.Client().{name}: a {type(vars(c)[name]).__name__}, expected "
                       + " or ".join(k.__name__ for k in kinds))
    for name, kinds in MODULE_NAMES.items():
        if not isinstance(getattr(mqtt, name, None), kinds):
            out.append(f"paho.mqtt.client.{name}: missing or not " + " or ".join(k.__name__ for k in kinds))
    if _paho_packet is None:
        out.append("paho.mqtt._packet: no such module")
    else:
        decode = getattr(_paho_packet, "decode_publish", None)
        if _params(decode) != PACKET_DECODER:
            out.append(f"paho.mqtt._packet.decode_publish: expected parameters {PACKET_DECODER}")
        fields = getattr(getattr(_paho_packet, "PublishPacket", None), "_fields", None)
        if fields != PublishPacket._fields:
            out.append(f"paho.mqtt._packet.PublishPacket: fields {fields}, expected {PublishPacket._fields}")
    tables = vars(Properties(PacketTypes.PUBLISH))  # type: ignore[no-untyped-call]
    for name in PROPERTY_TABLES:
        if not isinstance(tables.get(name), (list, dict)):
            out.append(f"paho.mqtt.properties.Properties().{name}: no such table")
    return out


# -- the one version check --------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    enabled: bool
    version: str
    mode: str
    why: str  # one line: why on or off
    warn: bool  # worth a warning (an untested paho, something missing, an unknown mode)


def paho_version() -> str:
    return str(getattr(paho.mqtt, "__version__", "unknown"))


def decide(version: str, mode: str, lacking: list[str]) -> Verdict:
    """The rule (module docstring), as a pure function of the paho version, the ROBOBUS_PAHO_PRIVATE value and
    what `missing()` found."""
    mode = mode.strip().lower() or "auto"
    tested = ", ".join(TESTED_VERSIONS)
    if mode not in MODES:
        return Verdict(False, version, mode, f"{ENV}={mode!r} is not one of {', '.join(MODES)}: the kit's "
                       f"paho fast paths are off (paho-mqtt {version})", True)
    if mode == "off":
        return Verdict(False, version, mode, f"{ENV}=off: the kit's paho fast paths are off", False)
    if lacking:
        return Verdict(False, version, mode, f"paho-mqtt {version} lacks what the kit's fast paths use "
                       f"({'; '.join(lacking[:3])}{'; ...' if len(lacking) > 3 else ''}): they are off, paho's "
                       f"public behaviour is used (tested with {tested})", True)
    if version in TESTED_VERSIONS:
        return Verdict(True, version, mode, f"paho-mqtt {version} is a tested version", False)
    if mode == "on":
        return Verdict(True, version, mode, f"paho-mqtt {version} is not a tested version ({tested}); the "
                       f"kit's paho fast paths are on because {ENV}=on and all they use is present", True)
    return Verdict(False, version, mode, f"paho-mqtt {version} is not a tested version ({tested}): the kit's "
                   f"paho fast paths are off, paho's public behaviour is used (slower round trips); "
                   f"{ENV}=on turns them on", True)


@functools.cache
def verdict() -> Verdict:
    """This process's decision, made (and warned about) once."""
    v = decide(paho_version(), os.environ.get(ENV, "auto"), missing())
    if v.warn:
        log.warning(v.why, extra={"paho_version": v.version})
    return v


def enabled() -> bool:
    return verdict().enabled


# -- sending ----------------------------------------------------------------------------------------
def coalesce_wakes(client: mqtt.Client, writing_now: threading.local) -> bool:
    """One wake-up of paho's network thread per burst, not per packet. Replaces this client's `_packet_queue`.

    Relies on: `Client._packet_queue(command, packet, mid, qos, info)` being the one place every outgoing packet
    is queued (paho's publish, PUBACK, SUBSCRIBE... all call it on self), on `_out_packet` (the deque of packet
    dicts `_packet_write` drains), `_sockpairW` and `sockpair_data` (the wake-up), `_thread`, and the tail of
    paho's routine (`_on_socket_register_write`, `_in_callback_mutex`, `_call_socket_register_write`), copied.

    paho's routine writes a byte to its socketpair for every packet queued from another thread, to break the
    network thread out of select(). At 20,000 state messages a second that is 20,000 wake-ups, and each one hands
    the GIL to the network thread and back: ~40 us a message, most of a publish's cost. This one wakes it only
    when the packet is the only one queued. That is enough: a packet queued behind others is written by whoever
    drains them (paho's loop, or a direct write, both pop until the queue is empty); a write the socket refused
    leaves the queue non-empty and paho's loop selects for writable. And the network thread never wakes itself
    (a PUBACK, an inline reply): its loop looks at the queue before select(). Nor is it woken for a packet whose
    publishing thread writes it at once (`writing_now.on`, set by `MqttSession.publish(now=True)`): the session's
    `write_now` wakes it only when something is left queued.
    Returns False (paho's own routine kept) when the private paths are off."""
    if not enabled():
        return False
    out = client._out_packet
    wake_byte = mqtt.sockpair_data

    def packet_queue(command: int, packet: bytes | bytearray, mid: int, qos: int, info: Any = None) -> Any:
        out.append({"command": command, "mid": mid, "qos": qos, "pos": 0, "to_process": len(packet),
                    "packet": packet, "info": info})
        pair = client._sockpairW
        net = client._thread
        if (pair is not None and len(out) == 1  # counted after the append: no lost wake-up (see above)
                and (net is None or net.ident != get_ident())  # paho's loop checks its queue before select()
                and not getattr(writing_now, "on", False)):  # the publishing thread writes it (write_now)
            try:
                pair.send(wake_byte)
            except BlockingIOError:
                pass
        # as paho: without a network thread (and not inside a callback), write at once
        if (client._thread is None and client._on_socket_register_write is None
                and client._in_callback_mutex.acquire(False)):
            client._in_callback_mutex.release()
            return client.loop_write()
        client._call_socket_register_write()
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    setattr(client, "_packet_queue", packet_queue)  # noqa: B010 (an instance attribute over paho's method)
    return True


def packet_writer(client: mqtt.Client) -> Callable[[], Any] | None:
    """paho's `_packet_write`: writes the queued packets (`_out_packet`) to the socket until it is empty or the
    socket would block, and runs what paho runs after a write (QoS 0 on_publish, a DISCONNECT's close). The
    session calls it from a publishing thread, under the lock `serialize_writes` puts around paho's own writes.
    None when the private paths are off (paho's network thread writes everything)."""
    if not enabled():
        return None
    writer: Callable[[], Any] = client._packet_write
    return writer


def serialize_writes(client: mqtt.Client, lock: threading.Lock) -> None:
    """Make paho's own writes take `lock`, so that one thread at a time drains `_out_packet`.

    Relies on paho's loop (`_loop`, `loop_forever`) and `_packet_queue` calling `self.loop_write()`, so that an
    instance attribute over the method is what they call. Only needed (and only done) with `packet_writer`."""
    paho_loop_write = client.loop_write

    def loop_write() -> Any:
        with lock:
            return paho_loop_write()

    setattr(client, "loop_write", loop_write)  # noqa: B010 (an instance attribute over paho's method)


def has_queued_output(client: mqtt.Client) -> bool:
    """Something is left in `_out_packet` (the socket took part of it, another thread is writing): the caller
    hands it to the network thread with `wake_network_thread`."""
    return bool(client._out_packet)


def retarget(client: mqtt.Client, host: str, port: int) -> None:
    """Send the client's next automatic reconnect to `host:port` (a clustered centre's next node). paho's public
    `host` / `port` setters refuse while its loop is (re)connecting, which is when on_connect_fail and
    on_disconnect run; its reconnect reads these two fields. On a paho without them: the public setters (raise
    there: the reconnect then stays on the same broker)."""
    if "_host" in vars(client) and "_port" in vars(client):
        client._host, client._port = host, port
    else:
        client.host, client.port = host, port


def wake_network_thread(client: mqtt.Client) -> None:
    """Break paho's network thread out of select() so that it writes what is queued: one `sockpair_data` byte on
    `_sockpairW`, as paho's `_packet_queue` does. Not from the network thread itself (its loop looks at the queue
    before select()), nor before loop_start (no socketpair yet)."""
    pair = client._sockpairW
    net = client._thread
    if pair is not None and (net is None or net.ident != get_ident()):
        try:
            pair.send(mqtt.sockpair_data)
        except OSError:  # BlockingIOError: the socketpair is full, a wake-up is pending already
            pass


# -- receiving --------------------------------------------------------------------------------------
def paho_decode_publish(header: int, packet: bytes | bytearray) -> Any:
    """paho's own MQTT 5 PUBLISH decoder (`paho.mqtt._packet.decode_publish`), with its MalformedPacket and its
    wording, for what a faster decoder leaves to it. Only called while the private paths are on (a decoder is
    installed by `install_publish_decoder` only then)."""
    return _paho_packet.decode_publish(header, packet, mqtt.MQTTv5)


def install_publish_decoder(client: mqtt.Client, decode: Callable[[int, bytes | bytearray], Any]) -> bool:
    """Decode this client's incoming PUBLISH packets with `decode(header, packet)` (a `PublishPacket`); paho's
    `_handle_publish` otherwise unchanged (the message it builds, the callbacks, the PUBACK after on_message,
    QoS 2). Replaces this client's `_handle_publish`, which paho's `_packet_handle` calls for every PUBLISH.

    Relies on: `_in_packet` (command byte and body of the packet just read), `_handle_on_message`, `_manual_ack`,
    `_send_puback`, `_send_pubrec`, `_in_message_mutex` / `_in_messages` (QoS 2), `_easy_log` / `_logger`,
    `time_func` and `mqtt_ms_wait_for_pubrel`: the body of paho 2.2's `_handle_publish`, copied.
    False (paho's own kept) when the private paths are off or the client is not MQTT 5."""
    if not enabled() or client._protocol != mqtt.MQTTv5:
        return False
    time_func = mqtt.time_func

    def handle_publish() -> MQTTErrorCode:
        in_packet = client._in_packet  # a new dict per packet
        result = decode(in_packet["command"], in_packet["packet"])
        message = mqtt.MQTTMessage(mid=result.mid, topic=result.topic)
        message.dup = result.dup
        message.qos = result.qos
        message.retain = result.retain
        message.properties = result.properties
        message.payload = result.payload
        if client.on_log is not None or client._logger is not None:  # what paho logs, formatted only when read
            client._easy_log(mqtt.MQTT_LOG_DEBUG,
                             "Received PUBLISH (d%d, q%d, r%d, m%d), '%s', properties=%s, ...  (%d bytes)",
                             message.dup, message.qos, message.retain, message.mid,
                             result.topic.decode("utf-8", "backslashreplace"), message.properties,
                             len(message.payload))
        message.timestamp = time_func()
        if message.qos == 0:
            client._handle_on_message(message)
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        if message.qos == 1:
            client._handle_on_message(message)
            if client._manual_ack:
                return MQTTErrorCode.MQTT_ERR_SUCCESS
            return client._send_puback(message.mid)
        if message.qos == 2:
            rc = client._send_pubrec(message.mid)
            message.state = mqtt.mqtt_ms_wait_for_pubrel
            with client._in_message_mutex:
                client._in_messages[message.mid] = message
            return rc
        return MQTTErrorCode.MQTT_ERR_PROTOCOL

    setattr(client, "_handle_publish", handle_publish)  # noqa: B010 (an instance attribute over paho's method)
    return True


# -- Properties -------------------------------------------------------------------------------------
_TABLES: dict[str, Any] = vars(Properties(PacketTypes.PUBLISH))  # type: ignore[no-untyped-call]


class SharedTablesProperties(Properties):
    """PUBLISH `Properties` whose name and type tables belong to the class, built once, instead of to each object
    (paho's `Properties.__init__` builds `types`, `names` and `properties` for every object, ~10 us).

    Relies on: those three tables being all `__init__` sets besides `packetType`, and on `pack`, `unpack`,
    `__setattr__` and `__str__` reading them through `self` (a class attribute does). Construct one only while
    `enabled()`; otherwise call `Properties.__init__(self, PacketTypes.PUBLISH)` for paho's own tables."""

    types: list[str] = _TABLES.get("types", [])  # empty on a paho without them: missing() says so, enabled() is off
    names: dict[str, int] = _TABLES.get("names", {})
    properties: dict[int, tuple[int, list[int]]] = _TABLES.get("properties", {})

    def __init__(self) -> None:  # no super().__init__: the tables are shared
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)
