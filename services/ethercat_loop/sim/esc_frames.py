"""EtherCAT frame and datagram codec: pure functions, bytes in and bytes out (sans-I/O).

Layout (ETG.1000.4): Ethernet header (dst, src, EtherType 0x88A4), a 2-byte EtherCAT header
(11-bit length of the datagrams, 4-bit type 1 = datagrams), then datagrams each made of
cmd(1) idx(1) address(4) len/flags(2) irq(2) data(len) wkc(2). Bit 15 of len/flags ("M") says
another datagram follows. The virtual slave and the tests share this one implementation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

ETHERTYPE_ECAT = 0x88A4
ETH_HEADER_LEN = 14
ECAT_HEADER_LEN = 2
DATAGRAM_HEADER_LEN = 10
WKC_LEN = 2
MAX_DATAGRAM_DATA = 1486  # a full frame: 1500 - 2 (ECAT header) - 10 (header) - 2 (WKC)
_DG_HEAD = struct.Struct("<BBHHHH")  # cmd, idx, adp/log-low, ado/log-high, len|flags, irq


class Cmd(IntEnum):
    NOP = 0
    APRD = 1
    APWR = 2
    APRW = 3
    FPRD = 4
    FPWR = 5
    FPRW = 6
    BRD = 7
    BWR = 8
    BRW = 9
    LRD = 10
    LWR = 11
    LRW = 12
    ARMW = 13
    FRMW = 14


READ_CMDS = frozenset({Cmd.APRD, Cmd.APRW, Cmd.FPRD, Cmd.FPRW, Cmd.BRD, Cmd.BRW, Cmd.LRD, Cmd.LRW})
WRITE_CMDS = frozenset({Cmd.APWR, Cmd.APRW, Cmd.FPWR, Cmd.FPRW, Cmd.BWR, Cmd.BRW, Cmd.LWR, Cmd.LRW})
LOGICAL_CMDS = frozenset({Cmd.LRD, Cmd.LWR, Cmd.LRW})


class FrameError(ValueError):
    """A frame that is not a well-formed EtherCAT datagram frame (counted and dropped, never fatal)."""


@dataclass
class Datagram:
    """One datagram. `adp`/`ado` are the two 16-bit halves of the address; for logical commands
    the 32-bit logical address is `adp | ado << 16` (see `logical`)."""

    cmd: int
    idx: int
    adp: int
    ado: int
    data: bytearray
    wkc: int = 0
    irq: int = 0
    circulating: bool = False
    extra: int = 0  # the 3 reserved bits of len/flags, kept so a frame round-trips byte-exact

    @property
    def logical(self) -> int:
        return self.adp | (self.ado << 16)

    @classmethod
    def make_logical(cls, cmd: int, idx: int, address: int, data: bytes, wkc: int = 0) -> Datagram:
        return cls(cmd, idx, address & 0xFFFF, (address >> 16) & 0xFFFF, bytearray(data), wkc)


@dataclass
class Frame:
    """An EtherCAT frame with its Ethernet addresses."""

    dst: bytes
    src: bytes
    datagrams: list[Datagram] = field(default_factory=list)
    ecat_type: int = 1


def parse_datagrams(payload: bytes) -> list[Datagram]:
    """Decode the EtherCAT header + datagrams (the Ethernet payload); raises FrameError."""
    if len(payload) < ECAT_HEADER_LEN:
        raise FrameError("frame shorter than the EtherCAT header")
    (hdr,) = struct.unpack_from("<H", payload, 0)
    length, ftype = hdr & 0x07FF, hdr >> 12
    if ftype != 1:
        raise FrameError(f"EtherCAT frame type {ftype} is not 1 (datagrams)")
    if ECAT_HEADER_LEN + length > len(payload):
        raise FrameError(f"EtherCAT header length {length} exceeds the frame ({len(payload) - 2} B)")
    end = ECAT_HEADER_LEN + length
    pos = ECAT_HEADER_LEN
    out: list[Datagram] = []
    while True:
        if pos + DATAGRAM_HEADER_LEN + WKC_LEN > end:
            raise FrameError("truncated datagram header")
        cmd, idx, adp, ado, lf, irq = _DG_HEAD.unpack_from(payload, pos)
        dlen = lf & 0x07FF
        data_at = pos + DATAGRAM_HEADER_LEN
        if data_at + dlen + WKC_LEN > end:
            raise FrameError(f"datagram data length {dlen} runs past the frame")
        data = bytearray(payload[data_at : data_at + dlen])
        (wkc,) = struct.unpack_from("<H", payload, data_at + dlen)
        out.append(Datagram(cmd, idx, adp, ado, data, wkc, irq, bool(lf & 0x4000), (lf >> 11) & 0x7))
        pos = data_at + dlen + WKC_LEN
        if not lf & 0x8000:
            break
    return out


def build_datagrams(datagrams: list[Datagram]) -> bytes:
    """Encode datagrams behind an EtherCAT header (the Ethernet payload, unpadded)."""
    if not datagrams:
        raise FrameError("a frame needs at least one datagram")
    parts: list[bytes] = []
    for i, d in enumerate(datagrams):
        if len(d.data) > MAX_DATAGRAM_DATA:
            raise FrameError(f"datagram data {len(d.data)} B exceeds {MAX_DATAGRAM_DATA} B")
        lf = len(d.data) | (d.extra & 0x7) << 11 | (0x4000 if d.circulating else 0)
        if i < len(datagrams) - 1:
            lf |= 0x8000
        parts.append(_DG_HEAD.pack(d.cmd & 0xFF, d.idx & 0xFF, d.adp & 0xFFFF, d.ado & 0xFFFF, lf, d.irq & 0xFFFF))
        parts.append(bytes(d.data))
        parts.append(struct.pack("<H", d.wkc & 0xFFFF))
    body = b"".join(parts)
    if len(body) > 0x07FF:
        raise FrameError(f"datagrams total {len(body)} B, more than an EtherCAT frame holds")
    return struct.pack("<H", len(body) | 0x1000) + body


def parse_frame(raw: bytes) -> Frame:
    """Decode an Ethernet frame carrying EtherCAT; raises FrameError for anything else."""
    if len(raw) < ETH_HEADER_LEN + ECAT_HEADER_LEN:
        raise FrameError("frame shorter than the Ethernet + EtherCAT headers")
    (etype,) = struct.unpack_from("!H", raw, 12)
    if etype != ETHERTYPE_ECAT:
        raise FrameError(f"EtherType 0x{etype:04x} is not EtherCAT")
    return Frame(bytes(raw[0:6]), bytes(raw[6:12]), parse_datagrams(raw[ETH_HEADER_LEN:]))


def build_frame(frame: Frame, pad: bool = True) -> bytes:
    """Encode an Ethernet frame; pads to the 60-byte Ethernet minimum like a NIC would."""
    raw = frame.dst + frame.src + struct.pack("!H", ETHERTYPE_ECAT) + build_datagrams(frame.datagrams)
    if pad and len(raw) < 60:
        raw += bytes(60 - len(raw))
    return raw
