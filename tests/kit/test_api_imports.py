"""A service's contract apart from its implementation: whatever reads the contract (the schema export, the CLI,
the dashboard, Home Assistant discovery, the recorder's catalogue) loads each registered service's API module
through shared.registry, and that module imports only the service's models (and their pure protocol codecs) and
the kit's contract modules: never a device library (Pillow, python-can, pyserial, pysoem, numpy), nor a
service's transport, simulator, devices or wiring. Checked in a fresh interpreter, where sys.modules tells."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shared.registry import service_plugins
from tests.fixtures import REPO

# the check, run in the fresh interpreter after the import under test: what it pulled that it must not
_CHECK = r"""
import json, sys
FORBIDDEN_TOP = {"PIL", "can", "serial", "serial_asyncio", "pysoem", "numpy"}
CONTRACT_ROOMS = {"api", "models", "protocol"}  # what a service's API module may bring in of its package
bad = []
for name in sorted(sys.modules):
    parts = name.split(".")
    if parts[0] in FORBIDDEN_TOP:
        if len(parts) == 1:
            bad.append(name)
    elif parts[0] == "services" and len(parts) >= 3 and parts[2] not in CONTRACT_ROOMS:
        bad.append(name)
print("RESULT " + json.dumps(bad))
"""


def _run(body: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_")}
    r = subprocess.run([sys.executable, "-c", body + _CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    bad: list[str] = json.loads(line.removeprefix("RESULT "))
    return bad


def test_every_entry_point_names_an_api_module() -> None:
    plugins = service_plugins()
    assert plugins
    for p in plugins:
        assert p.module.endswith(".api") and p.attr == "API", f"{p.name} = {p.module}:{p.attr}"


def test_every_api_module_imports_no_implementation() -> None:
    bad = _run("from shared.registry import service_apis\napis = service_apis()\nassert len(apis) >= 5\n")
    assert bad == [], f"reading the contracts imported implementation modules: {bad}"


def test_each_api_module_alone_imports_no_implementation() -> None:
    # one interpreter per service: a service's API module must not lean on what another one happened to import
    for p in service_plugins():
        bad = _run(f"import importlib\nimportlib.import_module({p.module!r}).{p.attr}\n")
        assert bad == [], f"{p.module} imported implementation modules: {bad}"


def test_the_dashboard_reads_the_contract_without_implementation() -> None:
    # `robobus dashboard` as the CLI runs it, up to the server: its sub-command found through the registry, the
    # document built from every service's contract; the server itself is replaced by one that records the
    # document and stops (no port, no thread)
    body = r"""
import importlib
from shared.registry import cli_plugins
plugin = next(p for p in cli_plugins() if p.name == "dashboard")
fn = plugin.load()
mod = importlib.import_module(plugin.module)

class Built(Exception):
    pass

class FakeServer:
    def __init__(self, document, *args, **kwargs):
        raise Built(sorted(document.get("channels", {})))

mod.DashboardServer = FakeServer
try:
    fn(host="127.0.0.1", port=0, ws_url=None, root="robobus")
except Built as done:
    assert len(done.args[0]) > 10, done.args
else:
    raise SystemExit("the dashboard did not build its document")
"""
    bad = _run(body)
    assert bad == [], f"the dashboard imported implementation modules: {bad}"
