"""The broker's security by default, on a real mosquitto: the compose broker's own config
(deploy/mosquitto/compose.conf) with the password and ACL files deploy/make_secrets.py generates.
Anonymous clients are refused; a service writes only under its own node; can-bootloader gets exactly
ethercat-loop's bridge topics; the viewer cannot command; the operator can; replies reach only their client."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

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
    if proc.stdout:
        proc.stdout.close()


def probe(port: int, d: Path, user: str | None) -> Probe:
    p = Probe("127.0.0.1", port, *(creds(d, user) if user else (None, None)))
    assert p.connect() == 0, f"{user} was refused"
    return p


def request(p: Probe, topic: str, reply_to: str, payload: bytes = b"{}") -> None:
    """A command as the kit sends it: MQTT 5 Response Topic and Correlation Data."""
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = reply_to
    props.CorrelationData = uuid.uuid4().bytes
    p.publish(topic, payload, props=props)


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
    request(op, "robobus/ethercat-loop/rh/cmd/get_state", mine)  # a node answers only requests it received
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
    request(op, "robobus/ethercat-loop/rh/cmd/get_state", f"robobus/_client/{op.client_id}/reply")
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
    from shared.rpc import wait_for
    from shared.settings import KitSettings
    from shared.tools.localbroker import REPO
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
        return subprocess.run([sys.executable, "-m", "shared.tools.cli", "stop", *args], cwd=REPO, env=env,
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


NOT_AUTHORIZED = 135  # CONNACK / PUBACK reason code


def test_a_client_id_belongs_to_its_user_no_session_takeover(secure_broker):
    """A viewer that connects with an operator's client id (visible in the Response Topic of the operator's
    commands, which the viewer reads) is refused at CONNECT: the operator stays connected and its replies reach
    only it. Every user connects as `<user>` or `<user>-...`; any other id is refused too."""
    port, d = secure_broker
    op = probe(port, d, "operator")
    assert op.client_id.startswith("operator-")
    mine = f"robobus/_client/{op.client_id}/reply"
    assert op.subscribe(mine) == [1]
    thief = Probe("127.0.0.1", port, *creds(d, "viewer"), client_id=op.client_id)
    assert thief.connect() == NOT_AUTHORIZED
    thief.close()
    for cid in ("robobus-cli-1234", "operator", "viewerx-1", "epuck-gateway-x"):  # not the viewer's
        p = Probe("127.0.0.1", port, *creds(d, "viewer"), client_id=cid)
        assert p.connect() == NOT_AUTHORIZED, cid
        p.close()
    ok = Probe("127.0.0.1", port, *creds(d, "viewer"), client_id="viewer")
    assert ok.connect() == 0
    ok.close()
    time.sleep(0.5)  # a takeover would have closed the operator's connection by now
    assert op.client.is_connected()
    ec = probe(port, d, "ethercat-loop")
    request(op, "robobus/ethercat-loop/rh/cmd/get_state", mine)
    ec.publish(mine, b'{"ok": true}')
    assert op.wait_for(lambda t, p, r: t == mine, SETTLE_S)
    for p in (op, ec):
        p.close()


def test_the_kits_clients_use_ids_the_broker_accepts(secure_broker):
    """shared.settings.bound_client_id: the kit's MqttSession (RpcClient, Node) and the recorder's lean client
    put their user's name in front of their client id, and connect."""
    from shared.mqtt.lean import LeanPublisher
    from shared.rpc import RpcClient
    from shared.settings import KitSettings, bound_client_id

    port, d = secure_broker
    assert bound_client_id("viewer", "robobus-cli-1") == "viewer-robobus-cli-1"
    assert bound_client_id("viewer", "viewer-x") == "viewer-x" and bound_client_id(None, "a") == "a"
    for user in ("viewer", "operator"):
        u, pw = creds(d, user)
        s = KitSettings(mqtt_url=f"mqtt://127.0.0.1:{port}", mqtt_username=u, mqtt_password=pw)
        with RpcClient(s, name="robobus-cli") as c:
            assert c.session.client_id.startswith(f"{user}-robobus-cli-"), c.session.client_id
            assert c.reply_topic == f"robobus/_client/{c.session.client_id}/reply"
            assert c.session.connected.wait(SETTLE_S)
    u, pw = creds(d, "recorder")
    lean = LeanPublisher(KitSettings(mqtt_url=f"mqtt://127.0.0.1:{port}", mqtt_username=u, mqtt_password=pw),
                          "robobus-record-x")
    lean.close()


def test_make_secrets_refuses_a_user_named_like_anothers_client_ids(tmp_path):
    with pytest.raises(SystemExit, match="bridge-site-a"):
        make_secrets.main(["--dir", str(tmp_path), "--central", "--site", "site=site/robobus",
                           "--site", "site-a=site-a/robobus"])


