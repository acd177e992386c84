"""DexterLink against the simulated DexRun: stop-and-wait, timeouts, keepalive, reconnect, reassembly."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from services.dexter_gateway.transport import DexterLink, DexterLinkConfig, DexterLinkError, PendingExchange
from shared.link import LinkState, SupervisedLink
from shared.rpc import wait_for


@pytest.fixture
def sim() -> Iterator[DexterSim]:
    s = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=200, acceleration_deg_s2=4000)).start()
    yield s
    s.close()


def make_link(sim: DexterSim, **cfg: Any) -> DexterLink:
    link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=sim.port, **cfg)).start()
    assert wait_for(lambda: link.serving, 10), link.message
    return link


def in_parallel(fn: Callable[[], Any], n: int) -> list[Any]:
    def safe() -> Any:
        try:
            return fn()
        except Exception as exc:
            return exc
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: safe(), range(n)))


def test_commands_from_many_threads_are_serialised(sim: DexterSim) -> None:
    link = make_link(sim)
    n0 = sim.stats.commands
    reps = in_parallel(lambda: link.request("h"), 40)
    assert all(not isinstance(r, Exception) and r.reply.error == 0 and r.reply.oplet == "h" for r in reps), reps
    assert len({r.reply.instruction_id for r in reps}) == 40
    # strictly one command per recv: the simulator saw every one as its own command, and none was lost
    assert sim.stats.commands - n0 >= 40 and sim.stats.crashes == 0 and link.stats.timeouts == 0
    assert link.stats.rtt_avg_ms > 0
    link.close()


def test_queue_limit_answers_busy(sim: DexterSim) -> None:
    link = make_link(sim, queue_limit=2)
    sim.delay_replies(0.3, 1)
    res = in_parallel(lambda: link.request("h"), 6)
    busy = [r for r in res if isinstance(r, DexterLinkError) and r.code == "busy"]
    assert busy and link.stats.busy == len(busy)
    assert sum(not isinstance(r, Exception) for r in res) >= 3
    link.close()


def test_a_cancelled_caller_leaves_the_queue(sim: DexterSim) -> None:
    link = make_link(sim)
    sim.delay_replies(0.5, 1)
    t = threading.Thread(target=lambda: link.request("h"))
    t.start()
    time.sleep(0.1)
    flag = threading.Event()
    threading.Timer(0.1, flag.set).start()
    with pytest.raises(DexterLinkError, match="cancelled"):
        link.request("h", cancelled=flag.is_set)
    t.join(5)
    assert link.request("h").reply.error == 0
    link.close()


def test_a_hold_keeps_the_turn_and_lets_a_waiter_in_between_two_exchanges(sim: DexterSim) -> None:
    link = make_link(sim)
    served: list[Any] = []
    with link.hold() as hold:
        first = hold.exchange(link.prepare("h")).reply
        assert link.busy and hold.held
        keepalives = link.stats.keepalives
        t = threading.Thread(target=lambda: served.append(link.request("h").reply))
        t.start()
        assert wait_for(lambda: link.queued == 1, 5)
        assert not served  # the holder keeps the link between its exchanges
        second = hold.exchange(link.prepare("h")).reply  # the waiter goes first, then the holder's next turn
        assert served and hold.held
        t.join(5)
        assert first.instruction_id < served[0].instruction_id < second.instruction_id  # FIFO, one at a time
        assert link.stats.keepalives == keepalives
    assert not link.busy
    assert link.request("h").reply.error == 0
    link.close()


def test_a_cancel_while_a_hold_waits_its_turn_gives_up_and_releases_nothing(sim: DexterSim) -> None:
    link = make_link(sim)
    sim.delay_replies(0.5, 1)
    t = threading.Thread(target=lambda: link.request("h"))
    t.start()
    assert wait_for(lambda: link.busy, 5)
    flag = threading.Event()
    threading.Timer(0.1, flag.set).start()
    with pytest.raises(DexterLinkError, match="cancelled"), link.hold(cancelled=flag.is_set):
        pass
    t.join(5)
    assert not link.busy and link.request("h").reply.error == 0
    link.close()


def test_timeout_resets_the_link_and_it_comes_back(sim: DexterSim) -> None:
    link = make_link(sim, reply_timeout_s=0.3, reconnect_min_s=0.05)
    sim.drop_replies(1)
    t0 = time.monotonic()
    with pytest.raises(DexterLinkError) as ei:
        link.request("h")
    assert ei.value.code == "timeout" and time.monotonic() - t0 >= 0.25
    assert link.stats.timeouts == 1
    assert wait_for(lambda: link.serving and link.stats.reconnects == 1, 10)
    assert link.request("h").reply.error == 0
    link.close()


def test_longer_allowance_for_z_and_queued_moves(sim: DexterSim) -> None:
    link = make_link(sim, reply_timeout_s=0.3)
    rep = link.request("z", [500000])  # 0.5 s sleep > the 0.3 s reply timeout
    assert rep.reply.error == 0 and rep.rtt_s >= 0.45
    assert link.timeout_for(link.prepare("F")) == link.config.motion_timeout_s
    assert link.timeout_for(link.prepare("w", [1, 2])) == link.config.motion_timeout_s
    assert link.timeout_for(link.prepare("a", [0] * 5)) == link.config.fifo_timeout_s
    assert link.timeout_for(link.prepare("S", ["RunFile", "x.make_ins"])) == link.config.motion_timeout_s
    link.close()


def test_keepalive_outlives_dexrun_idle_close() -> None:
    with DexterSim(DexterSimConfig(port=0, idle_close_s=0.5)) as sim:
        link = make_link(sim, keepalive_s=0.2)
        time.sleep(2.0)  # four idle-close periods without a command of ours
        assert sim.stats.idle_closes == 0 and link.stats.reconnects == 0 and link.serving
        assert link.stats.keepalives >= 3
        link.close()


def test_without_keepalive_the_idle_close_is_seen_and_survived() -> None:
    with DexterSim(DexterSimConfig(port=0, idle_close_s=0.3)) as sim:
        link = make_link(sim, keepalive_s=29, reconnect_min_s=0.05)
        assert wait_for(lambda: sim.stats.idle_closes >= 1 and link.stats.reconnects >= 1, 10)
        assert wait_for(lambda: link.serving, 5)
        assert link.request("h").reply.error == 0
        link.close()


def test_split_and_coalesced_replies(sim: DexterSim) -> None:
    link = make_link(sim)
    sim.split_replies(3, pieces=7, gap_s=0.01)
    for _ in range(3):
        assert link.request("h").reply.oplet == "h"
    sim.coalesce_replies(2)
    for _ in range(3):
        assert link.request("h").reply.oplet == "h"
    assert link.stats.stale_replies == 2 and link.stats.reconnects == 0 and link.stats.out_of_step == 0
    link.close()


def test_a_reply_trickling_past_its_deadline_times_out(sim: DexterSim) -> None:
    # the kernel's receive timeout is re-armed for each piece with what is left of the command's own: pieces
    # each within the reply timeout but together past it are a timeout, not a late success
    link = make_link(sim, reply_timeout_s=0.3, reconnect_min_s=0.05)
    sim.split_replies(1, pieces=6, gap_s=0.1)
    with pytest.raises(DexterLinkError) as ei:
        link.request("h")
    assert ei.value.code == "timeout" and link.stats.timeouts == 1
    assert wait_for(lambda: link.serving and link.stats.reconnects == 1, 10)
    assert link.request("h").reply.error == 0
    link.close()


def test_garbage_puts_the_stream_out_of_step_and_the_link_resets(sim: DexterSim) -> None:
    errors: list[str] = []
    link = make_link(sim, reply_timeout_s=0.5, reconnect_min_s=0.05)
    link.on_decode_error = errors.append
    sim.garbage(b"\x01\x02\x03")
    with pytest.raises(DexterLinkError) as ei:
        link.request("h")
    assert ei.value.code in ("device_error", "timeout")
    assert wait_for(lambda: link.serving and link.stats.reconnects >= 1, 10)
    assert link.request("h").reply.error == 0
    assert errors
    link.close()


def test_second_client_waits_until_the_arm_is_free(sim: DexterSim) -> None:
    holder = socket.create_connection(("127.0.0.1", sim.port))
    holder.sendall(p.build_request("g").encode())
    assert len(holder.recv(240)) > 0
    link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=sim.port, reply_timeout_s=0.3,
                                              reconnect_min_s=0.05, reconnect_max_s=0.2)).start()
    assert wait_for(lambda: "another client" in link.message, 5), link.message
    assert not link.serving
    with pytest.raises(DexterLinkError) as ei:
        link.request("h")
    assert ei.value.code == "unavailable"
    holder.close()
    assert wait_for(lambda: link.serving, 10)
    link.close()


def test_invalid_requests_never_reach_the_queue(sim: DexterSim) -> None:
    link = make_link(sim)
    n0 = sim.stats.commands
    with pytest.raises(p.ProtocolError):
        link.request("z")
    with pytest.raises(p.ProtocolError):
        link.request("a", [1, 2, 3])
    assert sim.stats.commands == n0
    link.close()


# -- the inline path (`try_inline`): the dispatching thread sends and waits a bounded time --------------------

def test_try_inline_answers_when_the_reply_is_quick_and_leaves_the_link_free(sim: DexterSim) -> None:
    link = make_link(sim)
    # a generous wait (this test is not about speed): the reply comes within it on any machine
    out = link.try_inline(link.prepare("h"), 5.0)
    assert not isinstance(out, PendingExchange) and out is not None
    assert out.reply.oplet == "h" and out.reply.error == 0 and out.reply.instruction_id == out.request.instruction_id
    assert not link.busy and link.request("h").reply.error == 0
    link.close()


def test_try_inline_sends_nothing_while_the_link_is_in_use(sim: DexterSim) -> None:
    link = make_link(sim)
    n0 = sim.stats.commands
    with link.hold():
        assert link.try_inline(link.prepare("h"), 5.0) is None
    assert sim.stats.commands == n0
    link.close()


def test_a_reply_after_the_inline_wait_reaches_its_caller_and_a_queued_command_keeps_its_order(sim: DexterSim
                                                                                               ) -> None:
    link = make_link(sim)
    sim.delay_replies(0.3, 1)
    pending = link.try_inline(link.prepare("h"), 0.001)
    assert isinstance(pending, PendingExchange)
    assert link.busy  # the turn stays with the pending exchange: nothing overtakes it
    later: list[Any] = []
    t = threading.Thread(target=lambda: later.append(link.request("g")))
    t.start()
    assert wait_for(lambda: link.queued == 1, 5)
    assert not later  # still queued behind the command in flight
    rep = pending.finish()  # on another thread in the gateway (the kit's pool): here, this one
    assert rep.reply.oplet == "h" and rep.reply.instruction_id == rep.request.instruction_id
    t.join(10)
    assert later and later[0].reply.oplet == "g" and later[0].reply.instruction_id > rep.reply.instruction_id
    assert link.stats.timeouts == 0 and link.stats.out_of_step == 0 and not link.busy
    with pytest.raises(RuntimeError):
        pending.finish()
    link.close()


def test_a_pending_inline_exchange_still_times_out_at_the_commands_deadline(sim: DexterSim) -> None:
    link = make_link(sim, reply_timeout_s=0.3, reconnect_min_s=0.05)
    sim.drop_replies(1)
    t0 = time.monotonic()
    pending = link.try_inline(link.prepare("h"), 0.001)
    assert isinstance(pending, PendingExchange)
    with pytest.raises(DexterLinkError) as ei:
        pending.finish()
    # the deadline counts from the send, not from the hand-over
    assert ei.value.code == "timeout" and time.monotonic() - t0 >= 0.25 and link.stats.timeouts == 1
    assert not link.busy
    assert wait_for(lambda: link.serving and link.stats.reconnects == 1, 10)
    assert link.request("h").reply.error == 0
    link.close()


# -- the kit's link supervisor (shared/link.py) drives health; the link reports to it ----------------------------

def _state(link: DexterLink) -> LinkState:
    return link.sup.state


def test_reconnects_follow_the_supervisors_backoff_then_one_probe_per_period() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=port, reply_timeout_s=0.3, liveness_s=0.5,
                                              reconnect_min_s=0.05, reconnect_max_s=0.2, probe_period_s=1.0)).start()
    try:
        # within the budget: the back-off ladder (0.05, 0.1, 0.2 ...), then `unreachable`
        # read between two attempts (a probe can be under way when the state changes: one attempt not yet failed)
        assert wait_for(lambda: link.sup.state is LinkState.UNREACHABLE
                        and link.sup.details()["failures"] == link.sup.details()["attempts"], 10), link.sup.details()
        d = link.sup.details()
        assert d["attempts"] >= 3 and "refused" in d["last_failure"].lower()
        # unreachable: one probe per probe period (the old ladder capped at 0.2 s tried ~15 times in 3 s)
        n0, t0 = d["attempts"], time.monotonic()
        time.sleep(3.0)
        probes = link.sup.details()["attempts"] - n0
        assert 1 <= probes <= (time.monotonic() - t0) / 1.0 + 1, probes
        assert link.sup.state is LinkState.UNREACHABLE and not link.serving
    finally:
        link.close()
    assert _state(link) is LinkState.STOPPED


def test_the_link_reports_sessions_losses_and_garbage_to_its_supervisor(sim: DexterSim) -> None:
    shown: list[dict[str, Any]] = []  # every health the supervisor sets, as a device's would be
    cfg = DexterLinkConfig(host="127.0.0.1", port=sim.port, reply_timeout_s=0.3, reconnect_min_s=0.05)
    link = DexterLink("arm", cfg, supervisor=SupervisedLink(cfg.policy(), shown.append)).start()
    assert wait_for(lambda: link.serving, 10)
    assert link.sup.state is LinkState.OPERATIONAL and link.sup.details()["sessions"] == 1
    sim.drop_replies(1)
    with pytest.raises(DexterLinkError):
        link.request("h")
    assert wait_for(lambda: link.serving and link.sup.state is LinkState.OPERATIONAL, 10)
    sim.garbage(b"\x01\x02\x03")
    with pytest.raises(DexterLinkError):
        link.request("h")
    assert wait_for(lambda: link.serving and link.sup.state is LinkState.OPERATIONAL, 10)
    d = link.sup.details()
    assert d["sessions"] == 3 and d["garbage"] >= 1 and d["failures"] >= 2, d
    states = [h["state"] for h in shown]
    assert states.count("lost") == 2 and states[-1] == "operational", states  # each loss shown when it happened
    assert not any(h["error"] for h in shown)  # losses and garbage are counted, never an error
    link.close()
    assert _state(link) is LinkState.STOPPED and shown[-1]["state"] == "stopped" and not shown[-1]["connection"]
