"""The rooms of ethercat-loop: no import cycles, the codec pure, the transport and the simulator
independent of the MQTT surface, logging under `robobus.*` and configured only by the kit."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "services" / "ethercat_loop"
PREFIX = "services.ethercat_loop"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module of the package this file imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if (PKG.parent.parent / Path(*full.split("."))).with_suffix(".py").exists() else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith(PREFIX)}


GRAPH = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(GRAPH.get(m, ())):
            if dep == m or dep not in GRAPH:
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep] if dep in stack else [m, dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if state.get(dep) is None:
                visit(dep, [*stack, dep])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("module,forbidden", [
    ("protocol", ("transport", "sim", "service", "models", "driver")),  # the codec is pure
    ("driver", ("transport", "sim", "service", "models")),
    ("control", ("driver", "transport", "sim", "service")),
    ("palm_model", ("transport", "sim", "service", "driver")),
])
def test_pure_rooms_import_no_io(module: str, forbidden: tuple[str, ...]) -> None:
    deps = GRAPH[f"{PREFIX}.{module}"]
    bad = [d for d in deps if any(d == f"{PREFIX}.{f}" or d.startswith(f"{PREFIX}.{f}.") for f in forbidden)]
    assert not bad, f"{module} imports {bad}"


def test_transport_and_sim_know_nothing_of_the_mqtt_surface() -> None:
    for m, deps in GRAPH.items():
        if m.startswith((f"{PREFIX}.transport", f"{PREFIX}.sim")):
            assert f"{PREFIX}.service" not in deps, m
        if m.startswith(f"{PREFIX}.transport"):  # the I/O never reaches for the simulator
            assert not any(d.startswith(f"{PREFIX}.sim") for d in deps), f"{m} imports {deps}"


def test_logging_is_the_kits_and_named_under_robobus() -> None:
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        assert "basicConfig" not in text, f"{p.name} configures logging itself (the kit's setup_logging does)"
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                assert str(node.args[0].value).startswith("robobus."), f"{p.name}: logger {node.args[0].value!r}"
