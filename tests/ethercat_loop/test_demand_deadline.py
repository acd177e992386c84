"""A demand carries the client's deadline to the cycle (shared.dispatch.request_deadline, computed from the client's
own send time): driven through the set_demands handler on the in-process palm model, one already past its deadline
never reaches the palm, and one with time left stops at its deadline, before the 100 ms deadman."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.ethercat_loop.api import API
from services.ethercat_loop.model_backend import ModelBackend
from services.ethercat_loop.models import PalmDemandsRequest
from services.ethercat_loop.protocol import PalmCommand, ToMotorDataType, unpack_command
from services.ethercat_loop.service import PalmService, build
from services.ethercat_loop.settings import EthercatSettings
from shared import Node, dispatch
from shared.rpc import wait_for


@pytest.fixture
def svc(broker_session: Any) -> Iterator[tuple[PalmService, list[tuple[int, int]]]]:
    """The service on the palm model, every command the palm gets recorded: (CLOCK_MONOTONIC ns, motor 0's demand)."""
    settings = EthercatSettings(mqtt_url=broker_session.url, node=f"hand-dl{time.monotonic_ns()}",
                                ethercat_push_config_on_start=False, ethercat_overrun_threshold=1_000_000)
    node = Node(API, settings)
    service = build(node, settings)
    backend = service.backend
    assert isinstance(backend, ModelBackend)
    wire: list[tuple[int, int]] = []
    exchange: Callable[[bytes], bytes | None] = backend.model.exchange

    def recorded(raw: bytes) -> bytes | None:
        cmd = unpack_command(raw, "0220")
        if isinstance(cmd, PalmCommand) and cmd.to_motor_data_type in (ToMotorDataType.DEMAND_PWM,
                                                                      ToMotorDataType.DEMAND_TORQUE):
            wire.append((time.monotonic_ns(), cmd.motor_data[0]))
        return exchange(raw)

    backend.model.exchange = recorded  # type: ignore[method-assign,assignment]
    node.start()
    service.start()
    t = threading.Thread(target=service.run, daemon=True)
    t.start()
    try:
        assert wait_for(backend.connected, 10)
        yield service, wire
    finally:
        service.shutdown()
        node.stop()
        t.join(2)


def _set_demands(service: PalmService, deadline: float | None, demand: int) -> None:
    """The handler as the kit calls it for a request whose deadline (monotonic) is `deadline`."""
    token = dispatch._deadline.set(deadline)
    try:
        service.set_demands(PalmDemandsRequest(motors={0: demand}))
    finally:
        dispatch._deadline.reset(token)


def test_a_demand_past_its_deadline_never_reaches_the_palm(svc: Any) -> None:
    service, wire = svc
    # past its deadline by the time it is handed on (the kit refuses one already expired when it reads it; one can
    # expire between that check and the cycle, e.g. in a stalled node's pipe): never on the wire
    _set_demands(service, time.monotonic() - 0.001, 300)
    n = len(wire)
    time.sleep(0.15)
    assert len(wire) > n + 50 and not [v for _t, v in wire[n:] if v], "the late demand reached the palm"
    assert service.backend.snapshot().counters["demands_late"] == 1  # type: ignore[union-attr]
    # 30 ms left: on the wire, then zero from its deadline on, long before the deadman's 100 ms
    deadline = time.monotonic() + 0.03
    _set_demands(service, deadline, 300)
    assert wait_for(lambda: any(v == 300 for _t, v in wire[n:]), 2)
    time.sleep(0.15)
    moving = [t for t, v in wire[n:] if v == 300]
    assert moving and max(moving) <= deadline * 1e9 + 1_000_000, (max(moving) / 1e9 - deadline)
    assert wire[-1][1] == 0
