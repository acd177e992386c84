"""The pysoem master for the Shadow hand: open the NIC, find the palm behind the bridge, map its
process data (from the SII, or by programming the four mailbox SyncManagers and two FMMUs the way
the original EML driver did, docs/reference/shadow_ethercat.md §2.2), bring the bus to OP and back, and exchange one
frame
per cycle with a working-counter check and a receive timeout well under the period.

Blocking calls only; the realtime cycle (transport/cycle.py) owns the timing: once per period it
`receive`s the reply to the frame it sent at the release before (queued by then) and `send`s the next,
from its own process. `exchange` (send + wait for the reply) is the same two halves back to back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import select
import socket
import struct
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from termios import FIONREAD
from typing import Any

import pysoem

from services.ethercat_loop.protocol import BRIDGE_PRODUCT_CODE, PROTOCOLS, ProtocolInfo, protocol_for_product
from services.ethercat_loop.transport.netns import enter_netns
from services.ethercat_loop.transport.recovery import Action, BusView, Do, Recovery, state_name
from services.ethercat_loop.transport.recovery import RecoveryPolicy as RecoveryPolicy  # part of this API

log = logging.getLogger("robobus.ethercat.master")

SII_SERIAL_WORD = 0x0E
SII_CAT_START = 0x40
SII_CAT_SM = 41
SII_CAT_TXPDO = 50
SII_CAT_RXPDO = 51
CONFIG_SCANS = 3  # scans whose mapping disagrees with the SII read again, before the master refuses (_configure)
REG_FMMU0 = 0x0600
REG_SM0 = 0x0800
REG_ALCTL = 0x0120
REG_ALSTAT = 0x0130  # AL status (state | 0x10 error), then 0x0134 AL status code
REG_ESC_COUNTS = 0x0004  # FMMUs supported, SyncManagers supported
MAX_FMMUS = 16
MAX_SMS = 16
MIN_WAIT_NS = 20_000  # even a late cycle waits this long for its frame
ETHERTYPE = b"\x88\xa4"  # EtherCAT
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; needs CAP_NET_ADMIN, else SO_RCVBUF (capped by rmem_max)
ECAT_ETHERTYPE = b"\x88\xa4"
PACKET_OUTGOING = 4  # a packet socket's address type for a frame this host sent
ETH_HEADER, ECAT_HEADER, DATAGRAM_HEADER = 14, 2, 10  # a process-data reply: frame, EtherCAT, LRW datagram
LOGICAL_BASE = 0x00010000  # EML's per-slave layout starts here (docs/reference/shadow_ethercat.md §2.2)
SIOCGSTAMPNS = 0x8907  # the receive time of the last frame read from a socket (CLOCK_REALTIME)
_TIMESPEC = struct.Struct("<qq")
_TIMESPEC_ZERO = bytes(_TIMESPEC.size)


class MasterError(RuntimeError):
    """The bus cannot be brought up as configured (clear message for logs and health)."""


class NoDevice(MasterError):
    """No slave answers on the NIC, or the NIC cannot be opened: nothing to drive there (yet). `garbage` counts
    the frames that did arrive during the scan without one of them being a slave's answer (a peer that speaks no
    EtherCAT, or answers with garbage)."""

    def __init__(self, message: str, garbage: int = 0) -> None:
        super().__init__(message)
        self.garbage = garbage


class WrongKind(MasterError):
    """A device answers, but not the one configured (not a Shadow palm, another protocol, or process data of
    the wrong size): refuse to run it."""


class SizeMismatch(WrongKind):
    """The palm's mapped process data do not match the protocol table: refuse to run. `confirmed`: the SII read
    again (`sii_pdo_bytes`) declares those same sizes, so the mapping is the palm's, not a fooled scan's."""

    def __init__(self, message: str, confirmed: bool = True) -> None:
        super().__init__(message)
        self.confirmed = confirmed


@dataclass
class MasterConfig:
    iface: str
    netns: str | None = None  # enter this network namespace before opening the NIC (virtual hand)
    protocol: str | None = None  # expected protocol; None = take it from the palm's product code
    recv_timeout_us: int = 500  # well under the 1 ms period (the original's 20 ms outlasted the motors' cut-out)
    late_us: int = 300  # a reply later than this (but in time) counts as a late frame
    program_sms: str = "auto"  # auto: program SMs/FMMUs when the SII lacks them; always; never
    state_timeout_us: int = 3_000_000
    # SM/FMMU/AL-control writes while configuring: SOEM's config_map gives its own EC_TIMEOUTRET3 (6 ms), and its
    # srconfirm resends the frame every EC_TIMEOUTRET (2 ms) within the budget, so a lost frame or a slave slow to
    # answer is retried. Nothing waits on configuration: allow EC_TIMEOUTSAFE (20 ms), i.e. up to 10 sends.
    config_write_timeout_us: int = 20_000
    recovery: RecoveryPolicy = field(default_factory=lambda: RecoveryPolicy())


@dataclass(frozen=True)
class HandIdentity:
    vendor: int
    product: int
    revision: int
    serial: int
    protocol: str
    palm_name: str
    palm_position: int  # 1-based SOEM slave number
    bridge_position: int | None
    mapping: str  # "sii" (SOEM mapped from the SII) or "programmed" (SMs/FMMUs written by the master)
    command_size: int
    status_size: int
    expected_wkc: int
    slaves: tuple[str, ...]
    # how many scans (config_init + config_map) the bring-up took: > 1 when a scan's mapping disagreed with the
    # palm's SII read again (a stale reply fooled SOEM), see EthercatMaster._configure
    scans: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WireCounters:
    frames: int = 0
    lost: int = 0  # no reply within the receive timeout
    # replies that do not belong to the frame just sent (a duplicate, or a late reply to a frame already
    # counted lost): drained before a send, skipped by SOEM's datagram-index check, or older than the send
    stale: int = 0
    late: int = 0  # a reply, but later than late_us
    wkc_errors: int = 0  # a reply with the wrong working counter
    recoveries: int = 0  # recovery actions sent to a slave out of OP
    left_op: int = 0  # times a slave was found out of OP
    escalations: int = 0  # INIT -> OP ladders started
    escalation_failures: int = 0  # ladders that timed out (retried with backoff)
    rescans: int = 0  # full re-scans of the bus
    bad_run: int = 0  # consecutive cycles without valid process data (lost or wrong working counter)
    valid_ns: int = 0  # CLOCK_MONOTONIC ns the last valid status came back (its kernel receive time)
    back_ns: int = 0  # ... and the first one after a run without (the end of the last outage)
    last_wkc: int = 0
    rtt_max_ns: int = 0
    state_issue: str = ""  # "" when every slave is in OP

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Exchange:
    """One cycle's result: `status` is None when no valid status arrived this cycle."""

    status: bytes | None
    wkc: int
    rtt_ns: int
    lost: bool = False
    late: bool = False
    wkc_error: bool = False
    stale: int = 0  # stale replies met on the way to this one (none of them is this frame's reply)
    sent_ns: int = 0  # CLOCK_MONOTONIC just before the frame was handed to SOEM


