"""The Foxglove services under the deployment's broker security (mosquitto with deploy/make_secrets.py's password
and ACL files and its client-id plugin): the operator rule is the broker's, as for every client. A bridge that logs
in as `viewer` answers the stop, its release and every command `forbidden` (the broker's PUBACK "not authorized"),
at once, and the stop stays as it was; a bridge that logs in as `operator` stops and releases the site (the node
answers it, its motion command is refused `stopped` meanwhile). The node is tests/kit/motion_node.py (two motion
devices, one read-only), logged in as its service user; the client is the protocol's own (client.js)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shared.rpc import RpcClient, wait_for
from shared.settings import KitSettings
from shared.stop import stop_topic
from shared.tools.asyncapi import build_document
from shared.tools.localbroker import NodeProcess, mosquitto_bin
from tests.dashboard.stack import SimStack, _listening, free_ports
from tests.deploy.deployfiles import host_broker_conf, make_secrets
from tests.deploy.mqttprobe import creds
from tests.foxglove.stack import WsClient, client_missing, start_bridge, wait_for_true
from tests.kit import motion_node

ROOT = "robobus"
NODE = "motion-test"


class Secured:
    def __init__(self, secrets: Path, port: int, stack: SimStack, operator: RpcClient) -> None:
        self.secrets, self.port, self.stack, self.operator = secrets, port, stack, operator

    def env(self, user: str) -> dict[str, str]:
        name, password = creds(self.secrets, user)
        return {"ROBOBUS_MQTT_USERNAME": name, "ROBOBUS_MQTT_PASSWORD": password}

    def retained_stop(self) -> dict[str, object] | None:
        got = [p for _, p, _ in self.operator.collect_retained(stop_topic(ROOT))]
        return json.loads(got[-1]) if got and got[-1] else None


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    why = client_missing() or (None if mosquitto_bin() else "mosquitto is not installed")
    if why:
        pytest.skip(why)
    exe = mosquitto_bin()
    assert exe
    with tempfile.TemporaryDirectory(prefix="robobus-foxglove-acl-") as tmp:
        d = Path(tmp)
        d.chmod(0o755)
        assert make_secrets.main(["--dir", str(d), "--root", ROOT, "--node", NODE]) == 0
        port = free_ports(1)[0]
        conf = d / "mosquitto.conf"
        conf.write_text(host_broker_conf(d, port))
        log = (d / "mosquitto.log").open("wb")
        broker = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        doc = d / "asyncapi.yaml"  # the node's contract, as the bridge's --asyncapi document
        doc.write_text(yaml.safe_dump(build_document([motion_node.API])))
        url = f"mqtt://127.0.0.1:{port}"
        stack = SimStack(None, d, url)  # type: ignore[arg-type]
        node = None
        operator = None
        try:
            assert wait_for(lambda: _listening(port), 20), (d / "mosquitto.log").read_text()
            name, password = creds(d, NODE)
            node = NodeProcess(["-m", "tests.kit.motion_node"], {"ROBOBUS_MQTT_URL": url,
                                                                "ROBOBUS_MQTT_USERNAME": name,
                                                                "ROBOBUS_MQTT_PASSWORD": password})
            oname, opassword = creds(d, "operator")
            operator = RpcClient(KitSettings(mqtt_url=url, mqtt_username=oname, mqtt_password=opassword),
                                 name="foxglove-acl-test")
            operator.connect()

            def online() -> bool:
                return bool([p for _, p, _ in operator.collect_retained(f"{ROOT}/{NODE}/wheel1/health") if p])

            assert wait_for(online, 60, 0.5), node.text()
            s = Secured(d, port, stack, operator)
            s.doc = doc  # type: ignore[attr-defined]
            yield s
        finally:
            if operator is not None:
                operator.close()
            stack.stop()
            if node is not None:
                node.stop()
            broker.kill()
            broker.wait(5)
            log.close()


def bridge_as(secured: Secured, user: str) -> WsClient:
    port = start_bridge(secured.stack, {**secured.env(user), "ROBOBUS_TOPIC_ROOT": ROOT},
                        name=f"foxglove-{user}", args=["--asyncapi", str(secured.doc)])  # type: ignore[attr-defined]
    ws = WsClient(port)
    move = f"{ROOT}/{NODE}/wheel1/cmd/move"
    assert wait_for_true(lambda: {move, f"{ROOT}/_stop/stop"} <= ws.services(), 30), (
        ws.events[-5:], secured.stack.procs[f"foxglove-{user}"].text())
    return ws


def test_a_viewer_bridge_is_refused_the_stop_and_every_command(secured: Secured) -> None:
    before = secured.retained_stop()
    ws = bridge_as(secured, "viewer")
    try:
        stop = ws.call(f"{ROOT}/_stop/stop", {"reason": "viewer tries"}, timeout=20)
        assert stop["valid"] and stop["body"]["error"]["code"] == "forbidden", stop
        assert "not authorized" in stop["body"]["error"]["message"] and "viewer" in stop["body"]["error"]["message"]
        assert stop["ms"] < 5000, stop  # the broker's refusal, not a timeout
        release = ws.call(f"{ROOT}/_stop/release", {}, timeout=20)
        assert release["body"]["error"]["code"] == "forbidden", release
        move = ws.call(f"{ROOT}/{NODE}/wheel1/cmd/move", {"speed": 1.0}, timeout=20)
        assert move["valid"] and move["body"]["error"]["code"] == "forbidden", move
        assert secured.retained_stop() == before
        # what a viewer may read, it sees: the node's health and status
        r = ws.report()
        assert r["topics"][f"{ROOT}/{NODE}/wheel1/health"]["messages"] >= 1
        assert r["topics"][f"{ROOT}/{NODE}/status"]["last"]["online"] is True
    finally:
        ws.close()


def test_an_operator_bridge_stops_and_releases_the_site(secured: Secured) -> None:
    ws = bridge_as(secured, "operator")
    try:
        move = f"{ROOT}/{NODE}/wheel1/cmd/move"
        assert ws.call(move, {"speed": 1.0})["body"]["ok"]
        stop = ws.call(f"{ROOT}/_stop/stop", {"reason": "operator in foxglove"})
        assert stop["valid"] and stop["body"]["ok"], stop
        result = stop["body"]["result"]
        assert result["stop"]["source"].startswith("operator via foxglove"), result["stop"]
        assert result["silent"] == [] and {d["device"] for d in result["answers"][NODE]["devices"]} >= {
            "wheel1", "wheel2"}, result
        held = secured.retained_stop()
        assert held is not None and held["active"] is True and held["reason"] == "operator in foxglove"
        refused = ws.call(move, {"speed": 1.0})
        assert refused["body"]["error"]["code"] == "stopped", refused
        release = ws.call(f"{ROOT}/_stop/release", {"reason": "done"})
        assert release["body"]["ok"], release
        assert ws.call(move, {"speed": 0.0})["body"]["ok"]
    finally:
        ws.close()
