"""A software EtherCAT slave controller (ESC): register space, AL state machine, SII EEPROM
interface, SyncManagers and FMMUs. Pure: `EscChain.process(datagrams)` mutates datagrams the way
a line of ESCs would, with no socket and no clock, so unit tests drive it with byte vectors and the
virtual hand puts it on a raw socket.

What is modelled (ET1200-like, enough for SOEM and the Shadow EML driver):
* registers 0x0000-0x0FFF with ESC info, station address 0x0010, DL control/status 0x0100/0x0110,
  AL control/status/code 0x0120/0x0130/0x0134, PDI control 0x0140, SII interface 0x0500-0x050F,
  FMMUs 0x0600 + 16n, SyncManagers 0x0800 + 8n; process RAM from 0x1000;
* APxx / FPxx / BXX / LXX / ARMW / FRMW datagrams with the working-counter rules of ETG.1000.4
  (read +1, write +1, read-write +3, logical read +1, logical write +2 for LRW or +1 for LWR) and the
  auto-increment of ADP;
* SM access rules: RAM covered by a disabled SM, or by an SM of the other direction, is not
  accessible (no data, no WKC). Output SMs take data only in SAFE-OP (without error) and OP: that
  is how a slave that dropped out of OP shows up as a working-counter drop.
* Mailbox-mode SMs latch "buffer full" when their last byte is written (`take_sm_events`), which
  is what wakes the palm firmware once per cycle. Reading an input mailbox the firmware has not
  filled returns the RAM as is (zeros at first): Shadow's ET1200 reads empty mailboxes as zero.
* Buffered (3-buffer) SMs need no buffer juggling here: the emulated PDI writes a whole status
  between two frames, so the master always reads a consistent buffer, which is what the three
  buffers guarantee on silicon.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from services.ethercat_loop.sim.esc_frames import Cmd, Datagram

# AL states (ETG.1000.6)
INIT = 0x01
PREOP = 0x02
BOOT = 0x03
SAFEOP = 0x04
OP = 0x08
AL_ERROR = 0x10

AL_CODE_NONE = 0x0000
AL_CODE_INVALID_CHANGE = 0x0011
AL_CODE_UNKNOWN_STATE = 0x0012
AL_CODE_INVALID_OUTPUT_CONFIG = 0x001D
AL_CODE_INVALID_INPUT_CONFIG = 0x001E
AL_CODE_SM_WATCHDOG = 0x001B

REG_TYPE = 0x0000
REG_STADR = 0x0010
REG_ALIAS = 0x0012
REG_DLCTL = 0x0100
REG_DLSTAT = 0x0110
REG_ALCTL = 0x0120
REG_ALSTAT = 0x0130
REG_ALCODE = 0x0134
REG_PDICTL = 0x0140
REG_EEPCFG = 0x0500
REG_EEPCTL = 0x0502
REG_EEPADR = 0x0504
REG_EEPDAT = 0x0508
REG_FMMU0 = 0x0600
REG_SM0 = 0x0800
RAM_START = 0x1000

EEP_CMD_MASK = 0x0700
EEP_CMD_READ = 0x0100
EEP_CMD_WRITE = 0x0201
EEP_STAT_R64 = 0x0040  # this ESC returns 8 bytes per read

_VALID = {
    INIT: {INIT, PREOP, BOOT},
    PREOP: {INIT, PREOP, SAFEOP},
    SAFEOP: {INIT, PREOP, SAFEOP, OP},
    OP: {INIT, PREOP, SAFEOP, OP},
    BOOT: {INIT, BOOT},
}
# Registers the master cannot change (ESC info, DL status, AL status/code, PDI control, SII status).
_READ_ONLY = ((0x0000, 0x0010), (0x0110, 0x0120), (0x0130, 0x0140), (0x0140, 0x0142))


@dataclass(frozen=True)
class SmRegs:
    index: int
    start: int
    length: int
    control: int
    enabled: bool

    @property
    def ecat_writes(self) -> bool:
        """Direction bits 2-3: 01 = the master writes (outputs / command)."""
        return (self.control >> 2) & 0x3 == 1

    @property
    def mailbox(self) -> bool:
        return self.control & 0x3 == 0x2


@dataclass(frozen=True)
class ExpectedSm:
    """What the firmware checks on PRE-OP -> SAFE-OP (a real slave refuses a bad SM setup)."""

    index: int
    start: int
    length: int


class Esc:
    """One slave. `mem` is the whole 0x0000-0x1FFF address space (registers + 4 KiB RAM)."""

    def __init__(self, sii: bytes, *, name: str, esc_type: int = 0x12, fmmus: int = 3, sms: int = 4,
                 dl_status: int = 0x0230, expected_sms: tuple[ExpectedSm, ...] = (),
                 fmmus_on_safeop: bool = False) -> None:
        self.name = name
        # like some slaves (and unlike an ET1200, which applies FMMU writes at once): FMMUs take effect only
        # when the slave goes PRE-OP -> SAFE-OP, so a master that writes them after the SAFE-OP request gets
        # a working counter of 0 for ever
        self.fmmus_on_safeop = fmmus_on_safeop
        self._fmmus_live: set[int] = set()
        self.mem = bytearray(0x2000)
        self.sii = bytearray(sii)
        self.n_fmmu = fmmus
        self.n_sm = sms
        self.expected_sms = expected_sms
        self.mem[0] = esc_type
        self.mem[1] = 0x01  # revision
        self.mem[4] = fmmus
        self.mem[5] = sms
        self.mem[6] = 1  # KiB of process RAM
        self.mem[7] = 0x0F  # ports 0/1 EBUS
        struct.pack_into("<H", self.mem, 0x0008, 0x0000)  # no DC, no LRW block: LRW is allowed
        struct.pack_into("<H", self.mem, REG_DLSTAT, dl_status)
        struct.pack_into("<H", self.mem, REG_PDICTL, sii[0] if sii else 0)
        struct.pack_into("<H", self.mem, REG_EEPCTL, EEP_STAT_R64)
        self._set_al(INIT, error=False, code=AL_CODE_NONE)
        self._sm_events: set[int] = set()
        self.transitions: list[tuple[int, int]] = []  # (from, to) log for tests and the CLI

    # ---- AL state --------------------------------------------------------------------------
    @property
    def al_state(self) -> int:
        return self.mem[REG_ALSTAT] & 0x0F

    @property
    def al_error(self) -> bool:
        return bool(self.mem[REG_ALSTAT] & AL_ERROR)

    @property
    def station_address(self) -> int:
        return int(struct.unpack_from("<H", self.mem, REG_STADR)[0])

    def _set_al(self, state: int, *, error: bool, code: int) -> None:
        self.mem[REG_ALSTAT] = state | (AL_ERROR if error else 0)
        self.mem[REG_ALSTAT + 1] = 0
        struct.pack_into("<H", self.mem, REG_ALCODE, code)

    def fault(self, state: int, code: int) -> None:
        """The firmware drops to `state` with the error flag (e.g. SAFE-OP + SM watchdog)."""
        self.transitions.append((self.al_state, state | AL_ERROR))
        self._set_al(state, error=True, code=code)

    def _al_control(self) -> None:
        ctl = self.mem[REG_ALCTL]
        req, ack = ctl & 0x0F, bool(ctl & AL_ERROR)
        cur = self.al_state
        if self.al_error and not ack:
            return  # an error must be acknowledged before the state machine moves again
        if req not in _VALID:
            self._set_al(cur, error=True, code=AL_CODE_UNKNOWN_STATE)
            return
        if req not in _VALID[cur]:
            self._set_al(cur, error=True, code=AL_CODE_INVALID_CHANGE)
            return
        if cur == PREOP and req == SAFEOP:
            code = self._check_sms()
            if code:
                self._set_al(PREOP, error=True, code=code)
                return
        if req != cur:
            self.transitions.append((cur, req))
        if cur == PREOP and req == SAFEOP:
            self._fmmus_live = {i for i in range(self.n_fmmu) if self.mem[REG_FMMU0 + 16 * i + 12] & 1}
        elif req in (INIT, PREOP, BOOT):
            self._fmmus_live = set()
        self._set_al(req, error=False, code=AL_CODE_NONE)

    def deactivate_fmmus(self) -> None:
        """Fault: the FMMUs stop mapping while the AL state stays as it is (working counter 0, every slave in OP)."""
        self._fmmus_live = set()
        for i in range(self.n_fmmu):
            self.mem[REG_FMMU0 + 16 * i + 12] &= 0xFE

    def _check_sms(self) -> int:
        for exp in self.expected_sms:
            sm = self.sm(exp.index)
            if not sm.enabled or sm.start != exp.start or sm.length != exp.length:
                outputs = sm.ecat_writes or exp.index < 2
                return AL_CODE_INVALID_OUTPUT_CONFIG if outputs else AL_CODE_INVALID_INPUT_CONFIG
        return AL_CODE_NONE

    # ---- SII ------------------------------------------------------------------------------
    def _eeprom_command(self) -> None:
        (ctl,) = struct.unpack_from("<H", self.mem, REG_EEPCTL)
        (addr,) = struct.unpack_from("<I", self.mem, REG_EEPADR)
        cmd = ctl & EEP_CMD_MASK
        if cmd == EEP_CMD_READ:
            chunk = bytes(self.sii[2 * addr : 2 * addr + 8])
            self.mem[REG_EEPDAT : REG_EEPDAT + 8] = chunk + b"\xff" * (8 - len(chunk))
        elif cmd == EEP_CMD_WRITE & EEP_CMD_MASK and ctl & 0x0001 and 2 * addr + 2 <= len(self.sii):
            self.sii[2 * addr : 2 * addr + 2] = self.mem[REG_EEPDAT : REG_EEPDAT + 2]
        # Commands complete at once: busy never shows, no error bits.
        struct.pack_into("<H", self.mem, REG_EEPCTL, EEP_STAT_R64)

    # ---- SM / FMMU ------------------------------------------------------------------------
    def sm(self, n: int) -> SmRegs:
        start, length, control, _status, activate, _pdi = struct.unpack_from("<HHBBBB", self.mem, REG_SM0 + 8 * n)
        return SmRegs(n, start, length, control, bool(activate & 1) and not self.mem[REG_SM0 + 8 * n + 7] & 1)

    def _ram_access(self, addr: int, n: int, write: bool) -> bool:
        """SyncManager rules for a RAM access; registers are always accessible."""
        if addr + n > len(self.mem):
            return False
        if addr + n <= RAM_START:
            return True
        for i in range(self.n_sm):
            sm = self.sm(i)
            if sm.length == 0 or addr >= sm.start + sm.length or addr + n <= sm.start:
                continue
            if not sm.enabled or sm.ecat_writes != write:
                return False
            if write and not (self.al_state == OP or (self.al_state == SAFEOP and not self.al_error)):
                return False
        return True

    def read(self, addr: int, n: int) -> bytes | None:
        """An ECAT read of physical memory; None when the ESC would not service it."""
        if not self._ram_access(addr, n, write=False):
            return None
        return bytes(self.mem[addr : addr + n])

    def write(self, addr: int, data: bytes) -> bool:
        """An ECAT write of physical memory, with register side effects; False if not serviced."""
        n = len(data)
        if not self._ram_access(addr, n, write=True):
            return False
        end = addr + n
        if addr < RAM_START:
            old = bytes(self.mem[addr:end])
            self.mem[addr:end] = data
            for lo, hi in _READ_ONLY:
                if addr < hi and end > lo:
                    a, b = max(addr, lo), min(end, hi)
                    self.mem[a:b] = old[a - addr : b - addr]
            if addr <= REG_ALCTL < end:
                self._al_control()
            if addr <= REG_EEPCTL < end or addr <= REG_EEPCTL + 1 < end:
                self._eeprom_command()
            return True
        self.mem[addr:end] = data
        for i in range(self.n_sm):
            sm = self.sm(i)
            if sm.length and addr <= sm.start + sm.length - 1 < end:
                self._sm_events.add(i)  # last byte written: the mailbox is full
        return True

    def take_sm_events(self) -> set[int]:
        ev, self._sm_events = self._sm_events, set()
        return ev

    def pdi_read(self, addr: int, n: int) -> bytes:
        return bytes(self.mem[addr : addr + n])

    def pdi_write(self, addr: int, data: bytes) -> None:
        self.mem[addr : addr + len(data)] = data

    def fmmus(self) -> list[tuple[int, int, int, int]]:
        """Active FMMUs as (logical start, length, physical start, type bits 1=read 2=write)."""
        out = []
        for i in range(self.n_fmmu):
            base = REG_FMMU0 + 16 * i
            log, length, _sb, _eb, phys, _pb, ftype, active = struct.unpack_from("<IHBBHBBB", self.mem, base)
            if active & 1 and length and (not self.fmmus_on_safeop or i in self._fmmus_live):
                out.append((log, length, phys, ftype))
        return out

    # ---- datagrams ------------------------------------------------------------------------
    def process(self, dg: Datagram) -> None:
        """Handle one datagram as it passes this slave (mutates data, wkc and ADP)."""
        cmd = dg.cmd
        if cmd in (Cmd.LRD, Cmd.LWR, Cmd.LRW):
            self._logical(dg)
            return
        if cmd in (Cmd.APRD, Cmd.APWR, Cmd.APRW, Cmd.ARMW):
            addressed = dg.adp == 0
            dg.adp = (dg.adp + 1) & 0xFFFF
        elif cmd in (Cmd.FPRD, Cmd.FPWR, Cmd.FPRW, Cmd.FRMW):
            addressed = dg.adp == self.station_address
        elif cmd in (Cmd.BRD, Cmd.BWR, Cmd.BRW):
            addressed = True
            dg.adp = (dg.adp + 1) & 0xFFFF
        else:
            return  # NOP and unknown commands pass untouched
        if cmd in (Cmd.ARMW, Cmd.FRMW):
            # the addressed slave reads, every other slave writes what it read
            if addressed:
                self._read_into(dg, bitwise_or=False)
            elif self.write(dg.ado, bytes(dg.data)):
                dg.wkc += 1
            return
        if not addressed:
            return
        broadcast = cmd in (Cmd.BRD, Cmd.BWR, Cmd.BRW)
        if cmd in (Cmd.APRW, Cmd.FPRW, Cmd.BRW):
            incoming = bytes(dg.data)
            got = self.read(dg.ado, len(incoming))
            if got is not None and self.write(dg.ado, incoming):
                dg.data[:] = bytes(a | b for a, b in zip(incoming, got, strict=True)) if broadcast else got
                dg.wkc += 3
            return
        if cmd in (Cmd.APRD, Cmd.FPRD, Cmd.BRD):
            self._read_into(dg, bitwise_or=broadcast)
        elif self.write(dg.ado, bytes(dg.data)):
            dg.wkc += 1

    def _read_into(self, dg: Datagram, *, bitwise_or: bool) -> None:
        got = self.read(dg.ado, len(dg.data))
        if got is None:
            return
        if bitwise_or:  # BRD: every slave ORs its data into the datagram
            dg.data[:] = bytes(a | b for a, b in zip(dg.data, got, strict=True))
        else:
            dg.data[:] = got
        dg.wkc += 1

    def _logical(self, dg: Datagram) -> None:
        start, n = dg.logical, len(dg.data)
        incoming = bytes(dg.data)
        read_hit = write_hit = False
        for log, length, phys, ftype in self.fmmus():
            lo, hi = max(start, log), min(start + n, log + length)
            if lo >= hi:
                continue
            off, paddr, size = lo - start, phys + (lo - log), hi - lo
            if ftype & 1 and dg.cmd in (Cmd.LRD, Cmd.LRW):
                got = self.read(paddr, size)
                if got is not None:
                    dg.data[off : off + size] = got
                    read_hit = True
            if ftype & 2 and dg.cmd in (Cmd.LWR, Cmd.LRW) and self.write(paddr, incoming[off : off + size]):
                write_hit = True
        if read_hit:
            dg.wkc += 1
        if write_hit:
            dg.wkc += 2 if dg.cmd == Cmd.LRW else 1


class EscChain:
    """Slaves in line: a frame passes slave 1 completely, then slave 2, as on the wire."""

    def __init__(self, slaves: list[Esc]) -> None:
        self.slaves = slaves

    def process(self, datagrams: list[Datagram]) -> None:
        for slave in self.slaves:
            for dg in datagrams:
                slave.process(dg)
