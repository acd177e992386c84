"""`robobus fleet-watch`'s logic on a fake clock: a site is unreachable once no heartbeat came for the timeout,
reachable again on the next one, each change published once; a site never heard of is unreachable after one
timeout; the watcher's own reconnect does not mark sites down; foreign topics are counted, not crashed on.
Then the real path on host mosquittos (no docker): a centre with the generated central secrets and ACL, an
edge with the generated bridge.conf, the watcher under its own user; the edge frozen (SIGSTOP: a link that
carries nothing any more) is seen unreachable within the bound, and reachable again when it resumes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared.tools.fleet_watch import FleetWatchSettings, Watcher, fail_over, run, unique_client_id
from tests.deploy.deployfiles import host_broker_conf, make_secrets
from tests.deploy.mqttprobe import Probe, creds
from tests.fixtures import free_port, mosquitto_bin


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def w() -> tuple[Watcher, Clock, list[tuple[str, str]]]:
    clock, sent = Clock(), []
    return Watcher(["site-a/robobus", "site-b/robobus"], 4.0, lambda t, v: sent.append((t, v)), clock), clock, sent


def test_reachable_on_a_heartbeat_unreachable_after_the_timeout_and_back(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    assert sent == [("site-a/robobus/_bridge/reachable", "1"), ("site-b/robobus/_bridge/reachable", "1")]
    for _ in range(3):  # heartbeats every 2 s from site-b only
        clock.t += 2.0
        watcher.heartbeat("site-b/robobus/_bridge/uptime")
        watcher.tick()
    assert sent[2:] == [("site-a/robobus/_bridge/reachable", "0")]  # at 6 s > 4 s, not at 4 s
    watcher.tick()
    assert len(sent) == 3  # published once, not at every tick
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    assert sent[3:] == [("site-a/robobus/_bridge/reachable", "1")]
    assert watcher.counts["unreachable"] == 1 and watcher.counts["reachable"] == 3


def test_not_before_the_timeout(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 4.0
    watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent


def test_a_site_never_heard_of_is_unreachable_after_one_timeout(w):
    watcher, clock, sent = w
    watcher.tick()
    assert sent == []
    clock.t += 4.5
    watcher.tick()
    assert sorted(sent) == [("site-a/robobus/_bridge/reachable", "0"), ("site-b/robobus/_bridge/reachable", "0")]


def test_the_watchers_own_reconnect_gives_each_site_a_new_timeout(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 30  # the watcher was cut off from its broker, not the site
    watcher.restart()
    watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent


def test_after_its_own_reconnect_the_watcher_publishes_each_sites_state_again(w):
    """On a clustered centre the reconnect may be to another node, where ejabberd has none of the retained states
    published through the old one: the next heartbeat says "1" again, a silent site "0" one timeout later."""
    watcher, clock, sent = w
    beat = "site-a/robobus/_bridge/uptime"
    clock.t += 3
    watcher.heartbeat(beat)
    clock.t += 3
    watcher.tick()  # site-b: 6 s without a heartbeat
    assert sent == [("site-a/robobus/_bridge/reachable", "1"), ("site-b/robobus/_bridge/reachable", "0")]
    watcher.restart()
    watcher.heartbeat(beat)
    clock.t += 3
    watcher.heartbeat(beat)
    clock.t += 2
    watcher.tick()
    assert sent[2:] == [("site-a/robobus/_bridge/reachable", "1"), ("site-b/robobus/_bridge/reachable", "0")]


class Subscriber:
    """The watcher's SUBSCRIBE on a fake clock: each call a new message id, acknowledged by the test."""

    def __init__(self) -> None:
        self.mids: list[int] = []

    def __call__(self) -> int:
        self.mids.append(len(self.mids) + 1)
        return self.mids[-1]


@pytest.fixture
def rw() -> tuple[Watcher, Clock, list[tuple[str, str]], Subscriber]:
    """A watcher that subscribes again (ejabberd's lost index entry): every 30 s, and before a verdict."""
    clock, sent, sub = Clock(), [], Subscriber()
    watcher = Watcher(["site-a/robobus", "site-b/robobus"], 4.0, lambda t, v: sent.append((t, v)), clock,
                      subscribe=sub, resubscribe_s=30.0)
    watcher.subscribed(0)  # the SUBSCRIBE at connect
    watcher.suback(0)
    return watcher, clock, sent, sub


