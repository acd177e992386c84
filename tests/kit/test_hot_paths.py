"""The kit's hot-path mechanics (docs/kit.md, "Hot paths"): each one is a shortcut past paho's own routine, so
each is checked here against what paho would have done: the same bytes, no lost message, no stale route."""

from __future__ import annotations

import threading
import uuid

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.mqtt.session import MqttSession, PublishProperties, reply_properties, unique_client_id
from shared.rpc import Reply, RpcClient, _Waiter, wait_for
from tests.fixtures import Broker


def _paho(response_topic: str | None, correlation: bytes | None, content_type: str | None) -> Properties:
    p = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if response_topic:
        p.ResponseTopic = response_topic
    if correlation is not None:
        p.CorrelationData = correlation
    if content_type:
        p.ContentType = content_type
    return p


@pytest.mark.parametrize("args", [
    ("robobus/_client/x/reply", b"\x00\x01\xfe\xff" * 4, "application/json"),
    (None, b"", None),
    (None, None, "image/png"),
    ("t\u00e9st/\u00fc", bytes(range(256)) * 3, "application/json; charset=utf-8"),
    (None, None, None),
])
def test_publish_properties_pack_to_pahos_bytes(args: tuple[str | None, bytes | None, str | None]) -> None:
    ours = reply_properties(*args)
    assert isinstance(ours, PublishProperties)
    assert ours.pack() == _paho(*args).pack()
    if args[1] is not None:
        assert ours.CorrelationData == args[1]  # readable like paho's, for whoever inspects a message


def test_publish_properties_repack_when_changed_and_refuse_what_paho_refuses() -> None:
    p = reply_properties(None, b"1", "a")
    p.ResponseTopic = "z"
    assert p.pack() == _paho("z", b"1", "a").pack()
    with pytest.raises(Exception, match="Property name"):
        p.NotAProperty = 1


def _session(broker: Broker, name: str) -> MqttSession:
    s = MqttSession(broker.settings(mqtt_max_queued=100_000), unique_client_id(name))
    s.start()
    assert s.wait_connected(10)
    return s


def test_the_shortcuts_are_active_with_the_installed_paho(broker_session: Broker) -> None:
    """On the installed (tested) paho every shortcut is on; on another paho shared/mqtt/paho_private.py turns them off
    (with one warning) and tests/kit/test_paho_private.py names what moved."""
    s = _session(broker_session, "shortcuts")
    try:
        assert s.coalesced_wakes and s.direct_writes and s.fast_decode
    finally:
        s.stop()


