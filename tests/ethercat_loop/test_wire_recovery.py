"""Issue 19 on the real path (ProcessBackend -> pysoem -> veth -> virtual hand): a hand whose FMMUs take
effect only on PRE-OP -> SAFE-OP, power-cycled in the middle of a run, must be brought back to a correct
working counter within 1 s of its return, and must not look connected while it exchanges nothing valid."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.sim.virtual_hand import HandControl
from services.ethercat_loop.transport.process_backend import ProcessBackend
from tests.ethercat_loop.wire_fixtures import hand, wait_for

pytestmark = pytest.mark.root
FMMUS_ON_SAFEOP = ["--fmmus-on-safeop"]


@contextmanager
def backend(hand_args: tuple[str, ...] = (), **kw: Any) -> Iterator[tuple[ProcessBackend, HandControl]]:
    with hand("0220", [*FMMUS_ON_SAFEOP, *hand_args]) as (ns, ctl):
        b = ProcessBackend(EthercatSettings(backend="virtual", ethercat_ifname=ns.master_if, ethercat_netns=ns.name,
                                            ethercat_push_config_on_start=False, **kw))
        b.start()
        try:
            yield b, ctl
        finally:
            b.stop()


def steps(b: ProcessBackend) -> list[tuple[int, str]]:
    rec = b.info()["recovery"] or {}
    return [(int(t), str(text)) for t, text in rec.get("steps", [])]


def watch_outage(b: ProcessBackend, until: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Poll info() until `until()` holds; every distinct (connected, state, no_data) seen on the way."""
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = b.info()
        view = {"connected": info["connected"], "state": info["state"], "no_data": info["no_data"]}
        if not seen or seen[-1] != view:
            seen.append(view)
        if until():
            return seen
        time.sleep(0.005)
    raise AssertionError(f"timed out; saw {seen}; recovery {steps(b)}")


def test_power_cycle_with_fmmus_that_activate_on_safeop() -> None:
    with backend() as (b, ctl):
        wait_for(lambda: b.connected() and (b.snapshot() or None) is not None, what="valid process data")
        wkc0 = b.stats().totals or {}
        assert ctl.call("stats")["palm_state"] == 8
        ctl.call("power_cycle", off_ms=400)
        seen = watch_outage(b, lambda: ctl.call("stats")["powered"] and b.connected())
        # the outage was visible: not connected, no valid data, a state other than OP
        assert any(not v["connected"] and v["no_data"] and v["state"] in ("no_data", "recovering") for v in seen), seen
        on_ns = ctl.call("stats")["powered_on_ns"]
        assert on_ns > 0
        # the episode's end is noted at the next state check once valid data flow (within 10 cycles)
        end = time.monotonic() + 5
        while not any(s.startswith("valid process data again") and t >= on_ns for t, s in steps(b)):
            if time.monotonic() > end:
                break
            time.sleep(0.01)
        log = steps(b)
        texts = [t for _, t in log]
        back = [t for t, text in log if text.startswith("valid process data again") and t >= on_ns]
        assert back, " | ".join(f"{(t - on_ns) / 1e6:.0f} ms: {text}" for t, text in log)
        assert back[0] - on_ns < 1_000_000_000, f"{(back[0] - on_ns) / 1e6:.0f} ms after the hand's return: {texts}"
        # the ladder, in the order a standard ESC expects: SMs before PRE-OP, FMMUs before SAFE-OP
        order = [next(i for i, t in enumerate(texts) if t.startswith(s)) for s in
                 ("step init", "step preop: SyncManagers written", "step safeop: FMMUs written", "step op",
                  "valid process data again")]
        assert order == sorted(order), texts
        # and the process data are valid again: the palm is cycling, the working counter is right
        cycles = ctl.call("stats")["palm_cycles"]
        wait_for(lambda: ctl.call("stats")["palm_cycles"] > cycles + 100, what="the palm cycling again")
        t = b.stats().totals or {}
        time.sleep(0.3)
        t2 = b.stats().totals or {}
        # (a lost frame now and then is this shared machine's scheduling, not the hand: not asserted)
        assert t2["wkc_errors"] == t["wkc_errors"] and b.connected(), (t, t2)
        assert t2["escalations"] >= 1 and t2["cycles"] > wkc0.get("cycles", 0)
        assert b.info()["state"] == "op" and not b.info()["issue"]


