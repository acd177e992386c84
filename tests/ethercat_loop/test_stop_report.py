"""The bus stop's report (stop_report.py `StopReport`) as a pure state machine: made-up times, made-up answers of the
latch and the cycle. Reported once the cycle sent the stop's first frame; sent again while the palm is in OP and
the cycle has not; an error after the grace, once, and still sent while it holds; nothing for a released stop."""

from __future__ import annotations

from services.ethercat_loop.stop_report import STOP_LATE_LOOK_S, StopReport, Verdict

T0 = 1000.0  # an arbitrary CLOCK_MONOTONIC, seconds
GEN = 7  # the latch's activation


def check(r: StopReport, now: float, *, active: bool = True, generation: int = GEN, sent_at_ns: int | None = None,
          connected: bool = True) -> Verdict:
    pending = r.pending
    assert pending is not None
    return r.check(pending, now, active=active, generation=generation, sent_at_ns=sent_at_ns, connected=connected)


def test_reported_once_the_cycle_sent_its_frame() -> None:
    r = StopReport(resend_s=0.1, grace_s=5.0)
    assert r.pending is None and r.look_again(T0) is None
    assert r.stop(T0, GEN) == 1
    assert r.look_again(T0) == T0 + 0.001  # a fresh stop: looked at every millisecond
    assert check(r, T0 + 0.0005) == Verdict()  # not sent yet, not due again
    assert check(r, T0 + 0.002, sent_at_ns=1_000_001_000_000) == Verdict(written_ns=1_000_001_000_000)
    assert r.pending is None  # reported: nothing more to do


def test_sent_again_while_in_op_and_unconfirmed() -> None:
    r = StopReport(resend_s=0.1, grace_s=5.0)
    seq = r.stop(T0, GEN)
    assert check(r, T0 + 0.05) == Verdict()
    assert check(r, T0 + 0.1) == Verdict(resend=seq)
    assert check(r, T0 + 0.15) == Verdict()  # the resend restarts the period
    assert check(r, T0 + 0.2) == Verdict(resend=seq)
    assert check(r, T0 + 0.5, connected=False) == Verdict()  # not in OP: a new cycle starts with zero demands


def test_an_error_after_the_grace_once_and_still_sent() -> None:
    r = StopReport(resend_s=0.1, grace_s=5.0)
    seq = r.stop(T0, GEN)
    v = check(r, T0 + 5.0, connected=False)
    assert v.resend is None and "not in OP" in v.error
    assert r.look_again(T0 + 5.0) == T0 + 5.0 + STOP_LATE_LOOK_S  # failed: looked at less often
    assert check(r, T0 + 6.0, connected=False) == Verdict()  # said once
    assert check(r, T0 + 7.0) == Verdict(resend=seq)  # the palm reached OP: the stop goes out again
    assert check(r, T0 + 7.01, sent_at_ns=5) == Verdict(written_ns=5)  # and its frame clears the error
    r2 = StopReport(resend_s=0.1, grace_s=5.0)
    r2.stop(T0, GEN)
    v = check(r2, T0 + 5.0)
    assert v.resend == 1 and "within 5 s" in v.error  # in OP, but the cycle never said so


def test_a_released_or_newer_stop_is_not_reported() -> None:
    r = StopReport()
    r.stop(T0, GEN)
    assert check(r, T0 + 1.0, active=False) == Verdict() and r.pending is None  # released: never sent again
    r.stop(T0, GEN)
    assert check(r, T0 + 1.0, generation=GEN + 1) == Verdict() and r.pending is None  # a stop of another activation
    r.stop(T0, GEN)
    old = r.pending
    assert old is not None
    r.stop(T0 + 0.5, GEN + 1)  # a newer stop came between the read and the check: it has its own report
    assert r.check(old, T0 + 1.0, active=True, generation=GEN, sent_at_ns=9, connected=True) == Verdict()
    newer = r.pending
    assert newer is not None and newer.seq == 4 and newer.generation == GEN + 1
