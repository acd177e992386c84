"""A simulated e-puck2 programmer: a GDB remote-serial-protocol server on a pty, as the robot's onboard
Black Magic Probe derivative serves it on its USB serial port, with an STM32F407's memory behind it.

It answers what GDB sends for GCtronic's update steps (`target extended-remote`, `monitor swdp_scan`,
`attach 1`, `load`, `compare-sections`, `detach`): the memory map that makes GDB use the flash
commands (vFlashErase / vFlashWrite / vFlashDone), a Cortex-M target description, memory reads and
CRCs (qCRC) over what was written. Flash behaves as flash: erased to 0xFF, a write can only clear
bits. The tests read the written memory back from `memory` (or through GDB's `m` packets).

The target's run state follows a Black Magic Probe's: running until `vAttach` halts it, running again
after `D` (detach) or a kill; a GDB that leaves without `D` leaves it halted (`running`).

Faults on demand (`Faults`), counted in `vFlashWrite` packets (1 = the first write of a session's
life): a write done but its ack and reply lost; the probe hung from a write on (nothing answered
again); a write answered with an error (the flash is left erased and partly written); the port gone at
a write (USB unplugged: the pty's master is closed).

RSP framing: `$payload#cs` (cs = byte sum mod 256, two hex digits), acknowledged with `+`;
binary payloads escape `#$}*` as `}` + (byte ^ 0x20).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import tty
from dataclasses import dataclass, field

log = logging.getLogger("robobus.epuck.sim_gdb")

FLASH_BASE, FLASH_SIZE = 0x0800_0000, 0x10_0000
RAM_BASE, RAM_SIZE = 0x2000_0000, 0x2_0000
# STM32F407 flash sectors: 4 x 16 KiB, 1 x 64 KiB, 7 x 128 KiB
SECTORS = [(FLASH_BASE + i * 0x4000, 0x4000) for i in range(4)] + [(FLASH_BASE + 0x10000, 0x10000)] + [
    (FLASH_BASE + 0x20000 + i * 0x20000, 0x20000) for i in range(7)]

_FLASH_REGIONS = ((FLASH_BASE, 0x10000, 0x4000), (FLASH_BASE + 0x10000, 0x10000, 0x10000),
                  (FLASH_BASE + 0x20000, 0xE0000, 0x20000))  # (start, length, erase block)
MEMORY_MAP = (
    '<?xml version="1.0"?>\n<!DOCTYPE memory-map PUBLIC "+//IDN gnu.org//DTD GDB Memory Map V1.0//EN" '
    '"http://sourceware.org/gdb/gdb-memory-map.dtd">\n<memory-map>\n'
    + "".join(f'  <memory type="flash" start="0x{start:08x}" length="0x{length:x}">'
              f'<property name="blocksize">0x{block:x}</property></memory>\n'
              for start, length, block in _FLASH_REGIONS)
    + f'  <memory type="ram" start="0x{RAM_BASE:08x}" length="0x{RAM_SIZE:x}"/>\n</memory-map>')

TARGET_XML = (
    '<?xml version="1.0"?>\n<!DOCTYPE target SYSTEM "gdb-target.dtd">\n<target version="1.0">\n'
    "  <architecture>arm</architecture>\n  <feature name=\"org.gnu.gdb.arm.m-profile\">\n"
    + "".join(f'    <reg name="r{i}" bitsize="32"/>\n' for i in range(13))
    + '    <reg name="sp" bitsize="32" type="data_ptr"/>\n    <reg name="lr" bitsize="32"/>\n'
    '    <reg name="pc" bitsize="32" type="code_ptr"/>\n    <reg name="xpsr" bitsize="32" regnum="25"/>\n'
    "  </feature>\n</target>")

SCAN_TEXT = "Target voltage: 3.3V\nAvailable Targets:\nNo. Att Driver\n 1      STM32F40x M4\n"
NO_TARGET_TEXT = "Target voltage: 3.3V\nSW-DP scan failed!\nNo targets found\n"


def gdb_crc32(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """GDB's qCRC: CRC-32, polynomial 0x04C11DB7, MSB first, no reflection, no final xor."""
    for b in data:
        crc ^= b << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else (crc << 1)
            crc &= 0xFFFFFFFF
    return crc


