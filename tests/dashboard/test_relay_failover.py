"""The dashboard's relay with a clustered centre's nodes (ROBOBUS_FLEET_BROKERS): a page connected through it to
the first node goes on on the second when the first is killed, and keeps receiving."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import build_document
from shared.tools.dashboard.relay import Upstream
from shared.tools.dashboard.server import DashboardServer, MissingAssets, PageConfig, Relay
from tests.fixtures import Broker, free_port, mosquitto_bin


@pytest.fixture
def first() -> Iterator[Broker]:
    if not mosquitto_bin():
        pytest.skip("mosquitto is not installed")
    with tempfile.TemporaryDirectory(prefix="robobus-relay-first-") as d:
        b = Broker(free_port(), Path(d))
        b.start()
        yield b
        b.kill()


class Page:
    """What the page's MQTT client does through /mqtt: connect, subscribe on every connect, reconnect on a loss."""

    def __init__(self, port: int, topic: str) -> None:
        self.got: list[bytes] = []
        self.connects = 0
        self.arrived = threading.Event()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="page-failover", protocol=mqtt.MQTTv5,
                        transport="websockets")
        c.ws_set_options(path="/mqtt")
        c.reconnect_delay_set(0.1, 0.5)  # type: ignore[arg-type]  # paho takes seconds as floats

        def on_connect(cl: mqtt.Client, *_: object) -> None:
            self.connects += 1
            cl.subscribe(topic, qos=1)

        def on_message(cl: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
            self.got.append(bytes(msg.payload))
            self.arrived.set()

        c.on_connect, c.on_message = on_connect, on_message
        c.connect_async("127.0.0.1", port, keepalive=5)
        c.loop_start()
        self.client = c

    def receives(self, pub: RpcClient, topic: str, payload: bytes, timeout: float = 5.0) -> bool:
        """Published (again, until the page's subscription is in) until the page has it."""
        def sent_and_seen() -> bool:
            self.arrived.clear()
            pub.session.publish(topic, payload, qos=1)
            return self.arrived.wait(0.2) and payload in self.got
        return wait_for(sent_and_seen, timeout)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_page_moves_to_the_next_node_when_its_node_is_killed(first: Broker, broker_session: Broker) -> None:
    upstream = Upstream("127.0.0.1", first.port, others=(("127.0.0.1", broker_session.port),))
    try:
        server = DashboardServer(build_document(), PageConfig(relay=True), port=0,
                                 relay=Relay(upstream, flush_s=0.01)).start()
    except MissingAssets as exc:
        pytest.skip(str(exc))
    topic = "relayfailover/n1/d1/event/tick"
    page = Page(int(server.httpd.server_address[1]), topic)
    try:
        with RpcClient(first.settings(), name="pub-first") as on_first:
            assert page.receives(on_first, topic, b"before")
        assert page.connects == 1 and upstream.current == ("127.0.0.1", first.port)
        first.kill()
        assert wait_for(lambda: page.connects == 2, 10)  # the relay closed its websocket; it came back
        with RpcClient(broker_session.settings(), name="pub-second") as on_second:
            assert page.receives(on_second, topic, b"after")
        assert upstream.current == ("127.0.0.1", broker_session.port)
    finally:
        page.close()
        server.stop()


def test_one_broker_is_as_before() -> None:
    up = Upstream("127.0.0.1", free_port())  # nothing listens there
    assert up.nodes == [("127.0.0.1", up.port)]
    with pytest.raises(OSError):
        up.connect(timeout=1)
