"""The flashing state machine, sans-I/O: frames in, frames and events out, time passed in.

A driver (transport.py, the tests, the benchmark) loops:

    frames = flasher.poll(now)          # send these
    flasher.receive(frame, now)         # for every frame the bus delivers
    flasher.tick(now)                   # timeouts; call at flasher.deadline() at the latest
    flasher.events()                    # phase changes, rewinds, warnings, the final result

The sequence is the original SimpleMotorFlasher's (docs/reference/can_bootloader.md §4): magic packet, erase, per
32-byte block
WRITE_FLASH_ADDRESS + 4 × WRITE_FLASH_DATA, read-back of the whole image 8 bytes at a time, reset; then
(robobus addition, docs/reference/can_bootloader.md §3 "BEWARE") a second magic packet proves the new firmware is
bootloader-aware.
That check resends the magic packet at the reference's magic timing (100 ms) within its budget: an aware
firmware that got the first one has already jumped into the bootloader (EEPROM[0xFF] = 0xFF), whose ACK may be
the one lost, and every later magic packet reboots the bootloader and is ACKed again. When none is answered,
READ_VERSION tells the two cases apart: an answer means the board sits in its bootloader (so the firmware did
go there: it is aware), with the image written and verified but not started, and it gets its RESET; silence
means the new firmware runs and ignores the bootloader (or the board has left the bus).
Differences from the original, each deliberate:
- every retry is bounded and configurable (the original retried ERASE, WRITE_ADDRESS and RESET forever);
- the dummy frame (id 0, length 0) the original sent first is not sent: its own code questioned it
  ("@todo") and the bootloader ignores it;
- 32-byte blocks that are all 0xFF are not written (ERASE left them so) but are verified;
- up to `window` frames are in flight. ACKs come back in order (one bus, one bootloader that handles one
  frame at a time), so the oldest unanswered frame is the one an ACK must match. A missing ACK (timeout, or
  the ACK of a later frame arriving first) rewinds to the start of its 32-byte block, as the original did on
  a WRITE_DATA timeout: WRITE_FLASH_ADDRESS resets the bootloader's `position`, and rewriting a block with
  the same bytes is harmless (flash programming only clears bits). Before resending, the flasher waits
  `drain_s` and ignores everything, so stale ACKs of the abandoned window cannot be taken for new ones;
- a read-back mismatch is retried (up to `read_retries` per chunk, the original's max_retry = 20),
  re-reading the last `window` chunks (READ answers carry no address, only their order ties them to a
  request); if the flash really holds other bytes, the whole flash restarts from ERASE (`restarts` times),
  then one frame at a time;
- every loss halves the window (it grows back by one every 32 ACKs): a lost frame, unlike a lost ACK, can
  mean the PIC's two receive buffers overflowed while it was writing flash, and a data frame that arrives
  without its WRITE_FLASH_ADDRESS programs a shifted block that only an erase can undo (verify catches it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from services.can_bootloader import protocol as p
from services.can_bootloader.image import APP_START, CHUNK, FlashImage


class Phase(StrEnum):
    IDLE = "idle"
    MAGIC = "magic"
    GUARD = "guard"  # read the bootloader area (0x0000–0x04BF) before anything is written: the baseline
    ERASE = "erase"
    WRITE = "write"
    VERIFY = "verify"
    GUARD_CHECK = "guard_check"  # the write could have reached the bootloader area: read it back, compare
    RESET = "reset"
    CHECK = "check"  # post-reset magic packet: is the new firmware bootloader-aware?
    PROBE = "probe"  # no check ACK: READ_VERSION, is the board in its bootloader (ACKs lost) or in the app?
    CHECK_RESET = "check_reset"  # it was: reset it again into the application
    REENTER = "reenter"  # a RESET went unanswered: magic packet to get back into the bootloader, then RESET
    DONE = "done"


class FlashConfig(BaseModel):
    """Timeouts and retries; defaults are the original's where it had bounded ones (docs/reference/can_bootloader.md
    §4). The one
    definition: the service's `can_flash` setting is this model (`window` and `check_bootloader_aware` come
    from ROBOBUS_CAN_WINDOW and the request instead)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    window: int = Field(2, ge=1, description="Frames in flight; 1 = the original's stop-and-wait")
    magic_timeout_s: float = Field(0.1, gt=0)
    magic_tries: int = Field(2, ge=1)
    erase_timeout_s: float = Field(3.0, gt=0)
    erase_tries: int = Field(3, ge=1, description="The original: forever")
    post_erase_delay_s: float = Field(0.0, ge=0, description="The original slept 1 s; the bootloader ACKs ERASE "
                                                            "after its erase loop")
    frame_timeout_s: float = Field(0.1, gt=0, description="WRITE_ADDRESS, WRITE_DATA, READ")
    block_retries: int = Field(20, ge=0, description="Rewinds of one 32-byte block (the original: forever)")
    read_retries: int = Field(20, ge=1, description="Per 8-byte chunk (the original's max_retry)")
    reset_timeout_s: float = Field(1.0, gt=0)
    reset_tries: int = Field(3, ge=1, description="The original: forever")
    check_bootloader_aware: bool = True
    check_delay_s: float = Field(0.05, ge=0, description="Let the new application start before the magic packet")
    check_timeout_s: float = Field(0.1, gt=0, description="Per magic packet of the check: the ACK comes from the "
                                                          "bootloader booting, as in the magic phase (100 ms)")
    check_tries: int = Field(10, ge=1, description="A lost ACK must not brand an aware firmware as unaware; more "
                                                   "magic packets are harmless (each reboots the bootloader, which "
                                                   "ACKs again): a 1 s budget at the default timeout")
    probe_tries: int = Field(3, ge=1, description="READ_VERSION after an unanswered check (frame_timeout_s each): "
                                                  "an answer means the board is in its bootloader")
    drain_s: float = Field(0.05, ge=0, description="Quiet time after a rewind with several frames in flight")
    restarts: int = Field(1, ge=0, description="Full re-erase + rewrite after a read-back that re-reading "
                                               "cannot fix")


