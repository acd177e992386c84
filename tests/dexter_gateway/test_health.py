"""Health while an arm is absent: failed attempts are counted, `error` stays false, the arm becomes `unreachable`
after its liveness budget, and an arm that appears is operational (the gateway as a process, a real broker)."""

from __future__ import annotations

import json
import socket
from typing import Any

from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from shared.localbroker import Broker, NodeProcess
from shared.rpc import RpcClient
from tests.dexter_gateway.conftest import GATEWAY, BusRecorder, wait_until


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once to find it, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(broker: Broker, node: str, arm: dict[str, Any]) -> tuple[NodeProcess, RpcClient, BusRecorder]:
    """The gateway as node `node` (one per test: a node's retained health outlives its process)."""
    client = RpcClient(broker.settings(), name="dexter-health-tests")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{node}/#", bus.on)
    env = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_DEXTER_ARMS": json.dumps([arm]),
           "ROBOBUS_HEALTH_INTERVAL_S": "0.2", "ROBOBUS_NODE": node}
    return NodeProcess(GATEWAY, env), client, bus


def test_an_absent_arm_is_counted_then_unreachable_never_an_error_and_operational_when_it_appears(
        broker_session: Broker) -> None:
    port = _closed_port()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": port, "reply_timeout_s": 1.0, "reconnect_min_s": 0.05,
           "reconnect_max_s": 0.2, "liveness_s": 1.0}
    proc, client, bus = _start(broker_session, "dexter-absent", arm)
    sim: DexterSim | None = None
    try:
        h = bus.wait_json("/arm1/health", lambda d: d["details"].get("failed_attempts", 0) >= 4
                          and d["state"] == "unreachable", timeout=30)
        assert h is not None, proc.text()
        assert "cannot connect" in h["error_message"] and h["details"]["connect_attempts"] >= 4
        assert "refused" in h["details"]["last_failure"].lower()
        healths = bus.since(0, "/arm1/health")
        assert healths and not any(d["error"] for d in healths), [d for d in healths if d["error"]]
        assert not any(d["connection"] or d["operational"] for d in healths)
        states = [d["state"] for d in healths]
        # `connecting` while within the budget, then `unreachable`, and never back (the attempts go on)
        first = states.index("unreachable")
        assert set(states[:first]) <= {"starting", "connecting"} and set(states[first:]) == {"unreachable"}, states

        sim = DexterSim(DexterSimConfig(port=port)).start()  # the arm appears
        h = bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30)
        assert h is not None, proc.text()
        assert h["connection"] and h["state"] == "connected" and not h["error"] and h["error_message"] == ""
        assert h["details"]["failed_attempts"] == 0 and h["details"]["connect_attempts"] >= 5
        assert not any(d["error"] for d in bus.since(0, "/arm1/health"))
        assert wait_until(lambda: client.call("dexter-absent", "arm1", "heartbeat", {}, timeout=5).ok, 20)

        # lost after it was reached: `reconnecting` within the budget, then `unreachable` again, still no error
        mark = bus.mark()
        sim.close()
        sim = None
        h = bus.wait_json("/arm1/health", lambda d: d["state"] == "unreachable", mark, timeout=30)
        assert h is not None and not h["connection"], proc.text()
        after = bus.since(mark, "/arm1/health")
        assert not any(d["error"] for d in after), [d for d in after if d["error"]]
        assert "reconnecting" in {d["state"] for d in after}
    finally:
        if sim is not None:
            sim.close()
        proc.stop()
        client.close()


def test_a_host_that_does_not_resolve_is_a_configuration_error(broker_session: Broker) -> None:
    arm = {"id": "arm1", "host": "no-such-host.invalid", "reconnect_min_s": 0.05, "reconnect_max_s": 0.2,
           "liveness_s": 1.0}
    proc, client, bus = _start(broker_session, "dexter-badhost", arm)
    try:
        h = bus.wait_json("/arm1/health", lambda d: d["details"].get("failed_attempts", 0) >= 3, timeout=30)
        assert h is not None, proc.text()
        assert h["error"] and "resolve" in h["error_message"] and not h["connection"]
        # it stays an error across the attempts (no flapping)
        later = [d for d in bus.since(0, "/arm1/health") if d["details"].get("failed_attempts", 0) >= 1]
        assert later and all(d["error"] for d in later)
    finally:
        proc.stop()
        client.close()
