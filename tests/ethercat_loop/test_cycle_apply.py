"""The cycle process's reading of the control pipe (`transport/cycle.py`, `_Cycle.apply`), without a NIC: a backlog
of demands (a client's stream that waited in the pipe while the cycle could not read it) is coalesced to the newest
per motor, the superseded ones counted and never unpickled; every other message is applied, in order."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import pytest

from services.ethercat_loop.control import NullifyDemands, SetDemands
from services.ethercat_loop.driver import _FOREVER as FOREVER
from services.ethercat_loop.driver import PalmDriver
from services.ethercat_loop.transport.cycle import _Cycle, _CycleState, submit_frame
from services.ethercat_loop.transport.master import WireCounters
from services.ethercat_loop.transport.shm import C, SharedBlock


@pytest.fixture
def rig() -> Iterator[tuple[_Cycle, Connection, SharedBlock]]:
    shm = SharedBlock.create()
    ctl_r, ctl_w = os.pipe()
    ev_r, ev_w = os.pipe()
    ctl, events = Connection(ctl_r, writable=False), Connection(ev_w, readable=False)
    writer = Connection(ctl_w, readable=False)
    master = SimpleNamespace(counters=WireCounters(), recovery_seq=0)
    cfg = SimpleNamespace(period_ns=1_000_000, state_check_every=250, snapshot_every=100, error_after=20,
                          zero_cycles=20)
    cyc = _Cycle(cfg, master, PalmDriver(), shm, ctl, events, _CycleState(), lambda: None, [])  # type: ignore[arg-type]
    cyc.cycle = 1  # not a cycle that polls for EOF: the pipe is read because the count of messages moved
    try:
        yield cyc, writer, shm
    finally:
        for conn in (ctl, events, writer):
            conn.close()
        os.close(ev_r)
        shm.close()


def _submit(writer: Connection, shm: SharedBlock, *msgs: object) -> None:
    for msg in msgs:  # as ProcessBackend._send writes them
        writer.send_bytes(submit_frame(msg, 1))
        shm.counters_mv[C["submits"]] += 1


def test_a_backlog_of_demands_is_coalesced_to_the_newest_per_motor(rig: Any, monkeypatch: Any) -> None:
    cyc, writer, shm = rig
    unpickled: list[object] = []
    loads = pickle.loads

    def counting(data: Any) -> Any:
        unpickled.append(msg := loads(data))
        return msg

    monkeypatch.setattr(pickle, "loads", counting)  # the module the cycle unpickles with
    stream = [SetDemands({0: v, 1: -v}, deadline_ns=1000 + v) for v in range(1, 9)]
    _submit(writer, shm, SetDemands({2: 7}), stream[0], SetDemands({0: 50}), NullifyDemands(False), *stream[1:],
            SetDemands({0: 99}))
    cyc.apply()
    driver = cyc.driver
    # the newest of each motor, with its own deadline; motor 2's only demand; the other message applied too
    assert driver._fresh == {0: (99, FOREVER), 1: (-8, 1008), 2: (7, FOREVER)}, driver._fresh
    assert shm.get("superseded") == 8 and shm.get("commands_applied") == 4  # {2}, nullify, stream[-1], {0: 99}
    assert len(unpickled) == 4 and not [m for m in unpickled if m in (stream[0], stream[3])]
    assert cyc.drained == 12 and len(cyc.submitted) == 4


def test_a_demand_is_superseded_only_when_newer_ones_set_all_its_motors(rig: Any) -> None:
    cyc, writer, shm = rig
    _submit(writer, shm, SetDemands({0: 5, 1: 6}), SetDemands({0: 9}))
    cyc.apply()
    assert cyc.driver._fresh == {0: (9, FOREVER), 1: (6, FOREVER)}
    assert shm.get("superseded") == 0 and shm.get("commands_applied") == 2
