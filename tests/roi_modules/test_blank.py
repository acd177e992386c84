"""Blank modules (§3.3 BLANK_STATE, §4.3): configured from the service's settings at start and after every
reset, and `make run`'s demo (deploy/Procfile.sim) comes up operational, not blank."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.roi_modules import protocol as p
from services.roi_modules.settings import RoiSettings
from services.roi_modules.sim import SimModuleSpec
from tests.fixtures import Broker
from tests.roi_modules.conftest import wait_until
from tests.roi_modules.harness import make_rig

PROCFILE = Path(__file__).resolve().parents[2] / "deploy" / "Procfile.sim"


def procfile_lines() -> dict[str, str]:
    return dict(line.split(":", 1) for line in PROCFILE.read_text().splitlines() if re.match(r"^[\w-]+:", line))


def procfile_sim_argv() -> list[str]:
    """The demo simulator's command line arguments (after `python -m services.roi_modules.sim`)."""
    words = shlex.split(procfile_lines()["roi-sim"])
    return words[words.index("services.roi_modules.sim") + 1:]


def procfile_roi() -> tuple[list[SimModuleSpec], list[dict[str, Any]]]:
    """The demo's simulated modules (roi-sim --modules) and the service's modules (ROBOBUS_ROI_MODULES)."""
    lines = procfile_lines()
    sim_args = shlex.split(lines["roi-sim"])
    specs = [SimModuleSpec.parse(t) for t in sim_args[sim_args.index("--modules") + 1].split(",")]
    env = dict(w.split("=", 1) for w in shlex.split(lines["roi-modules"]) if "=" in w and w.split("=")[0].isupper())
    return specs, json.loads(env["ROBOBUS_ROI_MODULES"])


def test_make_run_demo_modules_come_up_operational(broker_session: Broker) -> None:
    """Before: roi_io and roi_wheel stayed blank_state, not operational, in `make run`."""
    specs, modules = procfile_roi()
    r = make_rig(broker_session, modules, sim_modules=specs)
    try:
        names = [m["name"] for m in modules]

        def all_green() -> bool:
            hs = [r.bus.latest(f"/{n}/health") or {} for n in names]
            return all(h.get("connection") and h.get("operational") and not h.get("error") for h in hs)
        assert wait_until(all_green, 20), {n: r.bus.latest(f"/{n}/health") for n in names}
        for m, spec in zip(modules, specs, strict=True):
            if m["type"] != "actuator":  # the actuator firmware never leaves BLANK_STATE (§3.7), and works
                assert r.sim.call(spec.octet, lambda fw: fw.configured), m["name"]
    finally:
        r.close()


def test_modules_configured_from_settings_at_start_and_after_a_reset(broker_session: Broker) -> None:
    modules = [{"name": "io", "octet": 10, "type": "gpio", "pin_modes": {"3": "output", "12": "input_pullup"}},
               {"name": "wheel", "octet": 20, "type": "odrive", "initial_mode": "velocity"}]
    r = make_rig(broker_session, modules)
    try:
        assert r.bus.wait("/io/health", lambda d: d["operational"] and d["state"] != "blank_state") is not None
        assert r.bus.wait("/wheel/health", lambda d: d["operational"] and d["state"] != "blank_state") is not None
        assert r.sim.call(10, lambda fw: (fw.modes[3], fw.modes[12])) == (p.PinMode.OUTPUT, p.PinMode.INPUT_PULLUP)
        assert r.sim.call(20, lambda fw: (fw.control_mode, fw.input_mode, fw.vel_sp)) == (
            p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0)
        st = r.bus.wait("/io/state/pin_states", lambda d: d["modes"][3] == p.PinMode.OUTPUT)
        assert st is not None
        mark = r.bus.mark()
        r.sim.reboot(10)
        r.sim.reboot(20)
        assert wait_until(lambda: r.sim.call(10, lambda fw: fw.configured and fw.modes[3] == p.PinMode.OUTPUT), 15)
        assert wait_until(lambda: r.sim.call(20, lambda fw: fw.configured and fw.control_mode == 1), 15)
        assert r.bus.wait("/wheel/health", lambda d: d["operational"], mark) is not None
    finally:
        r.close()


def test_a_blank_module_says_what_configures_it(broker_session: Broker) -> None:
    r = make_rig(broker_session, [{"name": "io", "octet": 10, "type": "gpio"},
                                  {"name": "wheel", "octet": 20, "type": "odrive"}])
    try:
        io = r.bus.wait("/io/health", lambda d: d["state"] == "blank_state")
        assert io is not None and not io["operational"] and not io["error"]
        assert "set_pin_mode" in io["error_message"] and "pin_modes" in io["error_message"]
        wheel = r.bus.wait("/wheel/health", lambda d: d["state"] == "blank_state")
        assert wheel is not None and "initial_mode" in wheel["error_message"]
        # one command configures it
        assert r.call("io", "set_pin_mode", {"pin": 2, "mode": "input"}).ok
        assert r.call("io", "status_report").unwrap()["state_name"] != "blank_state"
    finally:
        r.close()


@pytest.mark.parametrize("module", [
    {"name": "a", "octet": 5, "type": "odrive", "pin_modes": {"3": "output"}},
    {"name": "a", "octet": 5, "type": "gpio", "pin_modes": {"9": "output"}},
    {"name": "a", "octet": 5, "type": "gpio", "initial_mode": "velocity"},
    {"name": "a", "octet": 5, "type": "odrive", "initial_mode": "position"},
    {"name": "a", "octet": 5, "type": "odrive", "length_feedback": "on"},
])
def test_configuration_that_does_not_fit_the_module_is_refused_at_start(module: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RoiSettings(roi_modules=[module])



def test_compose_sim_profile_configures_the_modules_as_make_run() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((PROCFILE.parent / "compose.yaml").read_text())
    env = compose["services"]["roi-modules-sim"]["environment"]
    assert json.loads(env["ROBOBUS_ROI_MODULES"]) == procfile_roi()[1]
    # the simulated modules too (the actuator's length feedback among them), on the compose network's prefix
    command = compose["services"]["roi-sim"]["command"]
    sim_argv = command[command.index("services.roi_modules.sim") + 1:]
    make_run = procfile_sim_argv()
    make_run[make_run.index("--prefix") + 1] = sim_argv[sim_argv.index("--prefix") + 1]
    assert sim_argv == make_run
