"""Birth, death, broker restarts: what a dashboard sees when things go wrong."""

from __future__ import annotations

import json
import signal
import time

from shared.rpc import RpcClient, wait_for
from tests.fixtures import Broker


def _status(c: RpcClient, node: str, timeout: float = 3.0) -> dict | None:
    msgs = c.collect(f"robobus/{node}/status", timeout, until=lambda t, p: True)
    return json.loads(msgs[-1][1]) if msgs else None


def _answers(c: RpcClient, node: str) -> bool:
    try:
        return c.call(node, "dev1", "echo", {"text": "up"}, timeout=0.5).ok
    except TimeoutError:
        return False


def _start(spawn, broker: Broker, node: str, **env: str):  # type: ignore[no-untyped-def]
    return spawn(["-m", "tests.kit.echo_node"],
                 {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": node, **env})


def test_birth_and_clean_shutdown(broker: Broker, spawn) -> None:  # type: ignore[no-untyped-def]
    proc = _start(spawn, broker, "life1")
    with RpcClient(broker.settings()) as c:
        assert wait_for(lambda: (_status(c, "life1", 0.5) or {}).get("online") is True, 15), proc.text()
        assert proc.stop() == 0
        st = _status(c, "life1")
        assert st is not None and st["online"] is False and st["reason"] == "shutdown"


def test_kill_9_goes_offline_through_last_will(broker: Broker, spawn) -> None:  # type: ignore[no-untyped-def]
    proc = _start(spawn, broker, "life2", ROBOBUS_MQTT_KEEPALIVE_S="5")
    with RpcClient(broker.settings()) as c:
        assert wait_for(lambda: (_status(c, "life2", 0.5) or {}).get("online") is True, 15), proc.text()
        proc.signal(signal.SIGKILL)
        # the broker sends the Will as soon as it sees the socket close
        assert wait_for(lambda: (_status(c, "life2", 0.5) or {}).get("online") is False, 10)
        st = _status(c, "life2")
        assert st is not None and st["reason"] == "connection lost"


def test_broker_restart_recovers_within_3s(broker: Broker, spawn) -> None:  # type: ignore[no-untyped-def]
    proc = _start(spawn, broker, "life3")
    c = RpcClient(broker.settings())
    c.connect()
    assert wait_for(lambda: _answers(c, "life3"), 15), proc.text()
    c.close()

    broker.restart(down_s=0.5)  # kill -9 and start again: no persistence, retained messages are gone
    t0 = time.monotonic()
    with RpcClient(broker.settings()) as c2:
        def back() -> bool:
            st = _status(c2, "life3", 0.2)
            health = c2.collect("robobus/life3/dev1/health", 0.2, until=lambda t, p: True)
            return bool(st and st["online"] and health)

        assert wait_for(back, 10, interval=0.05)
        elapsed = time.monotonic() - t0
        assert c2.call("life3", "dev1", "echo", {"text": "again"}, timeout=2).ok  # subscriptions restored
        assert elapsed <= 3.0, f"status and health back after {elapsed:.2f} s"
    assert proc.alive()
