"""Codec vectors, the stream parser in random segmentations, garbage, the command state machine."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.epuck_gateway.image import rgb565_image
from services.epuck_gateway.protocol.wifi import (
    COMMAND_SIZE,
    IMAGE_SIZE,
    SENSORS_SIZE,
    SET_CALIBRATE_IR,
    SET_OBSTACLE_AVOIDANCE,
    SET_STEPS,
    SOUND_MARIO,
    SOUND_STOP,
    EmptyPacket,
    EpuckCommand,
    EpuckController,
    EpuckRawSensors,
    EpuckStreamParser,
    FramingError,
    ImagePacket,
    ProtocolError,
    SensorsPacket,
    StepUnwrapper,
    acc_to_g,
    battery_volts,
    gyro_to_dps,
    rgb565_to_rgb888,
    stop_command,
)


# -- sensors: one distinct value per field, placed at the reference's offsets by hand --------------
def reference_vector() -> tuple[bytes, dict[str, object]]:
    """Built with pack_into at the offsets of reference section 2, independent of the codec's format."""
    b = bytearray(SENSORS_SIZE)
    expect: dict[str, object] = {}

    def put(fmt: str, off: int, *vals: object) -> None:
        struct.pack_into("<" + fmt, b, off, *vals)

    put("3h", 0, -101, 202, 768); expect["acc"] = (-101, 202, 768)  # noqa: E702
    put("f", 6, 789.5); expect["acceleration"] = 789.5  # noqa: E702
    put("f", 10, 123.25); expect["orientation"] = 123.25  # noqa: E702
    put("f", 14, 45.5); expect["inclination"] = 45.5  # noqa: E702
    put("3h", 18, -303, 404, -505); expect["gyro"] = (-303, 404, -505)  # noqa: E702
    put("3f", 24, 12.5, -34.75, 56.125); expect["mag"] = (12.5, -34.75, 56.125)  # noqa: E702
    put("b", 36, -7); expect["temperature"] = -7  # noqa: E702
    prox = tuple(1000 + i for i in range(8))
    put("8H", 37, *prox); expect["proximity"] = prox  # noqa: E702
    amb = tuple(3000 + i for i in range(8))
    put("8H", 53, *amb); expect["ambient"] = amb  # noqa: E702
    put("H", 69, 1234); expect["tof"] = 1234  # noqa: E702
    put("4H", 71, 11, 22, 33, 44); expect["mic"] = (11, 22, 33, 44)  # noqa: E702
    put("2h", 79, -12345, 23456); expect["steps"] = (-12345, 23456)  # noqa: E702
    put("H", 83, 3441); expect["battery"] = 3441  # noqa: E702
    put("B", 85, 1); expect["sd_state"] = 1  # noqa: E702
    put("B", 86, 2); expect["tv_toggle"] = 2  # noqa: E702
    put("B", 87, 3); expect["tv_address"] = 3  # noqa: E702
    put("B", 88, 4); expect["tv_data"] = 4  # noqa: E702
    put("B", 89, 15); expect["selector"] = 15  # noqa: E702
    put("3H", 90, 901, 902, 903); expect["ground_proximity"] = (901, 902, 903)  # noqa: E702
    put("3H", 96, 601, 602, 603); expect["ground_ambient"] = (601, 602, 603)  # noqa: E702
    put("B", 102, 1); expect["button"] = 1  # noqa: E702
    put("B", 103, 9); expect["reserved"] = 9  # noqa: E702
    return bytes(b), expect


def test_sensors_vector_every_field_at_its_offset() -> None:
    data, expect = reference_vector()
    s = EpuckRawSensors.decode(data)
    for name, value in expect.items():
        assert getattr(s, name) == value, name
    assert s.encode() == data
    assert set(EpuckRawSensors.FIELD_OFFSETS) == set(expect)


def test_sensor_units() -> None:
    assert acc_to_g(768) == pytest.approx(1.0)
    assert gyro_to_dps(131) == pytest.approx(0.99945, rel=1e-4)
    assert battery_volts(3441) == pytest.approx(4.2, abs=0.01)
    assert battery_volts(2785) == pytest.approx(3.4, abs=0.01)


def test_sensors_wrong_length() -> None:
    with pytest.raises(ProtocolError):
        EpuckRawSensors.decode(b"\x00" * 103)


i16 = st.integers(-0x8000, 0x7FFF)
u16 = st.integers(0, 0xFFFF)
u8 = st.integers(0, 255)
f32 = st.floats(width=32, allow_nan=False)


