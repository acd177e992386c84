"""What `make run`'s processes load, each checked in a fresh interpreter: the dashboard (deploy/Procfile.sim starts
it as `python -m shared.tools.dashboard`) its own command, never the rest of the `robobus` CLI (its other
sub-commands' modules: the services' CLIs, rich's tables) nor YAML, up to the moment its server would start; a
service's entry module no CLI library, no numpy and nothing the kit needs only on an error path (difflib). All of
it would stay resident in an idle process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from shared.registry import service_plugins
from shared.tools.localbroker import REPO, free_port

_PROBE = r"""
import json, runpy, sys
from shared.tools.dashboard import server

def started(self):
    print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
    raise SystemExit(0)

server.DashboardServer.start = started
sys.argv = ["python -m shared.tools.dashboard", "--port", "0"]
runpy.run_module("shared.tools.dashboard", run_name="__main__", alter_sys=True)
"""


def test_the_procfile_starts_the_dashboard_module() -> None:
    procfile = (REPO / "deploy" / "Procfile.sim").read_text()
    line = next(ln for ln in procfile.splitlines() if ln.startswith("dashboard:"))
    assert re.match(r"dashboard: python -m shared\.tools\.dashboard --port ", line), line


def test_the_dashboard_module_serves_without_the_rest_of_the_cli() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_")}
    env["ROBOBUS_MQTT_URL"] = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens: the relay connects per page
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "robobus dashboard: http://127.0.0.1:" in out.stdout, out.stdout
    modules = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("MODULES "))[8:])
    loaded = set(modules)
    assert "shared.tools.dashboard.cli" in loaded
    other_commands = sorted(m for m in loaded if m.split(".")[0] in ("shared", "services") and m.endswith(".cli")
                            and m != "shared.tools.dashboard.cli")
    assert other_commands == [], other_commands
    assert not {"shared.tools.cli", "shared.tools.record_cli", "shared.tools.fleet_watch"} & loaded
    assert "yaml" not in loaded and "rich.table" not in loaded


def test_each_service_entry_module_loads_no_cli_numpy_or_error_path_module() -> None:
    for plugin in service_plugins():
        package = plugin.module.rsplit(".", 1)[0]
        probe = f"import json, sys\nimport {package}.__main__\nprint('MODULES ' + json.dumps(sorted(sys.modules)))\n"
        out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_")})
        assert out.returncode == 0, out.stderr[-3000:]
        loaded = set(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("MODULES "))[8:]))
        unwanted = sorted(loaded & {"typer", "rich", "click", "numpy", "difflib", "shared.tools.cli"})
        assert unwanted == [], f"{package}: {unwanted}"
