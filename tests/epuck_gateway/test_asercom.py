"""asercom v2 codec: byte vectors from docs/reference/epuck2.md §6 (and §1/§3 for the shared layouts),
random segmentation, hypothesis round trips, garbage."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.epuck_gateway.protocol.asercom import (
    ALL_SENSORS_SIZE,
    ARG_SIZES,
    AsercomChainParser,
    AsercomImage,
    AsercomReplyReader,
    all_sensors_block,
    ascii_command,
    code_of,
    encode_chain,
    end_pending,
    expected_size,
    get_acc,
    get_all_sensors,
    get_ambient,
    get_battery,
    get_button,
    get_image,
    get_microphones,
    get_proximity,
    get_sd_state,
    get_steps,
    get_tof,
    parse_ascii_reply,
    sensors_packet,
    set_all_actuators,
    set_led,
    set_magnetometer,
    set_proximity_mode,
    set_rgb,
    set_speed,
    set_tof,
    wire_code,
)
from services.epuck_gateway.protocol.wifi import (
    SOUND_MARIO,
    EpuckCommand,
    EpuckRawSensors,
    ProtocolError,
)


def test_wire_codes_from_the_reference() -> None:
    # §6: -'N' = 0xB2, -'D' = 0xBC, -'I' = 0xB7, -0x08 = 0xF8, -0x09 = 0xF7
    assert get_proximity().encode() == b"\xb2"
    assert get_image().encode() == b"\xb7"
    assert get_all_sensors().encode() == b"\xf8"
    assert set_speed(200, -200).encode() == b"\xbc" + struct.pack("<hh", 200, -200)
    assert wire_code(ord("O")) == 0xB1 and code_of(0xB1) == ord("O")
    assert [c.encode()[0] for c in (get_button(), get_microphones(), get_tof(), get_sd_state())] == [
        0xF5, 0xF4, 0xF3, 0xF2]
    assert set_magnetometer(True).encode() == b"\xf1\x01"
    assert set_proximity_mode(2).encode() == b"\xf0\x02"
    assert set_tof(False).encode() == b"\xef\x00"
    assert set_rgb([(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]).encode() == b"\xf6" + bytes(range(1, 13))
    assert set_led(8, 1).encode() == b"\xb4\x08\x01"  # -'L'


def test_chain_ends_with_zero_and_replies_are_concatenated() -> None:
    chain = [get_all_sensors(), get_button()]
    assert encode_chain(chain) == b"\xf8\xf5\x00"
    assert expected_size(chain) == 104
    assert expected_size([get_image()]) == 3 + 40 * 40 * 2  # default camera: 40x40 RGB565


def test_set_all_actuators_is_the_wifi_command_bytes_2_to_20() -> None:
    # §3: the ESP32 copies bytes 2..20 of the 21-byte WiFi command as the -0x09 payload.
    cmd = EpuckCommand(request=3, settings=0x01, left=-500, right=1000, leds=0x21,
                       rgb=((100, 0, 0), (0, 100, 0), (0, 0, 100), (1, 2, 3)), sound=SOUND_MARIO)
    wifi = cmd.encode()
    frame = encode_chain([set_all_actuators(cmd), get_all_sensors()])
    assert frame == b"\xf7" + wifi[2:] + b"\xf8\x00"
    assert len(frame) == 22  # the ESP32's UART frame: 0xF7, 19 bytes, 0xF8, 0x00... minus its order
    assert frame[1:20] == bytes([0x01]) + struct.pack("<hh", -500, 1000) + bytes(
        [0x21, 100, 0, 0, 0, 100, 0, 0, 0, 100, 1, 2, 3, SOUND_MARIO])


def test_all_sensors_block_to_the_wifi_layout() -> None:
    # §1: the 103-byte block = WiFi bytes 0..101 + reserved; the ESP32 puts the button at 102.
    raw = EpuckRawSensors(acc=(1, -2, 768), proximity=tuple(range(8)), tof=123, battery=3400, selector=8,
                          ground_ambient=(7, 8, 9), button=1, reserved=0)
    wifi = raw.encode()
    block, button = all_sensors_block(wifi)
    assert len(block) == ALL_SENSORS_SIZE and button == 1 and block[:102] == wifi[:102]
    assert sensors_packet(block, button) == wifi
    assert EpuckRawSensors.decode(sensors_packet(block, 0)).button == 0
    with pytest.raises(ProtocolError):
        sensors_packet(block[:-1], 0)


def test_reply_reader_decodes_each_reply_in_order_and_counts_extra() -> None:
    chain = [set_all_actuators(EpuckCommand()), get_proximity(), get_acc(), get_steps(), get_battery(),
             get_button(), get_image()]
    pixels = bytes(range(256)) * 12 + bytes(3200 - 3072)
    reply = (struct.pack("<8H", *range(100, 108)) + struct.pack("<3h", -1, 2, 768) + struct.pack("<2h", -5, 5)
             + struct.pack("<H", 3100) + b"\x01" + bytes([1, 40, 40]) + pixels)
    assert len(reply) == expected_size(chain)
    r = AsercomReplyReader(chain)
    assert r.feed(reply[:50]) is None and r.pending == 50 - (16 + 6 + 4 + 2 + 1)  # into the image
    out = r.feed(reply[50:] + b"junk")
    assert out is not None and r.done and r.extra == 4
    values = {c.name: v for c, v in out}
    assert values["proximity"] == tuple(range(100, 108)) and values["acc"] == (-1, 2, 768)
    assert values["steps"] == (-5, 5) and values["battery"] == 3100 and values["button"] == 1
    assert values["image"] == AsercomImage(1, 40, 40, pixels)
    assert "set_all_actuators" not in values  # it answers nothing


def test_a_chain_with_no_answering_command_is_done_at_once() -> None:
    r = AsercomReplyReader([set_all_actuators(EpuckCommand())])
    assert r.done and r.feed(b"x") is None and r.extra == 1


@given(st.lists(st.sampled_from([get_all_sensors, get_button, get_proximity, get_ambient, get_acc, get_tof,
                                 get_microphones, get_sd_state, get_steps, get_battery]), min_size=1, max_size=6),
       st.data())
def test_any_chain_reply_in_any_segmentation(makers: list, data: st.DataObject) -> None:
    chain = [m() for m in makers]
    reply = data.draw(st.binary(min_size=expected_size(chain), max_size=expected_size(chain)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=8)))
    r = AsercomReplyReader(chain)
    results = None
    prev = 0
    for cut in [*cuts, len(reply)]:
        got = r.feed(reply[prev:cut])
        results = got if got is not None else results
        prev = cut
    assert results is not None and [c for c, _ in results] == chain and r.extra == 0


@given(st.lists(st.sampled_from([get_all_sensors(), get_button(), set_speed(100, -100), set_led(2, 1),
                                 set_all_actuators(EpuckCommand(left=5, sound=1)), set_magnetometer(True),
                                 get_image()]), min_size=1, max_size=5),
       st.lists(st.integers(1, 7), max_size=6))
def test_robot_side_parser_round_trips_chains_in_any_segmentation(chain: list, steps: list[int]) -> None:
    wire = encode_chain(chain) * 2
    p = AsercomChainParser()
    got: list = []
    i = 0
    for n in [*steps, len(wire)]:
        got += p.feed(wire[i:i + n])
        i += n
    assert [[(c.code, c.args) for c in g] for g in got] == [[(c.code, c.args) for c in chain]] * 2


@given(st.binary(max_size=300))
def test_robot_side_parser_never_crashes_on_garbage(data: bytes) -> None:
    p = AsercomChainParser()
    for item in p.feed(data):
        assert isinstance(item, (str, list))


def test_ascii_mode() -> None:
    assert ascii_command("D", 200, 200) == b"D,200,200\r"
    assert ascii_command("N") == b"N\r" and ascii_command("b") == b"b\r"  # b (battery) is not B (body LED)
    assert parse_ascii_reply(b"n,1,2,3,4,5,6,7,8\r\n") == ("n", [1, 2, 3, 4, 5, 6, 7, 8])
    assert parse_ascii_reply("d\r\n") == ("d", [])
    p = AsercomChainParser()
    assert p.feed(b"D,200,2") == [] and p.feed(b"00\rN\r") == ["D,200,200", "N"]
    with pytest.raises(ProtocolError):
        parse_ascii_reply(b"n,1,x\r\n")
    with pytest.raises(ProtocolError):
        ascii_command("DD")
    with pytest.raises(ProtocolError):
        set_proximity_mode(3)
    with pytest.raises(ProtocolError):
        set_speed(40000, 0)


def test_a_cut_chain_holds_its_partial_arguments_and_end_pending_ends_any_of_them() -> None:
    """As Asercom2.c reads its arguments (blocking getchar): `f7 00 00` waits for 17 more bytes, and the host's
    next poll (`f8 f5 00`) becomes three of them. `end_pending()` completes whatever argument list is open, for
    every command that takes arguments and however many of them are in, with zeros, and ends the chain: the
    chain that follows is read as written."""
    p = AsercomChainParser()
    assert p.feed(bytes([0xF7, 0x00, 0x00])) == [] and p.pending_args == 17
    assert p.feed(encode_chain([get_all_sensors(), get_button()])) == [] and p.pending_args == 14
    for code, n in ARG_SIZES.items():
        for given_args in range(n):
            q = AsercomChainParser()
            q.feed(bytes([(-code) & 0xFF]) + bytes(range(1, given_args + 1)))
            assert q.pending_args == n - given_args
            out = q.feed(end_pending() + encode_chain([set_speed(100, 100)]))
            assert q.pending_args == 0 and not q.in_line
            assert out[-1] == [set_speed(100, 100)], out
            cut = out[0]
            assert isinstance(cut, list) and cut[0].code == code
            assert cut[0].args[given_args:] == bytes(n - given_args)  # completed with zeros
    assert len(end_pending()) >= 19 + 1  # the reference's longest list (-0x09) and the chain's end
