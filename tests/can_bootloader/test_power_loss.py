"""Power loss at every frame of a windowed flash: the bootloader's own row (0x0000, its reset vector) is never
programmed, and the flasher never reports ok for an image it did not write and verify.

The model (sim.py) does what the PIC18F bootloader does: a reboot forgets the write address (TBLPTR = 0,
`position` = 0), so four WRITE_FLASH_DATA frames reaching a rebooted bootloader before a WRITE_FLASH_ADDRESS
program the row at 0x0000. Two kinds of power loss: the frame that meets it is lost (`eats`), or a brown-out
reboots the board just before a frame that the new bootloader then handles (`brownout`). Two paths, both
deterministic (fake clock, harness.Wire): a direct bus, and the palm's CAN bridge timing (one frame each way per
1 ms cycle, plus MQTT latency). The real bridge path (MQTT, ethercat-loop's palm model at 1 kHz) is in
test_bridge.py::test_power_loss_through_the_bridge.
"""

from __future__ import annotations

import pytest

from services.can_bootloader import protocol as p
from services.can_bootloader.flasher import Finished, FlashConfig, Flasher, FlashWarning
from services.can_bootloader.image import APP_START, FlashImage, from_bytes
from services.can_bootloader.sim import FLAG_RUN_APP, FLAG_STAY, BootBoard, make_firmware

from .harness import Wire

IMG = from_bytes(0x1000, make_firmware(0x1000, 0x107F, gaps=0))  # 4 blocks: 20 write frames, 16 reads
WINDOWS = (1, 2, 5, 12)
PATHS = {"direct": {"latency": 0.0005, "cycle": None}, "bridge": {"latency": 0.0015, "cycle": 0.001}}


def wire_for(board: BootBoard, path: str) -> Wire:
    return Wire([board], **PATHS[path])  # type: ignore[arg-type]


def clean_frames(path: str, window: int) -> int:
    """Frames the board receives in a flash without fault: the power loss is placed at each of them."""
    board = BootBoard(3)
    wire = wire_for(board, path)
    f = Flasher(3, IMG, FlashConfig(window=window))
    wire.run(f)
    assert f.result is not None and f.result.ok
    return board.frames_in


CASES = [(path, w, i) for path in PATHS for w in WINDOWS for i in range(clean_frames(path, w))]


def assert_written(board: BootBoard, image: FlashImage, r: Finished) -> None:
    """An ok result means the image is in flash (written and verified) and runs."""
    assert board.app_image(image.base, image.end) == image.data, r
    assert board.eeprom[0xFF] == FLAG_RUN_APP and board.mode == "app", r


def flash_after_power_loss(path: str, window: int, frame: int, *, eats: bool,
                           lost_boot_ack: bool = False) -> tuple[BootBoard, bytes, list[Finished]]:
    board = BootBoard(3)
    wire = wire_for(board, path)
    boot_area = bytes(board.flash[:APP_START])
    board.faults.power_loss_after, board.faults.power_off_s = frame, 0.0
    board.faults.power_loss_eats_frame = eats
    board.faults.drop_boot_acks = 1 if lost_boot_ack else 0
    results: list[Finished] = []
    for _attempt in range(2):  # the flash, then (if it failed) the retry an operator would run
        f = Flasher(3, IMG, FlashConfig(window=window), board_id=3)
        wire.run(f)
        assert f.result is not None
        results.append(f.result)
        if f.result.ok or f.result.boot_area_intact is False:
            break
        wire.clock.t += 1.0
    assert board.faults.power_losses == 1, "the power loss did not happen"
    return board, boot_area, results


@pytest.mark.parametrize("eats", [True, False], ids=["eats", "brownout"])
@pytest.mark.parametrize(("path", "window", "frame"), CASES)
def test_power_loss_at_every_frame(path: str, window: int, frame: int, eats: bool) -> None:
    board, boot_area, results = flash_after_power_loss(path, window, frame, eats=eats)
    assert board.protected_writes == [], f"row(s) {[hex(a) for a in board.protected_writes]} written: {results}"
    assert bytes(board.flash[:APP_START]) == boot_area
    for r in results:
        if r.ok:
            assert_written(board, IMG, r)
    assert results[-1].ok, results  # a retry after the power loss flashes the board


@pytest.mark.parametrize(("path", "window", "frame"), [c for c in CASES if c[1] in (2, 12)])
def test_brownout_with_its_boot_ack_lost_is_caught_and_told(path: str, window: int, frame: int) -> None:
    """A brown-out whose boot ACK is lost too leaves no trace in the protocol: the data frames' ACKs look the
    same. If it lets a row reach 0x0000, the flasher still never reports ok: the image does not read back as
    written, and the bootloader area, read back against its baseline, names the change, with no RESET sent."""
    board, boot_area, results = flash_after_power_loss(path, window, frame, eats=False, lost_boot_ack=True)
    damaged = bytes(board.flash[:APP_START]) != boot_area
    for r in results:
        if r.ok:
            assert not damaged, r
            assert_written(board, IMG, r)
    if damaged:
        r = results[0]
        assert not r.ok and r.boot_area_intact is False and "BOOTLOADER AREA CHANGED" in r.reason, r
        assert "ICD" in r.reason and "RESET was NOT sent" in r.reason
        assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY  # no RESET went out
    else:
        assert results[-1].ok, results


def test_the_defect_row_zero_at_window_12() -> None:
    """The case as found: window 12 on the direct bus, the power loss eats a WRITE_FLASH_ADDRESS, and the data
    frames already sent reach the rebooted bootloader, which would program them at 0x0000."""
    probe = BootBoard(3)
    clean = wire_for(probe, "direct")
    clean.run(Flasher(3, IMG, FlashConfig(window=12)))
    addresses = [i for i, fr in enumerate(clean.sent) if fr.sid & p.COMMAND_MASK == p.BootCommand.WRITE_FLASH_ADDRESS]
    board = BootBoard(3)
    wire = wire_for(board, "direct")
    board.faults.power_loss_after, board.faults.power_off_s = addresses[1], 0.0
    f = Flasher(3, IMG, FlashConfig(window=12))
    wire.run(f)
    assert board.faults.power_losses == 1
    assert board.protected_writes == []
    assert f.result is not None and f.result.ok, f.result
    assert_written(board, IMG, f.result)
    # the reboot was seen, and the bootloader area read back before the RESET
    assert f.result.boot_area_intact is True
    assert any(isinstance(e, FlashWarning) and "read back after the write" in e.message for e in f.events())
