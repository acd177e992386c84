"""The message-level contract of the AsyncAPI document, checked against what the running services do:
the reply topic convention, the reply's QoS, retained and QoS per channel, job or not (a job answers
with a job id, streams progress and ends with exactly one result), and that every error code a command
answers with is one the document lists for it (`x-robobus` on each command operation)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import jsonschema
import pytest

from services.can_bootloader.sim import make_intel_hex
from shared.rpc import wait_for
from shared.tools.asyncapi import REPLY_QOS, ContractValidator, build_document
from shared.tools.localbroker import NodeProcess
from tests.contract.conftest import CAN_NODE, EPUCK_NODE, GHOST, ROBOT, Seen, Stack, Tap

CAN_DEVICE = "motors"  # can-bootloader's default device
SMALL_HEX = make_intel_hex(0x1000, 0x13FF)
DEVICES = {EPUCK_NODE: ROBOT, CAN_NODE: CAN_DEVICE}
REPLY_WAIT_S = 20.0  # generous: a reply normally takes about a millisecond
pytestmark = pytest.mark.timeout(300)  # the stack (three processes) starts in the first test's setup


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_document()


@pytest.fixture(scope="module")
def validator(doc: dict[str, Any]) -> ContractValidator:
    return ContractValidator(doc)


def commands(doc: dict[str, Any], service: str) -> dict[str, dict[str, Any]]:
    """{command name: its operation} for one service, from the document."""
    prefix = f"{service}_cmd_"
    return {oid.removeprefix(prefix): op for oid, op in doc["operations"].items()
            if oid.startswith(prefix) and "x-robobus" in op}


class Caller:
    """Commands over a raw MQTT 5 client: the reply topic and correlation are ours to check."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.reply_topic = f"robobus/_client/{tap.name}/reply"
        tap.subscribe(self.reply_topic)

    def call(self, node: str, device: str, command: str, payload: Any, qos: int = 1) -> Seen:
        corr = uuid.uuid4().bytes
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.tap.publish(f"robobus/{node}/{device}/cmd/{command}", body, qos, response_topic=self.reply_topic,
                         correlation=corr)
        assert wait_for(lambda: any(s.correlation == corr for s in self.tap.on(self.reply_topic)), REPLY_WAIT_S), \
            f"no reply to {node}/{device}/cmd/{command}"
        return next(s for s in self.tap.on(self.reply_topic) if s.correlation == corr)


@pytest.fixture
def caller(stack: Stack) -> Any:
    tap = stack.tap("contract-caller")
    yield Caller(tap)
    tap.close()


def test_every_command_answers_on_the_reply_topic_convention_with_a_declared_code(
        stack: Stack, doc: dict[str, Any], validator: ContractValidator, caller: Caller) -> None:
    """Every command of the running services, sent garbage two ways: with an MQTT 5 Response Topic (reply
    there, Correlation Data echoed) and without one (reply on `<request topic>/reply`)."""
    plain = stack.tap("contract-plain")
    try:
        checked = 0
        for node, device in DEVICES.items():
            ops = commands(doc, node)
            assert ops, f"no command of {node} in the document"
            for name in sorted(ops):
                cid = f"{node}_cmd_{name}"
                reply = caller.call(node, device, name, b"\xff not json")
                validator.validate_reply(doc, cid, reply.payload)  # schema + the code is declared
                assert json.loads(reply.payload)["error"]["code"] == "invalid_request"

                topic = f"robobus/{node}/{device}/cmd/{name}"
                plain.subscribe(f"{topic}/reply")
                plain.publish(topic, b"[1, 2]", qos=1)
                got = plain.wait(f"{topic}/reply", 1, REPLY_WAIT_S)
                assert got, f"no reply on {topic}/reply"
                validator.validate_reply(doc, cid, got[0].payload)
                checked += 1
        assert checked >= 10
    finally:
        plain.close()


@pytest.mark.parametrize("qos, expected", [(0, 0), (1, 1), (2, 1)])
def test_the_reply_goes_at_the_request_qos(stack: Stack, doc: dict[str, Any], caller: Caller, qos: int,
                                           expected: int) -> None:
    assert doc["channels"][f"{EPUCK_NODE}_cmd_set_speed_reply"]["x-robobus"]["qos"] == 1  # at most 1
    assert REPLY_QOS in doc["channels"][f"{EPUCK_NODE}_cmd_set_speed_reply"]["description"]
    reply = caller.call(EPUCK_NODE, ROBOT, "set_speed", {"left": 0, "right": 0}, qos=qos)
    assert json.loads(reply.payload)["ok"] is True
    assert reply.qos == expected  # the caller subscribed at QoS 2: it gets the publisher's QoS


