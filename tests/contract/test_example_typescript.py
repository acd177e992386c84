"""examples/typescript runs: its models generated from the document the services produce now, compiled
with `tsc --strict`, and the client run against the stack (broker + e-puck simulator + gateway)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.tools.asyncapi import build_document, render_yaml
from tests.contract.conftest import CAN_NODE, EPUCK_NODE, ROBOT, Stack

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/typescript"
MODELINA = REPO / "tests/contract/modelina"
TIMEOUT_S = 300  # generous: 2 cores shared with other work (generation ~5 s of CPU, tsc ~3 s, the run ~2 s)
pytestmark = pytest.mark.timeout(3 * TIMEOUT_S)


def test_typescript_example_client_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    if shutil.which("node") is None or not (EXAMPLE / "node_modules/mqtt").exists() \
            or not (MODELINA / "node_modules/@asyncapi/modelina").exists():
        pytest.skip("node and the npm packages of examples/typescript and tests/contract/modelina are needed "
                    "(`make setup` installs them)")
    work = tmp_path / "example"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("node_modules", "dist", "models"))
    (work / "node_modules").symlink_to(EXAMPLE / "node_modules")
    doc = tmp_path / "asyncapi.yaml"
    doc.write_text(render_yaml(build_document()))
    gen = subprocess.run(["node", str(MODELINA / "generate.mjs"), str(doc), "typescript", str(work / "src/models")],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert gen.returncode == 0 and json.loads(gen.stdout.splitlines()[-1])["anonymous"] == [], gen.stdout + gen.stderr
    build = subprocess.run([str(EXAMPLE / "node_modules/.bin/tsc"), "-p", str(work)], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert build.returncode == 0, build.stdout + build.stderr

    run = subprocess.run(["node", str(work / "dist/client.js"), "--url", stack.url, "--timeout-ms", "20000"],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr + "\n" + stack.output()
    print(run.stdout)  # shown on failure, and with -s
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes[EPUCK_NODE] == {"node": EPUCK_NODE, "service": "epuck-gateway", "online": True}
    assert nodes[CAN_NODE]["online"] is True
    assert summary["device"] == ROBOT and summary["sensors_seq"] >= 0
    assert summary["set_speed"] == {"left_speed": 200, "right_speed": -200}
    assert summary["errors"] == {"out_of_range": "invalid_request", "unknown_device": "not_found"}
    assert summary["stopped"] == {"left_speed": 0, "right_speed": 0}
    assert f"node {EPUCK_NODE} (epuck-gateway" in run.stdout