def test_a_quiet_site_is_subscribed_again_before_it_is_said_unreachable(rw):
    """A site whose heartbeat stopped reaching the watcher (on ejabberd: the subscription dropped from the node's
    index while still listed) is not "0" at the timeout: the watcher subscribes again, and when the heartbeat comes
    after that SUBACK the site never was "0"."""
    watcher, clock, sent, sub = rw
    for r in ("site-a", "site-b"):
        watcher.heartbeat(f"{r}/robobus/_bridge/uptime")
    clock.t += 4.5
    watcher.tick()  # both quiet past the timeout: a SUBSCRIBE, no verdict yet
    assert sub.mids == [1] and len(sent) == 2
    clock.t += 0.1
    watcher.tick()
    assert sub.mids == [1] and len(sent) == 2  # once, not at every tick
    watcher.suback(1)
    clock.t += 1.0
    watcher.heartbeat("site-a/robobus/_bridge/uptime")  # the index holds the watcher again
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    for _ in range(20):
        clock.t += 0.5
        watcher.tick()
        if clock.t % 2 < 0.5:
            watcher.heartbeat("site-a/robobus/_bridge/uptime")
            watcher.heartbeat("site-b/robobus/_bridge/uptime")
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent and ("site-b/robobus/_bridge/reachable", "0") \
        not in sent, sent
    assert watcher.counts["resubscribed"] == 1


def test_a_quiet_site_is_unreachable_one_heartbeat_period_after_the_suback(rw):
    watcher, clock, sent, sub = rw
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    clock.t += 4.5
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    watcher.tick()
    assert sub.mids == [1] and len(sent) == 2
    clock.t += 1.0
    watcher.tick()  # no SUBACK yet: waiting
    assert len(sent) == 2
    watcher.suback(1)
    clock.t += 2.0
    watcher.tick()  # exactly one heartbeat period after the SUBACK: not yet
    assert len(sent) == 2
    clock.t += 0.5
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    watcher.tick()
    assert sent[2:] == [("site-a/robobus/_bridge/reachable", "0")]
    clock.t += 5
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    watcher.tick()
    assert sub.mids == [1] and sent[3:] == []  # a site said "0" is not subscribed for again and again
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    assert sent[3:] == [("site-a/robobus/_bridge/reachable", "1")]


def test_a_subscribe_not_acknowledged_holds_the_verdict_back_until_the_suback_wait(rw):
    """No SUBACK: the watcher's own link may be dead unnoticed (a "0" would be stale); the verdict waits
    suback_wait_s (the run: two keepalives, when paho has dropped a dead link), not forever."""
    watcher, clock, sent, sub = rw
    watcher.suback_wait_s = 30.0
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 4.5
    watcher.tick()
    assert sub.mids == [1]
    for _ in range(59):
        clock.t += 0.5
        watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent and sub.mids == [1]
    clock.t += 1.0
    watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") in sent


def test_sites_never_heard_of_after_a_connect_are_subscribed_for_again_first(rw):
    """Deaf from its start (seen on ejabberd at a cluster's first start and after the watcher's move to another
    node): the sites are not all "0" at the first timeout; the SUBSCRIBE again brings their heartbeats."""
    watcher, clock, sent, sub = rw
    watcher.restart()
    watcher.subscribed(7)
    watcher.suback(7)
    clock.t += 4.5
    watcher.tick()
    assert sub.mids == [1] and sent == []
    watcher.suback(1)
    clock.t += 0.5
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 2.0
    watcher.tick()
    assert sent == [("site-a/robobus/_bridge/reachable", "1"), ("site-b/robobus/_bridge/reachable", "0")]


def test_the_watcher_subscribes_again_every_resubscribe_s_and_not_without_the_setting(rw):
    watcher, clock, sent, sub = rw
    for _ in range(int(95 / 0.5)):  # 95 s of heartbeats every 2 s, ticks every 0.5 s
        clock.t += 0.5
        if clock.t % 2 < 0.5:
            watcher.heartbeat("site-a/robobus/_bridge/uptime")
            watcher.heartbeat("site-b/robobus/_bridge/uptime")
        watcher.tick()
        if sub.mids and sub.mids[-1] not in watcher._acked:
            watcher.suback(sub.mids[-1])
    assert sub.mids == [1, 2, 3]  # at 30, 60, 90 s
    assert all(v == "1" for _, v in sent)
    # without it (mosquitto, the default): the verdict at the timeout, no SUBSCRIBE
    clock2, sent2, sub2 = Clock(), [], Subscriber()
    plain = Watcher(["site-a/robobus"], 4.0, lambda t, v: sent2.append((t, v)), clock2, subscribe=sub2)
    plain.heartbeat("site-a/robobus/_bridge/uptime")
    clock2.t += 4.5
    plain.tick()
    assert sent2[1:] == [("site-a/robobus/_bridge/reachable", "0")] and sub2.mids == []
    assert FleetWatchSettings().fleet_watch_resubscribe_s == 0


