"""Fixtures: a simulated DexRun in this process, the gateway as a real process, a recorder of the bus."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from shared.rpc import Reply, RpcClient
from shared.tools.localbroker import Broker, NodeProcess

NODE = "dexter-gateway"
GATEWAY = ["-m", "services.dexter_gateway"]


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


@dataclass
class BusRecorder:
    """Every message under the gateway's node, in arrival order."""

    messages: list[tuple[str, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def mark(self) -> int:
        with self.lock:
            return len(self.messages)

    def since(self, mark: int, suffix: str) -> list[dict[str, Any]]:
        with self.lock:
            found = [m for m in self.messages[mark:] if m[0].endswith(suffix)]
        return [json.loads(pl) for _, pl in found]

    def wait_json(self, suffix: str, pred: Callable[[dict[str, Any]], bool], since: int = 0,
                  timeout: float = 10.0) -> dict[str, Any] | None:
        def check() -> dict[str, Any] | None:
            for d in reversed(self.since(since, suffix)):
                if pred(d):
                    return d
            return None
        return wait_until(check, timeout)  # type: ignore[no-any-return]


@dataclass
class Gateway:
    proc: NodeProcess
    sim: DexterSim
    bus: BusRecorder
    client: RpcClient
    arm: str = "arm1"
    node: str = NODE

    def call(self, command: str, payload: Any = None, timeout: float = 15.0) -> Reply:
        return self.client.call(self.node, self.arm, command, payload, timeout=timeout)

    def job(self, command: str, payload: dict[str, Any], on_progress: Callable[[dict[str, Any]], None] | None = None,
            timeout: float = 60.0) -> tuple[Reply, dict[str, Any] | None]:
        return self.client.call_job(self.node, self.arm, command, payload, on_progress or (lambda ev: None),
                                    timeout=timeout)


def start_gateway(broker: Broker, sim: DexterSim, arm: dict[str, Any] | None = None, node: str = NODE,
                  root: str = "robobus", **env: str) -> Gateway:
    """The gateway on `sim`, under topic root `root` (a test of the bus stop uses a root of its own: the stop is
    per root, retained)."""
    client = RpcClient(broker.settings(topic_root=root), name="dexter-tests")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"{root}/{node}/#", bus.on)
    cfg = {"id": "arm1", "host": "127.0.0.1", "port": sim.port, "reply_timeout_s": 1.0, "reconnect_min_s": 0.05,
           "reconnect_max_s": 0.5, "queue_limit": 4, **(arm or {})}
    full_env = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_DEXTER_ARMS": json.dumps([cfg]),
                "ROBOBUS_HEALTH_INTERVAL_S": "0.5", "ROBOBUS_NODE": node, "ROBOBUS_TOPIC_ROOT": root, **env}
    gw = Gateway(NodeProcess(GATEWAY, full_env), sim, bus, client, node=node)
    ok = bus.wait_json("/arm1/health", lambda h: bool(h["connection"]), timeout=20)
    assert ok, "gateway did not connect to the simulated arm:\n" + gw.proc.text()

    def answers() -> bool:  # health can go out before the node's command subscription is confirmed
        try:
            return client.call(node, "arm1", "heartbeat", {}, timeout=2).ok
        except TimeoutError:
            return False
    assert wait_until(answers, 30), "gateway does not answer commands:\n" + gw.proc.text()
    return gw


def stop_gateway(gw: Gateway) -> None:
    gw.proc.stop()
    gw.client.close()


@pytest.fixture(scope="module")
def gateway(broker_session: Broker) -> Iterator[Gateway]:
    """One simulated arm (newest DexRun, fast moves), one gateway process; the shell stays disabled."""
    sim = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=360, acceleration_deg_s2=7200)).start()
    gw = start_gateway(broker_session, sim, ROBOBUS_DEXTER_STATUS_HZ="20")
    yield gw
    stop_gateway(gw)
    sim.close()
