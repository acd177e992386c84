#!/usr/bin/env python3
"""robobus fleet gate: at a fleet's centre, a command to a site that is cut off is answered at once with
`unavailable` instead of being dropped.

mosquitto's MQTT 5 bridges keep no session for a site while its link is down, so a command published at the
centre then never reaches the site and nobody answers it. This process (profile `central`, compose service
`fleet-gate`, broker user `fleet-gate`) reads each site's `{root}/_bridge/reachable` (retained, written by
`robobus fleet-watch` alone: the centre's own view) and every command to the site's nodes,
`{root}/+/+/cmd/+`; while the site is unreachable it answers each command that names a Response Topic with
    {"ok": false, "error": {"code": "unavailable",
                            "message": "site site-a (site-a/robobus) unreachable since 07:31:02 UTC: ..."}}
and the command's Correlation Data, as a node answers (DESIGN.md "MQTT contract"), so `robobus call` and the
dashboard at the centre show it (a command without a Response Topic, from an MQTT 3 client, is answered on
`<command topic>/reply`, as a node answers it). While the site is reachable it stays silent: the site's node
answers.
The seconds between a cut and fleet-watch's verdict (at most make_secrets.watch_bound_s(), 6 s) are covered by
the site's heartbeat (`{root}/_bridge/uptime`, every HEARTBEAT_PERIOD_S): a command after which no heartbeat
arrives within `in_doubt_s` (3/4 of fleet-watch's timeout: one heartbeat period and a half) went into a link that
was failing, and is answered `unavailable` too, saying that whether it reached the site is not known. A heartbeat
that arrives PROOF_S or more after the command proves the link carried it: the gate forgets it.

    ROBOBUS_FLEET_SITES='site-a=site-a/robobus ...' ROBOBUS_MQTT_URL=... python3 deploy/fleet_gate.py
Settings: those of `robobus fleet-watch` (shared/tools/fleet_watch.py FleetWatchSettings), the broker's credentials
in ROBOBUS_MQTT_USERNAME / _PASSWORD; ROBOBUS_FLEET_WATCH_READY_FILE exists while subscribed (healthcheck);
ROBOBUS_FLEET_WATCH_RESUBSCRIBE_S > 0 (a clustered centre, ejabberd): the gate subscribes to its topics again every
that many seconds, as fleet-watch does (ejabberd's per-node index of subscribed filters can lose a subscriber:
deploy/README.md "A clustered centre"); a site's state it missed then comes as the retained value.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.fleet_topics import root_filters
from shared.settings import bound_client_id, load_settings
from shared.tools.fleet_watch import REACHABLE, FleetWatchSettings, fail_over, unique_client_id

log = logging.getLogger("robobus.fleet_gate")
CMD = "+/+/cmd/+"
UPTIME = "_bridge/uptime"  # each site broker's heartbeat, bridged out (make_secrets.bridge_conf)
PROOF_S = 0.25  # a heartbeat received this long after a command was sent after it went into the link
PENDING_MAX = 10_000  # commands awaiting their proof; beyond, the oldest are answered at once (a flood)


@dataclass
class Pending:
    """A command to a reachable site, not yet followed by a heartbeat."""

    root: str
    seen: float  # the gate's monotonic clock when the command came
    seen_wall: float
    reply_to: str
    correlation: bytes | None
    topic: str


class Gate:
    """Per site root: reachable or not, and since when (the time this gate learnt it; a state retained from
    before the gate started is dated "before" its start)."""

    def __init__(self, sites: dict[str, str], now: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic, in_doubt_s: float = 3.0) -> None:
        self.sites = sites  # root -> site name
        self.now = now
        self.mono = mono
        self.in_doubt_s = in_doubt_s
        self.started = now()
        self.state: dict[str, tuple[bool, float, bool]] = {}  # root -> (reachable, since, since_is_exact)
        self.beats: dict[str, tuple[float, float]] = {}  # root -> (monotonic, wall) of its last heartbeat here
        self.pending: list[Pending] = []  # in the order they came
        self.answered = 0
        self.in_doubt = 0  # of `answered`: commands no heartbeat followed
        self.lock = threading.Lock()

    def root_of(self, topic: str) -> str | None:
        """The site root a command topic ({root}/{node}/{device}/cmd/{name}) belongs to."""
        parts = topic.split("/")
        if len(parts) < 5 or parts[-2] != "cmd":
            return None
        root = "/".join(parts[:-4])
        return root if root in self.sites else None

    def reachability(self, root: str, payload: bytes, retained: bool) -> None:
        """A retained value is dated the gate's start when it is the first the gate knows of the site, else now
        (one the gate missed, delivered again by a re-subscribe)."""
        value = payload.strip()
        if value not in (b"0", b"1"):
            log.warning("fleet-gate: %s/%s says %r (not 0 or 1): ignored", root, REACHABLE, payload[:40])
            return
        up = value == b"1"
        with self.lock:
            old = self.state.get(root)
            if old is None or old[0] != up:
                self.state[root] = (up, self.started if retained and old is None else self.now(), not retained)
                log.warning("fleet-gate: site %s %s", root, "reachable: commands pass" if up else
                            "unreachable: commands answered unavailable")

    def heartbeat(self, root: str) -> None:
        """The site's broker is heard: every command that came PROOF_S or more before went through its link."""
        mono = self.mono()
        with self.lock:
            self.beats[root] = (mono, self.now())
            self.pending = [p for p in self.pending if p.root != root or mono - p.seen < PROOF_S]

    def command(self, root: str, reply_to: str, correlation: bytes | None, topic: str) -> bytes | None:
        """A command to `root`: the refusal to send at once (the site is unreachable), or None (the site's node
        answers; the command waits here for the heartbeat that proves its link carried it)."""
        body = self.refusal(root)
        if body is not None:
            return body
        with self.lock:
            self.pending.append(Pending(root, self.mono(), self.now(), reply_to, correlation, topic))
        return None

    def due(self) -> list[tuple[Pending, bytes]]:
        """The commands no heartbeat followed within `in_doubt_s`, with their replies; forgotten here."""
        mono = self.mono()
        with self.lock:
            late = [p for p in self.pending if mono - p.seen >= self.in_doubt_s]
            if len(self.pending) - len(late) > PENDING_MAX:  # a flood: the oldest are answered now
                late = self.pending[: len(self.pending) - PENDING_MAX]
            if not late:
                return []
            gone = {id(p) for p in late}
            self.pending = [p for p in self.pending if id(p) not in gone]
            beats = dict(self.beats)
        return [(p, self._doubt(p, beats.get(p.root))) for p in late]

    def _doubt(self, p: Pending, beat: tuple[float, float] | None) -> bytes:
        if beat is None:
            heard = f"no heartbeat from its broker since this gate started ({_clock(self.started)})"
        else:
            heard = (f"no heartbeat from its broker since {_clock(beat[1])} ({max(0.0, p.seen - beat[0]):.1f} s "
                     "before this command came)")
        msg = (f"site {self.sites[p.root]} ({p.root}): {heard}, and none in the {self.in_doubt_s:g} s after it: its "
               "link to the centre is failing, and whether the command reached the site is not known (a reply may "
               f"still come when the link returns; {p.root}/{REACHABLE} turns 0 if the cut holds). Check the "
               "device's state before sending it again")
        return json.dumps({"ok": False, "error": {"code": "unavailable", "message": msg}}).encode()

    def refusal(self, root: str) -> bytes | None:
        """The reply to a command for `root`, or None while the site is reachable (or not yet judged)."""
        with self.lock:
            st = self.state.get(root)
        if st is None or st[0]:
            return None
        since = _clock(st[1])
        started = " (when this gate started)" if st[1] == self.started else ""
        when = f"since {since}" if st[2] else f"since before {since}{started}"
        msg = (f"site {self.sites[root]} ({root}) unreachable {when}: its bridge to the centre is down, the "
               "command was not delivered (commands are not queued for a cut site; send it again once "
               f"{root}/{REACHABLE} is 1)")
        return json.dumps({"ok": False, "error": {"code": "unavailable", "message": msg}}).encode()


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def reply_target(topic: str, properties: Any) -> tuple[str, bytes | None]:
    """Where a node answers a command: its Response Topic with its Correlation Data, or `<topic>/reply` for a
    request without one (an MQTT 3 client; README, commands)."""
    reply_to = getattr(properties, "ResponseTopic", None) if properties else None
    corr = getattr(properties, "CorrelationData", None) if properties else None
    return (reply_to, corr) if reply_to else (f"{topic}/reply", None)


