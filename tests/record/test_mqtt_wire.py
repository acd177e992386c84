"""The recorder's MQTT 5 codec: byte vectors from the MQTT 5.0 standard, round trips, garbage."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.mqtt.wire import (
    PINGREQ_PACKET,
    ConnAck,
    Disconnect,
    MqttProtocolError,
    PacketReader,
    PingResp,
    PubAck,
    Publish,
    SubAck,
    decode_properties,
    encode_connect,
    encode_disconnect,
    encode_properties,
    encode_puback,
    encode_publish,
    encode_subscribe,
    encode_vbi,
)

# MQTT 5.0 section 1.5.5, table 1-1: the boundaries of 1..4-byte variable byte integers
VBI_VECTORS = [
    (0, "00"), (127, "7f"), (128, "8001"), (16_383, "ff7f"), (16_384, "808001"),
    (2_097_151, "ffff7f"), (2_097_152, "80808001"), (268_435_455, "ffffff7f"),
]


@pytest.mark.parametrize(("value", "hexed"), VBI_VECTORS)
def test_variable_byte_integer_vectors(value: int, hexed: str) -> None:
    assert encode_vbi(value).hex() == hexed


def test_variable_byte_integer_out_of_range() -> None:
    with pytest.raises(ValueError):
        encode_vbi(268_435_456)


def test_fixed_control_packets() -> None:
    assert bytes.fromhex("c000") == PINGREQ_PACKET  # 3.12: type 12, remaining length 0
    assert encode_puback(0x1234) == bytes.fromhex("40021234")  # 3.4.2.1: reason 0 may be left out
    assert encode_disconnect() == bytes.fromhex("e000")  # 3.14.2.1: normal disconnection, short form


def test_connect_bytes() -> None:
    # 3.1: "MQTT", version 5, flags (clean start, user, password), keepalive 60, properties
    # (session expiry 0x11 = 300), client id "c1", user "u", password "p"
    pkt = encode_connect("c1", keepalive=60, clean_start=True, username="u", password="p",
                         props={"session_expiry": 300})
    assert pkt.hex() == ("10" "1a" "00044d515454" "05" "c2" "003c" "05" "110000012c"
                         "00026331" "000175" "000170")


def test_subscribe_bytes_retain_as_published_and_handling() -> None:
    # 3.8: fixed header 0x82; packet id; no properties; filter "a/#" with options QoS 1 | RAP | RH=1
    pkt = encode_subscribe(7, ["a/#"], qos=1, retain_as_published=True, retain_handling=1)
    assert pkt.hex() == "82" "09" "0007" "00" "0003612f23" "19"


def test_publish_bytes_qos1_retained_with_properties() -> None:
    # 3.3: flags QoS 1 + RETAIN = 0x33; topic "t"; packet id 10; properties content type "a/b"
    pkt = encode_publish("t", b"hi", qos=1, retain=True, packet_id=10, props={"content_type": "a/b"})
    assert pkt.hex() == "33" "0e" "000174" "000a" "06" "030003612f62" "6869"
    (p,) = PacketReader().feed(pkt)
    assert p == Publish("t", b"hi", 1, True, False, 10, {"content_type": "a/b"})


def test_publish_without_properties_is_the_fast_path() -> None:
    (p,) = PacketReader().feed(bytes.fromhex("30" "06" "000174" "00" "6869"))
    assert isinstance(p, Publish) and p.props is None and p.payload == b"hi" and p.qos == 0


def test_broker_packets() -> None:
    packets = PacketReader().feed(
        bytes.fromhex("20" "03" "01" "00" "00")  # CONNACK session present, success, no properties
        + bytes.fromhex("90" "04" "0007" "00" "01")  # SUBACK id 7 granted QoS 1
        + bytes.fromhex("40" "02" "0009")  # PUBACK id 9
        + bytes.fromhex("d000")  # PINGRESP
        + bytes.fromhex("e0" "08" "8e" "06" "1f0003627965"))  # DISCONNECT 0x8E, reason string "bye"
    assert packets == [ConnAck(True, 0, {}), SubAck(7, [1]), PubAck(9, 0), PingResp(),
                       Disconnect(0x8E, {"reason_string": "bye"})]


def test_connack_refusal_with_properties() -> None:
    (ack,) = PacketReader().feed(bytes.fromhex("20" "06" "00" "86" "03" "210010"))
    assert ack == ConnAck(False, 0x86, {"receive_maximum": 16})


PROPS = st.fixed_dictionaries({}, optional={
    "content_type": st.text(max_size=30),
    "response_topic": st.text(min_size=1, max_size=40),
    "correlation_data": st.binary(max_size=40),
    "user_property": st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), min_size=1, max_size=3),
    "message_expiry": st.integers(0, 2**32 - 1),
    "payload_format": st.integers(0, 1),
    "subscription_id": st.integers(1, 268_435_455),
})
TOPIC = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="+#\x00"), min_size=1,
                max_size=60)


@settings(max_examples=200, deadline=None)
@given(topic=TOPIC, payload=st.binary(max_size=3000), qos=st.integers(0, 1), retain=st.booleans(),
       pid=st.integers(1, 65535), props=PROPS, cuts=st.lists(st.integers(0, 4000), max_size=5))
def test_publish_round_trip_split_anywhere(topic: str, payload: bytes, qos: int, retain: bool, pid: int,
                                           props: dict, cuts: list[int]) -> None:
    pkt = encode_publish(topic, payload, qos=qos, retain=retain, packet_id=pid if qos else 0, props=props)
    reader = PacketReader()
    out = []
    edges = sorted({min(c, len(pkt)) for c in cuts} | {0, len(pkt)})
    for a, b in itertools.pairwise(edges):
        out += reader.feed(pkt[a:b])
    assert out == [Publish(topic, payload, qos, retain, False, pid if qos else 0, props or None)]
    assert reader.buffered == 0


@settings(max_examples=100, deadline=None)
@given(props=PROPS)
def test_properties_round_trip(props: dict) -> None:
    raw = encode_properties(props)
    (n, start) = (raw[0], 1) if raw[0] < 0x80 else (None, None)
    if n is None:  # multi-byte length: decode through a PUBLISH instead
        (p,) = PacketReader().feed(encode_publish("t", b"", props=props))
        assert (p.props or {}) == props
        return
    assert decode_properties(raw, start, start + n) == props


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_is_a_protocol_error_or_packets_never_a_crash(data: bytes) -> None:
    try:
        PacketReader(max_packet=10_000).feed(data)
    except MqttProtocolError:
        pass


def test_specific_garbage_is_rejected_clearly() -> None:
    cases = {
        "34": "QoS 2",  # PUBLISH with QoS 2
        "a0": "unexpected packet type 10",  # UNSUBSCRIBE from a broker
        "32": "packet id 0",
    }
    bodies = {"34": "0400017400", "a0": "00", "32": "050001740000"}
    for first, why in cases.items():
        with pytest.raises(MqttProtocolError, match=why):
            PacketReader().feed(bytes.fromhex(first + bodies[first]))
    with pytest.raises(MqttProtocolError, match="longer than 4 bytes"):
        PacketReader().feed(bytes.fromhex("30ffffffff7f"))
    with pytest.raises(MqttProtocolError, match="exceeds the limit"):
        PacketReader(max_packet=100).feed(bytes.fromhex("30ff01"))
    with pytest.raises(MqttProtocolError, match="not UTF-8"):
        PacketReader().feed(bytes.fromhex("3004" "0001ff" "00"))
    with pytest.raises(MqttProtocolError, match="unknown property"):
        PacketReader().feed(bytes.fromhex("3006" "000174" "02" "7f00"))


def test_partial_packet_waits_for_the_rest() -> None:
    pkt = encode_publish("a/b", b"x" * 500, qos=1, packet_id=3)
    r = PacketReader()
    assert r.feed(pkt[:1]) == [] and r.feed(pkt[1:2]) == [] and r.feed(pkt[2:100]) == []
    (p,) = r.feed(pkt[100:])
    assert p.payload == b"x" * 500
