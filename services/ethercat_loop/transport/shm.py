"""Shared memory between the cycle process and the MQTT process, without locks the cycle could
wait on: counters and histograms the cycle increments in place (the reader tolerates a counter
being one cycle stale), and latest-value slots guarded by a sequence counter (a seqlock: the writer
makes the sequence odd while writing; a reader retries if it saw an odd or changed sequence).

The block has one owner, the MQTT process: it makes the block (an anonymous memory file, `memfd_create`: no
name in /dev/shm, nothing anyone must unlink) and hands its descriptor to every cycle process it starts, which
maps it and closes the descriptor. The memory goes when the last process that maps it ends, however it ends
(kill -9 of either included); no cycle process, late, stopped or dying, can take it from the next one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from services.ethercat_loop.loop_stats import HIST_US

COUNTERS = (
    "cycles", "overruns", "skipped_cycles", "frames", "lost", "late", "wkc_errors", "no_status", "recoveries",
    "left_op", "consecutive_no_status", "max_consecutive_no_status", "cpu_ns_sum", "cpu_ns_max", "wake_ns_max",
    "rtt_ns_max", "commands_applied", "snapshots", "state_checks", "period_ns",
    "started_ns", "heartbeat_ns", "in_op", "health_error", "events_dropped",
    "dropped", "decode_errors",  # the driver's dropped statuses (an empty palm mailbox: a valid frame, no data)
    # what the overrunning cycles had in common (a cycle can count in several)
    "overrun_late_wake", "overrun_slow_exchange", "overrun_lost_frame", "overrun_slack_work",
    "escalations", "rescans",  # recovery: INIT -> OP ladders started, full re-scans
    "late_starts",  # cycles started late (by less than a period) because the one before ran past their release
    "outages",  # runs of error_after_lost cycles without a valid status (motors cut out), counted as they begin
    "stale",  # replies that did not belong to the frame just sent (dropped; not the same as lost frames)
    "submits",  # by the MQTT side: control messages written whole to the pipe (the cycle reads it when this moved)
    # the bus stop (control.BusStop): when the first frame built after stop number `stop_seq` left (CLOCK_MONOTONIC
    # ns); written by the cycle, time first, only in a cycle that applied control messages
    "stop_sent_ns", "stop_seq",
    "superseded",  # SetDemands dropped from a backlog read in one cycle: newer ones set all their motors again
)
C = {name: i for i, name in enumerate(COUNTERS)}
N_COUNTERS = 64
HISTOGRAMS = ("wake", "cpu", "rtt", "command")  # command: submit() on the MQTT side -> its frame sent
SLOTS = {"snapshot": 1 << 20, "status": 1 << 16, "info": 1 << 16, "raw": 1 << 12}
RAW_HEAD = struct.Struct("<QQQ")  # driver cycle, CLOCK_MONOTONIC ns, statuses accepted; then the status bytes
_SEQ = struct.Struct("<QI")  # sequence, payload length
# a ring of fixed-size overrun records, written in place by the cycle (no serialising on its path): the
# record of overrun n (0-based) is at n % OVERRUN_RING; the "overruns" counter says how many there were
OVERRUN_RING = 256
# exchanged_us: the reply to the previous release's frame read; sent_us: this release's command sent (after it)
OVERRUN_FIELDS = ("release_ns", "wake_us", "sent_us", "exchanged_us", "end_us", "skipped", "lost", "slack_work")
OVERRUN_REC = struct.Struct("<qqqqqq??")


def _layout() -> tuple[dict[str, tuple[int, int]], int]:
    regions: dict[str, tuple[int, int]] = {"counters": (0, 8 * N_COUNTERS)}
    off = 8 * N_COUNTERS
    for h in HISTOGRAMS:
        regions[h] = (off, 8 * (HIST_US + 1))
        off += 8 * (HIST_US + 1)
    for name, size in SLOTS.items():
        regions[name] = (off, _SEQ.size + size)
        off += _SEQ.size + size
    regions["overrun_ring"] = (off, OVERRUN_REC.size * OVERRUN_RING)
    off += OVERRUN_REC.size * OVERRUN_RING
    return regions, off


REGIONS, TOTAL = _layout()


class SharedBlock:
    """Create with `SharedBlock.create()` (the owner: the MQTT process), attach with `SharedBlock.attach(fd)` (a cycle
    process, given the owner's `fd`) or `SharedBlock.open(path)` (another process: `/proc/<pid>/fd/<fd>`)."""

    def __init__(self, fd: int, owner: bool = False) -> None:
        """Map the block open at `fd`. The owner keeps `fd` (to hand to the next cycle process) until `close`; an
        attached block closes it at once: the mapping holds the memory."""
        self.owner = owner
        self.fd = fd if owner else -1
        self.path = f"/proc/{os.getpid()}/fd/{fd}" if owner else ""
        try:
            self.mm = mmap.mmap(fd, TOTAL)
        finally:
            if not owner:
                os.close(fd)
        off, _size = REGIONS["counters"]
        self.counters: npt.NDArray[np.int64] = np.frombuffer(self.mm, np.int64, N_COUNTERS, off)
        self.hist: dict[str, npt.NDArray[np.int64]] = {
            h: np.frombuffer(self.mm, np.int64, HIST_US + 1, REGIONS[h][0]) for h in HISTOGRAMS}
        # the same memory as plain int64 memoryviews, for the cycle's writes: an item update costs a
        # third of a numpy one (numpy scalars), and the cycle does ~25 a period
        mv = memoryview(self.mm)
        self.counters_mv = mv[off : off + 8 * N_COUNTERS].cast("q")
        self.hist_mv = {h: mv[REGIONS[h][0] : REGIONS[h][0] + 8 * (HIST_US + 1)].cast("q") for h in HISTOGRAMS}
        self._mv = mv

    @classmethod
    def create(cls) -> SharedBlock:
        fd = os.memfd_create("robobus-ecat", os.MFD_CLOEXEC)  # not inherited but where handed on (pass_fds)
        try:
            os.ftruncate(fd, TOTAL)
            return cls(fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> SharedBlock:
        return cls(fd)

    @classmethod
    def open(cls, path: str) -> SharedBlock:
        return cls(os.open(path, os.O_RDWR))

    def close(self) -> None:
        # numpy views pin the buffer: drop them before closing the mapping
        self.counters = np.zeros(0, np.int64)
        self.hist = {}
        for view in (self.counters_mv, *self.hist_mv.values(), self._mv):
            view.release()
        self.hist_mv = {}
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- seqlock slots --------------------------------------------------------------------
    def write_slot(self, name: str, payload: bytes) -> bool:
        off, size = REGIONS[name]
        if len(payload) > size - _SEQ.size:
            return False
        seq, _ = _SEQ.unpack_from(self.mm, off)
        _SEQ.pack_into(self.mm, off, seq + 1, len(payload))  # odd: write in progress
        self.mm[off + _SEQ.size : off + _SEQ.size + len(payload)] = payload
        _SEQ.pack_into(self.mm, off, seq + 2, len(payload))
        return True

    def repair_slots(self) -> None:
        """Empty every slot left mid-write: a writer killed there leaves its sequence odd, and readers would wait
        for that write forever (sequence 0: nothing written; the next write starts it again). Only while no
        writer runs (the MQTT side, between two cycle processes)."""
        for name in SLOTS:
            off = REGIONS[name][0]
            if _SEQ.unpack_from(self.mm, off)[0] & 1:
                _SEQ.pack_into(self.mm, off, 0, 0)

    def raw_writer(self) -> Callable[[int, int, int, bytes], bool]:
        """The raw slot's writer: RAW_HEAD (cycle, now_ns, statuses) and the status bytes under the seqlock, with
        the slot's offsets bound once (the cycle's raw status, every period)."""
        off, size = REGIONS["raw"]
        mm, seq_pack, seq_unpack, head_pack = self.mm, _SEQ.pack_into, _SEQ.unpack_from, RAW_HEAD.pack_into
        at_head, at_body, room = off + _SEQ.size, off + _SEQ.size + RAW_HEAD.size, size - _SEQ.size - RAW_HEAD.size

        def write(cycle: int, now_ns: int, statuses: int, body: bytes) -> bool:
            n = len(body)
            if n > room:
                return False
            seq = seq_unpack(mm, off)[0]
            seq_pack(mm, off, seq + 1, RAW_HEAD.size + n)  # odd: write in progress
            head_pack(mm, at_head, cycle, now_ns, statuses)
            mm[at_body : at_body + n] = body
            seq_pack(mm, off, seq + 2, RAW_HEAD.size + n)
            return True

        return write

    def seq(self, name: str) -> int:
        """The slot's sequence as it stands (no copy): a reader compares it with the sequence of its last
        read to skip reading a slot that has not changed."""
        return int(_SEQ.unpack_from(self.mm, REGIONS[name][0])[0])

    def raw_stamp(self, retries: int = 50) -> tuple[int, int] | None:
        """(sequence, CLOCK_MONOTONIC ns) of the newest raw status: its sequence, and when the cycle took it off the
        wire (RAW_HEAD's time: the release at which the cycle read the reply). None before the first. A consistent
        read of 24 bytes, no copy of the status."""
        off = REGIONS["raw"][0]
        for _ in range(retries):
            seq = _SEQ.unpack_from(self.mm, off)[0]
            if seq == 0:
                return None
            if seq & 1:
                continue
            at_ns = RAW_HEAD.unpack_from(self.mm, off + _SEQ.size)[1]
            if _SEQ.unpack_from(self.mm, off)[0] == seq:
                return int(seq), int(at_ns)
        return None

    def read_slot(self, name: str, retries: int = 50) -> tuple[int, bytes] | None:
        """(sequence, payload) of a consistent read, or None if nothing was ever written."""
        off, _size = REGIONS[name]
        for _ in range(retries):
            seq, n = _SEQ.unpack_from(self.mm, off)
            if seq == 0:
                return None
            if seq & 1:
                continue
            data = bytes(self.mm[off + _SEQ.size : off + _SEQ.size + n])
            seq2, _ = _SEQ.unpack_from(self.mm, off)
            if seq2 == seq:
                return seq, data
        return None

    # ---- overrun records --------------------------------------------------------------------
    def put_overrun(self, n: int, *record: int | bool) -> None:
        """Record overrun number `n` (before the "overruns" counter moves past it)."""
        OVERRUN_REC.pack_into(self.mm, REGIONS["overrun_ring"][0] + (n % OVERRUN_RING) * OVERRUN_REC.size, *record)

    def overruns(self) -> list[dict[str, int | bool]]:
        """The last OVERRUN_RING overrun records, oldest first (a record being rewritten as we read may
        come out torn: a diagnostic, not a contract)."""
        count = self.get("overruns")
        base = REGIONS["overrun_ring"][0]
        return [dict(zip(OVERRUN_FIELDS, OVERRUN_REC.unpack_from(self.mm, base + (n % OVERRUN_RING) * OVERRUN_REC.size),
                         strict=True))
                for n in range(max(0, count - OVERRUN_RING), count)]

    # ---- counters -------------------------------------------------------------------------
    def get(self, name: str) -> int:
        return int(self.counters[C[name]])

    def counters_dict(self) -> dict[str, int]:
        vals = self.counters.copy()
        return {name: int(vals[i]) for name, i in C.items()}
