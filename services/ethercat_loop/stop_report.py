"""The bus stop's report (docs/kit.md, "Stopping everything") as a pure state machine: no I/O, no clock (every
time is passed in, CLOCK_MONOTONIC seconds).

`PalmService` sends a `BusStop` down the control pipe when the stop comes (`stop`: its number), then, on its
publisher thread, gives `check` what it reads: the node's stop latch, when the cycle says the stop's first frame
left, whether the palm is in OP. The answer says what to do: report the frame's time (`written_ns`), send the
stop again (`resend`: a cycle process that died took it along, or the palm was not in OP yet), or report that no
frame carried it (`error`, after `grace_s`). A stop reported as failed is still sent while it holds: a palm that
reaches OP late reports its first stopped frame then, which clears the error. A released stop is never sent
again (a BusStop forgets the demands held: after the release those are new ones).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

STOP_RESEND_S = 0.1  # a BusStop the cycle has not confirmed is sent again this often
STOP_WRITE_GRACE_S = 5.0  # the write is reported as failed after this long without a frame carrying it
STOP_LATE_LOOK_S = 0.02  # how often a stop reported as failed is looked at again (not the 1 ms of a fresh one)


@dataclass(frozen=True)
class Pending:
    """The last stop submitted, not yet confirmed by the cycle."""

    seq: int  # the BusStop's number
    since: float  # submitted at
    sent: float  # last sent at
    generation: int  # the stop latch's activation it belongs to
    failed: bool = False  # reported as failed (no frame within the grace)


@dataclass(frozen=True)
class Verdict:
    written_ns: int | None = None  # report the stop written: its first frame left at this CLOCK_MONOTONIC ns
    resend: int | None = None  # send the BusStop with this number again
    error: str = ""  # report the stop as not written, with this reason


NOTHING = Verdict()


class StopReport:
    """Tracks the palm's last bus stop until a frame carried it (or it was released). Thread-safe: `stop` comes on
    the MQTT network thread, `check` on the publisher's."""

    def __init__(self, resend_s: float = STOP_RESEND_S, grace_s: float = STOP_WRITE_GRACE_S) -> None:
        self.resend_s = resend_s
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: Pending | None = None

    @property
    def pending(self) -> Pending | None:
        return self._pending

    def stop(self, now: float, generation: int) -> int:
        """A stop came (activation `generation` of the latch): the number of the BusStop to send."""
        with self._lock:
            self._seq += 1
            self._pending = Pending(self._seq, now, now, generation)
            return self._seq

    def look_again(self, now: float) -> float | None:
        """When the publisher should check again (None: nothing to report)."""
        pending = self._pending
        if pending is None:
            return None
        return now + (STOP_LATE_LOOK_S if pending.failed else 0.001)

    def check(self, pending: Pending, now: float, *, active: bool, generation: int, sent_at_ns: int | None,
              connected: bool) -> Verdict:
        """`pending` as read before the observations: the latch (`active`, `generation`), when the cycle sent the
        stop's first frame (`sent_at_ns`, None: not yet), whether the palm is in OP. A newer stop that came in
        between has its own report: this one is dropped."""
        if not active or generation != pending.generation:
            self._replace(pending, None)  # released (or a newer stop, with its own pending)
            return NOTHING
        if sent_at_ns is not None:
            return Verdict(written_ns=sent_at_ns) if self._replace(pending, None) else NOTHING
        resend = connected and now - pending.sent >= self.resend_s
        give_up = not pending.failed and now - pending.since >= self.grace_s
        if not (resend or give_up):
            return NOTHING
        if not self._replace(pending, replace(pending, sent=now if resend else pending.sent,
                                              failed=pending.failed or give_up)):
            return NOTHING
        error = ""
        if give_up:
            error = (f"the cycle did not report the stop's frame within {self.grace_s:.0f} s" if connected else
                     "the palm is not in OP: no frame carried the stop (its motors get no demand at all, and stop "
                     "on their own 20 ms no-demand timeout; a cycle that starts again starts with zero demands)")
        return Verdict(resend=pending.seq if resend else None, error=error)

    def _replace(self, old: Pending, new: Pending | None) -> bool:
        with self._lock:
            if self._pending != old:
                return False
            self._pending = new
            return True


__all__ = ["STOP_LATE_LOOK_S", "STOP_RESEND_S", "STOP_WRITE_GRACE_S", "Pending", "StopReport", "Verdict"]
