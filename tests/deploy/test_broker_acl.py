"""The broker's security by default, on a real mosquitto: the compose broker's own config
(deploy/mosquitto/compose.conf) with the password and ACL files deploy/make_secrets.py generates.
Anonymous clients are refused; a service writes only under its own node; can-bootloader gets exactly
ethercat-loop's bridge topics; the viewer cannot command; the operator can; replies reach only their client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.deployfiles import host_broker_conf, make_secrets
from tests.deploy.mqttprobe import Probe, creds, start_host_broker
from tests.fixtures import free_port, mosquitto_bin

SETTLE_S = 10.0  # generous: the machine is shared


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    d = tmp_path_factory.mktemp("secrets")
    assert make_secrets.main(["--dir", str(d), "--root", "robobus"]) == 0
    port = free_port()
    conf = d / "mosquitto.conf"
    conf.write_text(host_broker_conf(d, port))
    proc = start_host_broker(exe, conf, port, d)
    yield port, d
    proc.terminate()
    proc.wait(5)


def probe(port: int, d: Path, user: str | None) -> Probe:
    p = Probe("127.0.0.1", port, *(creds(d, user) if user else (None, None)))
    assert p.connect() == 0, f"{user} was refused"
    return p


def test_anonymous_and_wrong_password_are_refused(secure_broker):
    port, d = secure_broker
    anon = Probe("127.0.0.1", port)
    assert anon.connect() != 0  # 135 not authorized
    anon.close()
    user, _ = creds(d, "ethercat-loop")
    wrong = Probe("127.0.0.1", port, user, "not-the-password")
    assert wrong.connect() != 0
    wrong.close()


def test_a_service_cannot_publish_under_another_nodes_topics(secure_broker):
    port, d = secure_broker
    viewer = probe(port, d, "viewer")
    viewer.subscribe("robobus/#")
    ec = probe(port, d, "ethercat-loop")
    ec.publish("robobus/epuck-gateway/epuck1/state/sensors", b'{"forged": true}')
    ec.publish("robobus/epuck-gateway/status", b'{"online": false}')
    ec.publish("robobus/ethercat-loop/rh/state/sentinel", b"{}")  # its own: allowed, and after the others
    assert viewer.wait_for(lambda t, p, r: t.endswith("/sentinel"), SETTLE_S)
    assert not any(t.startswith("robobus/epuck-gateway/") for t in viewer.topics()), viewer.topics()
    for p in (viewer, ec):
        p.close()


def test_only_the_operator_commands_and_the_bridge_user_gets_exactly_the_bridge(secure_broker):
    port, d = secure_broker
    ec = probe(port, d, "ethercat-loop")
    ec.subscribe("robobus/ethercat-loop/+/cmd/+")  # what a node subscribes to: its own commands
    ec.subscribe("robobus/ethercat-loop/+/stream/+")
    viewer, boot, epuck, op = (probe(port, d, u) for u in ("viewer", "can-bootloader", "epuck-gateway", "operator"))
    viewer.publish("robobus/ethercat-loop/rh/cmd/set_demands", b'{"from": "viewer"}')
    epuck.publish("robobus/ethercat-loop/rh/cmd/set_demands", b'{"from": "epuck"}')
    boot.publish("robobus/ethercat-loop/rh/cmd/set_demands", b'{"from": "bootloader"}')  # not its grant
    boot.publish("robobus/ethercat-loop/rh/cmd/bridge_lease", b'{"from": "bootloader"}')
    boot.publish("robobus/ethercat-loop/rh/stream/can_tx", b'{"from": "bootloader"}')
    op.publish("robobus/ethercat-loop/rh/cmd/set_demands", b'{"from": "operator"}')
    assert ec.wait_for(lambda t, p, r: b"operator" in p, SETTLE_S)
    got = {(t.rsplit("/", 1)[-1], p) for t, p, _ in ec.received}
    assert got == {("bridge_lease", b'{"from": "bootloader"}'), ("can_tx", b'{"from": "bootloader"}'),
                   ("set_demands", b'{"from": "operator"}')}, got
    for p in (ec, viewer, boot, epuck, op):
        p.close()


def test_a_reply_reaches_only_the_client_that_asked(secure_broker):
    port, d = secure_broker
    op = probe(port, d, "operator")
    spy = probe(port, d, "viewer")
    mine = f"robobus/_client/{op.client_id}/reply"
    assert op.subscribe(mine) == [1]
    spy.subscribe(f"robobus/_client/{op.client_id}/reply")  # another client's replies: not delivered
    spy.subscribe("robobus/_client/#")
    ec = probe(port, d, "ethercat-loop")
    ec.publish(mine, b'{"ok": true}')
    assert op.wait_for(lambda t, p, r: t == mine, SETTLE_S)
    time.sleep(0.5)  # the spy would have had it by now: same broker, same message
    assert spy.topics() == [], spy.topics()
    for p in (op, spy, ec):
        p.close()


def test_a_client_may_write_its_own_reply_topic_and_no_other(secure_broker):
    """The kit's RpcClient confirms its reply subscription by sending itself a message there before its first
    request: the viewer (or the CLI as operator) must get it back, or every client waits out that confirmation."""
    port, d = secure_broker
    me = probe(port, d, "viewer")
    other = probe(port, d, "operator")
    mine, theirs = f"robobus/_client/{me.client_id}/reply", f"robobus/_client/{other.client_id}/reply"
    assert me.subscribe(mine) == [1] and other.subscribe(theirs) == [1]
    me.publish(theirs, b'{"ok": false}')  # forged into another client's replies: dropped
    me.publish(mine, b'{"ok": true}')
    assert me.wait_for(lambda t, p, r: t == mine, SETTLE_S)
    other.publish(theirs, b"{}")  # the operator's own: delivered, after the forged one would have been
    assert other.wait_for(lambda t, p, r: t == theirs, SETTLE_S)
    assert [p for t, p, _ in other.received if t == theirs] == [b"{}"], other.received
    for p in (me, other):
        p.close()


def test_password_file_uses_mosquittos_own_hash():
    entry = make_secrets.hash_password("secret", bytes.fromhex("d0708c9f2ff930e776e2662e"))
    # mosquitto_passwd -b wrote this for the same salt (0HCMny/5MOd24mYu) and password.
    assert entry == ("$7$101$0HCMny/5MOd24mYu$53VIxrdjqBxv+PojqkNvIHjlUSVhX+HrDbE4y3om7pFKXd8jpzi4bkpGpDggJz/"
                     "satxchuEDjXruIR+u3KTQxA==")


def test_rerun_keeps_passwords_and_rotate_changes_them(tmp_path):
    make_secrets.main(["--dir", str(tmp_path)])
    first = creds(tmp_path, "operator")
    make_secrets.main(["--dir", str(tmp_path)])
    assert creds(tmp_path, "operator") == first
    make_secrets.main(["--dir", str(tmp_path), "--rotate"])
    assert creds(tmp_path, "operator") != first
    assert (tmp_path / "operator.env").stat().st_mode & 0o777 == 0o600


def test_the_viewer_may_watch_the_whole_root(secure_broker):
    """`robobus watch 'robobus/#'` as viewer: the subscription is granted and node topics arrive."""
    port, d = secure_broker
    viewer = probe(port, d, "viewer")
    codes = viewer.subscribe("robobus/#")
    ec = probe(port, d, "ethercat-loop")
    ec.publish("robobus/ethercat-loop/rh/health", b"{}")
    assert viewer.wait_for(lambda t, p, r: t == "robobus/ethercat-loop/rh/health", SETTLE_S), codes
    for p in (viewer, ec):
        p.close()


def test_the_recorder_reads_the_whole_bus_and_writes_nothing(secure_broker):
    """compose profile `record`: its user receives streams, commands and replies (what a replay needs), and
    what it publishes, under a node or a command topic, reaches nobody."""
    port, d = secure_broker
    rec = probe(port, d, "recorder")
    assert rec.subscribe("robobus/#") == [1]
    watch = probe(port, d, "ethercat-loop")
    watch.subscribe("robobus/ethercat-loop/#")
    rec.publish("robobus/ethercat-loop/rh/cmd/set_demands", b'{"from": "recorder"}')
    rec.publish("robobus/ethercat-loop/status", b'{"online": false}')
    ec, op = probe(port, d, "ethercat-loop"), probe(port, d, "operator")
    ec.publish("robobus/ethercat-loop/rh/stream/can_rx", b"{}")
    ec.publish(f"robobus/_client/{op.client_id}/reply", b"{}")
    op.publish("robobus/ethercat-loop/rh/cmd/nullify_demands", b'{"from": "operator"}')
    assert rec.wait_for(lambda t, p, r: t.endswith("/cmd/nullify_demands"), SETTLE_S), rec.topics()
    assert {"robobus/ethercat-loop/rh/stream/can_rx", f"robobus/_client/{op.client_id}/reply"} <= set(rec.topics())
    assert watch.wait_for(lambda t, p, r: b"operator" in p, SETTLE_S)
    assert not any(b"recorder" in p or t.endswith("/status") for t, p, _ in watch.received), watch.received
    for p in (rec, watch, ec, op):
        p.close()


def test_only_the_operator_sets_or_releases_the_bus_stop(secure_broker):
    """{root}/_stop (shared/stop.py): the operator sets and releases it; every service node and the viewer read it
    and none of them can write it (a forged release is dropped: the retained stop stays the operator's)."""
    port, d = secure_broker
    topic = "robobus/_stop"
    ec, viewer = probe(port, d, "ethercat-loop"), probe(port, d, "viewer")
    assert ec.subscribe(topic) == [1] and viewer.subscribe(topic) == [1]
    op, epuck = probe(port, d, "operator"), probe(port, d, "epuck-gateway")

    def state(active: bool, source: str) -> bytes:
        return json.dumps({"active": active, "source": source, "reason": "acl test", "ts": time.time()}).encode()

    def write(p: Probe, payload: bytes) -> None:
        p.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)

    stop = state(True, "operator")
    write(op, stop)
    assert ec.wait_for(lambda t, p, r: p == stop, SETTLE_S) and viewer.wait_for(lambda t, p, r: p == stop, SETTLE_S)
    for forger in (viewer, epuck, ec):  # a release from anyone but the operator
        write(forger, state(False, forger.username or ""))
    release = state(False, "operator")
    write(op, release)  # the operator's own release, after the forged ones would have arrived
    assert ec.wait_for(lambda t, p, r: p == release, SETTLE_S)
    assert [p for t, p, _ in ec.received if t == topic] == [stop, release], ec.received
    # the retained stop is the operator's: a node that starts now reads it
    write(op, stop)
    for forger in (viewer, epuck):
        write(forger, state(False, "forged"))
    late = probe(port, d, "roi-modules")
    assert late.subscribe(topic) == [1]
    assert late.wait_for(lambda t, p, r: t == topic and r, SETTLE_S)
    assert [p for t, p, r in late.received if r] == [stop]
    write(op, b"")  # leave no stop on the module's broker
    for p in (ec, viewer, op, epuck, late):
        p.close()


