"""robobus's version is written once, in pyproject.toml, and read from the installed package's metadata in one
place (shared/__init__.py): the node's status, the AsyncAPI document, Home Assistant's discovery and the
recorder's metadata all take it from there."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import shared

REPO = Path(__file__).resolve().parents[2]


def test_the_version_is_the_installed_metadata_and_pyproject() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert shared.__version__ == importlib.metadata.version("robobus") == declared


def test_the_version_is_written_nowhere_else_and_imported_at_module_level() -> None:
    literal = re.compile(r"""^(__version__|VERSION|ROBOBUS_VERSION)\s*(:\s*str\s*)?=\s*["']\d+\.\d+""", re.M)
    reads, late, written = [], [], []
    for root in ("shared", "services"):
        for path in sorted((REPO / root).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            text = path.read_text()
            rel = path.relative_to(REPO).as_posix()
            if literal.search(text):
                written.append(rel)
            if 'version("robobus")' in text:
                reads.append(rel)
            tree = ast.parse(text)
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if (isinstance(node, ast.ImportFrom) and node.module == "shared" and not node.level
                        and any(a.name == "__version__" for a in node.names) and id(node) not in top):
                    late.append(f"{rel}:{node.lineno}")
    assert written == [], f"a version literal outside pyproject.toml: {written}"
    assert reads == ["shared/__init__.py"], reads
    assert late == [], f"`from shared import __version__` inside a function (an import circle dodged): {late}"


def test_every_user_of_the_version_follows_the_metadata(tmp_path: Path) -> None:
    """A fresh interpreter that finds robobus 9.8.7's metadata first: the package, a node's status and the
    AsyncAPI document all say 9.8.7."""
    dist = tmp_path / "meta" / "robobus-9.8.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: robobus\nVersion: 9.8.7\n")
    code = (
        "import shared\n"
        "from shared import KitSettings, Node, ServiceAPI\n"
        "from shared.tools.asyncapi import build_document\n"
        "node = Node(ServiceAPI(service='vtest'), KitSettings())\n"
        "print(shared.__version__, node.version, node._status(True).version, build_document([])['info']['version'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "meta"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["9.8.7"] * 4, out.stdout