# -- events ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseStarted:
    phase: Phase
    total_bytes: int


@dataclass(frozen=True)
class Rewind:
    phase: Phase
    address: int | None
    reason: str


@dataclass(frozen=True)
class FlashWarning:
    message: str


@dataclass(frozen=True)
class Finished:
    ok: bool
    reason: str
    phase: Phase  # where it ended (DONE on success, else the failing phase)
    address: int | None
    bootloader_aware: bool | None
    cancelled: bool = False
    held: bool = False  # the bus stop held a RESET: the image is written and verified, the board in its bootloader
    no_answer: bool = False  # after its RESET the board answered nothing: where it is is not known
    boot_area_intact: bool | None = None  # the bootloader area read back: unchanged / CHANGED / not read back


FlashEvent = PhaseStarted | Rewind | FlashWarning | Finished


@dataclass(frozen=True)
class Snapshot:
    phase: Phase
    done: int
    total: int
    frames_sent: int
    frames_received: int
    retries: int
    restarts: int


# -- the generic pipelined exchange ------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    frame: p.BootFrame
    address: int | None = None
    expect: bytes | None = None  # READ_FLASH: the bytes the reply must carry
    unit: int = 0  # index of the first op to resend when this one is lost (block start)
    data_bytes: int = 0  # bytes this op accounts for in progress
    gate: bool = False  # sent only once every earlier op is acknowledged (the data frame that programs a row)


@dataclass
class Failure:
    reason: str
    address: int | None
    op_index: int


