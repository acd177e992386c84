"""Fixtures: simulated robots in a thread, the gateway as a real process, a recorder of the bus."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from shared.rpc import RpcClient
from tests.fixtures import Broker, NodeProcess, free_port

NODE = "epuck-gateway"
GATEWAY = ["-m", "services.epuck_gateway"]


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


@dataclass
class Recorded:
    topic: str
    payload: bytes
    content_type: str | None
    retained: bool


@dataclass
class BusRecorder:
    """Every message under the gateway's node, in arrival order (QoS 1 subscription)."""

    messages: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, msg: mqtt.MQTTMessage) -> None:
        ctype = getattr(getattr(msg, "properties", None), "ContentType", None)
        with self.lock:
            self.messages.append(Recorded(msg.topic, bytes(msg.payload), ctype, bool(msg.retain)))

    def mark(self) -> int:
        with self.lock:
            return len(self.messages)

    def since(self, mark: int, suffix: str) -> list[Recorded]:
        with self.lock:
            return [m for m in self.messages[mark:] if m.topic.endswith(suffix)]

    def latest_json(self, suffix: str, since: int = 0) -> dict[str, Any] | None:
        found = self.since(since, suffix)
        return json.loads(found[-1].payload) if found else None

    def wait_json(self, suffix: str, pred: Callable[[dict[str, Any]], bool], since: int = 0,
                  timeout: float = 10.0) -> dict[str, Any] | None:
        def check() -> dict[str, Any] | None:
            for m in reversed(self.since(since, suffix)):
                data = json.loads(m.payload)
                if pred(data):
                    return data  # type: ignore[no-any-return]
            return None
        return wait_until(check, timeout)  # type: ignore[no-any-return]


@dataclass
class Gateway:
    proc: NodeProcess
    sim: EpuckSimThread
    bus: BusRecorder
    client: RpcClient
    robots: list[dict[str, Any]]

    def call(self, device: str, command: str, payload: Any = None) -> Any:
        return self.client.call(NODE, device, command, payload, timeout=10.0)

    def topic(self, device: str, kind: str, name: str) -> str:
        return f"robobus/{NODE}/{device}/{kind}/{name}"


def gateway_env(broker: Broker, sim: EpuckSimThread, extra_robots: list[dict[str, Any]] | None = None,
                **env: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    robots = [{"id": r.name, "host": "127.0.0.1", "port": r.port} for r in sim.robots] + (extra_robots or [])
    full_env = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots),
                "ROBOBUS_HEALTH_INTERVAL_S": "1", "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.5", **env}
    return full_env, robots


@pytest.fixture(scope="module")
def gateway(broker_session: Broker) -> Iterator[Gateway]:
    """Five simulated robots plus one that does not exist, one gateway process for all of them."""
    sim = EpuckSimThread(5, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    client = RpcClient(broker_session.settings(), name="epuck-tests")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{NODE}/#", bus.on)
    ghost = {"id": "ghost", "host": "127.0.0.1", "port": free_port()}
    env, robots = gateway_env(broker_session, sim, [ghost], ROBOBUS_EPUCK_MOTION_TIMEOUT_MS="400")
    proc = NodeProcess(GATEWAY, env)  # module-wide: the function-scoped `spawn` cannot hold it
    gw = Gateway(proc, sim, bus, client, robots)
    ok = wait_until(lambda: all(
        (bus.latest_json(f"/{r.name}/health") or {}).get("connection") for r in sim.robots), 20)
    assert ok, "gateway did not connect to the simulated robots:\n" + proc.text()
    yield gw
    proc.stop()
    client.close()
    sim.close()