def test_the_nodes_of_a_clustered_centre_in_turn():
    nodes = "ejabberd1:1883, ejabberd2:1883,ejabberd3:1883"
    s = FleetWatchSettings(fleet_brokers=nodes, mqtt_url="mqtt://x:1")
    assert s.brokers() == [("ejabberd1", 1883), ("ejabberd2", 1883), ("ejabberd3", 1883)]
    assert FleetWatchSettings(mqtt_url="mqtt://centre:1884").brokers() == [("centre", 1884)]
    for bad in ("ejabberd1", "ejabberd1:x", ":1883", "e:70000"):
        with pytest.raises(ValueError):
            FleetWatchSettings(fleet_brokers=bad)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="t", protocol=mqtt.MQTTv5)
    client.connect_async("ejabberd1", 1883)
    move = fail_over(client, s.brokers(), "test")
    seen = []
    for _ in range(4):
        move()
        seen.append((client.host, client.port))
    assert seen == [("ejabberd2", 1883), ("ejabberd3", 1883), ("ejabberd1", 1883), ("ejabberd2", 1883)]
    assert unique_client_id("fleet-watch") != unique_client_id("fleet-watch")


class _Stop:
    """A stop event for resubscribe_every: `wait` returns False `n` times, then True (no real time)."""

    def __init__(self, n: int) -> None:
        self.n, self.waits = n, []  # type: ignore[var-annotated]

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return len(self.waits) > self.n


class _Client:
    def __init__(self, connected: list[bool]) -> None:
        self.connected, self.subscribed = connected, []  # type: ignore[var-annotated]

    def is_connected(self) -> bool:
        return self.connected.pop(0)

    def subscribe(self, filters: list[tuple[str, int]]) -> None:
        self.subscribed.append(filters)


def test_the_gate_subscribes_again_every_resubscribe_s_while_connected_and_never_without_it():
    from tests.deploy.deployfiles import DEPLOY, load

    gate_mod = load("robobus_fleet_gate", DEPLOY / "fleet_gate.py")
    filters = [("s/robobus/_bridge/reachable", 1), ("s/robobus/+/+/cmd/+", 1)]
    stop, client = _Stop(3), _Client([True, False, True])
    gate_mod.resubscribe_every(client, filters, 10.0, stop)
    assert stop.waits == [10.0] * 4 and client.subscribed == [filters, filters]  # not while disconnected
    stop, client = _Stop(0), _Client([])
    gate_mod.resubscribe_every(client, filters, 0.0, stop)  # mosquitto: waits for the stop, never subscribes
    assert stop.waits == [None] and client.subscribed == []


def test_a_state_the_gate_missed_and_gets_retained_again_is_not_dated_from_its_start():
    """A re-subscribe brings the retained value of a change the gate missed live: dated when it learnt it
    ("since before" then), not "when this gate started"."""
    from tests.deploy.deployfiles import DEPLOY, load

    gate_mod = load("robobus_fleet_gate", DEPLOY / "fleet_gate.py")
    clock = Clock()
    gate = gate_mod.Gate({"site-a/robobus": "site-a"}, now=clock)
    gate.reachability("site-a/robobus", b"0", True)  # retained at the gate's start
    refusal = gate.refusal("site-a/robobus")
    assert refusal is not None and b"(when this gate started)" in refusal
    gate.reachability("site-a/robobus", b"1", False)
    clock.t += 3600
    gate.reachability("site-a/robobus", b"0", True)  # the live "0" missed, its retained value after a re-subscribe
    refusal = gate.refusal("site-a/robobus")
    assert refusal is not None, gate.state
    assert b"unreachable since before 01:01:40 UTC: " in refusal, refusal  # 100 + 3600 s after the epoch


def _gate(clock: Clock):  # type: ignore[no-untyped-def]
    from tests.deploy.deployfiles import DEPLOY, load

    gate_mod = load("robobus_fleet_gate", DEPLOY / "fleet_gate.py")
    return gate_mod, gate_mod.Gate({"site-a/robobus": "site-a"}, now=clock, mono=clock, in_doubt_s=3.0)


