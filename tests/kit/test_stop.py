"""The bus-wide software stop (shared/stop.py) against a real broker: motion commands refused with `stopped` and
accepted after the release, read-only commands answered throughout, each motion device's stop action called at
once, health `stopped` with source and reason and back on release, a node started under an active stop comes up
stopped, running motion jobs and commands that race the stop, and every message as the AsyncAPI document says."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared import Node
from shared.contract import command_errors
from shared.errors import CommandError, ErrorCode
from shared.messages import StopAnswer, StopState
from shared.rpc import RpcClient, wait_for
from shared.stop import LATER, answer_topic, fleet_stop_topic, stop_topic
from shared.tools.asyncapi import ContractValidator, build_document
from tests.fixtures import Broker
from tests.kit import motion_node
from tests.kit.motion_node import API, Wheel, build

DEADLINE = 20.0  # generous: the machine is shared


class Bus:
    """A test's own topic root on the session broker (the stop is per root: no other test sees this one), a
    client, and what it saw on the root: every message, validated against the AsyncAPI document."""

    def __init__(self, broker: Broker, root: str) -> None:
        self.broker = broker
        self.root = root
        self.client = RpcClient(broker.settings(topic_root=root), name="stop-test")
        self.client.connect()
        self.messages: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.client.subscribe_before(f"{root}/#", self._on)

    def _on(self, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def latest(self, topic: str) -> dict[str, Any] | None:
        with self.lock:
            for t, p in reversed(self.messages):
                if t == topic:
                    return json.loads(p) if p else None
        return None

    def set_stop(self, active: bool, reason: str = "test", source: str = "tester") -> StopState:
        stop = StopState(active=active, source=source, reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def answered(self, node: str, stop: StopState, settled: bool = True) -> dict[str, Any] | None:
        """The node's answer to `stop`, once it has one (and, `settled`, once no device is pending)."""
        a = self.latest(answer_topic(self.root, node))
        if a is None or a["stop_ts"] != stop.ts or a["active"] != stop.active:
            return None
        if settled and any(d["pending"] for d in a["devices"]):
            return None
        return a

    def wait_answer(self, node: str, stop: StopState, settled: bool = True) -> dict[str, Any]:
        assert wait_for(lambda: self.answered(node, stop, settled) is not None, DEADLINE), \
            self.latest(answer_topic(self.root, node))
        a = self.answered(node, stop, settled)
        assert a is not None
        return a

    def health(self, node: str, device: str) -> dict[str, Any] | None:
        return self.latest(f"{self.root}/{node}/{device}/health")

    def validate_all(self) -> None:
        v = ContractValidator(build_document([API]))
        with self.lock:
            msgs = [(t, p) for t, p in self.messages if p and "/_client/" not in t]
        for topic, payload in msgs:
            v.validate(topic, payload)

    def close(self) -> None:
        # leave nothing retained under this root on the shared broker
        with self.lock:
            retained = {t for t, _ in self.messages}
        for t in retained:
            self.client.session.publish(t, b"", qos=1, retain=True)
        self.client.session.publish_wait(stop_topic(self.root), b"", qos=1, retain=True)
        self.client.close()


@pytest.fixture
def bus(broker_session: Broker) -> Iterator[Bus]:
    b = Bus(broker_session, f"stoptest{time.monotonic_ns()}")
    yield b
    b.close()


def start_node(bus: Bus, name: str = "mover", **kw: Any) -> tuple[Node, dict[str, Wheel]]:
    node = Node(API, bus.broker.settings(topic_root=bus.root, node=name, health_interval_s=0.5))
    wheels = build(node, **kw)
    node.start()
    assert node.session.wait_ready(DEADLINE)
    return node, wheels


@pytest.fixture
def mover(bus: Bus) -> Iterator[tuple[Node, dict[str, Wheel]]]:
    node, wheels = start_node(bus)
    assert node.stop_latch.known_event.wait(DEADLINE)
    yield node, wheels
    node.stop()


def call(bus: Bus, node: Node, device: str, command: str, payload: dict[str, Any] | None = None) -> Any:
    return bus.client.call(node.name, device, command, payload or {}, timeout=DEADLINE)


