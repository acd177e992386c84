"""The sans-I/O flasher against the PIC18F2580 model on a simulated wire (fake clock, no threads)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.can_bootloader import protocol as p
from services.can_bootloader.flasher import (
    Finished,
    FlashConfig,
    Flasher,
    FlashWarning,
    Phase,
    PhaseStarted,
    Rewind,
    read_exchange,
    reset_exchange,
    version_exchange,
)
from services.can_bootloader.image import FlashImage, from_bytes, load_intel_hex
from services.can_bootloader.sim import (
    FLAG_RUN_APP,
    FLAG_STAY,
    BootBoard,
    BootBoardSet,
    BootReply,
    make_boards,
    make_firmware,
    make_intel_hex,
)

from .harness import Wire

IMAGE = load_intel_hex(make_intel_hex())
GUARD_READS = 2 * (0x04C0 // 8)  # the bootloader area read twice before the erase (its baseline, confirmed)


def small_image(aware: bool = True) -> FlashImage:
    return from_bytes(0x1000, make_firmware(0x1000, 0x11FF, aware=aware, gaps=1))


def flash(board: BootBoard, image: FlashImage, wire: Wire | None = None, **cfg: object) -> tuple[Flasher, Wire]:
    wire = wire or Wire([board])
    f = Flasher(board.local_id, image, FlashConfig(**cfg))  # type: ignore[arg-type]
    wire.run(f)
    return f, wire


def assert_flashed(board: BootBoard, image: FlashImage) -> None:
    assert board.app_image(image.base, image.end) == image.data
    assert board.app_image(0x04C0, image.base) == b"\xff" * (image.base - 0x04C0)
    assert board.eeprom[0xFF] == FLAG_RUN_APP and board.mode == "app"


@pytest.mark.parametrize("window", [1, 2, 8])
def test_realistic_image(window: int) -> None:
    board = BootBoard(8 - 0)
    f, wire = flash(board, IMAGE, window=window)
    assert f.result == Finished(True, f.result.reason, Phase.DONE, None, True)  # type: ignore[union-attr]
    assert_flashed(board, IMAGE)
    blocks = len(IMAGE.write_blocks())
    chunks = len(IMAGE.chunks())
    assert len(wire.sent) == 2 + GUARD_READS + 5 * blocks + chunks + 1 + 2
    assert f.snapshot().retries == 0


def test_frame_sequence_is_the_originals() -> None:
    board = BootBoard(3)
    _f, wire = flash(board, IMAGE, window=1)
    s = wire.sent
    assert s[0] == p.BootFrame(0x66A, p.MAGIC_DATA)
    # the bootloader area's baseline, read before anything is written
    assert s[1:1 + GUARD_READS] == [p.read_flash(3, a) for a in range(0, 0x04C0, 8)] * 2
    s = s[GUARD_READS:]
    assert s[1] == p.BootFrame(0x662, b"\x00")
    assert s[2] == p.BootFrame(0x665, bytes.fromhex("C00400"))
    assert s[3:7] == [p.write_flash_data(3, IMAGE.data[k:k + 8]) for k in range(0, 32, 8)]
    writes = [fr for fr in s if fr.sid == 0x665]
    addrs = [p.parse_address(fr.data) for fr in writes]
    assert addrs == [a for a, _ in IMAGE.write_blocks()]  # 0xFF blocks skipped
    reads = [p.parse_address(fr.data) for fr in s[1:] if fr.sid == 0x661]
    assert reads == list(range(IMAGE.base, IMAGE.end, 8))  # ... but verified
    assert s[-3:] == [p.reset(3), p.magic_packet(3), p.reset(3)]


@pytest.mark.parametrize("window", [1, 8])
@pytest.mark.parametrize(("command", "after"), [
    (p.BootCommand.WRITE_FLASH_DATA, 9),
    (p.BootCommand.WRITE_FLASH_DATA, 0),
    (p.BootCommand.WRITE_FLASH_ADDRESS, 5),
    (p.BootCommand.READ_FLASH, 40),
    (p.BootCommand.MAGIC_PACKET, 0),
    (p.BootCommand.MAGIC_PACKET, 1),  # the post-reset check's ACK
    (p.BootCommand.ERASE_FLASH, 0),
    (p.BootCommand.RESET, 0),
])
def test_lost_acks_are_recovered(window: int, command: int, after: int) -> None:
    board = BootBoard(2)
    board.faults.drop_acks, board.faults.drop_command, board.faults.drop_after = 1, command, after
    f, _wire = flash(board, small_image(), window=window)
    assert f.result is not None and f.result.ok, f.result
    assert board.faults.dropped == 1
    assert f.snapshot().retries >= 1
    assert_flashed(board, small_image())


def test_many_lost_acks_in_a_window() -> None:
    board = BootBoard(2)
    board.faults.drop_acks, board.faults.drop_after = 5, 30
    f, _ = flash(board, IMAGE, window=8)
    assert f.result is not None and f.result.ok
    assert_flashed(board, IMAGE)
    rewinds = [e for e in f.events() if isinstance(e, Rewind)]
    assert rewinds  # reported with phase and address


def test_delayed_ack_beyond_timeout() -> None:
    board = BootBoard(5)
    board.faults.delay_acks, board.faults.delay_s = 1, 0.3
    board.faults.delay_command = p.BootCommand.WRITE_FLASH_DATA
    f, _ = flash(board, small_image(), window=4)
    assert f.result is not None and f.result.ok
    assert_flashed(board, small_image())


@pytest.mark.parametrize("window", [1, 8])
def test_corrupt_read_back_is_reread(window: int) -> None:
    board = BootBoard(1)
    board.faults.corrupt_reads, board.faults.corrupt_after = 2, 17
    f, _ = flash(board, small_image(), window=window)
    assert f.result is not None and f.result.ok
    assert board.faults.corrupted == 2


def test_persistent_verify_failure_restarts_then_fails_with_address() -> None:
    board = BootBoard(1)
    board.faults.corrupt_reads, board.faults.corrupt_after = 10_000, 3
    f, wire = flash(board, small_image(), window=2, read_retries=5)
    r = f.result
    assert r is not None and not r.ok and r.phase is Phase.VERIFY
    assert r.address == small_image().base  # after the restart every READ answer is corrupt
    assert "verify failed at 0x001000" in r.reason and "read-back mismatch" in r.reason
    warnings = [e.message for e in f.events() if isinstance(e, FlashWarning)]
    assert any("verify failed at 0x0010" in w and "erasing and writing again" in w for w in warnings)
    assert f.snapshot().restarts == 1
    assert sum(1 for fr in wire.sent if fr == p.erase_flash(1)) == 2
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY


def test_no_board_fails_at_magic() -> None:
    board = BootBoard(4)
    f = Flasher(6, small_image())
    wire = Wire([board])
    wire.run(f)
    assert f.result is not None and not f.result.ok and f.result.phase is Phase.MAGIC
    assert "None of the magic packets were ACKed" in f.result.reason
    assert wire.sent == [p.magic_packet(6)] * 2


def test_erase_retries_are_bounded() -> None:
    board = BootBoard(4)
    board.faults.drop_acks, board.faults.drop_command = 99, p.BootCommand.ERASE_FLASH
    f, wire = flash(board, small_image(), erase_tries=3)
    assert f.result is not None and not f.result.ok and f.result.phase is Phase.ERASE
    assert "gave up after 3 tries" in f.result.reason
    assert wire.sent.count(p.erase_flash(4)) == 3


def test_write_failure_names_phase_and_address() -> None:
    board = BootBoard(4)
    board.faults.drop_acks, board.faults.drop_command, board.faults.drop_after = 999, 0, 12
    f, _ = flash(board, small_image(), block_retries=3, window=4)
    r = f.result
    assert r is not None and not r.ok and r.phase is Phase.WRITE and r.address is not None
    assert r.reason.startswith(f"write failed at 0x{r.address:06X}")


def test_power_loss_then_second_flash() -> None:
    board = BootBoard(7)
    wire = Wire([board])
    board.faults.power_loss_after, board.faults.power_off_s = 1500, 0.5
    f, _ = flash(board, IMAGE, wire, window=4, block_retries=2)
    assert f.result is not None and not f.result.ok and f.result.phase is Phase.WRITE
    assert board.eeprom[0xFF] == FLAG_STAY  # the flag was never set: the board boots into its bootloader
    wire.clock.t += 1.0
    f2, _ = flash(board, IMAGE, wire, window=4)
    assert f2.result is not None and f2.result.ok, f2.result
    assert board.boots >= 3
    assert_flashed(board, IMAGE)


def test_silent_board_after_the_reset_gets_no_verdict() -> None:
    """Firmware that ignores the magic packet: after its RESET the board answers nothing, which is exactly what a
    board in its bootloader whose answers are lost looks like. No verdict: the outcome says what is known."""
    board = BootBoard(0)
    img = small_image(aware=False)
    f = Flasher(0, img, FlashConfig(), board_id=0)
    wire = Wire([board])
    wire.run(f)
    r = f.result
    assert r is not None and not r.ok and r.no_answer and r.bootloader_aware is None and r.phase is Phase.PROBE, r
    assert r.reason.startswith("no answer from board 0 after 13 tries"), r.reason
    assert "written and verified" in r.reason and "robobus can version 0" in r.reason
    assert board.app_image(img.base, img.end) == img.data and board.mode == "app"
    # and indeed the board runs a firmware that cannot be reflashed: a new flash cannot even start
    f2, _ = flash(board, small_image())
    assert f2.result is not None and not f2.result.ok and f2.result.phase is Phase.MAGIC
    board.eeprom[0xFF] = 0xFF  # by hand, as the seed says
    board.power_on()
    f3, _ = flash(board, small_image(), wire)
    assert f3.result is not None and f3.result.ok and f3.result.bootloader_aware


def test_thirteen_lost_answers_in_the_bootloader_are_not_called_unaware() -> None:
    """The board jumps into its bootloader on the first check packet (its firmware is aware) and then every answer
    is lost: 10 magic packets and 3 READ_VERSION unanswered. It sits in its bootloader: not "NOT bootloader-aware"
    (exit 3), but "no answer after 13 tries", a distinct outcome."""
    board = BootBoard(2)
    img = small_image()

    wire = Wire([board])
    f = Flasher(2, img, FlashConfig(), board_id=2)
    # let the flash run up to its post-reset check, then lose every answer
    f.start(wire.clock.t)
    orig = board.handle

    def handle(sid: int, data: bytes) -> list[BootReply]:
        if f.phase in (Phase.CHECK, Phase.PROBE):
            board.faults.drop_all = True
        return orig(sid, data)

    board.handle = handle  # type: ignore[method-assign]
    wire.run(f)
    r = f.result
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY  # where it really is
    assert board.faults.dropped >= 13
    assert r is not None and not r.ok and r.no_answer and r.bootloader_aware is None, r
    assert "NOT bootloader-aware" not in r.reason.split("(")[0]
    assert r.reason.startswith("no answer from board 2 after 13 tries") and "may sit in its bootloader" in r.reason
    assert not any(isinstance(e, Finished) and e.bootloader_aware is False for e in f.events())


def test_check_can_be_disabled() -> None:
    board = BootBoard(0)
    f, wire = flash(board, small_image(aware=False), check_bootloader_aware=False)
    assert f.result is not None and f.result.ok and f.result.bootloader_aware is None
    assert wire.sent[-1] == p.reset(0)


def test_cancel_leaves_the_bootloader_ready() -> None:
    board = BootBoard(9)
    wire = Wire([board])
    f = Flasher(9, IMAGE, FlashConfig(window=4))
    f.start(wire.clock.t)
    for _ in range(300):
        for fr in f.poll(wire.clock.t):
            for r in board.handle(fr.sid, fr.data):
                f.receive(p.BootFrame(r.sid, r.data), wire.clock.t)
        wire.clock.t += 0.001
    assert f.phase is Phase.WRITE
    assert f.cancel(wire.clock.t)
    assert f.result is not None and f.result.cancelled and not f.result.ok and f.result.phase is Phase.WRITE
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY
    f2, _ = flash(board, IMAGE, wire)
    assert f2.result is not None and f2.result.ok


def test_events_sequence() -> None:
    f, _ = flash(BootBoard(0), small_image())
    phases = [e.phase for e in f.events() if isinstance(e, PhaseStarted)]
    assert phases == [Phase.MAGIC, Phase.GUARD, Phase.GUARD, Phase.ERASE, Phase.WRITE, Phase.VERIFY, Phase.RESET,
                      Phase.CHECK,
                      Phase.CHECK_RESET]


def test_exchanges() -> None:
    board = BootBoard(3)
    wire = Wire([board])
    ex = version_exchange(3)
    wire.run(ex)
    assert ex.ok and ex.pipe.replies[0] is not None and ex.pipe.replies[0].data == bytes.fromhex("40414243")
    rd = read_exchange(3, 0x0000, 20, window=4)
    wire.run(rd)
    assert rd.ok
    dump = b"".join(r.data for r in rd.pipe.replies if r is not None)
    assert dump == bytes(board.flash[0:24])
    missing = version_exchange(5, tries=2)
    wire.run(missing)
    assert not missing.ok and "no ACK" in missing.error()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 0x7FF), st.binary(max_size=8)), max_size=4), st.integers(1, 6))
def test_garbage_frames_do_not_disturb(garbage: list[tuple[int, bytes]], window: int) -> None:
    board = BootBoard(6)
    wire = Wire([board])
    # garbage arrives before every reply: other boards' traffic, requests, motor data, truncated frames.
    # Only answers that impersonate board 6 (its id with the ACK bit) are left out: repeated before every
    # reply, a rogue READ answer would (rightly) fail the verify.
    wire.extra = [p.BootFrame(s, d) for s, d in garbage if not ((s & 0x1E0) == (6 << 5) and s & 0x10)]
    img = from_bytes(0x2000, make_firmware(0x2000, 0x20FF, gaps=0))
    f, _ = flash(board, img, wire, window=window, check_bootloader_aware=False)
    assert f.result is not None and f.result.ok, f.result
    assert board.app_image(img.base, img.end) == img.data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.integers(0, 420), max_size=6), st.integers(1, 8), st.sampled_from([0.0005, 0.001, 0.003]))
def test_any_few_lost_answers_are_recovered(drops: set[int], window: int, latency: float) -> None:
    # With the defaults, losing every answer to one phase's bounded tries (2 magic packets, 10 post-reset checks)
    # is a correct failure or an "unaware" verdict, not a recovery; with more tries than drops, every few
    # lost answers must be recovered.
    board = BootBoard(4)
    wire = Wire([board], latency=latency, drop_replies=drops)
    img = from_bytes(0x3000, make_firmware(0x3000, 0x33FF, gaps=1))
    tries = len(drops) + 1
    f, _ = flash(board, img, wire, window=window, magic_tries=tries, check_tries=tries, reset_tries=tries)
    assert f.result is not None and f.result.ok, (f.result, sorted(drops))
    assert f.result.bootloader_aware is True
    assert board.app_image(img.base, img.end) == img.data
    assert board.eeprom[0xFF] == FLAG_RUN_APP


def test_board_set_for_the_palm_model() -> None:
    """BootBoardSet.on_can_frame (ethercat-loop's CanNode): per-bus routing, delayed answers held until the
    palm's next frame once due."""
    boards = BootBoardSet(make_boards([2, 12]))
    assert boards.on_can_frame(1, 0x644, b"") == [(1, 0x654, p.VERSION_DATA)]
    assert boards.on_can_frame(2, 0x644, b"") == [(2, 0x654, p.VERSION_DATA)]
    assert boards.on_can_frame(1, 0x664, b"") == []  # no board 3
    b = boards.board(12)
    b.faults.delay_acks, b.faults.delay_s = 1, 0.05
    assert boards.on_can_frame(2, 0x644, b"") == []
    time.sleep(0.06)
    assert boards.on_can_frame(2, 0x7FF, b"") == [(2, 0x654, p.VERSION_DATA)]
    with pytest.raises(KeyError):
        boards.board(5)


class _SilentFromReset(BootBoard):
    """A board that stays in its bootloader but whose every answer is lost from the first RESET on."""

    silent = False

    def handle(self, sid: int, data: bytes) -> list[BootReply]:
        msg = p.decode(p.BootFrame(sid, data))
        if msg is not None and msg.command == p.BootCommand.RESET:
            self.silent = True
        replies = super().handle(sid, data)
        if self.silent:
            self.mode = "bootloader"  # it sat in its bootloader all along
            return []
        return replies


def test_every_ack_lost_from_reset_on_says_what_was_observed() -> None:
    board = _SilentFromReset(4)
    f, _ = flash(board, small_image())
    assert f.result is not None and not f.result.ok
    reason = f.result.reason
    assert "no answer from board" in reason and "written and verified" in reason, reason
    # what was seen, not a guess about what the board runs
    assert "not bootloader-aware" not in reason and "either running" not in reason, reason


def test_two_lost_acks_of_the_post_reset_magic_are_retried_not_branded_unaware() -> None:
    """The first magic packet's ACK (the flash's own) goes through; the next two, the check's, are lost. The
    firmware is aware: it jumped into the bootloader on the first check packet. Retried within the check's
    budget, the third one is ACKed, and the board ends up running its new firmware."""
    board = BootBoard(2)
    board.faults.drop_magic_acks, board.faults.drop_magic_after = 2, 1
    img = small_image()
    f, _ = flash(board, img)
    r = f.result
    assert r is not None and r.ok and r.bootloader_aware is True, r
    assert board.faults.dropped == 2
    assert_flashed(board, img)


def test_every_check_ack_lost_the_board_answering_read_version_is_started() -> None:
    """None of the check's magic packets is ACKed, but READ_VERSION is: the board is in its bootloader, so the
    firmware is aware; it gets its RESET and runs."""
    board = BootBoard(2)
    board.faults.drop_magic_acks, board.faults.drop_magic_after = 1000, 1
    img = small_image()
    f, _ = flash(board, img)
    r = f.result
    assert r is not None and r.ok and r.bootloader_aware is True, r
    events = f.events()
    assert Phase.PROBE in [e.phase for e in events if isinstance(e, PhaseStarted)]
    assert any("answers READ_VERSION" in e.message for e in events if isinstance(e, FlashWarning))
    assert not any("NOT bootloader-aware" in e.message for e in events if isinstance(e, FlashWarning))
    assert_flashed(board, img)


def test_board_left_in_its_bootloader_is_reported_as_such_with_the_way_back() -> None:
    """Every post-reset magic ACK lost, and the ACK of every RESET after the first: the flash does not end in
    "reset", nor in "not bootloader-aware" (exit 3 in the CLI), but says what is known: the board sits in its
    bootloader, the image is written and verified and not started; `robobus can reset` starts it."""
    board = BootBoard(2)
    board.faults.drop_magic_acks, board.faults.drop_magic_after = 1000, 1
    board.faults.drop_acks, board.faults.drop_command, board.faults.drop_after = 1000, p.BootCommand.RESET, 1
    img = small_image()
    f = Flasher(2, img, FlashConfig(), board_id=2)
    wire = Wire([board])
    wire.run(f)
    r = f.result
    assert r is not None and not r.ok and r.bootloader_aware is True, r
    assert "in its bootloader" in r.reason and "written and verified but NOT started" in r.reason, r.reason
    assert "robobus can reset 2" in r.reason and "reset;" not in r.reason and "NOT bootloader-aware" not in r.reason
    assert not any("NOT bootloader-aware" in e.message for e in f.events() if isinstance(e, FlashWarning))
    # and that is the truth: in the bootloader (EEPROM[0xFF] = 0xFF), the image written, the application not running
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY
    assert board.app_image(img.base, img.end) == img.data
    # the way back the message names: RESET (its ACK now arrives) starts the verified image
    board.faults.drop_acks = 0
    reset = reset_exchange(2)
    wire.run(reset)
    assert reset.ok
    assert_flashed(board, img)


def test_the_standalone_simulator_takes_the_magic_ack_drop_option() -> None:
    import threading

    from services.can_bootloader.sim import serve

    stop = threading.Event()
    stop.set()  # start, then stop at once: only the boards' configuration is looked at
    sim = serve("virtual", f"robobus-serve-{id(stop)}", [3, 4], stop, drop_magic_acks=2, drop_magic_after=1)
    assert [(b.faults.drop_magic_acks, b.faults.drop_magic_after) for b in sim.boards] == [(2, 1), (2, 1)]