@st.composite
def raw_sensors(draw: st.DrawFn) -> EpuckRawSensors:
    return EpuckRawSensors(
        acc=(draw(i16), draw(i16), draw(i16)), acceleration=draw(f32), orientation=draw(f32),
        inclination=draw(f32), gyro=(draw(i16), draw(i16), draw(i16)), mag=(draw(f32), draw(f32), draw(f32)),
        temperature=draw(st.integers(-128, 127)), proximity=tuple(draw(u16) for _ in range(8)),
        ambient=tuple(draw(u16) for _ in range(8)), tof=draw(u16),
        mic=(draw(u16), draw(u16), draw(u16), draw(u16)), steps=(draw(i16), draw(i16)), battery=draw(u16),
        sd_state=draw(u8), tv_toggle=draw(u8), tv_address=draw(u8), tv_data=draw(u8), selector=draw(u8),
        ground_proximity=(draw(u16), draw(u16), draw(u16)), ground_ambient=(draw(u16), draw(u16), draw(u16)),
        button=draw(u8), reserved=draw(u8))


@given(raw_sensors())
def test_sensors_roundtrip(s: EpuckRawSensors) -> None:
    data = s.encode()
    assert len(data) == SENSORS_SIZE
    assert EpuckRawSensors.decode(data) == s


# -- command ---------------------------------------------------------------------------------------
def test_command_vector_every_field_at_its_offset() -> None:
    cmd = EpuckCommand(request=3, settings=0x05, left=-1000, right=999, leds=0x2A,
                       rgb=((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 100)), sound=0x10)
    b = cmd.encode()
    assert len(b) == COMMAND_SIZE
    assert b[0] == 0x80 and b[1] == 3 and b[2] == 0x05
    assert struct.unpack_from("<h", b, 3)[0] == -1000
    assert struct.unpack_from("<h", b, 5)[0] == 999
    assert b[7] == 0x2A
    assert list(b[8:20]) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 100]  # LED2 RGB at 8, LED8 at 17
    assert b[20] == 0x10
    assert EpuckCommand.decode(b) == cmd


@given(u8, u8, i16, i16, u8, st.lists(st.integers(0, 100), min_size=12, max_size=12), u8)
def test_command_roundtrip(req: int, sett: int, left: int, right: int, leds: int, rgb: list[int],
                           sound: int) -> None:
    c = EpuckCommand(req, sett, left, right, leds,
                     (tuple(rgb[0:3]), tuple(rgb[3:6]), tuple(rgb[6:9]), tuple(rgb[9:12])),  # type: ignore[arg-type]
                     sound)
    assert EpuckCommand.decode(c.encode()) == c


def test_command_rejects() -> None:
    with pytest.raises(ProtocolError):
        EpuckCommand(left=40000).encode()
    with pytest.raises(ProtocolError):
        EpuckCommand.decode(b"\x81" + bytes(20))
    with pytest.raises(ProtocolError):
        EpuckCommand.decode(b"\x80" + bytes(19))


def test_stop_command() -> None:
    b = stop_command().encode()
    assert b == bytes([0x80, 0, 0, 0, 0, 0, 0, 0]) + bytes(12) + bytes([SOUND_STOP])


# -- stream parser ---------------------------------------------------------------------------------
packet_st = st.one_of(
    st.just(b"\x03"),
    raw_sensors().map(lambda s: b"\x02" + s.encode()),
    st.integers(0, 255).map(lambda v: b"\x01" + bytes([v]) * IMAGE_SIZE),
)


def expected_events(packets: list[bytes]) -> list[object]:
    out: list[object] = []
    for p in packets:
        if p[0] == 1:
            out.append(ImagePacket(p[1:]))
        elif p[0] == 2:
            out.append(SensorsPacket(p[1:]))
        else:
            out.append(EmptyPacket())
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(packet_st, max_size=6), st.data())
def test_parser_random_segmentation(packets: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(packets)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=30))))
    parser = EpuckStreamParser()
    events: list[object] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        events += parser.feed(stream[prev:c])
        prev = c
    assert events == expected_events(packets)
    assert parser.packets == len(packets) and parser.framing_errors == 0
    assert not parser.in_packet


def test_parser_one_byte_at_a_time() -> None:
    s = EpuckRawSensors(acc=(1, 2, 3), tof=77)
    packets = [b"\x03", b"\x02" + s.encode(), b"\x01" + bytes(range(256)) * 150, b"\x03", b"\x02" + s.encode()]
    stream = b"".join(packets)
    parser = EpuckStreamParser()
    events: list[object] = []
    for i in range(len(stream)):
        events += parser.feed(stream[i:i + 1])
    assert events == expected_events(packets)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(1, 64), max_size=20))
