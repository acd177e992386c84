#!/usr/bin/env python3
"""robobus uplink: what a fleet site sends its centre of the states, within a budget.

A site's bridge carries status, health, events and replies as they come (QoS 1) and its nodes' states only
through this process (compose service `uplink`, added with the bridge by compose.edge.yaml; broker user
`uplink`). It reads `{root}/+/+/state/+` on the site's broker and republishes each state topic under
`_uplink/{root}/...`, which the bridge maps back to `{root}/...` at the centre (make_secrets.bridge_conf), at
QoS 0 (the newest value wins) and:
  - at most ROBOBUS_UPLINK_STATE_HZ messages per second per state topic (default 2; 0: no cap) and at most
    ROBOBUS_UPLINK_STATE_BYTES_S bytes per second per state topic (default 4096; 0: no cap: a 12 kB state goes
    once every 3 s), always ending on the newest value (a held-back message goes when the topic's next slot
    opens: nothing stays stale);
  - never the state names in ROBOBUS_UPLINK_DROP (default "image": the e-puck camera's JPEG frames);
    streams are not bridged at all.
Full rate on demand: an operator at the centre publishes `{root}/_uplink/set` (bridged in), e.g.
    {"state_hz": 0, "drop": [], "for_s": 60}
(every field optional: state_hz 0 = no cap, state_bytes_s likewise (missing: no cap when state_hz is 0, else the
default), drop = state names not forwarded, for_s = how long, default 300, at most 3600); then the defaults.
An unreadable request is logged and counted, nothing else changes.
The retain flag and MQTT 5 properties (Content Type) of each state are kept.

    ROBOBUS_TOPIC_ROOT=site-a/robobus ROBOBUS_MQTT_URL=... python3 deploy/uplink.py
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import Field

from shared.settings import KitSettings, bound_client_id, load_settings

log = logging.getLogger("robobus.uplink")
PREFIX = "_uplink/"  # local topics the bridge maps to the centre's {root}/...
SET = "_uplink/set"  # under {root}: the centre's request for another budget
MAX_FOR_S = 3600.0


class UplinkSettings(KitSettings):
    uplink_state_hz: float = Field(2.0, ge=0, le=1000, description="States per second per topic (0: no cap)")
    uplink_state_bytes_s: float = Field(4096.0, ge=0, description="State bytes per second per topic (0: no cap)")
    uplink_drop: str = Field("image", description="State names never forwarded (space-separated)")
    uplink_ready_file: Path | None = Field(None, description="Exists while subscribed (the healthcheck)")


class Budget:
    """Per state topic: when it was last forwarded and the newest message held back since."""

    def __init__(self, state_hz: float, drop: set[str], send: Any, now: Any = time.monotonic,
                 bytes_s: float = 0.0) -> None:
        self.default_hz, self.default_drop, self.default_bytes_s = state_hz, set(drop), bytes_s
        self.hz, self.drop, self.bytes_s = state_hz, set(drop), bytes_s
        self.until = 0.0  # a requested budget applies until then
        self.send = send  # (topic, payload, retain, properties) -> None
        self.now = now
        self.next: dict[str, float] = {}  # topic -> when its next message may go
        self.held: dict[str, tuple[bytes, bool, Any]] = {}
        self.counts = {"forwarded": 0, "held_back": 0, "dropped": 0, "bad_requests": 0}
        self.lock = threading.Lock()

    def state(self, topic: str, payload: bytes, retain: bool, props: Any) -> None:
        name = topic.rsplit("/", 1)[-1]
        with self.lock:
            if name in self.drop:
                self.counts["dropped"] += 1
                return
            t = self.now()
            if t >= self.next.get(topic, -1e9):
                self.next[topic] = t + self._gap(len(payload))
                self.held.pop(topic, None)
                self.counts["forwarded"] += 1
            else:  # the newest value waits for the topic's next slot (an older one held is replaced)
                self.held[topic] = (payload, retain, props)
                self.counts["held_back"] += 1
                return
        self.send(topic, payload, retain, props)

    def _gap(self, size: int) -> float:
        """How long a topic waits after a message of `size` bytes: its rate cap, or its byte budget if longer."""
        return max(1.0 / self.hz if self.hz > 0 else 0.0, size / self.bytes_s if self.bytes_s > 0 else 0.0)

    def tick(self) -> None:
        """Send what is due; back to the defaults when a requested budget ends."""
        due: list[tuple[str, tuple[bytes, bool, Any]]] = []
        with self.lock:
            t = self.now()
            if self.until and t >= self.until:
                self.hz, self.drop, self.until = self.default_hz, set(self.default_drop), 0.0
                self.bytes_s = self.default_bytes_s
                self.next.clear()
                log.info("uplink: back to the default budget (%s Hz per state, not %s)", self.hz, sorted(self.drop))
            for topic, held in list(self.held.items()):
                if t >= self.next.get(topic, -1e9):
                    self.next[topic] = t + self._gap(len(held[0]))
                    del self.held[topic]
                    self.counts["forwarded"] += 1
                    due.append((topic, held))
        for topic, (payload, retain, props) in due:
            self.send(topic, payload, retain, props)

    def request(self, payload: bytes) -> str:
        """The centre's {root}/_uplink/set; returns what now applies (or why nothing changed)."""
        try:
            req = json.loads(payload)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
            hz = float(req.get("state_hz", self.default_hz))
            bytes_s = float(req.get("state_bytes_s", 0.0 if hz == 0 else self.default_bytes_s))
            drop = req.get("drop", sorted(self.default_drop))
            for_s = float(req.get("for_s", 300.0))
            if not (0 <= hz <= 1000) or not (0 < for_s <= MAX_FOR_S) or bytes_s < 0:
                raise ValueError("state_hz 0..1000, state_bytes_s >= 0, for_s 0..3600")
            if not isinstance(drop, list) or not all(isinstance(d, str) for d in drop):
                raise ValueError("drop: a list of state names")
        except (ValueError, TypeError) as e:
            with self.lock:
                self.counts["bad_requests"] += 1
            log.warning("uplink: unreadable request %r: %s", payload[:200], e)
            return f"refused: {e}"
        with self.lock:
            self.hz, self.drop, self.until, self.bytes_s = hz, set(drop), self.now() + for_s, bytes_s
            self.next.clear()
        log.warning("uplink: %s Hz and %s B/s per state (0: no cap), not %s, for %.0f s", hz, bytes_s, sorted(drop),
                    for_s)
        return "ok"


