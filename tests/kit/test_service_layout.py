"""Services talk to one another over MQTT only: no module of services/<a>/ imports services.<b> (b != a). A
client of another service's wire (ethercat-loop's CAN-bridge client for python-can) lives with the service it
talks to, and what it needs of a contract comes from that service's own package.

Where a service's devices have a module of their own (found, for every registered service, as the modules of its
package beside service.py that hold device code: `device_modules()`), that module is `device.py` in every service,
`service.py` holds no device code (no handler, no `bind_all`, no `node.device(...)`), and the device module does not
import its `service.py`, a simulator or a transport's module, nor builds a transport itself (it calls what the
service hands it: the factory the service loaded by name, tests/kit/test_transports.py). A service with one small
device keeps it in service.py."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from shared.registry import service_packages
from tests.fixtures import REPO
from tests.kit.test_layers import imported_names


def _imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_service_imports_another() -> None:
    # services talk over MQTT only: no module of services/<a>/ imports services.<b> (b != a)
    crossings = []
    for path in sorted((REPO / "services").rglob("*.py")):
        rel = path.relative_to(REPO / "services")
        if len(rel.parts) < 2:
            continue
        own = rel.parts[0]
        for mod in _imports_of(path):
            parts = mod.split(".")
            if parts[0] == "services" and len(parts) >= 2 and parts[1] != own:
                crossings.append(f"services/{rel} imports {mod}")
    assert crossings == []


_HANDLER_MARKS = {"handles", "runs"}


def _device_code(path: Path) -> list[str]:
    """`line: what` for each handler mark (`@handles`, `@runs`), `bind_all(...)` and `.device(...)` call in
    `path`: what makes a class a device class."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in _HANDLER_MARKS:
                    found.append(f"{dec.lineno}: @{name} on {node.name}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("bind_all", "device")):
            found.append(f"{node.lineno}: .{node.func.attr}(...)")
    return found


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin, package
    return Path(spec.origin).parent


def device_modules() -> dict[str, tuple[str, Path, list[str]]]:
    """service -> (its package, the package's folder, the modules beside service.py that hold device code: its
    device modules, relative to the folder; none for a service whose one small device is in service.py)."""
    out = {}
    for svc, package in service_packages().items():
        folder = package_dir(package)
        found = [str(f.relative_to(folder)) for f in sorted(folder.rglob("*.py"))
                 if (f.name != "service.py" or f.parent != folder) and _device_code(f)]
        out[svc] = (package, folder, found)
    return out


# the services whose devices live in a module of their own, as this tree has them (the rule's own check)
EXPECTED_HERE = {"roi-modules": ["device.py"], "dexter-gateway": ["device.py"], "epuck-gateway": ["device.py"]}
DEVICE_MODULE = "device.py"  # the one name of the room (docs/kit.md), the same in every service


def test_device_classes_live_outside_service_py() -> None:
    modules = device_modules()
    assert {s: m for s, (_, _, m) in modules.items() if m and s in EXPECTED_HERE} == EXPECTED_HERE
    for svc, (package, folder, found) in modules.items():
        in_service = _device_code(folder / "service.py") if (folder / "service.py").exists() else []
        if not found:
            assert in_service, (f"{svc}: no module of {package} makes a device (node.device(...)), binds handlers "
                                "(@handles / @runs, bind_all): put the device classes in a device module beside "
                                "service.py (docs/kit.md, the rooms of a service)")
            continue
        assert found == [DEVICE_MODULE], (f"{package}: device code in {found}: the device module is "
                                          f"{DEVICE_MODULE} beside service.py (docs/kit.md, the rooms of a service)")
        assert in_service == [], f"{package}.service holds device code (move it to {found}): {in_service}"
        for module in found:
            in_module = _device_code(folder / module)
            assert any("@handles" in f for f in in_module), f"{package}: {module} binds no handler"
            assert any(".bind_all(" in f for f in in_module), f"{package}: {module} calls no bind_all"


def test_device_modules_do_not_reach_back_into_the_service() -> None:
    # the narrow context: a device module never imports its service.py (nor a simulator nor a transport's module,
    # test_transports.py's rule for service.py), nor builds a transport in place (test_transports.py's rule too)
    from tests.kit.test_transports import _transport_modules, builds_a_transport, forbidden_imports, transport_builders

    transports = _transport_modules()
    builders = transport_builders()
    bad = []
    for package, folder, found in device_modules().values():
        for module in found:
            path = folder / module
            name = f"{package}.{module.removesuffix('.py').replace('/', '.')}"
            own = f"{package}.service"
            bad += [f"{name}:{line}: {mod}" for line, mod in imported_names(path, name)
                    if mod == own or mod.startswith(f"{own}.")]
            bad += [f"{name}:{v}" for v in forbidden_imports(path, name, transports)]
            bad += [f"{name}:{v}" for v in builds_a_transport(path, builders)]
    assert bad == []