def test_parser_garbage_never_crashes(garbage: bytes, chunks: list[int]) -> None:
    parser = EpuckStreamParser()
    events: list[object] = []
    pos = 0
    for n in [*chunks, len(garbage)]:
        events += parser.feed(garbage[pos:pos + n])
        pos += n
    errors = [e for e in events if isinstance(e, FramingError)]
    assert len(errors) <= 1
    if errors:
        assert events[-1] == errors[0]  # nothing after a framing error until reset
        assert parser.broken and parser.framing_errors == 1
        assert errors[0].bad_id not in (1, 2, 3)
        assert parser.feed(b"\x03") == []


def test_parser_framing_error_then_reset() -> None:
    parser = EpuckStreamParser()
    ev = parser.feed(b"\x03\x03\x7f\x03")
    assert ev[:2] == [EmptyPacket(), EmptyPacket()]
    assert ev[2] == FramingError(bad_id=0x7F, offset=2)
    parser.reset()
    assert parser.feed(b"\x03") == [EmptyPacket()]
    assert parser.framing_errors == 1


def test_parser_zero_id_is_an_error() -> None:
    # 0x00 is "reserved": no size is known for it, so it cannot be skipped
    assert isinstance(EpuckStreamParser().feed(b"\x00")[0], FramingError)


# -- image -----------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32))
def test_pillow_565_matches_reference_decoder(seed: int) -> None:
    data = random.Random(seed).randbytes(IMAGE_SIZE)
    assert rgb565_image(data).tobytes() == rgb565_to_rgb888(data)


def test_565_big_endian() -> None:
    assert rgb565_to_rgb888(b"\xf8\x00\x07\xe0\x00\x1f") == bytes([255, 0, 0, 0, 255, 0, 0, 0, 255])


# -- step unwrap -----------------------------------------------------------------------------------
def test_step_unwrap_across_int16() -> None:
    u = StepUnwrapper()
    assert u.update(32000) == 32000
    assert u.update(-32536) == 33000  # 33000 truncated to int16
    assert u.update(-32636) == 32900
    assert u.update(32000) == 32000


# -- controller ------------------------------------------------------------------------------------
def test_controller_oneshots_cleared_after_a_later_packet() -> None:
    c = EpuckController()
    c.set_speed(100, -100)
    c.calibrate_ir()
    c.play(SOUND_MARIO)
    cmd = c.build()
    assert cmd.settings & SET_CALIBRATE_IR and cmd.sound == SOUND_MARIO
    assert (cmd.left, cmd.right) == (100, -100)
    c.sent(packets_done=10, mid_packet=True)
    assert not c.clear_due(10)
    assert not c.clear_due(11)  # the packet that was arriving when we sent
    assert c.clear_due(12)
    clear = c.build()
    assert clear.settings == 0 and clear.sound == 0 and not c.awaiting_clear
    assert (clear.left, clear.right) == (100, -100)


def test_controller_set_steps_is_oneshot() -> None:
    c = EpuckController()
    c.set_speed(200, 200)
    c.set_steps(-5, 7)
    cmd = c.build()
    assert cmd.settings & SET_STEPS and (cmd.left, cmd.right) == (-5, 7)
    nxt = c.build()
    assert not nxt.settings & SET_STEPS and (nxt.left, nxt.right) == (200, 200)


def test_controller_link_up_never_resumes_motion() -> None:
    c = EpuckController()
    c.set_speed(500, 500)
    c.obstacle_avoidance = True
    c.set_leds(led1=True, front=True)
    c.set_leds(led1=False, body=True)
    c.set_rgb([(1, 2, 3), None, None, (100, 0, 0)])
    c.calibrate_ir()
    first = c.on_link_up()
    assert (first.left, first.right) == (0, 0)
    assert first.settings == SET_OBSTACLE_AVOIDANCE
    assert first.leds == 0x30 and first.rgb[0] == (1, 2, 3) and first.rgb[3] == (100, 0, 0)


def test_controller_rejects_out_of_range() -> None:
    c = EpuckController()
    with pytest.raises(ProtocolError):
        c.set_speed(1001, 0)
    with pytest.raises(ProtocolError):
        c.set_rgb([(101, 0, 0), None, None, None])
    with pytest.raises(ProtocolError):
        c.play(0x03)
    c.set_stream(image=False, sensors=None)
    assert c.request == 2


def test_parser_says_how_much_of_the_packet_in_progress_is_missing() -> None:
    p = EpuckStreamParser()
    assert p.missing() == 0
    p.feed(bytes([0x01]) + bytes(1000))  # an image begun: the link waits for the rest in one wake-up
    assert p.missing() == IMAGE_SIZE - 1000
    p.feed(bytes(IMAGE_SIZE - 1000) + bytes([0x02]) + bytes(4))
    assert p.missing() == SENSORS_SIZE - 4
    p.feed(bytes(SENSORS_SIZE - 4))
    assert p.missing() == 0
    p.feed(bytes([0x07]))  # framing error: nothing more is awaited
    assert p.missing() == 0
