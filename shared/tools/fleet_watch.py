"""`robobus fleet-watch`: a fleet's centre sees a cut site within seconds.

The bridge's own Will ({root}/_bridge/state "0") stays the authoritative "bridge down", but mosquitto 2.0.11
publishes it only 8-14 s after a site's last packet (a bridge keepalive has a 5 s floor, keepalives are swept
every 6 s; deploy/README.md "A fleet"). So each site's broker bridges its own `$SYS/broker/uptime` out as
{root}/_bridge/uptime (`sys_interval 1`: 2.0.11 publishes it every 2 s), and this watcher, at the centre,
publishes {root}/_bridge/reachable -- retained, "1" / "0" like the bridge's notification -- "0" when no
heartbeat came for `fleet_watch_timeout_s`, "1" again on the next one.

On a broker whose subscription index can lose a subscriber (ejabberd's mod_mqtt at a clustered centre: the
watcher's subscription still listed, its entry in the node's index of filters gone, so nothing is delivered to it;
deploy/README.md "A clustered centre"), `fleet_watch_resubscribe_s` > 0 makes the watcher SUBSCRIBE again (which
puts the filters back into the node's index) every that many seconds, and, before it says a site is unreachable:
a site quiet past the timeout is declared "0" only if no heartbeat came in the heartbeat period after the SUBACK
of a SUBSCRIBE sent once it went quiet. 0 (the default, mosquitto): neither.
    ROBOBUS_FLEET_SITES="site-a=site-a/robobus site-b=site-b/robobus" robobus fleet-watch
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import paho.mqtt.client as mqtt
import typer
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import Field, field_validator

from shared.fleet_topics import root_filters
from shared.logs import setup_logging
from shared.mqtt.failover import fail_over as fail_over  # fleet_gate and the tests import it from here
from shared.rpc import FailoverSettings
from shared.settings import load_settings

log = logging.getLogger("robobus.fleet_watch")

HEARTBEAT = "_bridge/uptime"
REACHABLE = "_bridge/reachable"
HEARTBEAT_PERIOD_S = 2.0  # mosquitto 2.0.11 with `sys_interval 1` updates $SYS every 2 s (measured)


class FleetWatchSettings(FailoverSettings):
    """ROBOBUS_FLEET_BROKERS: shared/rpc.py's FailoverSettings (the nodes in turn)."""

    fleet_sites: str = Field("", description="Sites watched: 'SITE=ROOT ...' (as ROBOBUS_CENTRAL_SITES) or 'ROOT ...'")
    fleet_watch_timeout_s: float = Field(4.0, ge=2.5, le=600,
                                         description="No heartbeat for this long: the site is unreachable")
    fleet_watch_ready_file: Path | None = Field(None, description="Exists while connected and subscribed "
                                                                 "(the container's healthcheck)")
    fleet_watch_resubscribe_s: float = Field(
        0.0, ge=0, le=3600,
        description="A broker that can lose a subscriber from its index (ejabberd): subscribe again every this many "
                    "seconds, and before saying a site is unreachable (then only if no heartbeat came within one "
                    "heartbeat period after that SUBSCRIBE's SUBACK); 0: never (mosquitto)")
    @field_validator("fleet_sites")
    @classmethod
    def _sites(cls, v: str) -> str:
        for item in v.split():
            root = item.partition("=")[2] or item
            if not root or any(c in root for c in "+#") or root.startswith("/") or root.endswith("/"):
                raise ValueError(f"bad site {item!r}: SITE=ROOT or ROOT, a topic root without wildcards")
        return v

    def roots(self) -> list[str]:
        return sorted({item.partition("=")[2] or item for item in self.fleet_sites.split()})


