#!/usr/bin/env python3
"""Broker credentials and access rules for one robobus host (or a fleet's central broker).

Writes into a secrets folder (default deploy/secrets/, never committed):
    passwd          mosquitto password file: one user per service node, `operator`, `viewer`, `recorder` (PBKDF2-SHA512,
                    the `$7$` format of mosquitto_passwd), `uplink` at a bridged site; at a centre one
                    `bridge-<site>` user per site, `fleet-watch` and `fleet-gate`
    acl             mosquitto ACL file (below)
    <user>.env      ROBOBUS_MQTT_USERNAME / ROBOBUS_MQTT_PASSWORD for that user (compose `env_file`, the CLI)
    bridge.env      at an edge: the credentials its bridge uses at the centre
Passwords are kept when the files exist (re-running adds what is missing); --rotate makes new ones.

Client ids belong to users: the broker's plugin (mosquitto/robobus_auth.c) accepts user U's clients only as U or
U-... (so no user can take over another's session or reply topic), and lets a node write a client's reply topic
only after a request naming it reached that node. This script refuses user names that would share ids.
The ACL (anonymous access is off in the broker config):
  - a service node reads and writes only under {root}/{node}/#: its status, health, state, events, and the
    commands sent to it; it may answer clients under {root}/_client/+/reply (the MQTT 5 response topic: the
    plugin narrows this to the clients whose requests reached the node);
  - a node that uses another's commands gets exactly those: can-bootloader may call ethercat-loop's
    bridge_lease / bridge_release, write its stream/can_tx and read its stream/can_rx (the palm CAN bridge);
  - every client reads (and may write) the replies to its own requests, {root}/_client/<its client id>/reply;
  - `operator` (CLI, dashboards that command) reads every node's topics and sends any command;
  - the bus stop {root}/_stop (shared/stop.py): `operator` alone sets and releases it; every service node and
    `viewer` read it, none writes it; at a fleet's centre the operator writes each site's {root}/_stop and the
    site's bridge user reads it; the bridge carries it in to the site as {root}/_stop/fleet, the fleet's own
    latch, which every node and `viewer` read and no client writes (the bridge's publishes are the broker's own);
  - `viewer` (read-only dashboards) reads every node's topics and writes nothing;
  neither reads other clients' replies (observer_reads);
  - `recorder` (compose profile `record`, `robobus record`) reads everything under {root}/# (what it
    records: streams, commands and replies too) and writes nothing.
Stdlib only: runs on the host before anything is installed.
    python3 deploy/make_secrets.py [--dir deploy/secrets] [--root robobus] [--node NAME[=SERVICE]]...
    python3 deploy/make_secrets.py --central --site site-a=site-a/robobus --site site-b=site-b/robobus \
        [--tls-name central.example.lan]
    python3 deploy/make_secrets.py --root site-a/robobus --site site-a --bridge-to central.example.lan:8883 \
        --bridge-credentials bridge-site-a.env --bridge-ca fleet-ca.crt
At a centre it also makes the fleet's CA and the centre's TLS certificate (certs/, kept on re-runs; fleet-ca.crt
is the copy for the sites); an edge's bridge uses TLS with that CA unless --bridge-plain.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: shared.registry, standard library only
from shared.fleet_topics import root_filters
from shared.registry import service_names

PBKDF2_ITERATIONS = 101  # mosquitto_passwd's default for `$7$`
BROKER_UID = 1883  # the mosquitto user of deploy/docker/broker.Dockerfile


def registered_services() -> list[str]:
    """Every registered service, by its default node name (= its service name): the service registry's list
    (shared/registry.py: the `robobus.services` entry points, or this checkout's pyproject.toml where robobus
    is not installed), so a service registered once gets its broker user and ACL here too."""
    return service_names()


@dataclass(frozen=True)
class Grant:
    """Topics of another node a service may use: (access, suffix under {root}/{node}/)."""

    node: str
    rules: tuple[tuple[str, str], ...]


# can-bootloader flashes the hand's motor boards through ethercat-loop's palm CAN bridge
# (services/can_bootloader/bridge_bus.py): exactly those commands and streams.
USES: dict[str, tuple[Grant, ...]] = {
    "can-bootloader": (
        Grant("ethercat-loop", (("write", "+/cmd/bridge_lease"), ("write", "+/cmd/bridge_release"),
                                ("write", "+/stream/can_tx"), ("read", "+/stream/can_rx"))),
    ),
}


# A fleet bridge's topics under its site root (bridge_conf and the centre's ACL for its bridge user).
# `+/+/cmd/+/reply`: a request without a Response Topic (an MQTT 3 client) is answered on <request topic>/reply
# (README, commands), which must reach the centre's requester as an MQTT 5 reply does. One level deeper than
# BRIDGE_IN's `+/+/cmd/+`, so nothing a bridge carries in goes back out.
BRIDGE_OUT = ("+/status", "+/+/health", "+/+/state/+", "+/+/event/+", "_client/+/reply", "+/+/cmd/+/reply",
              "_bridge/uptime", "_bridge/state")
BRIDGE_IN = "+/+/cmd/+"
# The bus stop (shared/stop.py) comes in too: the centre's operator stops (and releases) a site through its bridge.
# The centre's {root}/_stop lands on the site's {root}/_stop/fleet, a latch of its own: the centre's retained copy,
# which comes down again whenever the bridge (re)connects, never replaces the stop the site's operator set on
# {root}/_stop (a node is stopped while either is active; a release lifts only its own channel).
BRIDGE_STOP = "_stop"
FLEET_STOP = "_stop/fleet"
# A site's states cross the bridge only through deploy/uplink.py (its budget: a capped rate per state topic, no
# camera frames): it republishes {root}/<state> as UPLINK_PREFIX{root}/<state>, which the bridge maps back to
# {root}/<state> at the centre. The centre's {root}/_uplink/set (the operator's request for another budget)
# comes in.
UPLINK_PREFIX = "_uplink/"
UPLINK_SET = "_uplink/set"


def check_client_id_prefixes(users: list[str]) -> None:
    """The broker binds client ids to users (mosquitto/robobus_auth.c): user U's clients are U or U-...; a user
    named like another's client ids (`bridge-site` and `bridge-site-a`) could take that user's ids."""
    for a in users:
        for b in users:
            if b.startswith(f"{a}-"):
                raise SystemExit(f"make_secrets: user {b!r} starts with {a + '-'!r}: the clients of {a!r} could use "
                                 f"{b!r}'s client ids (the broker binds ids U and U-... to user U); rename one")


def observer_reads(root: str, site: bool = True) -> list[str]:
    """What operator and viewer read under a root: every node's topics, but not other clients' replies
    ({root}/_client/<id>/reply: a reply is its requester's business), which `{root}/#` would include. At a site
    (`site`) also the fleet's stop latch, {root}/_stop/fleet (a centre has none: its operator writes {root}/_stop)."""
    return [f"topic read {root}/{t}" for t in ("+/status", "+/+/health", "+/+/state/#", "+/+/event/#",
                                               "+/+/stream/#", "+/+/cmd/#", "_stop", *((FLEET_STOP,) if site else ()),
                                               "_bridge/state", "_bridge/reachable", "_bridge/uptime")]


@dataclass
class Acl:
    root: str
    nodes: dict[str, str] = field(default_factory=dict)  # node -> service

    def text(self) -> str:
        r = self.root
        out = [f"# robobus ACL for topic root {r!r}, generated by deploy/make_secrets.py (edit the generator).",
               "# Every client reads the replies to its own requests (its MQTT client id), and may write there: the",
               "# kit's RpcClient confirms its reply subscription with a message to itself before its first request",
               "# (without write, the broker drops it and every client waits out the 5 s confirmation).",
               f"pattern readwrite {r}/_client/%c/reply", ""]
        for node, service in sorted(self.nodes.items()):
            # the bus stop, both latches (the site's and the fleet centre's): every node obeys them, no node sets them
            out += [f"user {node}", f"topic readwrite {r}/{node}/#", f"topic write {r}/_client/+/reply",
                    f"topic read {r}/{BRIDGE_STOP}", f"topic read {r}/{FLEET_STOP}"]
            for g in USES.get(service, ()):
                out += [f"topic {acc} {r}/{g.node}/{suffix}" for acc, suffix in g.rules]
            out.append("")
        # $SYS: broker statistics for dashboards (and the broker's own healthcheck, as viewer).
        out += ["user operator", *observer_reads(r), f"topic write {r}/+/+/cmd/+", f"topic write {r}/_stop",
                "topic read $SYS/#", "",
                "user viewer", *observer_reads(r), "topic read $SYS/#", "",
                # the bus recorder: read-only, but on everything it records (a replay needs the whole bus)
                "user recorder", f"topic read {r}/#", ""]
        return "\n".join(out)


def central_acl(sites: dict[str, str]) -> str:
    """A fleet's central broker: each site's bridge owns its site root; operator and viewer see every site."""
    out = ["# robobus central broker ACL, generated by deploy/make_secrets.py --central.",
           "pattern readwrite +/+/_client/%c/reply", "pattern readwrite +/_client/%c/reply", ""]
    for site, root in sorted(sites.items()):
        # exactly what the site's bridge carries (bridge_conf): out its nodes' status, health, state, events, the
        # replies to the centre's requests, its heartbeat and its bridge notification; in its nodes' commands.
        # Not {root}/_bridge/reachable: that is the centre's own view (fleet-watch), which no site may write.
        out += [f"user bridge-{site}", *(f"topic write {root}/{t}" for t in BRIDGE_OUT),
                f"topic read {root}/{BRIDGE_IN}", f"topic read {root}/{UPLINK_SET}",
                f"topic read {root}/{BRIDGE_STOP}", ""]
    # The centre's two watchers subscribe one wildcard per depth of the sites' roots, not a filter per site
    # (shared/fleet_topics.py: at a clustered centre they renew their subscriptions every few seconds, each filter
    # checked against every access entry); their rules are those wildcards. Under a root only its site's bridge
    # publishes, so a wildcard reads what the sites' own rules would, and a watcher ignores roots it has no site for.
    roots = sorted(sites.values())
    # the centre's watcher (robobus fleet-watch): reads each site's heartbeat, says whether it is reachable
    out += ["user fleet-watch", *(f"topic read {f}" for f in root_filters(roots, "_bridge/uptime")),
            *(f"topic write {f}" for f in root_filters(roots, "_bridge/reachable"))]
    # the centre's gate (deploy/fleet_gate.py): answers `unavailable` for a site fleet-watch says is cut off; the
    # heartbeat too: a command sent into a link that has just died is answered once no heartbeat follows it
    out += ["", "user fleet-gate",
            *(f"topic read {f}" for suffix in ("_bridge/reachable", "_bridge/uptime", BRIDGE_IN)
              for f in root_filters(roots, suffix)),
            *(f"topic write {f}" for suffix in ("_client/+/reply", f"{BRIDGE_IN}/reply")
              for f in root_filters(roots, suffix))]
    out += ["", "user operator"]
    for root in sorted(sites.values()):
        # the bus stop of each site (bridged in): the operator alone sets and releases it, as at a site
        out += [*observer_reads(root, site=False), f"topic write {root}/+/+/cmd/+", f"topic write {root}/{UPLINK_SET}",
                f"topic write {root}/{BRIDGE_STOP}"]
    out += ["topic read $SYS/#", "", "user viewer"]
    for root in sorted(sites.values()):
        out += observer_reads(root, site=False)
    out += ["topic read $SYS/#", ""]
    return "\n".join(out)


# The centre marks a site unreachable (publishes the bridge's Will "0") when nothing came from its bridge for
# more than 1.5 keepalives, in whole seconds (5 * 3 // 2 = 7, so from 8 s on). 5 s is mosquitto's floor for a
# bridge: a lower `keepalive_interval` is raised to 5 with a notice ("keepalive interval too low, using 5
# seconds", every 2.x), so the 2 s configured before was 5 s in fact. Debian 12's mosquitto (2.0.11) checks
# keepalives only every 6 s (`last_keepalive_check + 5 < now`), so a cut site is seen after 8 to 14 s
# (measured: 9-12 s); tests/deploy/test_fleet.py asserts this bound.
BRIDGE_KEEPALIVE_S = 5
BROKER_KEEPALIVE_CHECK_S = 6  # mosquitto 2.0.11's keepalive sweep period at the centre


# The equivalent within seconds: the edge broker's own $SYS/broker/uptime, bridged out as {root}/_bridge/uptime
# (QoS 0: a heartbeat is worth nothing late), is the site's heartbeat; `robobus fleet-watch` at the centre
# publishes {root}/_bridge/reachable "0" (retained) when none came for its timeout, "1" on the next one.
# `sys_interval 1`: mosquitto 2.0.11 then publishes $SYS every 2 s (measured: uptime 0, 2, 4, 6 s).
SYS_INTERVAL_S = 1
HEARTBEAT_PERIOD_S = 2
WATCH_TIMEOUT_S = 4  # two heartbeats: one late or lost heartbeat on a busy link is not a cut


def watch_bound_s(timeout_s: float = WATCH_TIMEOUT_S) -> float:
    """Longest time from a cut to {root}/_bridge/reachable "0": the last heartbeat came before the cut, so the
    watcher's timeout from then, plus one heartbeat period for a heartbeat in flight as the link was cut."""
    return timeout_s + HEARTBEAT_PERIOD_S


def unreachable_bound_s(keepalive_s: int = BRIDGE_KEEPALIVE_S) -> int:
    """Longest time from a site's last packet to its Will at the centre: past 1.5 keepalives (whole seconds),
    then at the next keepalive sweep."""
    return keepalive_s * 3 // 2 + 1 + BROKER_KEEPALIVE_CHECK_S


def bridge_conf(site: str, root: str, address: str, username: str, password: str, cafile: str | None = None) -> str:
    """The edge side of a fleet bridge (mosquitto `connection` block), MQTT 5 so that Response Topic and
    Correlation Data cross it. Out: what a centre watches (status, health, state, events, replies); in:
    commands for this site's nodes and the centre's bus stop {root}/_stop, mapped to the site's {root}/_stop/fleet
    (the fleet's own latch: the centre's retained copy, sent again on each reconnect, never replaces the stop the
    site's own operator sets and releases on {root}/_stop). Streams stay local. cleansession
    false: the centre keeps the bridge's session and this broker queues QoS 1 messages for it while the link is
    down (max_queued_messages).
    The bridge's Will at the centre says "0" on {root}/_bridge/state when the link drops; "1" when back.
    Out too: this broker's $SYS/broker/uptime as {root}/_bridge/uptime, the heartbeat `robobus fleet-watch`
    watches at the centre.
    `cafile`: the fleet's CA (the centre's secrets/fleet-ca.crt): TLS 1.2+, the centre's certificate checked against
    it and against the name in `address`; None only where plain MQTT is asked for (--bridge-plain)."""
    tls = [f"bridge_cafile {cafile}", "bridge_insecure false", "bridge_tls_version tlsv1.2"] if cafile else [
        "# PLAIN MQTT (--bridge-plain): credentials and commands cross the link unencrypted"]
    # several addresses (a clustered centre: HOST:PORT,HOST:PORT,...): the bridge starts on the first and, when
    # its node fails, moves to the next in turn and stays there (round_robin true). Not round_robin false (go back
    # to the first once it answers again): mosquitto 2.0's bridge_check then tries the first address on every
    # pass of its main loop (its once-a-second guard is never updated), each try a blocking DNS lookup and
    # connect, so while the first node is down the site's broker crawls (its clients time out, the bridge sends a
    # few messages a second); deploy/README.md, "A clustered centre"
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    return "\n".join([
        f"# Fleet bridge of site {site!r} (generated by deploy/make_secrets.py --bridge-to).",
        "# a global option: $SYS every 2 s, this broker's heartbeat at the centre (topic uptime, below)",
        f"sys_interval {SYS_INTERVAL_S}",
        "connection central",
        f"address {' '.join(addresses)}",
        *(["round_robin true"] if len(addresses) > 1 else []),
        "bridge_protocol_version mqttv50",
        f"remote_clientid {username}",
        f"remote_username {username}",
        f"remote_password {password}",
        *tls,
        # a cluster (several addresses): a clean session at the node (cleansession true), so that the node the
        # bridge fails over to does not first try to copy the session from the node that just died (ejabberd
        # waits for that node, seconds); this broker keeps the bridge's queue across the move (local_cleansession
        # false): QoS 1 messages sent meanwhile are delivered after it
        *(["cleansession false"] if len(addresses) == 1 else ["cleansession true", "local_cleansession false"]),
        f"keepalive_interval {BRIDGE_KEEPALIVE_S}",
        "restart_timeout 1 5",  # reconnect 1 s after a cut, backing off to 5 s at most
        "try_private true",
        "notifications true",
        "notifications_local_only false",
        f"notification_topic {root}/_bridge/state",
        f"topic uptime out 0 $SYS/broker/ {root}/_bridge/",
        *(f"topic {root}/{t} out 1" for t in BRIDGE_OUT if not t.startswith("_bridge/") and "/state/" not in t),
        f"topic +/+/state/+ out 0 {UPLINK_PREFIX}{root}/ {root}/",  # states: deploy/uplink.py's budget, QoS 0
        f"topic {root}/{BRIDGE_IN} in 1",
        f"topic {root}/{UPLINK_SET} in 1",
        # the centre's bus stop for this site (retained, QoS 1) onto the site's fleet latch: an empty pattern maps
        # one topic to another (mosquitto.conf(5), "topic pattern ... local-prefix remote-prefix")
        f'topic "" in 1 {root}/{FLEET_STOP} {root}/{BRIDGE_STOP}',
        "",
    ])


def ejabberd_access(acl_text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """A mosquitto ACL (central_acl) as ejabberd mod_mqtt's access maps: topic filter -> users allowed to publish,
    and -> users allowed to subscribe ("*": every user). `%c` (the client id) is mod_mqtt's `%c` too."""
    publish: dict[str, set[str]] = {}
    subscribe: dict[str, set[str]] = {}
    user = "*"
    for line in acl_text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user":
            user = words[1]
            continue
        kind, access, topic = words[0], words[1], words[2]
        who = "*" if kind == "pattern" else user
        if topic.startswith("$"):
            continue  # mod_mqtt has no $SYS
        if access in ("read", "readwrite"):
            subscribe.setdefault(topic, set()).add(who)
        if access in ("write", "readwrite"):
            publish.setdefault(topic, set()).add(who)
    return publish, subscribe


EJABBERD_PEM = "/var/lib/ejabberd/robobus.pem"  # the centre's certificate and key (ejabberd/entrypoint.sh)
CLUSTER_NODES = ("ejabberd1", "ejabberd2", "ejabberd3")  # compose.cluster.yaml: in the certificate's names
EJABBERD_MAX_QUEUE = 100_000  # as mosquitto's max_queued_messages in the shipped configs
EJABBERD_HOST = "robobus"  # the cluster's one ejabberd host (users are user@robobus): its certificate names it


def bound_client_ids(user: str) -> str:
    """The client ids of `user` (U or U-<anything>, as mosquitto/robobus_auth.c binds them) as a PCRE, for ejabberd's
    resource_regexp (the MQTT client id is the session's resource)."""
    literal = "".join(f"[{c}]" if c in ".-" else c for c in user)  # user names: letters, digits, - _ .
    return f"^{literal}(-.*)?$"


def ejabberd_conf(acl_text: str, users: list[str]) -> str:
    """The clustered centre's ejabberd.yml (deploy/compose.cluster.yaml): mod_mqtt only, ejabberd's own users, and
    the centre's ACL as mod_mqtt's access_publish / access_subscribe. mod_mqtt checks a subscription's filter, not
    each message: a filter is allowed when an access filter of the same shape matches it (`+` in the access filter
    matches any level or wildcard, `#` the rest), so `{root}/#` is refused where only narrower rules exist."""
    publish, subscribe = ejabberd_access(acl_text)
    rules: dict[frozenset[str], str] = {}

    def rule(who: set[str]) -> str:
        key = frozenset(who)
        if key not in rules:
            rules[key] = f"robobus_{len(rules) + 1}"
        return rules[key]

    pub = {t: rule(w) for t, w in sorted(publish.items())}
    sub = {t: rule(w) for t, w in sorted(subscribe.items())}
    out = ["# robobus clustered centre (ejabberd mod_mqtt), generated by deploy/make_secrets.py --cluster.",
           "hosts:", f"  - {EJABBERD_HOST}", "loglevel: warning", "acme:", "  auto: false",
           # 1883: the nodes' published ports (127.0.0.1 by default) and clients on the cluster's own network;
           # 8883 (TLS, the fleet's CA): the sites' bridges
           "listen:", "  -", "    port: 1883", '    ip: "::"', "    module: mod_mqtt", "    backlog: 1000",
           "  -", "    port: 8883", '    ip: "::"', "    module: mod_mqtt", "    backlog: 1000", "    tls: true",
           f"certfiles: [{EJABBERD_PEM}]",
           "auth_method: [internal]"]
    # Client ids bound to users, as mosquitto's plugin does at CONNECT (mosquitto/robobus_auth.c): mod_mqtt checks
    # each rule against the client's user AND its client id (the session's JID is user@host/<client id>), so every
    # allow names a user together with the ids it may use, U or U-... A client with another id connects but may
    # publish and subscribe nothing (mod_mqtt denies what no rule allows): `%c` is only ever its own user's id, so
    # neither an operator's id nor a `+` id opens another client's replies.
    out += ["access_rules:"]
    for who, name in sorted(rules.items(), key=lambda kv: kv[1]):
        out += [f"  {name}:", *(f"    - allow: {{user: \"{u}\", resource_regexp: '{bound_client_ids(u)}'}}"
                                for u in sorted(users if "*" in who else who))]
    out += ["api_permissions:", '  "console commands":', "    from: [ejabberd_ctl]", "    who: all", '    what: "*"',
            # mod_admin_extra: ejabberdctl's change_password, with which a restarted first node
            # (ejabberd/entrypoint.sh) sets its users' passwords again
            "modules:", "  mod_admin_extra: {}",
            # max_queue: a session's queue of outgoing messages (one is in flight at a time); past it ejabberd
            # clears the queue and disconnects the client (quota-exceeded): a bridge reconnects and its subscription
            # brings the retained stop again (deploy/README.md, "Broker limits")
            "  mod_mqtt:", f"    max_queue: {EJABBERD_MAX_QUEUE}", "    session_expiry: 0", "    max_topic_depth: 12",
            "    access_publish:", *(f'      "{t}": {r}' for t, r in pub.items()),
            "    access_subscribe:", *(f'      "{t}": {r}' for t, r in sub.items()), ""]
    return "\n".join(out)


FLEET_CA = "fleet-ca.crt"  # the centre's CA, copied next to the secrets: what a site needs with bridge-<site>.env
BRIDGE_CA_IN_BROKER = "/mosquitto/fleet/ca.crt"  # where compose.edge.yaml mounts a site's copy
TLS_DAYS = 3650


def _openssl(folder: Path, *args: str) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=120)
    except FileNotFoundError:
        raise SystemExit("make_secrets: openssl is needed for the centre's TLS certificates (apt-get install openssl)"
                         ) from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"make_secrets: openssl {' '.join(args[:2])} failed: {e.stderr.decode(errors='replace')}"
                         ) from e


