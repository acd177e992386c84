"""Codec vectors built from the reference tables (docs/reference/shadow_ethercat.md §1), a distinct value in every
field,
plus hypothesis round trips and garbage."""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from services.can_bootloader.protocol import BootCommand
from services.ethercat_loop import protocol as p


def test_sizes_and_product_codes():
    assert (p.PROTOCOLS["0220"].command_size, p.PROTOCOLS["0220"].status_size) == (70, 232)
    assert (p.PROTOCOLS["0230"].command_size, p.PROTOCOLS["0230"].status_size) == (74, 428)
    assert p.protocol_for_product(6).name == "0220"
    assert p.protocol_for_product(0x01000001).name == "0230"
    assert [sm[0] for sm in p.PROTOCOLS["0220"].sync_managers] == [0x1000, 0x103A, 0x1046, 0x1122]
    assert [sm[0] for sm in p.PROTOCOLS["0230"].sync_managers] == [0x1000, 0x103E, 0x104A, 0x11EA]


def test_enums_follow_current_headers():
    assert p.EDC_COMMAND.CAN_DIRECT_MODE == 4  # not the seed's 5
    assert len(p.SENSOR_NAMES) == 37 and p.SENSOR_NAMES[36] == "IGNORE"
    assert p.SENSOR_INDEX["GYRX"] == 29 and p.SENSOR_INDEX["AN0"] == 32 and p.SENSOR_INDEX["WRJ1A"] == 23
    assert len(p.JOINT_NAMES) == 28 and len(p.ACTUATED_JOINTS) == 20
    assert p.SERIOUS_ERROR_FLAGS == 0xE400
    assert p.flag_names(0x8403) == ["current_choke_3", "no_demand_seen", "over_temperature"]
    assert p.serious_flags(0x0020) == []
    assert p.channel_word(*p.EXPECTED_CHANNELS["LFJ5"]) == 0x0605
    assert p.make_sid(p.CanDirection.BOOTLOADER, 8, BootCommand.MAGIC_PACKET) == 0x600 | (8 << 5) | 0xA
    assert p.split_sid(0x600 | (3 << 5) | 0x10 | 1) == (3, 3, True, 1)


def _crc_reference(words):
    crc = 0
    for w in words:
        for byte in (w & 0xFF, w >> 8):
            i = (crc & 0xFF) ^ byte
            crc >>= 8
            for bit, poly in ((1, 0x3096), (2, 0x612C), (4, 0xC419), (8, 0x8832), (16, 0x1064), (32, 0x20C8),
                              (64, 0x4190), (128, 0x8320)):
                if i & bit:
                    crc ^= poly
    return crc or 1


def test_config_crc():
    words = [300, 64, 500, 0x2010, 500, 6200, 0, 0, 0, 0x0105]
    assert p.config_crc(words) == _crc_reference(words)
    assert p.config_crc(dict(zip(p.CONFIG_TYPES, words, strict=True))) == p.config_crc(words)
    assert p.config_crc([0] * 10) == 1  # 0 means "ignore": sent as 1
    assert p.config_crc([1, 0, 0, 0, 0, 0, 0, 0, 0, 0]) != p.config_crc([0, 1, 0, 0, 0, 0, 0, 0, 0, 0])


def _cmd_fields():
    can = p.CanBridgeFrame(2, 3, 0x6AB, bytes([9, 8, 7, 6, 5, 4, 3, 2]))
    return p.PalmCommand(edc_command=1, from_motor_data_type=0x7, which_motors=1, to_motor_data_type=0x2,
                         motor_data=tuple(100 * i - 900 for i in range(20)), tactile_data_type=0x11223344,
                         aux_data_type=0x55667788, can=can)


