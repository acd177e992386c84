"""The kit's one reconnect loop (shared/transport.py): the pure machine over the link supervisor with made-up times,
and its two drivers (a thread, a coroutine) running a transport that fails, opens, and loses its link."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.link import LinkPolicy, LinkState, LinkSupervisor, SupervisedLink
from shared.transport import (
    AsyncReconnectLoop,
    AsyncTransport,
    Attempt,
    Done,
    LinkEvent,
    OpenFailed,
    ReconnectLoop,
    ReconnectSteps,
    Transport,
    Wait,
)

POLICY = LinkPolicy(liveness_s=1.0, backoff_min_s=0.2, backoff_max_s=0.8, probe_period_s=5.0)


def steps(t0: float = 0.0, max_wait_s: float = 1.0) -> tuple[ReconnectSteps, LinkSupervisor]:
    sup = LinkSupervisor(POLICY, now=t0)
    return ReconnectSteps(sup, max_wait_s=max_wait_s), sup


def wait_of(action: object) -> float:
    assert isinstance(action, Wait), action
    return action.seconds


def test_the_first_attempt_is_at_once_and_failures_wait_the_supervisors_back_off() -> None:
    m, sup = steps()
    assert m.next_action(0.0) == Attempt()
    assert sup.counters.attempts == 1
    assert m.open_failed(0.0, "connection refused") is True
    assert (sup.counters.failures, sup.counters.last_failure) == (1, "connection refused")
    assert wait_of(m.next_action(0.05)) == pytest.approx(0.15)
    assert m.next_action(0.2) == Attempt()
    m.open_failed(0.2, "connection refused")
    assert wait_of(m.next_action(0.2)) == pytest.approx(0.4), "the back-off doubles"
    assert sup.counters.attempts == 2, "a wait is no attempt"


def test_a_long_wait_is_cut_so_that_the_rhythm_is_read_again() -> None:
    m, sup = steps()
    t = 0.0
    while sup.state is not LinkState.UNREACHABLE:
        action = m.next_action(t)
        if isinstance(action, Attempt):
            m.open_failed(t, "no answer")
        else:
            assert isinstance(action, Wait)
            t += action.seconds
    m.next_action(t + POLICY.probe_period_s)
    m.open_failed(t + POLICY.probe_period_s, "no answer")
    assert m.next_action(t + POLICY.probe_period_s) == Wait(1.0), "a probe period of 5 s, read again every 1 s"
    assert sup.next_attempt_in(t + POLICY.probe_period_s) == pytest.approx(5.0)


def test_a_session_end_is_told_once_whoever_sees_it_first() -> None:
    m, sup = steps()
    m.next_action(0.0)
    m.opened()
    sup.opened(0.0)
    sup.data(0.1)
    assert m.lost(0.5, "connection reset") is True, "the thread that saw the loss tells the link at once"
    assert sup.state is LinkState.LOST and sup.counters.failures == 1
    assert m.lost(0.51, "again") is False
    assert m.session_over(0.6, "connection reset") is False, "the session's end was told already"
    assert sup.counters.failures == 1 and sup.counters.last_failure == "connection reset"
    assert wait_of(m.next_action(0.6)) == pytest.approx(0.1), "the back-off counts from the loss"
    # the next session's end is told by its return
    assert m.next_action(0.7) == Attempt()
    m.opened()
    assert m.session_over(0.9, "closed by the peer") is True
    assert sup.counters.failures == 2 and sup.counters.attempts == 2


def test_closing_ends_every_wait_and_tells_the_link_nothing() -> None:
    m, sup = steps()
    m.next_action(0.0)
    m.opened()
    m.close()
    assert m.lost(0.1, "torn down") is False and m.session_over(0.1, "torn down") is False
    assert m.next_action(0.2) == Done()
    assert sup.counters.failures == 0 and sup.state is LinkState.CONNECTING
    m2, sup2 = steps()
    m2.next_action(0.0)
    m2.close()
    assert m2.open_failed(0.1, "refused") is False and sup2.counters.failures == 0


def test_lost_outside_a_session_is_no_news_and_an_attempt_must_end_first() -> None:
    m, sup = steps()
    assert m.lost(0.0, "nothing open") is False
    m.next_action(0.0)
    with pytest.raises(RuntimeError, match="opening"):
        m.next_action(0.0)
    assert sup.counters.failures == 0


# -- the drivers ---------------------------------------------------------------------------------------------
class Flaky(Transport):
    """Refuses `refusals` opens, then serves sessions that end when told (`end`)."""

    def __init__(self, link: SupervisedLink, refusals: int) -> None:
        self.link = link
        self.refusals = refusals
        self.events: list[str] = []
        self.loop = ReconnectLoop(self, link, name="flaky", max_wait_s=0.05)
        self.in_session = threading.Event()
        self.end = threading.Event()
        self.sessions = 0

    def open(self) -> None:
        self.events.append("open")
        if self.refusals:
            self.refusals -= 1
            raise OpenFailed("refused")

    def run_session(self) -> str:
        self.link.opened()
        self.link.data()
        self.sessions += 1
        self.in_session.set()
        self.end.wait(5.0)
        self.end.clear()
        return "peer closed"

    def close(self) -> None:
        self.loop.stop()
        self.end.set()
        self.loop.join(2.0)

    def reported(self, event: LinkEvent) -> None:
        self.events.append(event.value)


def test_the_thread_driver_reconnects_after_failures_and_losses_until_closed() -> None:
    link = SupervisedLink(LinkPolicy(liveness_s=1.0, backoff_min_s=0.01, backoff_max_s=0.02), lambda f: None)
    t = Flaky(link, refusals=2)
    t.loop.start()
    assert t.in_session.wait(5.0)
    assert link.state is LinkState.OPERATIONAL
    assert t.loop.lost("reset seen by a request") is True
    assert link.state is LinkState.LOST, "lost at once, from the thread that saw it"  # type: ignore[comparison-overlap]
    t.end.set()
    deadline = time.monotonic() + 5.0
    while t.sessions < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t.close()
    assert t.events[:7] == ["attempt", "open", "failed", "attempt", "open", "failed", "attempt"]
    assert t.events[7:10] == ["open", "closed", "attempt"] and t.events.count("closed") == 1, t.events
    d = link.details()
    assert (d["attempts"], d["failures"], d["sessions"]) == (4, 3, 2)
    assert link.state is LinkState.OPERATIONAL, "closing tells the link nothing (the shutdown reports stop)"


class AsyncFlaky(AsyncTransport):
    def __init__(self, link: SupervisedLink) -> None:
        self.link = link
        self.loop = AsyncReconnectLoop(self, link, max_wait_s=10.0)
        self.opens = 0
        self.sessions = 0

    async def open(self) -> None:
        self.opens += 1
        if self.opens == 1:
            raise OpenFailed("refused")

    async def run_session(self) -> str:
        self.sessions += 1
        self.link.opened()
        await asyncio.sleep(0.01)
        return "peer closed"

    async def close(self) -> None:
        self.loop.stop()


def test_the_asyncio_driver_runs_the_same_machine_and_closing_ends_its_wait() -> None:
    async def main() -> tuple[SupervisedLink, bool]:
        link = SupervisedLink(LinkPolicy(liveness_s=1.0, backoff_min_s=0.01, backoff_max_s=30.0), lambda f: None)
        t = AsyncFlaky(link)
        task = asyncio.ensure_future(t.loop.run())
        while t.sessions < 3:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await asyncio.sleep(0.05)  # a doubling back-off: the loop waits now (or, on a slow machine, serves again)
        in_session = t.loop.steps.in_session
        await t.close()
        await asyncio.wait_for(task, 2.0)
        assert time.monotonic() - t0 < 1.0, "closing ends the wait"
        return link, in_session

    link, in_session = asyncio.run(main())
    d = link.details()
    assert d["sessions"] >= 3
    # one refused open and every session's end are told; a session that closing ended is not
    assert d["failures"] == d["attempts"] - (1 if in_session else 0) >= 3