class Pipeline:
    """Send `ops` in order with up to `window` in flight; ACKs must arrive in order.

    `rewind_to(i)` names the op to resend from when op i is lost; retries are counted per rewind target.
    `keep_replies` stores the matching reply of every op (READ dumps, READ_VERSION).
    """

    def __init__(self, ops: list[Op], *, window: int, timeout_s: float, tries: int, drain_s: float,
                 rewind_to: Callable[[int], int] | None = None, keep_replies: bool = False,
                 not_before: float = 0.0, reboot: p.BootFrame | None = None) -> None:
        self.ops = ops
        self.reboot = reboot  # a request whose ACK is the bootloader's boot ACK: seen, the board rebooted
        self.reboots = 0
        self.window = window  # current window: halved on every loss, grown back by one per `grow_after` ACKs
        self.max_window = window
        self.grow_after = 32
        self._streak = 0
        self.timeout_s = timeout_s
        self.tries = tries
        self.drain_s = drain_s
        self.rewind_to = rewind_to or (lambda i: self.ops[i].unit)
        self.replies: list[p.BootFrame | None] = [None] * len(ops) if keep_replies else []
        self.keep_replies = keep_replies
        self.acked = 0
        self.next = 0
        self.sent_at: list[float] = [0.0] * len(ops)
        self.attempts: dict[int, int] = {}
        self.retries = 0
        self.frames_sent = 0
        self.stray = 0
        self.drain_until: float | None = None
        self.not_before = not_before
        self.failure: Failure | None = None
        self.rewinds: list[tuple[int, str]] = []  # (op index lost, reason), drained by the owner

    @property
    def finished(self) -> bool:
        return self.failure is None and self.acked >= len(self.ops)

    @property
    def active(self) -> bool:
        return self.failure is None and self.acked < len(self.ops)

    def in_flight(self) -> int:
        return self.next - self.acked

    def poll(self, now: float) -> list[p.BootFrame]:
        if not self.active or now < self.not_before:
            return []
        if self.drain_until is not None:
            if now < self.drain_until:
                return []
            self.drain_until = None
        out: list[p.BootFrame] = []
        while self.next < len(self.ops) and self.next - self.acked < self.window:
            if self.ops[self.next].gate and self.next > self.acked:
                break  # its block's earlier frames must be acknowledged first, with no reboot seen before them
            self.sent_at[self.next] = now
            out.append(self.ops[self.next].frame)
            self.next += 1
        self.frames_sent += len(out)
        return out

    def _matches(self, op: Op, frame: p.BootFrame) -> bool:
        if op.expect is not None:
            return p.read_matches(op.frame, frame, op.expect)
        return p.is_ack(op.frame, frame)

    def receive(self, frame: p.BootFrame, now: float) -> bool:
        """Feed one received frame; True if it was taken as an ACK."""
        if (self.reboot is not None and self.active and self.drain_until is None
                and p.is_ack(self.reboot, frame)):
            # The bootloader ACKs the magic packet when it boots: the board rebooted, TBLPTR is 0 and the write
            # address is gone. Data frames must not follow without a fresh WRITE_FLASH_ADDRESS: four of them
            # would program the row at 0x0000, the bootloader's own reset vector.
            self.reboots += 1
            self._lost(self.acked, now, "the board rebooted (its bootloader's boot ACK came): the write address "
                                        "is lost", drain=self.next > self.acked)
            return False
        if not self.active or self.drain_until is not None or self.next == self.acked:
            self.stray += 1
            return False
        op = self.ops[self.acked]
        if self._matches(op, frame):
            if self.keep_replies:
                self.replies[self.acked] = frame
            self.acked += 1
            self._streak += 1
            if self._streak >= self.grow_after and self.window < self.max_window:
                self.window += 1
                self._streak = 0
            return True
        if op.expect is not None and p.is_ack(op.frame, frame):
            self._lost(self.acked, now, f"read-back mismatch: expected {op.expect.hex(' ')}, "
                                        f"read {frame.data.hex(' ')}")
            return False
        for j in range(self.acked + 1, self.next):
            if self.ops[j].expect is None and p.is_ack(self.ops[j].frame, frame):
                self._lost(self.acked, now, f"ACK of {self.ops[self.acked].frame} missing "
                                            f"(the ACK of a later frame came first)")
                return False
        self.stray += 1
        return False

    def tick(self, now: float) -> None:
        if not self.active or self.drain_until is not None or self.next == self.acked:
            return
        if now - self.sent_at[self.acked] >= self.timeout_s:
            self._lost(self.acked, now, f"no ACK to {self.ops[self.acked].frame} within "
                                        f"{self.timeout_s * 1000:.0f} ms")

    def deadline(self) -> float | None:
        if not self.active:
            return None
        if self.drain_until is not None:
            return self.drain_until
        if self.next == self.acked:
            return self.not_before if self.not_before else None
        return self.sent_at[self.acked] + self.timeout_s

    def _lost(self, i: int, now: float, reason: str, drain: bool = False) -> None:
        target = self.rewind_to(i)
        n = self.attempts.get(target, 1) + 1
        self.attempts[target] = n
        if n > self.tries:
            self.failure = Failure(f"{reason}; gave up after {self.tries} tries", self.ops[i].address, i)
            return
        self.retries += 1
        self.rewinds.append((i, reason))
        # A loss may be a frame the bootloader never got (its two receive buffers overflow when frames come
        # faster than it writes flash): back off like TCP, halve the window, grow it back slowly.
        self.window = max(1, self.window // 2)
        self._streak = 0
        several = self.next - self.acked > 1 or drain
        self.acked = self.next = min(target, self.acked)
        if several:
            # Frames of the abandoned window may still be answered: let them pass, ignore them.
            self.drain_until = now + self.drain_s

    def progress_bytes(self) -> int:
        return sum(op.data_bytes for op in self.ops[:self.acked])


# -- the flasher --------------------------------------------------------------------------------------------
@dataclass
class _Counters:
    frames_sent: int = 0
    frames_received: int = 0
    retries: int = 0
    restarts: int = 0


Hold = Callable[[], str | None]  # before a RESET goes out: why it must not (the bus stop), or None


class Flasher:
    """Flash one board: one bus, one bootloader, one image.

    `hold()` is asked right before a RESET frame leaves `poll` (the driver sends what poll returns at once): a
    reason (the bus stop is active) ends the flash there, with the image written and verified and the board in
    its bootloader, instead of starting a firmware that may drive a motor. Nothing else is held: stopping in the
    middle of an erase or a write would leave the board without a valid image."""

    def __init__(self, local_id: int, image: FlashImage, config: FlashConfig | None = None, *,
                 board_id: int | None = None, hold: Hold | None = None) -> None:
        if not 0 <= local_id < p.BOARDS_PER_BUS:
            raise p.ProtocolError(f"local board id {local_id} is out of range 0–9")
        self.local_id = local_id
        self.board_id = board_id  # the board's id 0–19, for the recovery commands a message names
        self.image = image
        self.cfg = config or FlashConfig()
        self.hold = hold
        self.phase = Phase.IDLE
        self.pipe: Pipeline | None = None
        self._events: list[FlashEvent] = []
        self._counters = _Counters()
        self.result: Finished | None = None
        self._reset_attempts = 1
        self._resume = Phase.RESET
        self._in_bootloader = ""  # how the board was last seen in its bootloader after the reset, if it was
        self._write_ops = self._build_write_ops()
        self._verify_ops = self._build_verify_ops()
        self._guard: bytes | None = None  # the bootloader area as read before anything was written
        self._guard_candidate: bytes | None = None  # a baseline read with losses: confirmed by a second read
        self._guard_passes = 0
        self._exposed = ""  # why a write could have reached the bootloader area (a reboot, a lost frame), if so
        self._pending: Failure | None = None  # a failure waiting for the bootloader area's read-back
        self._pending_phase = Phase.IDLE
        for w in image.warnings:
            self._events.append(FlashWarning(w))

    # -- op lists ------------------------------------------------------------------------------------------
    def _build_write_ops(self) -> list[Op]:
        ops: list[Op] = []
        for addr, block in self.image.write_blocks():
            start = len(ops)
            ops.append(Op(p.write_flash_address(self.local_id, addr), addr, unit=start))
            for k in range(0, len(block), CHUNK):
                # the frame that fills the row (the 4th) programs it: it waits for its block's earlier ACKs, so a
                # reboot in between (boot ACK, or an ACK missing) is seen before a row is programmed at 0x0000
                ops.append(Op(p.write_flash_data(self.local_id, block[k:k + CHUNK]), addr + k, unit=start,
                              data_bytes=CHUNK, gate=k + CHUNK >= len(block)))
        return ops

    def _guard_ops(self, base: bytes | None) -> list[Op]:
        """READ_FLASH of the bootloader and its vectors (0x0000–0x04BF); with `base`, each answer must carry
        those bytes (READ answers carry no address: only a compared read is immune to a late answer)."""
        return [Op(p.read_flash(self.local_id, a), a,
                   expect=None if base is None else base[a:a + CHUNK])
                for a in range(0, APP_START, CHUNK)]

    def _build_verify_ops(self) -> list[Op]:
        return [Op(p.read_flash(self.local_id, addr), addr, expect=chunk, data_bytes=len(chunk))
                for addr, chunk in self.image.chunks()]

    # -- driving ---------------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.phase is not Phase.IDLE:
            raise RuntimeError("flasher already started")
        self._enter(Phase.MAGIC, now)

    @property
    def done(self) -> bool:
        return self.result is not None

    def events(self) -> list[FlashEvent]:
        out, self._events = self._events, []
        return out

    def poll(self, now: float) -> list[p.BootFrame]:
        self._advance(now)
        if self.pipe is None or self.done:
            return []
        frames = self.pipe.poll(now)
        if frames and self.hold is not None and any(p.starts_firmware(f) for f in frames):
            why = self.hold()
            if why:
                self._held(why)
                return []
        self._counters.frames_sent += len(frames)
        return frames

    def receive(self, frame: p.BootFrame, now: float) -> None:
        self._counters.frames_received += 1
        if self.pipe is None or self.done:
            return
        self.pipe.receive(frame, now)
        self._advance(now)

    def tick(self, now: float) -> None:
        if self.pipe is None or self.done:
            return
        self.pipe.tick(now)
        self._advance(now)

    def deadline(self) -> float | None:
        if self.pipe is None or self.done:
            return None
        return self.pipe.deadline()

    def cancel(self, now: float) -> bool:
        """Stop before the RESET goes out: the board stays in its bootloader (EEPROM flag 0xFF), ready to
        be flashed again. After RESET the flash is complete and the job finishes on its own: False."""
        if self.done:
            return False
        if self.phase in (Phase.GUARD_CHECK, Phase.RESET, Phase.CHECK, Phase.PROBE, Phase.CHECK_RESET,
                          Phase.REENTER):
            return False
        addr = self.current_address()
        self._finish(False, "cancelled by request; the board stays in its bootloader, ready to be flashed again",
                     address=addr, cancelled=True)
        return True

    def snapshot(self) -> Snapshot:
        done = self.pipe.progress_bytes() if self.pipe is not None else 0
        total = self._phase_total(self.phase)
        retries = self._counters.retries + (self.pipe.retries if self.pipe is not None else 0)
        return Snapshot(self.phase, done, total, self._counters.frames_sent, self._counters.frames_received,
                        retries, self._counters.restarts)

    # -- internals --------------------------------------------------------------------------------------------
    def _phase_total(self, phase: Phase) -> int:
        if phase is Phase.WRITE:
            return sum(op.data_bytes for op in self._write_ops)
        if phase is Phase.VERIFY:
            return len(self.image.data)
        return 0

    @property
    def exposed(self) -> str:
        """Why a data frame could have reached the board without its write address (empty: it could not)."""
        return self._exposed

    def current_address(self) -> int | None:
        """The program memory address being worked on (write and verify phases), else None."""
        if self.pipe is None or not self.pipe.ops:
            return None
        i = min(self.pipe.acked, len(self.pipe.ops) - 1)
        return self.pipe.ops[i].address

    def _enter(self, phase: Phase, now: float) -> None:
        if self.pipe is not None:
            self._counters.retries += self.pipe.retries
            self._note_exposure(self.pipe)
        self.phase = phase
        cfg, lid = self.cfg, self.local_id

        def single(frame: p.BootFrame, timeout_s: float, tries: int, not_before: float = 0.0) -> Pipeline:
            return Pipeline([Op(frame)], window=1, timeout_s=timeout_s, tries=tries, drain_s=cfg.drain_s,
                            not_before=not_before)

        if phase is Phase.MAGIC:
            self.pipe = single(p.magic_packet(lid), cfg.magic_timeout_s, cfg.magic_tries)
        elif phase in (Phase.GUARD, Phase.GUARD_CHECK):
            w = cfg.window
            after_failure = self._pending is not None  # best effort: the board may be gone
            base = self._guard if phase is Phase.GUARD_CHECK else self._guard_candidate
            self.pipe = Pipeline(self._guard_ops(base), window=w, timeout_s=cfg.frame_timeout_s,
                                 tries=cfg.probe_tries if after_failure else cfg.read_retries, drain_s=cfg.drain_s,
                                 rewind_to=lambda i: max(0, i - (w - 1)), keep_replies=base is None,
                                 not_before=now + (cfg.drain_s if self._guard_passes else 0.0))
        elif phase is Phase.ERASE:
            self.pipe = single(p.erase_flash(lid), cfg.erase_timeout_s, cfg.erase_tries)
        elif phase is Phase.WRITE:
            # after a restart, stop-and-wait: a block written without its WRITE_FLASH_ADDRESS (lost in an
            # overflowing receive buffer) lands shifted and only an erase undoes it. A boot ACK (the board
            # rebooted: its write address is gone) rewinds to the block's WRITE_FLASH_ADDRESS.
            self.pipe = Pipeline(self._write_ops, window=1 if self._counters.restarts else cfg.window,
                                 timeout_s=cfg.frame_timeout_s,
                                 tries=cfg.block_retries + 1, drain_s=cfg.drain_s,
                                 not_before=now + cfg.post_erase_delay_s, reboot=p.magic_packet(lid))
        elif phase is Phase.VERIFY:
            w = cfg.window
            self.pipe = Pipeline(self._verify_ops, window=w, timeout_s=cfg.frame_timeout_s,
                                 tries=cfg.read_retries, drain_s=cfg.drain_s,
                                 rewind_to=lambda i: max(0, i - (w - 1)))
        elif phase in (Phase.RESET, Phase.CHECK_RESET):
            # One try per pipeline: a RESET whose ACK was lost has already started the application, which
            # ignores RESET; the flasher re-enters the bootloader first (Phase.REENTER).
            self.pipe = single(p.reset(lid), cfg.reset_timeout_s, 1)
        elif phase is Phase.REENTER:
            self.pipe = single(p.magic_packet(lid), cfg.magic_timeout_s, cfg.magic_tries)
        elif phase is Phase.CHECK:
            self.pipe = single(p.magic_packet(lid), cfg.check_timeout_s, cfg.check_tries,
                               not_before=now + cfg.check_delay_s)
        elif phase is Phase.PROBE:
            self.pipe = single(p.read_version(lid), cfg.frame_timeout_s, cfg.probe_tries)
        self._events.append(PhaseStarted(phase, self._phase_total(phase)))

    def _advance(self, now: float) -> None:
        while self.pipe is not None and not self.done:
            pipe = self.pipe
            for i, reason in pipe.rewinds:
                self._events.append(Rewind(self.phase, pipe.ops[i].address, reason))
            pipe.rewinds.clear()
            if pipe.failure is not None:
                self._on_failure(pipe.failure, now)
                return
            if not pipe.finished:
                return
            self._on_phase_done(now)

    def _note_exposure(self, pipe: Pipeline) -> None:
        """A write pipeline that saw a reboot, or lost a frame or an ACK, may have had data frames reach a
        rebooted bootloader (its boot ACK can be lost too): the bootloader area must be read back."""
        if self.phase is not Phase.WRITE or self._exposed:
            return
        if pipe.reboots:
            self._exposed = f"the board rebooted during the write ({pipe.reboots} boot ACK(s))"
        elif pipe.retries or pipe.failure is not None:
            self._exposed = "frames or ACKs were lost during the write (a reboot whose boot ACK was lost looks so)"

    def _on_phase_done(self, now: float) -> None:
        ph = self.phase
        if ph is Phase.MAGIC:
            self._enter(Phase.GUARD, now)
        elif ph is Phase.GUARD:
            assert self.pipe is not None
            self._guard_passes += 1
            if self._guard_candidate is not None:  # the second read carried the same bytes: the baseline
                self._guard = self._guard_candidate
            else:  # one answer corrupted, or a late one taken for the next chunk's, would be a false alarm
                # later: read again, compared
                self._guard_candidate = b"".join(r.data if r is not None else b"" for r in self.pipe.replies)
                self._enter(Phase.GUARD, now)
                return
            self._enter(Phase.ERASE, now)
        elif ph is Phase.ERASE:
            self._enter(Phase.WRITE, now)
        elif ph is Phase.WRITE:
            self._enter(Phase.VERIFY, now)
        elif ph is Phase.VERIFY:
            assert self.pipe is not None
            self._note_exposure(self.pipe)
            if self._exposed or self._counters.restarts:
                self._enter(Phase.GUARD_CHECK, now)
            else:
                self._enter(Phase.RESET, now)
        elif ph is Phase.GUARD_CHECK:
            self._guard_unchanged(now)
        elif ph is Phase.RESET:
            if self.cfg.check_bootloader_aware:
                self._enter(Phase.CHECK, now)
            else:
                self._finish(True, "flashed, verified and reset", address=None, aware=None)
        elif ph is Phase.CHECK:
            self._in_bootloader = "it answered the magic packet"
            self._enter(Phase.CHECK_RESET, now)
        elif ph is Phase.PROBE:
            self._in_bootloader = "it answered READ_VERSION"
            self._events.append(FlashWarning(
                f"none of the {self.cfg.check_tries} magic packets after the reset was acknowledged, but board "
                f"{self.local_id} answers READ_VERSION: it is in its bootloader, so the new firmware did jump there "
                "(it is bootloader-aware) and the ACKs were lost; starting the image with RESET"))
            self._enter(Phase.CHECK_RESET, now)
        elif ph is Phase.REENTER:
            self._enter(self._resume, now)
        elif ph is Phase.CHECK_RESET:
            self._finish(True, "flashed, verified and reset; the new firmware is bootloader-aware",
                         address=None, aware=True)

    def _guard_unchanged(self, now: float) -> None:
        """The bootloader area reads as before the write."""
        note = (f"the bootloader area (0x000000–0x{APP_START - 1:06X}) was read back after the write "
                f"({self._exposed or 'a restart'}): unchanged")
        if self._pending is not None:
            self._end_pending(note, intact=True)
            return
        self._events.append(FlashWarning(note))
        self._enter(Phase.RESET, now)

    def _end_pending(self, note: str, *, intact: bool | None) -> None:
        f, ph = self._pending, self._pending_phase
        assert f is not None
        self.phase = ph
        where = f" at 0x{f.address:06X}" if f.address is not None else ""
        self._finish(False, f"{ph.value} failed{where}: {f.reason}; {note}", address=f.address,
                     boot_area_intact=intact)

    def _guard_changed(self, failure: Failure) -> None:
        """The bootloader area reads differently than before the write: say so loudly, send no RESET."""
        base = self._guard or b""
        a = failure.address or 0
        msg = (f"BOOTLOADER AREA CHANGED on board {self._board_hint()}: 0x{a:06X} reads differently than before "
               f"the write ({failure.reason}; before: {base[a:a + CHUNK].hex(' ')}). A data frame reached the "
               f"board without its write address ({self._exposed or 'after a restart'}) and was programmed into "
               "its bootloader (0x0000 is its reset vector). RESET was NOT sent: the bootloader runs from flash "
               "and still answers now, but may not boot again. Keep the board powered; over CAN only the "
               "application area can be erased, so the bootloader must be reprogrammed with an ICD programmer "
               "(pic18-bootloader.hex), unless a new read shows the bytes as before (a corrupted answer)")
        self._events.append(FlashWarning(msg))
        if self._pending is not None:
            self._end_pending(msg, intact=False)
            return
        self._finish(False, msg, address=a, boot_area_intact=False)

    def _on_failure(self, failure: Failure, now: float) -> None:
        ph = self.phase
        if ph is Phase.GUARD and self._guard_candidate is not None and self._guard_passes < 6 \
                and failure.reason.startswith("read-back mismatch"):
            self._guard_passes += 1
            self._guard_candidate = None  # the first read was misaligned by a late answer: read it afresh
            self._enter(Phase.GUARD, now)
            return
        if ph is Phase.GUARD_CHECK:
            if failure.reason.startswith("read-back mismatch"):
                self._guard_changed(failure)
            elif self._pending is not None:
                self._end_pending(f"the bootloader area could not be read back ({failure.reason}): a data frame "
                                  "may have reached it; read it (`robobus can read "
                                  f"{self._board_hint()} 0x0 {APP_START}`) before any RESET or power cycle",
                                  intact=None)
            else:
                self._finish(False, f"the bootloader area could not be read back after the write "
                                    f"({self._exposed or 'a restart'}): {failure.reason}. RESET was not sent; read "
                                    f"it (`robobus can read {self._board_hint()} 0x0 {APP_START}`) before any "
                                    "RESET or power cycle", address=failure.address)
            return
        if ph in (Phase.WRITE, Phase.VERIFY) and self._guard is not None and not (
                ph is Phase.VERIFY and failure.reason.startswith("read-back mismatch")
                and self._counters.restarts < self.cfg.restarts):
            assert self.pipe is not None
            self._note_exposure(self.pipe)
            if not self._exposed and failure.reason.startswith("read-back mismatch"):
                self._exposed = "the image did not read back as written (a block may have gone elsewhere)"
            if self._exposed or self._counters.restarts:
                # what the failure could have touched: read the bootloader area back before saying anything
                self._pending, self._pending_phase = failure, ph
                self._enter(Phase.GUARD_CHECK, now)
                return
        if ph is Phase.MAGIC:
            self._finish(False, f"None of the magic packets were ACKed: {failure.reason}. Is board "
                                f"{self.local_id} on this bus powered, and running the bootloader or a "
                                "bootloader-aware firmware?", address=None)
        elif ph is Phase.VERIFY and failure.reason.startswith("read-back mismatch") \
                and self._counters.restarts < self.cfg.restarts:
            self._counters.restarts += 1
            self._events.append(FlashWarning(f"verify failed at 0x{failure.address or 0:06X} ({failure.reason}); "
                                             "erasing and writing again, one frame at a time"))
            self._enter(Phase.ERASE, now)
        elif ph in (Phase.RESET, Phase.CHECK_RESET) and self._reset_attempts < self.cfg.reset_tries:
            self._reset_attempts += 1
            self._counters.retries += 1
            self._resume = ph
            self._events.append(Rewind(ph, None, f"{failure.reason}; sending the magic packet to get back into "
                                                 "the bootloader, then RESET again"))
            self._enter(Phase.REENTER, now)
        elif ph is Phase.REENTER and self._in_bootloader:
            # what is known: the image is written and verified; after the reset the board was in its bootloader
            # (the firmware went there on the magic packet: it is aware); the RESET that starts the image, and
            # the magic packets after it, were not acknowledged, and a magic packet takes an aware firmware back
            # into the bootloader: the board is there, the image not started. Not "reset", and not "unaware".
            self._finish(False, f"board {self._board_hint()} is in its bootloader: the new image is written and "
                                "verified but NOT started. After the reset the board was in its bootloader "
                                f"({self._in_bootloader}), so the new firmware is bootloader-aware; the RESET that "
                                "starts the image was not acknowledged, nor the magic packets sent after it "
                                f"({failure.reason}), and any magic packet that reached a running aware firmware took "
                                "it back into the bootloader. The board can be flashed again. To recover: `robobus "
                                f"can reset {self._board_hint()}` starts the verified image (`robobus can version` "
                                "first: an answer confirms the bootloader); no answer: check the board's power and "
                                "bus, then flash again",
                         address=None, aware=True)
        elif ph is Phase.REENTER:
            # say what was observed, no guess: a board still in its bootloader whose every answer is lost
            # looks exactly like one running a firmware that ignores the bootloader, or an unpowered one
            self._finish(False, f"{self._resume.value} failed: no answer from board {self.local_id} since the image "
                                f"was written and verified: RESET and the magic packets sent after it were not "
                                f"acknowledged ({failure.reason}). Check the "
                                "board's power and bus; reflash to be sure the new image runs",
                         address=None)
        elif ph is Phase.CHECK:
            self._enter(Phase.PROBE, now)  # bootloader (ACKs lost) or application (not aware)?
        elif ph is Phase.PROBE:
            # Silence proves nothing: a board in its bootloader whose answers are lost, an absent one, and one
            # running a firmware that ignores the bootloader all look the same. Say what is known.
            b = self._board_hint()
            n = self.cfg.check_tries + self.cfg.probe_tries
            msg = (f"no answer from board {b} after {n} tries since its RESET was acknowledged "
                   f"({self.cfg.check_tries} magic packets, {self.cfg.probe_tries} READ_VERSION): the image is "
                   "written and verified, but where the board is now is not known. It may sit in its bootloader "
                   f"with its answers lost (then `robobus can version {b}` answers and `robobus can reset {b}` "
                   "starts the image), be unpowered or off the bus, or run the new firmware if that is NOT "
                   "bootloader-aware (it ignores the magic packet: then the board cannot be reflashed over CAN "
                   "until EEPROM[0xFF] is set to 0xFF by hand, docs/reference/can_bootloader.md §3, BEWARE)")
            self._events.append(FlashWarning(msg))
            self._finish(False, msg, address=None, no_answer=True)
        else:
            where = f" at 0x{failure.address:06X}" if failure.address is not None else ""
            self._finish(False, f"{ph.value} failed{where}: {failure.reason}", address=failure.address)

    def _held(self, why: str) -> None:
        """The bus stop holds the RESET about to go out (reference §4: RESET marks the application valid and
        starts it): end here, the board in its bootloader, and say how to start the image after the release."""
        b = self._board_hint()
        after = (f"After the release, `robobus can reset {b}` starts it (a new command: nothing restarts by "
                 "itself), or flash again")
        if self.phase is Phase.CHECK_RESET:
            self._finish(False, f"held by the bus stop ({why}): the image is written and verified, and the new "
                                f"firmware is bootloader-aware ({self._in_bootloader} after the reset); the RESET "
                                f"that starts it again was not sent: board {b} stays in its bootloader. {after}",
                         address=None, aware=True, held=True)
            return
        earlier = ("" if self._reset_attempts == 1 else
                   " (an earlier RESET was not acknowledged and the magic packet since took the board back into "
                   "its bootloader)")
        self._finish(False, f"held by the bus stop ({why}): the image is written and verified; the RESET that "
                            f"starts it was not sent{earlier}: board {b} stays in its bootloader, the new firmware "
                            f"not started (its bootloader-aware check not done). {after}",
                     address=None, held=True)

    def _board_hint(self) -> str:
        return "<board>" if self.board_id is None else str(self.board_id)

    def _finish(self, ok: bool, reason: str, *, address: int | None, aware: bool | None = None,
                cancelled: bool = False, held: bool = False, no_answer: bool = False,
                boot_area_intact: bool | None = None) -> None:
        if self.pipe is not None:
            self._counters.retries += self.pipe.retries
            self.pipe.retries = 0
        phase = Phase.DONE if ok else self.phase
        if boot_area_intact is None and self._guard is not None and self.phase in (
                Phase.RESET, Phase.CHECK, Phase.PROBE, Phase.CHECK_RESET, Phase.REENTER, Phase.DONE) \
                and (self._exposed or self._counters.restarts):
            boot_area_intact = True  # read back after the verify, before the first RESET: unchanged
        self.result = Finished(ok, reason, phase, address, aware, cancelled, held, no_answer, boot_area_intact)
        self._events.append(self.result)
        if ok:
            self.phase = Phase.DONE


# -- single exchanges (read_version, read_flash dump, reset) ----------------------------------------------
@dataclass
class Exchange:
    """A pipelined run of requests whose replies the caller wants (sans-I/O, like Flasher)."""

    ops: list[Op]
    window: int = 1
    timeout_s: float = 0.1
    tries: int = 3
    drain_s: float = 0.05
    hold: Hold | None = None  # asked before a RESET goes out (see Flasher): a reason ends the exchange, `held`
    pipe: Pipeline = field(init=False)
    malformed: list[p.BootFrame] = field(init=False, default_factory=list)  # answers of the wrong shape
    held: str = field(init=False, default="")  # why a RESET was not sent (the bus stop)

    def __post_init__(self) -> None:
        w = self.window
        self.pipe = Pipeline(self.ops, window=w, timeout_s=self.timeout_s, tries=self.tries, drain_s=self.drain_s,
                             rewind_to=lambda i: max(0, i - (w - 1)), keep_replies=True)

    @property
    def done(self) -> bool:
        return bool(self.held) or not self.pipe.active

    @property
    def ok(self) -> bool:
        return not self.held and self.pipe.finished

    def poll(self, now: float) -> list[p.BootFrame]:
        if self.held:
            return []
        sent_before = self.pipe.frames_sent
        frames = self.pipe.poll(now)
        if frames and self.hold is not None and any(p.starts_firmware(f) for f in frames):
            why = self.hold()
            if why:
                self.held = why
                self.pipe.frames_sent = sent_before
                return []
        return frames

    def receive(self, frame: p.BootFrame, now: float) -> None:
        if not self.pipe.receive(frame, now) and any(p.is_malformed_answer(op.frame, frame)
                                                     for op in self.ops[:1] + self.ops[-1:]):
            self.malformed.append(frame)

    def tick(self, now: float) -> None:
        self.pipe.tick(now)

    def deadline(self) -> float | None:
        return self.pipe.deadline()

    def error(self) -> str:
        f = self.pipe.failure
        if f is None:
            return ""
        where = f" at 0x{f.address:06X}" if f.address is not None else ""
        return f"{f.reason}{where}"


def version_exchange(local_id: int, timeout_s: float = 0.1, tries: int = 3) -> Exchange:
    return Exchange([Op(p.read_version(local_id))], timeout_s=timeout_s, tries=tries)


def reset_exchange(local_id: int, timeout_s: float = 1.0, tries: int = 3, hold: Hold | None = None) -> Exchange:
    return Exchange([Op(p.reset(local_id))], timeout_s=timeout_s, tries=tries, hold=hold)


def read_exchange(local_id: int, start: int, length: int, window: int = 1, timeout_s: float = 0.1,
                  tries: int = 20) -> Exchange:
    """READ_FLASH every 8 bytes from `start` (rounded down to 8) covering `length` bytes."""
    first = start - start % CHUNK
    ops = [Op(p.read_flash(local_id, a), a) for a in range(first, start + length, CHUNK)]
    return Exchange(ops, window=window, timeout_s=timeout_s, tries=tries)
