"""A command has an age: a request read after its deadline is answered `expired` and never run; a handler sees the
deadline of the request it runs (`request_deadline`), so that it can hand it on (a demand to a realtime cycle)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from shared import Node, ServiceAPI
from shared.dispatch import check_age, deadline_of, request_deadline
from shared.errors import CommandError
from shared.mqtt.session import DEADLINE_PROPERTY, PublishProperties, command_properties
from shared.rpc import RpcClient, wait_for
from tests.fixtures import Broker


class Go(BaseModel):
    n: int = 0


class Seen(BaseModel):
    deadline_in_s: float | None = None


API = ServiceAPI("age-test")
GO = API.command("go", Go, Seen, doc="record the request and the deadline its handler saw")
GO_INLINE = API.command("go_inline", Go, Seen, doc="the same, inline on the network thread")
GO_ASYNC = API.command("go_async", Go, Seen, doc="the same, as an async handler")


@pytest.fixture
def age_node(broker_session: Broker) -> Iterator[tuple[Node, list[int]]]:
    node = Node(API, broker_session.settings(node=f"age-{time.monotonic_ns()}"))
    dev = node.device("d")
    ran: list[int] = []

    def seen(req: Go) -> Seen:
        ran.append(req.n)
        d = request_deadline()
        return Seen(deadline_in_s=None if d is None else d - time.monotonic())

    async def seen_async(req: Go) -> Seen:
        return seen(req)

    dev.bind(GO, seen)
    dev.bind(GO_INLINE, seen, inline=True)
    dev.bind(GO_ASYNC, seen_async)
    loop = asyncio.new_event_loop()  # the service's loop, where the async handler runs
    threading.Thread(target=loop.run_forever, daemon=True).start()
    node.attach_loop(loop)
    node.start()
    assert node.session.wait_ready(10)
    yield node, ran
    node.stop()
    loop.call_soon_threadsafe(loop.stop)


def _call_with(client: RpcClient, node: Node, command: str, props: PublishProperties, n: int) -> dict:
    """A request with hand-made properties; its reply, read from `<topic>/reply`."""
    got: list[bytes] = []
    topic = client.topic(node.name, "d", "cmd", command)
    client.subscribe_before(f"{topic}/reply", lambda m: got.append(bytes(m.payload)))
    try:
        client.session.publish(topic, json.dumps({"n": n}), qos=1, properties=props)
        assert wait_for(lambda: bool(got), 10), "no reply"
    finally:
        client.session.unsubscribe(f"{topic}/reply")
    return json.loads(got[0])


@pytest.mark.parametrize("command", ["go", "go_inline", "go_async"])
def test_a_request_past_its_deadline_is_refused_and_never_run(age_node: tuple[Node, list[int]],
                                                              client: RpcClient, command: str) -> None:
    node, ran = age_node
    before = node.stats().commands_failed.get("expired", 0)
    stale = command_properties(None, None, 0.2, now=time.time() - 1.0)  # sent a second ago, lived 200 ms
    rep = _call_with(client, node, command, stale, 7)
    assert rep["ok"] is False and rep["error"]["code"] == "expired", rep
    assert "not executed" in rep["error"]["message"]
    assert 7 not in ran
    assert node.stats().commands_failed.get("expired", 0) == before + 1  # counted by its code


@pytest.mark.parametrize("command", ["go", "go_inline", "go_async"])
def test_the_handler_sees_the_deadline_of_its_request(age_node: tuple[Node, list[int]], client: RpcClient,
                                                      command: str) -> None:
    node, _ = age_node
    rep = client.call(node.name, "d", command, {"n": 1}, timeout=5.0, max_age_s=3.0)
    assert rep.ok, rep
    left = rep.result["deadline_in_s"]
    assert left is not None and 0 < left <= 3.0  # the client's deadline, on the node's monotonic clock
    none = client.call(node.name, "d", command, {"n": 2}, max_age_s=None)
    assert none.ok and none.result["deadline_in_s"] is None  # no age: none leaks from the request before


def test_a_call_has_the_age_of_its_timeout_by_default(age_node: tuple[Node, list[int]], client: RpcClient) -> None:
    node, _ = age_node
    rep = client.call(node.name, "d", "go", {"n": 3}, timeout=4.0)
    assert rep.ok and 0 < rep.result["deadline_in_s"] <= 4.0


def test_send_streams_with_a_short_age(age_node: tuple[Node, list[int]], client: RpcClient) -> None:
    node, ran = age_node
    client.send(node.name, "d", "go", {"n": 11})
    assert wait_for(lambda: 11 in ran, 5)


def test_message_expiry_alone_is_honoured(age_node: tuple[Node, list[int]], client: RpcClient) -> None:
    """A client of another language that sets only MQTT 5's Message Expiry Interval: its remaining lifetime, from
    when the node read the request, is the deadline."""
    node, _ = age_node
    rep = _call_with(client, node, "go", PublishProperties(None, None, None, expiry_s=2), 4)
    assert rep["ok"], rep
    assert 1.0 < rep["result"]["deadline_in_s"] <= 2.0


def test_a_malformed_deadline_is_a_clear_error(age_node: tuple[Node, list[int]], client: RpcClient) -> None:
    node, ran = age_node
    bad = PublishProperties(None, None, None, user=[(DEADLINE_PROPERTY, "soon")])
    rep = _call_with(client, node, "go", bad, 5)
    assert rep["ok"] is False and rep["error"]["code"] == "invalid_request"
    assert DEADLINE_PROPERTY in rep["error"]["message"] and 5 not in ran


def test_deadline_arithmetic() -> None:
    now = time.monotonic()
    props = command_properties(None, None, 0.5, now=time.time())
    d = deadline_of(props, now)
    assert d is not None and 0.45 < d - now <= 0.5
    assert props.MessageExpiryInterval == 1  # whole seconds, rounded up
    assert deadline_of(PublishProperties(), now) is None
    check_age(None)
    check_age(time.monotonic() + 1)
    with pytest.raises(CommandError, match="expired"):
        check_age(time.monotonic() - 0.01)


def test_a_stalled_node_never_runs_what_expired_while_it_was_stalled(age_node: tuple[Node, list[int]],
                                                                      client: RpcClient) -> None:
    """Requests queued behind a blocked network thread (the node's process stalled) are refused once it runs again;
    a request sent after the stall runs."""
    node, ran = age_node
    release = threading.Event()
    node.session.client.message_callback_add("robobus/_hold", lambda *a: release.wait(10))
    node.session.client.subscribe("robobus/_hold", qos=1)
    time.sleep(0.3)
    client.session.publish("robobus/_hold", b"", qos=1)  # the node's network thread blocks on this one
    time.sleep(0.2)
    for i in range(100, 120):  # streamed while the node cannot read: each lives 100 ms
        client.send(node.name, "d", "go", {"n": i}, max_age_s=0.1)
        time.sleep(0.01)
    time.sleep(0.3)
    release.set()
    client.send(node.name, "d", "go", {"n": 999}, max_age_s=1.0)
    assert wait_for(lambda: 999 in ran, 5)
    assert not [n for n in ran if 100 <= n < 120], ran
