"""What `make run`'s dashboard process loads (deploy/Procfile.sim starts it as `python -m shared.tools.dashboard`):
the dashboard's own command, never the rest of the `robobus` CLI (its other sub-commands' modules: the services'
CLIs, rich's tables) nor YAML; all of it would stay resident in an idle server. Checked in a fresh interpreter
running the module as `python -m` does, up to the moment its server would start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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
