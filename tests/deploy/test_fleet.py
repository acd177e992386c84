"""A fleet on one host: a central broker and two sites, each its own compose project (the same compose file,
its own env: topic root, secrets), each site's broker bridged to the centre over a shared docker network.
One subscriber at the centre sees every site; a command sent at the centre reaches a device at a site and its
reply comes back; a site cut off from the centre is seen as unreachable within seconds (`robobus fleet-watch`:
{root}/_bridge/reachable; the bridge's own Will on {root}/_bridge/state follows within its longer bound), a
command sent to it at the centre then is answered `unavailable` (deploy/fleet_gate.py), it loses nothing it
published with QoS 1 meanwhile, and is reachable and current again when the link returns. The centre's operator
stops one site through its bridge (the bus stop, {root}/_stop) and releases it; a viewer at the centre cannot.
The bridges use TLS with the fleet's CA."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.messages import StopState
from shared.rpc import RpcClient
from shared.stop import StopRound, send_stop
from tests.deploy.conftest import TIMINGS
from tests.deploy.deployfiles import make_secrets
from tests.deploy.mqttprobe import Probe, creds
from tests.deploy.stack import DOCKER, Stack, bridged_host_brokers, run
from tests.kit.motion_node import API

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The bound comes from the bridge's configuration and the broker's keepalive sweep (deploy/make_secrets.py:
# 1.5 keepalives in whole seconds, then the next sweep, then the Will "0"). The margin covers the viewer's delivery
# on a loaded machine, not a longer keepalive.
KEEPALIVE_S = make_secrets.BRIDGE_KEEPALIVE_S
UNREACHABLE_MARGIN_S = 2.0
UNREACHABLE_WITHIN_S = make_secrets.unreachable_bound_s() + UNREACHABLE_MARGIN_S
# The watcher's bound: its timeout (configured here, as the centre's env would) from the last heartbeat before
# the cut, plus one heartbeat period; the same margin for delivery on a loaded machine.
WATCH_TIMEOUT_S = make_secrets.WATCH_TIMEOUT_S
WATCH_WITHIN_S = make_secrets.watch_bound_s(WATCH_TIMEOUT_S) + UNREACHABLE_MARGIN_S
# each site's states reach the centre through its uplink (deploy/uplink.py: compose.edge.yaml)
SITES = {"site-a": ["ethercat-loop-sim", "uplink"], "site-b": ["epuck-sim", "epuck-gateway-sim", "uplink"]}
NODES = {"site-a": ["ethercat-loop"], "site-b": ["epuck-gateway"]}


@pytest.fixture(scope="module")
def fleet(images: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    tag = f"{os.getpid()}"
    wan = f"robobus-wan-{tag}"
    central = Stack(f"robobus-central-{tag}", tmp_path_factory.mktemp("central"), profiles="central", root="robobus",
                    extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": "central",
                               "ROBOBUS_CENTRAL_SITES": " ".join(f"{s}={s}/robobus" for s in SITES),
                               "ROBOBUS_FLEET_WATCH_TIMEOUT_S": str(WATCH_TIMEOUT_S)})
    # the centre's certificate names the address the sites use (its alias on the shared network)
    central.make_secrets("--central", *[a for s in SITES for a in ("--site", f"{s}={s}/robobus")],
                         "--tls-name", "central")
    stacks = {"central": central}
    for site in SITES:
        st = Stack(f"robobus-{site}-{tag}", tmp_path_factory.mktemp(site), root=f"{site}/robobus",
                   extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": f"{site}-broker"})
        # over TLS (the default), checked against the fleet's CA: the centre's TLS listener, not its 1883
        st.make_secrets("--site", site, "--bridge-to", "central:8883",
                        "--bridge-credentials", str(central.secrets / f"bridge-{site}.env"),
                        "--bridge-ca", str(central.secrets / make_secrets.FLEET_CA))
        stacks[site] = st
    try:
        # the three projects come up side by side: a site's bridge that reaches the centre before it listens
        # retries (restart_timeout 1 5), and every test waits on what it checks
        t0 = time.monotonic()
        # the shared network first: compose.sh creates it when missing, which three at once would race
        run([DOCKER, "network", "create", wan])
        with ThreadPoolExecutor(len(stacks)) as pool:
            ups = [pool.submit(central.up)] + [pool.submit(stacks[site].up, "broker", *services)
                                               for site, services in SITES.items()]
            for f in ups:
                f.result()
        TIMINGS["fleet_up_s"] = time.monotonic() - t0
        yield stacks
    finally:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(stacks)) as pool:  # side by side, as they came up
            for f in [pool.submit(st.down) for st in stacks.values()]:
                f.result()
        run([DOCKER, "network", "rm", wan], check=False)
        TIMINGS["fleet_down_s"] = time.monotonic() - t0


def centre_view(central: Stack, seconds: float, until=None) -> list[tuple[str, bytes, bool]]:
    with RpcClient(central.settings("viewer"), name="test-fleet-view") as c:
        out: list[tuple[str, bytes, bool]] = []
        for site in SITES:  # one subscriber, every site's root
            out += c.collect(f"{site}/robobus/#", seconds / len(SITES), until)
    return out


def test_the_edge_bridges_its_heartbeat_out_and_the_centre_lets_only_the_watcher_judge():
    conf = make_secrets.bridge_conf("s", "s/robobus", "c:1883", "u", "p").splitlines()
    assert "sys_interval 1" in conf and "topic uptime out 0 $SYS/broker/ s/robobus/_bridge/" in conf
    acl = make_secrets.central_acl({"s": "s/robobus"})
    watch = acl.split("user fleet-watch\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert watch == ["topic read +/+/_bridge/uptime", "topic write +/+/_bridge/reachable"]


def test_the_watchers_rules_and_filters_do_not_grow_with_the_fleet():
    """At a clustered centre the watchers renew their subscriptions every few seconds, each filter checked against
    every access entry: one filter per site made that N x 12N matches (shared/fleet_topics.py). Their rules and
    filters are one wildcard per depth of the sites' roots, for 2 sites as for 300."""
    from shared.fleet_topics import root_filters

    def rules(acl: str, user: str) -> list[str]:
        return acl.split(f"user {user}\n", 1)[1].split("\n\n", 1)[0].splitlines()

    few = make_secrets.central_acl({f"s{i}": f"s{i}/robobus" for i in range(2)})
    many = make_secrets.central_acl({f"s{i}": f"s{i}/robobus" for i in range(300)})
    for user in ("fleet-watch", "fleet-gate"):
        assert rules(few, user) == rules(many, user), user
    assert rules(many, "fleet-gate") == [
        "topic read +/+/_bridge/reachable", "topic read +/+/_bridge/uptime", "topic read +/+/+/+/cmd/+",
        "topic write +/+/_client/+/reply", "topic write +/+/+/+/cmd/+/reply"]
    # roots of two depths: a wildcard for each
    assert root_filters(["a/robobus", "b", "c/robobus"], "_bridge/uptime") == ["+/+/_bridge/uptime",
                                                                               "+/_bridge/uptime"]


