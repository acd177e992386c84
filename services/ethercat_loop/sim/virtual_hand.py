"""The virtual Shadow hand on the wire: two software ESCs (the bridge, product 0, then the palm,
0220 or 0230) answering real EtherCAT frames on a raw socket, with the palm's process data driven
once per cycle by the shared palm model (`palm_model.PalmModel`).

Run it on one end of a veth pair (netns.py does the plumbing):
    python -m services.ethercat_loop.sim.virtual_hand --iface ech0 --protocol 0220 --control /run/x.sock
Faults are injected at run time through the control socket (`HandControl`), or from the start
with --drop-every / --delay-every / --answer-twice / --late-us / --stale-sii-reply /
--stall-at-frame.

The bus stop's stamp (tests, bench/stop.py): once armed (the control op `watch_stop`, or `--watch-stop`, re-armed
by SIGHUP), the palm stamps the first demand frame (TO_MOTOR type DEMAND_TORQUE or DEMAND_PWM) whose 20 demands are
all zero, with the kernel's receive time of that frame at the hand's port (CLOCK_MONOTONIC and Unix), its
process-data frame number and how many demand frames with a non-zero demand came between the arming and it (0: the
motors were at rest already). The op `stop_stamp` returns it (null until then); `--watch-stop` prints it as one
JSON line on stdout (`{"event": "stop_bytes", ...}`).

The palm firmware loads its status after it has processed the command (docs/reference/shadow_ethercat.md §1.10), so the
status a master reads in frame N answers command N-1; the model runs after the reply has left, which
also keeps the Python model's cost out of the master's round trip.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from services.ethercat_loop.loop_stats import percentiles
from services.ethercat_loop.protocol import (
    BRIDGE_PRODUCT_CODE,
    PROTOCOLS,
    PalmCommand,
    ProtocolInfo,
    ToMotorDataType,
    unpack_command,
)
from services.ethercat_loop.sim.esc import (
    AL_CODE_SM_WATCHDOG,
    OP,
    REG_EEPADR,
    REG_EEPDAT,
    REG_FMMU0,
    SAFEOP,
    Esc,
    EscChain,
    ExpectedSm,
)
from services.ethercat_loop.sim.esc_frames import (
    ETH_HEADER_LEN,
    ETHERTYPE_ECAT,
    Cmd,
    Datagram,
    FrameError,
    build_datagrams,
    parse_datagrams,
)
from services.ethercat_loop.sim.esc_sii import SM_TYPE_INPUTS, SM_TYPE_OUTPUTS, PdoSpec, SiiConfig, SmSpec, build_sii
from services.ethercat_loop.transport.realtime import RtSettings, apply_realtime

PACKET_OUTGOING = 4
SO_TIMESTAMPNS = 35  # <asm-generic/socket.h>; Python's socket module does not export it
ANSWER_HIST_US = 5000
GC_EVERY_FRAMES = 1000  # a young-generation collection, right after a frame was answered
# no public source gives Shadow's vendor id (docs/reference/shadow_ethercat.md §2.1); a placeholder
DEFAULT_VENDOR = 0x00000530
DEFAULT_SERIAL = 1234
DEFAULT_REVISION = 0x00000001


class PalmLike(Protocol):
    """The palm firmware model: one 1 ms cycle, command + CAN bridge in, status + CAN bridge out."""

    def exchange(self, command: bytes) -> bytes: ...


@dataclass
class HandOptions:
    protocol: str = "0220"
    serial: int = DEFAULT_SERIAL
    vendor: int = DEFAULT_VENDOR
    revision: int = DEFAULT_REVISION
    left: bool = False  # 0230 only: product 0x01000001 instead of 0x01000000
    sii_process_data: bool = True  # False: SII without SM/PDO categories (the master must program them)
    status_size_delta: int = 0  # != 0: SII declares a status PDO of the wrong size (master must refuse)
    drop_every: int = 0
    delay_every: int = 0
    delay_us: int = 3000
    watch: tuple[int, int] | None = None  # (offset, length) of the command bytes whose changes are logged
    fmmus_on_safeop: bool = False  # FMMUs take effect only on PRE-OP -> SAFE-OP (both slaves)
    lose_fmmu_replies: int = 0  # the replies to the first N FPWR frames to FMMU registers are lost
    answer_twice: bool = False  # every process-data frame is answered twice (the same reply, back to back)
    late_us: int = 0  # every process-data reply leaves this late, without holding up the frames after it
    garbage: bool = False  # no slave: every EtherCAT frame is answered with garbage (`garbage_replies`)
    # >= 0: the first master read of the palm's SII data register (FPRD 0x0508) for the 8-byte block holding this
    # SII word is answered late, behind a stale reply: the reply the hand last sent under the same datagram index
    # (`VirtualHand.stale_first`). What a stalled hand does to a master that kept sending: SOEM has 16 indices, so
    # after 16 timed-out datagrams the reply to an old one carries the index of the one now waiting.
    stale_sii_word: int = -1
    # > 0: on the Nth frame (counted from the start) the hand stalls stall_ms before handling it, the frames behind
    # it queueing meanwhile, then answers them all in order: a hand starved of CPU (or a VM's descheduled vCPU),
    # which a master that gave up waiting meets as a burst of late replies
    stall_frame: int = 0
    stall_ms: int = 60


def palm_product(opts: HandOptions) -> int:
    codes = PROTOCOLS[opts.protocol].product_codes
    return codes[1] if opts.left and len(codes) > 1 else codes[0]


def palm_sii(opts: HandOptions) -> SiiConfig:
    info = PROTOCOLS[opts.protocol]
    cfg = SiiConfig(opts.vendor, palm_product(opts), opts.revision, opts.serial, f"Shadow palm {info.name}")
    if opts.sii_process_data:
        (c0, l0, k0), (c1, l1, k1), (c2, l2, k2), (c3, l3, k3) = info.sync_managers
        cfg.sms = [SmSpec(c0, l0, k0, 1, SM_TYPE_OUTPUTS), SmSpec(c1, l1, k1, 1, SM_TYPE_OUTPUTS),
                   SmSpec(c2, l2, k2, 1, SM_TYPE_INPUTS), SmSpec(c3, l3, k3, 1, SM_TYPE_INPUTS)]
        cfg.rx_pdos = [PdoSpec(0x1600, 0, l0, "command"), PdoSpec(0x1601, 1, l1, "CAN bridge command")]
        cfg.tx_pdos = [PdoSpec(0x1A00, 2, l2 + opts.status_size_delta, "status"),
                       PdoSpec(0x1A01, 3, l3, "CAN bridge status")]
        cfg.fmmu_functions = [1, 2, 0]
    return cfg


def bridge_sii(opts: HandOptions) -> SiiConfig:
    return SiiConfig(opts.vendor, BRIDGE_PRODUCT_CODE, opts.revision, 0, "Shadow EtherCAT bridge")


def build_chain(opts: HandOptions) -> tuple[EscChain, Esc, Esc]:
    info = PROTOCOLS[opts.protocol]
    # DL status: bridge has ports 0 and 1 open with communication; the palm ends the line.
    bridge = Esc(build_sii(bridge_sii(opts)), name="bridge", dl_status=0x0A30, fmmus_on_safeop=opts.fmmus_on_safeop)
    palm = Esc(build_sii(palm_sii(opts)), name="palm", dl_status=0x0610,
               expected_sms=tuple(ExpectedSm(i, a, n) for i, (a, n, _c) in enumerate(info.sync_managers)),
               fmmus_on_safeop=opts.fmmus_on_safeop)
    return EscChain([bridge, palm]), bridge, palm


def load_model(spec: str, protocol: str) -> PalmLike:
    """`module:factory` called with protocol=..., default the shared palm model (palm_model.py)."""
    mod_name, _, attr = spec.partition(":")
    factory: Callable[..., PalmLike] = getattr(importlib.import_module(mod_name), attr or "PalmModel")
    return factory(protocol=protocol)


@dataclass
class Faults:
    """Pending one-shot faults (counted down per process-data frame) and periodic ones."""

    drop: int = 0
    delay: int = 0
    delay_us: int = 3000
    corrupt_wkc: int = 0
    drop_every: int = 0
    delay_every: int = 0
    lose_fmmu_replies: int = 0  # configuration: FPWR to 0x0600-0x06FF written, the reply lost (the master resends)
    twice: int = 0  # the next N process-data frames are answered twice
    twice_always: bool = False
    late: int = 0  # the next N process-data replies leave late_us late (scheduled: later frames are not held up)
    late_us: int = 0
    late_always: bool = False
    stale_sii: int = 0  # SII data reads (HandOptions.stale_sii_word) still to be answered behind a stale reply


@dataclass
class HandStats:
    frames: int = 0
    pd_frames: int = 0
    garbage: int = 0
    dropped: int = 0
    delayed: int = 0
    corrupted: int = 0
    duplicated: int = 0  # replies sent a second time
    answered_late: int = 0  # replies scheduled late_us after their frame
    stale_replies: int = 0  # stale replies sent ahead of the real one (HandOptions.stale_sii_word)
    stalls: int = 0  # stalls done (HandOptions.stall_frame)
    palm_cycles: int = 0
    left_op: int = 0
    power_cycles: int = 0
    frames_while_off: int = 0  # frames that met a hand without power (no reply)
    zero_demand_frames_before_leaving_op: int = -1  # -1: the palm has not left OP yet
    transitions: list[str] = field(default_factory=list)
    # how long a frame waited in the hand: kernel receive timestamp -> reply handed to the kernel (µs
    # histogram, last bin = that or more); the hand stands in for an ESC that answers in hardware, so
    # this shows whether the master's lost or late frames are the hand's doing
    answer_hist: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(ANSWER_HIST_US + 1, np.int64))
    answer_max_us: int = 0

    def answer_summary(self) -> dict[str, Any]:
        p = percentiles(self.answer_hist)
        return {"n": int(p["count"] or 0), "p50_us": p["p50"], "p99_us": p["p99"], "p99.9_us": p["p99.9"],
                "max_us": self.answer_max_us, "over_500us": int(self.answer_hist[500:].sum()),
                # the master reads a reply at its next release: at 1 kHz, one answered a period late is lost
                "over_1000us": int(self.answer_hist[1000:].sum())}


class PalmFirmware:
    """The PIC32 side of the palm ESC: once per written command, run the model and load the status."""

    def __init__(self, esc: Esc, info: ProtocolInfo, model: PalmLike, stats: HandStats,
                 watch: tuple[int, int] | None = None) -> None:
        self.esc, self.info, self.model, self.stats = esc, info, model, stats
        self.watch = slice(watch[0], watch[0] + watch[1]) if watch else slice(0, info.command_size)
        self.cmd_at = info.sync_managers[0][0]
        self.status_at = info.sync_managers[2][0]
        self.last_command = bytes(info.command_size)
        self.zero_run = 0  # consecutive commands with every motor demand at zero
        # (CLOCK_MONOTONIC ns, process-data frame number, command hex) of every command that differed
        self.changes: deque[tuple[int, int, str]] = deque(maxlen=50_000)
        # the bus stop's stamp (module docstring): armed by watch_stop(), the first all-zero demand frame after it
        self.watching = False
        self.stop_stamp: dict[str, Any] | None = None
        self.on_stamp: Callable[[dict[str, Any]], None] | None = None
        self._moving_since_armed = 0  # demand frames with a non-zero demand since the watch was armed
        self._demand_frames_since_armed = 0

    def watch_stop(self) -> None:
        """Arm the stop watch (again): forget the stamp; the next all-zero demand frame is stamped."""
        self.stop_stamp = None
        self._moving_since_armed = self._demand_frames_since_armed = 0
        self.watching = True

    def _watch_demands(self, cmd: PalmCommand, zero: bool, rx_ns: int) -> None:
        if cmd.to_motor_data_type not in (ToMotorDataType.DEMAND_TORQUE, ToMotorDataType.DEMAND_PWM):
            return
        self._demand_frames_since_armed += 1
        if not zero:
            self._moving_since_armed += 1
            return
        self.watching = False
        mono = time.monotonic_ns()
        self.stop_stamp = {"monotonic_ns": rx_ns, "monotonic": rx_ns / 1e9, "unix": time.time() - (mono - rx_ns) / 1e9,
                           "pd_frame": self.stats.pd_frames, "demand_frames": self._demand_frames_since_armed,
                           "moving_frames_before": self._moving_since_armed}
        if self.on_stamp is not None:
            self.on_stamp(self.stop_stamp)

    def after_frame(self, now_ns: int) -> None:
        events = self.esc.take_sm_events()
        if 1 not in events or self.esc.al_state != OP:
            return  # the command mailbox (SM0 + SM1) is full only once SM1's last byte has arrived
        cmd = self.esc.pdi_read(self.cmd_at, self.info.command_size)
        if cmd[self.watch] != self.last_command[self.watch]:
            self.changes.append((now_ns, self.stats.pd_frames, cmd.hex()))
        self.last_command = cmd
        decoded = unpack_command(cmd, self.info.name)
        zero = isinstance(decoded, PalmCommand) and not any(decoded.motor_data)
        self.zero_run = self.zero_run + 1 if zero else 0
        if self.watching and isinstance(decoded, PalmCommand):
            self._watch_demands(decoded, zero, now_ns)
        status = self.model.exchange(cmd)
        self.esc.pdi_write(self.status_at, status[: self.info.status_size])
        self.stats.palm_cycles += 1


class VirtualHand:
    """Frames in, frames out: the ESC chain plus fault injection and the palm firmware."""

    def __init__(self, opts: HandOptions, model: PalmLike) -> None:
        self.opts = opts
        self.info = PROTOCOLS[opts.protocol]
        self.chain, self.bridge, self.palm = build_chain(opts)
        self.stats = HandStats()
        self.faults = Faults(delay_us=opts.delay_us, drop_every=opts.drop_every, delay_every=opts.delay_every,
                             lose_fmmu_replies=opts.lose_fmmu_replies, twice_always=opts.answer_twice,
                             late_us=opts.late_us, late_always=opts.late_us > 0,
                             stale_sii=1 if opts.stale_sii_word >= 0 else 0)
        self.copies = 1  # how many times the frame just handled is to be answered (2: a duplicate)
        self.late_ns = 0  # > 0: its reply leaves this long after the frame arrived, scheduled (not a sleep)
        self.stale_first = False  # the frame just handled is answered behind the last reply sent under its index
        self.firmware = PalmFirmware(self.palm, self.info, model, self.stats, opts.watch)
        self._palm_state = self.palm.al_state
        self.off_until_ns: int | None = None  # powered off until then (a power cycle in progress)
        self.powered_on_ns = 0  # CLOCK_MONOTONIC of the last power-on (0: at start)

    def power_cycle(self, off_ms: int, serial: int | None = None) -> None:
        """Power lost now, back after `off_ms`: no frame is answered meanwhile; then both slaves start
        afresh (INIT, station address 0, no SyncManager or FMMU), optionally as a palm with another serial."""
        if serial is not None:
            self.opts.serial = serial
        self.off_until_ns = time.monotonic_ns() + off_ms * 1_000_000
        self.stats.power_cycles += 1

    def _power_on(self, now_ns: int) -> None:
        self.chain, self.bridge, self.palm = build_chain(self.opts)
        self.firmware.esc = self.palm
        self._palm_state = self.palm.al_state
        self.stats.transitions.append("power on")
        self.off_until_ns = None
        self.powered_on_ns = now_ns

    def handle(self, payload: bytes, now_ns: int) -> tuple[bytes | None, int]:
        """One EtherCAT payload in; (reply payload or None to drop it, delay in µs). `copies` and `late_ns`
        say how a process-data reply is to be sent: twice, and/or scheduled late."""
        self.stats.frames += 1
        self.copies, self.late_ns, self.stale_first = 1, 0, False
        if self.stats.frames == self.opts.stall_frame:
            time.sleep(self.opts.stall_ms / 1000)  # starved: every frame behind this one waits in the socket
            self.stats.stalls += 1
        if self.off_until_ns is not None:
            if time.monotonic_ns() < self.off_until_ns:
                self.stats.frames_while_off += 1
                return None, 0
            self._power_on(time.monotonic_ns())
        try:
            dgs = parse_datagrams(payload)
        except FrameError:
            self.stats.garbage += 1
            return None, 0
        self.chain.process(dgs)
        self._watch_state()
        if self.faults.stale_sii > 0 and self._reads_sii_word(dgs, self.opts.stale_sii_word):
            self.faults.stale_sii -= 1
            self.stale_first = True
        delay = 0
        if self.faults.lose_fmmu_replies > 0 and any(d.cmd == Cmd.FPWR and REG_FMMU0 <= d.ado < REG_FMMU0 + 0x100
                                                    for d in dgs):
            self.faults.lose_fmmu_replies -= 1
            self.stats.dropped += 1
            return None, 0  # written (an ESC acts on the frame as it passes), only the way back is lost
        if any(d.cmd in (10, 11, 12) for d in dgs):  # process data: the faults apply to these frames
            self.stats.pd_frames += 1
            n = self.stats.pd_frames
            f = self.faults
            if f.drop > 0 or (f.drop_every and n % f.drop_every == 0):
                f.drop = max(0, f.drop - 1)
                self.stats.dropped += 1
                return None, 0  # the slaves processed it (the palm still runs); only the way back is lost
            if f.delay > 0 or (f.delay_every and n % f.delay_every == 0):
                f.delay = max(0, f.delay - 1)
                self.stats.delayed += 1
                delay = f.delay_us
            if f.twice > 0 or f.twice_always:
                f.twice = max(0, f.twice - 1)
                self.stats.duplicated += 1
                self.copies = 2
            if f.late > 0 or f.late_always:
                f.late = max(0, f.late - 1)
                self.stats.answered_late += 1
                self.late_ns = f.late_us * 1000
            if f.corrupt_wkc > 0:
                f.corrupt_wkc -= 1
                self.stats.corrupted += 1
                for d in dgs:
                    d.wkc = (d.wkc + 7) & 0xFFFF
        return build_datagrams(dgs), delay

    def _reads_sii_word(self, dgs: list[Datagram], word: int) -> bool:
        """Whether one of these datagrams read the palm's SII data register while it held `word` (8 bytes, 4 words
        from the last read command's address)."""
        (adr,) = struct.unpack_from("<I", self.palm.mem, REG_EEPADR)
        return adr <= word < adr + 4 and any(
            d.cmd == Cmd.FPRD and d.adp == self.palm.station_address and d.ado == REG_EEPDAT and d.wkc for d in dgs)

    def _watch_state(self) -> None:
        st = self.palm.al_state | (0x10 if self.palm.al_error else 0)
        if st != self._palm_state:
            self.stats.transitions.append(f"{self._palm_state:#04x}->{st:#04x}")
            del self.stats.transitions[:-50]
            if self._palm_state == OP:
                self.stats.left_op += 1
                self.stats.zero_demand_frames_before_leaving_op = self.firmware.zero_run
            self._palm_state = st

    def leave_op(self) -> None:
        """The palm drops to SAFE-OP with an error, as after an SM watchdog expiry."""
        self.palm.fault(SAFEOP, AL_CODE_SM_WATCHDOG)
        self._watch_state()

    def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        n = int(msg.get("n", 1))
        if op == "drop":
            self.faults.drop += n
        elif op == "delay":
            self.faults.delay += n
            self.faults.delay_us = int(msg.get("us", self.faults.delay_us))
        elif op == "twice":  # answer the next n process-data frames twice
            self.faults.twice += n
        elif op == "late":  # the next n process-data replies leave `us` late (later frames not held up)
            self.faults.late += n
            self.faults.late_us = int(msg.get("us", self.faults.late_us or 1500))
        elif op == "corrupt_wkc":
            self.faults.corrupt_wkc += n
        elif op == "lose_fmmu_replies":  # the next n FPWR frames to FMMU registers: written, the reply lost
            self.faults.lose_fmmu_replies += n
        elif op == "leave_op":
            self.leave_op()
        elif op == "power_cycle":
            self.power_cycle(int(msg.get("off_ms", 300)), None if msg.get("serial") is None else int(msg["serial"]))
        elif op == "fmmus_off":
            self.palm.deactivate_fmmus()
        elif op == "watch_stop":  # arm the bus stop's stamp (again)
            self.firmware.watch_stop()
            return {"ok": True, "watching": True}
        elif op == "stop_stamp":  # the first all-zero demand frame since watch_stop (None: none yet)
            return {"ok": True, "watching": self.firmware.watching, "stamp": self.firmware.stop_stamp}
        elif op == "can_log":  # the frames the palm put on its CAN buses in CAN direct mode (the last 256)
            log = getattr(self.firmware.model, "bus_log", None)
            return {"ok": True, "frames": [[c, bus, sid, bytes(data).hex()] for c, bus, sid, data in list(log or ())]}
        elif op == "changes":
            out: list[tuple[int, int, str]] = []
            while self.firmware.changes and len(out) < int(msg.get("max", 400)):
                out.append(self.firmware.changes.popleft())
            return {"ok": True, "changes": out}
        elif op != "stats":
            return {"ok": False, "error": f"unknown op {op!r}"}
        return {"ok": True, **self.snapshot()}

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "frames": s.frames, "pd_frames": s.pd_frames, "garbage": s.garbage, "dropped": s.dropped,
            "delayed": s.delayed, "corrupted": s.corrupted, "duplicated": s.duplicated,
            "answered_late": s.answered_late, "stale_replies": s.stale_replies, "stalls": s.stalls,
            "palm_cycles": s.palm_cycles,
            "left_op": s.left_op,
            "zero_demand_frames_before_leaving_op": s.zero_demand_frames_before_leaving_op,
            "power_cycles": s.power_cycles, "frames_while_off": s.frames_while_off,
            "powered": self.off_until_ns is None, "powered_on_ns": self.powered_on_ns,
            "transitions": s.transitions[-20:], "palm_state": self.palm.al_state, "palm_error": self.palm.al_error,
            "bridge_state": self.bridge.al_state, "last_command": self.firmware.last_command.hex(),
            "protocol": self.info.name, "product": palm_product(self.opts), "serial": self.opts.serial,
            "answer": s.answer_summary(),
        }


