"""dexter-gateway's part of the AsyncAPI document: accepted by the official parser, names unique."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.dexter_gateway.api import API
from shared.tools.asyncapi import build_document, render_yaml

VALIDATOR = Path(__file__).resolve().parents[2] / "tests/contract/asyncapi-validate"
COMMANDS = ("move_all_joints", "move_all_joints_relative", "pid_move_all_joints", "move_to", "move_to_straight",
            "set_parameter", "set_boundaries", "sleep", "heartbeat", "write_fpga", "status_mode", "raw",
            "wait_motion_done", "read_file", "write_file", "run_file", "cancel")


def test_official_parser_accepts_the_dexter_document(tmp_path: Path) -> None:
    if shutil.which("node") is None or not (VALIDATOR / "node_modules").exists():
        pytest.skip("node and tests/contract/asyncapi-validate/node_modules are needed (make test installs them)")
    doc = tmp_path / "dexter.yaml"
    doc.write_text(render_yaml(build_document([API])))
    r = subprocess.run(["node", str(VALIDATOR / "validate.mjs"), str(doc)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["valid"]


def test_document_has_every_command_and_dexter_prefixed_models() -> None:
    doc = build_document()  # every registered service: model names must not clash
    for cmd in COMMANDS:
        assert f"dexter-gateway_cmd_{cmd}" in doc["channels"], cmd
    assert "dexter-gateway_state_status" in doc["channels"]
    kit = set(build_document([])["components"]["schemas"])
    ours = set(build_document([API])["components"]["schemas"]) - kit
    jobs_kit = {"CancelReply", "CancelRequest", "JobAccepted", "JobProgress", "JobResult", "ErrorInfo", "ErrorCode"}
    assert ours and all(name.startswith("Dexter") for name in ours - jobs_kit), sorted(ours)
