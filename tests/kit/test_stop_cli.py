"""`robobus stop` / `robobus stop --release` against a real broker and real nodes: the stop is set (retained), every
online node's answer is printed per device, a node that does not answer is named, and the exit code says so.
`robobus status` shows both latches of the stop: the site's {root}/_stop and the fleet centre's {root}/_stop/fleet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shared import Node
from shared.messages import StopState
from shared.rpc import RpcClient, wait_for
from shared.stop import fleet_stop_topic, stop_topic
from tests.fixtures import Broker
from tests.kit.motion_node import API, build
from tests.kit.test_cli import REPO

DEADLINE = 20.0


def robobus(broker: Broker, root: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_TOPIC_ROOT": root, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "shared.tools.cli", "stop", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def site(broker_session: Broker) -> Iterator[tuple[str, list[Node], RpcClient]]:
    """Two motion nodes under a topic root of their own."""
    root = f"stopcli{time.monotonic_ns()}"
    nodes = []
    for name in ("arm", "cart"):
        node = Node(API, broker_session.settings(topic_root=root, node=name, health_interval_s=0.5))
        build(node, devices=("m1", "m2") if name == "arm" else ("m1",), sensors=())
        node.start()
        assert node.stop_latch.known_event.wait(DEADLINE)
        nodes.append(node)
    client = RpcClient(broker_session.settings(topic_root=root), name="stop-cli-test")
    client.connect()
    yield root, nodes, client
    for node in nodes:
        node.stop()
    for t, _, r in client.collect_retained(f"{root}/#"):
        if r:
            client.session.publish(t, b"", qos=1, retain=True)
    client.session.publish_wait(stop_topic(root), b"", qos=1, retain=True)
    client.close()


def test_stop_and_release_print_every_nodes_answer(broker_session: Broker, site: Any) -> None:
    root, (arm, cart), client = site
    r = robobus(broker_session, root, "--reason", "maintenance", "--source", "alice")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"stop set on {root}/_stop by alice: maintenance" in r.stdout
    lines = r.stdout.splitlines()
    for dev in ("m1", "m2"):
        assert any(dev in line and "stopped" in line and " ms" in line for line in lines), r.stdout
    assert "arm" in r.stdout and "cart" in r.stdout
    # latched: retained on the broker, and the nodes hold it
    retained = [p for t, p, ret in client.collect_retained(stop_topic(root)) if ret]
    assert retained and StopState.model_validate_json(retained[-1]).active
    assert arm.stop_latch.active and cart.stop_latch.active
    rep = client.call("arm", "m1", "move", {"speed": 1}, timeout=DEADLINE)
    assert not rep.ok and rep.error["code"] == "stopped" and "maintenance" in rep.error["message"]
    j = robobus(broker_session, root, "--release", "--json")
    assert j.returncode == 0, j.stdout + j.stderr
    data = json.loads(j.stdout)
    assert data["stop"]["active"] is False and data["silent"] == []
    assert set(data["answers"]) == {"arm", "cart"}
    assert all(not d["stopped"] for a in data["answers"].values() for d in a["devices"])
    assert not arm.stop_latch.active
    assert client.call("arm", "m1", "move", {"speed": 1}, timeout=DEADLINE).ok


def test_a_node_that_does_not_answer_is_named_and_fails_the_exit_code(broker_session: Broker, site: Any) -> None:
    root, (arm, cart), client = site
    # a node online by its retained status, but hung: it never answers
    client.session.publish_wait(f"{root}/ghost/status", json.dumps(
        {"online": True, "node": "ghost", "service": "motion-test", "version": "0", "ts": time.time(),
         "session": 1, "devices": ["m1"]}), qos=1, retain=True)
    r = robobus(broker_session, root, "--reason", "drill", "--timeout", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ghost" in r.stdout and "no answer within 2 s" in r.stdout
    assert "1 of 3 online nodes did not answer" in r.stdout
    assert wait_for(lambda: arm.stop_latch.active and cart.stop_latch.active, DEADLINE)  # the others did
    assert "stopped" in r.stdout


def test_with_no_node_online_the_stop_is_still_latched(broker_session: Broker) -> None:
    root = f"stopempty{time.monotonic_ns()}"
    r = robobus(broker_session, root, "--reason", "before start")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "no node online" in r.stdout
        with RpcClient(broker_session.settings(topic_root=root), name="stop-cli-test") as c:
            got = [p for t, p, ret in c.collect_retained(stop_topic(root)) if ret]
            assert got and StopState.model_validate_json(got[-1]).reason == "before start"
    finally:
        with RpcClient(broker_session.settings(topic_root=root), name="stop-cli-test") as c:
            c.session.publish_wait(stop_topic(root), b"", qos=1, retain=True)


def test_bad_options_get_a_clear_error(broker_session: Broker) -> None:
    r = robobus(broker_session, "stopbad", "--source", "")
    assert r.returncode == 2 and "source" in r.stderr, r.stdout + r.stderr


def test_status_says_when_the_stop_is_active(broker_session: Broker, site: Any) -> None:
    root = site[0]
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root, "COLUMNS": "200"}

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    assert "bus stop ACTIVE" not in status().stdout
    assert robobus(broker_session, root, "--reason", "inspection", "--source", "bob").returncode == 0
    r = status()
    assert "bus stop ACTIVE (set by bob: inspection)" in r.stdout, r.stdout
    assert "stopped" in r.stdout  # the devices' health
    j = json.loads(status("--json").stdout)
    assert j["stop"]["active"] is True and j["stop"]["reason"] == "inspection"


def _status(broker: Broker, root: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_TOPIC_ROOT": root, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _answers(client: RpcClient, root: str) -> dict[str, dict[str, Any]]:
    """The nodes' retained answers to the stop, as the broker holds them."""
    return {t.split("/")[1]: json.loads(p) for t, p, _ in client.collect_retained(f"{root}/+/_node/state/stop") if p}


