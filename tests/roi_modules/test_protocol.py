"""ROI wire format: byte vectors from docs/reference/roi.md §2/§3, the original's defects, round trips, garbage."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.roi_modules import protocol as p


def test_general_packet_layout_vector() -> None:
    # §2.1: subDeviceID u16 BE | action u16 BE | checksum u16 BE | 56 payload bytes; 64 on the wire
    pkt = p.GeneralPacket(0x0102, 0x0003, bytes([0x10, 0x20]))
    raw = pkt.encode()
    assert len(raw) == p.DATAGRAM_SIZE == 64
    # checksum (§2.3): 0x0102 + 0x0003 + 0x10 + 0x20 = 0x0135
    assert raw[:8] == bytes.fromhex("0102 0003 0135 1020")
    assert raw[8:] == bytes(56)


def test_sysadmin_packet_layout_vector() -> None:
    # §2.2: meta u16 | origin u8 | action u16 | checksum u16 | payload; PING from host 100 with chain meta
    pkt = p.SysAdminPacket(p.SysAdminAction.PING, b"", meta=p.chain_meta(100), origin=100)
    raw = pkt.encode()
    assert len(raw) == 64
    # checksum: 0x8064 + 0x64 + 0x4000 = 0xC0C8
    assert raw[:7] == bytes.fromhex("8064 64 4000 C0C8")
    assert raw[7:] == bytes(57)


def test_checksum_wraps_at_16_bits_and_covers_all_56_payload_bytes() -> None:
    pkt = p.GeneralPacket(0xFFFF, 0xFFFF, bytes([0xFF] * 56))
    assert pkt.checksum == (0xFFFF + 0xFFFF + 56 * 0xFF) & 0xFFFF
    raw = bytearray(pkt.encode())
    raw[6 + 55] ^= 0x01  # the last payload byte is covered
    with pytest.raises(p.DecodeError) as e:
        p.decode_general(bytes(raw))
    assert e.value.reason == "checksum"


def test_original_status_report_test_datagram() -> None:
    # testing/pingStatusReport.py sends these 7 bytes: meta 0, origin 0xE7, STATUS_REPORT, checksum 0x20E7.
    # Its checksum is wrong (0xA0E7 is right); the firmware ignores that (§2.4), we do not.
    raw = (0b00000000000000001110011110100000000000000010000011100111).to_bytes(7, "big")
    pkt, ok = p.decode_sysadmin(raw, verify=False)
    assert (pkt.meta, pkt.origin, pkt.action, ok) == (0, 0xE7, p.SysAdminAction.STATUS_REPORT, False)
    with pytest.raises(p.DecodeError):
        p.decode_sysadmin(raw)


def test_sysadmin_packet_not_sliced_into_general_layout() -> None:
    """§4.5: sendSysadminPacket took a Packet by value and serialised SysAdmin packets in the general layout."""
    pkt = p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, b"", meta=0, origin=100)
    raw = pkt.encode()
    assert raw[2] == 100 and raw[3:5] == b"\xa0\x00"  # origin at 2, action at 3..4: SysAdmin layout
    sliced = p.GeneralPacket(0, p.SysAdminAction.STATUS_REPORT).encode()  # what the original put on the wire
    assert raw != sliced
    back, ok = p.decode_sysadmin(raw)
    assert ok and (back.meta, back.origin, back.action) == (0, 100, p.SysAdminAction.STATUS_REPORT)


def test_code_tables() -> None:
    S = p.SysAdminAction
    assert (S.PING, S.PONG, S.PING_LOOP_BACK, S.STATUS_REPORT, S.BLACK_LIST, S.FIRMWARE_REPORT) == (
        0x4000, 0xC000, 0x2000, 0xA000, 0x6000, 0xE000)
    assert p.sysadmin_reply_action(S.PING) == S.PONG and p.sysadmin_reply_action(S.STATUS_REPORT) == S.STATUS_REPORT
    assert [m.value for m in p.ModuleState] == list(range(7))
    assert (p.ModuleType.MASTER_SBC, p.ModuleType.GENERAL_GPIO, p.ModuleType.O_DRIVE, p.ModuleType.ACTUATOR) == (
        2, 3, 4, 5)
    assert p.module_type_name(0) == "reserved" and p.module_type_name(4) == "odrive"
    assert [b.value for b in p.BlacklistOp] == [0, 1, 2, 3, 4]
    assert (p.GpioAction.SET_PIN_MODE, p.GpioAction.SET_OUTPUT, p.GpioAction.READ) == (1, 2, 3)
    assert (p.PinMode.INPUT, p.PinMode.INPUT_PULLUP, p.PinMode.OUTPUT) == (1, 2, 3)
    assert p.GPIO_PINS == (0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17)
    od = p.OdriveAction
    sets = (od.SET_CONTROL_MODE, od.SET_INPUT_MODE, od.SET_TORQUE, od.SET_POSITION, od.SET_VELOCITY,
            od.SET_RELATIVE_POSITION, od.CLEAR_ERRORS)
    assert sets == (0, 1, 2, 3, 4, 5, 6)
    assert (od.GET_CONTROL_MODE, od.GET_ERROR, od.GET_POSITION, od.GET_CURRENT, od.GET_MOTOR_TEMPERATURE,
            od.GET_KINEMATIC_FEEDBACK, od.GET_ALL) == (0x80, 0x86, 0x87, 0x8A, 0x8C, 0x8D, 0xE4)
    assert od.GET_ALL == p.ODRIVE_GETMASK | p.OdriveRef.ALL
    assert [c.value for c in p.ControlMode] == [0, 1, 2] and [m.value for m in p.InputMode] == [0, 1, 2, 3, 4]
    A = p.ActuatorAction
    assert (A.SET_RELATIVE_LENGTH, A.SET_ABSOLUTE_LENGTH, A.GET_CURRENT_LENGTH, A.SET_VELOCITY,
            A.GET_CURRENT_VELOCITY, A.GET_LAST_HOME, A.SET_CONTROL, A.GET_CONTROL) == (
        0x0000, 0x0001, 0x8003, 0x0010, 0x8012, 0x8020, 0x0030, 0x8031)


def test_get_fet_temperature_collides_with_set_control_mode() -> None:
    """§3.6: GETMASK & FETTemperature == 0x00 == SET_CONTROL_MODE; the host never sends it."""
    assert p.GET_FET_TEMPERATURE_FIRMWARE == p.OdriveAction.SET_CONTROL_MODE == 0
    with pytest.raises(ValueError, match="GET_ALL"):
        p.odrive_request(p.GET_FET_TEMPERATURE_FIRMWARE)
    # the FET temperature comes from GET_ALL bytes 16..19
    allv = p.OdriveAll(1.0, 2.0, 24.0, 0.5, 41.5, 30.0, 0)
    assert p.OdriveAll.decode(allv.encode()).fet_temperature == 41.5


def test_get_bit_stripped_with_bitwise_not() -> None:
    """§4.5: `code & !GETMASK` is always 0 (every reply decoded as ControlMode); we use `& ~GETMASK`."""
    assert p.odrive_ref(p.OdriveAction.GET_POSITION) == p.OdriveRef.POSITION
    assert p.odrive_ref(p.OdriveAction.GET_ALL) == p.OdriveRef.ALL
    assert p.odrive_ref(p.OdriveAction.GET_ERROR) == p.OdriveRef.ERROR
    assert p.odrive_ref(p.OdriveAction.SET_VELOCITY) == p.OdriveRef.VELOCITY_SETPOINT
    assert p.odrive_is_get(p.OdriveAction.GET_ALL) and not p.odrive_is_get(p.OdriveAction.SET_TORQUE)


def test_get_all_vector_and_error_names() -> None:
    payload = (struct.pack(">6f", 1.5, -0.25, 24.0, 1.0, 40.0, 35.0) + bytes.fromhex("00002001"))
    allv = p.OdriveAll.decode(payload + bytes(28))
    assert allv == p.OdriveAll(1.5, -0.25, 24.0, 1.0, 40.0, 35.0, 0x2001)
    assert p.odrive_error_names(0x2001) == ["INITIALIZING", "MOTOR_OVER_TEMP"]
    assert p.odrive_error_text(0) == ""
    assert p.odrive_error_names(0x80000000) == ["UNKNOWN_0x80000000"]
    assert "CALIBRATION_ERROR" in p.odrive_error_text(0x40000000)


def test_odrive_request_payloads() -> None:
    assert p.odrive_request(p.OdriveAction.SET_POSITION, 1.5).payload == bytes.fromhex("3fc00000")
    assert p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, p.ControlMode.VELOCITY).payload == b"\x01"
    assert p.odrive_request(p.OdriveAction.GET_ALL).payload == b""
    for bad in (float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError):
            p.odrive_request(p.OdriveAction.SET_VELOCITY, bad)


def test_supply_voltage_is_millivolts() -> None:
    """§3.2: the firmware sends millivolts; the original divided by 100 and reported 10x the voltage."""
    payload = bytes([1, 2, 3, 4]) + (4987).to_bytes(2, "big") + bytes([4, 71]) + bytes.fromhex("02aabbccddee")
    rep = p.StatusReport.decode(payload + bytes(42))
    assert rep.supply_mv == 4987 and rep.supply_volts == pytest.approx(4.987)


def test_mac_read_from_bytes_8_to_13() -> None:
    """§3.2: base.cpp read the MAC from data[7..12], which includes the neighbour octet."""
    payload = bytes([1, 0, 1, 5]) + (5000).to_bytes(2, "big") + bytes([3, 71]) + bytes.fromhex("02aabbccddee")
    rep = p.StatusReport.decode(payload)
    assert rep.neighbour == 71 and rep.mac == bytes.fromhex("02aabbccddee") and rep.mac_text == "02:aa:bb:cc:dd:ee"
    assert rep.uptime_s == 65 and rep.module_type == 3 and rep.state == 1
    assert p.StatusReport.decode(rep.encode()) == rep


def test_pong_blacklist_and_firmware_report_payloads() -> None:
    assert p.Pong.decode(bytes([1, 4])) == p.Pong(True, 4)
    assert p.blacklist_payload(p.BlacklistOp.ADD, 42) == bytes([2, 42])
    with pytest.raises(ValueError):
        p.blacklist_payload(p.BlacklistOp.BLACKLISTED, 1)
    assert p.decode_blacklist_list(bytes([7, 9, 0, 11]) + bytes(52)) == [7, 9]
    rep = p.encode_firmware_report("12:34:56", "Oct 23 2025")
    assert rep[0] == len("12:34:56\nOct 23 2025")
    assert p.decode_firmware_report(rep + bytes(20)) == ("12:34:56", "Oct 23 2025")
    with pytest.raises(p.DecodeError):
        p.decode_firmware_report(bytes(56))


def test_gpio_read_values() -> None:
    assert p.gpio_read_value(3, bytes([1, 0])) == 1
    assert p.gpio_read_value(12, bytes([0x03, 0xFF])) == 1023


def test_short_and_long_datagrams_are_decode_errors() -> None:
    for raw in (b"", b"\x00" * 5):
        with pytest.raises(p.DecodeError) as e:
            p.decode_general(raw)
        assert e.value.reason == "short"
    with pytest.raises(p.DecodeError):
        p.decode_sysadmin(b"\x00" * 6)
    with pytest.raises(p.DecodeError) as e:
        p.decode_general(bytes(65))
    assert e.value.reason == "long"
    # a header-only general packet is valid (the firmware imports >= 6 bytes); the payload reads as zeros
    pkt, ok = p.decode_general(p.GeneralPacket(1, 2).encode()[:6])
    assert ok and pkt.payload == bytes(56)


def test_out_of_range_fields_are_refused() -> None:
    with pytest.raises(ValueError):
        p.GeneralPacket(0x10000, 0)
    with pytest.raises(ValueError):
        p.GeneralPacket(0, 0, bytes(57))
    with pytest.raises(ValueError):
        p.SysAdminPacket(0, b"", 0, 256)


payloads = st.binary(max_size=56)


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), payloads)
def test_general_round_trip(sub: int, action: int, payload: bytes) -> None:
    pkt = p.GeneralPacket(sub, action, payload)
    back, ok = p.decode_general(pkt.encode())
    assert ok and back.sub_device_id == sub and back.action == action
    assert back.payload == payload + bytes(56 - len(payload))


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0xFFFF), payloads)
def test_sysadmin_round_trip(meta: int, origin: int, action: int, payload: bytes) -> None:
    pkt = p.SysAdminPacket(action, payload, meta, origin)
    back, ok = p.decode_sysadmin(pkt.encode())
    assert ok and (back.meta, back.origin, back.action) == (meta, origin, action)
    assert back.payload[:len(payload)] == payload


@given(st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_float_round_trip(v: float) -> None:
    assert p.read_f32(p.f32(v)) == v


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=6, max_size=6),
       st.integers(0, 0xFFFFFFFF))
def test_get_all_round_trip(vals: list[float], err: int) -> None:
    allv = p.OdriveAll(*vals, error=err)
    assert p.OdriveAll.decode(allv.encode()) == allv


@given(st.binary(max_size=80))
def test_garbage_never_raises_anything_but_decode_error(raw: bytes) -> None:
    for decode in (p.decode_general, p.decode_sysadmin):
        try:
            decode(raw)
        except p.DecodeError as exc:
            assert exc.reason in ("short", "long", "checksum")
    if len(raw) >= 14:
        p.StatusReport.decode(raw)
    if len(raw) >= 28:
        p.OdriveAll.decode(raw)
    p.decode_blacklist_list(raw)
    if raw:
        try:
            p.decode_firmware_report(raw + bytes(56))
        except p.DecodeError:
            pass
