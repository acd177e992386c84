"""Services talk to one another over MQTT only: no module of services/<a>/ imports services.<b> (b != a). A
client of another service's wire (ethercat-loop's CAN-bridge client for python-can) lives with the service it
talks to, and what it needs of a contract comes from that service's own package."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures import REPO


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
