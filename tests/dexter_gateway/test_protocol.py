"""DexRun codec: byte vectors from docs/reference/dexter.md (§3.4 included), hypothesis round trips, garbage."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.dexter_gateway import protocol as p
from services.dexter_gateway.protocol import Firmware, ProtocolError


def reply_bytes(values: dict[int, int]) -> bytes:
    ints = [0] * 60
    for k, v in values.items():
        ints[k] = v
    return struct.pack("<60i", *ints)


# -- requests ---------------------------------------------------------------------------------------

def test_request_matches_dde_example_and_is_256_zero_padded() -> None:
    # docs/reference/dexter.md §2: `1 5 1712345678901 undefined a 0 0 0 0 0;`
    req = p.build_request("a", [0, 0, 0, 0, 0], job_id=1, instruction_id=5, start_ms=1712345678901)
    raw = req.encode()
    assert len(raw) == 256
    assert raw == b"1 5 1712345678901 undefined a 0 0 0 0 0;" + b"\x00" * (256 - 40)


def test_move_to_wiki_example() -> None:
    # docs/reference/dexter.md §4: `1 1 1 1 M 0 500000 100000 0 0 -1 1 1 1`
    req = p.Request("M", ("0", "500000", "100000", "0", "0", "-1", "1", "1", "1"), end="1")
    assert req.encode().rstrip(b"\x00") == b"1 1 1 1 M 0 500000 100000 0 0 -1 1 1 1;"
    p.check_oplet("M", req.args, Firmware.STABLE)


def test_read_request_wiki_form() -> None:
    # docs/reference/dexter.md §3.4, the wiki's example: `1 1 1 0 r 0 /srv/samba/share/AdcCenters.txt`, with the
    # terminator DexRun needs
    req = p.Request("r", ("0", "/srv/samba/share/AdcCenters.txt"), end="0")
    assert req.text() == "1 1 1 0 r 0 /srv/samba/share/AdcCenters.txt;"


@pytest.mark.parametrize("oplet,args,why", [
    ("z", [], "takes 1"),  # z without its argument crashed DexRun (PR #98)
    ("a", [1, 2, 3, 4], "takes 5..7"),
    ("R", [1, 2, 3, 4, 5, 6], "takes 5"),
    ("B", [0] * 9, "takes 10"),
    ("S", ["MaxSpeed"], "takes 2..6"),
    ("S", ["NoSuchParam", 1], "unknown S parameter"),
    ("S", [99, 1], "out of range"),
    ("i", [], "stdin"),
    ("E", [], "crashed"),
    ("c", [], "not supported"),
    ("r", ["x", "/a"], "block number"),
    ("r", ["0", "/a b"], "space"),
    ("a", ["1", "2", "3", "4", "x"], "not a number"),
    ("w", [1, 1.5e400], "infinite"),
])
def test_invalid_requests_are_refused_before_sending(oplet: str, args: list[object], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        p.build_request(oplet, args)  # type: ignore[arg-type]


def test_branch_differences() -> None:
    # C/D exist on the newest DexRun only; stable reads M's direction with atoi
    with pytest.raises(ProtocolError, match="newest"):
        p.build_request("C", [0] * 9, firmware=Firmware.STABLE)
    p.build_request("C", [0] * 9, firmware=Firmware.NEWEST)
    args = [0, 500000, 100000, 0.5, 0, -0.8, 1, 1, 1]
    with pytest.raises(ProtocolError, match="integers"):
        p.build_request("M", args, firmware=Firmware.STABLE)
    assert "0.5" in p.build_request("M", args, firmware=Firmware.NEWEST).text()


def test_request_length_limit() -> None:
    with pytest.raises(ProtocolError, match="at most 255"):
        p.build_request("r", ["0", "/" + "x" * 250])
    # exactly 255 bytes with the widest instruction id the link numbers a request with is fine: byte 256 stays NUL
    head = f"1 {p.MAX_INSTRUCTION_ID} 1 undefined r 0 /"
    req = p.build_request("r", ["0", "/" + "x" * (255 - len(head) - 1)])
    wide = req._replace(instruction_id=p.MAX_INSTRUCTION_ID)
    assert len(wide.text()) == 255 and wide.encode()[-1] == 0
    # one byte more fits with instruction id 1 but not with a later one: refused when it is built, not when sent
    with pytest.raises(ProtocolError, match="at most 255"):
        p.build_request("r", ["0", "/" + "x" * (255 - len(head))])


def test_nan_skips_j6_and_numbers_format_like_atoi_reads_them() -> None:
    req = p.build_request("a", [3600, -7200, 0, 0, 0, float("nan"), 300])
    assert req.text().endswith(" a 3600 -7200 0 0 0 NaN 300;")
    assert p.fmt_number(2.0) == "2" and p.fmt_number(True) == "1" and p.fmt_number(0.25) == "0.25"
    assert p.arcsec(1.0) == 3600 and p.arcsec(-0.5) == -1800


def test_parse_command_line() -> None:
    assert p.parse_command_line("a 0,0 0 0 0;") == ("a", ["0", "0", "0", "0", "0"])
    assert p.parse_command_line("r 0 #POM 5") == ("r", ["0", "#POM 5"])
    assert p.parse_command_line("r 0 `ls -l /srv") == ("r", ["0", "`ls -l /srv"])
    assert p.parse_command_line("W m 5 a b c") == ("W", ["m", "5", "a b c"])
    with pytest.raises(ProtocolError, match="only one command"):
        p.parse_command_line("g; h;")
    with pytest.raises(ProtocolError, match="empty"):
        p.parse_command_line(" ; ")


def test_set_parameter_units() -> None:
    # §4.1: speeds deg/s × 7754.73550222, boundaries deg × 3600, link lengths m -> µm, EERoll raw
    assert p.convert_param("MaxSpeed", 1.0) == pytest.approx(7754.73550222)
    assert p.convert_param("AngularAcceleration", 2.0) == pytest.approx(2 * 7754.73550222)
    assert p.convert_param("J1BoundryHigh", 1.0) == 3600
    assert p.convert_param("LinkLengths", 0.1) == pytest.approx(100000)
    assert p.convert_param("CartesianSpeed", 0.01) == pytest.approx(10000)
    assert p.convert_param("EERoll", 512) == 512
    assert p.resolve_param(1) == "Acceleration" and p.resolve_param("30") == "RunFile"
    assert p.PARAM_NAMES.index("LinkLengths") == 51 and p.PARAM_NAMES.index("RawVelocityLimits") == 53
    assert p.PARAM_NAMES[2:7] == ("J1Force", "J3Force", "J2Force", "J4Force", "J5Force")


# -- W escaping -------------------------------------------------------------------------------------

def test_escape_vector() -> None:
    assert p.escape(b"a;b%c\x00d") == b"a%3Bb%25c%00d"
    assert p.unescape(b"a%3Bb%25c%00d") == b"a;b%c\x00d"
    with pytest.raises(ProtocolError):
        p.unescape(b"%4")


def test_write_sequence_like_dde() -> None:
    seq = p.write_requests("/srv/samba/share/t.txt", b"x" * 70)
    assert seq[0] == ("W", ["f", "0", "/srv/samba/share/t.txt"])
    assert seq[1] == ("W", ["m", "62", "x" * 62])
    assert seq[2] == ("W", ["e", "8", "x" * 8])
    assert p.write_requests("/t", b"") == [("W", ["f", "0", "/t"]), ("W", ["e", "0"])]
    for oplet, args in seq:
        p.build_request(oplet, args)


@given(st.binary(max_size=600))
def test_escape_round_trip_and_chunks_stay_within_62(data: bytes) -> None:
    assert p.unescape(p.escape(data)) == data
    chunks = p.write_chunks(data)
    assert all(len(c) <= p.MAX_CONTENT_CHARS for c in chunks)
    assert b"".join(p.unescape(c) for c in chunks) == data  # no escape is split across chunks
    for c in chunks:
        assert b";" not in c and b"\x00" not in c
        assert not c[:1] or c[:1] not in (b" ", b",")


def _chunks_byte_by_byte(data: bytes, limit: int) -> list[bytes]:
    """The reference: DDE's fill, one byte at a time (write_chunks does the same per chunk, in C)."""
    chunks: list[bytes] = []
    cur = bytearray()
    for b in data:
        piece = b"%%%02X" % b if b in b"\x00;%" else bytes((b,))
        if len(cur) + len(piece) > limit:
            chunks.append(bytes(cur))
            cur = bytearray()
        if not cur and b in b" ,\t\r\n":
            piece = b"%%%02X" % b
        cur += piece
    if cur or not chunks:
        chunks.append(bytes(cur))
    return chunks


