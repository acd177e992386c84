"""The kit's link supervisor (shared/link.py): the one meaning of the health fields, with made-up times, and
bound to a device on a real broker (the node's housekeeping applies the deadlines by itself)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import Node
from shared.link import LinkPolicy, LinkState, LinkSupervisor, SupervisedLink
from shared.rpc import RpcClient, wait_for

POLICY = LinkPolicy(liveness_s=1.0, backoff_min_s=0.2, backoff_max_s=2.0, probe_period_s=5.0)


def test_a_device_never_heard_from_is_unreachable_once_its_budget_has_passed() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    t = 0.0
    errors = set()
    while t < 3.0:
        s.attempt(t)
        s.failed(t, "connection refused")
        h = s.health(t)
        errors.add(h["error"])
        assert h["connection"] is False and h["operational"] is False
        t += s.next_attempt_in(t) or 0.01
    assert errors == {False}, "a failed attempt is counted, never an error"
    assert s.state is LinkState.UNREACHABLE
    d = s.details(t)
    assert d["attempts"] == d["failures"] >= 3 and d["last_failure"] == "connection refused"
    # absent: one probe per probe period from now on, not the backoff ladder
    s.attempt(t)
    s.failed(t, "connection refused")
    assert s.next_attempt_in(t) == pytest.approx(POLICY.probe_period_s)
    assert "probing every 5 s" in s.health(t)["error_message"]


def test_connecting_before_the_budget_and_connection_only_with_valid_data() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    assert s.health(0.5)["state"] == "connecting"
    s.opened(0.6)
    h = s.health(0.7)
    assert h["state"] == "connected" and h["connection"] is False, "an open link is not valid data"
    s.data(0.8)
    h = s.health(0.9)
    assert (h["state"], h["connection"], h["operational"], h["error"]) == ("operational", True, True, False)
    assert s.tick(1.79) is LinkState.OPERATIONAL
    assert s.tick(1.81) is LinkState.SILENT  # muted: the link stays open, data stopped
    h = s.health(1.81)
    assert h["connection"] is False and h["error"] is False and "allowed 1.0 s" in h["error_message"]
    s.data(2.0)
    assert s.health(2.0)["state"] == "operational", "operational again at its first valid data"


def test_an_open_link_that_never_brings_valid_data_is_unreachable_not_connected_forever() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    for t in (0.5, 1.0):
        s.garbage(t, "bad frame")
    assert s.tick(1.01) is LinkState.UNREACHABLE
    assert s.details(1.01)["garbage"] == 2


def test_lost_at_once_then_unreachable_after_the_budget_then_back() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.1)
    s.closed(0.5, "peer closed")
    assert s.health(0.5)["state"] == "lost"
    waits = []
    t = 0.5
    for _ in range(4):
        waits.append(s.next_attempt_in(t))
        t += waits[-1]
        s.attempt(t)
        s.failed(t, "refused")
    assert waits[:3] == pytest.approx([0.2, 0.4, 0.8]), "capped doubling back-off while lost"
    assert s.tick(t) is LinkState.UNREACHABLE
    s.attempt(t + 5)
    s.opened(t + 5)
    s.data(t + 5.01)
    assert s.health(t + 5.02)["state"] == "operational"


def test_a_good_session_resets_the_backoff() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    for t in (0.0, 0.2, 0.6):
        s.attempt(t)
        s.failed(t, "refused")
    assert s.next_attempt_in(0.6) == pytest.approx(0.8)
    s.attempt(1.4)
    s.opened(1.4)
    for k in range(30):
        s.data(1.5 + k * 0.1)
    s.closed(4.5, "reset")
    assert s.next_attempt_in(4.5) == pytest.approx(POLICY.backoff_min_s)


def test_error_is_a_fault_of_the_device_and_says_how() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.1)
    s.fault("module type mismatch: configured odrive, answering gpio")
    h = s.health(0.2)
    assert (h["state"], h["error"], h["operational"]) == ("error", True, False)
    assert "mismatch" in h["error_message"]
    s.clear_fault()
    assert s.health(0.3)["error"] is False


def test_the_service_names_its_finer_state_while_operational() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.0)
    s.device_state("blank_state", operational=False, message="module not configured")
    h = s.health(0.1)
    assert (h["state"], h["connection"], h["operational"]) == ("blank_state", True, False)
    s.tick(2.0)
    assert s.health(2.0)["state"] == "silent", "the link's truth wins over the service's name"


def test_recovering_then_stopped_never_claims_valid_data() -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.0)
    s.recovering(0.5, "cycle process died")
    h = s.health(0.5)
    assert (h["state"], h["connection"]) == ("recovering", False)
    assert h["details"]["link"]["restarts"] == 1
    s.recovered(0.7)
    s.data(0.8)
    assert s.health(0.8)["state"] == "operational"
    s.stop(1.0, "shutdown")
    h = s.health(1.0)
    assert (h["state"], h["connection"], h["details"]["link"]["valid_data"]) == ("stopped", False, False)


EVENTS = st.lists(st.tuples(st.sampled_from(["attempt", "opened", "failed", "closed", "data", "garbage",
                                             "fault", "clear", "tick"]),
                            st.floats(min_value=0.0, max_value=2.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_invariants_over_any_sequence_of_events(events: list[tuple[str, float]]) -> None:
    s = LinkSupervisor(POLICY, now=0.0)
    t = 0.0
    last_data: float | None = None
    faulted = False
    for name, dt in events:
        t += dt
        if name in ("failed", "closed"):
            getattr(s, name)(t, "x")
            if name == "closed":
                last_data = None
        elif name == "data":
            s.data(t)
            last_data = t
        elif name == "garbage":
            s.garbage(t, "x")
        elif name == "fault":
            s.fault("bad")
            faulted = True
        elif name == "clear":
            s.clear_fault()
            faulted = False
        else:
            getattr(s, name)(t)
        h = s.health(t)
        if h["connection"]:
            assert last_data is not None and t - last_data <= POLICY.liveness_s
        assert h["error"] is faulted, "error means a fault, nothing else"
        assert not (h["operational"] and not h["connection"])
        assert s.next_attempt_in(t) <= max(POLICY.probe_period_s, POLICY.backoff_max_s) + 1e-9


def test_bound_to_a_device_health_follows_the_link_without_the_transport(echo_node: Node,
                                                                        client: RpcClient) -> None:
    """A supervised device nobody reports for: the node's housekeeping publishes `unreachable` when the budget
    passes; a transition is published at once, not at the next heartbeat; `details.link` is filled."""
    dev = echo_node.device(f"linked{time.monotonic_ns()}")
    seen: list[dict[str, Any]] = []
    client.subscribe_before(f"{dev.base}/health", lambda m: seen.append(json.loads(m.payload)))
    link = dev.supervise_link(LinkPolicy(liveness_s=0.6, probe_period_s=2.0))
    link.attempt()
    link.failed("refused")
    assert wait_for(lambda: bool(seen) and seen[-1]["state"] == "unreachable", 10), seen[-3:]
    h = seen[-1]
    assert h["connection"] is False and h["error"] is False
    assert h["details"]["link"]["attempts"] == 1 and h["details"]["link"]["failures"] == 1
    link.attempt()
    link.opened()
    link.data()
    assert wait_for(lambda: seen[-1]["state"] == "operational" and seen[-1]["connection"] is True, 10)
    assert wait_for(lambda: seen[-1]["state"] == "silent", 10), "no data: silent once the budget passed"


def test_a_budget_changed_at_run_time_applies_at_once_and_the_messages_say_it() -> None:
    """A device whose allowed silence follows what it sends (an e-puck2's image interval): the budget set at
    connect is not the one judged once the device shows its real rhythm."""
    s = LinkSupervisor(LinkPolicy(liveness_s=6.8), now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.5)
    s.set_budget(0.6, 1.0)  # its data now comes often: a shorter budget
    assert s.tick(1.49) is LinkState.OPERATIONAL
    assert s.tick(1.51) is LinkState.SILENT, "judged by the budget in force, not the one at connect"
    h = s.health(1.51)
    assert "allowed 1.0 s" in h["error_message"] and s.details(1.51)["liveness_s"] == 1.0
    s.data(2.0)
    s.set_budget(2.0, 3.0)  # longer again: the deadline already counting moves with it
    assert s.tick(4.9) is LinkState.OPERATIONAL
    assert s.tick(5.1) is LinkState.SILENT and "allowed 3.0 s" in s.health(5.1)["error_message"]
    with pytest.raises(ValueError):
        s.set_budget(6.0, 0.0)


def test_a_bound_link_wakes_the_deadline_thread_when_its_budget_changes() -> None:
    """A shorter budget brings the next deadline forward: the thread sleeping until the old one is woken
    (the node's housekeeping; `Device.supervise_link` passes its wake-up)."""
    now = [0.0]
    wakes: list[float] = []
    shown: list[dict[str, Any]] = []
    link = SupervisedLink(LinkPolicy(liveness_s=6.8), shown.append, clock=lambda: now[0],
                          wake=lambda: wakes.append(now[0]))
    link.attempt()
    link.opened()
    link.data()
    assert link.tick() == pytest.approx(6.8)
    now[0] = 0.2
    link.set_budget(1.0)
    assert wakes == [0.2] and link.tick() == pytest.approx(0.8)
    link.set_budget(1.0)  # unchanged (called with every image): no work, no wake-up
    assert wakes == [0.2]
    now[0] = 1.01
    assert link.tick() is None and shown[-1]["state"] == "silent" and "allowed 1.0 s" in shown[-1]["error_message"]


def test_the_first_health_of_a_supervised_device_carries_its_link_details(echo_node: Node,
                                                                          client: RpcClient) -> None:
    dev = echo_node.device(f"first{time.monotonic_ns()}")
    seen: list[dict[str, Any]] = []
    client.subscribe_before(f"{dev.base}/health", lambda m: seen.append(json.loads(m.payload)))
    dev.supervise_link(LinkPolicy(liveness_s=5.0))
    assert wait_for(lambda: any(h["state"] == "connecting" for h in seen), 10), seen
    first = next(h for h in seen if h["state"] == "connecting")
    assert first["details"]["link"]["state"] == "connecting"


def test_an_exchange_answered_when_done_owes_no_data_until_then() -> None:
    """A Dexter's `F` is answered when the arm's moves have ended: no data is owed meanwhile, so the device is
    not `silent` for it; the budget counts again from the end of that wait, and the reply clears it."""
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.opened(0.0)
    s.data(0.0)
    s.expect_silence(0.5, 10.0)
    assert s.tick(9.0) is LinkState.OPERATIONAL
    assert s.next_deadline(9.0) == pytest.approx(2.5)
    assert s.tick(11.6) is LinkState.SILENT, "the budget counts from the end of the owed silence"
    s2 = LinkSupervisor(POLICY, now=0.0)
    s2.attempt(0.0)
    s2.opened(0.0)
    s2.data(0.0)
    s2.expect_silence(0.5, 10.0)
    s2.data(3.0)  # the reply came early: the usual budget again
    assert s2.tick(4.1) is LinkState.SILENT


def test_data_stamped_where_they_arrived_are_judged_on_their_arrival_not_on_when_they_were_reported() -> None:
    """A helper process stamps its data (an EtherCAT cycle's valid statuses) and the service reports them when it
    looks: data reported late are as old as they are. Older than the budget, they never make `connection` true;
    the silence counts from the last arrival, and health states that age and the budget as they are."""
    now = [0.0]
    shown: list[dict[str, Any]] = []
    link = SupervisedLink(LinkPolicy(liveness_s=0.25), shown.append, clock=lambda: now[0])
    link.attempt()
    link.opened()
    now[0] = 1.0
    link.data(at=0.4)  # seen 0.6 s after it arrived: heard from, not alive now
    assert not [h for h in shown if h["connection"]], shown
    link.data(at=0.95)
    assert shown[-1]["connection"] is True
    now[0] = 1.19
    link.data(at=0.95)  # the same arrival reported again: no news
    assert link.tick() == pytest.approx(0.01) and shown[-1]["connection"] is True
    now[0] = 1.5
    link.data(at=1.0)  # the last data arrived 0.5 s ago: silent, with that age
    h = shown[-1]
    assert h["state"] == "silent" and h["connection"] is False, h
    assert h["error_message"] == "no valid data for 0.5 s (allowed 0.25 s)", h
    assert link.details()["last_data_age_s"] == pytest.approx(0.5)


def test_a_watched_source_keeps_a_link_alive_whoever_looks_first() -> None:
    """The deadline thread reads the link's source before it judges: a thread of the service held up past the budget
    (a loaded host) while the data flow does not make the device `silent`; data that stopped do, at the budget
    after their last arrival."""
    now = [0.0]
    arrived = [0.0]
    shown: list[dict[str, Any]] = []
    link = SupervisedLink(LinkPolicy(liveness_s=0.25), shown.append, clock=lambda: now[0])
    link.watch(lambda: arrived[0])
    link.attempt()
    link.opened()
    link.data(at=0.0)
    n0 = len(shown)
    for t in (0.2, 0.4, 0.6, 0.8):  # nobody reports the data; they arrive all the same
        now[0] = arrived[0] = t
        now[0] += 0.01
        assert link.tick() is not None and shown[-1]["state"] == "operational", shown[-1]
    now[0] = 1.06  # the data stopped at 0.8
    link.tick()
    assert shown[-1]["state"] == "silent" and "0.26 s" in shown[-1]["error_message"], shown[-1]
    assert [h["state"] for h in shown[n0 - 1 :]] == ["operational", "silent"], shown


def test_valid_data_before_the_link_is_said_open_keep_it_operational() -> None:
    """A helper process streams valid data as soon as it is up, and the transport says 'opened' a moment later:
    health stays operational (it flickered back to 'connected', connection false, for one publish)."""
    s = LinkSupervisor(POLICY, now=0.0)
    s.attempt(0.0)
    s.data(0.1)
    s.opened(0.11)
    assert s.health(0.12)["state"] == "operational" and s.details(0.12)["sessions"] == 1


def test_the_age_a_message_states_is_its_age_when_told_not_when_the_state_began() -> None:
    """One rule for every service: a health message that states an age (no data for, never sent in, since it
    opened) states it as of the moment it is told. The state's change is pushed once (no health per tick); every
    later telling (a heartbeat, a stop's overlay) counts the age to then. A fault's text and a service's own text
    are told as given."""
    now = [0.0]
    shown: list[dict[str, Any]] = []
    link = SupervisedLink(LinkPolicy(liveness_s=0.25, probe_period_s=1.0), shown.append, clock=lambda: now[0])
    link.attempt()
    link.opened()
    link.data()
    now[0] = 0.3
    link.tick()
    pushed = shown[-1]["error_message"]
    assert shown[-1]["state"] == "silent" and pushed == "no valid data for 0.3 s (allowed 0.25 s)", shown[-1]
    n = len(shown)
    now[0] = 12.0
    link.tick()
    assert len(shown) == n, "a tick pushes no new health for an age that grew"
    assert link.live_message(pushed) == "no valid data for 12.0 s (allowed 0.25 s)"
    assert link.live_message("the service's own words") == "the service's own words"
    link.closed("reset by peer")  # lost, then unreachable after the budget: its message counts on too
    now[0] = 13.0
    link.tick()
    h = shown[-1]
    assert h["state"] == "unreachable" and h["error_message"].startswith("no valid data from the device for 1.0 s")
    now[0] = 20.0
    assert link.live_message(h["error_message"]).startswith("no valid data from the device for 8.0 s")
    link.fault("not the palm configured")
    link.tick()
    assert link.live_message(shown[-1]["error_message"]) == "not the palm configured"


def test_a_published_health_states_the_age_as_of_its_publishing(echo_node: Node, client: RpcClient) -> None:
    """Through a device: the heartbeat after a cut says how long the device has been silent by then."""
    dev = echo_node.device(f"aged{time.monotonic_ns()}")
    seen: list[dict[str, Any]] = []
    client.subscribe_before(f"{dev.base}/health", lambda m: seen.append(json.loads(m.payload)))
    link = dev.supervise_link(LinkPolicy(liveness_s=0.2))
    link.attempt()
    link.opened()
    link.data()
    assert wait_for(lambda: bool(seen) and seen[-1]["state"] == "silent", 10), seen[-3:]
    t0 = seen[-1]["ts"]
    time.sleep(1.2)
    dev.publish_health()
    assert wait_for(lambda: seen[-1]["ts"] > t0 + 1.0, 10), seen[-2:]
    said = float(seen[-1]["error_message"].split("no valid data for ")[1].split(" s")[0])
    age = seen[-1]["details"]["link"]["last_data_age_s"]
    assert said >= 1.2 and abs(said - age) < 0.15, seen[-1]


def test_no_health_is_queued_while_the_node_is_not_connected(broker_session: Any) -> None:
    """Health changes before the node is connected are not queued in paho (which would send them after the fresh
    health the node publishes at its connect, leaving an older state retained): the retained health after the
    connect is the device's newest."""
    from tests.kit.echo_node import API, build

    node = Node(API, broker_session.settings(node=f"early-{time.monotonic_ns()}", health_interval_s=30))
    stop = build(node, "early")  # the echo service's handlers on device `early`
    dev = node.device("early")
    link = dev.supervise_link(LinkPolicy(liveness_s=5.0))
    link.attempt()
    link.opened()  # connected (the link), then operational, all before the node's MQTT connect
    queued = len(node.session.client._out_messages)  # paho's queue of messages not yet sent
    link.data()
    dev.set_health(details={"early": True})
    assert len(node.session.client._out_messages) == queued, "a health change was queued while not connected"
    client = RpcClient(broker_session.settings(), name=f"early-reader-{time.monotonic_ns()}")
    client.connect()
    try:
        node.start()
        assert node.session.wait_ready(10)
        def retained() -> list[dict[str, Any]]:
            return [json.loads(p) for _, p, _ in client.collect_retained(f"{dev.base}/health")]

        assert wait_for(lambda: bool(retained()), 10)
        got = retained()
        assert got and got[-1]["state"] == "operational" and got[-1]["details"]["early"] is True, got
        time.sleep(0.5)  # anything queued would have followed the connect's publish by now
        again = retained()
        assert again and again[-1]["state"] == "operational", again
    finally:
        stop.set()
        node.stop()
        client.close()