def test_the_bound_assumes_the_keepalive_mosquitto_really_uses():
    """mosquitto raises a bridge keepalive below 5 s to 5 s: a lower figure would make the bound a lie."""
    conf = make_secrets.bridge_conf("s", "s/robobus", "c:1883", "u", "p")
    assert f"keepalive_interval {KEEPALIVE_S}" in conf.splitlines()
    assert KEEPALIVE_S >= 5


def test_one_subscriber_at_the_centre_sees_every_sites_status_health_and_state(fleet):
    central = fleet["central"]
    viewer = Probe("127.0.0.1", central.port, *creds(central.secrets, "viewer"))
    assert viewer.connect() == 0
    for site in SITES:
        viewer.subscribe(f"{site}/robobus/#")
    for site, nodes in NODES.items():
        for node in nodes:
            base = f"{site}/robobus/{node}"
            assert viewer.wait_for(lambda t, p, r, b=base: t == f"{b}/status" and json.loads(p)["online"], 60), \
                (base, viewer.topics()[-20:])
            assert viewer.wait_for(lambda t, p, r, b=base: t.startswith(b) and t.endswith("/health"), 60), base
            assert viewer.wait_for(lambda t, p, r, b=base: t.startswith(b) and "/state/" in t, 60), base
    viewer.close()