@given(st.lists(st.sampled_from([b"a", b"%", b";", b"\x00", b" ", b",", b"\t", b"\n", b"\xff", b"z"]), max_size=300)
       .map(b"".join), st.sampled_from([3, 4, 5, 6, 62]))
def test_write_chunks_cut_exactly_as_the_byte_by_byte_fill(data: bytes, limit: int) -> None:
    assert p.write_chunks(data, limit) == _chunks_byte_by_byte(data, limit)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=5, max_size=7),
       st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**31 - 1))
def test_request_encoding_round_trip(args: list[int], job: int, instr: int) -> None:
    req = p.build_request("a", args, job_id=job, instruction_id=instr)
    raw = req.encode()
    text = raw.rstrip(b"\x00").decode()
    assert len(raw) == 256 and text.count(";") == 1 and text.endswith(";")
    fields = text[:-1].split(" ")
    assert fields[:2] == [str(job), str(instr)] and fields[4] == "a"
    assert [int(x) for x in fields[5:]] == args
    assert p.parse_command_line(" ".join(fields[4:])) == ("a", [str(a) for a in args])


@given(st.binary(max_size=200))
def test_written_file_survives_the_request_text(data: bytes) -> None:
    # what DexRun does: take the data after `W <sub> <n> ` up to ';' and unescape n chars
    out = b""
    for oplet, args in p.write_requests("/f", data)[1:]:
        text = p.build_request(oplet, args).encode().rstrip(b"\x00")
        assert text.endswith(b";")
        body = text[:-1].split(b" ", 7)
        n = int(body[6])
        tail = body[7] if len(body) > 7 else b""
        assert len(tail) == n
        out += p.unescape(tail)
    assert out == data