def central_certs(folder: Path, names: list[str], rotate: str = "") -> list[str]:
    """The fleet's CA and the centre's server certificate in folder/certs (ca.crt, ca.key, server.crt, server.key:
    what compose.tls.yaml and mosquitto/tls.conf use), and folder/fleet-ca.crt, the copy for the sites. Kept on
    re-runs; the server certificate is made again when `names` (its subjectAltNames: the names and addresses the
    sites connect to) change, with the same CA. Returns the names in the certificate.

    The CA is replaced in two steps, so that no site's bridge ever meets a certificate it does not trust (a
    refused TLS bridge can leave mosquitto 2.0.11 serving nobody: deploy/README.md, "A site's broker that stops
    serving"). `rotate="begin"`: a new CA and a server certificate from it wait in certs/next/; the centre keeps
    serving the old one; fleet-ca.crt holds both CAs, which every site gets. `rotate="finish"`, once every site
    has that file: the waiting CA and certificate take the old ones' place (restart the centre's broker), and
    fleet-ca.crt holds the new CA alone (the sites' two-CA copies still trust it)."""
    certs = folder / "certs"
    certs.mkdir(exist_ok=True)
    os.chmod(certs, 0o755)
    nxt = certs / "next"
    names = sorted(set(names))
    if rotate == "finish":
        if not (nxt / "ca.crt").exists():
            raise SystemExit("make_secrets: --rotate-ca-finish: no rotation begun (make_secrets --rotate-ca first)")
        for f in ("ca.crt", "ca.key", "server.crt", "server.key", "server.names"):
            shutil.move(str(nxt / f), str(certs / f))
        shutil.rmtree(nxt)
    if not (certs / "ca.crt").exists() or not (certs / "ca.key").exists():
        _new_ca(certs)
    done = (certs / "server.names").read_text().split() if (certs / "server.names").exists() else None
    if done != names or not (certs / "server.crt").exists():
        _server_cert(certs, certs, names)
    if rotate == "begin":
        nxt.mkdir(exist_ok=True)
        os.chmod(nxt, 0o755)
        _new_ca(nxt)
        _server_cert(nxt, nxt, names)
    for d in (certs, nxt):
        for f in ("ca.crt", "server.crt"):
            if (d / f).exists():
                os.chmod(d / f, 0o644)
    bundle = (certs / "ca.crt").read_bytes() + ((nxt / "ca.crt").read_bytes() if (nxt / "ca.crt").exists() else b"")
    (folder / FLEET_CA).write_bytes(bundle)
    os.chmod(folder / FLEET_CA, 0o644)
    return names


