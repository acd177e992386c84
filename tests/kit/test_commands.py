"""Commands through a real broker: the happy path and every error code the kit answers itself."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import Node
from shared.rpc import RpcClient, wait_for


def test_echo_round_trip(echo_node: Node, client: RpcClient) -> None:
    rep = client.call(echo_node.name, "dev1", "echo", {"text": "hello", "count": 3})
    assert rep.ok, rep
    assert rep.result == {"text": "hello", "count": 3}


def _err(client: RpcClient, node: Node, payload: bytes | str | dict | None, command: str = "echo",
         device: str = "dev1") -> dict:
    rep = client.call(node.name, device, command, payload)
    assert not rep.ok, rep
    assert rep.error is not None
    return rep.error


def test_inline_handler_runs_on_the_network_thread(echo_node: Node, client: RpcClient) -> None:
    rep = client.call(echo_node.name, "dev1", "where", {})
    assert rep.ok and not rep.result["thread"].startswith("cmd"), rep.result  # not a pool thread
    bad = client.call(echo_node.name, "dev1", "where", b"[]")
    assert not bad.ok and bad.error and bad.error["code"] == "invalid_request"  # validated the same way


def test_inline_handler_must_be_synchronous(echo_node: Node) -> None:
    from tests.kit.echo_node import WHERE

    async def coro(r: object) -> None:
        return None

    with pytest.raises(ValueError, match="synchronous"):
        echo_node.devices["dev1"].bind(WHERE, coro, inline=True)


def test_undecodable_bytes(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, b"\xff\xfe\x00garbage")
    assert err["code"] == "invalid_request" and "UTF-8" in err["message"]


def test_invalid_json(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, b'{"text": ')
    assert err["code"] == "invalid_request" and "not JSON" in err["message"]


def test_json_that_is_not_an_object(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, b"[1, 2]")
    assert err["code"] == "invalid_request" and "object" in err["message"]


def test_wrong_type(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {"text": 12})
    assert err["code"] == "invalid_request" and err["message"].startswith("text:")


def test_out_of_range(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {"text": "x", "count": 11})
    assert err["code"] == "invalid_request" and "count" in err["message"]


def test_unknown_command(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {}, command="no_such_command")
    assert err["code"] == "not_found" and "no_such_command" in err["message"]


def test_unknown_device(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {"text": "x"}, device="nope")
    assert err["code"] == "not_found" and "nope" in err["message"]


def test_handler_that_raises(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {}, command="boom")
    assert err["code"] == "internal" and "kaboom" in err["message"]
    # and the node still answers
    assert client.call(echo_node.name, "dev1", "echo", {"text": "still here"}).ok


def test_handler_error_code(echo_node: Node, client: RpcClient) -> None:
    err = _err(client, echo_node, {}, command="fail")
    assert err == {"code": "device_error", "message": "the device said no"}


def test_errors_are_counted(echo_node: Node, client: RpcClient) -> None:
    _err(client, echo_node, b"{bad")
    _err(client, echo_node, {}, command="boom")
    stats = echo_node.stats()
    assert stats.commands_failed.get("invalid_request", 0) >= 1
    assert stats.commands_failed.get("internal", 0) >= 1


def test_slow_handler_does_not_stall_others(echo_node: Node, client: RpcClient) -> None:
    done = threading.Event()

    def slow() -> None:
        client.call(echo_node.name, "dev1", "slow", {"seconds": 2.0}, timeout=10)
        done.set()

    threading.Thread(target=slow, daemon=True).start()
    time.sleep(0.2)
    # while the slow handler sleeps, other commands are answered
    for i in range(5):
        assert client.call(echo_node.name, "dev1", "echo", {"text": str(i)}, timeout=1.5).ok
    assert not done.is_set(), "the fast calls should all have finished inside the slow one"
    assert done.wait(5)


def test_reply_without_response_topic_goes_to_reply_topic(echo_node: Node, client: RpcClient) -> None:
    topic = f"robobus/{echo_node.name}/dev1/cmd/echo"
    got: list[bytes] = []
    ev = threading.Event()

    def on(msg) -> None:  # type: ignore[no-untyped-def]
        got.append(bytes(msg.payload))
        ev.set()

    client.subscribe_before(f"{topic}/reply", on)
    client.session.publish(topic, json.dumps({"text": "plain"}), qos=1)  # like mosquitto_pub without -r
    assert ev.wait(5)
    assert json.loads(got[0]) == {"ok": True, "result": {"text": "plain", "count": 1}}


@pytest.mark.parametrize("qos", [0, 1])
def test_reply_goes_at_the_request_qos(echo_node: Node, client: RpcClient, qos: int) -> None:
    """A caller streaming setpoints at QoS 0 asked for no acknowledgements: its replies come at QoS 0;
    a QoS 1 caller gets QoS 1 replies."""
    topic = f"robobus/{echo_node.name}/dev1/cmd/echo"
    got: list[int] = []
    ev = threading.Event()

    def on(msg) -> None:  # type: ignore[no-untyped-def]
        got.append(msg.qos)
        ev.set()

    client.subscribe_before(f"{topic}/reply", on)  # subscribed at QoS 1: the delivered QoS is the reply's
    client.session.publish(topic, json.dumps({"text": "q"}), qos=qos)
    assert ev.wait(5)
    assert got == [qos]


def _answers(c: RpcClient, node: str) -> bool:
    try:
        return c.call(node, "dev1", "echo", {"text": "up"}, timeout=0.5).ok
    except TimeoutError:
        return False


garbage = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                 max_leaves=10).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"text": st.integers() | st.text(min_size=101, max_size=150) | st.none(),
                           "count": st.integers() | st.text()}).map(lambda v: json.dumps(v).encode()),
)


def test_garbage_payloads_all_answered_and_node_survives(broker_session, spawn) -> None:  # type: ignore[no-untyped-def]
    """1,000 generated garbage payloads: every one gets an error reply, and the process stays alive."""
    node_name = f"garbage-{time.monotonic_ns()}"
    proc = spawn(["-m", "tests.kit.echo_node"],
                 {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node_name})
    c = RpcClient(broker_session.settings())
    c.connect()
    try:
        assert wait_for(lambda: _answers(c, node_name), 15), proc.text()
        answered = 0

        @settings(max_examples=1000, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(garbage)
        def fire(payload: bytes) -> None:
            nonlocal answered
            rep = c.call(node_name, "dev1", "echo", payload, timeout=5)
            if rep.ok:  # the generator can stumble on a valid request; it must then be echoed
                assert set(rep.result) == {"text", "count"}
            else:
                assert rep.error and rep.error["code"] == "invalid_request", rep
            answered += 1

        fire()
        assert answered >= 1000
        assert proc.alive(), proc.text()
        assert c.call(node_name, "dev1", "echo", {"text": "alive"}).ok
    finally:
        c.close()


def test_async_handler_runs_on_the_service_loop_without_a_pool_thread(echo_node: Node, client: RpcClient) -> None:
    """An `async def` handler goes from the network thread straight to the service's loop (one hop), with the
    same validation, errors and reply as the pool path."""
    import asyncio

    from shared import CommandError, ErrorCode
    from tests.kit.echo_node import WHERE, WhereReply

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="service-loop", daemon=True)
    runner.start()
    echo_node.attach_loop(loop)
    fail = threading.Event()

    async def where(r: object) -> WhereReply:
        await asyncio.sleep(0)
        if fail.is_set():
            raise CommandError(ErrorCode.BUSY, "async refusal")
        return WhereReply(thread=threading.current_thread().name)

    try:
        echo_node.devices["dev1"].bind(WHERE, where)
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert rep.ok and rep.result["thread"] == "service-loop", rep
        bad = client.call(echo_node.name, "dev1", "where", b"[]")
        assert not bad.ok and bad.error and bad.error["code"] == "invalid_request"
        fail.set()
        refused = client.call(echo_node.name, "dev1", "where", {})
        assert not refused.ok and refused.error and refused.error["code"] == "busy"
        assert "async refusal" in refused.error["message"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_an_inline_handler_can_defer_the_rest_to_the_pool(echo_node: Node, client: RpcClient) -> None:
    """`Deferred(finish)` from an inline handler: `finish()` runs on a pool thread and its result (or error) is the
    reply, validated against the reply model as any handler's."""
    from shared import CommandError, ErrorCode
    from shared.dispatch import Deferred
    from tests.kit.echo_node import WHERE, WhereReply

    mode = {"m": "defer"}

    def where(r: object) -> WhereReply:
        if mode["m"] == "defer":
            raise Deferred(lambda: WhereReply(thread=threading.current_thread().name))
        if mode["m"] == "fail":
            def finish() -> WhereReply:
                raise CommandError(ErrorCode.TIMEOUT, "late")
            raise Deferred(finish)
        raise Deferred(lambda: {"thread": 3})  # fails its own reply schema

    try:
        echo_node.devices["dev1"].bind(WHERE, where, inline=True)
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert rep.ok and rep.result["thread"].startswith("cmd"), rep  # finished on a pool thread
        mode["m"] = "fail"
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert not rep.ok and rep.error and rep.error["code"] == "timeout" and rep.error["message"] == "late"
        mode["m"] = "bad"
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert not rep.ok and rep.error and rep.error["code"] == "internal"
    finally:
        echo_node.devices["dev1"].bind(WHERE, lambda r: WhereReply(thread=threading.current_thread().name),
                                       inline=True)