def test_command_0220_vector():
    cmd = _cmd_fields()
    buf = bytearray(70)
    struct.pack_into("<I", buf, 0, 1)
    struct.pack_into("<I", buf, 4, 7)
    struct.pack_into("<h", buf, 8, 1)
    struct.pack_into("<I", buf, 10, 2)
    for i in range(20):
        struct.pack_into("<h", buf, 14 + 2 * i, 100 * i - 900)
    struct.pack_into("<I", buf, 54, 0x11223344)
    buf[58:70] = bytes([2, 3, 0xAB, 0x06, 9, 8, 7, 6, 5, 4, 3, 2])
    assert p.pack_command(cmd, "0220") == bytes(buf)
    back = p.unpack_command(bytes(buf), "0220")
    assert back == p.PalmCommand(**{**cmd.__dict__, "aux_data_type": 0})


def test_command_0230_vector():
    cmd = _cmd_fields()
    buf = bytearray(74)
    struct.pack_into("<IIhIII", buf, 0, 1, 7, 1, 2, 0x11223344, 0x55667788)
    for i in range(20):
        struct.pack_into("<h", buf, 22 + 2 * i, 100 * i - 900)
    buf[62:74] = bytes([2, 3, 0xAB, 0x06, 9, 8, 7, 6, 5, 4, 3, 2])
    assert p.pack_command(cmd, "0230") == bytes(buf)
    assert p.unpack_command(bytes(buf), "0230") == cmd


def _status_fields(protocol):
    v2 = protocol == "0230"
    return p.PalmStatus(
        edc_command=1, sensors=tuple(1000 + i for i in range(37)), motor_data_type=0xA, which_motors=1,
        which_motor_data_arrived=0xAAAAA, which_motor_data_had_errors=0x00012,
        motor_data_packet=tuple((-500 + i, 40000 + i) for i in range(10)), tactile_data_type=0x0A0B0C0D,
        tactile_data_valid=0x1F,
        tactile=tuple(tuple(2000 + 20 * t + k for k in range(16 if v2 else 8)) for t in range(5)),
        idle_time_us=321,
        tactile_mid_prox=tuple(tuple(3000 + 10 * t + k for k in range(8)) for t in range(5)) if v2 else (),
        aux_spi_data_type=0x01020304 if v2 else 0, aux_spi_sensor=tuple(4000 + k for k in range(16)) if v2 else (),
        can=p.CanBridgeFrame(1, 8, 0x612, bytes(range(0xF0, 0xF8))))


def test_status_0220_vector():
    s = _status_fields("0220")
    buf = bytearray(232)
    struct.pack_into("<I", buf, 0, 1)
    struct.pack_into("<37H", buf, 4, *s.sensors)
    struct.pack_into("<I", buf, 78, 0xA)
    struct.pack_into("<h", buf, 82, 1)
    struct.pack_into("<I", buf, 84, 0xAAAAA)
    struct.pack_into("<I", buf, 88, 0x12)
    for i, (t, m) in enumerate(s.motor_data_packet):
        struct.pack_into("<hH", buf, 92 + 4 * i, t, m)
    struct.pack_into("<I", buf, 132, 0x0A0B0C0D)
    struct.pack_into("<H", buf, 136, 0x1F)
    struct.pack_into("<40H", buf, 138, *[w for t in s.tactile for w in t])
    struct.pack_into("<H", buf, 218, 321)
    buf[220:232] = bytes([1, 8, 0x12, 0x06, *range(0xF0, 0xF8)])
    assert p.pack_status(s, "0220") == bytes(buf)
    assert p.unpack_status(bytes(buf), "0220") == s


def test_status_0230_vector():
    s = _status_fields("0230")
    buf = bytearray(428)
    struct.pack_into("<I", buf, 0, 1)
    struct.pack_into("<37H", buf, 4, *s.sensors)
    struct.pack_into("<40H", buf, 78, *[w for t in s.tactile_mid_prox for w in t])
    struct.pack_into("<I", buf, 158, 0x0A0B0C0D)
    struct.pack_into("<H", buf, 162, 0x1F)
    struct.pack_into("<80H", buf, 164, *[w for t in s.tactile for w in t])
    struct.pack_into("<I", buf, 324, 0x01020304)
    struct.pack_into("<16H", buf, 328, *s.aux_spi_sensor)
    struct.pack_into("<I", buf, 360, 0xA)
    struct.pack_into("<h", buf, 364, 1)
    struct.pack_into("<I", buf, 366, 0xAAAAA)
    struct.pack_into("<I", buf, 370, 0x12)
    for i, (t, m) in enumerate(s.motor_data_packet):
        struct.pack_into("<hH", buf, 374 + 4 * i, t, m)
    struct.pack_into("<H", buf, 414, 321)
    buf[416:428] = bytes([1, 8, 0x12, 0x06, *range(0xF0, 0xF8)])
    assert p.pack_status(s, "0230") == bytes(buf)
    assert p.unpack_status(bytes(buf), "0230") == s


