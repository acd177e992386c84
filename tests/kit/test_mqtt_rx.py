"""shared/mqtt/rx.py decodes received PUBLISH packets past paho's own routine: each packet must come out exactly
as paho's decoder makes it (the same fields, properties and bytes), and whatever paho refuses it must refuse the
same way. Checked on generated packets, well-formed and not."""

from __future__ import annotations

import struct
import uuid
from typing import Any

import paho.mqtt.client as mqtt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt import _packet

from shared.mqtt.rx import ReceivedProperties, decode_publish
from shared.mqtt.session import MqttSession, reply_properties, unique_client_id
from shared.rpc import wait_for
from tests.fixtures import Broker

_TABLES = ("packetType", "types", "names", "properties")


def _utf(s: bytes) -> bytes:
    return struct.pack("!H", len(s)) + s


def _vbi(n: int) -> bytes:
    out = b""
    while True:
        d, n = n % 128, n // 128
        out += bytes([d | (0x80 if n else 0)])
        if not n:
            return out


# one property's bytes: the common ones, and what paho refuses or decodes oddly
text = st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass"))
prop = st.one_of(
    st.tuples(st.sampled_from([3, 8]), text).map(lambda t: bytes([t[0]]) + _utf(t[1])),
    st.binary(max_size=40).map(lambda b: b"\x09" + _utf(b)),
    st.tuples(text, text).map(lambda t: b"\x26" + _utf(t[0]) + _utf(t[1])),
    st.integers(0, 3).map(lambda v: bytes([1, v])),
    st.integers(0, 2**32 - 1).map(lambda v: b"\x02" + struct.pack("!L", v)),
    st.integers(0, 65535).map(lambda v: b"\x23" + struct.pack("!H", v)),
    st.integers(0, 300).map(lambda v: b"\x0b" + _vbi(v)),
    st.sampled_from([b"\x11\x00\x00\x00\x01", b"\x03\x00\x01\x00", b"\x08\x00\x03\xef\xbb\xbf", b"\x09\x00\x05ab",
                     b"\x03\x00\x02\xc3", b"\x81\x01", b"\x2a\x01", b"\x00"]),
)


@st.composite
def publish(draw: Any) -> tuple[int, bytes]:
    qos = draw(st.integers(0, 2))
    header = 0x30 | (qos << 1) | draw(st.integers(0, 1)) | (draw(st.integers(0, 1)) << 3)
    body = _utf(draw(st.binary(max_size=30)))
    if qos:
        body += struct.pack("!H", draw(st.integers(0, 65535)))
    props = b"".join(draw(st.lists(prop, max_size=8)))
    plen = len(props) + draw(st.sampled_from([0, 0, 0, -1, 1, -3]))  # a lying length, now and then
    body += _vbi(max(0, plen)) + props + draw(st.binary(max_size=30))
    cut = draw(st.sampled_from([None, None, None, 1, 3, 7]))  # a truncated packet, now and then
    if cut is not None:
        body = body[:-cut] if cut < len(body) else b""
    return header, body


def _outcome(fn: Any) -> tuple[Any, ...]:
    try:
        r = fn()
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    props = r.properties
    state = {k: v for k, v in vars(props).items() if k not in _TABLES}
    return ("ok", r.dup, r.qos, r.retain, r.topic, r.mid, state, props.pack(), str(props), type(r.payload),
            r.payload, type(r.topic))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(publish())
def test_decode_matches_paho(packet: tuple[int, bytes]) -> None:
    header, body = packet
    for buf in (body, bytearray(body)):  # paho's receive buffer is a bytearray
        assert _outcome(lambda b=buf: decode_publish(header, b)) == \
            _outcome(lambda b=buf: _packet.decode_publish(header, bytes(b), mqtt.MQTTv5))


def test_a_command_request_takes_the_fast_path() -> None:
    """The shortcut must actually be taken for what the kit receives (not fall back to paho every time)."""
    props = reply_properties("robobus/_client/c-0123456789/reply", b"\x00\xff" * 8, "application/json")
    props.UserProperty = [("trace", "abc"), ("trace", "def")]
    body = _utf(b"robobus/n/d/cmd/x") + b"\x00\x07" + props.pack() + b'{"a":1}'
    r = decode_publish(0x32, bytearray(body))
    assert isinstance(r.properties, ReceivedProperties)
    assert r.properties.UserProperty == [("trace", "abc"), ("trace", "def")]
    assert (r.topic, r.mid, r.payload) == (b"robobus/n/d/cmd/x", 7, b'{"a":1}')
    assert _outcome(lambda: r) == _outcome(lambda: _packet.decode_publish(0x32, body, mqtt.MQTTv5))


def test_received_properties_over_a_broker(broker_session: Broker) -> None:
    """End to end through mosquitto: what the sender set is what the handler reads."""
    topic = f"robobus/test/rx/{uuid.uuid4().hex[:8]}"
    got: list[mqtt.MQTTMessage] = []
    sub = MqttSession(broker_session.settings(), unique_client_id("rx-sub"))
    pub = MqttSession(broker_session.settings(), unique_client_id("rx-pub"))
    assert sub.fast_decode
    sub.subscribe(topic, got.append, qos=2)  # QoS 2 delivered as such: paho's PUBREC path too
    sub.start()
    pub.start()
    try:
        assert sub.wait_ready(10) and pub.wait_connected(10)
        for qos in (0, 1, 2):
            props = reply_properties("r/t\u00e9", bytes([qos]) * 16, "application/json")
            props.UserProperty = ("k", str(qos))
            assert pub.publish(topic, b"x" * 100_000 + bytes([qos]), qos=qos, properties=props)
        assert wait_for(lambda: len(got) == 3, 10), len(got)
        for m in sorted(got, key=lambda m: m.payload[-1]):
            q = m.payload[-1]
            assert (m.topic, len(m.payload), m.qos) == (topic, 100_001, q)
            p = m.properties
            assert (p.ResponseTopic, p.CorrelationData, p.ContentType, p.UserProperty) == \
                ("r/t\u00e9", bytes([q]) * 16, "application/json", [("k", str(q))])
    finally:
        pub.stop()
        sub.stop()