def test_a_command_no_heartbeat_follows_is_answered_unavailable_as_not_known_to_be_delivered():
    """The seconds between a cut and fleet-watch's verdict: a command to a reachable site after which the site's
    heartbeat stops is answered `unavailable` once in_doubt_s passed without one, saying that its delivery is not
    known; one a later heartbeat followed is the site's to answer (nothing from the gate)."""
    clock = Clock()
    gate_mod, gate = _gate(clock)
    gate.reachability("site-a/robobus", b"1", True)
    gate.heartbeat("site-a/robobus")  # at 100
    clock.t = 100.5
    assert gate.command("site-a/robobus", "site-a/robobus/_client/op/reply", b"c1", "site-a/robobus/n/d/cmd/x") is None
    clock.t = 100.6
    gate.heartbeat("site-a/robobus")  # in flight as the command came: proves nothing
    clock.t = 102.4
    gate.heartbeat("site-a/robobus")  # the next: the link carried the command
    clock.t = 110
    assert gate.due() == [] and gate.pending == []
    assert gate.command("site-a/robobus", "site-a/robobus/_client/op/reply", b"c2", "site-a/robobus/n/d/cmd/x") is None
    clock.t = 110 + gate_mod.PROOF_S / 2
    gate.heartbeat("site-a/robobus")  # too soon after the command to prove the link carried it
    clock.t = 112.9
    assert gate.due() == []  # not yet in doubt
    clock.t = 113.0
    ((p, body),) = gate.due()
    assert (p.reply_to, p.correlation) == ("site-a/robobus/_client/op/reply", b"c2")
    err = json.loads(body)["error"]
    assert err["code"] == "unavailable", err
    assert "no heartbeat from its broker since 00:01:50 UTC (0.0 s before this command came)" in err["message"]
    assert "whether the command reached the site is not known" in err["message"], err
    assert gate.due() == [] and gate.pending == []  # answered once


def test_commands_to_a_site_never_heard_are_in_doubt_and_a_flood_is_bounded():
    clock = Clock()
    gate_mod, gate = _gate(clock)
    assert gate.command("site-a/robobus", "r", None, "t") is None  # not judged yet: waits for a heartbeat
    clock.t += 3.0
    ((_, body),) = gate.due()
    assert b"no heartbeat from its broker since this gate started (00:01:40 UTC)" in body
    for i in range(gate_mod.PENDING_MAX + 5):
        gate.command("site-a/robobus", f"r{i}", None, "t")
    assert [p.reply_to for p, _ in gate.due()] == [f"r{i}" for i in range(5)]  # the oldest answered at once
    assert len(gate.pending) == gate_mod.PENDING_MAX