# -- replies ----------------------------------------------------------------------------------------

WIKI_BLOCK1 = b"0x5960000\r\n0x6540000\r\n0x47e0000\r\n0x46a0000\r\n0x3f20000\r\n0x3e800"
WIKI_BLOCK2 = b"00\r\n0x4920000\r\n0x73a0000\r\n0x5000000\r\n0x51e0000\r\n"


def test_read_reply_wiki_packets() -> None:
    # docs/reference/dexter.md §3.4, the wiki's packet #1: job 1, instruction 1, 'r' (114), error 0, PAYLOAD_LENGTH
    # 62, data from byte 28
    base = [1, 1, 1543452381, 148000, 114, 0] + [0] * 54
    raw = bytearray(p.read_reply_ints(base, WIKI_BLOCK1, 0))
    assert len(raw) == 240 and raw[16] == 114 and raw[24:28] == (62).to_bytes(4, "little")
    reply = p.decode_reply(bytes(raw))
    assert (reply.job_id, reply.instruction_id, reply.oplet, reply.error) == (1, 1, "r", 0)
    assert reply.robot_time == pytest.approx(1543452381.148)
    blk = p.decode_read(reply)
    assert blk.length == 62 and blk.payload == WIKI_BLOCK1
    # packet #2: 48 bytes; the bytes after them are stale contents of packet #1 and must be ignored
    raw[24:28] = (48).to_bytes(4, "little")
    raw[28:28 + 48] = WIKI_BLOCK2
    blk2 = p.decode_read(p.decode_reply(bytes(raw)))
    assert blk2.length == 48 and blk2.payload == WIKI_BLOCK2
    assert (WIKI_BLOCK1 + WIKI_BLOCK2).count(b"\r\n") == 10


def test_pom_wiki_block() -> None:
    # docs/reference/dexter.md §3.4 (the wiki's example): the first #POM block as decimal bytes
    dec = [91, 91, 49, 46, 48, 48, 48, 48, 48, 48, 44, 32, 48, 46, 48, 48, 48, 48, 48, 48, 44, 32, 48, 46, 48, 48,
           48, 48, 48, 48, 44, 32, 48, 46, 48, 48, 48, 48, 48, 48, 93, 44, 91, 45, 48, 46, 48, 48, 48, 48, 48, 48, 44,
           32, 49, 46, 48, 48, 48, 48, 48, 48]
    assert len(dec) == 62
    raw = p.read_reply_ints([1, 1, 1543452381, 349602, 114, 0] + [0] * 54, bytes(dec), 0)
    blk = p.decode_read(p.decode_reply(raw))
    assert blk.payload.decode() == "[[1.000000, 0.000000, 0.000000, 0.000000],[-0.000000, 1.000000"
    pom = "[[1.000000, 0.000000, 0.000000, 0.000000],[-0.000000, 1.000000, 0.000000, 0.000000]," \
          "[0.000000, 0.000000, 1.000000, 0.000000],[0.000000, 0.000000, 0.000000, 1.000000]]"
    assert p.decode_keyword("#POM", pom)[1][1] == 1.0
    assert p.decode_keyword("#EyeNumbers", "286, 255, 255, 255, 324") == [286, 255, 255, 255, 324]
    assert p.decode_keyword("#measured_angles", "[0, 0, 0, 0, 0]") == [0, 0, 0, 0, 0]


