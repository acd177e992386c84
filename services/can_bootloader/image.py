"""Firmware images for the PIC18F2580 motor boards: Intel HEX in, a checked flash image out (pure, no I/O).

Rules (docs/reference/can_bootloader.md §4.4 "Reading the image" and §4.5 "PIC18 bootloader side"):
- the application region is 0x04C0 up to, not including, 0x7DC0 (what ERASE clears);
- anything that would land in the bootloader (0x0000–0x047F), its vector area (0x0480–0x04BF), or past
  the region (0x7DC0–0x1FFFFF, the debugger area and unimplemented memory) is refused, before any frame
  is sent, with the offending address range in the message;
- ID locations (0x200000…), configuration words (0x300000…), the device id (0x3FFFFE…) and EEPROM data
  (0xF00000…) are skipped with a warning: the original dropped every section at 0x7FFF or above;
- the image spans min→max address pre-filled with 0xFF, as the original's libbfd reader did; it is
  widened to whole 32-byte write blocks (0xFF padding writes nothing: erased flash is already 0xFF).

ELF is not read: PIC18 toolchains (C18, XC8) emit Intel HEX and COFF, never ELF, so an ELF reader would
only add a dependency no motor-board firmware needs.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field

from intelhex import IntelHex, IntelHexError

APP_START = 0x04C0
APP_END = 0x7DC0  # exclusive: ERASE stops here (debugger area above)
BOOTLOADER_END = 0x0480  # 0x0000–0x047F
VECTORS_END = 0x04C0  # 0x0480–0x049F vectors, 0x04A0–0x04BF unused, app entry at 0x04C0
BLOCK = 32  # TBLWT holding registers: one row write per 32 bytes
CHUNK = 8  # bytes per WRITE_FLASH_DATA / READ_FLASH frame
ERASE_ROW = 64

# Regions the original skipped (>= 0x7FFF) that are not program memory: warned about, never sent.
SKIPPED_REGIONS: tuple[tuple[int, int, str], ...] = (
    (0x200000, 0x200008, "ID locations"),
    (0x300000, 0x30000E, "configuration words"),
    (0x3FFFFE, 0x400000, "device id"),
    (0xF00000, 0xF00100, "EEPROM data"),
)


class ImageError(ValueError):
    """The firmware cannot be flashed; the message says why (and where)."""


def _ranges(addresses: list[int]) -> list[tuple[int, int]]:
    """Sorted addresses -> [(start, end_inclusive)] of contiguous runs."""
    out: list[tuple[int, int]] = []
    for a in addresses:
        if out and a == out[-1][1] + 1:
            out[-1] = (out[-1][0], a)
        else:
            out.append((a, a))
    return out


def _fmt(ranges: list[tuple[int, int]], limit: int = 4) -> str:
    parts = [f"0x{s:06X}–0x{e:06X}" for s, e in ranges[:limit]]
    if len(ranges) > limit:
        parts.append(f"and {len(ranges) - limit} more range(s)")
    return ", ".join(parts)


@dataclass(frozen=True)
class FlashImage:
    """Program memory to write: `data` starts at `base` (32-aligned) and is whole 32-byte blocks."""

    base: int
    data: bytes
    first: int  # lowest address the HEX file wrote
    last: int  # highest address the HEX file wrote (inclusive)
    warnings: tuple[str, ...] = field(default=())
    bootloader_aware: bool | None = None  # unknown from the image itself; the post-reset check tells

    def __post_init__(self) -> None:
        if self.base % BLOCK or len(self.data) % BLOCK:
            raise ImageError("internal: image not aligned to 32-byte blocks")
        if self.base < APP_START or self.base + len(self.data) > APP_END:
            raise ImageError(f"internal: image 0x{self.base:06X}+{len(self.data)} outside the application region")

    @property
    def end(self) -> int:
        return self.base + len(self.data)

    @property
    def size(self) -> int:
        """Bytes the HEX file spans (first..last), the figure the original logged."""
        return self.last - self.first + 1

    def blocks(self) -> Iterator[tuple[int, bytes]]:
        """Every 32-byte block (address, bytes), 0xFF blocks included."""
        for off in range(0, len(self.data), BLOCK):
            yield self.base + off, self.data[off:off + BLOCK]

    def write_blocks(self) -> list[tuple[int, bytes]]:
        """Blocks that must be written: all-0xFF blocks are skipped (ERASE already left them so)."""
        return [(a, b) for a, b in self.blocks() if b != b"\xff" * BLOCK]

    def chunks(self) -> list[tuple[int, bytes]]:
        """8-byte read-back chunks over the whole image (0xFF blocks verified too)."""
        return [(self.base + off, self.data[off:off + CHUNK]) for off in range(0, len(self.data), CHUNK)]

    def at(self, address: int, n: int) -> bytes:
        off = address - self.base
        return self.data[off:off + n]


def from_bytes(base: int, payload: bytes) -> FlashImage:
    """An image from raw program bytes at `base` (checked like a HEX file)."""
    ih = IntelHex()
    ih.frombytes(payload, offset=base)
    return from_intelhex(ih)


def load_intel_hex(text: str | bytes) -> FlashImage:
    """Parse Intel HEX text (with extended address records) and check it against the memory map."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError as exc:
            raise ImageError(f"Intel HEX must be ASCII text: byte 0x{text[exc.start]:02X} at offset {exc.start}"
                             ) from None
    if not text.strip():
        raise ImageError("empty firmware: the Intel HEX text has no records")
    ih = IntelHex()
    try:
        ih.loadhex(io.StringIO(text))
    except IntelHexError as exc:
        raise ImageError(f"malformed Intel HEX: {exc}") from None
    except (ValueError, TypeError, IndexError) as exc:
        raise ImageError(f"malformed Intel HEX: {exc}") from None
    return from_intelhex(ih)


