"""Fixtures: a can-bootloader node in this process on private virtual buses with simulated boards."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import can
import pytest

from services.can_bootloader.api import API
from services.can_bootloader.service import CanBootService, build
from services.can_bootloader.settings import CanBootSettings
from services.can_bootloader.sim import BootBusSim, make_boards
from services.can_bootloader.transport import CanBusConfig
from shared import Node
from tests.fixtures import Broker

_ids = itertools.count()


class BootNode:
    def __init__(self, node: Node, svc: CanBootService, sims: list[BootBusSim]) -> None:
        self.node = node
        self.svc = svc
        self.sims = sims
        self.name = node.name

    def board(self, board_id: int) -> Any:
        for sim in self.sims:
            try:
                return sim.board(board_id)
            except KeyError:
                continue
        raise KeyError(board_id)

    def frames_sent(self) -> int:
        return sum(pt.frames_sent for pt in self.svc.ports.values())


@pytest.fixture
def boot_node(broker_session: Broker, tmp_path: Any) -> Iterator[Callable[..., BootNode]]:
    made: list[tuple[Node, list[BootBusSim]]] = []

    def make(boards: tuple[int, ...] = (3, 8, 13), *, erase_s: float = 0.0, app_aware: bool | None = None,
             **kw: Any) -> BootNode:
        n = next(_ids)
        name = f"canboot{n}"
        settings = CanBootSettings(
            mqtt_url=broker_session.url, node=name, health_interval_s=0.5,
            can_bus1=CanBusConfig(interface="virtual", channel=f"{name}-1"),
            can_bus2=CanBusConfig(interface="virtual", channel=f"{name}-2"),
            can_firmware_dir=tmp_path, **kw)
        sims = []
        for bus_no in (1, 2):
            ids = [b for b in boards if (b >= 10) == (bus_no == 2)]
            sim = BootBusSim(can.Bus(interface="virtual", channel=f"{name}-{bus_no}"),
                             make_boards(ids, app_aware=app_aware), erase_s=erase_s).start()
            sims.append(sim)
        node = Node(API, settings)
        svc = build(node, settings)
        node.start()
        assert node.session.wait_ready(10)
        # flash and reset answer `unavailable` until the node has read the bus stop (shared/stop.py)
        assert node.stop_latch.known_event.wait(10)
        made.append((node, sims))
        return BootNode(node, svc, sims)

    yield make
    for node, sims in made:
        node.stop()
        for s in sims:
            s.stop()
            s.bus.shutdown()