def test_the_contract_says_motion_commands_may_be_stopped() -> None:
    assert ErrorCode.STOPPED.value == "stopped"
    assert {"stopped", "unavailable"} <= {c.value for c in command_errors(motion_node.MOVE)}
    assert "stopped" not in {c.value for c in command_errors(motion_node.READ)}
    doc = build_document([API])
    ops = doc["operations"]
    assert "stopped" in ops["motion-test_cmd_move"]["x-robobus"]["errors"]
    assert "stopped" in ops["motion-test_cmd_drive"]["x-robobus"]["errors"]
    assert "stopped" not in ops["motion-test_cmd_read"]["x-robobus"]["errors"]
    stop = doc["channels"]["stop"]
    assert stop["address"] == "{root}/_stop" and stop["x-robobus"] == {"kind": "stop", "retain": True, "qos": 1}
    v = ContractValidator(doc)
    assert v.validate("site/_stop", StopState(active=True, source="a", ts=1.0).model_dump_json().encode()) == "stop"
    with pytest.raises(AssertionError):
        v.validate("site/_stop", b'{"active": "yes"}')
    assert v.validate("site/n1/_node/state/stop", StopAnswer(
        node="n1", service="s", active=True, stop_ts=1.0, source="a", reason="", received_ts=2.0, devices=[],
        ts=2.0).model_dump_json().encode()) == "stopAnswer"


def test_motion_refused_while_stopped_read_only_answered_and_accepted_after_release(bus: Bus, mover: Any) -> None:
    node, wheels = mover
    assert call(bus, node, "wheel1", "move", {"speed": 3}).ok
    stop = bus.set_stop(True, reason="person in the cell")
    answer = bus.wait_answer(node.name, stop)
    rep = call(bus, node, "wheel1", "move", {"speed": 5})
    assert not rep.ok and rep.error["code"] == "stopped", rep.raw
    assert "person in the cell" in rep.error["message"] and "tester" in rep.error["message"]
    writes = len(wheels["wheel1"].writes)
    # the handler never ran: nothing was written after the stop's own write
    assert wheels["wheel1"].writes[-1][1] == 0.0
    job = call(bus, node, "wheel2", "drive", {"speed": 1})
    assert not job.ok and job.error["code"] == "stopped"
    read = call(bus, node, "wheel1", "read")
    assert read.ok and read.result == {"speed": 0.0}
    assert call(bus, node, "sensor1", "read").ok
    assert len(wheels["wheel1"].writes) == writes
    assert {d["device"] for d in answer["devices"]} == {"wheel1", "wheel2"}  # the motion devices only
    release = bus.set_stop(False, reason="cell clear")
    bus.wait_answer(node.name, release)
    # nothing moves by itself: no write after the release until a new command
    time.sleep(0.2)
    assert len(wheels["wheel1"].writes) == writes and wheels["wheel1"].speed == 0.0
    rep = call(bus, node, "wheel1", "move", {"speed": 2})
    assert rep.ok and rep.result == {"speed": 2.0}
    bus.validate_all()


def test_each_motion_devices_stop_action_at_once_and_health_says_stopped(bus: Bus, mover: Any) -> None:
    node, wheels = mover
    for name in ("wheel1", "wheel2"):
        assert call(bus, node, name, "move", {"speed": 4}).ok
    stop = bus.set_stop(True, reason="drill", source="alice@lab")
    answer = bus.wait_answer(node.name, stop)
    for name, wheel in wheels.items():
        assert len(wheel.stops) == 1, wheel.stops
        _, thread, seen = wheel.stops[0]
        assert seen == stop and thread.startswith("stop-")  # on a thread of its own
        assert wheel.speed == 0.0
        dev = next(d for d in answer["devices"] if d["device"] == name)
        assert dev["stopped"] and not dev["pending"] and dev["error"] == ""
        assert dev["written_ts"] == pytest.approx(wheel.writes[-1][0])
    assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("state") == "stopped", DEADLINE)
    h = bus.health(node.name, "wheel1")
    assert h is not None
    assert (h["operational"], h["error"], h["connection"]) == (False, False, True)
    assert "alice@lab" in h["error_message"] and "drill" in h["error_message"]
    assert h["details"]["stop"]["source"] == "alice@lab" and h["details"]["stop"]["reason"] == "drill"
    # heartbeats keep it stopped; a device without motion is untouched
    assert (bus.health(node.name, "sensor1") or {}).get("state") == "running"
    node.devices["wheel1"].set_health(state="streaming")  # the service's own update does not lift the stop
    time.sleep(0.6)
    assert (bus.health(node.name, "wheel1") or {}).get("state") == "stopped"
    release = bus.set_stop(False)
    bus.wait_answer(node.name, release)
    assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("state") == "streaming", DEADLINE)
    h = bus.health(node.name, "wheel1")
    assert h is not None and h["operational"] is True and "stop" not in h["details"]
    bus.validate_all()


