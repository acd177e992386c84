"""Jobs (accept, progress, result, cancel, busy) and rate-capped, retained state."""

from __future__ import annotations

import json
import threading
import time

from pydantic import BaseModel

from shared import Node, ServiceAPI
from shared.rpc import RpcClient, wait_for
from tests.fixtures import Broker


def test_job_progress_and_result(echo_node: Node, client: RpcClient) -> None:
    progress: list[dict] = []
    rep, result = client.call_job(echo_node.name, "dev1", "count", {"n": 30, "delay_s": 0.01}, progress.append)
    assert rep.ok and "job_id" in rep.result
    assert result is not None and result["ok"] and result["result"] == {"counted": 30}
    assert progress and all(p["job_id"] == rep.result["job_id"] for p in progress)
    assert progress[-1]["done"] <= 30 and progress[0]["phase"] == "counting"


def test_job_cancel_and_busy(echo_node: Node, client: RpcClient) -> None:
    out: dict = {}

    def run() -> None:
        out["rep"], out["result"] = client.call_job(echo_node.name, "dev1", "count",
                                                    {"n": 10000, "delay_s": 0.01}, lambda e: None)

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: bool(echo_node.devices["dev1"].running_jobs()), 5)
    busy = client.call(echo_node.name, "dev1", "count", {"n": 1})
    assert not busy.ok and busy.error and busy.error["code"] == "busy"
    job_id = echo_node.devices["dev1"].running_jobs()[0]
    cancel = client.call(echo_node.name, "dev1", "cancel", {"job_id": job_id})
    assert cancel.ok and cancel.result == {"cancelled": [job_id]}
    t.join(10)
    assert out["result"]["cancelled"] is True and out["result"]["ok"] is False
    assert out["result"]["error"]["code"] == "cancelled", out["result"]  # not `busy`: nothing held it
    missing = client.call(echo_node.name, "dev1", "cancel", {"job_id": "nope"})
    assert not missing.ok and missing.error and missing.error["code"] == "not_found"


class Reading(BaseModel):
    value: int


RATE_API = ServiceAPI("rate-test")
READING = RATE_API.state("reading", Reading, rate_hz=10)


def test_rate_cap_keeps_the_newest_and_retains_it(broker_session: Broker, client: RpcClient) -> None:
    node = Node(RATE_API, broker_session.settings(node="rate1"))
    dev = node.device("d")
    node.start()
    assert node.session.wait_ready(10)
    got: list[int] = []
    client.subscribe_before("robobus/rate1/d/state/reading", lambda m: got.append(json.loads(m.payload)["value"]))
    try:
        for i in range(2000):  # far faster than 10 Hz
            dev.publish(READING, Reading(value=i))
        assert wait_for(lambda: bool(got) and got[-1] == 1999, 3), got
        assert len(got) <= 3, f"rate cap let {len(got)} through a burst"
        retained = client.collect("robobus/rate1/d/state/reading", 2, until=lambda t, p: True)
        assert retained and json.loads(retained[-1][1]) == {"value": 1999} and retained[-1][2]
    finally:
        node.stop()


def test_state_rates_setting_overrides_the_cap(broker_session: Broker) -> None:
    node = Node(RATE_API, broker_session.settings(node="rate2", state_rates={"reading": 1000}))
    slot = node.device("d")._slot(READING)
    assert abs(slot.interval - 0.001) < 1e-9
    node.stop()


def test_health_heartbeat_and_change(echo_node: Node, client: RpcClient) -> None:
    topic = f"robobus/{echo_node.name}/dev1/health"
    seen: list[dict] = []
    client.subscribe_before(topic, lambda m: seen.append(json.loads(m.payload)))
    assert wait_for(lambda: len(seen) >= 2, 3)  # retained copy + heartbeat at 0.5 s
    echo_node.devices["dev1"].set_health(error=True, error_message="overheated")
    assert wait_for(lambda: seen[-1]["error_message"] == "overheated", 2)
    h = seen[-1]
    assert {"connection", "operational", "state", "error", "error_message", "service", "node", "device",
            "version", "ts"} <= set(h)
    assert time.time() - h["ts"] < 5


