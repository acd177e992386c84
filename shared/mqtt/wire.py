"""MQTT 5 packets for the recorder's lean subscriber: pure code, bytes in, packets out (sans-I/O).

Why not paho here: paho's MQTT 5 receive path builds a `Properties` object per PUBLISH and reads the
socket a byte at a time for each fixed header; measured on this machine it tops out at ~12-14 K
messages/s with an empty callback, below the recorder's 20 K/s target. This codec parses PUBLISH
packets straight out of a large receive buffer and decodes properties only when a packet has any.

Covers what a subscriber (and the benchmark's publisher) needs: CONNECT / CONNACK, SUBSCRIBE / SUBACK,
PUBLISH (QoS 0 and 1) / PUBACK, PINGREQ / PINGRESP, DISCONNECT. Layouts from the MQTT 5.0 OASIS
standard, sections 2.1-2.2 (fixed header, variable byte integer), 2.2.2 (properties) and 3.x (packets).
QoS 2 is never asked for (subscriptions are QoS 1), so PUBREC/PUBREL/PUBCOMP are protocol errors here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# packet types (high nibble of the first byte)
CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14

MAX_REMAINING = 268_435_455  # the largest value four variable-byte-integer bytes hold

# property identifier -> (name, kind); MQTT 5.0 table 2-4
PROPERTIES: dict[int, tuple[str, str]] = {
    0x01: ("payload_format", "byte"),
    0x02: ("message_expiry", "u32"),
    0x03: ("content_type", "str"),
    0x08: ("response_topic", "str"),
    0x09: ("correlation_data", "bin"),
    0x0B: ("subscription_id", "vbi"),
    0x11: ("session_expiry", "u32"),
    0x12: ("assigned_client_id", "str"),
    0x13: ("server_keep_alive", "u16"),
    0x15: ("auth_method", "str"),
    0x16: ("auth_data", "bin"),
    0x17: ("request_problem_info", "byte"),
    0x18: ("will_delay", "u32"),
    0x19: ("request_response_info", "byte"),
    0x1A: ("response_info", "str"),
    0x1C: ("server_reference", "str"),
    0x1F: ("reason_string", "str"),
    0x21: ("receive_maximum", "u16"),
    0x22: ("topic_alias_maximum", "u16"),
    0x23: ("topic_alias", "u16"),
    0x24: ("maximum_qos", "byte"),
    0x25: ("retain_available", "byte"),
    0x26: ("user_property", "pair"),
    0x27: ("maximum_packet_size", "u32"),
    0x28: ("wildcard_available", "byte"),
    0x29: ("subscription_id_available", "byte"),
    0x2A: ("shared_available", "byte"),
}
_IDS = {name: (pid, kind) for pid, (name, kind) in PROPERTIES.items()}


class MqttProtocolError(ValueError):
    """Bytes that are not a well-formed MQTT 5 packet (or one a subscriber must never receive)."""


class Publish(NamedTuple):
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int  # 0 for QoS 0
    props: dict[str, Any] | None  # None when the packet has no properties (the common, fast case)


@dataclass
class ConnAck:
    session_present: bool
    reason: int
    props: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubAck:
    packet_id: int
    reasons: list[int]


@dataclass
class PubAck:
    packet_id: int
    reason: int


@dataclass
class PingResp:
    pass


@dataclass
class Disconnect:
    reason: int
    props: dict[str, Any] = field(default_factory=dict)


Packet = Publish | ConnAck | SubAck | PubAck | PingResp | Disconnect


# -- encoding -------------------------------------------------------------------------------------
def encode_vbi(n: int) -> bytes:
    if not 0 <= n <= MAX_REMAINING:
        raise ValueError(f"variable byte integer out of range: {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    return struct.pack("!H", len(b)) + b


def _bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return struct.pack("!H", len(b)) + b


def encode_properties(props: dict[str, Any] | None) -> bytes:
    body = bytearray()
    for name, value in (props or {}).items():
        pid, kind = _IDS[name]
        values = value if kind == "pair" else [value]
        for v in values:
            body.append(pid)
            if kind == "byte":
                body.append(int(v))
            elif kind == "u16":
                body += struct.pack("!H", v)
            elif kind == "u32":
                body += struct.pack("!I", v)
            elif kind == "vbi":
                body += encode_vbi(v)
            elif kind == "str":
                body += _str(v)
            elif kind == "bin":
                body += _bin(bytes(v))
            else:  # pair
                body += _str(v[0]) + _str(v[1])
    return encode_vbi(len(body)) + bytes(body)


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + encode_vbi(len(body)) + body


def encode_connect(client_id: str, *, keepalive: int = 60, clean_start: bool = True,
                   username: str | None = None, password: str | None = None,
                   props: dict[str, Any] | None = None) -> bytes:
    flags = (0x02 if clean_start else 0) | (0x80 if username is not None else 0) | \
            (0x40 if password is not None else 0)
    body = _str("MQTT") + bytes([5, flags]) + struct.pack("!H", keepalive) + encode_properties(props)
    body += _str(client_id)
    if username is not None:
        body += _str(username)
    if password is not None:
        body += _bin(password.encode())
    return _packet(CONNECT << 4, body)


def encode_subscribe(packet_id: int, filters: Iterable[str], *, qos: int = 1, retain_as_published: bool = True,
                     no_local: bool = False, retain_handling: int = 0) -> bytes:
    """retain_handling: 0 send retained messages on subscribe, 1 only for a new subscription, 2 never."""
    if retain_handling not in (0, 1, 2):
        raise ValueError("retain_handling is 0, 1 or 2")
    opts = qos | (0x04 if no_local else 0) | (0x08 if retain_as_published else 0) | (retain_handling << 4)
    body = struct.pack("!H", packet_id) + encode_properties(None)
    for f in filters:
        body += _str(f) + bytes([opts])
    return _packet((SUBSCRIBE << 4) | 0x02, body)


def encode_publish(topic: str, payload: bytes, *, qos: int = 0, retain: bool = False, packet_id: int = 0,
                   dup: bool = False, props: dict[str, Any] | None = None) -> bytes:
    if qos not in (0, 1):
        raise ValueError("QoS 2 is not supported here")
    first = (PUBLISH << 4) | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    head = _str(topic) + (struct.pack("!H", packet_id) if qos else b"") + encode_properties(props)
    return _packet(first, head + payload)


def encode_puback(packet_id: int) -> bytes:
    """Reason 0 (success) with no properties may be left out (3.4.2.1): the 4-byte form."""
    return bytes((PUBACK << 4, 2, packet_id >> 8, packet_id & 0xFF))


PINGREQ_PACKET = bytes((PINGREQ << 4, 0))


def encode_disconnect(reason: int = 0, props: dict[str, Any] | None = None) -> bytes:
    if reason == 0 and not props:
        return bytes((DISCONNECT << 4, 0))
    return _packet(DISCONNECT << 4, bytes([reason]) + encode_properties(props))


# -- decoding -------------------------------------------------------------------------------------
def decode_properties(buf: bytes | memoryview, pos: int, end: int) -> dict[str, Any]:
    """Properties from buf[pos:end] (the bytes after the property length)."""
    out: dict[str, Any] = {}
    try:
        while pos < end:
            pid = buf[pos]
            pos += 1
            spec = PROPERTIES.get(pid)
            if spec is None:
                raise MqttProtocolError(f"unknown property identifier 0x{pid:02x}")
            name, kind = spec
            if kind == "byte":
                v: Any = buf[pos]
                pos += 1
            elif kind == "u16":
                (v,) = struct.unpack_from("!H", buf, pos)
                pos += 2
            elif kind == "u32":
                (v,) = struct.unpack_from("!I", buf, pos)
                pos += 4
            elif kind == "vbi":
                v, pos = _vbi(buf, pos, end)
            elif kind == "str" or kind == "bin":
                (n,) = struct.unpack_from("!H", buf, pos)
                raw = bytes(buf[pos + 2:pos + 2 + n])
                if len(raw) != n:
                    raise MqttProtocolError("property runs past the packet")
                pos += 2 + n
                v = raw if kind == "bin" else _utf8(raw)
            else:  # pair
                k, pos = _read_str(buf, pos, end)
                val, pos = _read_str(buf, pos, end)
                out.setdefault(name, []).append((k, val))
                continue
            if name in out:
                raise MqttProtocolError(f"property {name} given twice")
            out[name] = v
    except (IndexError, struct.error):
        raise MqttProtocolError("truncated properties") from None
    if pos != end:
        raise MqttProtocolError("properties run past their length")
    return out


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise MqttProtocolError("string is not UTF-8") from None


def _read_str(buf: bytes | memoryview, pos: int, end: int) -> tuple[str, int]:
    if pos + 2 > end:
        raise MqttProtocolError("truncated string")
    n = (buf[pos] << 8) | buf[pos + 1]
    if pos + 2 + n > end:
        raise MqttProtocolError("string runs past the packet")
    return _utf8(bytes(buf[pos + 2:pos + 2 + n])), pos + 2 + n


def _vbi(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    value = 0
    for shift in (0, 7, 14, 21):
        if pos >= end:
            raise MqttProtocolError("truncated variable byte integer")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
    raise MqttProtocolError("variable byte integer longer than 4 bytes")


class PacketReader:
    """Feed received bytes, get whole packets. Keeps a partial packet across calls.

    `max_packet` bounds the memory a peer can make us hold (MQTT 5 Maximum Packet Size)."""

    def __init__(self, max_packet: int = MAX_REMAINING + 5) -> None:
        self._buf = b""
        self.max_packet = max_packet

    def feed(self, data: bytes) -> list[Packet]:
        buf = self._buf + data if self._buf else data
        n = len(buf)
        pos = 0
        out: list[Packet] = []
        while pos + 2 <= n:
            first = buf[pos]
            # remaining length (inlined for the common 1-2 byte case)
            b = buf[pos + 1]
            if b < 0x80:
                length, body = b, pos + 2
            else:
                try:
                    length, body = _vbi(buf, pos + 1, n)
                except MqttProtocolError:
                    if n - pos - 1 < 4:
                        break  # the length itself is not complete yet
                    raise
            if body + length - pos > self.max_packet:
                raise MqttProtocolError(f"packet of {body + length - pos} bytes exceeds the limit")
            end = body + length
            if end > n:
                break
            ptype = first >> 4
            if ptype == PUBLISH:
                out.append(_publish(first, buf, body, end))
            else:
                out.append(_control(ptype, first & 0x0F, buf[body:end]))
            pos = end
        self._buf = buf[pos:]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def _publish(first: int, buf: bytes, pos: int, end: int) -> Publish:
    qos = (first >> 1) & 0x03
    if qos > 1:
        raise MqttProtocolError(f"PUBLISH with QoS {qos} (subscriptions ask for at most 1)")
    if pos + 2 > end:
        raise MqttProtocolError("PUBLISH too short for its topic")
    tlen = (buf[pos] << 8) | buf[pos + 1]
    tend = pos + 2 + tlen
    if tend > end:
        raise MqttProtocolError("PUBLISH topic runs past the packet")
    try:
        topic = buf[pos + 2:tend].decode()
    except UnicodeDecodeError:
        raise MqttProtocolError("PUBLISH topic is not UTF-8") from None
    pos = tend
    pid = 0
    if qos:
        if pos + 2 > end:
            raise MqttProtocolError("PUBLISH too short for its packet id")
        pid = (buf[pos] << 8) | buf[pos + 1]
        if pid == 0:
            raise MqttProtocolError("PUBLISH QoS 1 with packet id 0")
        pos += 2
    if pos >= end:
        raise MqttProtocolError("PUBLISH without a property length")
    plen = buf[pos]
    props: dict[str, Any] | None = None
    if plen == 0:
        pos += 1
    else:
        plen, ppos = _vbi(buf, pos, end)
        if ppos + plen > end:
            raise MqttProtocolError("PUBLISH properties run past the packet")
        props = decode_properties(buf, ppos, ppos + plen)
        pos = ppos + plen
    if not topic and not (props and "topic_alias" in props):
        raise MqttProtocolError("PUBLISH with an empty topic and no topic alias")
    return Publish(topic, buf[pos:end], qos, bool(first & 0x01), bool(first & 0x08), pid, props)


def _control(ptype: int, flags: int, body: bytes) -> Packet:
    n = len(body)
    if ptype == CONNACK:
        if n < 2:
            raise MqttProtocolError("CONNACK too short")
        props: dict[str, Any] = {}
        if n > 2:
            plen, pos = _vbi(body, 2, n)
            props = decode_properties(body, pos, pos + plen)
        return ConnAck(bool(body[0] & 0x01), body[1], props)
    if ptype == SUBACK:
        if n < 3:
            raise MqttProtocolError("SUBACK too short")
        plen, pos = _vbi(body, 2, n)
        if pos + plen > n:
            raise MqttProtocolError("SUBACK properties run past the packet")
        return SubAck((body[0] << 8) | body[1], list(body[pos + plen:]))
    if ptype == PUBACK:
        if n < 2:
            raise MqttProtocolError("PUBACK too short")
        return PubAck((body[0] << 8) | body[1], body[2] if n > 2 else 0)
    if ptype == PINGRESP:
        return PingResp()
    if ptype == DISCONNECT:
        if n == 0:
            return Disconnect(0)
        props = {}
        if n > 1:
            plen, pos = _vbi(body, 1, n)
            props = decode_properties(body, pos, pos + plen)
        return Disconnect(body[0], props)
    raise MqttProtocolError(f"unexpected packet type {ptype} for a subscriber")