def open_raw(iface: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETHERTYPE_ECAT))
    s.bind((iface, ETHERTYPE_ECAT))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    # the kernel's receive time of each frame: when it reached the hand's port, however late the
    # (Python) hand gets to it
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return s


def reply_frame(raw: bytes, payload: bytes) -> bytes:
    # An ESC's port 0 sets the locally-administered bit of the source MAC on the way back (ETG.1000.4).
    src = bytes([raw[6] | 0x02]) + raw[7:12]
    out = raw[0:6] + src + raw[12:14] + payload
    return out + bytes(60 - len(out)) if len(out) < 60 else out


GARBAGE_ETHERTYPE = b"\x88\xb5"  # IEEE 802 local experimental: a frame that is not EtherCAT


def garbage_replies(raw: bytes) -> list[bytes]:
    """What a peer that is no EtherCAT slave sends back for one EtherCAT frame (`--garbage`): a frame that is not
    EtherCAT at all, and one typed EtherCAT whose datagrams are random bytes. The second carries a datagram
    index that is not the request's (its top bit flipped: SOEM keeps 16), so no master takes it for the answer
    it waits for: random garbage that happened to echo the index would be a slave to SOEM's scan, the wrong
    kind of device rather than garbage."""
    src = bytes([raw[6] | 0x02]) + raw[7:12]
    head = raw[0:6] + src
    other = head + GARBAGE_ETHERTYPE + os.urandom(46 + os.urandom(1)[0] % 128)
    body = bytearray(os.urandom(max(len(raw) - ETH_HEADER_LEN, 48)))
    body[0:2] = raw[ETH_HEADER_LEN : ETH_HEADER_LEN + 2] if len(raw) >= ETH_HEADER_LEN + 2 else body[0:2]
    if len(raw) > ETH_HEADER_LEN + 3:
        body[3] = raw[ETH_HEADER_LEN + 3] ^ 0x80  # datagram header: command, then the index
    return [other, head + ETHERTYPE_ECAT.to_bytes(2, "big") + bytes(body)]