def test_a_running_motion_job_is_cancelled_with_stopped(bus: Bus, mover: Any) -> None:
    node, wheels = mover
    results: list[dict[str, Any]] = []

    def run() -> None:
        _, res = bus.client.call_job(node.name, "wheel2", "drive", {"speed": 2}, lambda ev: None, timeout=DEADLINE)
        results.append(res or {})

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: len(wheels["wheel2"].writes) >= 3, DEADLINE)
    stop = bus.set_stop(True, reason="job test")
    bus.wait_answer(node.name, stop)
    t.join(DEADLINE)
    assert results and results[0]["ok"] is False and results[0]["error"]["code"] == "stopped", results
    assert "job test" in results[0]["error"]["message"]
    # the job wrote after the stop action ran? then the kit ran the stop action again when the job ended
    assert wheels["wheel2"].writes[-1][1] == 0.0
    assert wheels["wheel2"].speed == 0.0


def test_a_motion_command_running_across_the_stop_gets_the_stop_action_again(bus: Bus, mover: Any) -> None:
    node, wheels = mover
    reply: list[Any] = []
    t = threading.Thread(target=lambda: reply.append(call(bus, node, "wheel1", "move", {"speed": 6, "hold_s": 1.0})))
    t.start()
    assert wait_for(lambda: wheels["wheel1"].speed == 6.0, DEADLINE)
    stop = bus.set_stop(True, reason="race")
    bus.wait_answer(node.name, stop)
    t.join(DEADLINE)
    assert reply and reply[0].ok  # admitted before the stop: it ran
    # once at the stop, once more when the command that ran across it returned
    assert wait_for(lambda: len(wheels["wheel1"].stops) == 2, DEADLINE), wheels["wheel1"].stops
    assert len(wheels["wheel2"].stops) == 1
    assert wheels["wheel1"].speed == 0.0


def test_a_write_reported_later_shows_pending_then_written(bus: Bus) -> None:
    node, wheels = start_node(bus, name="later", later=("wheel2",))
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        stop = bus.set_stop(True, reason="deadman")
        first = bus.wait_answer(node.name, stop, settled=False)
        final = bus.wait_answer(node.name, stop)
        by = {d["device"]: d for d in final["devices"]}
        assert by["wheel2"]["written_ts"] == pytest.approx(wheels["wheel2"].writes[-1][0])
        assert by["wheel1"]["written_ts"] is not None
        assert any(d["pending"] for d in first["devices"]) or final is first
        h = bus.health(node.name, "wheel2")
        assert wait_for(lambda: ((bus.health(node.name, "wheel2") or {}).get("details", {}).get("stop", {})
                                 .get("written_ts")) is not None, DEADLINE), h
    finally:
        node.stop()


def test_a_failed_write_reported_later_stamps_no_write_time(bus: Bus) -> None:
    """`stop_written(error=...)`: the stop did not reach the device, so the answer has the error and no
    `written_ts` (a time there would tell an operator the device was stopped)."""
    node, _ = start_node(bus, name="failing", devices=("wheel1",), sensors=())
    dev = node.devices["wheel1"]
    dev.on_stop(lambda stop: LATER)
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        stop = bus.set_stop(True, reason="deadman")
        bus.wait_answer(node.name, stop, settled=False)
        dev.stop_written(error="the robot's socket is closed")
        final = bus.wait_answer(node.name, stop)
        entry = {d["device"]: d for d in final["devices"]}["wheel1"]
        assert entry["error"] == "the robot's socket is closed" and entry["written_ts"] is None, entry
    finally:
        node.stop()