def from_intelhex(ih: IntelHex) -> FlashImage:
    addresses = sorted(int(a) for a in ih.addresses())
    if not addresses:
        raise ImageError("empty firmware: the Intel HEX file contains no data records")
    warnings: list[str] = []
    program: list[int] = []
    refused: list[int] = []
    skipped: dict[str, list[int]] = {}
    for a in addresses:
        region = next((name for lo, hi, name in SKIPPED_REGIONS if lo <= a < hi), None)
        if region is not None:
            skipped.setdefault(region, []).append(a)
        elif APP_START <= a < APP_END:
            program.append(a)
        else:
            refused.append(a)
    if refused:
        below = [a for a in refused if a < APP_START]
        above = [a for a in refused if a >= APP_START]
        why = []
        if below:
            boot = [a for a in below if a < BOOTLOADER_END]
            what = "the bootloader (0x0000–0x047F)" if boot else "the bootloader's vector area (0x0480–0x04BF)"
            if boot and len(boot) != len(below):
                what = "the bootloader and its vector area (0x0000–0x04BF)"
            why.append(f"writes into {what} at {_fmt(_ranges(below))}")
        if above:
            why.append(f"writes past the application region (ends at 0x{APP_END:04X}) at {_fmt(_ranges(above))}")
        raise ImageError(f"image refused: it {' and '.join(why)}; the application region is "
                         f"0x{APP_START:04X}–0x{APP_END - 1:04X}")
    for name, addrs in skipped.items():
        warnings.append(f"skipped {len(addrs)} byte(s) of {name} at {_fmt(_ranges(addrs))}: "
                        "not programmable over the CAN bootloader")
    if not program:
        raise ImageError("empty firmware: no bytes in the application region "
                         f"0x{APP_START:04X}–0x{APP_END - 1:04X}" + (f" ({'; '.join(warnings)})" if warnings else ""))
    first, last = program[0], program[-1]
    base = first - first % BLOCK
    end = last + 1
    end += (-end) % BLOCK
    buf = bytearray(b"\xff" * (end - base))
    for a in program:
        buf[a - base] = int(ih[a])
    return FlashImage(base=base, data=bytes(buf), first=first, last=last, warnings=tuple(warnings))


def to_intel_hex(image: FlashImage, extra: dict[int, bytes] | None = None) -> str:
    """Render an image (plus extra address->bytes, e.g. configuration words) as Intel HEX text."""
    ih = IntelHex()
    ih.frombytes(image.data[image.first - image.base:image.last - image.base + 1], offset=image.first)
    for addr, payload in (extra or {}).items():
        ih.frombytes(payload, offset=addr)
    out = io.StringIO()
    ih.write_hex_file(out, byte_count=16)
    return out.getvalue()
