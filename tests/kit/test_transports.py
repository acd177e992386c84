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
  parser is tests/kit/test_layers.py's); `test_the_import_rule_catches_a_forbidden_import` shows it finds one;
- every service registers at least one transport, and no service.py builds one itself: it calls neither a
  transport's factory nor the class a factory returns (its return annotation) by name; the factory, loaded by
  name, is the one place that builds it (`test_the_construction_rule_catches_a_transport_built_in_place`).
"""

from __future__ import annotations

import ast
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
    # every service's transport is chosen by name in its settings (the simulators beside the real ones where they
    # run in-process; roi-modules' and dexter-gateway's simulators are peers on the real wire)
    assert set(registered) == services, f"services registering no transport: {sorted(services - set(registered))}"
    assert {"model", "virtual", "nic"} <= set(registered["ethercat-loop"])
    assert "sim" in registered["can-bootloader"]
    assert {"wifi", "serial"} <= set(registered["epuck-gateway"])
    assert "udp" in registered["roi-modules"]
    assert "tcp" in registered["dexter-gateway"]
    for svc, names in registered.items():
        for name in names:
            factory = load_transport(svc, name)
            assert callable(factory), f"{svc}.{name}"
            assert check_transport(svc, name) == name


def test_each_service_default_names_a_registered_transport():
    from services.dexter_gateway.settings import DexterSettings
    from services.epuck_gateway.settings import EpuckSerialRobot, EpuckWifiRobot
    from services.ethercat_loop.settings import EthercatSettings
    from services.roi_modules.settings import RoiSettings

    assert EthercatSettings.model_fields["backend"].default in transport_names("ethercat-loop")
    assert EthercatSettings(backend="virtual").backend == "virtual"
    assert RoiSettings.model_fields["roi_transport"].default == "udp" in transport_names("roi-modules")
    assert DexterSettings.model_fields["dexter_transport"].default == "tcp" in transport_names("dexter-gateway")
    with pytest.raises(ValueError, match=r"unknown dexter-gateway transport 'tpc' \(did you mean 'tcp'\?\); "
                                         r"registered: tcp"):
        DexterSettings(dexter_transport="tpc")
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


# (service package, the setting, a wrong name, its close match, the registered names) and what else the service
# needs to read its settings: nothing but the transport is wrong
UNKNOWN_AT_START = [
    ("ethercat_loop", "ROBOBUS_ETHERCAT_BACKEND", "modle", "model", "model, nic, virtual", {}),
    ("roi_modules", "ROBOBUS_ROI_TRANSPORT", "upd", "udp", "udp",
     {"ROBOBUS_ROI_NETWORK": "127.0.2", "ROBOBUS_ROI_MODULES": '[{"name": "gpio1", "octet": 10, "type": "gpio"}]'}),
    ("dexter_gateway", "ROBOBUS_DEXTER_TRANSPORT", "tpc", "tcp", "tcp",
     {"ROBOBUS_DEXTER_ARMS": '[{"id": "dexter1", "host": "127.0.0.1", "port": 1}]'}),
]


@pytest.mark.parametrize(("package", "var", "wrong", "close", "registered", "extra"), UNKNOWN_AT_START,
                         ids=[c[0] for c in UNKNOWN_AT_START])
def test_an_unknown_name_in_the_settings_stops_the_service_at_start(package: str, var: str, wrong: str, close: str,
                                                                    registered: str, extra: dict[str, str]):
    """ROBOBUS_ETHERCAT_BACKEND=modle (ROBOBUS_ROI_TRANSPORT=upd, ROBOBUS_DEXTER_TRANSPORT=tpc): one line naming the
    variable and the registered transports, exit 2, before any broker is tried (none runs at the URL given)."""
    env = {**os.environ, **extra, var: wrong, "ROBOBUS_MQTT_URL": "mqtt://127.0.0.1:1"}
    r = subprocess.run([sys.executable, "-m", f"services.{package}"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert var in line and f"registered: {registered}" in line, line
    assert f"did you mean {close!r}" in line, line


def test_a_registered_transport_that_does_not_import_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "services.ethercat_loop.transport.process_backend", None)
    with pytest.raises(TransportUnavailable, match="ethercat-loop transport 'nic' cannot be imported here"):
        load_transport("ethercat-loop", "nic")


def test_roi_and_dexter_report_a_transport_that_does_not_import_as_unavailable(monkeypatch):
    """A registered transport whose module does not import: the service's "cannot run here" (ServiceUnavailable,
    exit 2 at start), the loader's reason in it."""
    from services.dexter_gateway.api import API as DEXTER
    from services.dexter_gateway.service import build as build_dexter
    from services.dexter_gateway.settings import DexterSettings
    from services.roi_modules.api import API as ROI
    from services.roi_modules.service import build as build_roi
    from services.roi_modules.settings import RoiSettings
    from shared import Node, ServiceUnavailable

    monkeypatch.setitem(sys.modules, "services.roi_modules.transport", None)
    monkeypatch.setitem(sys.modules, "services.dexter_gateway.transport", None)
    rs = RoiSettings(roi_network="127.0.2", roi_modules=[{"name": "io", "octet": 10, "type": "gpio"}])
    with pytest.raises(ServiceUnavailable, match="roi-modules transport 'udp' cannot be imported here"):
        build_roi(Node(ROI, rs), rs)
    ds = DexterSettings()
    with pytest.raises(ServiceUnavailable, match="dexter-gateway transport 'tcp' cannot be imported here"):
        build_dexter(Node(DEXTER, ds), ds)


