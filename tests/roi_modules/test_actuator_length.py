"""Actuator position from GET_CURRENT_LENGTH (0x8003) where the module answers it with a length (the ROS node
at 6ec908d reads uint16 BE ticks), the flagged estimate only where it does not (released firmware: [0] = 0)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.roi_modules import protocol as p
from services.roi_modules.sim import ActuatorFirmware, RoiSim, SimModuleSpec
from tests.fixtures import Broker
from tests.roi_modules.conftest import fresh_prefix
from tests.roi_modules.harness import Rig, make_rig

SPEED_TICKS = 15.0  # the simulated motor's top speed: 10 %/s of 150 ticks, whatever is commanded


def put(ticks: float, ch: int = 0) -> Any:
    def f(fw: Any) -> None:
        fw.length[ch] = fw.target[ch] = ticks
    return f


def pct(r: Rig, ch: int = 0) -> float:
    return float(r.sim.call(30, lambda fw: fw.length[ch])) / 150 * 100


@pytest.fixture()
def rig(broker_session: Broker) -> Iterator[Rig]:
    sim = RoiSim(fresh_prefix(), [SimModuleSpec(30, "actuator")], actuator_length=True,
                 actuator_max_speed=SPEED_TICKS).start()
    sim.call(30, put(15.0))  # 10 %: not at 0, which reads the same as the released firmware's zero reply
    r = make_rig(broker_session, [{"name": "arm", "octet": 30, "type": "actuator"}], sim=sim)
    yield r
    r.close()


def test_sim_answers_current_length_only_with_the_option() -> None:
    now = time.monotonic()
    ask = p.GeneralPacket(1, p.ActuatorAction.GET_CURRENT_LENGTH)
    with_length = ActuatorFirmware(30, now, length_feedback=True)
    with_length.length[1] = 123.4
    assert p.read_u16(with_length.handle(ask, now).encode(), p.GENERAL_HEADER) == 123
    released = ActuatorFirmware(30, now)
    released.length[1] = 123.4
    assert released.handle(ask, now).encode()[p.GENERAL_HEADER:] == bytes(58)  # not implemented: [0] = 0


def test_published_position_follows_the_measured_length_not_the_target(rig: Rig) -> None:
    """Before: the state ignored the reply and jumped to the target (30 % at once, the module at 14.4 %)."""
    st = rig.bus.wait("/arm/state/state", lambda d: d["estimated"] is False)
    assert st is not None and st["position"] == pytest.approx(10.0, abs=0.7)
    mark = rig.bus.mark()
    assert rig.call("arm", "goto_position", {"position": 30.0}).ok  # 2 s at the motor's 10 %/s
    done = rig.bus.wait("/arm/state/state", lambda d: d["position"] >= 29.5, mark, timeout=30)
    assert done is not None and pct(rig) == pytest.approx(30.0, abs=0.7)
    states = [json.loads(m.payload) for m in rig.bus.since(mark, "/arm/state/state")]
    assert all(s["estimated"] is False for s in states)
    positions = [s["position"] for s in states]
    assert all(10.0 - 0.7 <= x <= 30.0 + 0.7 for x in positions), positions
    assert all(b >= a - 0.7 for a, b in itertools.pairwise(positions)), positions  # no jump back
    assert any(13.0 < x < 27.0 for x in positions), positions  # on its way, not at the target at once
    assert any(s["velocity"] > 3.0 for s in states)  # measured velocity, ~10 %/s


def test_move_job_finishes_on_the_measured_position(rig: Rig) -> None:
    """Before: the job ended when the estimate (at the commanded 40 %/s) reached the target, the module far
    behind at its own top speed."""
    assert rig.call("arm", "goto_position", {"position": 10.0}).ok  # where it is: a known start either way
    rep, result = rig.client.call_job(rig.node, "arm", "go_to_position",
                                      {"position": 60.0, "velocity_feedforward": 40.0, "timeout_s": 40},
                                      lambda e: None, timeout=60)
    assert rep.ok and result is not None and result["ok"], result
    assert abs(pct(rig) - 60.0) <= 0.5 + 0.7  # the module is there (within one tick of the reported)
    r = result["result"]
    assert r["estimated"] is False and abs(r["position"] - 60.0) <= 0.5


def test_length_feedback_off_keeps_the_estimate(broker_session: Broker) -> None:
    sim = RoiSim(fresh_prefix(), [SimModuleSpec(30, "actuator")], actuator_length=True).start()
    sim.call(30, put(30.0, 0))
    sim.call(30, put(30.0, 1))
    r = make_rig(broker_session, [{"name": "off", "octet": 30, "type": "actuator", "length_feedback": "off"},
                                  {"name": "auto", "octet": 30, "type": "actuator", "channel": 1}], sim=sim)
    try:
        assert r.bus.wait("/auto/state/state", lambda d: not d["estimated"] and d["position"] == 20.0) is not None
        off = r.bus.wait("/off/state/state", lambda d: True)
        assert off is not None and off["estimated"] is True and off["position"] is None
    finally:
        r.close()


@pytest.mark.parametrize("velocity", [-5.0, 0.0, -0.0, 1000.5])
def test_actuator_velocity_out_of_range_is_refused_and_nothing_sent(rig: Rig, velocity: float) -> None:
    """An actuator's set_velocity is the speed of its moves, in (0, 1000] %/s. Before: -5 was taken as 5 %/s
    (its absolute value) while 0 was refused."""
    assert rig.bus.wait("/arm/health", lambda d: d["operational"]) is not None
    speed = rig.sim.call(30, lambda fw: fw.speed[0])
    rep = rig.call("arm", "set_velocity", {"velocity": velocity})
    assert not rep.ok and rep.error["code"] == "invalid_request", rep.raw
    assert "must be in (0, 1000]" in rep.error["message"], rep.error
    if velocity:  # the same speed as a move's feed-forward (0 there means: keep the speed)
        rep = rig.call("arm", "goto_position", {"position": 50.0, "velocity_feedforward": velocity})
        assert not rep.ok and rep.error["code"] == "invalid_request", rep.raw
    assert rig.sim.call(30, lambda fw: fw.speed[0]) == speed
    assert rig.call("arm", "set_velocity", {"velocity": 5.0}).ok  # in range: taken
    assert rig.sim.call(30, lambda fw: fw.speed[0]) == pytest.approx(5.0 / 100 * 150)