def _new_ca(d: Path) -> None:
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(TLS_DAYS),
             "-subj", "/CN=robobus fleet CA", "-keyout", "ca.key", "-out", "ca.crt")
    os.chmod(d / "ca.key", 0o600)
    (d / "server.names").unlink(missing_ok=True)


def _server_cert(ca_dir: Path, d: Path, names: list[str]) -> None:
    """d/server.crt and server.key for `names`, signed by ca_dir's CA."""
    san = ",".join(f"IP:{n}" if _is_ip(n) else f"DNS:{n}" for n in names)
    (d / "san.ext").write_text(f"subjectAltName={san}\n")
    _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={names[0]}", "-keyout", "server.key",
             "-out", "server.csr")
    _openssl(d, "x509", "-req", "-in", "server.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
             "-CAcreateserial", "-days", str(TLS_DAYS), "-extfile", "san.ext", "-out", "server.crt")
    key = d / "server.key"
    write_private(key, key.read_text(), owner=BROKER_UID)  # the broker (uid 1883) reads it
    (d / "server.names").write_text(" ".join(names) + "\n")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def hash_password(password: str, salt: bytes | None = None) -> str:
    """mosquitto's `$7$` entry: PBKDF2-HMAC-SHA512, 101 iterations, 12-byte salt, both base64."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    return f"$7${PBKDF2_ITERATIONS}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def write_private(path: Path, text: str, owner: int | None = None) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600 if owner is None else 0o640)
    if owner is not None and os.geteuid() == 0:
        os.chown(tmp, owner, owner)
    elif owner is not None:  # not root: the broker container (another uid) must still read it
        os.chmod(tmp, 0o644)
    tmp.replace(path)


def user_password(folder: Path, user: str, rotate: bool) -> str:
    env = folder / f"{user}.env"
    old = read_env(env).get("ROBOBUS_MQTT_PASSWORD")
    if old and not rotate:
        return old
    pw = secrets.token_urlsafe(24)
    write_private(env, f"# MQTT credentials of {user!r} (deploy/make_secrets.py)\n"
                       f"ROBOBUS_MQTT_USERNAME={user}\nROBOBUS_MQTT_PASSWORD={pw}\n")
    return pw


def parse_pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise SystemExit(f"make_secrets: bad {what} {item!r}")
        out[name] = value or name
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "secrets")
    ap.add_argument("--root", default=os.environ.get("ROBOBUS_TOPIC_ROOT", "robobus"), help="topic root of this host")
    ap.add_argument("--node", action="append", default=[],
                    help="NAME[=SERVICE]: a node (default: every registered service)")
    ap.add_argument("--central", action="store_true", help="a fleet's central broker (with --site)")
    ap.add_argument("--cluster", action="store_true",
                    help="with --central: the clustered centre's ejabberd.yml, users and Erlang cookie "
                         "(deploy/compose.cluster.yaml)")
    ap.add_argument("--site", action="append", default=[], help="SITE=ROOT, e.g. site-a=site-a/robobus")
    ap.add_argument("--bridge-to", metavar="HOST:PORT", help="edge: bridge this host's broker to the centre")
    ap.add_argument("--bridge-credentials", type=Path, help="edge: the centre's bridge-<site>.env for this site")
    ap.add_argument("--bridge-ca", type=Path,
                    help="edge: the fleet's CA (the centre's fleet-ca.crt): the bridge uses TLS")
    ap.add_argument("--bridge-plain", action="store_true",
                    help="edge: bridge without TLS (credentials and commands in clear: a trusted link only)")
    ap.add_argument("--tls-name", action="append", default=[],
                    help="centre: a name or address sites connect to (its certificate's subjectAltName); "
                         "localhost, 127.0.0.1 and this host's names are always in")
    ap.add_argument("--rotate", action="store_true", help="new passwords for every user")
    ap.add_argument("--rotate-ca", action="store_true",
                    help="centre: begin replacing the fleet's CA (the centre keeps its certificate; fleet-ca.crt "
                         "holds the old and the new CA: give it to every site)")
    ap.add_argument("--rotate-ca-finish", action="store_true",
                    help="centre: once every site has the two-CA fleet-ca.crt, switch the centre to the new CA's "
                         "certificate (restart its broker)")
    args = ap.parse_args(argv)
    folder: Path = args.dir
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)  # the broker container reads passwd/acl by name; the .env files stay 0600
    if args.central:
        sites = parse_pairs(args.site, "--site")
        if not sites:
            raise SystemExit("make_secrets: --central needs at least one --site SITE=ROOT")
        users = [f"bridge-{s}" for s in sites] + ["fleet-watch", "fleet-gate", "operator", "viewer"]
        acl = central_acl(sites)
        names = central_certs(folder, [*args.tls_name, "localhost", "127.0.0.1", socket.gethostname(),
                                       socket.getfqdn(), *((*CLUSTER_NODES, EJABBERD_HOST) if args.cluster else ())],
                             "finish" if args.rotate_ca_finish else "begin" if args.rotate_ca else "")
        print(f"make_secrets: TLS for the sites' bridges: {folder}/certs/server.crt for {', '.join(names)}; "
              f"give each site {folder}/{FLEET_CA} with its bridge-<site>.env")
        if args.rotate_ca:
            print(f"make_secrets: a new CA waits in {folder}/certs/next/; {folder}/{FLEET_CA} now holds both CAs: "
                  "give it to every site (restart their bridges), then run make_secrets --central --rotate-ca-finish "
                  "and restart the centre's broker")
        if args.rotate_ca_finish:
            print("make_secrets: the centre's certificate is now the new CA's: restart the centre's broker")
    else:
        if args.bridge_to:
            site = next(iter(parse_pairs(args.site, "--site")), "") if args.site else ""
            creds = read_env(args.bridge_credentials) if args.bridge_credentials else {}
            if not site or "ROBOBUS_MQTT_PASSWORD" not in creds:
                raise SystemExit("make_secrets: --bridge-to needs --site NAME and --bridge-credentials FILE "
                                 "(the centre's bridge-NAME.env)")
            if args.bridge_ca is None and not args.bridge_plain:
                raise SystemExit("make_secrets: the bridge uses TLS: --bridge-ca FILE (the centre's fleet-ca.crt, "
                                 "ROBOBUS_BRIDGE_CA), or --bridge-plain (ROBOBUS_BRIDGE_TLS=off) on a trusted link")
            cafile = None
            if args.bridge_ca is not None:
                if not args.bridge_ca.is_file():
                    raise SystemExit(f"make_secrets: --bridge-ca {args.bridge_ca}: no such file")
                shutil.copyfile(args.bridge_ca, folder / FLEET_CA)
                os.chmod(folder / FLEET_CA, 0o644)
                cafile = BRIDGE_CA_IN_BROKER
            else:
                print("make_secrets: WARNING: the bridge is plain MQTT (--bridge-plain): its password and the "
                      "commands cross the link unencrypted", file=sys.stderr)
            write_private(folder / "bridge.conf", bridge_conf(site, args.root, args.bridge_to,
                                                              creds["ROBOBUS_MQTT_USERNAME"],
                                                              creds["ROBOBUS_MQTT_PASSWORD"], cafile),
                          owner=BROKER_UID)
        nodes = parse_pairs(args.node, "--node") or {s: s for s in registered_services()}
        users = [*nodes, "operator", "viewer", "recorder"]
        acl = Acl(args.root, nodes).text()
        if args.bridge_to:  # the site's uplink (deploy/uplink.py): reads states, writes their bridged copies
            users.append("uplink")
            acl += "\n".join(["", "user uplink", f"topic read {args.root}/+/+/state/+",
                              f"topic write {UPLINK_PREFIX}{args.root}/+/+/state/+",
                              f"topic read {args.root}/{UPLINK_SET}", ""])
    check_client_id_prefixes(users)
    if args.central and args.cluster:  # ejabberd keeps its own users: their passwords in clear, root only
        (folder / "ejabberd.yml").write_text(ejabberd_conf(acl, users))  # no secret in it: ejabberd's user reads it
        os.chmod(folder / "ejabberd.yml", 0o644)
        write_private(folder / "ejabberd-users",
                      "".join(f"{u} {user_password(folder, u, args.rotate)}\n" for u in users), owner=0)
        cookie = read_env(folder / "ejabberd-cookie.env").get("ROBOBUS_EJABBERD_COOKIE")
        if not cookie or args.rotate:
            write_private(folder / "ejabberd-cookie.env",
                          f"ROBOBUS_EJABBERD_COOKIE={secrets.token_hex(20)}\n")
    lines = [f"{u}:{hash_password(user_password(folder, u, args.rotate))}" for u in users]
    write_private(folder / "passwd", "\n".join(lines) + "\n", owner=BROKER_UID)
    write_private(folder / "acl", acl, owner=BROKER_UID)
    print(f"make_secrets: {len(users)} users in {folder}/passwd, ACL in {folder}/acl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
