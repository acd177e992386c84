"""Health dies with its node: retained health carries a Message Expiry Interval of a few heartbeats, so after a
kill -9 (no final message) a reader of one device's retained health, here an independent client (mosquitto_sub),
is not told that the dead node's device is live."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from shared.device import health_properties
from shared.rpc import RpcClient, wait_for
from shared.settings import KitSettings
from tests.fixtures import Broker

SUB = shutil.which("mosquitto_sub")


def _retained_health(broker: Broker, node: str) -> list[dict]:
    """What mosquitto_sub reads retained on the node's health topics (`--retained-only`, gives up after 1 s)."""
    assert SUB is not None
    out = subprocess.run([SUB, "-V", "mqttv5", "-h", "127.0.0.1", "-p", str(broker.port), "-t",
                          f"robobus/{node}/+/health", "--retained-only", "-W", "1"],
                         capture_output=True, timeout=20, check=False)
    return [json.loads(line) for line in out.stdout.decode().splitlines() if line.strip()]


def _answers(c: RpcClient) -> bool:
    try:
        return c.call("expiry1", "dev1", "echo", {"text": "up"}, timeout=0.5).ok
    except TimeoutError:
        return False


@pytest.mark.skipif(SUB is None, reason="mosquitto_sub (Debian mosquitto-clients) is not installed")
def test_a_killed_nodes_retained_health_expires(broker: Broker, spawn) -> None:  # type: ignore[no-untyped-def]
    # heartbeats every 0.5 s, 3 of them: the broker drops the health ceil(0.5 * 3 + 2) = 4 s after the last one
    proc = spawn(["-m", "tests.kit.echo_node"], {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": "expiry1",
                                                 "ROBOBUS_HEALTH_INTERVAL_S": "0.5"})
    with RpcClient(broker.settings()) as c:
        assert wait_for(lambda: _answers(c), 20), proc.text()
    live = _retained_health(broker, "expiry1")
    assert live and live[0]["connection"] is True, live
    os.killpg(proc.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.proc.wait(5)
    # never longer than the expiry after the last heartbeat; checked until then, then once more past it
    assert wait_for(lambda: not _retained_health(broker, "expiry1"), 12), "health still retained after kill -9"
    assert time.monotonic() - killed <= 4.0 + 1.0 + 3.0  # the expiry, one heartbeat, mosquitto_sub's wait and load
    assert not _retained_health(broker, "expiry1")


def test_expiry_follows_the_heartbeat() -> None:
    s = KitSettings(health_interval_s=5.0)
    props = health_properties(s)
    assert props is not None and props.MessageExpiryInterval == 17  # 3 beats + 2 s
    assert health_properties(KitSettings(health_interval_s=5.0, health_expiry_beats=0)) is None
