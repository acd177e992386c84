"""A PIC18F2580 motor board running the Shadow CAN bootloader: the device side of protocol.py.

Model (docs/reference/can_bootloader.md §2, §3 and §4.5):
- 32 KB program memory; ERASE clears 0x04C0 up to 0x7DC0 in 64-byte rows; WRITE_FLASH_DATA fills the
  32 TBLWT holding registers (TBLPTR<4:0>) and the 4th frame (`position == 32`) programs the 32-byte block
  at TBLPTR<21:5> after the TBLRDPOSTDEC, exactly as `write_flash_data()` does. Programming only clears bits
  (flash AND holding registers), and the holding registers read 0xFF again after a row write.
- EEPROM[0xFF] is the boot flag: 0xFF stays in the bootloader, 0x42 (written by RESET) runs the application.
  The bootloader ACKs the magic packet when it boots (so MAGIC in the bootloader = reboot + ACK).
- READ_VERSION answers 40 41 42 43; READ_FLASH answers 8 bytes with SID | 0x10; every other command gets the
  usual echo ACK (same SID | 0x10, same length, same data).
- Application mode: the application answers only the magic packet, and only if the image is
  bootloader-aware (it writes 0xFF to EEPROM[0xFF] and jumps to 0, where the bootloader boots and ACKs).
  Awareness is read from the image: it contains BOOT_AWARE_MARKER (or `app_aware` forces it).
  Reference over seed: the seed says the application reacts to a magic packet whose direction bits are
  "10", but the original flasher sends every magic packet with direction "11" (0x600 | ...) and the
  SimpleMotor firmware "can be flashed over itself", so the model accepts both directions.
- A reboot forgets the write address: at power-on TBLPTR is 0x000000 (the PIC18's reset value) and the
  bootloader's `position` is 0, so four WRITE_FLASH_DATA frames that reach a rebooted bootloader before a
  WRITE_FLASH_ADDRESS program the row at 0x0000, the bootloader's own reset vector. The bootloader never
  checks the address (no source says whether real boards write-protect the boot block with WRTB); every row
  written outside the application area is recorded in `protected_writes`.
- Faults: drop or delay ACKs (any, one command's, or the ACKs of N magic packets: `drop_magic_acks`),
  corrupt READ answers, garble answers (right SID, wrong length: `garble`), lose power after N frames (it
  boots again into the bootloader, because the flag is 0xFF during a flash; the frame that met the power loss
  is lost, or with `power_loss_eats_frame=False` a brown-out reboots the board just before the frame, which
  the rebooted bootloader then handles; `drop_boot_acks` loses the boot ACKs of the reboots), drop answers
  for good (`drop_all`), and a 2-deep receive buffer that overflows when frames arrive while a row write or
  the erase stalls the CPU (virtual-bus attachment only).

`BootBoard.handle()` is the pure core; `BootBusSim` runs boards on a python-can bus; `on_can_frame()` plugs a
board into ethercat-loop's palm model (CAN direct mode).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.can_bootloader import protocol as p
from services.can_bootloader.image import APP_END, APP_START, BLOCK, ERASE_ROW
from services.can_bootloader.transport import BusHooks, CanPort

if TYPE_CHECKING:
    from services.can_bootloader.settings import CanBootSettings

log = logging.getLogger("robobus.can_bootloader.sim")

FLASH_SIZE = 0x8000
EEPROM_SIZE = 256
BOOT_FLAG_ADDR = 0xFF
FLAG_STAY = 0xFF
FLAG_RUN_APP = 0x42
BOOT_AWARE_MARKER = b"RBBL-AWARE"  # test images embed this to be modelled as bootloader-aware
ROW_WRITE_S = 0.002  # PIC18F2580 TIW (typical self-timed write)
ROW_ERASE_S = 0.002


@dataclass
class BootFaults:
    """Fault injection; counters count down as faults fire."""

    drop_acks: int = 0  # drop the next N answers ...
    drop_command: int | None = None  # ... of this command only (None: any)
    drop_after: int = 0  # ... after letting this many matching answers through
    delay_acks: int = 0  # delay the next N answers by delay_s
    delay_s: float = 0.0
    delay_command: int | None = None
    drop_magic_acks: int = 0  # drop the ACKs of the next N magic packets (the bootloader's ACK at boot) ...
    drop_magic_after: int = 0  # ... after letting this many through (independent of drop_acks)
    corrupt_reads: int = 0  # flip bits in the next N READ answers ...
    corrupt_after: int = 0  # ... after this many good ones
    garble: int = 0  # answer the next N frames with a malformed answer (right SID, wrong length): garbage
    power_loss_after: int | None = None  # lose power after receiving this many more frames
    power_off_s: float = 0.05
    power_loss_eats_frame: bool = True  # False: a brown-out reboots the board and the frame reaches the new boot
    drop_boot_acks: int = 0  # lose the boot ACKs of the next N reboots caused by power losses
    drop_all: bool = False  # every answer lost (a board that hears but whose answers never come back)
    dropped: int = 0
    delayed: int = 0
    corrupted: int = 0
    garbled: int = 0
    power_losses: int = 0


@dataclass
class BootReply:
    sid: int
    data: bytes
    delay_s: float = 0.0


@dataclass
class BootBoard:
    """One motor board: program memory, EEPROM, the bootloader, a (bootloader-aware or not) application."""

    local_id: int
    bus: int = 1
    app_aware: bool | None = None  # None: decide from the image (BOOT_AWARE_MARKER)
    flash: bytearray = field(default_factory=lambda: bytearray(b"\xff" * FLASH_SIZE))
    eeprom: bytearray = field(default_factory=lambda: bytearray(b"\xff" * EEPROM_SIZE))
    faults: BootFaults = field(default_factory=BootFaults)
    mode: str = "off"  # "bootloader", "app", "off"
    tblptr: int = 0
    position: int = 0
    holding: bytearray = field(default_factory=lambda: bytearray(b"\xff" * BLOCK))
    powered_off_until: float | None = None
    frames_in: int = 0
    row_writes: int = 0
    protected_writes: list[int] = field(default_factory=list)  # rows written outside 0x04C0–0x7DC0
    erases: int = 0
    boots: int = 0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not 0 <= self.local_id < p.BOARDS_PER_BUS:
            raise ValueError(f"local id {self.local_id} out of range 0–9")
        # A bootloader lives at 0x0000–0x047F (programmed with an ICD, never over CAN).
        for a in range(0, 0x0480):
            self.flash[a] = (a * 7 + 3) & 0xFF

    @property
    def board(self) -> int:
        return self.local_id + (p.BOARDS_PER_BUS if self.bus == 2 else 0)

    # -- power ---------------------------------------------------------------------------------------------
    def power_on(self) -> list[BootReply]:
        """Boot: the bootloader runs first and stays if the flag is 0xFF (and ACKs the magic packet)."""
        self.powered_off_until = None
        self.boots += 1
        self.position = 0
        self.tblptr = 0  # TBLPTR's reset value: the write address is forgotten
        self.holding[:] = b"\xff" * BLOCK
        if self.eeprom[BOOT_FLAG_ADDR] == FLAG_RUN_APP:
            self.mode = "app"
            return []
        self.mode = "bootloader"
        return [BootReply(p.boot_sid(self.local_id, p.BootCommand.MAGIC_PACKET, ack=True), p.MAGIC_DATA)]

    def power_off(self, off_s: float | None = None) -> None:
        self.mode = "off"
        self.faults.power_losses += 1
        self.powered_off_until = None if off_s is None else self.clock() + off_s

    def _boot_acks(self, replies: list[BootReply]) -> list[BootReply]:
        """The boot ACK of a reboot after a power loss, unless the fault loses it."""
        if replies and self.faults.drop_boot_acks > 0:
            self.faults.drop_boot_acks -= 1
            self.faults.dropped += 1
            return []
        return replies

    def app_is_aware(self) -> bool:
        if self.app_aware is not None:
            return self.app_aware
        return BOOT_AWARE_MARKER in self.flash[APP_START:APP_END]

    def app_image(self, start: int = APP_START, end: int = APP_END) -> bytes:
        return bytes(self.flash[start:end])

    # -- the pure core ----------------------------------------------------------------------------------------
    def handle(self, sid: int, data: bytes) -> list[BootReply]:
        """One received frame -> the frames the board sends back (with fault delays)."""
        if self.mode == "off":
            if self.powered_off_until is not None and self.clock() >= self.powered_off_until:
                boot = self._boot_acks(self.power_on())
                return [*self._faulted(boot), *self.handle(sid, data)]
            return []
        self.frames_in += 1
        if self.faults.power_loss_after is not None:
            if self.faults.power_loss_after <= 0:
                self.faults.power_loss_after = None
                if self.faults.power_loss_eats_frame:
                    self.power_off(self.faults.power_off_s)
                    return []
                # a brown-out between two frames: the board reboots and the frame reaches the new bootloader
                self.power_off(0.0)
                boot = self._boot_acks(self.power_on())
                self.frames_in -= 1
                return [*self._faulted(boot), *self.handle(sid, data)]
            self.faults.power_loss_after -= 1
        if sid & p.ACK_BIT or not 0 <= sid <= p.SID_MASK:
            return []
        if ((sid & p.ID_MASK) >> p.ID_SHIFT) != self.local_id:
            return []
        direction = sid & p.DIRECTION_MASK
        cmd = sid & p.COMMAND_MASK
        if self.mode == "app":
            if (cmd == p.BootCommand.MAGIC_PACKET and direction in (0x400, 0x600) and bytes(data) == p.MAGIC_DATA
                    and self.app_is_aware()):
                self.eeprom[BOOT_FLAG_ADDR] = FLAG_STAY
                return self._faulted(self.power_on())  # goto 0x0000: the bootloader boots and ACKs
            return []
        if direction != p.BOOT_DIRECTION:
            return []
        return self._faulted(self._bootloader(sid, cmd, bytes(data)))

    def _bootloader(self, sid: int, cmd: int, data: bytes) -> list[BootReply]:
        echo = [BootReply(sid | p.ACK_BIT, data)]
        if cmd == p.BootCommand.WRITE_FLASH_DATA:
            for b in data[:8].ljust(8, b"\x00"):
                self.holding[self.tblptr & (BLOCK - 1)] = b  # TBLWTPOSTINC
                self.tblptr = (self.tblptr + 1) & 0x3FFFFF
            self.position += 8
            if self.position == 32:
                self.tblptr = (self.tblptr - 1) & 0x3FFFFF  # TBLRDPOSTDEC
                self._row_write(self.tblptr & ~(BLOCK - 1))
                self.position = 0
            return echo
        if cmd == p.BootCommand.READ_FLASH:
            addr = p.parse_address(data)
            out = bytes(self.flash[a] if a < FLASH_SIZE else 0 for a in range(addr, addr + 8))
            self.tblptr = (addr + 8) & 0x3FFFFF
            return [BootReply(sid | p.ACK_BIT, out)]
        if cmd == p.BootCommand.ERASE_FLASH:
            i = APP_START
            while i < APP_END:
                row = i & ~(ERASE_ROW - 1)
                self.flash[row:row + ERASE_ROW] = b"\xff" * ERASE_ROW
                i += ERASE_ROW
            self.erases += 1
            return echo
        if cmd == p.BootCommand.RESET:
            self.eeprom[BOOT_FLAG_ADDR] = FLAG_RUN_APP
            self.power_on()  # goto 0x0000 after the ACK: flag 0x42 -> the application runs
            return echo
        if cmd == p.BootCommand.READ_VERSION:
            return [BootReply(sid | p.ACK_BIT, p.VERSION_DATA)]
        if cmd == p.BootCommand.WRITE_FLASH_ADDRESS:
            self.position = 0
            self.tblptr = p.parse_address(data) & 0x3FFFFF
            return echo
        if cmd == p.BootCommand.MAGIC_PACKET:
            return self.power_on()  # goto 0x0000; the bootloader ACKs at boot
        return []  # unknown commands are ignored by the bootloader's dispatch

    def _row_write(self, block: int) -> None:
        # The bootloader never guards the address; the PIC only has 32 KB, so TBLPTR wraps into it.
        block &= FLASH_SIZE - 1
        if not APP_START <= block < APP_END:
            self.protected_writes.append(block)
        for k in range(BLOCK):
            self.flash[block + k] &= self.holding[k]
        self.holding[:] = b"\xff" * BLOCK
        self.row_writes += 1

    def busy_time(self, sid: int, data: bytes, row_write_s: float, erase_s: float) -> float:
        """CPU stall the frame causes (before its ACK): the erase loop, or a row write on the 4th data frame."""
        if self.mode != "bootloader" or ((sid & p.ID_MASK) >> p.ID_SHIFT) != self.local_id or sid & p.ACK_BIT:
            return 0.0
        cmd = sid & p.COMMAND_MASK
        if cmd == p.BootCommand.ERASE_FLASH:
            return erase_s
        if cmd == p.BootCommand.WRITE_FLASH_DATA and self.position == 24:
            return row_write_s
        return 0.0

    def _faulted(self, replies: list[BootReply]) -> list[BootReply]:
        f = self.faults
        if f.drop_all:
            f.dropped += len(replies)
            return []
        out: list[BootReply] = []
        for r in replies:
            cmd = r.sid & p.COMMAND_MASK
            if f.drop_magic_acks > 0 and cmd == p.BootCommand.MAGIC_PACKET:
                if f.drop_magic_after > 0:
                    f.drop_magic_after -= 1
                else:
                    f.drop_magic_acks -= 1
                    f.dropped += 1
                    continue
            if f.drop_acks > 0 and (f.drop_command is None or cmd == f.drop_command):
                if f.drop_after > 0:
                    f.drop_after -= 1
                else:
                    f.drop_acks -= 1
                    f.dropped += 1
                    continue
            if cmd == p.BootCommand.READ_FLASH and f.corrupt_reads > 0:
                if f.corrupt_after > 0:
                    f.corrupt_after -= 1
                else:
                    f.corrupt_reads -= 1
                    f.corrupted += 1
                    r = BootReply(r.sid, bytes([r.data[0] ^ 0x5A, *r.data[1:]]), r.delay_s)
            if f.garble > 0:
                f.garble -= 1
                f.garbled += 1
                r = BootReply(r.sid, r.data[:5] if len(r.data) >= 8 else (r.data + b"\xa5\x5a")[:8], r.delay_s)
            if f.delay_acks > 0 and (f.delay_command is None or cmd == f.delay_command):
                f.delay_acks -= 1
                f.delayed += 1
                r = BootReply(r.sid, r.data, r.delay_s + f.delay_s)
            out.append(r)
        return out


class BootBoardSet:
    """The boards of one CAN bus, as ethercat-loop's palm model peers (CAN direct mode).

    `on_can_frame(bus, sid, data)` returns the frames the boards send back; delayed answers are held and
    released on a later call once due (the palm only asks when it has a frame to deliver)."""

    def __init__(self, boards: Iterable[BootBoard]) -> None:
        self.boards = list(boards)
        self._held: list[tuple[float, int, int, bytes]] = []
        self._lock = threading.Lock()
        for b in self.boards:
            b.power_on()

    def board(self, board_id: int) -> BootBoard:
        for b in self.boards:
            if b.board == board_id:
                return b
        raise KeyError(f"no simulated board {board_id}")

    def on_can_frame(self, bus: int, sid: int, data: bytes) -> list[tuple[int, int, bytes]]:
        now = time.monotonic()
        out: list[tuple[int, int, bytes]] = []
        with self._lock:
            for b in self.boards:
                if b.bus != bus:
                    continue
                for r in b.handle(sid, bytes(data)):
                    if r.delay_s > 0:
                        self._held.append((now + r.delay_s, bus, r.sid, r.data))
                    else:
                        out.append((bus, r.sid, r.data))
            due = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
        out.extend((b, s, d) for _, b, s, d in due)
        return out


def make_boards(board_ids: Iterable[int], *, app_aware: bool | None = None) -> list[BootBoard]:
    out = []
    for bid in board_ids:
        addr = p.board_address(bid)
        out.append(BootBoard(addr.local_id, bus=addr.bus, app_aware=app_aware))
    return out


class BootBusSim:
    """Boards on a python-can bus (virtual, udp_multicast, a real adapter): a thread answers their frames.

    Timing: an ERASE stalls for `erase_s` and the 4th WRITE_FLASH_DATA of a block for `row_write_s` before
    the ACK; frames that arrive during a stall fill a `rx_buffers`-deep receive buffer (the ECAN's two
    buffers in legacy mode) and the ones beyond it are lost, as on the chip."""

    def __init__(self, bus: Any, boards: Iterable[BootBoard], *, row_write_s: float = 0.0, erase_s: float = 0.0,
                 rx_buffers: int = 2, ignore_sent: bool = False) -> None:
        self.bus = bus
        self.boards = list(boards)
        self.row_write_s = row_write_s
        self.erase_s = erase_s
        self.rx_buffers = rx_buffers
        self.ignore_sent = ignore_sent  # udp_multicast loops our own frames back (docs/reference/peers.md §6.3)
        self.overflows = 0
        self._busy_until = 0.0
        self._queued_during_busy = 0
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._sent: dict[tuple[int, bytes], int] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="boot-bus-sim", daemon=True)

    def board(self, board_id: int) -> BootBoard:
        for b in self.boards:
            if b.board == board_id:
                return b
        raise KeyError(f"no simulated board {board_id}")

    def start(self) -> BootBusSim:
        for b in self.boards:
            self._send(b.power_on())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        with self._lock:
            for t in self._timers:
                t.cancel()

    def _send(self, replies: list[BootReply]) -> None:
        import can

        for r in replies:
            msg = can.Message(arbitration_id=r.sid, data=r.data, is_extended_id=False)
            if r.delay_s > 0:
                t = threading.Timer(r.delay_s, self._send_now, args=(msg,))
                t.daemon = True
                with self._lock:
                    self._timers = [x for x in self._timers if x.is_alive()]
                    self._timers.append(t)
                t.start()
            else:
                self._send_now(msg)

    def _send_now(self, msg: Any) -> None:
        if self._stop.is_set():
            return
        if self.ignore_sent:
            key = (int(msg.arbitration_id), bytes(msg.data))
            with self._lock:
                self._sent[key] = self._sent.get(key, 0) + 1
        try:
            self.bus.send(msg)
        except Exception as exc:  # a closed bus at shutdown
            log.debug("sim send failed: %s", exc)

    def _own_echo(self, msg: Any) -> bool:
        if not self.ignore_sent:
            return False
        key = (int(msg.arbitration_id), bytes(msg.data))
        with self._lock:
            n = self._sent.get(key, 0)
            if n:
                self._sent[key] = n - 1
                return True
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.bus.recv(0.05)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("sim bus receive failed: %s", exc)
                time.sleep(0.05)
                continue
            if msg is None or msg.is_error_frame or msg.is_remote_frame or msg.is_extended_id:
                continue
            if self._own_echo(msg):
                continue
            sid, data = int(msg.arbitration_id), bytes(msg.data)
            arrived = float(msg.timestamp) if msg.timestamp else time.time()
            if arrived < self._busy_until:
                # It came in while the CPU was stalled: it waits in a receive buffer, if one is free.
                self._queued_during_busy += 1
                if self._queued_during_busy > self.rx_buffers:
                    self.overflows += 1
                    continue
            else:
                self._queued_during_busy = 0
            for b in self.boards:
                busy = b.busy_time(sid, data, self.row_write_s, self.erase_s)
                replies = b.handle(sid, data)
                if busy > 0:
                    self._busy_until = max(time.time(), self._busy_until) + busy
                    self._queued_during_busy = 0
                    time.sleep(max(0.0, self._busy_until - time.time()))
                self._send(replies)


# -- test firmware -------------------------------------------------------------------------------------------
SIMPLEMOTOR_FIRST = 0x04C0
SIMPLEMOTOR_LAST = 0x7D4B  # released_firmware/simplemotor.hex spans 0x04C0–0x7D4B (docs/reference/can_bootloader.md §4)
CONFIG_BYTES = {0x300001: bytes.fromhex("0E1E0081000F")}  # config words 0x300001–0x300006, skipped


def sims_on_ports(ports: Mapping[int, CanPort], board_ids: Iterable[int], row_write_s: float,
                  erase_s: float) -> list[BootBusSim]:
    """Simulated boards on the configured buses (their own bus objects on the same channels), started."""
    import can

    sims = []
    ids = list(board_ids)
    for n, port in ports.items():
        bus = can.Bus(interface=port.cfg.interface, channel=port.cfg.channel)
        sims.append(BootBusSim(bus, make_boards([b for b in ids if p.board_address(b).bus == n]),
                               row_write_s=row_write_s, erase_s=erase_s,
                               ignore_sent=port.cfg.interface == "udp_multicast").start())
    return sims


def demo_boards(settings: CanBootSettings, hooks: BusHooks) -> list[BootBusSim]:
    """Transport `can-bootloader.sim` (ROBOBUS_CAN_SIM=true; entry point `robobus.transports`; the kit's one
    signature, `factory(settings, hooks)`): the simulated boards ROBOBUS_CAN_SIM_BOARDS names on the configured
    buses (`hooks.ports`), in the service's process, started (`make run`, demos). The service stops each (`stop()`,
    then `bus.shutdown()`) at shutdown."""
    return sims_on_ports(hooks.ports, settings.can_sim_boards, settings.can_sim_row_write_s,
                         settings.can_sim_erase_s)


def make_firmware(first: int = SIMPLEMOTOR_FIRST, last: int = SIMPLEMOTOR_LAST, *, aware: bool = True,
                  seed: int = 1, gaps: int = 6) -> bytes:
    """Deterministic pseudo-firmware bytes for first..last: a `goto` at the entry, code-like bytes, a few
    32-byte 0xFF holes (skipped by the writer), and BOOT_AWARE_MARKER when `aware`."""
    n = last - first + 1
    buf = bytearray(n)
    x = seed * 2654435761 & 0xFFFFFFFF
    for i in range(n):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        buf[i] = (x >> 16) & 0xFF
    buf[0:4] = bytes.fromhex("EF60F002")  # goto _startup
    for g in range(gaps):
        off = ((g + 1) * n // (gaps + 2)) & ~(BLOCK - 1)
        off += (-(first + off)) % BLOCK
        if off + 3 * BLOCK <= n:
            buf[off:off + 3 * BLOCK] = b"\xff" * (3 * BLOCK)
    if aware and n >= 64 + len(BOOT_AWARE_MARKER):
        buf[64:64 + len(BOOT_AWARE_MARKER)] = BOOT_AWARE_MARKER
    return bytes(buf[:n])


def make_intel_hex(first: int = SIMPLEMOTOR_FIRST, last: int = SIMPLEMOTOR_LAST, *, aware: bool = True,
                   seed: int = 1, config: bool = True, extra: dict[int, bytes] | None = None) -> str:
    """An MPLAB-style Intel HEX file: an explicit extended linear address record first, 16-byte data
    records, then (if `config`) the configuration bytes at 0x300001 under their own type-04 record."""
    import io

    from intelhex import IntelHex

    ih = IntelHex()
    ih.frombytes(make_firmware(first, last, aware=aware, seed=seed), offset=first)
    for addr, payload in {**(CONFIG_BYTES if config else {}), **(extra or {})}.items():
        ih.frombytes(payload, offset=addr)
    out = io.StringIO()
    ih.write_hex_file(out, byte_count=16)
    text = out.getvalue()
    if not text.startswith(":02000004"):
        text = ":020000040000FA\n" + text
    return text


# -- a standalone simulator process -----------------------------------------------------------------------------
def serve(interface: str, channel: str, boards: list[int], stop: threading.Event, *, erase_s: float = 0.968,
          row_write_s: float = ROW_WRITE_S, app_aware: bool | None = None, drop_magic_acks: int = 0,
          drop_magic_after: int = 0, garble: int = 0, **bus_kwargs: Any) -> BootBusSim:
    """Run simulated boards on a python-can bus until `stop` is set (for vcan, udp_multicast, a real bus)."""
    import can

    made = make_boards(boards, app_aware=app_aware)
    for b in made:
        b.faults.drop_magic_acks, b.faults.drop_magic_after = drop_magic_acks, drop_magic_after
        b.faults.garble = garble
    if len({b.local_id for b in made}) != len(made):
        raise ValueError(f"boards {boards} share local ids: one bus carries boards 0–9 or 10–19, not both")
    bus = can.Bus(interface=interface, channel=channel, **bus_kwargs)
    own = interface == "udp_multicast" or bool(bus_kwargs.get("receive_own_messages"))
    sim = BootBusSim(bus, made, erase_s=erase_s, row_write_s=row_write_s, ignore_sent=own).start()
    # only now: a process started beside the node (the conformance rig) is ready when this line is out
    log.info("simulated boards %s on %s:%s: bus open, answering", boards, interface, channel)
    try:
        stop.wait()
    finally:
        sim.stop()
        bus.shutdown()
    return sim


def main(argv: list[str] | None = None) -> None:
    """python -m services.can_bootloader.sim --interface socketcan --channel vcan0 --boards 0-9"""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description="Simulated PIC18F2580 motor boards (CAN bootloader) on a CAN bus")
    ap.add_argument("--interface", default="socketcan", help="python-can interface (socketcan, udp_multicast, ...)")
    ap.add_argument("--channel", default="vcan0")
    ap.add_argument("--bus", type=int, choices=(1, 2), default=1, help="palm bus these boards are on")
    ap.add_argument("--boards", default="", help="board ids, e.g. 0-9 (default: every board of --bus)")
    ap.add_argument("--erase-s", type=float, default=0.968)
    ap.add_argument("--row-write-s", type=float, default=ROW_WRITE_S)
    ap.add_argument("--not-aware", action="store_true", help="model firmware that is not bootloader-aware")
    ap.add_argument("--drop-magic-acks", type=int, default=0, metavar="N",
                    help="drop the ACKs of N magic packets (each board), after --drop-magic-after N let through")
    ap.add_argument("--drop-magic-after", type=int, default=0, metavar="N")
    ap.add_argument("--garble", type=int, default=0, metavar="N",
                    help="answer N frames (each board; -1: all) with a malformed answer (right SID, wrong length)")
    ap.add_argument("--port", type=int, default=None, help="udp_multicast: the UDP port (default python-can's 43113)")
    args = ap.parse_args(argv)
    ids: list[int] = []
    for part in args.boards.split(","):
        if part:
            lo, _, hi = part.partition("-")
            ids.extend(range(int(lo), int(hi or lo) + 1))
    ids = ids or [b for b in range(20) if p.board_address(b).bus == args.bus]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.basicConfig(level=logging.INFO)
    serve(args.interface, args.channel, ids, stop, erase_s=args.erase_s, row_write_s=args.row_write_s,
          app_aware=False if args.not_aware else None, drop_magic_acks=args.drop_magic_acks,
          drop_magic_after=args.drop_magic_after, garble=args.garble if args.garble >= 0 else 1 << 62,
          **({"port": args.port} if args.port is not None else {}))


if __name__ == "__main__":
    main()