class Watcher:
    """Per site root: the last heartbeat's time and the state last published (None: nothing yet).

    With `subscribe` (sends the heartbeat SUBSCRIBE again, returns its message id) and `resubscribe_s` > 0: a
    SUBSCRIBE again every `resubscribe_s`, and a site quiet past the timeout is said unreachable only once a
    SUBSCRIBE sent after it went quiet was acknowledged (`suback`) and one heartbeat period more passed without
    its heartbeat (a SUBSCRIBE not acknowledged holds the verdict back `suback_wait_s` at most)."""

    def __init__(self, roots: list[str], timeout_s: float, publish: Any, now: Any = time.monotonic,
                 subscribe: Callable[[], int | None] | None = None, resubscribe_s: float = 0.0,
                 period_s: float = HEARTBEAT_PERIOD_S, suback_wait_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._publish = publish  # (topic, payload) -> None, retained, QoS 1
        self._now = now
        self._subscribe = subscribe if resubscribe_s > 0 else None
        self.resubscribe_s = resubscribe_s
        self.period_s = period_s
        # no SUBACK: the watcher's own link may be dead and not yet known so (a "0" then would be stale and sent
        # after the reconnect), so the verdict waits this long (the run: two keepalives, when paho drops a dead link)
        self.suback_wait_s = timeout_s if suback_wait_s is None else suback_wait_s
        self._lock = threading.Lock()
        self.last: dict[str, float] = {r: now() for r in roots}  # a site never heard of gets one timeout
        self.state: dict[str, str | None] = {r: None for r in roots}
        self.counts = {"heartbeats": 0, "unexpected": 0, "unreachable": 0, "reachable": 0, "resubscribed": 0}
        self._asked: float | None = None  # when the last SUBSCRIBE went out
        self._asked_mid: int | None = None
        self._acked: dict[int, float] = {}  # SUBACKs by message id (one may come before subscribe() returns)

    def restart(self) -> None:
        """After the watcher's own reconnect: it was deaf, not the sites; give each one timeout again, and publish
        each state again (the next heartbeat's "1", or "0" a timeout later): on a clustered centre the reconnect
        may be to another node, and ejabberd gives a retained message only to subscribers of the node it was
        published through (deploy/README.md, "A clustered centre")."""
        with self._lock:
            t = self._now()
            for r in self.last:
                self.last[r] = t
                self.state[r] = None
            self._asked, self._asked_mid, self._acked = None, None, {}

    def subscribed(self, mid: int | None) -> None:
        """A heartbeat SUBSCRIBE went out (the one at connect too)."""
        with self._lock:
            self._asked, self._asked_mid = self._now(), mid
            self._acked = {m: t for m, t in self._acked.items() if m == mid}

    def suback(self, mid: int) -> None:
        with self._lock:
            self._acked[mid] = self._now()

    def _resubscribe(self) -> None:
        assert self._subscribe is not None
        self.counts["resubscribed"] += 1
        log.info("fleet-watch: subscribing to the heartbeats again")
        self.subscribed(self._subscribe())

    def heartbeat(self, topic: str) -> None:
        root = topic[: -len(HEARTBEAT) - 1] if topic.endswith("/" + HEARTBEAT) else ""
        with self._lock:
            if root not in self.last:
                self.counts["unexpected"] += 1
                return
            self.counts["heartbeats"] += 1
            self.last[root] = self._now()
        self._set(root, "1")

    def tick(self) -> None:
        with self._lock:
            t = self._now()
            late = [r for r, seen in self.last.items() if t - seen > self.timeout_s]
            if self._subscribe is not None:
                # reference: deploy/README.md "A clustered centre" (ejabberd's per-node index of subscribed filters)
                quiet = {r: self.last[r] + self.timeout_s for r in late if self.state[r] != "0"}  # root -> since
                asked = self._asked
                acked = self._acked.get(self._asked_mid) if self._asked_mid is not None else None
        if self._subscribe is None:
            for r in late:
                self._set(r, "0")
            return
        if any(asked is None or asked < since for since in quiet.values()):
            self._resubscribe()  # a site went quiet since the last SUBSCRIBE: first put it back into the index
            return
        if not quiet:
            if asked is None or t - asked >= self.resubscribe_s:
                self._resubscribe()  # every resubscribe_s (not while a verdict waits on the last one)
            return
        assert asked is not None
        if (acked is not None and t - acked > self.period_s) or (acked is None and t - asked > self.suback_wait_s):
            for r in quiet:
                self._set(r, "0")

    def _set(self, root: str, value: str) -> None:
        with self._lock:
            if self.state[root] == value:
                return
            self.state[root] = value
            self.counts["reachable" if value == "1" else "unreachable"] += 1
        log.warning("site %s %s", root, "reachable" if value == "1" else "unreachable")
        self._publish(f"{root}/{REACHABLE}", value)


def unique_client_id(name: str) -> str:
    """`<name>-<pid>-<random>`: a client id no earlier start of this program used."""
    return f"{name}-{os.getpid()}-{secrets.token_hex(4)}"


def run(settings: FleetWatchSettings, stop: threading.Event) -> None:
    roots = settings.roots()
    if not roots:
        raise SystemExit("fleet-watch: no sites (ROBOBUS_FLEET_SITES='site-a=site-a/robobus ...')")
    b = settings.broker()
    # unique per start: in a container the pid is the same on each start, and ejabberd's mod_mqtt, when a session
    # with the same client id is replaced, drops the subscription of the new one from its index (deaf from then)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=unique_client_id("fleet-watch"),
                         protocol=mqtt.MQTTv5)
    if b.username:
        client.username_pw_set(b.username, b.password)
    if b.tls:
        client.tls_set(ca_certs=str(settings.mqtt_tls_ca) if settings.mqtt_tls_ca else None,
                       certfile=str(settings.mqtt_tls_cert) if settings.mqtt_tls_cert else None,
                       keyfile=str(settings.mqtt_tls_key) if settings.mqtt_tls_key else None)
        client.tls_insecure_set(settings.mqtt_tls_insecure)
    client.reconnect_delay_set(1, 5)
    ready = settings.fleet_watch_ready_file
    filters = [(f, 0) for f in root_filters(roots, HEARTBEAT)]  # a few wildcards, not one per site (fleet_topics)
    watcher = Watcher(roots, settings.fleet_watch_timeout_s,
                      lambda topic, value: client.publish(topic, value, qos=1, retain=True),
                      subscribe=lambda: client.subscribe(filters)[1],
                      resubscribe_s=settings.fleet_watch_resubscribe_s,
                      suback_wait_s=2.0 * settings.mqtt_keepalive_s)

    def on_connect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if rc.is_failure:
            log.error("fleet-watch: broker refused the connection: %s", rc)
            return
        watcher.restart()
        watcher.subscribed(c.subscribe(filters)[1])

    def on_subscribe(c: mqtt.Client, userdata: object, mid: int, rcs: list[Any], props: object) -> None:
        refused = [str(rc) for rc in rcs if rc.is_failure]
        watcher.suback(mid)
        if refused:
            log.error("fleet-watch: heartbeat subscriptions refused: %s", refused)
        elif ready:
            ready.touch()

    brokers = settings.brokers()
    move = fail_over(client, brokers, "fleet-watch")

    def on_disconnect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if ready:
            ready.unlink(missing_ok=True)
        if not stop.is_set():
            move()

    def on_connect_fail(c: mqtt.Client, userdata: object) -> None:
        log.warning("fleet-watch: no broker at %s:%s, retrying", c.host, c.port)
        move()

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if msg.retain:  # the broker's copy from before we subscribed: says nothing about now
            return
        watcher.heartbeat(msg.topic)

    client.on_connect, client.on_subscribe = on_connect, on_subscribe
    client.on_disconnect, client.on_message = on_disconnect, on_message
    client.on_connect_fail = on_connect_fail
    client.connect_async(*brokers[0], keepalive=settings.mqtt_keepalive_s)
    client.loop_start()
    log.info("fleet-watch: %s, unreachable after %.1f s without a heartbeat%s", roots, settings.fleet_watch_timeout_s,
             f" (subscribing again every {settings.fleet_watch_resubscribe_s:g} s and before that verdict)"
             if settings.fleet_watch_resubscribe_s else "")
    try:
        while not stop.wait(0.1):
            if client.is_connected():
                watcher.tick()
    finally:
        client.disconnect()
        client.loop_stop()
        if ready:
            ready.unlink(missing_ok=True)
        log.info("fleet-watch: stopped %s", watcher.counts)


def fleet_watch(
    sites: Annotated[str | None, typer.Option("--sites", help="'SITE=ROOT ...' (default ROBOBUS_FLEET_SITES)")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds without a heartbeat")] = None,
    broker: Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (default ROBOBUS_MQTT_URL)")] = None,
) -> None:
    """Mark fleet sites unreachable at the centre within seconds ({root}/_bridge/reachable, retained)."""
    import signal

    overrides: dict[str, Any] = {}
    if sites is not None:
        overrides["fleet_sites"] = sites
    if timeout is not None:
        overrides["fleet_watch_timeout_s"] = timeout
    if broker is not None:
        overrides["mqtt_url"] = broker
    settings = load_settings(FleetWatchSettings, **overrides)
    setup_logging(settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(settings, stop)


if __name__ == "__main__":
    typer.run(fleet_watch)
