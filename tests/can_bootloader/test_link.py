"""Health from the kit's link supervisor (docs/kit.md, "Health"): the link is the adapter (the python-can bus);
boards answer only in their bootloader and only when asked. A bus that cannot open is unreachable and probed,
an adapter that vanishes is lost and reopened, a board answering garbage is counted and answered with a stable
code, shutdown says stopped. Real buses, a real broker."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.can_bootloader.api import API
from services.can_bootloader.service import build
from services.can_bootloader.settings import CanBootSettings
from services.can_bootloader.transport import CanBusConfig
from shared import Node
from shared.rpc import RpcClient, wait_for
from tests.fixtures import Broker

DEV = "motors"
_ids = itertools.count()


class Watched:
    """A node and every health message it published, as a subscriber saw them."""

    def __init__(self, client: RpcClient, node: Node, svc: Any) -> None:
        self.node, self.svc = node, svc
        self.health: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        client.subscribe_before(f"robobus/{node.name}/{DEV}/health", self._on)

    def _on(self, m: Any) -> None:
        with self._lock:
            self.health.append(json.loads(m.payload))

    def last(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.health[-1]) if self.health else {}

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.health)


@pytest.fixture
def bare_node(broker_session: Broker, client: RpcClient) -> Iterator[Any]:
    made: list[Node] = []

    def make(**kw: Any) -> Watched:
        name = f"canlink{next(_ids)}"
        settings = CanBootSettings(mqtt_url=broker_session.url, node=name, health_interval_s=0.5, **kw)
        node = Node(API, settings)
        w = Watched(client, node, None)
        w.svc = build(node, settings)
        node.start()
        assert node.session.wait_ready(10)
        assert node.stop_latch.known_event.wait(10)  # flash and reset need the bus stop's state
        made.append(node)
        return w

    yield make
    for n in made:
        n.stop()


def test_health_is_the_link_supervisors(boot_node: Any, client: RpcClient) -> None:
    """Operational = the adapter proved healthy within the budget (a setting); the finer state is idle."""
    bn = boot_node(can_liveness_s=0.8)
    h: dict[str, Any] = {}

    def seen() -> bool:
        nonlocal h
        msgs = client.collect_retained(f"robobus/{bn.name}/{DEV}/health")
        h = json.loads(msgs[-1][1]) if msgs else {}
        return bool(h.get("connection"))

    assert wait_for(seen, 10), h
    assert h["state"] == "idle" and h["operational"] and not h["error"]
    link = h["details"]["link"]
    assert link["state"] == "operational" and link["valid_data"] and link["liveness_s"] == 0.8
    assert link["sessions"] == 1 and link["failures"] == 0


def test_a_bus_that_cannot_open_is_unreachable_and_probed(bare_node: Any, client: RpcClient) -> None:
    """A bad interface/channel: connecting, then unreachable after the budget; every failed open is counted, never
    an error; once unreachable, one open attempt per probe period (not the back-off ladder)."""
    w = bare_node(can_bus1=CanBusConfig(interface="udp_multicast", channel="not-a-multicast-group"), can_bus2=None,
                  can_liveness_s=0.5, can_backoff_min_s=0.1, can_backoff_max_s=0.2, can_probe_period_s=1.5)
    assert wait_for(lambda: w.last().get("state") == "unreachable", 10), w.all()[-3:]
    h = w.last()
    assert h["connection"] is False and h["operational"] is False and h["error"] is False
    assert "not-a-multicast-group" in h["error_message"]
    assert not any(x["error"] for x in w.all())
    rep = client.call(w.node.name, DEV, "read_version", {"board": 3})
    assert not rep.ok and (rep.error or {})["code"] == "unavailable"
    a0 = w.svc.link.details()["attempts"]
    t0 = time.monotonic()
    assert wait_for(lambda: w.svc.link.details()["attempts"] >= a0 + 2, 10)
    elapsed = time.monotonic() - t0
    assert elapsed >= 1.5 * 0.9, f"two probes {elapsed:.2f} s apart: the back-off ladder, not the probe period"
    d = w.svc.link.details()
    assert d["failures"] >= d["attempts"] - 1 and d["sessions"] == 0 and "last_failure" in d


def test_an_adapter_that_vanishes_is_lost_and_reopened(boot_node: Any, client: RpcClient) -> None:
    """The adapter fails under the node (a read error, as when a USB adapter is pulled): lost at once,
    connection false, no error; reopened after the back-off and operational again at its first clean check."""
    bn = boot_node(can_backoff_min_s=0.3)
    w = Watched(client, bn.node, bn.svc)
    assert wait_for(lambda: w.last().get("connection") is True, 10), w.all()[-2:]
    port = bn.svc.ports[1]
    port._bus.shutdown()  # the interface is gone: every read fails from now on
    assert wait_for(lambda: w.last().get("state") == "lost", 5), w.all()[-3:]
    h = w.last()
    assert h["connection"] is False and h["error"] is False and "CAN bus 1" in h["error_message"]
    assert wait_for(lambda: w.last().get("connection") is True, 10), w.all()[-3:]
    assert not any(x["error"] for x in w.all())
    d = bn.svc.link.details()
    assert d["sessions"] == 2 and d["failures"] >= 1
    rep = client.call(bn.name, DEV, "read_version", {"board": 3})
    assert rep.ok, rep.error


def test_a_board_answering_garbage_is_counted_and_gets_device_error(boot_node: Any, client: RpcClient) -> None:
    """Malformed answers (the board's SID, the wrong length) are counted as garbage (link and node) and the read
    is answered `device_error` saying so; the adapter stays healthy."""
    bn = boot_node()
    bn.board(3).faults.garble = 1000
    rep = client.call(bn.name, DEV, "read_version", {"board": 3})
    assert not rep.ok and (rep.error or {})["code"] == "device_error", rep.error
    assert "malformed" in (rep.error or {})["message"]
    assert bn.svc.link.details()["garbage"] >= 1
    assert bn.node.counters.decode_errors >= 1
    rep = client.call(bn.name, DEV, "read_flash", {"board": 3, "address": 0x1000, "length": 16})
    assert not rep.ok and (rep.error or {})["code"] == "device_error", rep.error
    assert bn.svc.link.state.value == "operational"  # garbage from a board is not the adapter failing
    rep = client.call(bn.name, DEV, "read_version", {"board": 8})  # a good board on the same bus
    assert rep.ok, rep.error


def test_shutdown_says_stopped(boot_node: Any, client: RpcClient) -> None:
    bn = boot_node()
    w = Watched(client, bn.node, bn.svc)
    assert wait_for(lambda: w.last().get("connection") is True, 10)
    bn.node.stop()
    assert wait_for(lambda: w.last().get("state") == "stopped", 5), w.all()[-2:]
    h = w.last()
    assert h["connection"] is False and h["operational"] is False
    assert h["details"]["link"]["valid_data"] is False