def test_a_stale_retained_request_is_not_acted_on(stack: Stack, caller: Caller) -> None:
    """A request left retained on a command topic reaches a node that subscribes later with the retain
    flag: the node must not act on it (it is stale); a fresh request is answered."""
    node = f"epuck-late-{time.monotonic_ns() % 10**6}"
    topic = f"robobus/{node}/{GHOST}/cmd/set_speed"
    corr = b"stale-retained-request"
    caller.tap.publish(topic, b'{"left": 100, "right": 100}', 1, response_topic=caller.reply_topic,
                       correlation=corr, retain=True)
    ghost_only = json.dumps([{"id": GHOST, "host": "127.0.0.1", "port": 9}])  # any command: `unavailable`
    late = NodeProcess(["-m", "services.epuck_gateway"],
                       {"ROBOBUS_MQTT_URL": stack.url, "ROBOBUS_NODE": node, "ROBOBUS_EPUCK_ROBOTS": ghost_only})
    try:
        status = stack.tap("contract-late")
        status.subscribe(f"robobus/{node}/status")
        assert wait_for(lambda: any(json.loads(s.payload)["online"] for s in status.on(f"robobus/{node}/status")),
                        30), late.text()
        status.close()
        fresh = caller.call(node, GHOST, "set_speed", {"left": 0, "right": 0})
        assert json.loads(fresh.payload)["error"]["code"] == "unavailable"
        time.sleep(0.5)
        assert not [s for s in caller.tap.on(caller.reply_topic) if s.correlation == corr], "acted on a stale request"
    finally:
        caller.tap.publish(topic, b"", 1, retain=True)  # clear it
        late.stop()


def test_retain_and_qos_per_channel_are_what_the_document_says(stack: Stack, doc: dict[str, Any],
                                                               validator: ContractValidator,
                                                               caller: Caller) -> None:
    live = stack.tap("contract-live")
    try:
        live.subscribe("robobus/#")
        # make events too: a job (progress, flash_report, job_result) and the robot's states
        accepted = json.loads(caller.call(CAN_NODE, CAN_DEVICE, "flash", {"board": 14, "hex": SMALL_HEX}).payload)
        job_id = accepted["result"]["job_id"]
        assert wait_for(lambda: any(json.loads(s.payload).get("job_id") == job_id
                                    for s in live.on(f"robobus/{CAN_NODE}/{CAN_DEVICE}/event/job_result")), 60)
        time.sleep(2.5)  # > 2 health heartbeats (1 s here) and node stats
        live_msgs = [s for s in live.seen if "/_client/" not in s.topic and not s.topic.endswith("/reply")]
    finally:
        live.close()
    channels: dict[str, set[str]] = {}
    for s in live_msgs:
        if not s.payload:
            continue  # a retained message being cleared
        cid = validator.validate(s.topic, s.payload)
        ch = doc["channels"][cid]["x-robobus"]
        assert s.qos == ch["qos"], f"{s.topic}: delivered at QoS {s.qos}, the document says {ch['qos']}"
        op = next(o for o in doc["operations"].values() if o["channel"]["$ref"] == f"#/channels/{cid}")
        assert op["bindings"]["mqtt"]["qos"] == ch["qos"] and op["bindings"]["mqtt"]["retain"] == ch["retain"]
        channels.setdefault(cid, set()).add(s.topic)
    # every kind of channel was seen: the kit's, state, binary state, events of a job
    assert {"status", "health", "nodeStats", f"{EPUCK_NODE}_state_sensors", f"{EPUCK_NODE}_state_image",
            f"{CAN_NODE}_event_job_progress", f"{CAN_NODE}_event_job_result"} <= set(channels)
    should_be_retained = {t for cid, topics in channels.items() if doc["channels"][cid]["x-robobus"]["retain"]
                          for t in topics}

    # a new subscriber gets the retained ones (the broker sends them after the SUBACK, among live traffic
    # that a loaded machine may make slow to read: wait for them rather than for a fixed time)
    fresh = stack.tap("contract-fresh")
    try:
        fresh.subscribe("robobus/#")
        wait_for(lambda: should_be_retained <= {s.topic for s in list(fresh.seen) if s.retain}, 30)
        retained = {s.topic: s for s in list(fresh.seen) if s.retain}
    finally:
        fresh.close()

    for cid, topics in channels.items():
        is_retained = doc["channels"][cid]["x-robobus"]["retain"]
        for topic in topics:
            if is_retained:
                assert topic in retained, f"{topic} ({cid}) is documented retained but was not retained"
            else:
                assert topic not in retained, f"{topic} ({cid}) is documented not retained but was retained"


