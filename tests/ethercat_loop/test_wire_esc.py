"""The software ESC without sockets: frame codec (byte vectors + hypothesis), SII images, datagram
addressing and working counters, SM/FMMU rules, the AL state machine, the SII interface, and the
cycle's deadline arithmetic and shared memory. No root needed."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ethercat_loop.loop_stats import HIST_US, percentiles
from services.ethercat_loop.protocol import PROTOCOLS
from services.ethercat_loop.sim.esc import (
    AL_CODE_INVALID_CHANGE,
    AL_CODE_INVALID_OUTPUT_CONFIG,
    INIT,
    OP,
    PREOP,
    SAFEOP,
    Esc,
    EscChain,
)
from services.ethercat_loop.sim.esc_frames import (
    Cmd,
    Datagram,
    Frame,
    FrameError,
    build_datagrams,
    build_frame,
    parse_datagrams,
    parse_frame,
)
from services.ethercat_loop.sim.esc_sii import CAT_RXPDO, CAT_TXPDO, build_sii, parse_sii
from services.ethercat_loop.sim.virtual_hand import HandOptions, VirtualHand, bridge_sii, build_chain, palm_sii
from services.ethercat_loop.transport.master import fmmu_register_block, sm_register_block
from services.ethercat_loop.transport.realtime import next_deadline
from services.ethercat_loop.transport.shm import SharedBlock
from tests.ethercat_loop.palm_fixtures import EchoPalm

# ---------------------------------------------------------------------------------------------- codec
# An APRD of 2 bytes at ADP 0, ADO 0x0130 (AL status), index 7, WKC 0, as SOEM sends it.
APRD_VECTOR = bytes.fromhex("0e10" "01" "07" "0000" "3001" "0200" "0000" "0000" "0000")


def test_parse_known_vector() -> None:
    (dg,) = parse_datagrams(APRD_VECTOR)
    assert (dg.cmd, dg.idx, dg.adp, dg.ado, bytes(dg.data), dg.wkc) == (Cmd.APRD, 7, 0, 0x0130, b"\0\0", 0)
    assert build_datagrams([dg]) == APRD_VECTOR


def test_two_datagrams_more_bit() -> None:
    a = Datagram(Cmd.FPRD, 1, 0x1001, 0x0130, bytearray(2))
    b = Datagram.make_logical(Cmd.LRW, 2, 0x10000, b"\x01\x02\x03", wkc=3)
    raw = build_datagrams([a, b])
    assert struct.unpack_from("<H", raw, 2 + 6)[0] & 0x8000  # first has "more"
    out = parse_datagrams(raw)
    assert [d.cmd for d in out] == [Cmd.FPRD, Cmd.LRW]
    assert out[1].logical == 0x10000 and out[1].wkc == 3 and bytes(out[1].data) == b"\x01\x02\x03"


def test_frame_padding_and_ethertype() -> None:
    f = Frame(b"\xff" * 6, b"\x01" * 6, [Datagram(Cmd.BRD, 0, 0, 0, bytearray(2))])
    raw = build_frame(f)
    assert len(raw) == 60 and raw[12:14] == b"\x88\xa4"
    assert parse_frame(raw).datagrams[0].cmd == Cmd.BRD
    with pytest.raises(FrameError):
        parse_frame(raw[:12] + b"\x08\x00" + raw[14:])


@pytest.mark.parametrize("bad", [b"", b"\x0e", bytes.fromhex("0e20") + APRD_VECTOR[2:], APRD_VECTOR[:-3],
                                 bytes.fromhex("ff17") + APRD_VECTOR[2:]])
def test_garbage_is_rejected(bad: bytes) -> None:
    with pytest.raises(FrameError):
        parse_datagrams(bad)


datagram_st = st.builds(
    Datagram, cmd=st.integers(0, 14), idx=st.integers(0, 255), adp=st.integers(0, 0xFFFF),
    ado=st.integers(0, 0xFFFF), data=st.binary(max_size=100).map(bytearray), wkc=st.integers(0, 0xFFFF),
    irq=st.integers(0, 0xFFFF), circulating=st.booleans(), extra=st.integers(0, 7))


@given(st.lists(datagram_st, min_size=1, max_size=8))
def test_roundtrip(dgs: list[Datagram]) -> None:
    raw = build_datagrams(dgs)
    assert parse_datagrams(raw) == dgs
    assert build_datagrams(parse_datagrams(raw)) == raw


@given(st.binary(max_size=200))
@settings(max_examples=300)
def test_parser_never_crashes(raw: bytes) -> None:
    try:
        parse_datagrams(raw)
    except FrameError:
        pass


# ---------------------------------------------------------------------------------------------- SII
@pytest.mark.parametrize("proto", ["0220", "0230"])
def test_palm_sii_identity_and_pdo_sizes(proto: str) -> None:
    opts = HandOptions(protocol=proto, serial=4321)
    info = parse_sii(build_sii(palm_sii(opts)))
    p = PROTOCOLS[proto]
    assert (info.vendor, info.product, info.serial) == (opts.vendor, p.product_codes[0], 4321)
    assert sum(info.pdo_bytes(CAT_RXPDO).values()) == p.command_size
    assert sum(info.pdo_bytes(CAT_TXPDO).values()) == p.status_size
    assert [(s.start, s.length, s.control) for s in info.sms()] == list(p.sync_managers)
    bridge = parse_sii(build_sii(bridge_sii(opts)))
    assert bridge.product == 0 and CAT_RXPDO not in bridge.categories


def test_palm_sii_without_process_data() -> None:
    info = parse_sii(build_sii(palm_sii(HandOptions(sii_process_data=False))))
    assert info.sms() == [] and info.pdo_bytes(CAT_TXPDO) == {}


# ---------------------------------------------------------------------------------------------- ESC
def _dg(cmd: int, adp: int, ado: int, data: bytes | int) -> Datagram:
    return Datagram(cmd, 0, adp, ado, bytearray(data if isinstance(data, bytes) else bytes(data)))


def _chain() -> tuple[EscChain, Esc, Esc]:
    return build_chain(HandOptions())


def test_auto_increment_and_station_address() -> None:
    chain, bridge, palm = _chain()
    # SOEM addresses slave n (1-based) with ADP = 1 - n
    chain.process([d := _dg(Cmd.APWR, 0xFFFF, 0x0010, struct.pack("<H", 0x1002))])
    assert d.wkc == 1 and palm.station_address == 0x1002 and bridge.station_address == 0
    assert d.adp == 1  # incremented by both slaves
    chain.process([r := _dg(Cmd.FPRD, 0x1002, 0x0010, 2)])
    assert r.wkc == 1 and bytes(r.data) == struct.pack("<H", 0x1002)
    chain.process([c := _dg(Cmd.BRD, 0, 0x0000, 1)])
    assert c.wkc == 2  # every slave counts: this is how a master counts slaves


def test_brd_ors_and_read_write_counts() -> None:
    chain, bridge, palm = _chain()
    chain.process([w := _dg(Cmd.BWR, 0, 0x0120, bytes([PREOP, 0]))])
    assert w.wkc == 2 and bridge.al_state == palm.al_state == PREOP
    bridge.fault(SAFEOP, 0x1B)
    chain.process([r := _dg(Cmd.BRD, 0, 0x0130, 2)])
    assert r.data[0] == (PREOP | SAFEOP | 0x10)  # the ORed states show that one slave differs
    chain.process([rw := _dg(Cmd.APRW, 0, 0x0012, struct.pack("<H", 0x55))])
    assert rw.wkc == 3 and bytes(rw.data) == b"\0\0"
    chain.process([x := _dg(Cmd.FPRD, 0x7777, 0x0130, 2)])
    assert x.wkc == 0  # nobody has that station address


def test_read_only_registers_and_al_state_machine() -> None:
    _, _, palm = _chain()
    palm.write(0x0130, bytes([OP, 0]))  # AL status is read-only for the master
    assert palm.al_state == INIT
    palm.write(0x0120, bytes([OP, 0]))  # INIT -> OP is not a valid change
    assert palm.al_error and palm.mem[0x0134] == AL_CODE_INVALID_CHANGE and palm.al_state == INIT
    palm.write(0x0120, bytes([PREOP, 0]))  # not acknowledged: ignored
    assert palm.al_state == INIT
    palm.write(0x0120, bytes([PREOP | 0x10, 0]))
    assert palm.al_state == PREOP and not palm.al_error
    palm.write(0x0120, bytes([SAFEOP, 0]))  # SMs not programmed: the firmware refuses SAFE-OP
    assert palm.al_state == PREOP and palm.al_error and palm.mem[0x0134] == AL_CODE_INVALID_OUTPUT_CONFIG


def test_sii_interface_reads_words() -> None:
    _, _, palm = _chain()
    palm.write(0x0502, struct.pack("<HI", 0x0100, 0x0A))  # read command at word 0x0A (product code)
    ctl = struct.unpack_from("<H", palm.mem, 0x0502)[0]
    assert not ctl & 0x8000 and ctl & 0x0040  # not busy; 8-byte reads
    product, revision = struct.unpack_from("<II", palm.mem, 0x0508)
    assert (product, revision) == (6, 1)


def _program(palm: Esc, proto: str = "0220") -> None:
    info = PROTOCOLS[proto]
    for n, (a, ln, c) in enumerate(info.sync_managers):
        palm.write(0x0800 + 8 * n, sm_register_block(a, ln, c))
    palm.write(0x0600, fmmu_register_block(0x10000, info.command_size, 0x1000, True))
    palm.write(0x0610, fmmu_register_block(0x10000 + info.command_size, info.status_size,
                                           info.sync_managers[2][0], False))
    for state in (PREOP, SAFEOP, OP):
        palm.write(0x0120, bytes([state, 0]))


def test_lrw_through_fmmus_and_sm_rules() -> None:
    chain, bridge, palm = _chain()
    _program(palm)
    for state in (PREOP, SAFEOP, OP):
        bridge.write(0x0120, bytes([state, 0]))
    assert palm.al_state == OP
    palm.pdi_write(0x1046, b"\xaa" * 232)  # the firmware loaded a status
    cmd = bytes(range(70))
    chain.process([d := Datagram.make_logical(Cmd.LRW, 0, 0x10000, cmd + bytes(232))])
    assert d.wkc == 3 and bytes(d.data[70:]) == b"\xaa" * 232
    assert palm.pdi_read(0x1000, 70) == cmd and palm.take_sm_events() == {0, 1}
    palm.fault(SAFEOP, 0x1B)  # out of OP: outputs refused, inputs still read
    chain.process([d2 := Datagram.make_logical(Cmd.LRW, 0, 0x10000, bytes(302))])
    assert d2.wkc == 1
    # the master may not write into the status mailbox, nor read the command mailbox
    assert palm.write(0x1046, b"\x01") is False and palm.read(0x1000, 2) is None


def test_virtual_hand_runs_the_firmware_once_per_command() -> None:
    hand = VirtualHand(HandOptions(), EchoPalm("0220"))
    _program(hand.palm)
    for state in (PREOP, SAFEOP, OP):
        hand.bridge.write(0x0120, bytes([state, 0]))
    frame = build_datagrams([Datagram.make_logical(Cmd.LRW, 0, 0x10000, bytes(302))])
    reply, delay = hand.handle(frame, 1)
    assert reply is not None and delay == 0 and parse_datagrams(reply)[0].wkc == 3
    hand.firmware.after_frame(1)
    assert hand.stats.palm_cycles == 1
    hand.control({"op": "drop", "n": 1})
    assert hand.handle(frame, 2) == (None, 0) and hand.stats.dropped == 1
    hand.control({"op": "corrupt_wkc"})
    reply, _ = hand.handle(frame, 3)
    assert reply is not None and parse_datagrams(reply)[0].wkc != 3
    hand.control({"op": "leave_op"})
    assert hand.stats.left_op == 1 and hand.palm.al_error
    assert hand.control({"op": "nonsense"})["ok"] is False


# ---------------------------------------------------------------------------------------------- cycle maths
def test_next_deadline_skips_to_boundary() -> None:
    # (release, start, end, period)
    assert next_deadline(1000, 1010, 1500, 1000) == (2000, 0)
    assert next_deadline(1000, 1010, 2300, 1000) == (2000, 0)  # ran past 2000: that release starts late
    assert next_deadline(1000, 1010, 3000, 1000) == (4000, 2)  # 2000 could not start in its period
    assert next_deadline(1000, 2100, 2300, 1000) == (3000, 1)  # woke a period late: an overrun, like cyclictest
    assert next_deadline(1000, 1010, 4700, 1000) == (5000, 3)  # boundaries stay on the 1000 grid


@given(st.integers(0, 10**12), st.integers(0, 10**7), st.integers(0, 10**7), st.integers(1, 10**7))
def test_next_deadline_properties(release: int, late: int, work: int, period: int) -> None:
    start = release + late
    now = start + work
    nxt, skipped = next_deadline(release, start, now, period)
    assert (nxt - release) % period == 0 and nxt > release
    if skipped == 0:  # no release lost: the next one, started at most a period late, and never early
        assert nxt == release + period and late < period and now - nxt < period
    else:  # every release up to now skipped, the next one is the first boundary in the future
        assert nxt > now and nxt - now <= period and skipped == (nxt - release) // period - 1
        assert late >= period or now >= release + 2 * period


def test_shared_block_slots_and_histograms() -> None:
    blk = SharedBlock.create()
    other = SharedBlock.open(blk.path)
    try:
        assert other.read_slot("snapshot") is None
        assert blk.write_slot("snapshot", b"hello")
        seq, data = other.read_slot("snapshot") or (0, b"")
        assert data == b"hello" and seq % 2 == 0
        assert not blk.write_slot("status", bytes(1 << 17))  # too big: refused, not truncated
        blk.counters[0] = 42
        assert other.get("cycles") == 42
        other.hist["wake"][[10, 10, 20, HIST_US]] = [5, 5, 4, 1]
        p = percentiles(blk.hist["wake"])
        assert p["p50"] == 10 and p["max"] == HIST_US and p["count"] == 10
    finally:
        other.close()
        blk.close()
    assert percentiles(np.zeros(5, np.int64))["p50"] is None


def test_overrun_ring_keeps_the_last_records_in_order() -> None:
    from services.ethercat_loop.transport.shm import OVERRUN_RING, C

    blk = SharedBlock.create()
    other = SharedBlock.open(blk.path)
    try:
        assert other.overruns() == []
        for n in range(OVERRUN_RING + 44):  # the cycle: record n, then count it
            blk.put_overrun(n, 1_000_000 * n, n, n + 1, n + 2, n + 3, 1, n % 2 == 0, False)
            blk.counters[C["overruns"]] = n + 1
        recs = other.overruns()
        assert len(recs) == OVERRUN_RING and recs[0]["release_ns"] == 44_000_000
        assert recs[-1] == {"release_ns": (OVERRUN_RING + 43) * 1_000_000, "wake_us": OVERRUN_RING + 43,
                            "sent_us": OVERRUN_RING + 44, "exchanged_us": OVERRUN_RING + 45,
                            "end_us": OVERRUN_RING + 46, "skipped": 1, "lost": False, "slack_work": False}
    finally:
        other.close()
        blk.close()


@given(st.dictionaries(st.integers(0, 300), st.integers(1, 50), min_size=1, max_size=40))
def test_percentiles_match_the_samples(bins: dict[int, int]) -> None:
    hist = np.zeros(301, np.int64)
    for us, n in bins.items():
        hist[us] = n
    samples = np.sort(np.repeat(np.arange(301), hist))
    p = percentiles(hist)
    for q in (0.5, 0.99, 0.999):  # the smallest bin holding at least q of the samples
        assert p[f"p{q * 100:g}"] == samples[max(0, int(np.ceil(q * len(samples))) - 1)]
    assert p["max"] == max(bins) and p["count"] == sum(bins.values())


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF),
                          st.binary(max_size=64)), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_esc_chain_survives_any_datagrams(items: list[tuple[int, int, int, bytes]]) -> None:
    """Whatever a master sends (any command, address, register, length), the line of ESCs answers
    without raising, keeps each datagram's length and only ever adds to its working counter."""
    chain, _bridge, _palm = _chain()
    dgs = [Datagram(cmd, 0, adp, ado, bytearray(data)) for cmd, adp, ado, data in items]
    before = [(len(d.data), d.wkc) for d in dgs]
    chain.process(dgs)
    for (n, wkc), d in zip(before, dgs, strict=True):
        assert len(d.data) == n and d.wkc >= wkc


def test_realtime_to_monotonic_offset_is_tight() -> None:
    """The virtual hand moves kernel receive timestamps (CLOCK_REALTIME) to CLOCK_MONOTONIC with this."""
    import time

    from services.ethercat_loop.sim.virtual_hand import realtime_minus_monotonic

    offs = [realtime_minus_monotonic() for _ in range(20)]
    assert max(offs) - min(offs) < 200_000  # the same offset within 0.2 ms, read after read
    assert abs(offs[0] - (time.clock_gettime_ns(time.CLOCK_REALTIME) - time.monotonic_ns())) < 5_000_000