OUT_OF_TREE = '''
"""A transport for ethercat-loop from a package outside the tree: the model backend, marked."""
from services.ethercat_loop.model_backend import model_backend

MADE = []


def factory(settings, hooks):
    backend = model_backend(settings, hooks)
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


OUT_OF_TREE_WIRES = '''
"""Transports for roi-modules and dexter-gateway from a package outside the tree: the registered ones, marked."""
from services.dexter_gateway.transport import tcp_link
from services.roi_modules.transport import udp_transport

MADE = []


def roi(settings, hooks):
    transport = udp_transport(settings, hooks)
    MADE.append(transport)
    return transport


def dexter(settings, hooks):
    link = tcp_link(settings, hooks)
    MADE.append(link)
    return link
'''


def test_a_package_outside_the_tree_adds_a_transport_to_roi_modules_and_dexter_gateway(tmp_path):
    """ROBOBUS_ROI_TRANSPORT / ROBOBUS_DEXTER_TRANSPORT name a transport of another distribution: each service's
    `build()` makes its transport (roi) and each arm's link (dexter) with that factory, not the registered one."""
    from tests.roi_modules.conftest import fresh_prefix

    (tmp_path / "extra_wires.py").write_text(textwrap.dedent(OUT_OF_TREE_WIRES))
    info = tmp_path / "extra_wires-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-wires\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nroi-modules.extra = extra_wires:roi\n"
                                           "dexter-gateway.extra = extra_wires:dexter\n")
    script = textwrap.dedent(f'''
        import extra_wires
        from services.dexter_gateway.api import API as DEXTER
        from services.dexter_gateway.service import build as build_dexter
        from services.dexter_gateway.settings import DexterSettings
        from services.roi_modules.api import API as ROI
        from services.roi_modules.service import build as build_roi
        from services.roi_modules.settings import RoiSettings
        from shared import Node
        from shared.transports import transport_names
        print(transport_names("roi-modules"), transport_names("dexter-gateway"))
        rs = RoiSettings(roi_transport="extra", roi_network="{fresh_prefix()}",
                         roi_modules=[{{"name": "io", "octet": 10, "type": "gpio"}}])
        roi = build_roi(Node(ROI, rs), rs)
        ds = DexterSettings(dexter_transport="extra")
        dexter = build_dexter(Node(DEXTER, ds), ds)
        print(extra_wires.MADE == [roi.transport, dexter.arms[0].link], len(extra_wires.MADE))
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    names, made = r.stdout.splitlines()[:2]
    assert names == "['extra', 'udp'] ['extra', 'tcp']" and made == "True 2", r.stdout


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
            "services.epuck_gateway.transport.wifi", "services.epuck_gateway.transport.serial",
            "services.roi_modules.transport", "services.dexter_gateway.transport"} <= mods
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


# -- no service.py builds a transport itself -------------------------------------------------------------------
def _return_names(factory: object) -> set[str]:
    """The class names in a factory's return annotation (`-> RoiTransport`, `-> list[BootBusSim]`: BootBusSim), or
    the class itself when the factory is one."""
    if isinstance(factory, type):
        return {factory.__name__}
    ann = getattr(factory, "__annotations__", {}).get("return")
    if ann is None:
        return set()
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
    tree = ast.parse(text, mode="eval")
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id[:1].isupper()}


def transport_builders() -> dict[str, str]:
    """{name: what it is} for each registered transport's factory and each class a factory returns: the names a
    service's wiring must not call (it calls the factory `load_transport` gives it)."""
    out: dict[str, str] = {}
    for svc in service_names():
        for name, plugin in transport_plugins(svc).items():
            factory = load_transport(svc, name)
            out[plugin.attr] = f"{svc}.{name}'s factory"  # the name the entry point gives it
            out.update({cls: f"what {svc}.{name}'s factory returns" for cls in _return_names(factory)})
    return out


def builds_a_transport(path: Path, builders: dict[str, str]) -> list[str]:
    """`line: name(...) (why)` for each call in `path` of a name in `builders` (a bare name or an attribute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in builders:
                found.append(f"{node.lineno}: {name}(...) ({builders[name]}: load it by name, shared.transports)")
    return found


def test_no_service_builds_its_transport_in_place():
    builders = transport_builders()
    assert {"udp_transport", "RoiTransport", "tcp_link", "DexterLink", "model_backend", "ModelBackend",
            "wifi_link", "EpuckLink"} <= set(builders), builders
    bad = [f"{f.relative_to(REPO)}:{v}" for f in _service_files() for v in builds_a_transport(f, builders)]
    assert bad == [], "\n".join(bad)


def test_the_construction_rule_catches_a_transport_built_in_place(tmp_path):
    path = tmp_path / "service.py"
    path.write_text(textwrap.dedent('''
        from services.roi_modules import transport

        def build(settings, node):
            t = transport.RoiTransport(settings.config, [10])
            link = DexterLink("arm", settings.link)
            return node, t, link, load_transport("roi-modules", "udp")(settings, [10])
    '''))
    found = builds_a_transport(path, transport_builders())
    assert [f.split(" (")[0] for f in found] == ["5: RoiTransport(...)", "6: DexterLink(...)"], found
