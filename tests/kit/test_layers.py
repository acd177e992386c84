"""The layers inside shared/: the kit (shared/*.py), the MQTT layer (shared/mqtt/) and the tools (shared/tools/).

The rule, checked on every import statement of every module (module level, function level, under
TYPE_CHECKING, relative imports resolved, and `importlib.import_module("<constant>")`):

- the kit never imports the tools nor any service;
- the MQTT layer never imports the tools, any service, nor the kit (`shared` itself or any `shared.<module>`
  outside `shared.mqtt`).

By construction (`test_the_rule_catches_a_new_forbidden_import`): a copy of shared/ in which node.py gains
`from shared.tools.cli import main` inside a function, stop.py `import services.roi_modules.service`, and
mqtt/session.py `from shared.settings import KitSettings` and `from .. import Node` gives exactly those
four findings, so an import like these added to the real tree fails `test_the_kit_and_the_mqtt_layer_keep_their_rule`.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / "shared"


def _module_name(root: Path, path: Path) -> str:
    """`shared.mqtt.session` for <root>/shared/mqtt/session.py (`shared.mqtt` for its __init__.py)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module `path` imports, anywhere in it: (line, dotted name). `from a import b` gives `a.b` (b may be a
    module or a name in a: the rules below treat both as reaching into `a`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.append((node.lineno, node.args[0].value))
    return out


def _layer(name: str) -> str | None:
    """The layer a dotted name belongs to: tools, mqtt, kit, service, or None (outside robobus)."""
    if name == "services" or name.startswith("services."):
        return "service"
    if name == "shared.tools" or name.startswith("shared.tools."):
        return "tools"
    if name == "shared.mqtt" or name.startswith("shared.mqtt."):
        return "mqtt"
    if name == "shared" or name.startswith("shared."):
        return "kit"
    return None


FORBIDDEN = {"kit": {"tools", "service"}, "mqtt": {"tools", "service", "kit"}}


def violations(shared_dir: Path) -> list[str]:
    """`path:line: <layer> imports <name> (<its layer>)` for every import against the rule, in shared_dir."""
    found = []
    for path in sorted(shared_dir.rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        module = _module_name(shared_dir, path)
        layer = _layer(module)
        if layer not in FORBIDDEN:
            continue
        for line, name in imported_names(path, module):
            target = _layer(name)
            if target in FORBIDDEN[layer]:
                found.append(f"{path.relative_to(shared_dir.parent)}:{line}: {layer} imports {name} ({target})")
    return found


def test_the_kit_and_the_mqtt_layer_keep_their_rule() -> None:
    found = violations(SHARED)
    assert found == [], "imports against the layers of shared/ (tests/kit/test_layers.py):\n  " + "\n  ".join(found)


def test_every_module_of_shared_is_in_a_layer() -> None:
    """A new subpackage of shared/ is placed on purpose (the rule above knows three rooms)."""
    packages = {p.parent.relative_to(SHARED).as_posix() for p in SHARED.rglob("__init__.py")
                if "node_modules" not in p.parts}
    assert packages == {".", "mqtt", "tools", "tools/dashboard", "tools/foxglove", "tools/prometheus"}, packages


def test_the_rule_catches_a_new_forbidden_import(tmp_path: Path) -> None:
    copy = tmp_path / "shared"
    shutil.copytree(SHARED, copy, ignore=shutil.ignore_patterns("node_modules", "__pycache__", "static"))
    assert violations(copy) == []

    def add(rel: str, code: str) -> None:
        p = copy / rel
        p.write_text(p.read_text() + "\n" + textwrap.dedent(code))

    def line_of(rel: str, text: str) -> int:
        return next(i for i, ln in enumerate((copy / rel).read_text().splitlines(), 1) if ln.strip() == text)

    add("node.py", """
        def _late() -> None:
            from shared.tools.cli import main
            main()
        """)
    add("stop.py", "import services.roi_modules.service\n")
    add("mqtt/session.py", """
        from shared.settings import KitSettings
        from .. import Node
        """)
    at_node = line_of("node.py", "from shared.tools.cli import main")
    at_stop = line_of("stop.py", "import services.roi_modules.service")
    at_session = line_of("mqtt/session.py", "from shared.settings import KitSettings")
    assert violations(copy) == [
        f"shared/mqtt/session.py:{at_session}: mqtt imports shared.settings.KitSettings (kit)",
        f"shared/mqtt/session.py:{at_session + 1}: mqtt imports shared.Node (kit)",
        f"shared/node.py:{at_node}: kit imports shared.tools.cli.main (tools)",
        f"shared/stop.py:{at_stop}: kit imports services.roi_modules.service (service)",
    ]


def test_importing_the_kit_and_the_mqtt_layer_loads_no_tool_and_no_service() -> None:
    """The same rule at run time, in a fresh interpreter: every kit and MQTT-layer module imported, then neither
    shared.tools nor services is in sys.modules (and the MQTT layer alone loads no kit module)."""
    kit = sorted(_module_name(SHARED, p) for p in SHARED.glob("*.py"))
    mqtt = sorted(_module_name(SHARED, p) for p in (SHARED / "mqtt").glob("*.py"))
    code = textwrap.dedent(f"""
        import importlib, sys
        for m in {mqtt!r}:
            importlib.import_module(m)
        kit = sorted(m for m in sys.modules if m.startswith("shared.") and not m.startswith("shared.mqtt"))
        print("mqtt-loaded-kit", kit)
        for m in {kit!r}:
            importlib.import_module(m)
        bad = sorted(m for m in sys.modules if m.startswith(("shared.tools", "services")) or m == "services")
        print("kit-loaded", bad)
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mqtt-loaded-kit []" in out.stdout, out.stdout
    assert "kit-loaded []" in out.stdout, out.stdout
