"""A module of another type at a configured octet (§4.2 "Module type mismatch"): health says error, and the
module gets nothing typed: no poll, no command, no measurement published from its replies."""

from __future__ import annotations

from typing import Any

from services.roi_modules import protocol as p
from services.roi_modules.sim import GpioFirmware, SimModuleSpec
from tests.fixtures import Broker
from tests.roi_modules.conftest import wait_until
from tests.roi_modules.harness import make_rig

COMMANDS: list[tuple[str, dict[str, Any]]] = [
    ("goto_position", {"position": 1.0}), ("goto_relative_position", {"position": 1.0}),
    ("set_velocity", {"velocity": 1.0}), ("set_torque", {"torque": 0.1}), ("clear_errors", {}),
    ("queue_general_packet", {"action": p.OdriveAction.GET_ALL}), ("go_to_position", {"position": 1.0}),
]


def general_rx(fw: Any) -> int:
    return int(fw.counters.general_rx)


def test_mismatched_module_gets_no_typed_packet_and_publishes_no_measurement(broker_session: Broker) -> None:
    """An ODrive configured, a GPIO module answering: before the fix the GET_ALL poll went to the GPIO module
    every tick, its zero replies were published as state/power/temperature (estimated: false), and
    goto_position sent it SET_CONTROL_MODE."""
    r = make_rig(broker_session, [{"name": "wheel", "octet": 20, "type": "odrive"}],
                 sim_modules=[SimModuleSpec(20, "gpio")])
    try:
        h = r.bus.wait("/wheel/health", lambda d: "mismatch" in d["error_message"])
        assert h is not None and h["error"] and not h["operational"] and "Check IP octet" in h["error_message"]
        # some maintain ticks with the mismatch known: it is asked what it is (STATUS_REPORT), nothing else
        n = r.sim.call(20, lambda fw: fw.counters.sysadmin_rx)
        assert wait_until(lambda: r.sim.call(20, lambda fw: fw.counters.sysadmin_rx) >= n + 5, 15)
        for command, body in COMMANDS:
            rep = r.call("wheel", command, body)
            assert not rep.ok, command
            assert rep.error["code"] == "device_error" and "mismatch" in rep.error["message"], (command, rep.error)
        assert r.sim.call(20, general_rx) == 0  # not one general packet: no poll, no mode switch, no raw
        assert r.sim.call(20, lambda fw: (fw.configured, list(fw.modes))) == (False, [0] * p.GPIO_COUNT)
        for name in ("state", "power", "temperature"):
            assert r.bus.since(0, f"/wheel/state/{name}") == [], name
        # type-agnostic SysAdmin still answers: it is how the mismatch is diagnosed
        assert r.call("wheel", "ping").unwrap()["module_type_name"] == "gpio"

        # the right module plugged in instead (the link drops while modules are swapped)
        mark = r.bus.mark()
        r.sim.set_faults(20, offline=True)
        assert r.bus.wait("/wheel/health", lambda d: not d["connection"], mark) is not None
        r.sim.replace(20, "odrive")
        assert r.bus.wait("/wheel/health", lambda d: d["connection"] and "mismatch" not in d["error_message"],
                          mark) is not None
        st = r.bus.wait("/wheel/state/power", lambda d: d["voltage"] == 24.0, mark)
        assert st is not None
        assert r.call("wheel", "set_velocity", {"velocity": 0.5}).ok

        # and swapped for a GPIO module again: measurements stop at once, nothing typed reaches it
        r.sim.set_faults(20, offline=True)
        assert r.bus.wait("/wheel/health", lambda d: not d["connection"], r.bus.mark()) is not None
        gpio = r.sim.replace(20, "gpio")
        assert isinstance(gpio, GpioFirmware)
        mark = r.bus.mark()
        assert r.bus.wait("/wheel/health", lambda d: "mismatch" in d["error_message"], mark) is not None
        n = r.sim.call(20, lambda fw: fw.counters.sysadmin_rx)
        assert wait_until(lambda: r.sim.call(20, lambda fw: fw.counters.sysadmin_rx) >= n + 5, 15)
        assert r.sim.call(20, general_rx) == 0
        for name in ("state", "power", "temperature"):
            assert r.bus.since(mark, f"/wheel/state/{name}") == [], name
    finally:
        r.close()


def test_sim_puts_a_module_of_another_kind_at_an_octet() -> None:
    from services.roi_modules.sim import ActuatorFirmware, OdriveFirmware, RoiSim
    from tests.roi_modules.conftest import fresh_prefix

    sim = RoiSim(fresh_prefix(), [SimModuleSpec(20, "odrive"), SimModuleSpec(21, "gpio")])
    try:
        assert isinstance(sim.module(20), OdriveFirmware)
        fw = sim.replace(20, "actuator")
        assert isinstance(fw, ActuatorFirmware) and sim.module(20) is fw
        assert fw.neighbour == 21 and fw.chain_ok  # keeps its place in the ring
        assert fw.status_report(fw.boot_time).module_type == p.ModuleType.ACTUATOR
    finally:
        sim.close()


def test_status_report_of_a_module_of_another_kind_says_so(broker_session: Broker) -> None:
    """An ODrive configured, a blank GPIO module answering: the command's message names the mismatch and what the
    module reports. Before: the ODrive's blank-state text ("An ODrive module is configured by any set command")."""
    r = make_rig(broker_session, [{"name": "wheel", "octet": 20, "type": "odrive"}],
                 sim_modules=[SimModuleSpec(20, "gpio")])
    try:
        assert r.bus.wait("/wheel/health", lambda d: "mismatch" in d["error_message"]) is not None
        rep = r.call("wheel", "status_report").unwrap()
        assert rep["module_type_name"] == "gpio" and rep["state_name"] == "blank_state", rep
        msg = rep["message"]
        assert msg.startswith("Module type mismatch: gpio answers at octet 20, configured odrive"), msg
        assert msg.endswith("It reports blank_state.") and "ODrive" not in msg, msg
        # the configured type answering: its own text, as before
        r.sim.set_faults(20, offline=True)
        assert r.bus.wait("/wheel/health", lambda d: not d["connection"], r.bus.mark()) is not None
        r.sim.replace(20, "odrive")
        assert wait_until(lambda: r.bus.latest("/wheel/health", 0) and "mismatch" not in
                          (r.bus.latest("/wheel/health") or {}).get("error_message", "mismatch"), 15)
        rep = r.call("wheel", "status_report").unwrap()
        assert "mismatch" not in rep["message"] and "An ODrive module is configured" in rep["message"], rep
    finally:
        r.close()