def test_bursts_from_many_threads_all_arrive(broker_session: Broker) -> None:
    """One wake-up per burst: no packet may be left queued without a wake-up pending (QoS 0 and QoS 1, queued
    for the network thread and written at once, from four threads at the same time)."""
    topic = f"robobus/test/burst/{uuid.uuid4().hex[:8]}"
    got: list[bytes] = []
    sub = _session(broker_session, "burst-sub")
    sub.subscribe(topic, lambda m: got.append(bytes(m.payload)), qos=1)
    assert sub.wait_ready(10)
    pub = _session(broker_session, "burst-pub")
    per_thread = 2000

    def blast(t: int) -> None:
        for i in range(per_thread):
            assert pub.publish(topic, f"{t}:{i}".encode(), qos=i % 2, now=(t % 2 == 1))

    threads = [threading.Thread(target=blast, args=(t,)) for t in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert wait_for(lambda: len(got) >= 4 * per_thread, 30), f"{len(got)} of {4 * per_thread} arrived"
        assert sorted(got) == sorted(f"{t}:{i}".encode() for t in range(4) for i in range(per_thread))
        for t in range(4):  # one thread's messages at one QoS stay in order (QoS 1 past paho's in-flight
            for q in (0, 1):  # window waits for PUBACKs, so QoS 0 may overtake it: MQTT orders per QoS)
                sent = [f"{t}:{i}".encode() for i in range(q, per_thread, 2)]
                assert [g for g in got if g in set(sent)] == sent
    finally:
        pub.stop()
        sub.stop()


def test_a_lone_publish_after_a_burst_is_not_stranded(broker_session: Broker) -> None:
    """The last packet of a burst and a single later one: both must go out without another publish to push
    them (a lost wake-up would leave one queued until the next keepalive)."""
    topic = f"robobus/test/lone/{uuid.uuid4().hex[:8]}"
    got: list[bytes] = []
    sub = _session(broker_session, "lone-sub")
    sub.subscribe(topic, lambda m: got.append(bytes(m.payload)), qos=0)
    assert sub.wait_ready(10)
    pub = _session(broker_session, "lone-pub")
    try:
        for round_ in range(50):
            for i in range(20):
                pub.publish(topic, f"{round_}:{i}".encode())
            assert wait_for(lambda r=round_: f"{r}:19".encode() in got, 5), f"round {round_} stranded"
            pub.publish(topic, f"lone{round_}".encode())
            assert wait_for(lambda r=round_: f"lone{r}".encode() in got, 5), f"lone {round_} stranded"
    finally:
        pub.stop()
        sub.stop()


def test_routes_follow_subscribe_and_unsubscribe(broker_session: Broker) -> None:
    """Handlers are resolved once per topic; a later (un)subscription must still be seen."""
    base = f"robobus/test/routes/{uuid.uuid4().hex[:8]}"
    a: list[bytes] = []
    b: list[bytes] = []
    s = _session(broker_session, "routes")
    c = RpcClient(broker_session.settings(), name="routes-pub")
    c.connect()
    try:
        s.subscribe(f"{base}/+", lambda m: a.append(bytes(m.payload)))
        assert s.wait_ready(10)
        c.session.publish(f"{base}/x", b"1", qos=1)
        assert wait_for(lambda: a == [b"1"], 5)
        s.subscribe(f"{base}/x", lambda m: b.append(bytes(m.payload)))  # the topic is routed already
        assert s.wait_ready(10)
        c.session.publish(f"{base}/x", b"2", qos=1)
        # (the broker may deliver it once per matching subscription: MQTT 5 allows either)
        assert wait_for(lambda: b"2" in b and b"2" in a, 5), (a, b)
        s.unsubscribe(f"{base}/+")
        c.subscribe_before(f"{base}/x", lambda m: None)  # a round trip through the broker after the UNSUBSCRIBE
        c.session.publish(f"{base}/x", b"3", qos=1)
        assert wait_for(lambda: b"3" in b, 5)
        assert b"3" not in a
    finally:
        c.close()
        s.stop()


def test_a_direct_write_the_socket_cannot_take_at_once_is_finished_by_the_network_thread(
        broker_session: Broker) -> None:
    """A reply written at once wakes nobody; when the socket takes only part of it, the rest is left queued
    and the network thread must be woken to finish it (else it would wait for paho's next select timeout)."""
    topic = f"robobus/test/big/{uuid.uuid4().hex[:8]}"
    got: list[int] = []
    sub = _session(broker_session, "big-sub")
    sub.subscribe(topic, lambda m: got.append(len(m.payload)), qos=1)
    assert sub.wait_ready(10)
    pub = _session(broker_session, "big-pub")
    wakes = []
    wake = pub._wake_network_thread
    pub._wake_network_thread = lambda: (wakes.append(1), wake())  # type: ignore[method-assign]
    try:
        for i in range(3):
            assert pub.publish(topic, bytes(32 << 20), qos=1, now=True)  # far more than a socket buffer
            assert wait_for(lambda n=i + 1: len(got) == n, 30), f"message {i} did not arrive"
        assert got == [32 << 20] * 3 and wakes, "the rest was never handed to the network thread"
    finally:
        pub.stop()
        sub.stop()


def test_a_reply_whose_caller_has_gone_does_not_hold_the_network_thread() -> None:
    """The network thread waits for the woken caller to run again, but only briefly: a caller that timed out
    a moment before its reply came never releases it."""
    w = _Waiter()
    t = threading.Thread(target=w.put, args=(Reply(ok=True),))
    t.start()
    t.join(10)
    assert not t.is_alive()
    w.put(Reply(ok=False))  # a QoS 1 duplicate changes nothing
    rep = w.get(0)
    assert rep is not None and rep.ok


def test_a_batch_is_written_by_its_thread_without_waking_the_network_thread(broker_session: Broker) -> None:
    """`MqttSession.batch()`: what a tick publishes (QoS 0 and 1) arrives, in order, and paho's network thread
    is not woken for it (no byte on its socketpair): the publishing thread writes the batch at its end."""
    topic = f"robobus/test/batch/{uuid.uuid4().hex[:8]}"
    got: list[bytes] = []
    sub = _session(broker_session, "batch-sub")
    sub.subscribe(topic, lambda m: got.append(bytes(m.payload)), qos=1)
    assert sub.wait_ready(10)
    pub = _session(broker_session, "batch-pub")
    wakes = [0]

    class CountingPair:
        def __init__(self, sock: object) -> None:
            self.sock = sock

        def send(self, data: bytes) -> int:
            wakes[0] += 1
            return self.sock.send(data)  # type: ignore[attr-defined, no-any-return]

    real = pub.client._sockpairW
    pub.client._sockpairW = CountingPair(real)
    try:
        for tick in range(50):
            with pub.batch():
                for i in range(5):
                    assert pub.publish(topic, f"{tick}:{i}".encode(), qos=i % 2)
            assert wait_for(lambda t=tick: f"{t}:4".encode() in got, 5), f"tick {tick} not written"
        # The batch's own thread writes it; the network thread is woken only when that thread cannot (the write
        # lock held by the network thread at that instant, or the socket taking part of it), which a busy machine
        # makes happen now and then (1 of 50 beside stress-ng, 7 of 50 with the suite in parallel on a loaded
        # machine). Without the batch's own write it is at least one wake a tick (50).
        assert wakes[0] <= 15, f"the network thread was woken {wakes[0]} times for 50 ticks"
        assert [g for g in got if g.endswith(b":0")] == [f"{t}:0".encode() for t in range(50)]
    finally:
        pub.client._sockpairW = real
        pub.stop()
        sub.stop()