def _after_power_cycle_with_lost_fmmu_replies(lost: int) -> list[str]:
    """Power-cycle the hand, lose the replies to the next `lost` FMMU writes (written all the same, as an ESC
    acts on a frame as it passes: what a late reply on a stalled host looks like to the master), and return
    the recovery's steps once valid process data are back."""
    with backend() as (b, ctl):
        wait_for(lambda: b.connected() and (b.snapshot() or None) is not None, what="valid process data")
        ctl.call("power_cycle", off_ms=300)
        ctl.call("lose_fmmu_replies", n=lost)
        watch_outage(b, lambda: any(t.startswith("valid process data again") for _, t in steps(b))
                     and b.connected())
        assert ctl.call("stats")["dropped"] >= lost  # every reply the test meant to lose was lost
        assert b.info()["state"] == "op" and not b.info()["issue"]
        return [t for _, t in steps(b)]


def test_a_ladder_write_not_acknowledged_is_written_again() -> None:
    texts = _after_power_cycle_with_lost_fmmu_replies(2)
    order = [next(i for i, t in enumerate(texts) if t.startswith(s)) for s in
             ("step init", "step safeop: a write was not acknowledged; writing again", "step safeop: FMMUs written",
              "step op", "valid process data again")]
    assert order == sorted(order), texts
    assert not [t for t in texts if "looking for it again" in t], texts


def test_a_ladder_whose_writes_are_not_taken_goes_to_find_the_slave_then_recovers() -> None:
    # more lost replies than write_retry_ns (100 ms, a write every 10 ms) rewrites: the ladder leaves to find the
    # slave, a later ladder takes the hand to OP, and the episode's end is noted after it
    texts = _after_power_cycle_with_lost_fmmu_replies(15)
    gave_up = next(i for i, t in enumerate(texts) if t.startswith("step safeop: a slave did not take the write for"))
    back = max(i for i, t in enumerate(texts) if t.startswith("valid process data again"))
    assert gave_up < back, texts


def test_ladders_whose_writes_are_never_taken_end_in_a_re_scan() -> None:
    # a slave that takes no ladder's writes would send the recovery round the ladder for ever: after 4 ladders
    # left to find it in one episode, the whole bring-up again (SOEM resends its own configuration writes)
    texts = _after_power_cycle_with_lost_fmmu_replies(60)
    assert len([t for t in texts if "did not take the write" in t]) == 4, texts
    rescan = texts.index("full re-scan: the ladder's writes were not taken 4 times")
    done = next(i for i, t in enumerate(texts) if t.startswith("re-scan done"))
    assert rescan < done < max(i for i, t in enumerate(texts) if t.startswith("valid process data again")), texts


def test_wrong_working_counter_while_every_slave_claims_op_escalates() -> None:
    with backend() as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        ctl.call("fmmus_off")  # the palm stays in OP, its FMMUs stop mapping: WKC 0 every cycle
        seen = watch_outage(b, lambda: any(t.startswith("valid process data again") for _, t in steps(b))
                            and b.connected())
        assert any(not v["connected"] for v in seen), seen
        texts = [t for _, t in steps(b)]
        assert any("while every slave reports OP" in t for t in texts), texts
        assert ctl.call("stats")["palm_state"] == 8


def test_a_palm_back_with_another_serial_is_rescanned() -> None:
    with backend() as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        assert b.info()["serial"] == 1234
        ctl.call("power_cycle", off_ms=200, serial=4321)
        wait_for(lambda: b.info()["serial"] == 4321 and b.connected(), timeout=30,
                 what=f"re-scan with the new identity (recovery {steps(b)})")
        texts = [t for _, t in steps(b)]
        assert any(t.startswith("full re-scan: the palm came back with serial 4321") for t in texts), texts
        assert any(t.startswith("re-scan done") for t in texts), texts
        assert (b.stats().totals or {}).get("cycles", 0) > 0


# An SII word in the palm's TxPDO category (category 50 at word 0x8D): a stale block there changes the status size
# SOEM derives (238 B instead of 232 B with the stale reply SOEM's 16 datagram indices line up with).
STALE_SII_WORD = 0x101
# A frame of the scan's SII reads (some 460 frames from config_init to OP), and a stall long enough for SOEM to give
# up on more than 16 datagrams (2 ms each): what a hand starved of CPU does at bring-up
STALL = ("--stall-at-frame", "300", "--stall-ms", "60")