def test_a_motion_device_made_during_an_active_stop_is_stopped_at_once(bus: Bus) -> None:
    """A robot found, or a module added, while the stop is active: its stop action runs when it is given one,
    the node's answer lists it, its health says stopped, and its motion commands are refused."""
    node, _ = start_node(bus, name="grows", devices=("wheel1",), sensors=())
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        stop = bus.set_stop(True, reason="found later")
        bus.wait_answer(node.name, stop)
        late = build(node, devices=("wheel9",), sensors=())  # binds its motion command, then its stop action
        final = bus.wait_answer(node.name, stop)
        assert wait_for(lambda: bool(late["wheel9"].stops), DEADLINE)
        assert wait_for(lambda: {d["device"]: d for d in (bus.answered(node.name, stop) or final)["devices"]}
                        .get("wheel9", {}).get("written_ts") is not None, DEADLINE), bus.latest(
                            answer_topic(bus.root, node.name))
        entry = {d["device"]: d for d in bus.wait_answer(node.name, stop)["devices"]}["wheel9"]
        assert entry["stopped"] and not entry["error"], entry
        assert wait_for(lambda: (bus.health(node.name, "wheel9") or {}).get("state") == "stopped", DEADLINE)
        rep = call(bus, node, "wheel9", "move", {"speed": 2})
        assert not rep.ok and rep.error["code"] == "stopped"
        assert all(speed == 0.0 for _, speed in late["wheel9"].writes)
    finally:
        node.stop()


def test_a_node_started_under_an_active_stop_comes_up_stopped(bus: Bus, broker_session: Broker) -> None:
    """The retained stop is read before the first motion command is accepted: a client that commands the node
    the moment it comes online gets `unavailable` (stop state not yet read) or `stopped`, never a motion."""
    stop = bus.set_stop(True, reason="set before start")
    node = Node(API, broker_session.settings(topic_root=bus.root, node="late", health_interval_s=0.5))
    wheels = build(node)
    # before it is connected, the node has not read the stop: a motion command is refused before its handler
    with pytest.raises(CommandError) as err:
        node.dispatcher.dispatch("wheel1", "move", b'{"speed": 1}')
    assert err.value.code == ErrorCode.UNAVAILABLE
    assert node.dispatcher.dispatch("wheel1", "read", b"{}") == b'{"speed":0.0}'
    codes: list[str] = []
    online = threading.Event()

    def on_status(msg: mqtt.MQTTMessage) -> None:
        if msg.payload and json.loads(msg.payload).get("online"):
            online.set()

    bus.client.subscribe_before(f"{bus.root}/late/status", on_status)
    node.start()
    try:
        assert online.wait(DEADLINE)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # command it from the first moment it is online
            rep = bus.client.call("late", "wheel1", "move", {"speed": 9}, timeout=DEADLINE)
            codes.append(str(rep.error["code"]) if rep.error else "ok")
        assert set(codes) <= {"unavailable", "stopped"} and codes[-1] == "stopped", codes
        assert all(speed == 0.0 for _, speed in wheels["wheel1"].writes)
        answer = bus.wait_answer("late", stop)
        assert {d["device"] for d in answer["devices"] if d["stopped"]} == {"wheel1", "wheel2"}
        assert wait_for(lambda: (bus.health("late", "wheel1") or {}).get("state") == "stopped", DEADLINE)
    finally:
        node.stop()