def checksum(payload: bytes) -> bytes:
    return f"{sum(payload) & 0xFF:02x}".encode()


def frame(payload: bytes) -> bytes:
    return b"$" + payload + b"#" + checksum(payload)


def unescape(data: bytes) -> bytes:
    out = bytearray()
    it = iter(data)
    for b in it:
        out.append((next(it) ^ 0x20) if b == 0x7D else b)
    return bytes(out)


@dataclass
class Faults:
    """Misbehaviour on demand; each names the n-th `vFlashWrite` (1 = the first; 0 = never)."""

    lose_reply_at_write: int = 0  # that write is done, but its ack and its reply are lost (once)
    hang_at_write: int = 0  # from that write on nothing is answered: the probe hung (until `heal`)
    error_at_write: int = 0  # that write is refused with an error reply (E03), nothing written
    disconnect_at_write: int = 0  # the port goes away at that write (ProgrammerSim closes its pty)


@dataclass
class ProgrammerStats:
    packets: int = 0
    bad_checksums: int = 0
    erases: int = 0
    bytes_written: int = 0
    crcs: int = 0
    attached: int = 0
    detached: int = 0
    flash_writes: int = 0  # vFlashWrite packets received (the fault counter)
    lost_replies: int = 0
    ignored_while_hung: int = 0
    monitor: list[str] = field(default_factory=list)


