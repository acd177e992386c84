"""A small `make run`-like stack on free ports for the contract tests: a broker of its own (so retained
state is only this stack's), one simulated e-puck2 plus a robot that does not exist, the e-puck gateway,
and can-bootloader on simulated boards (a service with jobs). Every process is a real one."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.rpc import wait_for
from shared.tools.localbroker import Broker, NodeProcess, free_port, mosquitto_bin

EPUCK_NODE = "epuck-gateway"
CAN_NODE = "can-bootloader"
ROBOT = "epuck1"
GHOST = "ghost"  # configured, never reachable: its commands answer `unavailable`
START_S = 30.0  # generous: both services start on a busy 2-core machine


@dataclass
class Seen:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    correlation: bytes | None = None


@dataclass
class Tap:
    """A raw MQTT 5 client (paho) that records what it receives, for the checks the kit's RpcClient hides
    (QoS and retain flags of each delivery, Correlation Data)."""

    url: str
    name: str
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.name, protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        host, port = self.url.removeprefix("mqtt://").split(":")
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        props = getattr(msg, "properties", None)
        corr = getattr(props, "CorrelationData", None) if props else None
        with self.lock:
            self.seen.append(Seen(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain), corr))

    def subscribe(self, topic_filter: str, qos: int = 2) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *_a: done.set()
        self.client.subscribe(topic_filter, qos=qos)
        assert done.wait(10), f"no SUBACK for {topic_filter}"

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, *, response_topic: str | None = None,
                correlation: bytes | None = None, retain: bool = False) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic:
            props.ResponseTopic = response_topic
        if correlation:
            props.CorrelationData = correlation
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=props).wait_for_publish(10)

    def on(self, topic: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.topic == topic]

    def wait(self, topic: str, count: int = 1, timeout: float = 10.0) -> list[Seen]:
        wait_for(lambda: len(self.on(topic)) >= count, timeout)
        return self.on(topic)

    def close(self) -> None:
        self.client.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        self.client.loop_stop()


@dataclass
class Stack:
    broker: Broker
    procs: dict[str, NodeProcess]

    @property
    def url(self) -> str:
        return self.broker.url

    def tap(self, name: str) -> Tap:
        return Tap(self.url, f"{name}-{time.monotonic_ns() % 10**9}")

    def output(self) -> str:
        return "\n".join(f"--- {n}\n{p.text()[-3000:]}" for n, p in self.procs.items())


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    with tempfile.TemporaryDirectory(prefix="robobus-contract-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        robot_port = free_port()
        robots = [{"id": ROBOT, "host": "127.0.0.1", "port": robot_port},
                  {"id": GHOST, "host": "127.0.0.1", "port": free_port()}]
        common = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_HEALTH_INTERVAL_S": "1"}
        procs = {
            "epuck-sim": NodeProcess(["-m", "services.epuck_gateway.sim", "--count", "1",
                                      "--base-port", str(robot_port)], {}),
            EPUCK_NODE: NodeProcess(["-m", "services.epuck_gateway"],
                                    {**common, "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots),
                                     "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.5"}),
            CAN_NODE: NodeProcess(["-m", "services.can_bootloader"],
                                  {**common, "ROBOBUS_CAN_SIM": "true", "ROBOBUS_CAN_SIM_ERASE_S": "0.05",
                                   "ROBOBUS_CAN_SIM_BOARDS": "[4, 14]"}),
        }
        s = Stack(broker, procs)
        tap = s.tap("stack-ready")
        try:
            tap.subscribe("robobus/+/status")
            tap.subscribe(f"robobus/{EPUCK_NODE}/{ROBOT}/health")

            def ready() -> bool:
                online = {json.loads(m.payload)["node"] for m in tap.seen
                          if m.topic.endswith("/status") and json.loads(m.payload)["online"]}
                health = [json.loads(m.payload) for m in tap.on(f"robobus/{EPUCK_NODE}/{ROBOT}/health")]
                return {EPUCK_NODE, CAN_NODE} <= online and any(h["connection"] for h in health)

            assert wait_for(ready, START_S), "the stack did not come up:\n" + s.output()
        finally:
            tap.close()
        yield s
        for p in procs.values():
            p.stop()
        broker.kill()