def test_a_motion_command_before_the_stop_state_is_known_waits_for_it(bus: Bus, broker_session: Broker,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that acts on a device's health before the node's birth: its motion command waits for the stop
    state (no stop here) and runs, instead of a refusal it would have to retry."""
    import shared.stop as stop_mod

    monkeypatch.setattr(stop_mod, "ADMIT_WAIT_S", DEADLINE)  # the connect may be slow on a busy machine
    node = Node(API, broker_session.settings(topic_root=bus.root, node="eager", health_interval_s=0.5))
    wheels = build(node)
    out: list[bytes] = []
    early = threading.Thread(target=lambda: out.append(node.dispatcher.dispatch("wheel1", "move", b'{"speed": 3}')))
    early.start()  # before the node is connected: it waits in the gate
    time.sleep(0.2)
    assert not out and not wheels["wheel1"].writes
    node.start()
    try:
        early.join(DEADLINE)
        assert out, "the early command was refused or never returned"
        assert wheels["wheel1"].writes and wheels["wheel1"].writes[-1][1] == 3.0
    finally:
        node.stop()


def test_without_a_stop_the_node_knows_by_its_round_trip(bus: Bus, broker_session: Broker) -> None:
    """No retained stop: the node learns so from the message it sends itself after its subscriptions."""
    node, _ = start_node(bus, name="free")
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        assert node.stop_latch.state is None
        assert call(bus, node, "wheel1", "move", {"speed": 1}).ok
    finally:
        node.stop()


def test_the_retained_stop_comes_before_a_message_sent_after_the_suback(bus: Bus, broker_session: Broker) -> None:
    """What the start-up relies on, asked of the broker itself: a subscription's retained message is delivered
    before a message the client sends itself once the SUBACK is in (same connection, QoS 1)."""
    stop = bus.set_stop(True, reason="order")
    for i in range(20):
        assert _retained_then_own(broker_session, bus.root, i)
    assert stop.active


def _retained_then_own(broker: Broker, root: str, i: int) -> bool:
    got: list[str] = []
    suback = threading.Event()
    done = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"order-{i}-{time.monotonic_ns()}",
                    protocol=mqtt.MQTTv5)
    c.on_subscribe = lambda *a: suback.set()

    def on_message(client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        got.append(msg.topic)
        if msg.topic.endswith("/self"):
            done.set()
    c.on_message = on_message
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        c.subscribe([(stop_topic(root), 1), (f"{root}/order/self", 1)])
        assert suback.wait(DEADLINE)
        c.publish(f"{root}/order/self", b"x", qos=1)
        assert done.wait(DEADLINE)
        assert got == [stop_topic(root), f"{root}/order/self"], got
    finally:
        c.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        c.loop_stop()
    return True


def test_an_unreadable_stop_message_holds_the_stop_until_a_valid_release(bus: Bus, mover: Any) -> None:
    node, wheels = mover
    before = node.counters.decode_errors
    bus.client.session.publish_wait(stop_topic(bus.root), b'{"active": "maybe"', qos=1, retain=True)
    assert wait_for(lambda: node.stop_latch.active, DEADLINE)
    assert node.counters.decode_errors == before + 1
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped" and "unreadable" in rep.error["message"]
    assert wait_for(lambda: len(wheels["wheel1"].stops) == 1, DEADLINE)
    release = bus.set_stop(False)
    bus.wait_answer(node.name, release)
    assert call(bus, node, "wheel1", "move", {"speed": 1}).ok


def test_stop_actions_run_where_the_service_asks_and_a_failure_is_reported(bus: Bus, broker_session: Broker) -> None:
    """Own thread (default), the MQTT network thread (`inline`), the service's loop (`async def`); an action that
    raises is reported in the answer and the health, and the device's motion commands are refused all the same."""
    import asyncio

    node = Node(API, broker_session.settings(topic_root=bus.root, node="where", health_interval_s=0.5))
    build(node, devices=("wheel1",), sensors=())
    ran: dict[str, str] = {}
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="service-loop", daemon=True)
    loop_thread.start()
    node.attach_loop(loop)
    inline = node.device("inline", kind=motion_node.MOVER.name)
    inline.bind(motion_node.MOVE, lambda r: motion_node.MotionSpeed(speed=r.speed))
    inline.on_stop(lambda stop: ran.__setitem__("inline", threading.current_thread().name), inline=True)

    async def on_loop(stop: StopState) -> float:
        ran["async"] = threading.current_thread().name
        await asyncio.sleep(0)
        return 123.0

    node.device("async", kind=motion_node.MOVER.name).on_stop(on_loop)
    node.device("async").bind(motion_node.MOVE, lambda r: motion_node.MotionSpeed(speed=r.speed))

    def broken(stop: StopState) -> None:
        raise OSError("port gone")

    node.device("broken", kind=motion_node.MOVER.name).on_stop(broken)
    node.device("broken").bind(motion_node.MOVE, lambda r: motion_node.MotionSpeed(speed=r.speed))
    node.start()
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        net = node.stop_latch.session.client._thread  # inline: the stop connection's own network thread
        assert net is not None and net is not node.session.client._thread
        stop = bus.set_stop(True, reason="where")
        answer = bus.wait_answer("where", stop)
        by = {d["device"]: d for d in answer["devices"]}
        assert set(by) == {"wheel1", "inline", "async", "broken"}
        assert ran["inline"] == net.name and ran["async"] == "service-loop"
        assert by["async"]["written_ts"] == 123.0
        assert by["broken"]["error"] == "OSError: port gone" and by["broken"]["written_ts"] is None
        assert wait_for(lambda: "port gone" in (bus.health("where", "broken") or {}).get("error_message", ""),
                        DEADLINE)
        rep = bus.client.call("where", "broken", "move", {"speed": 1}, timeout=DEADLINE)
        assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped"
    finally:
        node.stop()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        loop.close()


