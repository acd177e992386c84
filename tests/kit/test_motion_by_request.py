"""Commands that move for some requests only (`motion=BY_REQUEST`, docs/kit.md "Stopping everything"), against a real
broker and a real node: the device's `@moves_when` predicate decides per request; a moving request is refused
`stopped` while the bus stop is active and a still one of the same command is answered; a moving request that ran
across the stop gets the device's stop action again (pooled, inline with a `Deferred` rest, and `async def`
handlers); a predicate that raises is the request's error; a node whose such command has no predicate does not
start; the AsyncAPI document says which commands move for which requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from shared import Node, ServiceAPI
from shared.contract import BY_REQUEST, command_errors
from shared.device import handles, moves_when
from shared.dispatch import Deferred
from shared.errors import CommandError, ErrorCode
from shared.messages import StopState
from shared.node import UnboundCommands
from shared.rpc import Reply, RpcClient, wait_for
from shared.settings import KitSettings
from shared.stop import answer_topic, stop_topic
from shared.tools.asyncapi import ContractValidator, build_document
from tests.fixtures import Broker

DEADLINE = 20.0  # generous: the machine is shared


class ByRequestTune(BaseModel):
    target: Literal["speed", "label"] = Field(description="speed moves the device; label does not")
    value: float = 0.0
    hold_s: float = Field(0.0, ge=0, le=5, description="Keep the handler running this long after the write")


class ByRequestTuned(BaseModel):
    speed: float
    label: float


class ByRequestEmpty(BaseModel):
    pass


API = ServiceAPI("motion-request-test", device_doc="a test device that moves for some requests")
TUNE = API.command("tune", ByRequestTune, ByRequestTuned, doc="Set the speed (moves) or the label (still)",
                   motion=BY_REQUEST)
TUNE_INLINE = API.command("tune_inline", ByRequestTune, ByRequestTuned, doc="tune, inline (defers its rest)",
                          motion="request")
TUNE_ASYNC = API.command("tune_async", ByRequestTune, ByRequestTuned, doc="tune, an async def handler",
                         motion=BY_REQUEST)
MOVE = API.command("move", ByRequestTune, ByRequestTuned, doc="Every request moves", motion=True)
READ = API.command("read", ByRequestEmpty, ByRequestTuned, doc="Read-only")
ARM = API.kind("arm", commands=[TUNE, TUNE_INLINE, TUNE_ASYNC, MOVE, READ], doc="moves for some requests")
STILL = API.kind("still", commands=[TUNE, READ], doc="a device whose requests never move (no stop action)")


class Arm:
    """The device: a speed (it moves), a label (it does not), every speed write, every stop action."""

    def __init__(self) -> None:
        self.speed = 0.0
        self.label = 0.0
        self.writes: list[float] = []
        self.stops: list[StopState] = []
        self.lock = threading.Lock()
        self.predicate_threads: list[str] = []

    @moves_when(TUNE)
    @moves_when(TUNE_INLINE)
    @moves_when(TUNE_ASYNC)
    def tune_moves(self, req: ByRequestTune) -> bool:
        self.predicate_threads.append(threading.current_thread().name)
        if req.value == 13:
            raise CommandError(ErrorCode.FORBIDDEN, "13 is refused by the predicate")
        if req.value == 99:
            raise RuntimeError("the predicate broke")
        return req.target == "speed"

    def apply(self, req: ByRequestTune) -> None:
        with self.lock:
            if req.target == "speed":
                self.speed = req.value
                self.writes.append(req.value)
            else:
                self.label = req.value

    def reply(self) -> ByRequestTuned:
        return ByRequestTuned(speed=self.speed, label=self.label)

    @handles(TUNE)
    @handles(MOVE)
    def tune(self, req: ByRequestTune) -> ByRequestTuned:
        self.apply(req)
        time.sleep(req.hold_s)
        return self.reply()

    @handles(TUNE_INLINE, inline=True)
    def tune_inline(self, req: ByRequestTune) -> ByRequestTuned:
        self.apply(req)  # on the network thread; the rest (the hold) on the pool
        if req.hold_s:
            def rest() -> ByRequestTuned:
                time.sleep(req.hold_s)
                return self.reply()
            raise Deferred(rest)
        return self.reply()

    @handles(TUNE_ASYNC)
    async def tune_async(self, req: ByRequestTune) -> ByRequestTuned:
        self.apply(req)
        await asyncio.sleep(req.hold_s)
        return self.reply()

    @handles(READ)
    def read(self, req: ByRequestEmpty) -> ByRequestTuned:
        return self.reply()

    def stop_now(self, stop: StopState) -> None:
        with self.lock:
            self.stops.append(stop)
            self.speed = 0.0
            self.writes.append(0.0)


class Still:
    """A device of the same API whose requests never move (e.g. a GPIO module with no stop outputs)."""

    @moves_when(TUNE)
    def tune_moves(self, req: ByRequestTune) -> bool:
        return False

    @handles(TUNE)
    def tune(self, req: ByRequestTune) -> ByRequestTuned:
        return ByRequestTuned(speed=0.0, label=req.value)

    @handles(READ)
    def read(self, req: ByRequestEmpty) -> ByRequestTuned:
        return ByRequestTuned(speed=0.0, label=0.0)


class Rig:
    def __init__(self, broker: Broker) -> None:
        self.root = f"byreq{time.monotonic_ns()}"
        self.broker = broker
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="service-loop", daemon=True)
        self.loop_thread.start()
        self.node = Node(API, broker.settings(topic_root=self.root, node="byreq", health_interval_s=0.5))
        self.node.attach_loop(self.loop)
        self.arm = Arm()
        dev = self.node.device("arm1", kind=ARM.name)
        dev.bind_all(self.arm)
        # inline: the kit's second stop action (StopLatch.done) runs before the reply of the request that ran across
        # the stop is published, so the test sees it (or its absence) with the reply
        dev.on_stop(self.arm.stop_now, inline=True)
        self.node.device("still1", kind=STILL.name).bind_all(Still())
        self.node.start()
        assert self.node.session.wait_ready(DEADLINE)
        assert self.node.stop_latch.known_event.wait(DEADLINE)
        self.client = RpcClient(broker.settings(topic_root=self.root), name="byreq-test")
        self.client.connect()

    def call(self, command: str, payload: dict[str, Any] | None = None, device: str = "arm1") -> Reply:
        return self.client.call(self.node.name, device, command, payload or {}, timeout=DEADLINE)

    def set_stop(self, active: bool) -> StopState:
        stop = StopState(active=active, source="tester", reason="by-request test", ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        assert wait_for(lambda: self.node.stop_latch.active == active and (
            (a := self.node.stop_latch.answer()) is not None and a.stop_ts == stop.ts
            and not any(d.pending for d in a.devices)), DEADLINE)
        return stop

    def close(self) -> None:
        self.client.session.publish_wait(stop_topic(self.root), b"", qos=1, retain=True)
        self.client.session.publish_wait(answer_topic(self.root, self.node.name), b"", qos=1, retain=True)
        self.client.close()
        self.node.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(5)
        self.loop.close()


@pytest.fixture
def rig(broker_session: Broker) -> Iterator[Rig]:
    r = Rig(broker_session)
    yield r
    r.close()


def code(rep: Reply) -> str:
    return "ok" if rep.ok else str((rep.error or {})["code"])


def message(rep: Reply) -> str:
    return str((rep.error or {}).get("message", ""))


def test_the_document_says_which_commands_move_for_which_requests() -> None:
    for spec in (TUNE, TUNE_INLINE, MOVE):
        codes = command_errors(spec)
        assert ErrorCode.STOPPED in codes and ErrorCode.UNAVAILABLE in codes, spec.name
    assert ErrorCode.STOPPED not in command_errors(READ)
    doc = build_document([API])
    ops = doc["operations"]
    assert ops["motion-request-test_cmd_tune"]["x-robobus"]["motion"] == "request"
    assert ops["motion-request-test_cmd_move"]["x-robobus"]["motion"] == "always"
    assert ops["motion-request-test_cmd_read"]["x-robobus"]["motion"] == "never"
    assert "stopped" in ops["motion-request-test_cmd_tune"]["x-robobus"]["errors"]
    assert "unavailable" in ops["motion-request-test_cmd_tune"]["x-robobus"]["errors"]
    assert "stopped" not in ops["motion-request-test_cmd_read"]["x-robobus"]["errors"]
    ContractValidator(doc)  # the document stays one the validator reads


@pytest.mark.parametrize("command", ["tune", "tune_inline", "tune_async"])
def test_a_moving_request_is_refused_stopped_and_a_still_one_of_the_same_command_answered(
        rig: Rig, command: str) -> None:
    assert code(rig.call(command, {"target": "speed", "value": 3})) == "ok"
    rig.set_stop(True)
    writes = list(rig.arm.writes)
    assert writes[-1] == 0.0  # the stop action
    rep = rig.call(command, {"target": "speed", "value": 5})
    assert code(rep) == "stopped", rep.raw
    assert "by-request test" in message(rep) and "tester" in message(rep)
    assert rig.arm.writes == writes and rig.arm.speed == 0.0  # the handler never ran
    rep = rig.call(command, {"target": "label", "value": 7})
    assert code(rep) == "ok", rep.raw
    assert rep.result == {"speed": 0.0, "label": 7.0}
    assert code(rig.call("move", {"target": "label", "value": 1})) == "stopped"  # motion=True: every request
    assert code(rig.call("read")) == "ok"
    rig.set_stop(False)
    assert code(rig.call(command, {"target": "speed", "value": 2})) == "ok"
    assert rig.arm.speed == 2.0


@pytest.mark.parametrize("command", ["tune", "tune_inline", "tune_async"])
def test_a_moving_request_across_the_stop_gets_the_stop_action_again(rig: Rig, command: str) -> None:
    reply: list[Reply] = []
    t = threading.Thread(target=lambda: reply.append(
        rig.call(command, {"target": "speed", "value": 6, "hold_s": 1.0})))
    t.start()
    assert wait_for(lambda: rig.arm.speed == 6.0, DEADLINE)
    rig.set_stop(True)
    assert len(rig.arm.stops) == 1
    t.join(DEADLINE)
    assert reply and code(reply[0]) == "ok", reply  # admitted before the stop: it ran
    # once at the stop, once more when the request that ran across it returned (before its reply)
    assert len(rig.arm.stops) == 2, rig.arm.stops
    assert rig.arm.speed == 0.0


def test_a_still_request_across_the_stop_gets_no_second_stop_action(rig: Rig) -> None:
    reply: list[Reply] = []
    t = threading.Thread(target=lambda: reply.append(rig.call("tune", {"target": "label", "value": 4, "hold_s": 1.0})))
    t.start()
    assert wait_for(lambda: rig.arm.label == 4.0, DEADLINE)
    rig.set_stop(True)
    t.join(DEADLINE)
    assert reply and code(reply[0]) == "ok"
    assert len(rig.arm.stops) == 1  # a second stop action would have run before the reply


def test_a_predicate_that_raises_is_the_requests_error(rig: Rig) -> None:
    before = dict(rig.node.counters.failed_by_code())
    rep = rig.call("tune", {"target": "speed", "value": 13})
    assert code(rep) == "forbidden" and "13 is refused" in message(rep)
    rep = rig.call("tune_inline", {"target": "speed", "value": 99})
    assert code(rep) == "internal", rep.raw
    rep = rig.call("tune_async", {"target": "speed", "value": 99})
    assert code(rep) == "internal", rep.raw
    after = rig.node.counters.failed_by_code()
    assert after.get("forbidden", 0) == before.get("forbidden", 0) + 1
    assert after.get("internal", 0) == before.get("internal", 0) + 2
    assert rig.arm.writes == []  # no handler ran
    assert code(rig.call("tune", {"target": "speed", "value": 1})) == "ok"  # the node is fine


def test_the_predicate_runs_where_the_handler_does(rig: Rig) -> None:
    rig.call("tune_inline", {"target": "label", "value": 1})
    rig.call("tune_async", {"target": "label", "value": 1})
    rig.call("tune", {"target": "label", "value": 1})
    net, loop, pool = rig.arm.predicate_threads[-3:]
    assert loop == "service-loop" and pool.startswith("cmd"), rig.arm.predicate_threads
    assert net not in ("service-loop",) and not net.startswith("cmd")  # paho's network thread


def test_a_device_whose_requests_may_move_is_not_a_motion_device_by_that_alone(rig: Rig) -> None:
    """A command that moves for some requests makes no motion device: the device's stop action does (a GPIO
    module with no stop outputs is not held by the stop)."""
    assert rig.node.devices["arm1"].motion and not rig.node.devices["still1"].motion
    rig.set_stop(True)
    answer = rig.node.stop_latch.answer()
    assert answer is not None and [d.device for d in answer.devices] == ["arm1"]
    rep = rig.call("tune", {"target": "label", "value": 3}, device="still1")
    assert code(rep) == "ok" and rep.result == {"speed": 0.0, "label": 3.0}


def test_a_node_whose_request_dependent_command_has_no_predicate_does_not_start() -> None:
    class NoPredicate:
        @handles(TUNE)
        def tune(self, req: ByRequestTune) -> ByRequestTuned:
            return ByRequestTuned(speed=0.0, label=0.0)

        @handles(READ)
        def read(self, req: ByRequestEmpty) -> ByRequestTuned:
            return ByRequestTuned(speed=0.0, label=0.0)

    node = Node(API, KitSettings(node="byreq-unbound"))
    node.device("still1", kind=STILL.name).bind_all(Still())
    node.device("still2", kind=STILL.name).bind_all(NoPredicate())
    with pytest.raises(UnboundCommands) as err:
        node.start()  # before the session: nothing is published
    msg = str(err.value)
    assert msg.startswith("motion-request-test: device 'still2' (kind 'still') has no handler for "), msg
    assert "tune's @moves_when predicate" in msg, msg
    assert "still1" not in msg
    assert not node.session.connected.is_set()


def test_a_predicate_is_refused_where_it_makes_no_sense() -> None:
    with pytest.raises(ValueError, match="not declared motion='request'"):
        moves_when(MOVE)
    with pytest.raises(ValueError, match="not declared motion='request'"):
        moves_when(READ)
    with pytest.raises(ValueError, match="synchronous"):
        @moves_when(TUNE)
        async def pred(req: ByRequestTune) -> bool:
            return True
    api = ServiceAPI("motion-request-bad")
    with pytest.raises(ValueError, match="motion must be"):
        api.command("c", ByRequestTune, ByRequestTuned, motion="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="motion must be"):
        api.job("j", ByRequestTune, ByRequestTuned, motion="request")  # type: ignore[arg-type]
    node = Node(API, KitSettings(node="byreq-bind"))
    dev = node.device("arm1", kind=ARM.name)
    with pytest.raises(ValueError, match="takes no moves_when predicate"):
        dev.bind_moves_when(MOVE, lambda r: True)


def test_the_services_declare_the_commands_that_move_for_some_requests() -> None:
    """The four services whose commands move for some requests only declare them so: the AsyncAPI document tells a
    client that those may be refused `stopped` (each service's stop tests hold the behaviour)."""
    from services.dexter_gateway.api import API as DEXTER
    from services.epuck_gateway.api import API as EPUCK
    from services.ethercat_loop.api import API as ETHERCAT
    from services.roi_modules.api import API as ROI

    expected = [(DEXTER, {"set_parameter", "raw"}), (ROI, {"queue_general_packet", "set_pin_mode", "set_pin_output"}),
                (ETHERCAT, {"system_controls", "send_can"}), (EPUCK, {"ascii"})]
    doc = build_document([api for api, _ in expected])
    for api, names in expected:
        assert {n for n, c in api.commands.items() if c.motion == BY_REQUEST} == names, api.service
        for name in names:
            contract = doc["operations"][f"{api.service}_cmd_{name}"]["x-robobus"]
            assert contract["motion"] == "request" and "stopped" in contract["errors"], (api.service, name)