def test_standard_status_layout_and_units() -> None:
    vals = {0: 7, 1: 9, 2: 1700000000, 3: 123456, 4: ord("g"), 5: 0, 8: 0, 9: 1,
            10: 3600, 11: -36, 16: 3590, 17: 123456,
            20: -7200, 30: 1800, 40: 57600, 41: 57600, 42: -57600, 50: 360,
            18: 100, 28: 5, 38: 612, 48: -3, 58: (0x20 << 8) | 0x04,
            19: p.JUNK_WORD, 29: p.JUNK_WORD}
    reply = p.decode_reply(reply_bytes(vals))
    st_ = p.decode_status(reply)
    j1, j2, j3, j4, j5 = st_.joints
    assert j1.angle_deg == 1.0 and j1.delta_deg == pytest.approx(-0.01) and j1.measured_deg == pytest.approx(
        3590 / 3600)
    assert j1.sent_raw == 123456  # raw steps: not converted
    assert j2.angle_deg == -2.0 and j3.angle_deg == 0.5 and j5.angle_deg == 0.1
    # J4/J5 deltas are 1/16 arcsec (DDE's 1/57600)
    assert j4.angle_deg == 16.0 and j4.delta_deg == 1.0 and j4.pid_delta_deg == -1.0
    # code + DDE: 18/28 = servo ID 1 = J7, 38/48 = servo ID 3 = J6 (J6 zero 512), 0.29 deg/unit
    assert st_.j7.position_units == 100 and st_.j7.angle_deg == pytest.approx(29.0) and st_.j7.load_units == 5
    assert st_.j6.position_units == 612 and st_.j6.angle_deg == pytest.approx(29.0) and st_.j6.load_units == -3
    assert st_.j6.error_flags == 0x04 and st_.j7.error_flags == 0x20
    assert st_.phui_button and st_.end_effector_io == 1


@pytest.mark.parametrize("value,errno,code,flags", [
    (0, False, 0, ()),
    (1, False, 1, ()),
    (1024 | 1, False, 1, ("firmware_mismatch",)),
    (1024, False, 0, ("firmware_mismatch",)),
    ((1 << 30) | (1 << 28), False, 0, ("roll_servo_j6", "monitor")),
    (1 << 27, False, 0, ("span_servo_j7",)),
    (1 << 29, False, 0, ("boundary",)),
    (666, False, 0, ("stable_monitor",)),
    (665 | 1024, False, 0, ("firmware_mismatch", "stable_boundary")),
    (2, True, 2, ()),
    (10, True, 10, ()),
    (29, True, 29, ()),
    (16 | 1024, True, 16, ("firmware_mismatch",)),
])
def test_error_decoding(value: int, errno: bool, code: int, flags: tuple[str, ...]) -> None:
    e = p.decode_error(value, errno_reply=errno)
    assert e.code == code and set(e.flags) == set(flags)
    assert e.failed == (code != 0) and e.message
    if errno and code == 2:
        assert "ENOENT" in e.message
    if code == 1 and not errno:
        assert "unknown" in e.message


@settings(max_examples=200)
@given(st.lists(st.binary(min_size=240, max_size=240), min_size=1, max_size=6), st.data())
def test_reassembly_from_any_segmentation(replies: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(replies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    asm = p.ReplyAssembler()
    out: list[bytes] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        out += asm.feed(stream[prev:c])
        prev = c
    assert out == replies and asm.pending == 0


@given(st.binary(min_size=240, max_size=240))
def test_garbage_replies_raise_protocol_errors_only(data: bytes) -> None:
    try:
        r = p.decode_reply(data)
    except ProtocolError:
        return
    try:
        p.decode_read(r)
    except ProtocolError:
        pass
    p.decode_status(r)
    p.decode_error(r.error)
    p.decode_error(r.error, errno_reply=True)


def test_short_and_long_replies_are_refused() -> None:
    with pytest.raises(ProtocolError):
        p.decode_reply(b"\x00" * 239)
    with pytest.raises(ProtocolError, match="oplet"):
        p.decode_reply(reply_bytes({4: 0}))
    with pytest.raises(ProtocolError, match="payload length"):
        p.decode_read(p.decode_reply(reply_bytes({4: 114, 6: 300})))


def test_shell_reader_waits_for_echild() -> None:
    sr = p.ShellRead()
    sr.feed(p.ReadBlock(0, b"a"))  # a short block is not the end
    assert not sr.done
    sr.feed(p.ReadBlock(0, b""))
    sr.feed(p.ReadBlock(p.ECHILD, b""))
    assert sr.done and bytes(sr.output) == b"a" and sr.exit_status == 0
