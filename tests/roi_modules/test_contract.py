"""roi-modules' part of the AsyncAPI document: accepted by the official parser, names unique and prefixed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.roi_modules.api import API
from shared import messages
from shared.tools.asyncapi import build_document, render_yaml

VALIDATOR = Path(__file__).resolve().parents[2] / "tests/contract/asyncapi-validate"


def test_official_parser_accepts_the_roi_document(tmp_path: Path) -> None:
    if shutil.which("node") is None or not (VALIDATOR / "node_modules").exists():
        pytest.skip("node and tests/contract/asyncapi-validate/node_modules are needed (make test installs them)")
    doc = tmp_path / "roi.yaml"
    doc.write_text(render_yaml(build_document([API])))
    r = subprocess.run(["node", str(VALIDATOR / "validate.mjs"), str(doc)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["valid"]


def test_document_has_every_command_job_and_state() -> None:
    doc = build_document()  # every registered service: model names must not clash
    for name in ("set_pin_output", "set_pin_mode", "goto_position", "goto_relative_position", "set_velocity",
                 "set_torque", "clear_errors", "queue_general_packet", "queue_sysadmin_packet", "ping",
                 "status_report", "blacklist", "go_to_position", "go_to_relative_position", "cancel"):
        assert f"roi-modules_cmd_{name}" in doc["channels"], name
    for name in ("pin_states", "pin_values", "state", "power", "temperature", "link"):
        assert f"roi-modules_state_{name}" in doc["channels"], name
    kit = set(build_document([])["components"]["schemas"])
    ours = set(build_document([API])["components"]["schemas"]) - kit
    kit_models = {n for n in dir(messages) if isinstance(getattr(messages, n), type)}  # the kit's job models
    assert ours and all(name.startswith("Roi") or name in kit_models for name in ours), sorted(ours)
