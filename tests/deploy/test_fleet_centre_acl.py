"""A fleet centre's ACL under attack: one probe suite (`centre_probes`) that every centre runs, the single mosquitto
centre here (a host mosquitto with the generated centre ACL and the broker plugin) and the clustered ejabberd centre
in tests/deploy/test_cluster.py. Each probe is one thing a centre user must not do: read another client's replies
(with that client's id, with the id `+`, or with a wildcard), forge them, command or stop a site without being the
operator, write another site's topics or the centre's own view of a site. The centre must let none through.

The evidence: a read leaks when the attacker receives what a legitimate client published there; a write leaks when
the victim (a client that may read the topic) receives the forgery. Where the broker checks a subscription's filter
once, at SUBSCRIBE, and every publish at once (ejabberd mod_mqtt: `filters_checked`), a granted SUBACK or an
accepted PUBACK is access too: ejabberd can miss a delivery to a subscriber (deploy/README.md, "A clustered
centre"), and a missed forgery must not pass for a refused one. On mosquitto a granted SUBACK is not access (it
filters each message by the ACL on delivery), so only deliveries count there."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.deployfiles import host_broker_conf, make_secrets
from tests.deploy.mqttprobe import Probe, creds, start_host_broker
from tests.fixtures import free_port, mosquitto_bin

A, B = "site-a/robobus", "site-b/robobus"
SITES = {"site-a": A, "site-b": B}
SETTLE_S = 1.0  # after the legitimate copies arrived: a leaked copy, on the same broker, would have too
WAIT_S = 20.0

# (who, client id: None = the user's own, "OP" = the operator's, else literal)
Connect = Callable[[str, str | None], Probe | None]


@dataclass
class Read:
    name: str
    user: str
    client_id: str | None
    filter: str  # "{op}" = the operator's client id
    of: str = "reply"  # what leaks: the operator's replies, or a command to site-b ("cmd"), which viewers may read


@dataclass
class Write:
    name: str
    user: str
    client_id: str | None
    topic: str
    victim: str  # "op" (the operator's replies), "bridge-a" (site-a's commands, stop, budget), "viewer"


READS = [
    Read("viewer with the operator's id reads its replies", "viewer", "OP", f"{A}/_client/{{op}}/reply"),
    Read("viewer with id + reads every reply", "viewer", "+", f"{A}/_client/+/reply"),
    Read("viewer with id + reads site-b's replies", "viewer", "+", f"{B}/_client/+/reply"),
    Read("viewer reads every reply by wildcard", "viewer", None, f"{A}/_client/+/reply"),
    Read("viewer reads _client/#", "viewer", None, f"{A}/_client/#"),
    Read("viewer reads #", "viewer", None, "#"),
    Read("site-a's bridge with id + reads every reply", "bridge-site-a", "+", f"{A}/_client/+/reply"),
    Read("site-a's bridge with the operator's id reads its replies", "bridge-site-a", "OP",
         f"{A}/_client/{{op}}/reply"),
    Read("site-a's bridge reads its own replies by wildcard", "bridge-site-a", None, f"{A}/_client/+/reply"),
    Read("site-a's bridge reads site-b's commands", "bridge-site-a", None, f"{B}/+/+/cmd/+", "cmd"),
    Read("site-b's bridge with id + reads site-b's replies", "bridge-site-b", "+", f"{B}/_client/+/reply"),
    Read("fleet-watch with id + reads every reply", "fleet-watch", "+", f"{A}/_client/+/reply"),
    Read("fleet-gate with the operator's id reads its replies", "fleet-gate", "OP", f"{B}/_client/{{op}}/reply"),
    Read("operator with id + reads every client's replies", "operator", "+", f"{A}/_client/+/reply"),
]

WRITES = [
    Write("viewer with the operator's id forges its reply", "viewer", "OP", f"{A}/_client/{{op}}/reply", "op"),
    Write("viewer forges the operator's reply", "viewer", None, f"{A}/_client/{{op}}/reply", "op"),
    Write("site-a's bridge with the operator's id forges its site-b reply", "bridge-site-a", "OP",
          f"{B}/_client/{{op}}/reply", "op"),
    Write("site-a's bridge forges a site-b reply", "bridge-site-a", None, f"{B}/_client/{{op}}/reply", "op"),
    Write("site-b's bridge with the operator's id forges its site-a reply", "bridge-site-b", "OP",
          f"{A}/_client/{{op}}/reply", "op"),
    Write("fleet-watch with the operator's id forges its reply", "fleet-watch", "OP", f"{A}/_client/{{op}}/reply",
          "op"),
    Write("viewer commands site-a", "viewer", None, f"{A}/ethercat-loop/rh/cmd/nullify_demands", "bridge-a"),
    Write("viewer with the operator's id commands site-a", "viewer", "OP", f"{A}/ethercat-loop/rh/cmd/nullify_demands",
          "bridge-a"),
    Write("viewer with id 'operator' stops site-a", "viewer", "operator", f"{A}/_stop", "bridge-a"),
    Write("viewer stops site-a", "viewer", None, f"{A}/_stop", "bridge-a"),
    Write("viewer sets site-a's uplink budget", "viewer", None, f"{A}/_uplink/set", "bridge-a"),
    Write("site-b's bridge stops site-a", "bridge-site-b", None, f"{A}/_stop", "bridge-a"),
    Write("fleet-watch commands site-a", "fleet-watch", None, f"{A}/ethercat-loop/rh/cmd/nullify_demands",
          "bridge-a"),
    Write("fleet-gate stops site-a", "fleet-gate", None, f"{A}/_stop", "bridge-a"),
    Write("site-a's bridge says itself reachable", "bridge-site-a", None, f"{A}/_bridge/reachable", "viewer"),
    Write("site-a's bridge writes site-b's status", "bridge-site-a", None, f"{B}/ethercat-loop/status", "viewer"),
]


def _sentinel_loop(publish: Callable[[], None], got: Callable[[], bool], what: str) -> None:
    """Publish a legitimate message until its reader has one (ejabberd can miss one delivery: deploy/README.md)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        publish()
        if got():
            return
        time.sleep(1.0)
    raise AssertionError(f"the legitimate {what} never arrived: the probe proves nothing")


