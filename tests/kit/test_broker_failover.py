"""A client of a clustered centre takes its nodes in turn (ROBOBUS_FLEET_BROKERS, shared/mqtt/failover.py): the
`robobus` CLI answers from the second broker when the first is down, and a connected client whose broker is
killed goes on on the next one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from shared.rpc import FailoverSettings, RpcClient, wait_for
from shared.settings import KitSettings
from tests.fixtures import REPO, Broker, free_port


def _nodes(*ports: int) -> str:
    return ",".join(f"127.0.0.1:{p}" for p in ports)


def test_the_cli_answers_from_the_second_broker_when_the_first_is_down(broker_session: Broker) -> None:
    root = f"failover{os.getpid()}"
    down = free_port()  # nothing listens there
    with RpcClient(broker_session.settings(topic_root=root), name="failover-test") as c:
        assert c.session.publish_wait(f"{root}/n1/status", json.dumps({"online": True, "service": "x"}), qos=1,
                                      retain=True)
        try:
            env = {**os.environ, "ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{down}", "ROBOBUS_TOPIC_ROOT": root,
                   "ROBOBUS_FLEET_BROKERS": _nodes(down, broker_session.port)}
            r = subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", "--json"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["nodes"]["n1"]["online"] is True
            # a broker named on the command line is that broker alone: the down one, no answer
            alone = subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", "--broker",
                                    f"mqtt://127.0.0.1:{down}"], cwd=REPO, env=env, capture_output=True, text=True,
                                   timeout=60)
            assert alone.returncode == 3 and f"127.0.0.1:{down}" in alone.stderr
        finally:
            c.session.publish_wait(f"{root}/n1/status", b"", qos=1, retain=True)


def test_a_client_whose_broker_is_killed_moves_to_the_next_and_keeps_receiving(broker: Broker,
                                                                             broker_session: Broker) -> None:
    root = f"failover{os.getpid()}b"
    settings = FailoverSettings(mqtt_url=broker.url, topic_root=root,
                                fleet_brokers=_nodes(broker.port, broker_session.port))
    got: list[bytes] = []
    arrived = threading.Event()

    def on(msg: object) -> None:
        got.append(bytes(msg.payload))  # type: ignore[attr-defined]
        arrived.set()

    with RpcClient(settings, name="failover-test") as c, \
            RpcClient(broker_session.settings(topic_root=root), name="failover-pub") as pub:
        assert c.session.broker.port == broker.port  # the first
        c.subscribe_before(f"{root}/n1/d1/event/+", on)
        broker.kill()
        assert wait_for(lambda: c.session.connected.is_set() and c.session.broker.port == broker_session.port, 10)
        assert c.session.wait_ready(5)  # its subscriptions are back, on the second broker
        assert wait_for(lambda: (pub.session.publish(f"{root}/n1/d1/event/tick", b"after", qos=1)
                                 and arrived.wait(0.2)), 5)
        assert b"after" in got
        assert pub.session.publish_wait(f"{root}/n1/status", b'{"online": true}', qos=1, retain=True)
        try:  # a retained read on the second broker (its marker's round trip included)
            assert c.collect_retained(f"{root}/+/status", timeout=5) == [(f"{root}/n1/status", b'{"online": true}',
                                                                          True)]
        finally:
            pub.session.publish_wait(f"{root}/n1/status", b"", qos=1, retain=True)


def test_one_url_is_one_broker() -> None:
    assert FailoverSettings(mqtt_url="mqtt://centre:1884").brokers() == [("centre", 1884)]
    assert RpcClient(KitSettings(mqtt_url="mqtt://centre:1884")).session.brokers == [("centre", 1884)]
    two = RpcClient(FailoverSettings(mqtt_url="mqtts://u:p@x:1", fleet_brokers="a:8883, b:8883"))
    assert two.session.brokers == [("a", 8883), ("b", 8883)]
    assert (two.session.broker.host, two.session.broker.port, two.session.broker.tls) == ("a", 8883, True)