_TS_CMSG_SPACE = socket.CMSG_SPACE(16)


class _MonoFromRealtime:
    """SO_TIMESTAMPNS stamps CLOCK_REALTIME; the rest of the system (master, bench) uses CLOCK_MONOTONIC.
    The offset between them is re-read once a second (a clock step moves it; NTP slewing barely does)."""

    def __init__(self) -> None:
        self._due = 0
        self._offset = 0

    def __call__(self, realtime_ns: int, mono_now: int) -> int:
        if mono_now >= self._due:
            self._offset = realtime_minus_monotonic()
            self._due = mono_now + 1_000_000_000
        return min(realtime_ns - self._offset, mono_now)


def realtime_minus_monotonic(tries: int = 5) -> int:
    """CLOCK_REALTIME - CLOCK_MONOTONIC (ns), the realtime read bracketed by two monotonic reads; the
    tightest of a few tries (a preemption between the reads would skew one)."""
    best: tuple[int, int] | None = None
    for _ in range(tries):
        m0 = time.monotonic_ns()
        r = time.clock_gettime_ns(time.CLOCK_REALTIME)
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, r - (m0 + m1) // 2)
    assert best is not None
    return best[1]


def _rx_time(ancdata: list[tuple[int, int, bytes]], mono_now: int, to_mono: _MonoFromRealtime) -> int:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            return to_mono(sec * 1_000_000_000 + nsec, mono_now)
    return mono_now