def centre_probes(connect: Connect, filters_checked: bool) -> dict[str, str]:
    """Every probe against a centre with sites site-a and site-b: {probe: how it got through} for those that did."""
    opened: list[Probe] = []

    def open_(user: str, cid: str | None) -> Probe | None:
        p = connect(user, cid)
        if p is not None:
            opened.append(p)
        return p

    try:
        op = open_("operator", None)
        assert op is not None, "the operator was refused"
        replies = {s: f"{r}/_client/{op.client_id}/reply" for s, r in SITES.items()}
        for t in replies.values():
            assert op.subscribe(t)[0] < 0x80
        # victims: clients that may read the topics a forgery goes to (the bridge's own id is its real bridge's:
        # a probe must not take over that session)
        bridge_a = open_("bridge-site-a", "bridge-site-a-probe")
        viewer = open_("viewer", None)
        assert bridge_a is not None and viewer is not None
        for f in (f"{A}/+/+/cmd/+", f"{A}/_stop", f"{A}/_uplink/set"):
            assert bridge_a.subscribe(f)[0] < 0x80, f
        for f in (f"{A}/_bridge/reachable", f"{B}/+/status"):
            assert viewer.subscribe(f)[0] < 0x80, f
        victims = {"op": op, "bridge-a": bridge_a, "viewer": viewer}
        marks = {v: p.mark() for v, p in victims.items()}
        leaks: dict[str, str] = {}

        def cid(c: str | None) -> str | None:
            return op.client_id if c == "OP" else c

        # reads: the attackers subscribe, then the secrets are published by who may
        spies: list[tuple[Read, Probe]] = []
        for r in READS:
            p = open_(r.user, cid(r.client_id))
            if p is None:
                continue  # refused at CONNECT
            codes = p.subscribe(r.filter.format(op=op.client_id))
            if filters_checked and codes[0] < 0x80:
                leaks[r.name] = f"SUBACK {codes[0]} for {r.filter}"
            spies.append((r, p))
        secret = {"reply": f"reply-{uuid.uuid4().hex}".encode(), "cmd": f"cmd-{uuid.uuid4().hex}".encode()}
        for t in replies.values():
            op.publish(t, secret["reply"])  # the operator's own replies
        op.publish(f"{B}/ethercat-loop/rh/cmd/get_state", secret["cmd"])  # a command to site-b
        assert op.wait_for(lambda t, p, r: p == secret["reply"], WAIT_S), "the operator's own reply never came back"
        # writes: every forgery acknowledged before the legitimate messages that end each victim's wait
        forged = f"forged-{uuid.uuid4().hex}".encode()
        for w in WRITES:
            p = open_(w.user, cid(w.client_id))
            if p is None:
                continue
            rc: list[int] = []
            p.client.on_publish = lambda c, u, mid, code, props, rc=rc: rc.append(code.value)
            p.publish(w.topic.format(op=op.client_id), forged + b" " + w.name.encode())
            if filters_checked and rc and rc[0] < 0x80:
                leaks[w.name] = f"PUBACK {rc[0]} on {w.topic}"
        end = f"end-{uuid.uuid4().hex}".encode()
        _sentinel_loop(lambda: op.publish(replies["site-a"], end),
                       lambda: op.wait_for(lambda t, p, r: p == end, 0.2, marks["op"]), "reply")
        _sentinel_loop(lambda: op.publish(f"{A}/ethercat-loop/rh/cmd/get_state", end),
                       lambda: bridge_a.wait_for(lambda t, p, r: p == end, 0.2, marks["bridge-a"]), "command")
        fw = open_("fleet-watch", None)
        assert fw is not None
        reachable = f"{A}/_bridge/reachable"
        _sentinel_loop(lambda: fw.publish(reachable, b"1"),
                       lambda: viewer.wait_for(lambda t, p, r: t == reachable and p == b"1", 0.2, marks["viewer"]),
                       "reachability")
        time.sleep(SETTLE_S)
        for r, p in spies:
            if any(pl == secret[r.of] for _, pl, _ in list(p.received)):
                leaks.setdefault(r.name, f"received a secret on {r.filter}")
        for w in WRITES:
            got = victims[w.victim].received[marks[w.victim]:]
            if any(pl == forged + b" " + w.name.encode() for _, pl, _ in list(got)):
                leaks.setdefault(w.name, f"the forgery reached {w.victim}")
        return leaks
    finally:
        for p in opened:
            p.close()