def test_a_service_answers_only_requests_it_received(secure_broker):
    """A compromised e-puck gateway cannot answer for the hand: a node may write a client's reply topic only
    after a request naming it reached that node (published on {root}/<node>/<device>/cmd/<name> by someone
    else); a node's command to itself grants nothing. Forged replies are refused (PUBACK 135)."""
    port, d = secure_broker
    op = probe(port, d, "operator")
    mine = f"robobus/_client/{op.client_id}/reply"
    assert op.subscribe(mine) == [1]
    ec, epuck, roi = (probe(port, d, u) for u in ("ethercat-loop", "epuck-gateway", "roi-modules"))
    request(op, "robobus/ethercat-loop/rh/cmd/get_state", mine)
    epuck.publish(mine, b'{"from": "epuck before"}')  # it got no request from this client
    request(roi, "robobus/roi-modules/m1/cmd/get_state", mine)  # its own command topic, naming op's replies
    roi.publish(mine, b'{"from": "roi"}')
    ec.publish(mine, b'{"from": "hand"}')  # the node that was asked
    assert op.wait_for(lambda t, p, r: b"hand" in p, SETTLE_S)
    request(op, "robobus/epuck-gateway/epuck1/cmd/get_state", mine)  # now the gateway was asked too
    epuck.publish(mine, b'{"from": "epuck after"}')
    assert op.wait_for(lambda t, p, r: b"epuck after" in p, SETTLE_S)
    assert [p for t, p, _ in op.received] == [b'{"from": "hand"}', b'{"from": "epuck after"}'], op.received
    refused: list[int] = []
    epuck.client.on_publish = lambda c, u, mid, rc, props: refused.append(rc.value)
    epuck.publish(f"robobus/_client/{roi.client_id}/reply", b"{}")
    assert refused == [NOT_AUTHORIZED], refused  # the broker says so to the forger
    for p in (op, ec, epuck, roi):
        p.close()


@pytest.fixture(scope="module")
def central_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    d = tmp_path_factory.mktemp("central")
    assert make_secrets.main(["--dir", str(d), "--central", "--site", "site-a=site-a/robobus",
                              "--site", "site-b=site-b/robobus"]) == 0
    port = free_port()
    conf = d / "mosquitto.conf"
    conf.write_text(host_broker_conf(d, port))
    proc = start_host_broker(exe, conf, port, d)
    yield port, d
    proc.terminate()
    proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def test_a_site_cannot_write_its_own_reachability_at_the_centre(central_broker):
    """{root}/_bridge/reachable is the centre's view (robobus fleet-watch): a site's bridge user may write its
    nodes' topics, heartbeat and notification, but not that topic, nor anything of another site."""
    port, d = central_broker
    viewer = probe(port, d, "viewer")
    assert viewer.subscribe("site-a/robobus/_bridge/#") == [1] and viewer.subscribe("site-b/robobus/#") == [1]
    site = Probe("127.0.0.1", port, *creds(d, "bridge-site-a"), client_id="bridge-site-a")
    assert site.connect() == 0
    site.publish("site-a/robobus/_bridge/reachable", b"1")
    site.publish("site-a/robobus/_bridge/reachable", b"0")
    site.publish("site-b/robobus/ethercat-loop/status", b'{"online": false}')
    site.publish("site-a/robobus/_bridge/uptime", b"42")  # its heartbeat: allowed
    watch = probe(port, d, "fleet-watch")
    watch.publish("site-a/robobus/_bridge/reachable", b"1")  # the centre's own view: allowed
    assert viewer.wait_for(lambda t, p, r: t.endswith("/reachable"), SETTLE_S)
    assert viewer.wait_for(lambda t, p, r: t.endswith("/uptime"), SETTLE_S)
    time.sleep(0.5)
    assert [(t, p) for t, p, _ in viewer.received] == [("site-a/robobus/_bridge/uptime", b"42"),
                                                       ("site-a/robobus/_bridge/reachable", b"1")], viewer.received
    for p in (viewer, site, watch):
        p.close()


def test_a_node_that_may_call_another_cannot_have_it_answer_a_third_client(secure_broker):
    """can-bootloader may call ethercat-loop (cmd/bridge_lease: the palm's CAN bridge). A request of its naming the
    operator's reply topic as its Response Topic reaches the hand's node, whose dispatch answers there (an unknown
    command is answered too): the broker refuses that answer, since a request grants a reply only on its sender's
    own reply topic. The same request naming can-bootloader's own reply topic is answered; the operator's own
    request is answered to the operator, and only that answer reaches it."""
    from shared import Node
    from shared.settings import KitSettings
    from tests.kit.motion_node import API, build

    port, d = secure_broker
    user, password = creds(d, "ethercat-loop")
    node = Node(API, KitSettings(mqtt_url=f"mqtt://127.0.0.1:{port}", mqtt_username=user, mqtt_password=password,
                                 node="ethercat-loop"))
    build(node, devices=("rh",), sensors=())
    node.start()
    op, boot = probe(port, d, "operator"), probe(port, d, "can-bootloader")
    try:
        ops, boots = f"robobus/_client/{op.client_id}/reply", f"robobus/_client/{boot.client_id}/reply"
        assert op.subscribe(ops) == [1] and boot.subscribe(boots) == [1]
        assert node.session.connected.wait(SETTLE_S)
        request(boot, "robobus/ethercat-loop/rh/cmd/bridge_lease", ops, b'{"from": "can-bootloader"}')
        request(boot, "robobus/ethercat-loop/rh/cmd/bridge_lease", boots, b'{"from": "can-bootloader"}')
        assert boot.wait_for(lambda t, p, r: t == boots, SETTLE_S), "the node did not answer can-bootloader itself"
        request(op, "robobus/ethercat-loop/rh/cmd/read", ops)
        assert op.wait_for(lambda t, p, r: t == ops and b"speed" in p, SETTLE_S), op.received
        time.sleep(0.5)
        assert len(op.received) == 1, f"the node answered can-bootloader's request onto the operator's: {op.received}"
    finally:
        for p in (op, boot):
            p.close()
        node.stop()
