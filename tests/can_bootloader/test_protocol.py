"""Wire format: byte vectors from docs/reference/can_bootloader.md §1/§2/§4, hypothesis round trips, garbage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.can_bootloader import protocol as p


def test_sid_layout_vectors() -> None:
    # 0x600 | (motor_id << 5) | command; ACK bit 0x10 (docs/reference/can_bootloader.md §1, §2)
    assert p.magic_packet(8) == p.BootFrame(0x70A, bytes.fromhex("55AA55AA55AA55AA"))
    assert p.erase_flash(0) == p.BootFrame(0x602, b"\x00")  # length 1, unused byte (reference step 2)
    assert p.write_flash_address(3, 0x04C0) == p.BootFrame(0x665, bytes.fromhex("C00400"))
    assert p.write_flash_data(9, bytes(range(8))).sid == 0x720
    assert p.read_flash(3, 0x7D48) == p.BootFrame(0x661, bytes.fromhex("487D00"))
    assert p.reset(1) == p.BootFrame(0x623, b"")
    assert p.read_version(2) == p.BootFrame(0x644, b"")
    assert p.ack_for(p.magic_packet(8)) == p.BootFrame(0x71A, p.MAGIC_DATA)


def test_board_mapping() -> None:
    assert p.board_address(0) == p.BoardAddress(0, 1, 0)
    assert p.board_address(9) == p.BoardAddress(9, 1, 9)
    assert p.board_address(10) == p.BoardAddress(10, 2, 0)
    assert p.board_address(19) == p.BoardAddress(19, 2, 9)
    for bad in (-1, 20, 255):
        with pytest.raises(p.ProtocolError):
            p.board_address(bad)


def test_ack_rule_of_the_original() -> None:
    sent = p.write_flash_data(4, bytes.fromhex("0102030405060708"))
    ack = p.BootFrame(sent.sid | 0x10, sent.data)
    assert p.is_ack(sent, ack)
    # direction bits are ignored by the (id & 0x1EF) compare
    assert p.is_ack(sent, p.BootFrame((sent.sid | 0x10) & ~0x600 | 0x400, sent.data))
    assert not p.is_ack(sent, sent)  # no ACK bit
    assert not p.is_ack(sent, p.BootFrame(sent.sid | 0x10, sent.data[:7]))  # length
    assert not p.is_ack(sent, p.BootFrame(sent.sid | 0x10, bytes(8)))  # data
    assert not p.is_ack(sent, p.BootFrame((sent.sid | 0x10) ^ 0x20, sent.data))  # other motor
    assert not p.is_ack(sent, p.BootFrame((sent.sid | 0x10) ^ 0x01, sent.data))  # other command
    rd = p.read_flash(4, 0x500)
    reply = p.BootFrame(0x600 | 4 << 5 | 0x10 | 1, bytes(8))
    assert p.is_ack(rd, reply) and p.read_matches(rd, reply, bytes(8))
    assert not p.read_matches(rd, reply, b"\xff" * 8)
    assert not p.is_ack(rd, p.BootFrame(reply.sid, bytes(4)))
    assert not p.is_ack(rd, p.BootFrame(reply.sid & ~0x600 | 0x400, bytes(8)))  # READ: exact SID
    ver = p.read_version(4)
    assert p.is_ack(ver, p.BootFrame(ver.sid | 0x10, p.VERSION_DATA))


def test_frame_validation() -> None:
    with pytest.raises(p.ProtocolError):
        p.BootFrame(0x800)
    with pytest.raises(p.ProtocolError):
        p.BootFrame(0x600, bytes(9))
    with pytest.raises(p.ProtocolError):
        p.write_flash_data(0, bytes(7))
    with pytest.raises(p.ProtocolError):
        p.read_flash(0, 0x1000000)


@given(st.integers(0, 0xFFFFFF))
def test_address_round_trip(addr: int) -> None:
    assert p.parse_address(p.address_bytes(addr)) == addr


@given(st.integers(0, 15), st.integers(0, 15), st.booleans(), st.binary(max_size=8))
def test_encode_decode_round_trip(lid: int, cmd: int, ack: bool, data: bytes) -> None:
    msg = p.BootMessage(lid, cmd, ack, data)
    frame = p.encode(msg)
    assert p.decode(frame) == msg
    assert frame.sid & 0x600 == 0x600


@given(st.integers(0, 9), st.sampled_from(list(p.BootCommand)), st.binary(min_size=8, max_size=8),
       st.integers(0, 0xFFFFFF))
def test_every_request_accepts_its_echo(lid: int, cmd: p.BootCommand, data: bytes, addr: int) -> None:
    req = {
        p.BootCommand.WRITE_FLASH_DATA: p.write_flash_data(lid, data),
        p.BootCommand.READ_FLASH: p.read_flash(lid, addr),
        p.BootCommand.ERASE_FLASH: p.erase_flash(lid),
        p.BootCommand.RESET: p.reset(lid),
        p.BootCommand.READ_VERSION: p.read_version(lid),
        p.BootCommand.WRITE_FLASH_ADDRESS: p.write_flash_address(lid, addr),
        p.BootCommand.MAGIC_PACKET: p.magic_packet(lid),
    }[cmd]
    if cmd == p.BootCommand.READ_FLASH:
        assert p.is_ack(req, p.BootFrame(req.sid | 0x10, data))
    elif cmd == p.BootCommand.READ_VERSION:
        assert p.is_ack(req, p.BootFrame(req.sid | 0x10, p.VERSION_DATA))
    else:
        assert p.is_ack(req, p.ack_for(req))
        assert not p.is_ack(req, req)


@given(st.integers(0, 0x7FF), st.binary(max_size=8))
def test_garbage_decodes_or_is_rejected(sid: int, data: bytes) -> None:
    frame = p.BootFrame(sid, data)
    msg = p.decode(frame)
    if sid & 0x600 != 0x600:
        assert msg is None
    else:
        assert msg is not None and p.encode(msg) == frame
