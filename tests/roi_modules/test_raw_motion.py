"""The raw path (`queue_general_packet`) and motion: on an ODrive or an actuator only getters go raw (a setter
moves the motor or changes how it moves, bypassing the set-points the service publishes, re-sends after a
reset and stops on shutdown): refused with `forbidden`, nothing sent. GPIO setters go, and the service's pin
modes and outputs (published, re-sent after a reset) follow them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.roi_modules import protocol as p
from tests.fixtures import Broker
from tests.roi_modules.conftest import wait_until
from tests.roi_modules.harness import Rig, make_rig


@pytest.fixture(scope="module")
def rig(broker_session: Broker) -> Iterator[Rig]:
    r = make_rig(broker_session)
    assert wait_until(lambda: all((r.bus.latest(f"/{n}/health") or {}).get("state") not in (None, "connecting")
                                  for n in ("io", "wheel", "arm")), 20)
    yield r
    r.close()


@pytest.mark.parametrize(("action", "payload"), [
    (p.OdriveAction.SET_VELOCITY, p.f32(2.0)), (p.OdriveAction.SET_TORQUE, p.f32(0.5)),
    (p.OdriveAction.SET_POSITION, p.f32(5.0)), (p.OdriveAction.SET_RELATIVE_POSITION, p.f32(5.0)),
    (p.OdriveAction.SET_CONTROL_MODE, bytes([p.ControlMode.VELOCITY])), (p.OdriveAction.CLEAR_ERRORS, b""),
    (0x0100, b""),  # an unknown code without the get bit: a setter as far as the firmware can tell
])
def test_raw_odrive_setter_is_refused_and_never_sent(rig: Rig, action: int, payload: bytes) -> None:
    assert rig.call("wheel", "set_velocity", {"velocity": 0.0}).ok
    before = rig.sim.call(20, lambda f: (f.control_mode, f.input_mode, f.vel_sp, f.torque_sp, f.pos_sp))
    rep = rig.call("wheel", "queue_general_packet", {"action": action, "payload_hex": payload.hex()})
    assert not rep.ok and rep.error["code"] == "forbidden", rep.raw
    assert "getters only" in rep.error["message"] and "set_velocity" in rep.error["message"]
    after = rig.sim.call(20, lambda f: (f.control_mode, f.input_mode, f.vel_sp, f.torque_sp, f.pos_sp))
    assert after == before


def test_raw_actuator_setter_is_refused_and_getters_go(rig: Rig) -> None:
    assert rig.call("arm", "goto_position", {"position": 10.0}).ok
    for action, payload in ((p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.u16(140)),
                            (p.ActuatorAction.SET_RELATIVE_LENGTH, p.u16(100)),
                            (p.ActuatorAction.SET_VELOCITY, p.f32(500.0)), (p.ActuatorAction.SET_CONTROL, b"\x01")):
        rep = rig.call("arm", "queue_general_packet", {"action": action, "payload_hex": payload.hex()})
        assert not rep.ok and rep.error["code"] == "forbidden", (action, rep.raw)
    assert rig.sim.call(30, lambda f: (f.target[0], f.speed[0])) == (15.0, 0.0)
    rep = rig.call("arm", "queue_general_packet", {"action": p.ActuatorAction.GET_CURRENT_LENGTH}).unwrap()
    assert rep["replied"] and rep["action"] == p.ActuatorAction.GET_CURRENT_LENGTH


def test_raw_odrive_getter_goes(rig: Rig) -> None:
    rep = rig.call("wheel", "queue_general_packet", {"action": p.OdriveAction.GET_CONTROL_MODE}).unwrap()
    assert rep["replied"] and bytes.fromhex(rep["payload_hex"])[0] == rig.sim.call(20, lambda f: f.control_mode)


def test_raw_gpio_setters_update_the_published_and_re_sent_pin_state(rig: Rig) -> None:
    mark = rig.bus.mark()
    rep = rig.call("io", "queue_general_packet", {"sub_device_id": 4, "action": p.GpioAction.SET_PIN_MODE,
                                                  "payload_hex": bytes([p.PinMode.OUTPUT]).hex()}).unwrap()
    assert bytes.fromhex(rep["payload_hex"])[0] == 1
    st = rig.bus.wait("/io/state/pin_states", lambda d: d["modes"][4] == p.PinMode.OUTPUT, mark)
    assert st is not None and st["names"][4] == "output"
    rep = rig.call("io", "queue_general_packet", {"sub_device_id": 4, "action": p.GpioAction.SET_OUTPUT,
                                                  "payload_hex": "01"}).unwrap()
    assert bytes.fromhex(rep["payload_hex"])[0] == 1
    # a typed set_pin_output now knows the pin is an output, and a reset gets both back
    assert rig.call("io", "set_pin_output", {"pin": 4, "value": 1}).ok
    rig.sim.reboot(10)
    assert wait_until(lambda: rig.sim.call(10, lambda f: (f.modes[4], f.outputs[4])) == (3, 1), 15)