def test_rate_cap_keeps_its_cadence(broker_session: Broker, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A held-back value sent late must not stretch the period (100 Hz would become ~97 Hz):
    the slot's clock advances by whole intervals. A fake clock makes this exact."""
    import shared.ratecap as ratecap_mod

    clock = [1000.0]
    monkeypatch.setattr(ratecap_mod.time, "monotonic", lambda: clock[0])
    node = Node(RATE_API, broker_session.settings(node="rate3"))  # not started: publishes are just counted
    dev = node.device("d")
    slot = dev._slot(READING)  # 10 Hz cap
    dev.publish(READING, Reading(value=1))
    assert slot.last_sent == 1000.0
    clock[0] = 1000.05
    dev.publish(READING, Reading(value=2))  # too soon: held back, due at 1000.1
    assert slot.has_pending
    clock[0] = 1000.1012  # the flusher gets there 1.2 ms late
    node.flush_schedule.flush(node.send_slot)
    assert not slot.has_pending and abs(slot.last_sent - 1000.1) < 1e-9  # due time, not flush time
    clock[0] = 1000.5  # a long pause: never more than one interval of catch-up, so no burst
    dev.publish(READING, Reading(value=3))
    assert slot.last_sent == 1000.5
    # a publisher on a fixed 10 Hz schedule, its wake-ups 3 ms either side of it: each value goes
    # at once (no hand-over to the flusher), and early ones count at their due time, so 100 values never
    # take less than 99 intervals (the cap holds over the long run)
    sent_at = []
    for k in range(1, 101):
        clock[0] = 1000.5 + 0.1 * k + (0.003 if k % 2 else -0.003)
        dev.publish(READING, Reading(value=k))
        assert not slot.has_pending, f"value {k} held back"
        sent_at.append(slot.last_sent)
    assert sent_at[-1] - sent_at[0] >= 99 * 0.1 - 1e-9
    clock[0] += 0.08  # 20 % of the interval early: held back as before
    dev.publish(READING, Reading(value=0))
    assert slot.has_pending
    node.stop()


def test_a_fixed_schedule_publisher_is_not_held_back_for_its_jitter(broker_session: Broker,
                                                                     monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`publish(at=)`: the slot counts the time the value was meant for, so wake-ups late by up to most of an
    interval (a loaded host) still go at once instead of through the housekeeping thread; without `at`, the
    same jitter is judged against the latest wake-up so far and values are held back."""
    import shared.ratecap as ratecap_mod

    clock = [2000.0]
    monkeypatch.setattr(ratecap_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    node = Node(RATE_API, broker_session.settings(node="rate4"))  # not started: publishes are just counted
    dev = node.device("d")
    slot = dev._slot(READING)  # 10 Hz cap
    late = [0.0, 0.06, 0.0, 0.03, 0.07, 0.0, 0.05]  # seconds after each scheduled time
    held = 0
    for k, d in enumerate(late * 10):
        clock[0] = 2000.0 + 0.1 * k + d
        dev.publish(READING, Reading(value=k), at=2000.0 + 0.1 * k)
        assert not slot.has_pending, f"value {k} held back"
    sent_before = slot.last_sent
    for k, d in enumerate(late * 10, start=len(late) * 10):
        clock[0] = 2000.0 + 0.1 * k + d
        dev.publish(READING, Reading(value=k))
        held += slot.has_pending
        node.flush_schedule.flush(node.send_slot)
    assert held > 0 and sent_before < slot.last_sent
    # the cap still holds: a value meant for less than an interval after the last is held back
    dev.publish(READING, Reading(value=-1), at=slot.last_sent + 0.05)
    assert slot.has_pending