def run(settings: UplinkSettings, stop: threading.Event) -> None:
    root = settings.topic_root
    b = settings.broker()
    cid = bound_client_id(b.username, f"uplink-{os.getpid()}")  # the broker binds client ids to users
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    if b.username:
        client.username_pw_set(b.username, b.password)
    if b.tls:
        client.tls_set(ca_certs=str(settings.mqtt_tls_ca) if settings.mqtt_tls_ca else None)
    client.reconnect_delay_set(1, 5)
    ready = settings.uplink_ready_file

    def send(topic: str, payload: bytes, retain: bool, props: Any) -> None:
        client.publish(PREFIX + topic, payload, qos=0, retain=retain, properties=props)

    budget = Budget(settings.uplink_state_hz, set(settings.uplink_drop.split()), send,
                    bytes_s=settings.uplink_state_bytes_s)

    def on_connect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if rc.is_failure:
            log.error("uplink: broker refused the connection: %s", rc)
            return
        c.subscribe([(f"{root}/+/+/state/+", 0), (f"{root}/{SET}", 1)])

    def on_subscribe(c: mqtt.Client, userdata: object, mid: int, rcs: list[Any], props: object) -> None:
        refused = [str(rc) for rc in rcs if rc.is_failure]
        if refused:
            log.error("uplink: subscriptions refused: %s", refused)
        elif ready:
            ready.touch()

    def on_disconnect(c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if ready:
            ready.unlink(missing_ok=True)

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == f"{root}/{SET}":
            if not msg.retain:  # a request is for now, not a copy from before this process started
                budget.request(bytes(msg.payload))
            return
        budget.state(msg.topic, bytes(msg.payload), bool(msg.retain), msg.properties)

    client.on_connect, client.on_subscribe = on_connect, on_subscribe
    client.on_disconnect, client.on_message = on_disconnect, on_message
    client.connect_async(b.host, b.port, keepalive=settings.mqtt_keepalive_s)
    client.loop_start()
    log.info("uplink: %s states at <= %s Hz and %s B/s per topic (0: no cap), never %s", root,
             settings.uplink_state_hz, settings.uplink_state_bytes_s, sorted(budget.drop))
    try:
        while not stop.wait(0.05):
            budget.tick()
    finally:
        client.disconnect()
        client.loop_stop()
        if ready:
            ready.unlink(missing_ok=True)
        log.info("uplink: stopped %s", budget.counts)


def main() -> None:
    logging.basicConfig(level=os.environ.get("ROBOBUS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(load_settings(UplinkSettings), stop)


if __name__ == "__main__":
    main()
