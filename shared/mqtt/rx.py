"""The receive side's shortcut: paho's PUBLISH decode, to the same message, without its per-message cost.

paho decodes every received PUBLISH's MQTT 5 properties with `Properties(PUBLISH).unpack()`: it builds the name
and type tables for each message, then for each property looks its name up by walking the tables, re-checks the
name against a list built per call, and walks a string character by character. For a command's Content Type,
Response Topic and Correlation Data that is ~25-40 us of the round trip at each end (server and client), the
largest single cost on either side (bench/rpc_stages.py). Here the properties of a well-formed PUBLISH are read
straight into a `Properties` that shares the tables (as `mqtt.PublishProperties` does for sending), with paho's
checks; anything unusual (an identifier paho would refuse, a value out of its range, a length that runs past the
properties, a repeated property) is handed to paho's own decoder, so that what paho refuses it still refuses, in
its own words. `tests/kit/test_mqtt_rx.py` checks both against paho, byte for byte, on generated packets.
What this needs of paho's internals (its `_handle_publish`, its own decoder) is in `shared.mqtt.paho_private`, and only
used while that module's version check allows it.
"""

from __future__ import annotations

import struct
from typing import Any

import paho.mqtt.client as mqtt

from shared.mqtt import paho_private
from shared.mqtt.paho_private import PublishPacket, SharedTablesProperties

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!L")
_BAD_CHARS = ("\x00", "\ufeff")  # paho's readUTF refuses these (MQTT-1.5.4-2, -3); D800-DFFF cannot decode

# PUBLISH properties (MQTT 5.0 3.3.2.3): identifier -> attribute name, as paho names them
_STR = {3: "ContentType", 8: "ResponseTopic"}
_BIN = {9: "CorrelationData"}


class ReceivedProperties(SharedTablesProperties):
    """A received PUBLISH's properties: paho's class, sharing its tables instead of building them per message."""


class _Unusual(Exception):
    """Not the common case: paho's own decoder decides."""


def _utf8(buf: bytes | bytearray, pos: int, end: int) -> tuple[str, int]:
    if pos + 2 > end:
        raise _Unusual
    n = (buf[pos] << 8) | buf[pos + 1]
    stop = pos + 2 + n
    if stop > end:
        raise _Unusual
    s = bytes(buf[pos + 2:stop]).decode("utf-8")  # UnicodeDecodeError: not _Unusual, paho raises it too
    for bad in _BAD_CHARS:
        if bad in s:
            raise _Unusual
    return s, stop


def read_properties(buf: bytes | bytearray, pos: int) -> tuple[ReceivedProperties, int]:
    """The properties at `pos` (their length first); returns them and the position after them.
    Raises _Unusual for anything but a well-formed set of PUBLISH properties that paho would accept as is."""
    first = buf[pos]
    if first < 0x80:
        length, pos = first, pos + 1
    elif pos + 1 < len(buf) and buf[pos + 1] < 0x80 and buf[pos + 1]:  # two bytes, minimally encoded
        length, pos = (first & 0x7F) | (buf[pos + 1] << 7), pos + 2
    else:
        raise _Unusual
    end = pos + length
    if end > len(buf):
        raise _Unusual
    props = ReceivedProperties()
    seen: set[int] = set()
    put = object.__setattr__
    while pos < end:
        ident = buf[pos]
        pos += 1
        if ident in seen and ident not in (11, 38):
            raise _Unusual  # paho: "must not exist more than once"
        seen.add(ident)
        if ident in _STR:
            value, pos = _utf8(buf, pos, end)
            put(props, _STR[ident], value)
        elif ident in _BIN:
            if pos + 2 > end:
                raise _Unusual
            stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
            if stop > end:
                raise _Unusual
            put(props, _BIN[ident], bytes(buf[pos + 2:stop]))
            pos = stop
        elif ident == 38:  # User Property: a list of (name, value) pairs, in order
            name, pos = _utf8(buf, pos, end)
            value, pos = _utf8(buf, pos, end)
            pairs = props.__dict__.setdefault("UserProperty", [])
            pairs.append((name, value))
        elif ident == 1:  # Payload Format Indicator: 0 or 1
            if pos + 1 > end or buf[pos] > 1:
                raise _Unusual
            put(props, "PayloadFormatIndicator", buf[pos])
            pos += 1
        elif ident == 2:  # Message Expiry Interval
            if pos + 4 > end:
                raise _Unusual
            put(props, "MessageExpiryInterval", _U32.unpack_from(buf, pos)[0])
            pos += 4
        elif ident == 35:  # Topic Alias: 1-65535
            if pos + 2 > end:
                raise _Unusual
            alias = _U16.unpack_from(buf, pos)[0]
            if alias < 1:
                raise _Unusual
            put(props, "TopicAlias", alias)
            pos += 2
        else:  # Subscription Identifier (a variable byte integer) and what a PUBLISH must not carry
            raise _Unusual
    if pos != end:
        raise _Unusual
    return props, end


def decode_publish(header: int, packet: bytes | bytearray) -> Any:
    """paho's `_packet.decode_publish` for MQTT 5, to the same PublishPacket (and paho's own result, or its
    MalformedPacket, for whatever is unusual)."""
    try:
        n = len(packet)
        if n < 2:
            raise _Unusual
        tlen = (packet[0] << 8) | packet[1]
        pos = 2 + tlen
        qos = (header & 0x06) >> 1
        mid = 0
        if qos > 0:
            if pos + 2 > n:
                raise _Unusual
            mid = (packet[pos] << 8) | packet[pos + 1]
            pos += 2
        if pos >= n:
            raise _Unusual
        props, pos = read_properties(packet, pos)
        topic = bytes(packet[2:2 + tlen])
    except Exception:  # _Unusual, or a surprise (not UTF-8, ...): paho decides, and words its MalformedPacket
        return paho_private.paho_decode_publish(header, packet)
    with memoryview(packet) as view:
        payload = bytes(view[pos:])  # bytes, as paho's (one copy)
    return PublishPacket(dup=(header & 0x08) != 0, qos=qos, retain=(header & 0x01) != 0,
                                      topic=topic, mid=mid, properties=props, payload=payload)


def install(c: mqtt.Client) -> bool:
    """Decode this client's incoming PUBLISH packets with `decode_publish` (`paho_private.install_publish_decoder`:
    paho's `_handle_publish` otherwise unchanged). False (paho's own kept) when the version check turns the
    private paths off, or the client is not MQTT 5."""
    return paho_private.install_publish_decoder(c, decode_publish)