def serve(hand: VirtualHand, iface: str, control_path: str | None, stop: Callable[[], bool]) -> None:
    """The hand's loop: answer frames until `stop()`. Frames come first: control datagrams (fault
    injection, stats, the change log) are served only when no frame is waiting, so a large reply costs
    the master nothing it can see."""
    raw = open_raw(iface)
    ctl: socket.socket | None = None
    if control_path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control_path)
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ctl.bind(control_path)
        ctl.setblocking(False)
    watch = [raw] + ([ctl] if ctl else [])
    stats, hist, last_bin = hand.stats, hand.stats.answer_hist, ANSWER_HIST_US
    to_mono = _MonoFromRealtime()
    mono = time.monotonic_ns
    since_gc = 0
    # late replies (HandOptions.late_us, the "late" op): (due CLOCK_MONOTONIC ns, order, frame), sent when due
    # while the frames behind them are served as usual
    later: list[tuple[int, int, bytes]] = []
    order = 0
    # the last reply sent under each datagram index (HandOptions.stale_sii_word only: nothing kept otherwise)
    by_index: dict[int, bytes] | None = {} if hand.opts.stale_sii_word >= 0 else None
    try:
        while not stop():
            wait = 0.2 if not later else max(0.0, min(0.2, (later[0][0] - mono()) / 1e9))
            ready, _, _ = select.select(watch, [], [], wait)
            while later and later[0][0] <= mono():
                raw.send(heapq.heappop(later)[2])
            answered = False
            while True:  # drain every frame queued before anything else
                try:
                    frame, anc, _flags, meta = raw.recvmsg(2048, _TS_CMSG_SPACE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if meta[2] == PACKET_OUTGOING or len(frame) < ETH_HEADER_LEN + 2:
                    continue
                if hand.opts.garbage:
                    if frame[12:14] == ETHERTYPE_ECAT.to_bytes(2, "big"):
                        for out in garbage_replies(frame):
                            raw.send(out)
                        stats.frames += 1
                    continue
                now = mono()
                rx = _rx_time(anc, now, to_mono)
                payload, delay_us = hand.handle(frame[ETH_HEADER_LEN:], rx)
                if payload is not None and hand.late_ns:
                    out = reply_frame(frame, payload)
                    for _ in range(hand.copies):
                        order += 1
                        heapq.heappush(later, (rx + hand.late_ns, order, out))
                elif payload is not None:
                    if delay_us:
                        time.sleep(delay_us / 1e6)
                    out = reply_frame(frame, payload)
                    if by_index is not None:
                        index = frame[ETH_HEADER_LEN + 3]  # EtherCAT header (2), command (1), then the index
                        old = by_index.get(index)
                        if hand.stale_first and old is not None:
                            raw.send(old)  # the stale reply first, as if it had been held up this long
                            stats.stale_replies += 1
                        by_index[index] = out
                    raw.send(out)
                    if hand.copies > 1:  # a duplicate: the same reply again, right behind the first
                        raw.send(out)
                    waited = (mono() - rx) // 1000
                    hist[min(waited, last_bin)] += 1
                    if waited > stats.answer_max_us:
                        stats.answer_max_us = waited
                hand.firmware.after_frame(rx)
                answered = True
            if answered:
                since_gc += 1
                if since_gc >= GC_EVERY_FRAMES:
                    since_gc = 0
                    gc.collect(0)
                continue  # look for frames again before serving control
            if ctl is not None and ctl in ready:
                _serve_control(hand, ctl)
    finally:
        raw.close()
        if ctl is not None:
            ctl.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(control_path or "")


def _serve_control(hand: VirtualHand, ctl: socket.socket) -> None:
    try:
        data, addr = ctl.recvfrom(65536)
    except BlockingIOError:
        return
    try:
        reply = hand.control(json.loads(data))
    except (ValueError, TypeError) as exc:
        reply = {"ok": False, "error": str(exc)}
    if addr:
        with contextlib.suppress(OSError):
            ctl.sendto(json.dumps(reply).encode(), addr)


class HandControl:
    """Client of the control socket (tests, bench, CLI)."""

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.path = path
        self.timeout = timeout

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="rbvh-") as d, \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(os.path.join(d, "c.sock"))
            s.settimeout(self.timeout)
            s.sendto(json.dumps({"op": op, **kw}).encode(), self.path)
            reply: dict[str, Any] = json.loads(s.recv(1 << 20))
            return reply

    def wait_ready(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call("stats")
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def set_realtime(priority: int) -> str | None:
    """SCHED_FIFO + mlockall for the hand process; returns a warning instead of failing."""
    if priority <= 0:
        return None
    warnings = apply_realtime(RtSettings(priority=priority))
    return "; ".join(warnings) + " (the virtual hand)" if warnings else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ethercat_loop.sim.virtual_hand",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--iface", required=True, help="interface to answer on (one end of a veth pair)")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="0220")
    p.add_argument("--serial", type=int, default=DEFAULT_SERIAL)
    p.add_argument("--vendor", type=lambda s: int(s, 0), default=DEFAULT_VENDOR)
    p.add_argument("--revision", type=lambda s: int(s, 0), default=DEFAULT_REVISION)
    p.add_argument("--left", action="store_true", help="0230: the left hand's product code")
    p.add_argument("--no-sii-pd", action="store_true", help="palm SII without SyncManager/PDO categories")
    p.add_argument("--status-size-delta", type=int, default=0, help="declare a wrong status size in the SII")
    p.add_argument("--model", default="services.ethercat_loop.palm_model:PalmModel",
                   help="palm model factory module:name")
    p.add_argument("--control", help="UNIX datagram socket for fault injection and stats")
    p.add_argument("--drop-every", type=int, default=0, help="drop every Nth process-data frame")
    p.add_argument("--delay-every", type=int, default=0, help="delay every Nth process-data frame")
    p.add_argument("--delay-us", type=int, default=3000)
    p.add_argument("--rt-priority", type=int, default=0, help="SCHED_FIFO priority for the hand (0: normal)")
    p.add_argument("--cpus", default="", help="CPU affinity of the hand, e.g. 1 or 0,1 (default: any)")
    p.add_argument("--watch", help="OFFSET:LENGTH of the command bytes whose changes are logged (default: all)")
    p.add_argument("--lose-fmmu-replies", type=int, default=0,
                   help="lose the replies to the first N FMMU register writes (FPWR), as a flaky link would")
    p.add_argument("--answer-twice", action="store_true",
                   help="answer every process-data frame twice (a stale duplicate behind each reply)")
    p.add_argument("--late-us", type=int, default=0,
                   help="send every process-data reply this late (scheduled: the frames behind it are not held up)")
    p.add_argument("--stale-sii-reply", type=lambda s: int(s, 0), default=-1, metavar="WORD",
                   help="answer the first read of the palm's SII data register for the block holding WORD behind a "
                        "stale reply (the last one sent under the same datagram index), as a stalled hand would")
    p.add_argument("--stall-at-frame", type=int, default=0, metavar="N",
                   help="stall --stall-ms before the Nth frame (the frames behind it queue, then are all answered)")
    p.add_argument("--stall-ms", type=int, default=60)
    p.add_argument("--garbage", action="store_true",
                   help="no slave: answer every EtherCAT frame with garbage (a non-EtherCAT frame, random datagrams)")
    p.add_argument("--watch-stop", action="store_true",
                   help="stamp the first all-zero demand frame (the bus stop's bytes) and print it as one JSON line "
                        '({"event": "stop_bytes", "unix", "monotonic", ...}); SIGHUP re-arms the watch')
    p.add_argument("--fmmus-on-safeop", action="store_true",
                   help="FMMUs take effect only on the PRE-OP -> SAFE-OP transition (as some slaves do)")
    a = p.parse_args(argv)
    watch: tuple[int, int] | None = None
    if a.watch:
        off, _, length = a.watch.partition(":")
        watch = (int(off, 0), int(length, 0))
    opts = HandOptions(a.protocol, a.serial, a.vendor, a.revision, a.left, not a.no_sii_pd, a.status_size_delta,
                       a.drop_every, a.delay_every, a.delay_us, watch, a.fmmus_on_safeop,
                       a.lose_fmmu_replies, a.answer_twice, a.late_us, a.garbage, a.stale_sii_reply,
                       a.stall_at_frame, a.stall_ms)
    hand = VirtualHand(opts, load_model(a.model, a.protocol))
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    warning = set_realtime(a.rt_priority)
    if warning:
        print(f"virtual_hand: warning: {warning}", file=sys.stderr, flush=True)
    stopping = False

    def on_term(_sig: int, _frm: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if a.watch_stop:
        hand.firmware.on_stamp = lambda stamp: print(json.dumps({"event": "stop_bytes", **stamp}), flush=True)
        hand.firmware.watch_stop()
        signal.signal(signal.SIGHUP, lambda _s, _f: hand.firmware.watch_stop())
    print(f"virtual_hand: {opts.protocol} palm (product {palm_product(opts):#x}, serial {opts.serial}) "
          f"behind the bridge on {a.iface}", flush=True)
    # what exists now lives for the whole run: out of the collector's sight; young collections only,
    # between frames (an untimed full collection could hold a frame for milliseconds)
    gc.collect()
    gc.freeze()
    gc.disable()
    serve(hand, a.iface, a.control, lambda: stopping)
    print(f"virtual_hand: stopped: {json.dumps(hand.snapshot())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
