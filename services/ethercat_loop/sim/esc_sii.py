"""SII EEPROM images for the virtual slaves (ETG.2010 layout): pure builders and a parser.

Words 0x08/0x0A/0x0C/0x0E hold vendor, product, revision and serial (the hand serial is the palm's
word 0x0E, docs/reference/shadow_ethercat.md §0). Categories start at word 0x40. SOEM derives the process-data mapping
from the SyncManager category (41) plus the bit totals of the RxPDO (51) / TxPDO (50) categories,
and reads only the first category of each type (docs/reference/shadow_ethercat.md §8), so each direction's PDOs live in
one category.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

CAT_STRINGS = 10
CAT_GENERAL = 30
CAT_FMMU = 40
CAT_SM = 41
CAT_TXPDO = 50  # slave -> master (inputs)
CAT_RXPDO = 51  # master -> slave (outputs)
CAT_END = 0xFFFF

SM_TYPE_MBX_OUT = 1
SM_TYPE_MBX_IN = 2
SM_TYPE_OUTPUTS = 3
SM_TYPE_INPUTS = 4


@dataclass(frozen=True)
class SmSpec:
    """One SyncManager as the SII describes it (and as a master programs it at 0x0800 + 8n)."""

    start: int
    length: int
    control: int
    enable: int
    sm_type: int

    def register_bytes(self) -> bytes:
        """The 8-byte SM register block: start, length, control, status, activate, PDI control."""
        return struct.pack("<HHBBBB", self.start, self.length, self.control, 0, self.enable, 0)


@dataclass(frozen=True)
class PdoSpec:
    """One PDO: `size` bytes assigned to SyncManager `sm`."""

    index: int
    sm: int
    size: int
    name: str = ""


@dataclass
class SiiConfig:
    vendor: int
    product: int
    revision: int
    serial: int
    name: str
    sms: list[SmSpec] = field(default_factory=list)
    rx_pdos: list[PdoSpec] = field(default_factory=list)
    tx_pdos: list[PdoSpec] = field(default_factory=list)
    fmmu_functions: list[int] = field(default_factory=list)  # 1 outputs, 2 inputs, 3 SM status


def crc8_sii(data: bytes) -> int:
    """The SII header checksum (CRC-8, polynomial 0x07, initial 0xFF) over words 0..6."""
    crc = 0xFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _category(cat: int, body: bytes) -> bytes:
    if len(body) % 2:
        body += b"\x00"
    return struct.pack("<HH", cat, len(body) // 2) + body


def _pdo_entries(size: int) -> list[int]:
    """Entry bit lengths covering `size` bytes: 64-bit entries keep the count under the 255 limit."""
    bits: list[int] = []
    rest = size
    for chunk in (8, 2, 1):
        while rest >= chunk:
            bits.append(chunk * 8)
            rest -= chunk
    return bits


def _pdo_category(pdos: list[PdoSpec], name_idx: dict[str, int]) -> bytes:
    body = b""
    for pdo in pdos:
        entries = _pdo_entries(pdo.size)
        body += struct.pack("<HBBBBH", pdo.index, len(entries), pdo.sm, 0, name_idx.get(pdo.name, 0), 0)
        for sub, bitlen in enumerate(entries, start=1):
            dtype = {8: 0x05, 16: 0x06, 64: 0x1B}[bitlen]  # UNSIGNED8 / UNSIGNED16 / UNSIGNED64
            # object 0x7nn0 for outputs, 0x6nn0 for inputs (the usual CiA layout)
            obj = (0x6000 if pdo.index >= 0x1A00 else 0x7000) | (pdo.index & 0xFF) << 4
            body += struct.pack("<HBBBBH", obj, sub & 0xFF, 0, dtype, bitlen, 0)
    return body


def build_sii(cfg: SiiConfig) -> bytes:
    """The whole EEPROM image, ending with the end-of-categories marker and padded to 2 KiB."""
    header = bytearray(0x80)
    struct.pack_into("<HHHH", header, 0, 0x0005, 0x0000, 0x0000, 0x0000)  # PDI: SPI (PIC32 behind an ET1200)
    struct.pack_into("<H", header, 0x07 * 2, crc8_sii(bytes(header[:14])))
    struct.pack_into("<IIII", header, 0x08 * 2, cfg.vendor, cfg.product, cfg.revision, cfg.serial)
    struct.pack_into("<H", header, 0x3E * 2, 1)  # size: (1 + 1) KiB
    struct.pack_into("<H", header, 0x3F * 2, 1)  # SII version
    strings = [cfg.name, *sorted({p.name for p in cfg.rx_pdos + cfg.tx_pdos if p.name})]
    name_idx = {s: i + 1 for i, s in enumerate(strings)}
    sbody = bytes([len(strings)]) + b"".join(bytes([len(s)]) + s.encode("ascii") for s in strings)
    out = bytes(header) + _category(CAT_STRINGS, sbody)
    general = bytearray(32)
    general[3] = name_idx[cfg.name]  # name string index; group/image/order unused
    out += _category(CAT_GENERAL, bytes(general))
    if cfg.fmmu_functions:
        out += _category(CAT_FMMU, bytes(cfg.fmmu_functions))
    if cfg.sms:
        out += _category(CAT_SM, b"".join(
            struct.pack("<HHBBBB", s.start, s.length, s.control, 0, s.enable, s.sm_type) for s in cfg.sms))
    if cfg.tx_pdos:
        out += _category(CAT_TXPDO, _pdo_category(cfg.tx_pdos, name_idx))
    if cfg.rx_pdos:
        out += _category(CAT_RXPDO, _pdo_category(cfg.rx_pdos, name_idx))
    out += struct.pack("<H", CAT_END)
    return out + b"\xff" * (2048 - len(out)) if len(out) < 2048 else out


@dataclass
class SiiInfo:
    """What a master learns from an image (used by tests and `virtual_hand --dump-sii`)."""

    vendor: int
    product: int
    revision: int
    serial: int
    categories: dict[int, bytes]

    def pdo_bytes(self, cat: int) -> dict[int, int]:
        """Bytes per SyncManager from the first PDO category of type `cat`."""
        body = self.categories.get(cat, b"")
        sizes: dict[int, int] = {}
        pos = 0
        while pos + 8 <= len(body):
            _index, n, sm, _sync, _name, _flags = struct.unpack_from("<HBBBBH", body, pos)
            pos += 8
            bits = sum(body[pos + 8 * k + 5] for k in range(n))
            pos += 8 * n
            sizes[sm] = sizes.get(sm, 0) + bits // 8
        return sizes

    def sms(self) -> list[SmSpec]:
        body = self.categories.get(CAT_SM, b"")
        return [SmSpec(*struct.unpack_from("<HHBxBB", body, i)) for i in range(0, len(body) - 7, 8)]


def parse_sii(image: bytes) -> SiiInfo:
    """Parse header identity and categories (first of each type); raises ValueError on a bad image."""
    if len(image) < 0x82:
        raise ValueError("SII image shorter than its header")
    vendor, product, revision, serial = struct.unpack_from("<IIII", image, 0x10)
    cats: dict[int, bytes] = {}
    pos = 0x80
    while pos + 2 <= len(image):
        (cat,) = struct.unpack_from("<H", image, pos)
        if cat == CAT_END:
            break
        if pos + 4 > len(image):
            raise ValueError("truncated SII category header")
        (words,) = struct.unpack_from("<H", image, pos + 2)
        body = image[pos + 4 : pos + 4 + 2 * words]
        if len(body) != 2 * words:
            raise ValueError(f"SII category {cat} runs past the image")
        cats.setdefault(cat, bytes(body))
        pos += 4 + 2 * words
    return SiiInfo(vendor, product, revision, serial, cats)