def test_a_node_keeps_an_active_stop_across_a_lost_broker(broker: Broker) -> None:
    """The test broker keeps nothing across a restart (no persistence): the retained stop is gone when the node
    reconnects, and the node still holds it; a node that had no stop does not accept motion before it has read the
    stop state again."""
    root = f"stoploss{time.monotonic_ns()}"
    node = Node(API, broker.settings(topic_root=root, node="keeper", mqtt_reconnect_min_s=0.1,
                                     mqtt_reconnect_max_s=0.5))
    wheels = build(node, devices=("wheel1",), sensors=())
    node.start()
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        with RpcClient(broker.settings(topic_root=root), name="stop-loss") as c:
            c.session.publish_wait(stop_topic(root), StopState(active=True, source="t", reason="before loss",
                                                               ts=time.time()).model_dump_json(), retain=True)
        assert wait_for(lambda: node.stop_latch.active, DEADLINE)
        reconnects = node.session.reconnects
        broker.restart()
        assert wait_for(lambda: node.session.reconnects > reconnects and node.session.ready.is_set(), DEADLINE)
        with RpcClient(broker.settings(topic_root=root), name="stop-loss") as c:
            assert not [p for t, p, r in c.collect_retained(stop_topic(root)) if r]  # the broker forgot it
            rep = c.call("keeper", "wheel1", "move", {"speed": 1}, timeout=DEADLINE)
            assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", rep.raw
            assert "before loss" in rep.error["message"]
            assert all(speed == 0.0 for _, speed in wheels["wheel1"].writes)
            c.session.publish_wait(stop_topic(root), StopState(active=False, source="t", ts=time.time())
                                   .model_dump_json(), retain=True)
            assert wait_for(lambda: not node.stop_latch.active, DEADLINE)
            assert c.call("keeper", "wheel1", "move", {"speed": 1}, timeout=DEADLINE).ok
        # lost again with no stop: unknown until the round trip after the reconnect, then motion again
        broker.kill()
        assert wait_for(lambda: not node.stop_latch.known, DEADLINE)
        with pytest.raises(CommandError) as err:
            node.dispatcher.dispatch("wheel1", "move", b'{"speed": 2}')
        assert err.value.code == ErrorCode.UNAVAILABLE
        reconnects = node.session.reconnects
        broker.start()
        assert wait_for(lambda: node.stop_latch.known, DEADLINE)
        # the stop is read on a connection of its own: the command subscription, on the main one, may come later
        # (a command sent before it is in is dropped by the broker, unanswered)
        assert wait_for(lambda: node.session.reconnects > reconnects and node.session.ready.is_set(), DEADLINE)
        with RpcClient(broker.settings(topic_root=root), name="stop-loss") as c:
            assert c.call("keeper", "wheel1", "move", {"speed": 2}, timeout=DEADLINE).ok
    finally:
        node.stop()


