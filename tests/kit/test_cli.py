"""The robobus CLI against a real broker and a real node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shared import Node
from tests.fixtures import Broker

REPO = Path(__file__).resolve().parents[2]


def robobus(broker: Broker, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "shared.tools.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, input=stdin)


def test_call_ok_and_error_exit_codes(broker_session: Broker, echo_node: Node) -> None:
    ok = robobus(broker_session, "call", f"{echo_node.name}/dev1", "echo", '{"text": "cli"}')
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"ok": True, "result": {"text": "cli", "count": 1}}
    bad = robobus(broker_session, "call", f"{echo_node.name}/dev1", "echo", '{"count": 99}')
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["error"]["code"] == "invalid_request"
    notjson = robobus(broker_session, "call", f"{echo_node.name}/dev1", "echo", "{oops")
    assert notjson.returncode == 2 and "not JSON" in notjson.stderr


def test_call_follows_a_job_to_its_result(broker_session: Broker, echo_node: Node) -> None:
    r = robobus(broker_session, "call", f"{echo_node.name}/dev1", "count", '{"n": 20, "delay_s": 0.01}')
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"] == {"counted": 20}
    assert "done" in r.stderr  # the progress bar's last state


def test_status_table_and_json(broker_session: Broker, echo_node: Node) -> None:
    r = robobus(broker_session, "status", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["nodes"][echo_node.name]["online"] is True
    assert data["health"][f"{echo_node.name}/dev1"]["state"] == "running"
    t = robobus(broker_session, "status")
    assert echo_node.name in t.stdout and "running" in t.stdout


def test_status_at_a_centre_says_a_cut_site_and_its_rows_are_last_known(broker_session: Broker) -> None:
    """fleet-watch's {root}/_bridge/reachable "0": `robobus status` says the site is unreachable above the table and
    shows its nodes `stale (last online)`, never plain online; "1" or no verdict (a site's own broker): as ever."""
    from shared.rpc import RpcClient
    from shared.settings import KitSettings

    root = f"cut{os.getpid()}/robobus"
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root, "COLUMNS": "200"}

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)

    with RpcClient(KitSettings(mqtt_url=broker_session.url, topic_root=root), name="cut") as c:
        topics = [f"{root}/n1/status", f"{root}/n1/d1/health", f"{root}/_bridge/reachable"]
        try:
            c.session.publish_wait(topics[0], json.dumps({"online": True, "service": "x"}), qos=1, retain=True)
            c.session.publish_wait(topics[1], json.dumps({"state": "running", "connection": True}), qos=1,
                                   retain=True)
            r = status()
            assert "UNREACHABLE" not in r.stdout and "online" in r.stdout and "stale" not in r.stdout, r.stdout
            assert json.loads(status("--json").stdout)["site_reachable"] is None
            c.session.publish_wait(topics[2], b"0", qos=1, retain=True)
            r = status()
            assert f"the site {root} is UNREACHABLE from this centre" in r.stdout, r.stdout
            assert "stale (last online)" in r.stdout, r.stdout
            assert json.loads(status("--json").stdout)["site_reachable"] is False
            c.session.publish_wait(topics[2], b"1", qos=1, retain=True)
            r = status()
            assert "UNREACHABLE" not in r.stdout and "stale" not in r.stdout, r.stdout
        finally:
            for t in topics:
                c.session.publish_wait(t, b"", qos=1, retain=True)


def test_status_reads_every_retained_status_and_health_once_the_broker_has_sent_them(broker_session: Broker) -> None:
    """`robobus status` stops gathering when its marker comes back, not after a fixed window: every retained message
    of the subscriptions before the marker is in (400 health topics and 40 nodes here, more than the broker sends
    before it must wait for acknowledgements)."""
    from shared.rpc import RpcClient
    from shared.settings import KitSettings

    root = f"many{os.getpid()}"
    nodes = [f"n{i:02d}" for i in range(40)]
    with RpcClient(KitSettings(mqtt_url=broker_session.url, topic_root=root), name="many") as c:
        for n in nodes:
            assert c.session.publish_wait(f"{root}/{n}/status", json.dumps({"online": True, "service": "x"}),
                                          qos=1, retain=True)
            for d in range(10):
                assert c.session.publish_wait(f"{root}/{n}/d{d}/health", json.dumps({"state": f"s{d}"}), qos=1,
                                              retain=True)
        got = c.collect_retained(f"{root}/+/status", f"{root}/+/+/health", timeout=30)
        assert len(got) == 440 and all(ret for _, _, ret in got)
        env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root}
        r = subprocess.run([sys.executable, "-m", "shared.tools.cli", "status", "--json", "--wait", "30"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert set(data["nodes"]) == set(nodes) and len(data["health"]) == 400
        for n in nodes:  # leave the session broker as it was
            c.session.publish_wait(f"{root}/{n}/status", b"", qos=1, retain=True)
            for d in range(10):
                c.session.publish_wait(f"{root}/{n}/d{d}/health", b"", qos=1, retain=True)


def test_watch_prints_live_messages(broker_session: Broker, echo_node: Node) -> None:
    r = robobus(broker_session, "watch", f"robobus/{echo_node.name}/dev1/state/#", "--count", "3",
                "--seconds", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("state/counter") >= 3


def test_schema_check(tmp_path: Path) -> None:
    env = {**os.environ}
    r = subprocess.run([sys.executable, "-m", "shared.tools.cli", "schema", "--out", str(tmp_path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "asyncapi.yaml").exists() and list((tmp_path / "schemas").glob("*.json"))
    c = subprocess.run([sys.executable, "-m", "shared.tools.cli", "schema", "--out", str(tmp_path), "--check"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert c.returncode == 0
