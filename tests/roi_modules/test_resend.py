"""The resend rules (services/roi_modules/resend.py) with made-up times: a request's ladder (sends, loss, the bus
stop's refusal before every send) and the stop's own ladder (written again until one write is acknowledged); the
probe rhythm (modules.next_probe); and the transport driving the request's ladder with a guard, against the
simulator."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from services.roi_modules import protocol as p
from services.roi_modules.device import next_probe
from services.roi_modules.resend import Decision, Ladder, Step, StopLadder
from services.roi_modules.sim import RoiSim, SimModuleSpec
from services.roi_modules.transport import RequestRefused, RoiTransport, TransportConfig, guard_sends
from tests.roi_modules.conftest import fresh_prefix, wait_until


def test_a_request_is_sent_then_resent_each_timeout_then_lost() -> None:
    lad = Ladder(timeout_s=0.05, retries=2)
    assert lad.decide(10.0) == Decision(Step.SEND)
    lad.sent(10.0)
    assert lad.decide(10.02) == Decision(Step.WAIT, until=10.05)
    assert lad.decide(10.05).step is Step.SEND
    lad.sent(10.05)
    lad.sent(10.10)
    assert lad.resends == 2
    assert lad.decide(10.12).step is Step.WAIT
    assert lad.decide(10.15).step is Step.LOST  # 1 + 2 sends, each awaited for its timeout
    lad2 = Ladder(timeout_s=0.05, retries=2)
    lad2.sent(0.0)
    lad2.reply()
    assert lad2.decide(5.0).step is Step.ANSWERED


def test_a_module_that_stops_answering_gets_no_more_resends_unless_insisted() -> None:
    lad = Ladder(timeout_s=0.05, retries=10)
    lad.sent(0.0)
    assert lad.decide(0.05, live=False).step is Step.LOST
    insist = Ladder(timeout_s=0.05, retries=10, insist=True)
    insist.sent(0.0)
    assert insist.decide(0.05, live=False).step is Step.SEND


def test_the_stop_refuses_a_request_before_its_first_send_and_every_resend_and_for_good() -> None:
    lad = Ladder(timeout_s=0.05, retries=10)
    assert lad.decide(0.0, refusal="stop") == Decision(Step.REFUSED, reason="stop")
    assert lad.sends == []
    lad = Ladder(timeout_s=0.05, retries=10)
    lad.sent(0.0)
    # woken while its reply is awaited (transport.halt): refused at once, not at the end of its wait
    assert lad.decide(0.01, refusal="stop").step is Step.REFUSED
    assert lad.decide(0.2).step is Step.REFUSED  # sticky: never sent again, whatever the guard says later
    assert lad.sends == [0.0]


def test_the_stop_is_written_again_until_one_write_is_acknowledged() -> None:
    lad = StopLadder(count=3, timeout_s=0.05, retries=10)
    assert lad.decide(0.0).step is Step.SEND
    lad.written(0.0, 1000.0)
    lad.ack(0)
    lad.ack(1)
    assert lad.decide(0.03) == Decision(Step.WAIT, until=0.05)
    assert lad.decide(0.05).step is Step.SEND  # one datagram of three unanswered: the whole write again
    lad.written(0.05, 1000.05)
    assert lad.acked == set() and not lad.done  # acks count for the latest write only
    lad.ack(2)
    lad.ack(0)
    lad.ack(1)
    assert lad.decide(0.06).step is Step.ANSWERED
    assert lad.written_at == 1000.05  # the write that holds: the latest, not the first


def test_the_stop_ladder_says_lost_once_then_writes_slowly_until_acknowledged_and_ends_with_its_stop() -> None:
    lad = StopLadder(count=1, timeout_s=0.05, retries=2, slow_s=1.0)
    for i in range(3):
        lad.written(i * 0.05, 1000.0 + i)
    assert lad.decide(0.1).step is Step.WAIT
    assert lad.decide(0.2).step is Step.LOST  # said once (the answer says not acknowledged) ...
    assert lad.decide(0.25) == Decision(Step.WAIT, until=1.1)  # ... then written again every second
    assert lad.decide(1.1).step is Step.SEND
    lad.written(1.1, 1010.0)
    assert lad.decide(1.5).step is Step.WAIT
    lad.ack(0)  # the module answers again while the stop holds
    assert lad.decide(1.6).step is Step.ANSWERED and lad.written_at == 1010.0
    lad2 = StopLadder(count=1, timeout_s=0.05, retries=2)
    lad2.written(0.0, 1000.0)
    lad2.end("released")
    assert lad2.decide(0.01) == Decision(Step.REFUSED, reason="released")


def test_an_absent_module_is_probed_once_per_period_counted_from_each_probe_start() -> None:
    """The link supervisor counts its wait from the probe's failure, after the probe waited 0.55 s for a reply:
    1.55 s apart (measured ~1.6 s with the maintain tick). Counted from the probe's start: one a second."""
    period, wait_reply = 1.0, 0.55
    starts = [0.0]
    for _ in range(5):
        start = starts[-1]
        failed_at = start + wait_reply
        starts.append(next_probe(start, failed_at, period))  # the supervisor's wait, seen at the failure
    assert [round(b - a, 6) for a, b in itertools.pairwise(starts)] == [period] * 5
    # a wait shorter than the probe's own: the next probe at once, never in the past
    assert next_probe(0.0, 0.55, 0.2) == 0.55