class RspSession:
    """The protocol, sans-I/O: bytes from GDB in, bytes to GDB out. Memory lives in `memory`."""

    def __init__(self, target_present: bool = True, faults: Faults | None = None) -> None:
        self.flash = bytearray(b"\xff" * FLASH_SIZE)
        self.ram = bytearray(RAM_SIZE)
        self.target_present = target_present
        self.faults = faults or Faults()
        self.attached = False
        self.running = True  # the MCU runs its firmware; halted while attached, and after a GDB left without D
        self.hung = False
        self.disconnected = False  # the port went away (ProgrammerSim closes the pty)
        self.no_ack = False
        self.stats = ProgrammerStats()
        self.regs = [0] * 17
        self._buf = bytearray()

    # -- memory ---------------------------------------------------------------------------------------
    def _region(self, addr: int, length: int) -> tuple[bytearray, int] | None:
        for base, size, mem in ((FLASH_BASE, FLASH_SIZE, self.flash), (RAM_BASE, RAM_SIZE, self.ram)):
            if base <= addr and addr + length <= base + size:
                return mem, addr - base
        return None

    def read(self, addr: int, length: int) -> bytes | None:
        r = self._region(addr, length)
        if r is None:
            return None
        mem, off = r
        return bytes(mem[off:off + length])

    # -- framing --------------------------------------------------------------------------------------
    def heal(self) -> None:
        """A hung probe answers again (its USB replugged)."""
        self.hung = False

    def _fault(self, payload: bytes) -> str:
        """The fault this packet triggers: "", "lose", "hang", "error" or "disconnect"."""
        if not payload.startswith(b"vFlashWrite:"):
            return ""
        self.stats.flash_writes += 1
        n, f = self.stats.flash_writes, self.faults
        for kind, at in (("hang", f.hang_at_write), ("disconnect", f.disconnect_at_write),
                         ("error", f.error_at_write), ("lose", f.lose_reply_at_write)):
            if at and n == at:
                return kind
        return ""

    def feed(self, data: bytes) -> bytes:
        if self.hung or self.disconnected:
            self.stats.ignored_while_hung += 1
            return b""
        self._buf += data
        out = bytearray()
        while self._buf and not (self.hung or self.disconnected):
            b = self._buf[0]
            if b in (0x2B, 0x2D):  # + / - acks from GDB
                del self._buf[0]
                continue
            if b == 0x03:  # interrupt
                del self._buf[0]
                out += frame(b"T02")
                continue
            if b != 0x24:  # '$'
                del self._buf[0]
                continue
            end = self._buf.find(b"#")
            if end < 0 or len(self._buf) < end + 3:
                break
            payload = bytes(self._buf[1:end])
            cs = bytes(self._buf[end + 1:end + 3])
            del self._buf[:end + 3]
            if payload.startswith(b"qSupported"):
                self.no_ack = False  # a new GDB session starts in ack mode on the same line
            if cs.lower() != checksum(payload):
                self.stats.bad_checksums += 1
                if not self.no_ack:
                    out += b"-"
                continue
            fault = self._fault(payload)
            if fault in ("hang", "disconnect"):
                self.hung, self.disconnected = fault == "hang", fault == "disconnect"
                self._buf.clear()
                log.info("fault: %s at flash write %d", fault, self.stats.flash_writes)
                break
            if not self.no_ack and fault != "lose":
                out += b"+"
            self.stats.packets += 1
            if fault == "error":
                out += frame(b"E03")
                continue
            replies = self.handle(payload)
            if fault == "lose":
                self.stats.lost_replies += 1
                continue
            for reply in replies:
                out += frame(reply)
        return bytes(out)

    # -- packets ----------------------------------------------------------------------------------------
    def handle(self, p: bytes) -> list[bytes]:
        if p.startswith(b"qSupported"):
            return [b"PacketSize=4000;qXfer:memory-map:read+;qXfer:features:read+;QStartNoAckMode+;vContSupported-"]
        if p == b"QStartNoAckMode":
            self.no_ack = True
            return [b"OK"]
        if p == b"!":
            return [b"OK"]
        if p == b"?":
            return [b"T05thread:1;" if self.attached else b"W00"]
        if p.startswith(b"qXfer:features:read:target.xml:"):
            return [self._xfer(TARGET_XML.encode(), p)]
        if p.startswith(b"qXfer:memory-map:read::"):
            return [self._xfer(MEMORY_MAP.encode(), p)]
        if p.startswith(b"qRcmd,"):
            cmd = bytes.fromhex(p[6:].decode()).decode(errors="replace")
            self.stats.monitor.append(cmd)
            if cmd.strip() in ("swdp_scan", "swd_scan", "s"):
                text = SCAN_TEXT if self.target_present else NO_TARGET_TEXT
                return [b"O" + text.encode().hex().encode(), b"OK"]
            return [b"O" + f"unknown monitor command: {cmd}\n".encode().hex().encode(), b"OK"]
        if p.startswith(b"vAttach;"):
            if not self.target_present:
                return [b"E01"]
            self.attached = True
            self.running = False
            self.stats.attached += 1
            self.regs[15] = int.from_bytes(self.flash[4:8], "little") & ~1
            self.regs[13] = int.from_bytes(self.flash[0:4], "little")
            return [b"T05thread:1;"]
        if not self.attached and (p[:1] in (b"m", b"M", b"X", b"g", b"p") or p.startswith((b"vFlash", b"qCRC"))):
            return [b"E05"]  # no target attached
        if p == b"g":
            return ["".join(r.to_bytes(4, "little").hex() for r in self.regs).encode()]
        if p.startswith(b"p"):
            n = int(p[1:], 16)
            return [(self.regs[n] if n < 16 else self.regs[16] if n == 25 else 0).to_bytes(4, "little").hex().encode()]
        if p.startswith(b"P"):
            return [b"OK"]
        if p.startswith(b"m"):
            addr, length = (int(x, 16) for x in p[1:].split(b","))
            data = self.read(addr, length)
            return [b"E01" if data is None else data.hex().encode()]
        if p.startswith((b"M", b"X")):
            head, _, body = p[1:].partition(b":")
            addr, length = (int(x, 16) for x in head.split(b","))
            raw = bytes.fromhex(body.decode()) if p[:1] == b"M" else unescape(body)
            r = self._region(addr, length)
            if r is None or r[0] is self.flash:
                return [b"E01"]  # flash goes through vFlash*
            mem, off = r
            mem[off:off + length] = raw[:length]
            return [b"OK"]
        if p.startswith(b"vFlashErase:"):
            addr, length = (int(x, 16) for x in p[12:].split(b","))
            if not any(base == addr for base, _ in SECTORS) or self._region(addr, length) is None:
                return [b"E01"]
            off = addr - FLASH_BASE
            self.flash[off:off + length] = b"\xff" * length
            self.stats.erases += 1
            return [b"OK"]
        if p.startswith(b"vFlashWrite:"):
            head, _, body = p[12:].partition(b":")
            addr = int(head, 16)
            raw = unescape(body)
            r = self._region(addr, len(raw))
            if r is None or r[0] is not self.flash:
                return [b"E01"]
            off = addr - FLASH_BASE
            old = self.flash[off:off + len(raw)]
            if any((o & n) != n for o, n in zip(old, raw, strict=True)):
                return [b"E.memtype"]  # programming a byte that was not erased
            self.flash[off:off + len(raw)] = raw
            self.stats.bytes_written += len(raw)
            return [b"OK"]
        if p == b"vFlashDone":
            return [b"OK"]
        if p.startswith(b"qCRC:"):
            addr, length = (int(x, 16) for x in p[5:].split(b","))
            data = self.read(addr, length)
            self.stats.crcs += 1
            return [b"E01" if data is None else f"C{gdb_crc32(data):08x}".encode()]
        if p == b"D" or p.startswith(b"D;"):
            self.attached = False
            self.running = True  # a detach resumes the MCU
            self.stats.detached += 1
            return [b"OK"]
        if p in (b"k",) or p.startswith(b"vKill"):
            self.attached = False
            self.running = True  # the probe resets the MCU, which runs what the flash holds
            return [b"OK"]
        if p == b"qAttached" or p.startswith(b"qAttached:"):
            return [b"1"]
        if p == b"qC":
            return [b"QC1"]
        if p == b"qfThreadInfo":
            return [b"m1" if self.attached else b"l"]
        if p == b"qsThreadInfo":
            return [b"l"]
        if p.startswith(b"H") or p == b"qSymbol::":
            return [b"OK"]
        return [b""]  # not supported

    @staticmethod
    def _xfer(doc: bytes, p: bytes) -> bytes:
        off, length = (int(x, 16) for x in p.rsplit(b":", 1)[1].split(b","))
        chunk = doc[off:off + length]
        escaped = chunk.replace(b"}", b"}]").replace(b"#", b"}\x03").replace(b"$", b"}\x04").replace(b"*", b"}\x0a")
        return (b"l" if off + length >= len(doc) else b"m") + escaped