def test_a_command_at_the_centre_reaches_a_site_and_the_reply_comes_back(fleet):
    central = fleet["central"]
    calls = (("site-b", "epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0}),
             ("site-a", "ethercat-loop", "rh", "nullify_demands", {}))
    for site, node, device, cmd, payload in calls:
        with RpcClient(central.settings("operator", topic_root=f"{site}/robobus"), name="test-fleet-op") as c:
            rep = c.call(node, device, cmd, payload, timeout=30)
        assert rep.ok, (site, rep)


def _users(acl: str) -> dict[str, list[str]]:
    return {b.split("\n", 1)[0]: b.splitlines()[1:] for b in acl.split("\n\n") if b.startswith("user ")}


def test_the_bus_stop_comes_in_over_the_bridge_and_only_the_centres_operator_writes_it():
    conf = make_secrets.bridge_conf("s", "s/robobus", "c:8883", "u", "p").splitlines()
    # the centre's s/robobus/_stop lands on the site's own fleet latch, never on the site's s/robobus/_stop
    assert [line for line in conf if line.startswith("topic") and "_stop" in line] == [
        'topic "" in 1 s/robobus/_stop/fleet s/robobus/_stop']
    users = _users(make_secrets.central_acl({"s": "s/robobus"}))
    assert "topic read s/robobus/_stop" in users["user bridge-s"]
    assert "topic write s/robobus/_stop" in users["user operator"]
    for user in ("viewer", "fleet-watch", "fleet-gate"):
        assert not any("write" in line and line.endswith("/_stop") for line in users[f"user {user}"]), user
    assert not any("_stop/fleet" in line for lines in users.values() for line in lines)  # a site's topic only
    # at the site: every node and the viewer read both latches; the operator writes the site's only; nobody
    # writes the fleet's (the bridge's publishes are the broker's own)
    site = _users(make_secrets.Acl("s/robobus", {"n1": "svc"}).text())
    for user in ("n1", "viewer", "operator"):
        assert "topic read s/robobus/_stop/fleet" in site[f"user {user}"], user
    assert "topic write s/robobus/_stop" in site["user operator"]
    assert not any("write" in line and "_stop/fleet" in line for lines in site.values() for line in lines)


@pytest.fixture
def host_fleet(tmp_path) -> Iterator[tuple[int, Path, int, Path]]:
    """(centre port, centre secrets, site port, site secrets): stack.bridged_host_brokers."""
    with bridged_host_brokers(tmp_path) as fleet:
        yield fleet


def _retain(probe: Probe, topic: str, stop: StopState) -> None:
    info = probe.client.publish(topic, stop.model_dump_json().encode(), qos=1, retain=True)
    info.wait_for_publish(10)
    assert info.is_published(), topic


def test_a_bridge_reconnect_never_lifts_the_sites_own_stop(host_fleet):
    """The centre's retained release comes down again each time the site's bridge reconnects; it lands on the
    site's fleet latch ({root}/_stop/fleet), so the stop the site's operator set meanwhile on {root}/_stop stays
    retained, and a node that starts after the reconnect comes up stopped. The centre's stop still stops the node
    (on the fleet latch, read under the site's ACL), a site release does not lift it, the centre's release does."""
    from shared import Node
    from shared.rpc import wait_for
    from shared.settings import KitSettings
    from tests.kit.motion_node import build

    cport, central, eport, edge = host_fleet
    root = "site-a/robobus"
    centre_op = Probe("127.0.0.1", cport, *creds(central, "operator"))
    site_op = Probe("127.0.0.1", eport, *creds(edge, "operator"))
    local = Probe("127.0.0.1", eport, *creds(edge, "viewer"))  # what the site's broker sees of its stops
    for p in (centre_op, site_op, local):
        assert p.connect() == 0
    assert local.subscribe(f"{root}/_stop/#") == [1]
    nodes: list[Node] = []

    def start_node() -> Node:
        user, password = creds(edge, "ethercat-loop")
        node = Node(API, KitSettings(mqtt_url=f"mqtt://127.0.0.1:{eport}", mqtt_username=user,
                                     mqtt_password=password, node="ethercat-loop", topic_root=root))
        build(node, devices=("rh",), sensors=())
        nodes.append(node)
        node.start()
        assert node.stop_latch.known_event.wait(30)
        return node

    try:
        # the centre released the site (retained at the centre); it came in over the bridge
        at = local.mark()
        _retain(centre_op, f"{root}/_stop", StopState(active=False, source="centre-operator", ts=time.time()))
        assert local.wait_for(lambda t, p, r: b"centre-operator" in p, 30, at), local.received
        # then the site's operator stopped the site, on the site's broker
        site_stop = StopState(active=True, source="site-operator", reason="person in the cell", ts=time.time())
        _retain(site_op, f"{root}/_stop", site_stop)
        assert local.wait_for(lambda t, p, r: b"site-operator" in p, 30, at)
        # the bridge reconnects: its session at the centre taken over (as a cut link ends it), it connects again
        # (restart_timeout) and its new subscription brings the centre's retained release down again
        at = local.mark()
        kick = Probe("127.0.0.1", cport, *creds(central, "bridge-site-a"), client_id="bridge-site-a")
        assert kick.connect() == 0
        kick.close()
        assert local.wait_for(lambda t, p, r: b"centre-operator" in p, 60, at), \
            f"the bridge did not reconnect and bring the centre's release: {local.received}"
        # a node that starts now comes up stopped, by the site's own stop
        node = start_node()
        assert node.stop_latch.active, (node.stop_latch.state, local.received)
        assert node.stop_latch.channel == "site" and node.stop_latch.state == site_stop
        node.stop()
        # the centre's stop still stops the site (on the fleet latch); the site's release does not lift it
        node = start_node()
        centre_stop = StopState(active=True, source="centre-operator", reason="fleet drill", ts=time.time())
        _retain(centre_op, f"{root}/_stop", centre_stop)
        assert wait_for(lambda: node.stop_latch.state == centre_stop, 30), node.stop_latch.state
        assert node.stop_latch.channel == "fleet"
        _retain(site_op, f"{root}/_stop", StopState(active=False, source="site-operator", ts=time.time()))
        assert wait_for(lambda: node.stop_latch.channels["site"].state is not None
                        and not node.stop_latch.channels["site"].state.active, 30)
        assert node.stop_latch.active and node.stop_latch.state == centre_stop
        # the centre's release lifts it
        _retain(centre_op, f"{root}/_stop", StopState(active=False, source="centre-operator", ts=time.time()))
        assert wait_for(lambda: not node.stop_latch.active, 30), node.stop_latch.state
    finally:
        for n in nodes:
            n.stop()
        for p in (centre_op, site_op, local):
            p.close()


STOP_TIMEOUT_S = 30.0  # the answers come up through the site's uplink (2 Hz per state topic): well within this


def _stop(settings, active: bool, source: str, reason: str = "") -> StopRound:
    with RpcClient(settings, name="test-fleet-stop") as c:
        return send_stop(c, StopState(active=active, source=source, reason=reason, ts=time.time()), STOP_TIMEOUT_S)


def _answered(rnd: StopRound, node: str, active: bool) -> None:
    assert not rnd.silent() and not rnd.failed(), (rnd.online, rnd.silent(), rnd.failed(), rnd.answers)
    a = rnd.answers[node]
    assert a.active is active and a.devices, a
    assert all(d.stopped is active and not d.pending and not d.error for d in a.devices), a


def test_the_centre_stops_one_site_through_its_bridge_and_releases_it(fleet):
    """The centre's operator stops site-a: site-a's nodes answer stopped (their answers come up to the centre), its
    motion commands are refused `stopped`, site-b keeps moving; the centre's release lifts it. A viewer at the
    centre cannot stop a site. The site's own operator still stops and releases its own site."""
    central, site = fleet["central"], fleet["site-a"]
    root_a = "site-a/robobus"
    op_a = central.settings("operator", topic_root=root_a)
    op_b = central.settings("operator", topic_root="site-b/robobus")
    demand = ("ethercat-loop", "rh", "set_demands", {"motors": {"0": 0}})
    speed = ("epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0})
    # what site-a's own broker sees on its stop topics (its own latch and the fleet's)
    local = Probe("127.0.0.1", site.port, *creds(site.secrets, "viewer"))
    assert local.connect() == 0
    local.subscribe(f"{root_a}/_stop/#")
    at_start = local.mark()
    # a viewer at the centre: its stop is refused by the centre's broker and crosses no bridge
    viewer = Probe("127.0.0.1", central.port, *creds(central.secrets, "viewer"))
    assert viewer.connect() == 0
    forged = StopState(active=True, source="viewer-forged", reason="", ts=time.time()).model_dump_json().encode()
    viewer.publish(f"{root_a}/_stop", forged, qos=1)
    viewer.close()
    try:
        rnd = _stop(op_a, True, "centre-operator", "fleet test")
        _answered(rnd, "ethercat-loop", True)
        # the operator's stop crossed the bridge onto the site's fleet latch (never onto the site's own), the
        # viewer's (published before it, on the same path) did not cross
        assert local.wait_for(lambda t, p, r: b"centre-operator" in p, 30, at_start), local.received
        assert all(t == f"{root_a}/_stop/fleet" for t, p, _ in list(local.received) if b"centre-operator" in p), \
            local.received
        assert rnd.answers["ethercat-loop"].channel == "fleet", rnd.answers
        assert not any(b"viewer-forged" in p for _, p, _ in list(local.received)), local.received
        with RpcClient(op_a, name="test-fleet-op") as c:
            rep = c.call(*demand, timeout=30)
        assert not rep.ok and rep.error and rep.error["code"] == "stopped", rep
        assert "centre-operator" in rep.error["message"], rep.error
        with RpcClient(op_b, name="test-fleet-op") as c:  # the other site keeps moving
            rep = c.call(*speed, timeout=30)
        assert rep.ok, rep
        rnd = _stop(op_a, False, "centre-operator")
        _answered(rnd, "ethercat-loop", False)
        with RpcClient(op_a, name="test-fleet-op") as c:
            rep = c.call(*demand, timeout=30)
        assert rep.ok, rep
        # the site's own operator, on the site's broker, still stops and releases its site
        rnd = _stop(site.settings("operator"), True, "site-operator")
        _answered(rnd, "ethercat-loop", True)
        rnd = _stop(site.settings("operator"), False, "site-operator")
        _answered(rnd, "ethercat-loop", False)
    finally:
        local.close()


def test_a_stop_set_at_the_site_survives_a_bridge_reconnect_and_holds_a_node_that_starts_after(fleet):
    """The centre's retained release comes down again each time site-a's bridge reconnects. It lands on site-a's
    fleet latch ({root}/_stop/fleet), so the stop site-a's operator set stays retained on {root}/_stop, and the
    site's node, restarted after the reconnect, comes up stopped: it answers the site's stop and refuses motion."""
    central, site = fleet["central"], fleet["site-a"]
    root_a = "site-a/robobus"
    op_a = central.settings("operator", topic_root=root_a)
    demand = ("ethercat-loop", "rh", "set_demands", {"motors": {"0": 0}})
    local = Probe("127.0.0.1", site.port, *creds(site.secrets, "viewer"))
    assert local.connect() == 0
    assert local.subscribe(f"{root_a}/_stop/#") == [1]
    answers = Probe("127.0.0.1", site.port, *creds(site.secrets, "viewer"))
    assert answers.connect() == 0
    assert answers.subscribe(f"{root_a}/ethercat-loop/_node/state/stop") == [1]
    try:
        # the centre's release, retained at the centre (it crossed the bridge)
        at = local.mark()
        _answered(_stop(op_a, False, "centre-operator"), "ethercat-loop", False)
        assert local.wait_for(lambda t, p, r: b"centre-operator" in p, 30, at), local.received
        # the site's operator stops the site on the site's broker
        site_stop = _stop(site.settings("operator"), True, "site-operator", "reconnect test")
        _answered(site_stop, "ethercat-loop", True)
        # the bridge reconnects: its session at the centre taken over (the link ends as a cut ends it), it connects
        # again (restart_timeout) and its new subscription brings the centre's retained release down again
        at = local.mark()
        kick = Probe("127.0.0.1", central.port, *creds(central.secrets, "bridge-site-a"), client_id="bridge-site-a")
        assert kick.connect() == 0
        kick.close()
        assert local.wait_for(lambda t, p, r: b"centre-operator" in p, 60, at), \
            f"the bridge did not reconnect and bring the centre's release down: {local.received}"
        # the site's node starts again after the reconnect: it comes up stopped, by the site's stop
        restarted = time.time()
        at = answers.mark()
        run([DOCKER, "restart", "-t", "10", site.container_id("ethercat-loop-sim")])

        def fresh(t: str, p: bytes, r: bool) -> bool:
            a = json.loads(p) if p else {}
            return bool(a) and a["received_ts"] >= restarted and a["stop_ts"] == site_stop.stop.ts

        assert answers.wait_for(fresh, 120, at), answers.received[at:]
        a = json.loads(next(p for t, p, r in reversed(answers.received) if fresh(t, p, r)))
        assert a["active"] is True and a["channel"] == "site" and a["source"] == "site-operator", a
        with RpcClient(site.settings("operator"), name="test-fleet-op") as c:
            rep = c.call(*demand, timeout=60)
        assert not rep.ok and rep.error and rep.error["code"] == "stopped", rep
        assert "reconnect test" in rep.error["message"], rep.error
    finally:
        _stop(site.settings("operator"), False, "site-operator")
        local.close()
        answers.close()


def test_a_cut_link_is_seen_at_the_centre_within_seconds_and_nothing_sent_meanwhile_is_lost(fleet):
    central, site = fleet["central"], fleet["site-a"]
    root = "site-a/robobus"
    reachable, state = f"{root}/_bridge/reachable", f"{root}/_bridge/state"
    watcher = Probe("127.0.0.1", central.port, *creds(central.secrets, "viewer"))
    assert watcher.connect() == 0
    watcher.subscribe(f"{root}/#")
    assert watcher.wait_for(lambda t, p, r: t == state and p == b"1", 30)
    assert watcher.wait_for(lambda t, p, r: t == reachable and p == b"1", 30), watcher.topics()[-20:]
    # the other site stays reachable throughout (checked at the end)
    other = Probe("127.0.0.1", central.port, *creds(central.secrets, "viewer"))
    assert other.connect() == 0
    other.subscribe("site-b/robobus/_bridge/reachable")
    # A publisher at the site with the node's own credentials (its topics only), QoS 1, numbered.
    pub = Probe("127.0.0.1", site.port, *creds(site.secrets, "ethercat-loop"))
    assert pub.connect() == 0
    # the site's own view: its node's heartbeats while the link is cut (they must be queued and arrive too)
    local = Probe("127.0.0.1", site.port, *creds(site.secrets, "viewer"))
    assert local.connect() == 0
    local.subscribe(f"{root}/ethercat-loop/rh/health")
    broker = site.container_id("broker")
    net = site.extra_env["ROBOBUS_WAN_NETWORK"]
    at_cut = watcher.mark()
    # the clock starts before the disconnect command (the link goes somewhere inside it): the strict side
    cut_at = time.monotonic()
    run([DOCKER, "network", "disconnect", net, broker])
    TIMINGS["fleet_disconnect_cmd_s"] = time.monotonic() - cut_at
    try:
        assert watcher.wait_for(lambda t, p, r: t == reachable and p == b"0", WATCH_WITHIN_S, at_cut), \
            f"fleet-watch did not see site-a as unreachable within {WATCH_WITHIN_S} s"
        TIMINGS["fleet_watch_unreachable_s"] = time.monotonic() - cut_at
        # a command at the centre for the cut site: answered at once by the centre's gate, not dropped
        t0 = time.monotonic()
        with RpcClient(central.settings("operator", topic_root=root), name="test-fleet-cut") as c:
            rep = c.call("ethercat-loop", "rh", "nullify_demands", {}, timeout=30)
        TIMINGS["fleet_unavailable_answer_s"] = time.monotonic() - t0
        assert not rep.ok and rep.error and rep.error["code"] == "unavailable", rep
        assert "site site-a (site-a/robobus) unreachable since" in rep.error["message"], rep.error
        # the bridge's own Will, still the authoritative "bridge down", within its (longer) bound
        assert watcher.wait_for(lambda t, p, r: t == state and p == b"0",
                                UNREACHABLE_WITHIN_S - (time.monotonic() - cut_at), at_cut), \
            f"the bridge's Will did not say site-a is down within {UNREACHABLE_WITHIN_S} s"
        TIMINGS["fleet_bridge_will_s"] = time.monotonic() - cut_at
        cut_ts = time.time()
        for i in range(50):
            pub.publish(f"{root}/ethercat-loop/rh/event/probe", json.dumps({"seq": i}).encode(), qos=1)
        # until the site's node has sent a health heartbeat (every 5 s) while cut off: queued too
        assert local.wait_for(lambda t, p, r: not r and json.loads(p)["ts"] >= cut_ts, 30), "no heartbeat at the site"
        at_reconnect = watcher.mark()
    finally:
        run([DOCKER, "network", "connect", "--alias", "site-a-broker", net, broker])
    back_at = time.monotonic()
    seqs = lambda: [json.loads(p)["seq"] for t, p, _ in list(watcher.received) if t.endswith("/event/probe")]  # noqa: E731
    assert watcher.wait_for(lambda t, p, r: t == state and p == b"1", 60, at_reconnect), "the bridge did not come back"
    assert watcher.wait_for(lambda t, p, r: t == reachable and p == b"1", 60, at_reconnect), \
        "fleet-watch did not see site-a reachable again"
    TIMINGS["fleet_watch_reachable_again_s"] = time.monotonic() - back_at
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(set(seqs())) < 50:
        time.sleep(0.2)
    TIMINGS["fleet_queue_drained_s"] = time.monotonic() - back_at
    assert sorted(set(seqs())) == list(range(50)), seqs()
    # The node's own heartbeats from the cut-off period arrived too, and it is current again.
    health_ts = [json.loads(p)["ts"] for t, p, _ in list(watcher.received) if t == f"{root}/ethercat-loop/rh/health"]
    assert any(ts >= cut_ts for ts in health_ts), health_ts
    fresh = f"{root}/ethercat-loop/rh/health"
    assert watcher.wait_for(lambda t, p, r: t == fresh and json.loads(p)["ts"] > time.time() - 10, 30)
    # site-b was never marked unreachable (a heartbeat every 2 s against a 4 s timeout does not flap)
    assert other.wait_for(lambda t, p, r: p == b"1", 5)
    assert not any(p == b"0" for _, p, _ in list(other.received)), other.received
    for probe in (pub, watcher, other, local):
        probe.close()