def test_robobus_stop_as_viewer_changes_nothing_and_as_operator_stops_the_node(secure_broker):
    """End to end under the deployment's ACL: a node (as its service user) obeys the stop the operator's `robobus
    stop` sets and the operator's `--release` lifts; the viewer's `robobus stop --release` (or stop) reaches no node
    and says why."""
    import os
    import subprocess
    import sys

    from shared import Node
    from shared.localbroker import REPO
    from shared.rpc import wait_for
    from shared.settings import KitSettings
    from tests.kit.motion_node import API, build

    port, d = secure_broker
    user, password = creds(d, "ethercat-loop")
    node = Node(API, KitSettings(mqtt_url=f"mqtt://127.0.0.1:{port}", mqtt_username=user, mqtt_password=password,
                                 node="ethercat-loop"))
    wheels = build(node, devices=("rh",), sensors=())
    node.start()

    def robobus(who: str, *args: str) -> subprocess.CompletedProcess[str]:
        u, pw = creds(d, who)
        env = {**os.environ, "ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{port}", "ROBOBUS_MQTT_USERNAME": u,
               "ROBOBUS_MQTT_PASSWORD": pw, "COLUMNS": "200"}
        return subprocess.run([sys.executable, "-m", "shared.cli", "stop", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    try:
        assert node.stop_latch.known_event.wait(SETTLE_S)
        v = robobus("viewer", "--reason", "viewer tries", "--timeout", "2")
        assert v.returncode == 1 and "allowed to write robobus/_stop" in v.stdout, v.stdout + v.stderr
        assert not node.stop_latch.active and not wheels["rh"].stops
        o = robobus("operator", "--reason", "operator stops")
        assert o.returncode == 0 and "stopped" in o.stdout, o.stdout + o.stderr
        assert node.stop_latch.active and wheels["rh"].stops
        v = robobus("viewer", "--release", "--timeout", "2")
        assert v.returncode == 1 and node.stop_latch.active, v.stdout
        o = robobus("operator", "--release")
        assert o.returncode == 0 and "released" in o.stdout, o.stdout + o.stderr
        assert wait_for(lambda: not node.stop_latch.active, SETTLE_S)
    finally:
        node.stop()
        op = probe(port, d, "operator")
        op.client.publish("robobus/_stop", b"", qos=1, retain=True).wait_for_publish(10)
        op.close()
