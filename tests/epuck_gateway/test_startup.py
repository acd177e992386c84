"""A node seen online answers for every configured robot: the robots' devices exist before the node connects.

They were made in the service's asyncio main, which a busy machine ran only after paho's thread had connected,
subscribed and published the node online; a command in that gap was answered `not_found` (seen in a proof run of
the suite beside `stress-ng --cpu 1`)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from services.epuck_gateway.api import API
from services.epuck_gateway.service import build
from services.epuck_gateway.settings import EpuckSettings
from shared import Node


def test_every_configured_robot_is_a_device_once_built_before_any_connection() -> None:
    settings = EpuckSettings(mqtt_url="mqtt://127.0.0.1:9", epuck_robots=[
        {"id": "left", "host": "127.0.0.1", "port": 9}, {"id": "right", "transport": "serial", "port": "/dev/null9"}])
    node = Node(API, settings)
    interval = sys.getswitchinterval()
    try:
        gateway = build(node, settings)  # what run_service does before it starts the node
        assert not node.session.connected.is_set()
        assert set(node.devices) == {"left", "right"}
        assert all(node.devices[r].commands for r in ("left", "right"))  # commands bound: dispatchable
        # every robot answers the whole contract, each command and the job bound once on its handler (the kit
        # refuses to start otherwise), a WiFi and a serial robot alike
        node.check_bindings()
        for r in ("left", "right"):
            dev = node.devices[r]
            assert set(API.commands) <= set(dev.commands) and set(dev.jobs) == set(API.jobs) == {"flash"}
            assert dev.unbound() == ([], [])
    finally:
        sys.setswitchinterval(interval)
        gateway.pool.shutdown(wait=False)


def test_a_health_snapshot_read_before_a_change_is_never_published_after_it() -> None:
    """At start the connect callback (paho's thread) publishes every robot's health while the loop's link reports
    `connected`: a `connecting` snapshot read before that change and sent after it was the retained health until
    the next change (up to 150 ms, `streaming`). A publish whose snapshot began earlier than one already sent is
    dropped (shared/device.py publish_health)."""
    settings = EpuckSettings(mqtt_url="mqtt://127.0.0.1:9", epuck_robots=[{"id": "r", "host": "127.0.0.1", "port": 9}])
    node = Node(API, settings)
    dev = node.device("r")
    sent: list[dict[str, Any]] = []

    def record(topic: str, payload: bytes | str, **kw: Any) -> bool:
        sent.append(json.loads(payload))
        return True

    setattr(node.session, "publish", record)  # noqa: B010 (a stand-in for the broker)
    node.session.connected.set()  # as connected (no health is published before the node is)
    dev.set_health(state="connecting")
    read, go = threading.Event(), threading.Event()
    real = dev.health_message

    def slow_message() -> Any:
        msg = real()  # the old state, read now ...
        if threading.current_thread().name == "heartbeat":
            read.set()
            go.wait(5)  # ... and sent after the change
        return msg

    dev.health_message = slow_message  # type: ignore[method-assign]
    beat = threading.Thread(target=dev.publish_health, name="heartbeat")
    beat.start()
    assert read.wait(5)
    dev.set_health(state="connected")  # the link's change, published at once
    go.set()
    beat.join(5)
    assert sent[-1]["state"] == "connected", [m["state"] for m in sent]