def _settled_on(client: RpcClient, root: str, stop: StopState, channel: str, nodes: set[str]) -> bool:
    got = _answers(client, root)
    return all(n in got and got[n]["channel"] == channel and got[n]["stop_ts"] == stop.ts
               and got[n]["active"] == stop.active and not any(d["pending"] for d in got[n]["devices"])
               for n in nodes)


def test_status_says_when_only_the_fleets_stop_is_active(broker_session: Broker, site: Any) -> None:
    """A retained stop on {root}/_stop/fleet alone (the centre's, as the site's bridge brings it in): the nodes are
    stopped, and `robobus status` says so, by whom, and which nodes hold it; the site's release does not lift it."""
    root, (arm, cart), client = site
    assert "not stopped (neither latch is active)" in _status(broker_session, root).stdout
    fleet = StopState(active=True, source="centre-op@hq", reason="fleet drill", ts=time.time())
    assert client.session.publish_wait(fleet_stop_topic(root), fleet.model_dump_json(), qos=1, retain=True)
    assert wait_for(lambda: arm.stop_latch.active and cart.stop_latch.active, DEADLINE)
    assert wait_for(lambda: _settled_on(client, root, fleet, "fleet", {"arm", "cart"}), DEADLINE), \
        _answers(client, root)

    r = _status(broker_session, root)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "fleet bus stop ACTIVE (set by centre-op@hq: fleet drill)" in out, out
    assert f"robobus stop --root {root} --release` at the centre" in out, out
    assert "STOPPED by the fleet's stop" in out, out
    assert "bus stop ACTIVE (set by" not in out.replace("fleet bus stop ACTIVE (set by", ""), out  # not the site's
    assert "held by 2 of 2 online nodes (arm, cart)" in out, out
    assert "stopped (fleet)" in out, out  # the node's answer and the devices' health name the latch
    j = json.loads(_status(broker_session, root, "--json").stdout)
    assert j["stopped"] is True and j["stopped_by"] == ["fleet"], j
    assert j["stop"]["active"] is True and j["stop"]["channel"] == "fleet" and j["stop"]["reason"] == "fleet drill"
    assert j["stop_latches"]["site"]["state"] is None
    assert j["stop_latches"]["fleet"]["held_by"] == ["arm", "cart"], j["stop_latches"]
    assert j["stop_answers"]["arm"]["answers_current"] == "fleet"

    # the site's release lifts only the site's latch: `robobus stop --release` says the devices stay stopped
    rel = robobus(broker_session, root, "--release", "--source", "bob")
    assert rel.returncode == 0, rel.stdout + rel.stderr
    assert "still stopped" in rel.stdout and "fleet" in rel.stdout, rel.stdout
    assert arm.stop_latch.active and cart.stop_latch.active
    j = json.loads(_status(broker_session, root, "--json").stdout)
    assert j["stopped_by"] == ["fleet"] and j["stop_latches"]["site"]["state"]["active"] is False, j
    assert j["stop_latches"]["fleet"]["held_by"] == ["arm", "cart"], j  # their answer: the release, still stopped
    out = _status(broker_session, root).stdout
    assert "STOPPED by the fleet's stop" in out and "site  latch" in out and "released" in out, out

    # both released: not stopped
    done = StopState(active=False, source="centre-op@hq", reason="", ts=time.time())
    assert client.session.publish_wait(fleet_stop_topic(root), done.model_dump_json(), qos=1, retain=True)
    assert wait_for(lambda: not arm.stop_latch.active and not cart.stop_latch.active, DEADLINE)
    j = json.loads(_status(broker_session, root, "--json").stdout)
    assert j["stopped"] is False and j["stopped_by"] == [], j