def scan_notes(b: ProcessBackend) -> list[str]:
    return [t for _, t in steps(b) if t.startswith("scan ")]


def test_a_hand_stalled_during_the_scan_is_scanned_again_not_refused() -> None:
    """The hand stalls in the middle of the scan (starved of CPU) and then answers every queued frame: SOEM takes
    late replies whose datagram index was reused since for the answers it waits for, and derives a wrong mapping
    (or names, or identities) from them. The master sees replies come back late and scans again with a fresh
    master, instead of refusing the palm for a size it does not declare."""
    with backend(STALL) as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        assert ctl.call("stats")["stalls"] == 1
        info = b.info()
        assert info["mapping"] == "sii" and info["state"] == "op" and info["serial"] == 1234, info
        # (under load the scan may also see late replies elsewhere: more than one scan is fine, a refusal is not)
        assert all("not trusted" in t for t in scan_notes(b)), steps(b)


def test_a_stale_reply_to_an_sii_read_at_bring_up_is_caught_and_the_bus_scanned_again() -> None:
    """A stale reply, carrying the index the master now waits on, arrives ahead of the answer to an SII read: SOEM
    takes it for the SII block it asked for, so config_map derives a wrong status size. The master reads the SII
    again, sees that the scan was fooled and scans again, instead of refusing the hand."""
    with backend(("--stale-sii-reply", str(STALE_SII_WORD))) as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        assert ctl.call("stats")["stale_replies"] == 1
        info = b.info()
        assert info["mapping"] == "sii" and info["state"] == "op", info
        notes = scan_notes(b)
        # the stale block lands where it changes the size unless a frame SOEM timed out on (load) shifted which
        # reply was stale: then the scan may not have been fooled, or was caught by its late replies
        assert all("not trusted" in t for t in notes), notes
        disagreed = [t for t in notes if "the SII disagrees" in t]
        assert not disagreed or "the SII read again declares 70 B + 232 B" in disagreed[0], notes


def test_an_outage_is_named_while_the_slave_is_absent_and_measured_from_its_last_valid_data() -> None:
    """A power cycle of 2 s: the recovery episode is named while the hand is still off (its first step, from the
    moment the data stopped), and its closing line measures the outage, from the last valid data to the first
    valid data again, not from the first step the recovery took (it said 114 ms of a 3.9 s outage)."""
    with backend() as (b, ctl):
        wait_for(lambda: b.connected(), what="valid process data")
        seen: list[tuple[int, int]] = []  # (raw slot sequence, the cycle's stamp) of each newest valid status seen
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seq, at = b.last_valid_status()
                if at is not None and (not seen or seq != seen[-1][0]):
                    seen.append((seq, round(at * 1e9)))
                time.sleep(0.002)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            ctl.call("power_cycle", off_ms=2000)
            wait_for(lambda: any(s.startswith("outage: no valid process data") for _, s in steps(b)), 10,
                     "the outage named")
            assert not ctl.call("stats")["powered"], f"named only once the hand was back: {steps(b)}"
            wait_for(lambda: any(s.startswith("valid process data again after") for _, s in steps(b)), 20,
                     "the episode's end")
        finally:
            done.set()
            t.join(2)
        end = next(s for _, s in steps(b) if s.startswith("valid process data again after"))
        took_ns = int(end.split("after ")[1].split(" ms")[0]) * 1_000_000
        gap = max(range(1, len(seen)), key=lambda i: seen[i][1] - seen[i - 1][1])
        last = seen[gap - 1][1]  # exact: the newest stamp all through the outage
        # the first valid status again: the one seen, less the statuses (two sequence steps each, one a period) that
        # came after it before the watcher looked
        first = seen[gap][1] - ((seen[gap][0] - seen[gap - 1][0]) // 2 - 1) * 1_000_000
        assert first - last > 2_000_000_000, (first - last) / 1e6
        # the master's "valid" is a frame with the full working counter; the palm's first answers after power-on
        # can be empty mailboxes (dropped statuses: not in the count above), a few tens of ms at most; and on a busy
        # host the cycle's late periods make the count of statuses undercount the time, putting `first` later (51 ms
        # beside a CPU hog and six test processes). The defect this guards against was off by seconds.
        assert -150_000_000 <= took_ns - (first - last) <= 5_000_000, (
            f"outage measured {took_ns / 1e6:.0f} ms, {(first - last) / 1e6:.0f} ms from the last valid data to the "
            f"first again: {steps(b)}")