def test_a_release_older_than_the_active_stop_is_stale_and_ignored(bus: Bus, mover: Any) -> None:
    """A fleet centre's retained release, sent down again when its bridge reconnects, must not lift a newer stop
    that the site's operator set meanwhile: a release older than the active stop is ignored (and counted)."""
    node, _wheels = mover
    old_release = StopState(active=False, source="centre", reason="release", ts=time.time() - 60)
    stop = bus.set_stop(True, reason="person in the cell", source="site operator")
    bus.wait_answer(node.name, stop)
    before = node.counters.decode_errors
    assert bus.client.session.publish_wait(stop_topic(bus.root), old_release.model_dump_json(), qos=1, retain=True)
    assert wait_for(lambda: node.counters.decode_errors == before + 1, DEADLINE)
    assert node.stop_latch.active
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped"
    release = bus.set_stop(False)  # a current release lifts it
    bus.wait_answer(node.name, release)
    assert call(bus, node, "wheel1", "move", {"speed": 1}).ok


def test_a_node_says_online_only_once_it_knows_the_stop_state(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """The birth waits for the stop's state (one round trip after the subscriptions), so a client that sees the
    node online is never answered `unavailable` for a motion command; a node that cannot learn it (here: its
    round trip suppressed) still says online, after BIRTH_WAIT_MAX_S, and answers `unavailable` meanwhile."""
    import shared.node as node_mod
    from shared.stop import StopLatch

    # a node that knows: online, and a motion command at once is accepted
    node, _ = start_node(bus, name="born")
    try:
        status = f"{bus.root}/born/status"
        assert wait_for(lambda: (bus.latest(status) or {}).get("online") is True, DEADLINE)
        assert node.stop_latch.known
        assert call(bus, node, "wheel1", "move", {"speed": 1}).ok
    finally:
        node.stop()
    # a node that cannot know: no birth before the wait is over
    monkeypatch.setattr(StopLatch, "_on_connect", lambda self: None)
    t0 = time.monotonic()
    node2, _ = start_node(bus, name="unborn")
    try:
        status2 = f"{bus.root}/unborn/status"
        assert wait_for(lambda: (bus.latest(status2) or {}).get("online") is True, DEADLINE)
        assert time.monotonic() - t0 >= node_mod.BIRTH_WAIT_MAX_S * 0.9, "online before the stop state was known"
        rep = call(bus, node2, "wheel1", "move", {"speed": 1})
        assert not rep.ok and rep.error["code"] == "unavailable"
    finally:
        node2.stop()


def _set(bus: Bus, topic: str, active: bool, source: str, reason: str = "", ts: float | None = None) -> StopState:
    stop = StopState(active=active, source=source, reason=reason, ts=time.time() if ts is None else ts)
    assert bus.client.session.publish_wait(topic, stop.model_dump_json(), qos=1, retain=True)
    return stop


def test_the_fleet_channel_is_a_latch_of_its_own(bus: Bus, mover: Any) -> None:
    """{root}/_stop/fleet (the centre's stop, as the site's bridge brings it in) stops the node on its own; a release
    on one channel lifts only that channel; the node moves again only once both are released, and never by itself.
    The answer and the health say which channel holds the node."""
    node, wheels = mover
    site, fleet = stop_topic(bus.root), fleet_stop_topic(bus.root)
    stop = _set(bus, fleet, True, "centre-operator", "fleet drill")
    answer = bus.wait_answer(node.name, stop)
    assert answer["channel"] == "fleet" and all(d["stopped"] for d in answer["devices"]), answer
    assert wheels["wheel1"].stops and wheels["wheel1"].stops[-1][2] == stop
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped", rep.raw
    assert "fleet drill" in rep.error["message"] and fleet in rep.error["message"], rep.error
    assert wait_for(lambda: ((bus.health(node.name, "wheel1") or {}).get("details", {}).get("stop", {})
                             .get("channel")) == "fleet", DEADLINE), bus.health(node.name, "wheel1")
    # the site's release (newer than the fleet's stop) does not lift the fleet's stop
    release = _set(bus, site, False, "site-operator")
    a = bus.wait_answer(node.name, release)
    assert a["channel"] == "site" and all(d["stopped"] for d in a["devices"]), a
    assert "still stopped by the fleet stop" in a["reason"], a
    assert node.stop_latch.active and node.stop_latch.channel == "fleet"
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped", rep.raw
    # and the other way: the site's stop, then the fleet's release: still stopped, by the site
    site_stop = _set(bus, site, True, "site-operator", "site drill")
    bus.wait_answer(node.name, site_stop)
    assert node.stop_latch.channel == "site"  # the newest active stop is the effective one
    fleet_release = _set(bus, fleet, False, "centre-operator")
    a = bus.wait_answer(node.name, fleet_release)
    assert a["channel"] == "fleet" and all(d["stopped"] for d in a["devices"]), a
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped" and "site drill" in rep.error["message"], rep.raw
    assert wait_for(lambda: ((bus.health(node.name, "wheel1") or {}).get("details", {}).get("stop", {})
                             .get("channel")) == "site", DEADLINE), bus.health(node.name, "wheel1")
    writes = len(wheels["wheel1"].writes)
    # both released: released, and nothing moved by itself
    released = _set(bus, site, False, "site-operator")
    a = bus.wait_answer(node.name, released)
    assert a["channel"] == "site" and not any(d["stopped"] for d in a["devices"]), a
    assert not node.stop_latch.active
    assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("state") != "stopped", DEADLINE)
    assert len(wheels["wheel1"].writes) == writes
    assert call(bus, node, "wheel1", "move", {"speed": 2}).ok
    bus.validate_all()


