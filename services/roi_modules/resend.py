"""The resend rules of the ROI transport as pure objects: no I/O, no clock (every time is passed in).

The reply is the acknowledgement (docs/reference/roi.md §5.4): a request unanswered for `timeout_s` is sent again, up
to `retries` times, then abandoned. Two ladders:

- `Ladder`: one request (transport.RoiTransport._request drives it). Before every send, the first included, the
  caller says whether the request may still go (`refusal`): a motion request admitted before the bus stop is
  refused from the moment the stop is active, so neither its first send nor any resend reaches the module after
  the stop's datagrams (the README's "Stopping everything").
- `StopLadder`: the bus stop's datagrams to one module (modules.RoiModule.confirm_stop drives it). The whole
  sequence is written again, in order, every `timeout_s` until every datagram of one write is acknowledged, up to
  `retries` rewrites, whether or not the module looks alive. The write that holds is the latest one written
  before the acknowledgement: its time is what the node's stop answer reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Step(Enum):
    SEND = "send"  # send (again) now
    WAIT = "wait"  # wait for a reply until `Decision.until`
    ANSWERED = "answered"  # the reply came: done
    LOST = "lost"  # every allowed send went unanswered: abandoned
    REFUSED = "refused"  # the request may not be sent (again): `Decision.reason`


@dataclass(frozen=True)
class Decision:
    step: Step
    until: float = 0.0  # WAIT: the time the reply is overdue
    reason: str = ""  # REFUSED: why


@dataclass
class Ladder:
    """One request's sends. `timeout_s`: how long a send's reply is awaited; `retries`: resends after the first;
    `insist`: resend even while the module is not live (otherwise a module that stops answering gets no more)."""

    timeout_s: float
    retries: int
    insist: bool = False
    sends: list[float] = field(default_factory=list)  # the times of the sends so far
    answered: bool = False
    refused: str = ""

    def decide(self, now: float, *, live: bool = True, refusal: str = "") -> Decision:
        """What to do at `now`. `live`: the module answers (the link supervisor's); `refusal`: why the request
        may not be sent any more ("" when it may): asked before every send and whenever the caller is woken (the
        bus stop wakes a request it refuses), it ends the request at once, its resends cancelled."""
        if self.answered:
            return Decision(Step.ANSWERED)
        if refusal and not self.refused:
            self.refused = refusal  # sticky: a request refused once is never sent again
        if self.refused:
            return Decision(Step.REFUSED, reason=self.refused)
        if self.sends:
            due = self.sends[-1] + self.timeout_s
            if now < due:
                return Decision(Step.WAIT, until=due)
            if len(self.sends) > self.retries or (not self.insist and not live):
                return Decision(Step.LOST)
        return Decision(Step.SEND)

    def sent(self, now: float) -> None:
        self.sends.append(now)

    def reply(self) -> None:
        self.answered = True

    @property
    def resends(self) -> int:
        return max(0, len(self.sends) - 1)


@dataclass
class StopLadder:
    """The bus stop's `count` datagrams to one module, written together (transport.send_now_many) and acknowledged
    one by one (each reply is one datagram's ack). Acknowledged when every datagram of the latest write has its
    reply; otherwise written again every `timeout_s`, up to `retries` times (the module looking silent or not: on
    a busy host the acks of many stops at once can be late); then the ladder is LOST once (the caller says the
    stop is not acknowledged) and the stop is written again every `slow_s` until it is, or the stop is over: a
    module that comes back while the stop holds gets it."""

    count: int
    timeout_s: float
    retries: int
    slow_s: float = 1.0  # past the ladder: written again this often until acknowledged
    writes: list[tuple[float, float]] = field(default_factory=list)  # (when, Unix time the write left)
    acked: set[int] = field(default_factory=set)  # indices of the latest write's datagrams answered
    over: str = ""  # the stop this ladder serves is over (released, or a newer one): why
    lost_said: bool = False  # LOST was decided once (the caller reported it); the slow rewrites go on

    def written(self, now: float, unix: float) -> None:
        """The whole sequence was written (again) at `now` (leaving the socket at Unix time `unix`): acks start
        over, and a late reply counts for this write (nothing tells replies to two writes apart)."""
        self.writes.append((now, unix))
        self.acked = set()

    def ack(self, index: int) -> None:
        """The module answered datagram `index` of the latest write (what the reply says is the caller's)."""
        self.acked.add(index)

    def end(self, why: str) -> None:
        """The stop is over (released, a newer activation, shutdown): no more writes, nothing to report."""
        self.over = why

    @property
    def done(self) -> bool:
        return len(self.acked) >= self.count

    @property
    def written_at(self) -> float | None:
        """The Unix time of the write that holds: the latest one (None: none written)."""
        return self.writes[-1][1] if self.writes else None

    def decide(self, now: float) -> Decision:
        if self.over:
            return Decision(Step.REFUSED, reason=self.over)
        if not self.writes:
            return Decision(Step.SEND)
        if self.done:
            return Decision(Step.ANSWERED)
        past_ladder = len(self.writes) > self.retries
        due = self.writes[-1][0] + (self.slow_s if past_ladder and self.lost_said else self.timeout_s)
        if now < due:
            return Decision(Step.WAIT, until=due)
        if past_ladder and not self.lost_said:
            self.lost_said = True
            return Decision(Step.LOST)
        return Decision(Step.SEND)


__all__ = ["Decision", "Ladder", "Step", "StopLadder"]