def probe_count() -> int:
    return len(READS) + len(WRITES)


@pytest.fixture(scope="module")
def mosquitto_centre(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    d = tmp_path_factory.mktemp("centre")
    assert make_secrets.main(["--dir", str(d), "--central", *[a for s, r in SITES.items()
                                                              for a in ("--site", f"{s}={r}")]]) == 0
    port = free_port()
    conf = d / "mosquitto.conf"
    conf.write_text(host_broker_conf(d, port))
    proc = start_host_broker(exe, conf, port, d)
    yield port, d
    proc.terminate()
    proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def connector(host: str, port: int, secrets: Path) -> Connect:
    def connect(user: str, client_id: str | None) -> Probe | None:
        p = Probe(host, port, *creds(secrets, user), client_id=client_id or "")
        if p.connect() != 0:
            p.close()
            return None
        return p
    return connect


def test_no_probe_gets_through_the_mosquitto_centre(mosquitto_centre):
    port, d = mosquitto_centre
    leaks = centre_probes(connector("127.0.0.1", port, d), filters_checked=False)
    assert not leaks, f"{len(leaks)} of {probe_count()} probes got through: {leaks}"


def test_the_cluster_binds_every_rule_to_the_users_client_ids():
    """The clustered centre's rules name a user with its client ids (ejabberd's resource_regexp on the MQTT client
    id): no rule allows a user alone, none allows everyone (the reply pattern lists each user with its ids)."""
    import re

    import yaml

    acl = make_secrets.central_acl(SITES)
    users = ["bridge-site-a", "bridge-site-b", "fleet-watch", "fleet-gate", "operator", "viewer"]
    conf = yaml.safe_load(make_secrets.ejabberd_conf(acl, users))
    rules = conf["access_rules"]
    used = set(conf["modules"]["mod_mqtt"]["access_publish"].values()) | set(
        conf["modules"]["mod_mqtt"]["access_subscribe"].values())
    assert used <= set(rules)
    for name, entries in rules.items():
        for entry in entries:
            allow = entry["allow"]
            assert set(allow) == {"user", "resource_regexp"}, (name, entry)
            ids = re.compile(allow["resource_regexp"])
            u = allow["user"]
            assert ids.match(u) and ids.match(f"{u}-robobus-cli-1") and not ids.match(f"{u}x-1"), allow
            assert not ids.match("+") and not ids.match("operator-1" if u != "operator" else "viewer-1"), allow
    reply = conf["modules"]["mod_mqtt"]["access_subscribe"]["+/+/_client/%c/reply"]
    assert {e["allow"]["user"] for e in rules[reply]} == set(users)


def test_a_site_node_answers_the_centres_operator_over_the_bridge(tmp_path: Path) -> None:
    """A request relayed by a site's bridge grants its node the requester's reply topic (the centre bound it to the
    requester; the bridge's publishes carry no username at the site): a kit node at the site answers the centre's
    operator through the bridge."""
    from shared import Node
    from shared.rpc import RpcClient
    from shared.settings import KitSettings
    from tests.deploy.stack import bridged_host_brokers
    from tests.kit.motion_node import API, build

    with bridged_host_brokers(tmp_path) as (cport, central, eport, edge):
        user, password = creds(edge, "ethercat-loop")
        node = Node(API, KitSettings(mqtt_url=f"mqtt://127.0.0.1:{eport}", mqtt_username=user, node="ethercat-loop",
                                     mqtt_password=password, topic_root=A))
        build(node, devices=("rh",), sensors=())
        node.start()
        try:
            u, pw = creds(central, "operator")
            s = KitSettings(mqtt_url=f"mqtt://127.0.0.1:{cport}", mqtt_username=u, mqtt_password=pw, topic_root=A)
            with RpcClient(s, name="test-centre-op") as c:
                deadline, rep = time.monotonic() + WAIT_S, None
                while rep is None and time.monotonic() < deadline:  # until the bridge is up
                    try:
                        rep = c.call("ethercat-loop", "rh", "read", {}, timeout=2)
                    except TimeoutError:
                        pass
            assert rep is not None and rep.ok, rep
        finally:
            node.stop()