def test_a_command_without_a_response_topic_is_answered_where_a_node_answers_it():
    """An MQTT 3 client names no Response Topic: a node answers on <request topic>/reply, and so does the gate."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    clock = Clock()
    gate_mod, gate = _gate(clock)
    assert gate_mod.reply_target("s/robobus/n/d/cmd/x", None) == ("s/robobus/n/d/cmd/x/reply", None)
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic, props.CorrelationData = "s/robobus/_client/op/reply", b"k"
    assert gate_mod.reply_target("s/robobus/n/d/cmd/x", props) == ("s/robobus/_client/op/reply", b"k")
    gate.reachability("site-a/robobus", b"0", False)
    body = gate.command("site-a/robobus", "site-a/robobus/n/d/cmd/x/reply", None, "site-a/robobus/n/d/cmd/x")
    assert body is not None and json.loads(body)["error"]["code"] == "unavailable"
    assert gate.pending == []  # refused at once: nothing waits


def test_foreign_topics_are_counted(w):
    watcher, _, sent = w
    watcher.heartbeat("site-c/robobus/_bridge/uptime")
    watcher.heartbeat("site-a/robobus/status")
    assert watcher.counts["unexpected"] == 2 and sent == []


def test_sites_setting():
    s = FleetWatchSettings(fleet_sites="site-a=site-a/robobus site-b/robobus")
    assert s.roots() == ["site-a/robobus", "site-b/robobus"]
    with pytest.raises(ValueError):
        FleetWatchSettings(fleet_sites="site-a=site-a/#")
    with pytest.raises(ValueError):
        FleetWatchSettings(fleet_watch_timeout_s=1.0)  # below one heartbeat period (2 s): it would flap


def _start(exe: str, conf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"no broker listening on port {port} after {timeout_s:g} s"
            time.sleep(0.05)


@pytest.fixture
def host_fleet(tmp_path: Path) -> Iterator[tuple[int, Path, subprocess.Popen[bytes]]]:
    """(centre's port, centre's secrets, the edge broker's process) with the bridge up."""
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    central, edge = tmp_path / "central", tmp_path / "edge"
    make_secrets.main(["--dir", str(central), "--central", "--site", "site-a=site-a/robobus"])
    for f in central.iterdir():  # a host mosquitto (not the compose uid 1883) reads them
        f.chmod(0o644)
    cport, eport = free_port(), free_port()
    (tmp_path / "central.conf").write_text(host_broker_conf(central, cport))
    u, p = creds(central, "bridge-site-a")
    edge.mkdir()
    (tmp_path / "edge.conf").write_text(
        f"user root\nallow_anonymous true\npersistence false\nlistener {eport} 127.0.0.1\n"
        + make_secrets.bridge_conf("site-a", "site-a/robobus", f"127.0.0.1:{cport}", u, p))
    procs = [_start(exe, tmp_path / "central.conf"), _start(exe, tmp_path / "edge.conf")]
    try:
        for port in (cport, eport):  # both listening before a test connects (a loaded host starts them slowly)
            _wait_listening(port, 15)
        yield cport, central, procs[1]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(5)


def test_on_real_brokers_a_frozen_edge_is_seen_unreachable_within_the_bound_and_back(host_fleet):
    cport, central, edge = host_fleet
    timeout_s = float(make_secrets.WATCH_TIMEOUT_S)
    bound_s = make_secrets.watch_bound_s(timeout_s) + 2.0  # + margin for delivery on a loaded machine
    u, p = creds(central, "fleet-watch")
    settings = FleetWatchSettings(mqtt_url=f"mqtt://127.0.0.1:{cport}", mqtt_username=u, mqtt_password=p,
                                  fleet_sites="site-a=site-a/robobus", fleet_watch_timeout_s=timeout_s)
    stop = threading.Event()
    watch = threading.Thread(target=run, args=(settings, stop), daemon=True)
    viewer = Probe("127.0.0.1", cport, *creds(central, "viewer"))
    deadline = time.monotonic() + 15
    while True:  # the centre may still be starting
        try:
            assert viewer.connect() == 0
            break
        except OSError:
            assert time.monotonic() < deadline, "the centre's broker did not start"
            time.sleep(0.1)
    topic = "site-a/robobus/_bridge/reachable"
    viewer.subscribe(topic)
    watch.start()
    try:
        assert viewer.wait_for(lambda t, p, r: t == topic and p == b"1", 30), viewer.received
        mark = viewer.mark()
        os.kill(edge.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert viewer.wait_for(lambda t, p, r: t == topic and p == b"0", bound_s, mark), \
            f"not seen unreachable within {bound_s} s"
        seen_s = time.monotonic() - frozen_at
        assert seen_s > timeout_s - make_secrets.HEARTBEAT_PERIOD_S - 0.5  # not before the timeout could pass
        mark = viewer.mark()
        os.kill(edge.pid, signal.SIGCONT)
        assert viewer.wait_for(lambda t, p, r: t == topic and p == b"1", 30, mark), "not reachable again"
    finally:
        stop.set()
        watch.join(10)
        viewer.close()


def test_a_command_to_a_cut_site_is_answered_unavailable_at_the_centre(host_fleet):
    """deploy/fleet_gate.py at the centre, under its own user: while the site is reachable the site's node answers
    (the gate is silent); once fleet-watch says the site is cut off, a command sent at the centre is answered at
    once with `unavailable`, naming the site and since when, to the caller's Response Topic and Correlation Data;
    when the site is back, its node answers again."""
    from shared.rpc import RpcClient
    from shared.settings import KitSettings
    from tests.deploy.deployfiles import DEPLOY, load

    gate_mod = load("robobus_fleet_gate", DEPLOY / "fleet_gate.py")
    cport, central, edge = host_fleet
    eport = int(next(line.split()[1] for line in (central.parent / "edge.conf").read_text().splitlines()
                     if line.startswith("listener ")))
    sites = "site-a=site-a/robobus"
    stop = threading.Event()
    threads = []
    for user, target in (("fleet-watch", run), ("fleet-gate", gate_mod.run)):
        u, p = creds(central, user)
        s = FleetWatchSettings(mqtt_url=f"mqtt://127.0.0.1:{cport}", mqtt_username=u, mqtt_password=p,
                               fleet_sites=sites, fleet_watch_timeout_s=float(make_secrets.WATCH_TIMEOUT_S))
        threads.append(threading.Thread(target=target, args=(s, stop), daemon=True))
    # the site's node: answers every command it gets, at the edge broker (anonymous there)
    node = Probe("127.0.0.1", eport)
    deadline = time.monotonic() + 15
    while True:  # the edge's broker may still be starting
        try:
            assert node.connect() == 0
            break
        except OSError:
            assert time.monotonic() < deadline, "the edge's broker did not start"
            time.sleep(0.1)

    def answer(client, userdata, msg) -> None:  # type: ignore[no-untyped-def]
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        reply_to = getattr(msg.properties, "ResponseTopic", None)
        if reply_to:
            props.CorrelationData = msg.properties.CorrelationData
        client.publish(reply_to or f"{msg.topic}/reply", b'{"ok": true, "result": {"from": "site"}}', qos=1,
                       properties=props)  # as a node: no Response Topic (MQTT 3), on <request topic>/reply

    node.client.on_message = answer
    assert node.subscribe("site-a/robobus/+/+/cmd/+") == [1]
    viewer = Probe("127.0.0.1", cport, *creds(central, "viewer"))
    assert viewer.connect() == 0 and viewer.subscribe("site-a/robobus/_bridge/reachable") == [1]
    u, p = creds(central, "operator")
    op = KitSettings(mqtt_url=f"mqtt://127.0.0.1:{cport}", mqtt_username=u, mqtt_password=p,
                     topic_root="site-a/robobus")
    for t in threads:
        t.start()
    try:
        assert viewer.wait_for(lambda t, p, r: p == b"1", 30), "site-a never reachable"
        with RpcClient(op, name="robobus-cli") as c:
            rep = c.call("ethercat-loop", "rh", "get_state", {}, timeout=30)
            assert rep.ok and rep.result == {"from": "site"}, rep  # reachable: the site answers, not the gate
            # an MQTT 3 client at the centre (no Response Topic): the site's <request topic>/reply crosses back
            v3 = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"operator-v3-{os.getpid()}",
                             protocol=mqtt.MQTTv311)
            v3.username_pw_set(u, p)
            replies: list[bytes] = []
            got = threading.Event()
            v3.on_message = lambda cl, ud, m: (replies.append(bytes(m.payload)), got.set())
            subscribed = threading.Event()
            v3.on_subscribe = lambda *a: subscribed.set()
            v3.connect("127.0.0.1", cport)
            v3.loop_start()
            try:
                v3.subscribe("site-a/robobus/ethercat-loop/rh/cmd/get_state/reply", 1)
                assert subscribed.wait(10)
                time.sleep(0.5)  # a requests's retained-free stream: nothing to wait for but the subscription
                v3.publish("site-a/robobus/ethercat-loop/rh/cmd/get_state", b"{}", qos=1)
                assert got.wait(15), "an MQTT 3 request's reply never reached the centre"
                assert json.loads(replies[0]) == {"ok": True, "result": {"from": "site"}}
            finally:
                v3.loop_stop()
                v3.disconnect()
            mark = viewer.mark()
            os.kill(edge.pid, signal.SIGSTOP)
            # sent into the link as it dies, before fleet-watch's verdict: answered, never silent
            t0 = time.monotonic()
            rep = c.call("ethercat-loop", "rh", "get_state", {}, timeout=30)
            answered_s = time.monotonic() - t0
            assert not rep.ok and rep.error and rep.error["code"] == "unavailable", rep
            assert answered_s < make_secrets.watch_bound_s() + 4.0, answered_s  # not the caller's 30 s
            assert viewer.wait_for(lambda t, p, r: p == b"0", make_secrets.watch_bound_s() + 2.0, mark)
            t0 = time.monotonic()
            rep = c.call("ethercat-loop", "rh", "get_state", {}, timeout=30)
            answered_s = time.monotonic() - t0
            assert not rep.ok and rep.error and rep.error["code"] == "unavailable", rep
            assert "site site-a (site-a/robobus) unreachable since" in rep.error["message"], rep.error
            assert answered_s < 10, answered_s  # at once, not the caller's timeout (generous: a busy machine)
            mark = viewer.mark()
            os.kill(edge.pid, signal.SIGCONT)
            assert viewer.wait_for(lambda t, p, r: p == b"1", 30, mark), "not reachable again"
            rep = c.call("ethercat-loop", "rh", "get_state", {}, timeout=30)
            assert rep.ok and rep.result == {"from": "site"}, rep
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(edge.pid, signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(10)
        for probe in (node, viewer):
            probe.close()