def test_a_job_answers_with_a_job_id_streams_progress_and_ends_with_one_result(
        stack: Stack, doc: dict[str, Any], validator: ContractValidator, caller: Caller) -> None:
    ops = commands(doc, CAN_NODE)
    jobs = {n for n, op in ops.items() if op["x-robobus"]["job"]}
    assert jobs == {"flash", "flash_many"}
    events = stack.tap("contract-events")
    try:
        events.subscribe(f"robobus/{CAN_NODE}/{CAN_DEVICE}/event/#")
        requests = {"flash": {"board": 4, "hex": SMALL_HEX}, "flash_many": {"boards": [4, 14], "hex": SMALL_HEX}}
        for name in sorted(jobs):
            contract = ops[name]["x-robobus"]
            assert contract["events"] == ["job_progress", "job_result"] and contract["cancel"] == "cmd/cancel"
            reply = caller.call(CAN_NODE, CAN_DEVICE, name, requests[name])
            validator.validate_reply(doc, f"{CAN_NODE}_cmd_{name}", reply.payload)
            accepted = json.loads(reply.payload)["result"]
            assert accepted["command"] == name and accepted["job_id"]
            job_id = accepted["job_id"]

            def of_job(event: str, jid: str = job_id) -> list[dict[str, Any]]:
                topic = f"robobus/{CAN_NODE}/{CAN_DEVICE}/event/{event}"
                for s in events.on(topic):
                    validator.validate(s.topic, s.payload)
                return [e for e in (json.loads(s.payload) for s in events.on(topic)) if e["job_id"] == jid]

            assert wait_for(lambda: bool(of_job("job_result")), 60), f"{name}: no job_result"
            time.sleep(0.3)  # a second result would come right after the first
            results = of_job("job_result")
            assert len(results) == 1, results
            assert results[0]["ok"] is True, results[0]
            assert of_job("job_progress"), f"{name}: no job_progress"
            # the result is the model the document names for the job
            result_schema = {**contract["result"], "components": {"schemas": doc["components"]["schemas"]}}
            jsonschema.Draft202012Validator(result_schema).validate(results[0]["result"])
        # a command that is not a job answers with its result at once (the flashed boards now run their
        # application, which does not answer read_version: the robot's set_speed is the example)
        non_job = caller.call(EPUCK_NODE, ROBOT, "set_speed", {"left": 0, "right": 0})
        assert commands(doc, EPUCK_NODE)["set_speed"]["x-robobus"]["job"] is False
        validator.validate_reply(doc, f"{EPUCK_NODE}_cmd_set_speed", non_job.payload)
        assert "job_id" not in json.loads(non_job.payload)["result"]
    finally:
        events.close()


def test_error_codes_the_services_answer_with_are_declared(stack: Stack, doc: dict[str, Any],
                                                            validator: ContractValidator, caller: Caller) -> None:
    """Provoke every error the stack can produce; `validate_reply` fails on a code the document does not
    list for that command."""
    seen: set[str] = set()

    def expect(node: str, device: str, command: str, payload: Any, code: str) -> dict[str, Any]:
        reply = caller.call(node, device, command, payload)
        validator.validate_reply(doc, f"{node}_cmd_{command}", reply.payload)
        data = json.loads(reply.payload)
        assert data["ok"] is False and data["error"]["code"] == code, data
        seen.add(code)
        return data

    expect(EPUCK_NODE, GHOST, "set_speed", {"left": 10, "right": 10}, "unavailable")
    expect(EPUCK_NODE, "no-such-robot", "set_speed", {"left": 0, "right": 0}, "not_found")
    expect(EPUCK_NODE, ROBOT, "set_speed", {"left": 5000, "right": 0}, "invalid_request")
    expect(CAN_NODE, CAN_DEVICE, "flash", {"board": 4, "path": "motor.hex"}, "forbidden")
    expect(CAN_NODE, CAN_DEVICE, "read_version", {"board": 5}, "timeout")  # no board 5 on the simulated bus
    expect(CAN_NODE, CAN_DEVICE, "cancel", {"job_id": "no-such-job"}, "not_found")

    # busy: a slow flash holds bus 1; a second one on it is refused; cancelling ends the first with `busy`
    events = stack.tap("contract-cancel")
    try:
        events.subscribe(f"robobus/{CAN_NODE}/{CAN_DEVICE}/event/#")
        slow = json.loads(caller.call(CAN_NODE, CAN_DEVICE, "flash",
                                      {"board": 4, "hex": make_intel_hex(), "window": 1}).payload)
        job_id = slow["result"]["job_id"]
        expect(CAN_NODE, CAN_DEVICE, "flash", {"board": 3, "hex": SMALL_HEX}, "busy")
        cancelled = caller.call(CAN_NODE, CAN_DEVICE, "cancel", {"job_id": job_id})
        assert json.loads(cancelled.payload)["result"]["cancelled"] == [job_id]
        topic = f"robobus/{CAN_NODE}/{CAN_DEVICE}/event/job_result"
        assert wait_for(lambda: any(json.loads(s.payload)["job_id"] == job_id for s in events.on(topic)), 60)
        result = next(json.loads(s.payload) for s in events.on(topic) if json.loads(s.payload)["job_id"] == job_id)
        assert result["cancelled"] is True
        assert result["error"]["code"] in commands(doc, CAN_NODE)["flash"]["x-robobus"]["errors"]
    finally:
        events.close()
    assert seen == {"unavailable", "not_found", "invalid_request", "forbidden", "timeout", "busy"}