def test_empty_mailbox_is_a_dropped_status():
    for proto, info in p.PROTOCOLS.items():
        st_ = p.unpack_status(bytes(info.status_size), proto)
        assert isinstance(st_, p.PalmStatus) and st_.dropped


def test_garbage_is_rejected_not_raised():
    good = p.pack_status(_status_fields("0220"), "0220")
    bad_edc = b"\x09" + good[1:]
    bad_type = good[:78] + b"\x20" + good[79:]
    bad_can_len = good[:221] + b"\x09" + good[222:]
    for buf in (b"", b"\x01", good[:-1], good + b"\0", bad_edc, bad_type, bad_can_len):
        assert isinstance(p.unpack_status(buf, "0220"), p.DecodeError)
    assert isinstance(p.unpack_status(good, "0999"), p.DecodeError)
    assert isinstance(p.unpack_command(b"\0" * 3, "0220"), p.DecodeError)
    assert isinstance(p.CanBridgeFrame.unpack(b"\0" * 11), p.DecodeError)


i16 = st.integers(-0x8000, 0x7FFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
frames = st.builds(p.CanBridgeFrame, st.integers(0, 255), st.integers(0, 8), u16, st.binary(min_size=8, max_size=8))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["0220", "0230"]), st.integers(0, 4), u32, st.integers(0, 1), u32,
       st.lists(i16, min_size=20, max_size=20), u32, u32, frames)
def test_command_round_trip(proto, edc, frm, which, to, md, tact, aux, can):
    cmd = p.PalmCommand(edc, frm, which, to, tuple(md), tact, aux if proto == "0230" else 0, can)
    buf = p.pack_command(cmd, proto)
    assert len(buf) == p.PROTOCOLS[proto].command_size
    assert p.unpack_command(buf, proto) == cmd


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["0220", "0230"]), st.integers(0, 4), st.lists(u16, min_size=37, max_size=37),
       st.integers(0, 15), st.integers(0, 1), u32, u32, st.lists(st.tuples(i16, u16), min_size=10, max_size=10),
       u16, frames, st.data())
def test_status_round_trip(proto, edc, sensors, mtype, which, arrived, errors, packets, idle, can, data):
    n = 16 if proto == "0230" else 8
    tactile = tuple(tuple(data.draw(st.lists(u16, min_size=n, max_size=n))) for _ in range(5))
    extra = {}
    if proto == "0230":
        extra = {"tactile_mid_prox": tuple(tuple(data.draw(st.lists(u16, min_size=8, max_size=8)))
                                           for _ in range(5)),
                 "aux_spi_data_type": data.draw(u32),
                 "aux_spi_sensor": tuple(data.draw(st.lists(u16, min_size=16, max_size=16)))}
    s = p.PalmStatus(edc, tuple(sensors), mtype, which, arrived, errors, tuple(packets), data.draw(u32),
                     data.draw(u16), tactile, idle, can=can, **extra)
    buf = p.pack_status(s, proto)
    assert len(buf) == p.PROTOCOLS[proto].status_size
    assert p.unpack_status(buf, proto) == s


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["0220", "0230"]), st.binary(max_size=500))
def test_random_bytes_never_raise(proto, buf):
    out = p.unpack_status(buf, proto)
    assert isinstance(out, p.PalmStatus | p.DecodeError)
    out2 = p.unpack_command(buf, proto)
    assert isinstance(out2, p.PalmCommand | p.DecodeError)
