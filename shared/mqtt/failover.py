"""A clustered centre's nodes in turn: where a client's next (re)connect goes when its broker fails.

`ROBOBUS_FLEET_BROKERS` ('HOST:PORT,HOST:PORT,...', deploy/README.md "A clustered centre") lists the nodes; the
URL's scheme, user and TLS (ROBOBUS_MQTT_URL) apply to each. fleet-watch, fleet-gate, the `robobus` CLI (its
MqttSession) and the dashboard's relay start on the first node and move to the next when theirs fails."""

from __future__ import annotations

import logging
from collections.abc import Callable

import paho.mqtt.client as mqtt

from shared.mqtt import paho_private

log = logging.getLogger("robobus.mqtt")


def parse_brokers(text: str) -> list[tuple[str, int]]:
    """'HOST:PORT,HOST:PORT,...' (blanks around the commas allowed) as (host, port) pairs, or ValueError."""
    out: list[tuple[str, int]] = []
    for item in filter(None, (a.strip() for a in text.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad broker {item!r}: HOST:PORT")
        out.append((host, int(port)))
    return out


def fail_over(client: mqtt.Client, brokers: list[tuple[str, int]], who: str,
              moved: Callable[[str, int], None] | None = None) -> Callable[..., None]:
    """A callback for on_connect_fail and on_disconnect: the client's next (re)connect goes to the next broker in
    `brokers`, in turn (a clustered centre's nodes); with one broker it does nothing. `moved(host, port)` is told
    each move."""
    at = [0]

    def move(*_: object) -> None:
        if len(brokers) < 2:
            return
        at[0] = (at[0] + 1) % len(brokers)
        host, port = brokers[at[0]]
        paho_private.retarget(client, host, port)  # paho's public setters refuse while it reconnects
        if moved is not None:
            moved(host, port)
        log.warning("%s: the next connection to %s:%s", who, host, port)

    return move
