"""A motion device's stop note (`Device.on_stop(..., note=)`): what the stop cannot do on that device is said in its
health's `error_message` while the stop is active, after the stop's source and reason, and is gone after the
release (dexter-gateway: DexRun has no way to halt a move in progress)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shared.messages import StopState
from shared.rpc import wait_for
from tests.fixtures import Broker
from tests.kit.test_stop import DEADLINE, Bus, start_node

NOTE = "moves already queued on the device run to their end"


@pytest.fixture
def bus(broker_session: Broker) -> Iterator[Bus]:
    b = Bus(broker_session, f"stopnote{time.monotonic_ns()}")
    yield b
    b.close()


def test_the_stop_note_is_in_the_health_message_while_stopped(bus: Bus) -> None:
    node, _ = start_node(bus, name="noted")
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)

        def stop_now(stop: StopState) -> None:
            return None
        node.devices["wheel1"].on_stop(stop_now, note=NOTE)  # wheel2 keeps its action, without a note
        stop = bus.set_stop(True, reason="drill", source="alice@lab")
        bus.wait_answer(node.name, stop)
        assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("state") == "stopped", DEADLINE)
        h1, h2 = bus.health(node.name, "wheel1"), bus.health(node.name, "wheel2")
        assert h1 is not None and h2 is not None
        assert h1["error_message"] == f"bus stop by alice@lab: drill; {NOTE}"
        assert h2["error_message"] == "bus stop by alice@lab: drill"
        release = bus.set_stop(False)
        bus.wait_answer(node.name, release)
        assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("state") != "stopped", DEADLINE)
        h1 = bus.health(node.name, "wheel1")
        assert h1 is not None and NOTE not in h1["error_message"]
        bus.validate_all()
    finally:
        node.stop()