# -- the transport drives the ladder: a guarded request against the simulator -------------------------------------
@pytest.fixture
def sim() -> Iterator[RoiSim]:
    s = RoiSim(fresh_prefix(), [SimModuleSpec(20, "odrive")], seed=7).start()
    yield s
    s.close()


def test_a_guarded_request_is_halted_at_once_and_sends_nothing_more(sim: RoiSim) -> None:
    """Replies lost: a motion request is in its resend ladder; the stop comes (its guard refuses from then on) and
    `halt` ends it at once (RequestRefused), well before its next resend; nothing more of it reaches the module."""
    stopped = {"now": False}
    velocity = p.odrive_request(p.OdriveAction.SET_VELOCITY, 1.5)

    async def main() -> tuple[int, int, float]:
        tr = RoiTransport(TransportConfig(sim.prefix, 100, timeout_s=0.25), [20])
        await tr.open()
        try:
            async def command() -> None:
                guard_sends(lambda pkt: "stopped" if stopped["now"] else "")
                await tr.general(20, velocity)
            task = asyncio.ensure_future(command())
            sim.record_wire()
            sim.set_faults(20, drop_replies=True)
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, lambda: wait_until(lambda: len(sim.wire_log(20)) >= 1, 10))
            stopped["now"] = True
            t0 = loop.time()
            assert tr.halt({20}) == {20}
            with pytest.raises(RequestRefused, match="stopped"):
                await task
            took = loop.time() - t0
            await asyncio.sleep(0.6)  # two resend timeouts: nothing more comes
            # a request with no guard is not halted
            sim.set_faults(20, drop_replies=False)
            assert tr.halt({20}) == set()
            await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
            return len([r for r in sim.wire_log(20) if r.action == p.OdriveAction.SET_VELOCITY]), \
                tr.links[20].resent, took
        finally:
            tr.close()

    sends, resent, took = asyncio.run(main())
    assert sends == 1 and resent == 0, (sends, resent)
    assert took < 0.25  # at once, not at its next resend


def test_a_guard_that_refuses_at_a_resend_ends_the_request(sim: RoiSim) -> None:
    """Without `halt`, the guard is asked again before each resend: the request ends there, unsent."""
    stopped = {"now": False}

    async def main() -> int:
        tr = RoiTransport(TransportConfig(sim.prefix, 100, timeout_s=0.1), [20])
        await tr.open()
        try:
            sim.record_wire()
            sim.set_faults(20, drop_replies=True)

            def guard(pkt: p.GeneralPacket) -> str:
                refused = "stopped" if stopped["now"] else ""
                stopped["now"] = True  # from the first resend on
                return refused
            guard_sends(guard)
            with pytest.raises(RequestRefused):
                await tr.general(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 1.5))
            return len(sim.wire_log(20))
        finally:
            tr.close()

    assert asyncio.run(main()) == 1
