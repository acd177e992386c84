"""The threaded path on python-can virtual buses: CanPort.drive + Flasher against BootBusSim (the PIC18F model
with its erase and row-write stalls and its two receive buffers)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import can
import pytest

from services.can_bootloader import protocol as p
from services.can_bootloader.flasher import FlashConfig, Flasher, Phase
from services.can_bootloader.image import FlashImage, from_bytes, load_intel_hex
from services.can_bootloader.sim import FLAG_RUN_APP, FLAG_STAY, BootBusSim, make_boards, make_firmware, make_intel_hex
from services.can_bootloader.transport import CanBusConfig, CanPort

IMAGE = load_intel_hex(make_intel_hex())
_ch = itertools.count()


@pytest.fixture
def bus_pair() -> Iterator[Any]:
    made: list[tuple[BootBusSim, CanPort]] = []

    def make(boards: list[int], **sim_kw: Any) -> tuple[BootBusSim, CanPort]:
        ch = f"vbus-{next(_ch)}"
        sim = BootBusSim(can.Bus(interface="virtual", channel=ch), make_boards(boards), **sim_kw).start()
        port = CanPort(1, CanBusConfig(interface="virtual", channel=ch))
        made.append((sim, port))
        return sim, port

    yield make
    for sim, port in made:
        port.close()
        sim.stop()
        sim.bus.shutdown()


def run(port: CanPort, local_id: int, image: FlashImage, before: Callable[[], None] | None = None,
        **cfg: Any) -> Flasher:
    f = Flasher(local_id, image, FlashConfig(**cfg))
    port.drain()
    if before is not None:
        before()
    f.start(time.monotonic())
    port.drive(f)
    return f


def small(first: int = 0x1000, last: int = 0x17FF, aware: bool = True) -> FlashImage:
    return from_bytes(first, make_firmware(first, last, aware=aware, gaps=2))


def test_realistic_image_with_pic_timing(bus_pair: Any) -> None:
    sim, port = bus_pair([8], erase_s=0.05, row_write_s=0.002)
    f = run(port, 8, IMAGE, window=2)
    assert f.result is not None and f.result.ok and f.result.bootloader_aware
    board = sim.board(8)
    assert board.app_image(IMAGE.base, IMAGE.end) == IMAGE.data and board.eeprom[0xFF] == FLAG_RUN_APP
    assert sim.overflows == 0  # window 2 never has more than the PIC's two receive buffers waiting
    # every frame once; on a busy machine a late ACK may also make the flasher resend (a counted retry: at most a
    # block's 5 frames each) and the post-reset check resend its magic packet every 100 ms (at most 10 in its budget)
    exact = 2 + 2 * (0x04C0 // 8) + 5 * len(IMAGE.write_blocks()) + len(IMAGE.chunks()) + 3  # bootloader area x2
    assert exact <= port.frames_sent <= exact + 5 * f.snapshot().retries + 10, (port.frames_sent, exact)


def test_overflowing_receive_buffers_are_survived(bus_pair: Any) -> None:
    """Window 8 on a direct bus overruns the PIC while it writes flash: frames are lost, blocks may be written
    shifted; the flasher backs off, and the verify + restart (one frame at a time) still ends with the image."""
    sim, port = bus_pair([3], row_write_s=0.003)
    img = small()
    f = run(port, 3, img, window=8)
    assert f.result is not None and f.result.ok, f.result
    assert sim.board(3).app_image(img.base, img.end) == img.data


def test_delayed_and_dropped_acks(bus_pair: Any) -> None:
    sim, port = bus_pair([5])
    board = sim.board(5)
    board.faults.delay_acks, board.faults.delay_s, board.faults.delay_command = 2, 0.25, p.BootCommand.READ_FLASH
    board.faults.drop_acks, board.faults.drop_command, board.faults.drop_after = 2, 0, 7
    img = small()
    f = run(port, 5, img, window=4)
    assert f.result is not None and f.result.ok, f.result
    assert board.faults.delayed == 2 and board.faults.dropped == 2
    assert board.app_image(img.base, img.end) == img.data


def test_power_loss_mid_flash_then_reflash(bus_pair: Any) -> None:
    sim, port = bus_pair([7])
    board = sim.board(7)
    board.faults.power_loss_after, board.faults.power_off_s = 400, 0.3
    img = small(0x1000, 0x1FFF)
    f = run(port, 7, img, window=2, block_retries=1)
    assert f.result is not None and not f.result.ok and f.result.phase is Phase.WRITE
    assert f.result.address is not None and f"0x{f.result.address:06X}" in f.result.reason
    assert board.eeprom[0xFF] == FLAG_STAY
    time.sleep(0.35)
    f2 = run(port, 7, img, window=2)
    assert f2.result is not None and f2.result.ok, f2.result
    assert board.app_image(img.base, img.end) == img.data


def test_garbage_on_the_bus(bus_pair: Any) -> None:
    sim, port = bus_pair([2])
    noise = can.Bus(interface="virtual", channel=port.cfg.channel)

    def make_noise() -> None:
        for m in (can.Message(arbitration_id=0x1ABCDEF, data=b"\x01", is_extended_id=True),
                  can.Message(arbitration_id=0x652, is_remote_frame=True, is_extended_id=False),
                  can.Message(arbitration_id=0x123, data=b"junk", is_extended_id=False),
                  can.Message(arbitration_id=0x652 | 0x10, data=b"\x00" * 8, is_extended_id=False),
                  can.Message(is_error_frame=True)):
            noise.send(m)

    try:
        img = small(0x1000, 0x10FF)
        f = run(port, 2, img, before=make_noise)
        assert f.result is not None and f.result.ok
        assert port.garbage == 3  # extended, remote and error frames never reach the flasher
        assert sim.board(2).app_image(img.base, img.end) == img.data
    finally:
        noise.shutdown()


def test_standalone_simulator_and_own_echo() -> None:
    """sim.serve() (what `python -m services.can_bootloader.sim` runs) on a bus that loops our own frames back
    (receive_own_messages, like udp_multicast): both sides ignore their own frames."""
    import threading

    from services.can_bootloader.sim import serve

    stop = threading.Event()
    ch = f"vbus-{next(_ch)}"
    sims: list[BootBusSim] = []
    t = threading.Thread(target=lambda: sims.append(serve("virtual", ch, [1, 2], stop, erase_s=0.0,
                                                          row_write_s=0.0, receive_own_messages=True)))
    t.start()
    port = CanPort(1, CanBusConfig(interface="virtual", channel=ch, options={"receive_own_messages": True}))
    try:
        time.sleep(0.1)
        img = small(0x1000, 0x10FF)
        f = run(port, 1, img)
        assert f.result is not None and f.result.ok, f.result
    finally:
        port.close()
        stop.set()
        t.join(5)
    assert sims and sims[0].board(1).app_image(img.base, img.end) == img.data
    with pytest.raises(ValueError, match="share local ids"):
        serve("virtual", ch, [1, 11], stop)