class ProgrammerSim:
    """The session on a pty, served by a thread; `link` is a stable symlink to the pty's slave."""

    def __init__(self, link: str, target_present: bool = True, faults: Faults | None = None) -> None:
        self.link = link
        self.session = RspSession(target_present, faults)
        self._master = -1
        self._slave = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ProgrammerSim:
        self._master, self._slave = os.openpty()
        tty.setraw(self._slave)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.link)
        os.symlink(os.ttyname(self._slave), self.link)
        self._thread = threading.Thread(target=self._serve, name="gdb-programmer", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        import select

        while not self._stop.is_set():
            r, _, _ = select.select([self._master], [], [], 0.1)
            if not r:
                continue
            try:
                data = os.read(self._master, 65536)
            except OSError:
                continue
            reply = self.session.feed(data)
            if self.session.disconnected:
                log.info("fault: the programmer's port went away")
                with contextlib.suppress(OSError):
                    os.close(self._master)
                self._master = -1
                return
            view = memoryview(reply)
            while view:
                try:
                    n = os.write(self._master, view)
                except BlockingIOError:
                    select.select([], [self._master], [], 0.1)
                    continue
                view = view[n:]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.link)
        for fd in (self._master, self._slave):
            with contextlib.suppress(OSError):
                os.close(fd)