def test_a_stale_release_on_one_channel_is_ignored_by_that_channel(bus: Bus, mover: Any) -> None:
    """Each channel has its own stale-release guard and its own fail-safe parsing."""
    node, _ = mover
    fleet = fleet_stop_topic(bus.root)
    stop = _set(bus, fleet, True, "centre-operator")
    bus.wait_answer(node.name, stop)
    before = node.counters.decode_errors
    _set(bus, fleet, False, "centre-operator", ts=stop.ts - 60)
    assert wait_for(lambda: node.counters.decode_errors == before + 1, DEADLINE)
    assert node.stop_latch.active
    assert bus.client.session.publish_wait(fleet, b"{garbage", qos=1, retain=True)
    assert wait_for(lambda: node.counters.decode_errors == before + 2, DEADLINE)
    rep = call(bus, node, "wheel1", "move", {"speed": 1})
    assert not rep.ok and rep.error["code"] == "stopped" and "unreadable" in rep.error["message"], rep.raw
    release = _set(bus, fleet, False, "centre-operator")
    bus.wait_answer(node.name, release)
    assert call(bus, node, "wheel1", "move", {"speed": 1}).ok


@pytest.mark.parametrize("stopped_on", ["site", "fleet"])
def test_a_node_started_with_one_channel_stopped_and_the_other_released_comes_up_stopped(
        bus: Bus, broker_session: Broker, stopped_on: str) -> None:
    """The case of a site whose bridge reconnected after its operator stopped it: the site's retained stop on
    {root}/_stop and the centre's retained release on {root}/_stop/fleet (newer: the release never lifts the
    other channel). A node that starts then comes up stopped; so with the channels the other way round."""
    site, fleet = stop_topic(bus.root), fleet_stop_topic(bus.root)
    stop_topic_, release_topic = (site, fleet) if stopped_on == "site" else (fleet, site)
    stop = _set(bus, stop_topic_, True, f"{stopped_on}-operator", "held")
    _set(bus, release_topic, False, "other-operator", ts=stop.ts + 10)
    node = Node(API, broker_session.settings(topic_root=bus.root, node="starter", health_interval_s=0.5))
    wheels = build(node)
    node.start()
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        assert node.stop_latch.active and node.stop_latch.channel == stopped_on
        rep = bus.client.call("starter", "wheel1", "move", {"speed": 9}, timeout=DEADLINE)
        assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", rep.raw
        assert all(speed == 0.0 for _, speed in wheels["wheel1"].writes)
        assert wait_for(lambda: bool(wheels["wheel1"].stops), DEADLINE)
        assert wait_for(lambda: (bus.health("starter", "wheel1") or {}).get("state") == "stopped", DEADLINE)
    finally:
        node.stop()
