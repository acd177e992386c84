"""Intel HEX loading and the memory-map checks: refused images say where, skipped regions warn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.can_bootloader.image import APP_END, APP_START, ImageError, from_bytes, load_intel_hex, to_intel_hex
from services.can_bootloader.sim import make_firmware, make_intel_hex


def test_realistic_image() -> None:
    text = make_intel_hex()
    assert ":020000040030CA" in text  # extended linear address record for the config words
    img = load_intel_hex(text)
    assert (img.first, img.last) == (0x04C0, 0x7D4B)
    assert img.base == 0x04C0 and img.end == 0x7D60
    assert img.at(0x04C0, 4) == bytes.fromhex("EF60F002")
    assert len(img.warnings) == 1 and "0x300001–0x300006" in img.warnings[0]
    assert "configuration words" in img.warnings[0]
    blocks = list(img.blocks())
    skipped = [a for a, b in blocks if b == b"\xff" * 32]
    assert len(skipped) >= 6 and len(img.write_blocks()) == len(blocks) - len(skipped)
    assert img.data[img.last - img.base + 1:] == b"\xff" * (img.end - img.last - 1)
    assert len(img.chunks()) == len(img.data) // 8


def test_eeprom_and_idlocs_skipped() -> None:
    text = make_intel_hex(0x1000, 0x10FF, extra={0xF000FF: b"\x42", 0x200000: b"\x01\x02"})
    img = load_intel_hex(text)
    assert any("EEPROM data at 0xF000FF" in w for w in img.warnings)
    assert any("ID locations" in w for w in img.warnings)


@pytest.mark.parametrize(("first", "last", "where"), [
    (0x0000, 0x0100, "the bootloader (0x0000–0x047F) at 0x000000–0x000100"),
    (0x0480, 0x049F, "vector area (0x0480–0x04BF) at 0x000480–0x00049F"),
    (0x0400, 0x0600, "the bootloader and its vector area (0x0000–0x04BF) at 0x000400–0x0004BF"),
    (0x7000, 0x7DC0, "past the application region (ends at 0x7DC0) at 0x007DC0–0x007DC0"),
    (0x7F00, 0x8100, "past the application region (ends at 0x7DC0) at 0x007F00–0x008100"),
])
def test_refused_ranges(first: int, last: int, where: str) -> None:
    with pytest.raises(ImageError) as exc:
        load_intel_hex(make_intel_hex(first, last, config=False))
    assert where in str(exc.value)
    assert "refused" in str(exc.value)


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"),
    ("   \n", "empty"),
    (":00000001FF\n", "empty"),
    (":10000000DEADBEEF\n", "malformed"),
    ("hello world\n", "malformed"),
    (":1004C000EF60F0026D8BDC122795B55F90A0AA2933\n:00000001FF\n", "malformed"),  # checksum
    (":020000040030CA\n:0100010055A9\n:00000001FF\n", "empty"),  # only config bytes
])
def test_bad_hex(text: str, why: str) -> None:
    with pytest.raises(ImageError, match=why):
        load_intel_hex(text)


def test_non_ascii() -> None:
    with pytest.raises(ImageError, match="ASCII"):
        load_intel_hex(b"\xff\xfe:00000001FF")


@settings(max_examples=60, deadline=None)
@given(st.integers(APP_START, APP_END - 1), st.binary(min_size=1, max_size=300))
def test_hex_round_trip(start: int, payload: bytes) -> None:
    payload = payload[:APP_END - start]
    img = from_bytes(start, payload)
    assert img.base % 32 == 0 and len(img.data) % 32 == 0
    assert img.at(start, len(payload)) == payload
    again = load_intel_hex(to_intel_hex(img))
    assert again == img


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_garbage_text_never_crashes(text: str) -> None:
    try:
        load_intel_hex(text)
    except ImageError:
        pass


def test_firmware_generator_is_deterministic() -> None:
    assert make_firmware(seed=3) == make_firmware(seed=3) != make_firmware(seed=4)