def test_a_serialized_result_is_published_as_it_is(echo_node: Node, client: RpcClient) -> None:
    """A handler may return `Serialized` (its reply model's bytes, made by its own tested code): the kit publishes
    those bytes unchanged, inline, from the pool and from a `Deferred`'s rest, with no second validation (so a
    deliberately off-schema `Serialized` goes out as it is: proving the equality is the handler's job)."""
    from shared.dispatch import Deferred
    from shared.payloads import Serialized
    from tests.kit.echo_node import WHERE, WhereReply

    body = Serialized(b'{"thread":"made by hand"}')
    dev = echo_node.devices["dev1"]
    try:
        dev.bind(WHERE, lambda r: body, inline=True)
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert rep.ok and rep.result == {"thread": "made by hand"}, rep
        dev.bind(WHERE, lambda r: body)  # on the pool
        assert client.call(echo_node.name, "dev1", "where", {}).result == {"thread": "made by hand"}

        def deferred(r: object) -> WhereReply:
            raise Deferred(lambda: body)
        dev.bind(WHERE, deferred, inline=True)
        assert client.call(echo_node.name, "dev1", "where", {}).result == {"thread": "made by hand"}
        dev.bind(WHERE, lambda r: Serialized(b'{"thread":3}'))  # not checked: the handler vouches for it
        rep = client.call(echo_node.name, "dev1", "where", {})
        assert rep.ok and rep.result == {"thread": 3}, rep
    finally:
        dev.bind(WHERE, lambda r: WhereReply(thread=threading.current_thread().name), inline=True)