def sm_register_block(start: int, length: int, control: int) -> bytes:
    """SM register layout (0x0800 + 8n): start, length, control, status, activate=1, PDI control."""
    return struct.pack("<HHBBBB", start, length, control, 0, 1, 0)


def fmmu_register_block(logical: int, length: int, physical: int, write: bool) -> bytes:
    """FMMU register layout (0x0600 + 16n); type 2 = write (outputs), 1 = read (inputs)."""
    return struct.pack("<IHBBHBBB3x", logical, length, 0, 7, physical, 0, 2 if write else 1, 1)


@dataclass
class _Bus:
    master: Any
    palm: Any
    info: ProtocolInfo
    ident: HandIdentity
    slaves: list[Any] = field(default_factory=list)
    # per slave, the SyncManager and FMMU register blocks as configured: what an escalation writes back
    golden: list[tuple[bytes, bytes]] = field(default_factory=list)

    @functools.cached_property
    def view(self) -> BusView:
        """The bus as the recovery machine knows it."""
        return BusView(tuple(str(s.name) for s in self.slaves), self.ident.palm_position - 1, self.ident.serial,
                       self.ident.expected_wkc)


class EthercatMaster:
    """`open()`, `to_op()`, then `exchange()` every cycle and `check_states()` now and then;
    `leave_op()` and `close()` at the end."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.counters = WireCounters()
        self._bus: _Bus | None = None
        self._output = b""
        self.socket_fds: list[int] = []  # SOEM's raw socket(s), made non-blocking and waited on with select
        self._stamp_fd = -1  # the primary socket, asked for the receive time of each reply
        # the same sockets (dup'ed descriptors: one receive queue each), read to drop stale replies before a send
        self._drain: list[socket.socket] = []
        self._scratch = bytearray(64)  # a stale reply is read into this and dropped (the rest is truncated)
        self._inq = bytearray(4)  # FIONREAD's answer (a 0.4 µs ioctl, no exception when nothing is queued)
        # the head frame, peeked: where the palm's outputs sit in a process-data reply (0: not checked)
        self._peek = bytearray(2048)
        self._peek_mv = memoryview(self._peek)
        self._peek_len = 0
        self._out_at = 0
        self._real_minus_mono = 0
        self._sent_ns: int | None = None  # a process-data frame in flight (sent, not yet received)
        self._stale_before = 0  # stale replies dropped just before the frame in flight was sent
        self._result: Exchange | None = None  # a reply read early (settle) or a synchronous exchange
        self.policy = cfg.recovery
        # the recovery's decisions (transport/recovery.py): this master reads and writes for it
        self.recovery = Recovery(cfg.recovery, self.counters)
        self._ifindex = 0  # the NIC's index when it was opened (a NIC unplugged and back has another)
        self._scan_late = 0  # replies that came back late during the last scan (_configure)

    @property
    def recovery_log(self) -> deque[tuple[int, str]]:
        """What recovery did, newest last: (CLOCK_MONOTONIC ns, text); the cycle publishes it, the MQTT side logs
        each entry (no logging in the realtime process)."""
        return self.recovery.log

    @property
    def recovery_seq(self) -> int:
        return self.recovery.seq

    @property
    def rescan_needed(self) -> str:
        """Why a full re-scan is due ("" none): the cycle calls rescan()."""
        return self.recovery.rescan_needed

    @rescan_needed.setter
    def rescan_needed(self, why: str) -> None:
        self.recovery.rescan_needed = why

    @property
    def episode_open(self) -> bool:
        """A recovery episode has not seen its end yet (the cycle checks the states every 10 cycles meanwhile)."""
        return self.recovery.episode_open

    @property
    def identity(self) -> HandIdentity:
        if self._bus is None:
            raise MasterError("the master is not open")
        return self._bus.ident

    # ---- bring-up -------------------------------------------------------------------------
    def open(self) -> HandIdentity:
        cfg = self.cfg
        if cfg.netns:
            enter_netns(cfg.netns)
        bus = self._configure()
        self._bus = bus
        self._output = bytes(bus.info.command_size)
        self._out_at = 0
        if bus.ident.mapping == "sii" and self._drain:
            # SOEM's LRW covers the IO map from logical 0: every slave's outputs in slave order, then the inputs
            ahead = sum(len(bytes(s.output)) for s in bus.slaves[: bus.ident.palm_position - 1])
            self._out_at = ETH_HEADER + ECAT_HEADER + DATAGRAM_HEADER + ahead
        self._peek_len = min(len(self._peek), self._out_at + bus.info.command_size)
        return bus.ident

    def _open_nic(self) -> Any:
        """A pysoem master on the NIC, its packet sockets non-blocking, a dup of each to drop stale replies."""
        cfg = self.cfg
        m = pysoem.Master()
        before = _open_fds()
        self._ifindex = _ifindex(cfg.iface)
        try:
            if not self._ifindex:
                raise OSError("no such interface")
            m.open(cfg.iface)
        except Exception as exc:
            raise NoDevice(f"cannot open EtherCAT NIC {cfg.iface!r}: {exc}") from exc
        self.socket_fds = _make_packet_sockets_nonblocking({fd for fd, target in _open_fds().items()
                                                            if target.startswith("socket:")
                                                            and target not in before.values()})
        self._sent_ns, self._result = None, None
        self._close_drain()
        self._drain = [socket.socket(fileno=os.dup(fd)) for fd in self.socket_fds]
        self._stamp_fd = min(self.socket_fds) if self.socket_fds else -1  # SOEM opens the primary first
        if self._stamp_fd >= 0:
            with contextlib.suppress(OSError):  # the first call turns the socket's receive timestamps on
                fcntl.ioctl(self._stamp_fd, SIOCGSTAMPNS, _TIMESPEC_ZERO)
        self.refresh_clock_offset()
        return m

    def _configure(self) -> _Bus:
        """Open the NIC, scan and map the bus; again, with a fresh master, when the scan may have been fooled.
        SOEM takes any reply carrying the datagram index it waits for as the answer, and it has 16 indices:
        after a stall in which it gave up on datagrams (a hand starved of CPU, a VM's vCPU descheduled), the
        late reply to an old datagram is read as the answer to the one now waiting (an SII read returns another
        block's bytes, a register another register's value), what SOEM derives (the mapping, names, identities)
        is wrong, and the rest of the burst keeps later requests out of step. A scan during which a reply came
        back after the master had sent another frame (`_Tap.late`), or whose mapping disagrees with the SII
        read again word by word (`sii_pdo_bytes`), is done again: the late replies are let in and dropped,
        and a fresh pysoem master (new socket, SOEM context and SII cache) scans, up to CONFIG_SCANS scans.
        The last scan's verdict stands: a palm whose SII declares the wrong size is still refused."""
        for scan in range(1, CONFIG_SCANS + 1):
            last = scan == CONFIG_SCANS
            m = self._open_nic()
            self._scan_late = 0
            why = ""
            try:
                bus = self._scan(m)
            except MasterError as exc:
                fooled = isinstance(exc, SizeMismatch) and not exc.confirmed
                if last or not (fooled or self._scan_late):
                    m.close()
                    raise
                why = f"{self._scan_late} replies came back late" if self._scan_late else "the SII disagrees"
                why += f": {exc}"
            except BaseException:
                m.close()
                raise
            else:
                if not self._scan_late or last:
                    if scan > 1:
                        bus.ident = dataclasses.replace(bus.ident, scans=scan)
                    return bus
                why = f"{self._scan_late} replies came back late (a stale reply may have been taken for an answer)"
            log.warning("scan %d of %d not trusted (%s); scanning again", scan, CONFIG_SCANS, why)
            self.recovery.note(time.monotonic_ns(), f"scan {scan} not trusted ({why}); scanning again")
            self._quiet_wire()
            m.close()
        raise AssertionError("unreachable")

    def _quiet_wire(self, quiet_s: float = 0.05, max_s: float = 2.0) -> None:
        """Drop every reply still on its way (late ones from the scan just given up) until none has arrived for
        `quiet_s` (at most `max_s`), so that the next scan starts with nothing stale queued."""
        if not self._drain:
            time.sleep(quiet_s)
            return
        end = time.monotonic() + max_s
        while time.monotonic() < end:
            self.drop_stale()
            ready, _, _ = select.select(self._drain, [], [], quiet_s)
            if not ready:
                return

    def _scan(self, m: Any) -> _Bus:
        cfg = self.cfg
        with _Tap(cfg.iface) as tap:  # what arrives during the scan: garbage when no slave is found; late replies
            try:
                return self._scan_tapped(m, tap)
            finally:
                tap.incoming()
                self._scan_late = tap.late

    def _scan_tapped(self, m: Any, tap: _Tap) -> _Bus:
        cfg = self.cfg
        n = m.config_init()
        if n <= 0:
            got = tap.incoming()
            raise NoDevice(f"no EtherCAT slave answers on {cfg.iface}" + (
                f"; {got} frames arrived during the scan, none a slave's answer" if got else ""), garbage=got)
        slaves = list(m.slaves)
        names = tuple(f"{i + 1}:{s.name} (product {s.id:#x})" for i, s in enumerate(slaves))
        palm_i = next((i for i, s in enumerate(slaves) if s.id != BRIDGE_PRODUCT_CODE and _is_palm(s.id)), None)
        if palm_i is None:
            raise WrongKind(f"no Shadow palm (product 6, 0x01000000 or 0x01000001) on {cfg.iface}: "
                              f"found {', '.join(names)}")
        palm = slaves[palm_i]
        bridge_i = next((i for i in range(palm_i) if slaves[i].id == BRIDGE_PRODUCT_CODE), None)
        if bridge_i is None:
            log.warning("no bridge slave (product 0) in front of the palm; continuing")
        info = protocol_for_product(palm.id)
        if cfg.protocol and cfg.protocol != info.name:
            raise WrongKind(f"palm product {palm.id:#x} speaks protocol {info.name}, but protocol "
                              f"{cfg.protocol} is configured: refusing to run")
        serial = int.from_bytes(palm.eeprom_read(SII_SERIAL_WORD)[:4], "little")
        has_pd = _sii_describes_process_data(palm)
        if cfg.program_sms == "always" or (cfg.program_sms == "auto" and not has_pd):
            mapping = "programmed"
        elif not has_pd:
            raise MasterError("the palm's SII describes no SyncManagers/PDOs and program_sms=never")
        else:
            mapping = "sii"
        m.config_map()
        if mapping == "sii":
            out_n, in_n = len(palm.output), len(palm.input)
            if (out_n, in_n) != (info.command_size, info.status_size):
                tap.incoming()
                declared = None if tap.late else sii_pdo_bytes(palm)  # late replies: the re-read proves nothing
                confirmed = declared == (out_n, in_n)
                raise SizeMismatch(
                    f"palm product {palm.id:#x} (protocol {info.name}) maps {out_n} B of command and {in_n} B of "
                    f"status, but protocol {info.name} needs {info.command_size} B + {info.status_size} B "
                    f"(CAN bridge included): refusing to run" + ("" if confirmed else (
                        f" (the SII read again declares {declared[0]} B + {declared[1]} B: the scan was fooled)"
                        if declared else " (replies came back late: not confirmed)")), confirmed)
            expected = int(m.expected_wkc)
        tap.close()  # the scan proper ends here: what follows checks itself (working counters, AL states)
        if mapping != "sii":
            self._program_sms(palm, info)
            expected = 2  # FPWR command (1) + FPRD status (1)
        ident = HandIdentity(palm.man, palm.id, palm.rev, serial, info.name, palm.name, palm_i + 1,
                             None if bridge_i is None else bridge_i + 1, mapping, info.command_size,
                             info.status_size, expected, names)
        if m.state_check(pysoem.SAFEOP_STATE, cfg.state_timeout_us) != pysoem.SAFEOP_STATE:
            m.read_state()
            bad = ", ".join(f"{s.name}: {state_name(s.state)} (AL code {s.al_status:#06x} "
                            f"{pysoem.al_status_code_to_string(s.al_status)})" for s in slaves
                            if s.state != pysoem.SAFEOP_STATE)
            raise MasterError(f"slaves did not reach SAFE-OP: {bad}")
        log.info("palm %s: vendor %#x product %#x revision %#x serial %d, protocol %s, %s mapping %d/%d B",
                 palm.name, palm.man, palm.id, palm.rev, serial, info.name, mapping,
                 info.command_size, info.status_size)
        return _Bus(m, palm, info, ident, slaves, [_read_sm_fmmu(s) for s in slaves])

    def _program_sms(self, palm: Any, info: ProtocolInfo) -> None:
        """EML's configuration (docs/reference/shadow_ethercat.md §2.2): 4 mailbox SMs, FMMU0 writes the command +
        CAN bridge,
        FMMU1 reads the status + CAN bridge, at logical 0x10000. Done in PRE-OP, then SAFE-OP again."""
        for n, (start, length, control) in enumerate(info.sync_managers):
            self._config_write(palm, REG_SM0 + 8 * n, sm_register_block(start, length, control), f"SM{n}")
        cmd_at, status_at = info.sync_managers[0][0], info.sync_managers[2][0]
        self._config_write(palm, REG_FMMU0, fmmu_register_block(LOGICAL_BASE, info.command_size, cmd_at, True),
                           "FMMU0")
        self._config_write(palm, REG_FMMU0 + 16, fmmu_register_block(LOGICAL_BASE + info.command_size,
                                                                     info.status_size, status_at, False), "FMMU1")
        # config_map asked for SAFE-OP before the SMs existed: acknowledge that refusal and ask again.
        self._config_write(palm, REG_ALCTL, struct.pack("<H", pysoem.SAFEOP_STATE | pysoem.STATE_ACK),
                           "AL control (SAFE-OP + ack)")

    def _config_write(self, slave: Any, register: int, data: bytes, what: str) -> None:
        """One configuration register write, resent by SOEM within `config_write_timeout_us` (see MasterConfig)."""
        timeout = self.cfg.config_write_timeout_us
        try:
            slave._fpwr(register, data, timeout)
        except pysoem.WkcError:
            raise MasterError(f"{slave.name} did not acknowledge the write of {what} (register {register:#06x}) "
                              f"within {timeout / 1000:g} ms, resent every 2 ms") from None

    def to_op(self) -> None:
        bus = self._need()
        m = bus.master
        m.state = pysoem.OP_STATE
        self.exchange(self._output)  # outputs valid before OP, as SOEM's examples do
        m.write_state()
        deadline = time.monotonic() + self.cfg.state_timeout_us / 1e6
        while time.monotonic() < deadline:
            self.exchange(self._output)
            if m.state_check(pysoem.OP_STATE, 1000) == pysoem.OP_STATE:
                return
        m.read_state()
        bad = ", ".join(f"{s.name}: {state_name(s.state)}" for s in bus.slaves if s.state != pysoem.OP_STATE)
        raise MasterError(f"slaves did not reach OP: {bad}")

    def leave_op(self, state: int = pysoem.INIT_STATE) -> None:
        """OP -> SAFE-OP -> `state` (INIT by default), the way down for shutdown."""
        bus = self._need()
        self.settle()
        m = bus.master
        for st in (pysoem.SAFEOP_STATE, state):
            m.state = st
            m.write_state()
            m.state_check(st, 200_000)

    def close(self) -> None:
        if self._bus is not None:
            with contextlib.suppress(Exception):
                self.settle()
            self._bus.master.close()
            self._bus = None
        self._close_drain()

    def _close_drain(self) -> None:
        for sk in self._drain:
            sk.close()  # a dup: SOEM's own descriptor stays open
        self._drain = []

    def drop_stale(self) -> int:
        """Read and drop every frame waiting in SOEM's socket(s) and count them as stale replies. Called just
        before a frame is sent, when no frame is in flight (one at a time: `settle`), so whatever is queued
        then cannot be the reply to the frame about to go out: a duplicate, or a reply that came back after
        its frame was counted lost. Left in the queue, SOEM would read it instead of the next reply (and,
        its datagram index being another, drop it and report that frame lost: one stale reply in the queue
        made every following frame look lost, and with a reply index 16 frames old matching, read a status
        that old). When nothing is queued (the usual case) this is one FIONREAD ioctl per socket, no read."""
        n = 0
        for sk in self._drain:
            if not fcntl.ioctl(sk.fileno(), FIONREAD, self._inq, True):  # the length of the next frame, 0: none
                continue
            while True:
                try:
                    sk.recv_into(self._scratch, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
                except OSError:  # BlockingIOError: the queue is empty now
                    break
                n += 1
        if n:
            self.counters.stale += n
        return n

    def _need(self) -> _Bus:
        if self._bus is None:
            raise MasterError("the master is not open")
        return self._bus

    # ---- per cycle ------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._bus is not None

    def nic_replaced(self) -> bool:
        """The interface named in the configuration is not the one opened (one ioctl; asked only while no valid
        data flow)."""
        return bool(self._ifindex) and _ifindex(self.cfg.iface) != self._ifindex

    def exchange(self, command: bytes, give_up_ns: int | None = None) -> Exchange:
        """Send this cycle's command, wait at most recv_timeout_us for the frame (and never past the
        CLOCK_MONOTONIC time `give_up_ns`), check the WKC. Without a bus (a re-scan that failed) nothing
        is sent: a lost exchange. (`send` then `receive`.)"""
        self.send(command)
        return self.receive(give_up_ns)

    def send(self, command: bytes) -> int:
        """Hand this cycle's command to the wire and return at once (CLOCK_MONOTONIC ns of the send); the
        reply is read by `receive` (the cycle: at its next release, when the reply has long been in the
        socket's queue, so the cycle never sleeps and wakes a second time per period for it). The
        programmed mapping's exchange is two blocking pysoem datagrams: it runs here, whole."""
        self.settle()  # one frame in flight at a time: every send is paired with one receive
        bus = self._bus
        c = self.counters
        stale = self.drop_stale() if self._drain else 0  # nothing queued now is a reply to this frame
        t0 = time.monotonic_ns()
        if bus is None:
            c.lost += 1
            c.bad_run += 1
            self._result = Exchange(None, -1, 0, lost=True, sent_ns=t0)
            return t0
        c.frames += 1
        if len(command) != bus.info.command_size:
            raise ValueError(f"command is {len(command)} B, protocol {bus.info.name} needs {bus.info.command_size}")
        self._output = command
        if bus.ident.mapping == "sii":
            bus.palm.output = command
            bus.master.send_processdata()
            self._sent_ns = t0
            self._stale_before = stale
        else:
            wkc, status = self._exchange_physical(bus, command, None)
            self._result = self._account(bus, wkc, status, time.monotonic_ns() - t0, t0)
            self._result.stale = stale
        return t0

    def receive(self, give_up_ns: int | None = None) -> Exchange:
        """The reply to the last `send`: already in the socket's queue, or waited for in select() at most
        recv_timeout_us after the send and never past `give_up_ns`. A frame not back by then is lost (SOEM
        frees its slot); one back later than late_us after its send is late. The round trip is the
        kernel's receive time of the reply (SIOCGSTAMPNS) minus the send, so a reply read at the next
        release still has its own round trip."""
        ex = self._result
        if ex is not None:
            self._result = None
            return ex
        bus = self._bus
        t0 = self._sent_ns
        if bus is None or t0 is None:
            raise MasterError("receive() without a frame in flight")
        self._sent_ns = None
        # SOEM frees the frame's slot after one receive_processdata, found or not: wait first (select, no
        # spinning) while the reply may still come, then read once
        end = t0 + self.cfg.recv_timeout_us * 1000
        if give_up_ns is not None:
            end = min(end, give_up_ns)
        stale, self._stale_before = self._stale_before, 0
        # SOEM reads one frame and drops it when its datagram index is not this frame's: a stale reply at the
        # head of the queue (one that came back after this frame was sent: late, or a duplicate) would cost
        # this frame its own reply behind it. So look at the head first and drop a reply that does not carry
        # the command just sent (the palm's outputs come back unchanged in the LRW reply).
        waiting = False  # a frame was queued when SOEM was asked
        while True:
            now = time.monotonic_ns()
            if end > now and self.socket_fds and not select.select(self.socket_fds, [], [], (end - now) / 1e9)[0]:
                break  # nothing back in time: lost
            head = self._head()
            if head < 0:  # nothing queued (the cycle reads at its next release: no wait left)
                break
            waiting = True
            if head:
                break  # this frame's reply, as far as can be told here: SOEM checks the index
            self._drain[0].recv_into(self._scratch, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
            self.counters.stale += 1
            stale += 1
            waiting = False
        wkc = int(bus.master.receive_processdata(1))
        t_rx = time.monotonic_ns()
        if wkc >= 0 and self._stamp_fd >= 0:
            try:
                sec, nsec = _TIMESPEC.unpack(fcntl.ioctl(self._stamp_fd, SIOCGSTAMPNS, _TIMESPEC_ZERO))
                t_rx = min(t_rx, sec * 1_000_000_000 + nsec - self._real_minus_mono)
            except OSError:  # no timestamp yet (the first frame after enabling them): when we read it
                pass
            if t_rx < t0:
                # received before its frame was sent: a stale reply whose datagram index happened to be this
                # frame's (SOEM has 16), never this frame's reply nor a round trip
                self.counters.stale += 1
                ex = self._account(bus, -1, None, 0, t0)
                ex.stale, ex.rtt_ns = stale + 1, -1  # no round trip: nothing for the histogram
                return ex
        elif waiting:
            # a frame was queued and SOEM found none with this frame's datagram index: it read a stale reply
            # (a late one, which came back after this frame was sent) and dropped it
            self.counters.stale += 1
            stale += 1
        ex = self._account(bus, wkc, bus.palm.input if wkc == bus.ident.expected_wkc else None, t_rx - t0, t0)
        ex.stale = stale
        return ex

    def _head(self) -> int:
        """The frame at the head of the primary socket's queue, peeked (not read): -1 none; 0 a reply to another
        frame (it does not carry the command just sent); 1 maybe this frame's reply (it does, or it cannot
        be told: a programmed mapping, no socket found)."""
        if not self._drain:
            return 1 if self._queued_any() else -1
        try:
            n = self._drain[0].recv_into(self._peek, self._peek_len, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # BlockingIOError: empty
            return -1
        at = self._out_at
        if at <= 0:
            return 1
        end = at + len(self._output)
        return 1 if n >= end and self._peek[12:14] == ETHERTYPE and self._peek_mv[at:end] == self._output else 0

    def _queued_any(self) -> bool:
        """A frame waits in SOEM's socket(s) (FIONREAD: the next frame's length, 0 for none)."""
        return any(fcntl.ioctl(fd, FIONREAD, self._inq, True) for fd in self.socket_fds)

    @property
    def pending(self) -> bool:
        """A reply is owed to the caller: a frame in flight, or its reply read early."""
        return self._sent_ns is not None or self._result is not None

    def settle(self, give_up_ns: int | None = None) -> None:
        """Read a reply still in flight now (and keep it for the next `receive`): before any other
        datagram goes on the socket, whose replies would take its place in the receive timestamp."""
        if self._sent_ns is not None and self._result is None:
            self._result = self.receive(give_up_ns)

    def refresh_clock_offset(self) -> None:
        """CLOCK_REALTIME - CLOCK_MONOTONIC, for the kernel's (realtime) receive timestamps; NTP moves it
        slowly, so the cycle refreshes it in its slack now and then."""
        self._real_minus_mono = time.clock_gettime_ns(time.CLOCK_REALTIME) - time.monotonic_ns()

    def _account(self, bus: _Bus, wkc: int, status: bytes | None, rtt: int, t0: int) -> Exchange:
        c = self.counters
        c.last_wkc = wkc
        if rtt > c.rtt_max_ns:
            c.rtt_max_ns = rtt
        ex = Exchange(status, wkc, rtt, sent_ns=t0)
        if wkc < 0:
            c.lost += 1
            ex.lost = True
        elif wkc != bus.ident.expected_wkc:
            c.wkc_errors += 1
            ex.wkc_error = True
        if not ex.lost and rtt > self.cfg.late_us * 1000:
            c.late += 1
            ex.late = True
        if status is not None:
            c.valid_ns = t0 + rtt
            if c.bad_run:
                c.back_ns, c.bad_run = c.valid_ns, 0
        else:
            c.bad_run += 1
        return ex

    def _exchange_physical(self, bus: _Bus, command: bytes, give_up_ns: int | None) -> tuple[int, bytes | None]:
        """Programmed mapping: FPWR the command area, FPRD the status area (pysoem has no raw LRW), each
        with half of the time left (pysoem waits on these blocking, so the socket is not select()ed)."""
        wkc = 0
        t0 = time.monotonic_ns()
        timeout = self.cfg.recv_timeout_us
        if give_up_ns is not None:
            timeout = max(MIN_WAIT_NS, min(timeout * 1000, give_up_ns - t0)) // 1000
        timeout = max(MIN_WAIT_NS // 1000, timeout // 2)
        try:
            bus.palm._fpwr(bus.info.sync_managers[0][0], command, timeout)
            wkc += 1
            status: bytes = bus.palm._fprd(bus.info.sync_managers[2][0], bus.info.status_size, timeout)
            wkc += 1
        except pysoem.WkcError:
            # pysoem hides whether the frame came back: a full timeout means it did not
            return (-1 if time.monotonic_ns() - t0 >= timeout * 1000 else wkc), None
        return wkc, status

    def _read_states(self, bus: _Bus, give_up_ns: int | None) -> list[tuple[int, int] | None]:
        """(AL state, AL status code) of every slave; None for a slave whose read was cut short.

        Without a time limit, SOEM's read_state (a broadcast, then one read per slave when they differ).
        With one, an FPRD of AL status + code per slave, each waiting at most until `give_up_ns`: SOEM
        polls the (non-blocking) socket for its own 2 ms per datagram, which a cycle cannot afford when
        a slave has stopped answering. A read cut short by the limit before `late_us` says nothing about
        the slave; one that waited longer and got no answer is a slave not answering (NONE)."""
        if give_up_ns is None:
            bus.master.read_state()
            return [(int(s.state), int(s.al_status)) for s in bus.slaves]
        out: list[tuple[int, int] | None] = []
        full_us = self.cfg.recv_timeout_us
        for s in bus.slaves:
            left_us = (give_up_ns - time.monotonic_ns()) // 1000
            if left_us < MIN_WAIT_NS // 1000:
                out.append(None)
                continue
            wait_us = min(full_us, left_us)
            try:
                raw = s._fprd(REG_ALSTAT, 6, wait_us)
            except pysoem.WkcError:
                out.append((pysoem.NONE_STATE, 0) if wait_us >= min(full_us, self.cfg.late_us) else None)
                continue
            out.append((raw[0] & 0x1F, int(struct.unpack_from("<H", raw, 4)[0])))
        return out

    def _settle_by(self, bus: _Bus, give_up_ns: int | None) -> int | None:
        """How long a state check waits for the reply in flight: to `give_up_ns` while valid data flow (the reply
        comes in ~100 µs, and a read cut short then is no evidence anyway), else only until every slave's read
        can still wait `late_us`, the least wait whose silence counts as a slave not answering."""
        if give_up_ns is None or not self.counters.bad_run:
            return give_up_ns
        return give_up_ns - len(bus.slaves) * min(self.cfg.recv_timeout_us, self.cfg.late_us) * 1000 - MIN_WAIT_NS

    def check_states(self, give_up_ns: int | None = None) -> str:
        """One recovery step, bounded by the CLOCK_MONOTONIC time `give_up_ns` when given: read every slave's
        AL state; act on the first slave confirmed out of OP (or on process data that stay invalid while all
        claim OP); or advance an escalation already under way. Returns "" when all is well, else what is
        being worked on (for health). What to do is the recovery machine's (transport/recovery.py); this
        reads and writes what it asks for. No logging here (this runs in the realtime process): steps go to
        `recovery_log`, which the MQTT side logs."""
        bus = self._need()
        # the reply in flight first: the state reads must not take its timestamp. While no valid data flow it is
        # not waited for into the time the reads need: a frame nobody answers took its whole receive timeout,
        # and every read after it was then cut short before `late_us` (no evidence), check after check, so a
        # hung slave was never confirmed and the ladder never ran (silent for ever, never lost)
        self.settle(self._settle_by(bus, give_up_ns))
        r = self.recovery
        if r.nic_check_due and self.nic_replaced():
            return r.nic_lost(time.monotonic_ns(), self.cfg.iface, vanished=not _ifindex(self.cfg.iface))
        act = r.check(time.monotonic_ns())
        if act.do is Do.WRITE_STEP:
            acked = self._write_step(bus, act, give_up_ns)
            return r.step_written(time.monotonic_ns(), acked)
        if act.do is Do.READ_STATES:
            states = self._read_states(bus, give_up_ns)
            act = r.states(time.monotonic_ns(), states, bus.view)
        if act.do is Do.RECOVER:
            # SOEM's recover: find the slave at its position again, give it back its station address if it lost
            # it (a power cycle), provided vendor, product and revision are the ones configured
            ok = int(bus.slaves[act.slave].recover(self.policy.recover_timeout_us)) > 0
            serial = self._palm_serial(bus) if ok and act.check_serial else None
            return r.recovered(time.monotonic_ns(), ok, serial)
        if act.do is Do.REQUEST_STATE:
            s = bus.slaves[act.slave]
            s.state = act.state
            s.write_state()
        return act.issue

    def _write_step(self, bus: _Bus, act: Action, give_up_ns: int | None) -> bool:
        """The ladder's step to every slave: its SyncManagers and FMMUs as configured when asked, then the AL
        control word. False: a write was not acknowledged (the rest not sent)."""
        try:
            for i, s in enumerate(bus.slaves):
                sms, fmmus = bus.golden[i]
                if act.sms and sms:
                    s._fpwr(REG_SM0, sms, self._wait_us(give_up_ns))
                if act.fmmus and fmmus:
                    s._fpwr(REG_FMMU0, fmmus, self._wait_us(give_up_ns))
                s._fpwr(REG_ALCTL, struct.pack("<H", act.state), self._wait_us(give_up_ns))
        except pysoem.WkcError:
            return False
        return True

    def _palm_serial(self, bus: _Bus) -> int | None:
        try:
            return int.from_bytes(bus.palm.eeprom_read(SII_SERIAL_WORD, 5000)[:4], "little")
        except Exception:  # pysoem raises its own errors for a read that did not complete
            return None

    def _wait_us(self, give_up_ns: int | None) -> int:
        if give_up_ns is None:
            return self.cfg.recv_timeout_us
        return max(MIN_WAIT_NS // 1000, min(self.cfg.recv_timeout_us, (give_up_ns - time.monotonic_ns()) // 1000))

    def rescan(self) -> HandIdentity:
        """The whole bring-up again (config_init, mapping, SAFE-OP, OP): the bus as it now is. Blocking (tens
        of ms or more); the cycle calls it only while no valid process data flow anyway. Raises MasterError
        when the bus cannot be brought up (the cycle then tries again later)."""
        why = self.recovery.rescan_started()
        self.settle()
        self._result = None  # the old bus's last reply: not news about the new one
        old = self._bus
        self._bus = None
        if old is not None:
            with contextlib.suppress(Exception):
                old.master.close()
        netns, self.cfg.netns = self.cfg.netns, None  # this thread is in the namespace already
        try:
            ident = self.open()
        except NoDevice as exc:
            # the NIC may go only after the slave fell silent (a namespace torn down, a USB adapter unplugged):
            # the re-scan asked for another reason then, and its failure is where the NIC's loss shows
            self.recovery.rescan_found_nothing(time.monotonic_ns(), why, self.cfg.iface,
                                               not _ifindex(self.cfg.iface), str(exc))
            raise
        finally:
            self.cfg.netns = netns
        self.to_op()
        self.counters.bad_run = 0
        self.recovery.rescan_done(time.monotonic_ns(), why, ident.palm_name, ident.serial, ident.protocol)
        return ident


def _read_sm_fmmu(s: Any) -> tuple[bytes, bytes]:
    """A slave's SyncManager and FMMU register blocks as configured (what an escalation writes back)."""
    try:
        n_fmmu, n_sm = s._fprd(REG_ESC_COUNTS, 2)
        n_fmmu, n_sm = min(int(n_fmmu), MAX_FMMUS), min(int(n_sm), MAX_SMS)
        return (bytes(s._fprd(REG_SM0, 8 * n_sm)) if n_sm else b"",
                bytes(s._fprd(REG_FMMU0, 16 * n_fmmu)) if n_fmmu else b"")
    except pysoem.WkcError:
        return b"", b""


def _ifindex(iface: str) -> int:
    """The interface's index in this thread's network namespace; 0 when there is no such interface."""
    try:
        return socket.if_nametoindex(iface)
    except OSError:
        return 0


class _Tap:
    """A packet socket on the NIC for the length of a scan: counts the frames that arrived from outside."""

    def __init__(self, iface: str) -> None:
        self.sock: socket.socket | None = None
        self._seen = self._in = self._out_since_reply = 0
        self.late = 0  # EtherCAT replies that came back after the master had sent another frame (see incoming)
        try:
            sk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sk.bind((iface, 0))
            sk.setblocking(False)
            try:  # a scan is some 500 frames each way, read only at its end: room for all of them
                sk.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
            except OSError:
                sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
            self.sock = sk
        except OSError:
            pass

    def __enter__(self) -> _Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Count what arrived so far and stop watching (the counts stay)."""
        if self.sock is not None:
            self.incoming()
            self.sock.close()
            self.sock = None

    def incoming(self) -> int:
        """Frames that arrived from outside so far (reads what is queued; cumulative). Also counts `late`:
        EtherCAT replies that arrived after the master had sent another frame since the last reply, i.e. after
        it gave up on the frame they answer (a configuration master sends one frame at a time and waits)."""
        while self.sock is not None and self._seen < 100_000:
            try:
                data, addr = self.sock.recvfrom(64)
            except OSError:
                break
            self._seen += 1
            ecat = data[12:14] == ECAT_ETHERTYPE
            if addr[2] == PACKET_OUTGOING:
                self._out_since_reply += ecat
                continue
            self._in += 1
            if ecat:
                if self._out_since_reply > 1:
                    self.late += 1
                self._out_since_reply = 0
        return self._in


def _open_fds() -> dict[int, str]:
    """fd -> link target ("socket:[inode]"...): inodes tell new sockets apart from reused fd numbers."""
    out: dict[int, str] = {}
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
    return out


def _make_packet_sockets_nonblocking(fds: set[int]) -> list[int]:
    """SOEM waits for a frame with recv() on a socket whose SO_RCVTIMEO is 1 µs, which the kernel rounds
    up to one jiffy (4 ms at HZ=250): a lost frame then stalls the cycle for 4-8 ms whatever timeout was
    asked for. On a non-blocking socket recv() returns at once, so the timeout is honoured to the
    microsecond; `exchange` sleeps in select() until the frame is back instead of letting SOEM spin."""
    out: list[int] = []
    for fd in sorted(fds):  # the primary first (SOEM opens it first)
        try:
            with socket.socket(fileno=fd) as sk:
                try:
                    if sk.family == socket.AF_PACKET:
                        os.set_blocking(fd, False)
                        out.append(fd)
                finally:
                    sk.detach()  # the descriptor stays SOEM's
        except OSError:
            continue
    return out


def _is_palm(product: int) -> bool:
    return any(product in p.product_codes for p in PROTOCOLS.values())


def sii_pdo_bytes(slave: Any) -> tuple[int, int] | None:
    """(command, status) bytes the slave's SII declares, read word by word with the master's own EEPROM reads
    (not SOEM's SII cache) and summed the way SOEM's config_map does (docs/reference/shadow_ethercat.md §8): the
    bit lengths of every entry of the first RxPDO (51) and the first TxPDO (50) category. None: unreadable."""
    try:
        bodies: dict[int, bytes] = {}
        word = SII_CAT_START
        for _ in range(64):  # bounded, in case the image is garbage
            cat, size = struct.unpack_from("<HH", slave.eeprom_read(word))
            if cat in (0xFFFF, 0):
                break
            if cat in (SII_CAT_RXPDO, SII_CAT_TXPDO) and cat not in bodies:
                body = b"".join(bytes(slave.eeprom_read(word + 2 + k)[:4]) for k in range(0, size, 2))
                bodies[cat] = body[: 2 * size]
            word += 2 + size
    except (pysoem.EepromError, pysoem.WkcError):
        return None
    if set(bodies) != {SII_CAT_RXPDO, SII_CAT_TXPDO}:
        return None  # config_map found both (the mapping is "sii"): a read that finds neither proves nothing
    out: list[int] = []
    for cat in (SII_CAT_RXPDO, SII_CAT_TXPDO):
        body, bits, pos = bodies.get(cat, b""), 0, 0
        while pos + 8 <= len(body):
            n = body[pos + 2]
            pos += 8
            bits += sum(body[pos + 8 * k + 5] for k in range(n) if pos + 8 * k + 5 < len(body))
            pos += 8 * n
        out.append((bits + 7) // 8)
    return out[0], out[1]


def _sii_describes_process_data(slave: Any) -> bool:
    """Walk the palm's SII categories: SOEM can map only if SM and PDO categories are present."""
    found: set[int] = set()
    word = SII_CAT_START
    for _ in range(64):  # a handful of categories; bounded in case the image is garbage
        head = slave.eeprom_read(word)
        cat, size = struct.unpack_from("<HH", head)
        if cat == 0xFFFF or cat == 0:
            break
        found.add(cat)
        word += 2 + size
    return SII_CAT_SM in found and (SII_CAT_RXPDO in found or SII_CAT_TXPDO in found)
