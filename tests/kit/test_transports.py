"""The services' transports, real and simulated, chosen by name through one kit mechanism (shared/transports.py):
entry points `robobus.transports`, `<service>.<name> = module:factory`.

- every registered transport belongs to a registered service and loads by name (its factory imports and is
  callable), and each service's default setting names one of its registered transports;
- an unknown name is refused with the registered names listed, by the loader and at start (a settings error:
  one line naming the variable, exit 2, before anything connects);
- a package outside this tree adds a transport to an existing service with an entry point of its own, and the
  service runs it (a dist-info on the path of a subprocess);
- no service.py imports simulator code (a module `sim`, `sim_*`, `simworld`, or one inside a `sim` package) nor a
  module a transport's entry point names: the factory module is the only one that knows the concrete transport.
  The check parses every import of every service.py (function level and `importlib.import_module` too; the
  parser is tests/kit/test_layers.py's); `test_the_import_rule_catches_a_forbidden_import` shows it finds one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.registry import service_names
from shared.transports import (
    GROUP,
    TransportUnavailable,
    UnknownTransport,
    check_transport,
    load_transport,
    transport_names,
    transport_plugins,
)
from tests.kit.test_layers import imported_names

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"
SIM_PART = re.compile(r"sim(_\w+|world)?")


def _registered() -> dict[str, list[str]]:
    """{service: [transport names]} for every service that registers transports."""
    out: dict[str, list[str]] = {}
    for svc in service_names():
        names = transport_names(svc)
        if names:
            out[svc] = names
    return out


def test_every_registered_transport_belongs_to_a_service_and_loads_by_name():
    from shared.registry import plugins

    services = set(service_names())
    every = [p.name for p in plugins(GROUP, "")]
    assert every, "no robobus.transports entry point: is robobus installed (pip install -e .)?"
    orphans = [n for n in every if not any(n.startswith(f"{s}.") for s in services)]
    assert not orphans, f"transports of no registered service: {orphans}"
    registered = _registered()
    # the services whose transport is chosen in their settings: the simulators beside the real ones
    assert {"ethercat-loop", "can-bootloader", "epuck-gateway"} <= set(registered)
    assert {"model", "virtual", "nic"} <= set(registered["ethercat-loop"])
    assert "sim" in registered["can-bootloader"]
    assert {"wifi", "serial"} <= set(registered["epuck-gateway"])
    for svc, names in registered.items():
        for name in names:
            factory = load_transport(svc, name)
            assert callable(factory), f"{svc}.{name}"
            assert check_transport(svc, name) == name


def test_each_service_default_names_a_registered_transport():
    from services.epuck_gateway.settings import EpuckSerialRobot, EpuckWifiRobot
    from services.ethercat_loop.settings import EthercatSettings

    assert EthercatSettings.model_fields["backend"].default in transport_names("ethercat-loop")
    assert EthercatSettings(backend="virtual").backend == "virtual"
    # an e-puck2's `transport` names its link; WiFi by default
    assert {EpuckWifiRobot.model_fields["transport"].default, "serial"} <= set(transport_names("epuck-gateway"))
    assert EpuckSerialRobot(id="r", transport="serial", port="/dev/ttyACM0").transport == "serial"


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(UnknownTransport, match=r"unknown ethercat-loop transport 'modle' \(did you mean 'model'\?\); "
                                               r"registered: model, nic, virtual"):
        load_transport("ethercat-loop", "modle")
    with pytest.raises(ValueError, match="registered: model, nic, virtual"):  # a settings validator's ValueError
        check_transport("ethercat-loop", "ethercat")
    with pytest.raises(UnknownTransport, match="no transport is registered for no-such-service"):
        load_transport("no-such-service", "x")


def test_an_unknown_name_in_the_settings_stops_the_service_at_start():
    """ROBOBUS_ETHERCAT_BACKEND=modle: one line naming the variable and the registered transports, exit 2,
    before any broker is tried (none runs at the URL given)."""
    env = {**os.environ, "ROBOBUS_ETHERCAT_BACKEND": "modle", "ROBOBUS_MQTT_URL": "mqtt://127.0.0.1:1"}
    r = subprocess.run([sys.executable, "-m", "services.ethercat_loop"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "ROBOBUS_ETHERCAT_BACKEND" in line and "registered: model, nic, virtual" in line, line
    assert "did you mean 'model'" in line, line


def test_a_registered_transport_that_does_not_import_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "services.ethercat_loop.transport.process_backend", None)
    with pytest.raises(TransportUnavailable, match="ethercat-loop transport 'nic' cannot be imported here"):
        load_transport("ethercat-loop", "nic")


OUT_OF_TREE = '''
"""A transport for ethercat-loop from a package outside the tree: the model backend, marked."""
from services.ethercat_loop.model_backend import model_backend

MADE = []


def factory(settings, calibration):
    backend = model_backend(settings, calibration)
    MADE.append(backend)
    return backend
'''


def test_a_package_outside_the_tree_adds_a_transport_to_a_service(tmp_path):
    """A dist-info with its own `robobus.transports` entry point on the path: the service's settings accept its
    name and the service's own wiring (service.make_backend) builds the backend with its factory."""
    (tmp_path / "extra_hand.py").write_text(textwrap.dedent(OUT_OF_TREE))
    info = tmp_path / "extra_hand-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-hand\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f'[{GROUP}]\nethercat-loop.extra = extra_hand:factory\n')
    script = textwrap.dedent('''
        import extra_hand
        from services.ethercat_loop.service import make_backend
        from services.ethercat_loop.settings import EthercatSettings
        from shared.transports import transport_names
        print(transport_names("ethercat-loop"))
        b = make_backend(EthercatSettings(backend="extra"))
        print(extra_hand.MADE == [b], type(b).__name__)
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    names, made = r.stdout.splitlines()[:2]
    assert "'extra'" in names and "'model'" in names and made == "True ModelBackend", r.stdout


# -- no service.py imports a simulator or a concrete transport ------------------------------------------------
def _transport_modules() -> set[str]:
    """The modules the `robobus.transports` entry points name (the concrete transports and the simulators)."""
    return {p.module for svc in service_names() for p in transport_plugins(svc).values()}


def forbidden_imports(path: Path, module: str, transport_modules: set[str]) -> list[str]:
    """`line: name (why)` for each import in `path` of simulator code or of a transport's module."""
    found = []
    for line, name in imported_names(path, module):
        parts = name.split(".")
        if parts[0] == "services" and any(SIM_PART.fullmatch(p) for p in parts[2:]):
            found.append(f"{line}: {name} (simulator code)")
        elif any(name == m or name.startswith(f"{m}.") for m in transport_modules):
            found.append(f"{line}: {name} (a transport's module: load it by name, shared.transports)")
    return found


def _service_files() -> list[Path]:
    return sorted(SERVICES.glob("*/service.py"))


def test_no_service_imports_a_simulator_or_a_transport_module():
    files = _service_files()
    assert len(files) >= 5
    mods = _transport_modules()
    assert {"services.ethercat_loop.model_backend", "services.can_bootloader.sim",
            "services.epuck_gateway.links.wifi", "services.epuck_gateway.links.serial"} <= mods
    bad = {f"{f.relative_to(REPO)}:{v}" for f in files
           for v in forbidden_imports(f, f"services.{f.parent.name}.service", mods)}
    assert not bad, "\n".join(sorted(bad))


def test_the_import_rule_catches_a_forbidden_import(tmp_path):
    path = tmp_path / "service.py"
    path.write_text(textwrap.dedent('''
        import importlib
        from services.ethercat_loop.model_backend import ModelBackend
        from services.ethercat_loop.backend import HandBackend

        def start():
            from services.can_bootloader.sim import sims_on_ports
            from .sim import wifi
            importlib.import_module("services.ethercat_loop.transport.process_backend")
            from services.epuck_gateway import simworld
    '''))
    found = forbidden_imports(path, "services.epuck_gateway.service", _transport_modules())
    assert sorted((f.split(" (")[0] for f in found), key=lambda f: int(f.split(":")[0])) == [
        "3: services.ethercat_loop.model_backend.ModelBackend",
        "7: services.can_bootloader.sim.sims_on_ports",
        "8: services.epuck_gateway.sim.wifi",
        "9: services.ethercat_loop.transport.process_backend",
        "10: services.epuck_gateway.simworld",
    ], found