def sites_of(settings: FleetWatchSettings) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in settings.fleet_sites.split():
        name, _, root = item.partition("=")
        out[root or name] = name
    return out


def resubscribe_every(client: Any, filters: list[tuple[str, int]], every_s: float, stop: threading.Event) -> None:
    """Until `stop`: SUBSCRIBE to `filters` again every `every_s` while connected (0: never; just wait)."""
    while not stop.wait(every_s if every_s > 0 else None):
        if client.is_connected():
            client.subscribe(filters)


def run(settings: FleetWatchSettings, stop: threading.Event) -> None:
    sites = sites_of(settings)
    if not sites:
        raise SystemExit("fleet-gate: no sites (ROBOBUS_FLEET_SITES='site-a=site-a/robobus ...')")
    gate = Gate(sites, in_doubt_s=settings.fleet_watch_timeout_s * 3 / 4)
    b = settings.broker()
    # the broker binds client ids to users; unique per start (fleet_watch.unique_client_id)
    cid = bound_client_id(b.username, unique_client_id("fleet-gate"))
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    if b.username:
        client.username_pw_set(b.username, b.password)
    if b.tls:
        client.tls_set(ca_certs=str(settings.mqtt_tls_ca) if settings.mqtt_tls_ca else None)
    client.reconnect_delay_set(1, 5)
    ready = settings.fleet_watch_ready_file

    # a few wildcards, not one per site (shared/fleet_topics.py); what belongs to no site is ignored (on_message)
    filters = ([(f, 1) for f in root_filters(sites, REACHABLE)] + [(f, 1) for f in root_filters(sites, CMD)]
               + [(f, 0) for f in root_filters(sites, UPTIME)])

    def on_connect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if rc.is_failure:
            log.error("fleet-gate: broker refused the connection: %s", rc)
            return
        c.subscribe(filters)

    def on_subscribe(c: mqtt.Client, userdata: object, mid: int, rcs: list[Any], props: object) -> None:
        refused = [str(rc) for rc in rcs if rc.is_failure]
        if refused:
            log.error("fleet-gate: subscriptions refused: %s", refused)
        elif ready:
            ready.touch()

    brokers = settings.brokers()  # a clustered centre: its nodes in turn (fleet_watch.fail_over)
    move = fail_over(client, brokers, "fleet-gate")

    def on_disconnect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if ready:
            ready.unlink(missing_ok=True)
        if not stop.is_set():
            move()

    def answer(reply_to: str, corr: bytes | None, body: bytes) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        if corr is not None:
            props.CorrelationData = corr
        props.ContentType = "application/json"
        client.publish(reply_to, body, qos=1, properties=props)
        gate.answered += 1

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if msg.topic.endswith(f"/{REACHABLE}"):
            if msg.topic[: -len(REACHABLE) - 1] in sites:
                gate.reachability(msg.topic[: -len(REACHABLE) - 1], bytes(msg.payload), bool(msg.retain))
            return
        if msg.topic.endswith(f"/{UPTIME}"):
            if msg.topic[: -len(UPTIME) - 1] in sites:
                gate.heartbeat(msg.topic[: -len(UPTIME) - 1])
            return
        root = gate.root_of(msg.topic)
        if root is None or msg.retain:
            return
        reply_to, corr = reply_target(msg.topic, msg.properties)
        body = gate.command(root, reply_to, corr, msg.topic)
        if body is not None:
            answer(reply_to, corr, body)
            log.info("fleet-gate: answered %s unavailable (site %s cut off)", msg.topic, root)

    def sweep() -> None:  # the commands no heartbeat followed
        while not stop.wait(0.1):
            for p, body in gate.due():
                answer(p.reply_to, p.correlation, body)
                gate.in_doubt += 1
                log.warning("fleet-gate: answered %s unavailable (site %s silent since it came)", p.topic, p.root)

    client.on_connect, client.on_subscribe = on_connect, on_subscribe
    client.on_disconnect, client.on_message = on_disconnect, on_message
    client.on_connect_fail = lambda c, userdata: move()
    client.connect_async(*brokers[0], keepalive=settings.mqtt_keepalive_s)
    client.loop_start()
    sweeper = threading.Thread(target=sweep, name="fleet-gate-sweep", daemon=True)
    sweeper.start()
    log.info("fleet-gate: %s", sorted(sites))
    try:
        resubscribe_every(client, filters, settings.fleet_watch_resubscribe_s, stop)
    finally:
        client.disconnect()
        client.loop_stop()
        if ready:
            ready.unlink(missing_ok=True)
        sweeper.join(5)
        log.info("fleet-gate: stopped, %d commands answered unavailable (%d of them in doubt: no heartbeat "
                 "followed them)", gate.answered, gate.in_doubt)


def main() -> None:
    logging.basicConfig(level=os.environ.get("ROBOBUS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(load_settings(FleetWatchSettings), stop)


if __name__ == "__main__":
    main()
