"""epuck-gateway's part of the AsyncAPI document: accepted by the official parser, names unique."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.epuck_gateway.api import API
from shared.tools.asyncapi import build_document, render_yaml

VALIDATOR = Path(__file__).resolve().parents[2] / "tests/contract/asyncapi-validate"


def test_official_parser_accepts_the_epuck_document(tmp_path: Path) -> None:
    if shutil.which("node") is None or not (VALIDATOR / "node_modules").exists():
        pytest.skip("node and tests/contract/asyncapi-validate/node_modules are needed (make test installs them)")
    doc = tmp_path / "epuck.yaml"
    doc.write_text(render_yaml(build_document([API])))
    r = subprocess.run(["node", str(VALIDATOR / "validate.mjs"), str(doc)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["valid"]


def test_document_describes_the_image_as_jpeg_and_every_command() -> None:
    doc = build_document()  # every registered service: model names must not clash
    msgs = doc["components"]["messages"]
    assert msgs["epuck-gateway_state_image"]["contentType"] == "image/jpeg"
    for cmd in ("set_speed", "set_steps", "leds", "rgb", "sound", "calibrate_ir", "obstacle_avoidance", "stream",
                "snapshot", "flash", "cancel"):
        assert f"epuck-gateway_cmd_{cmd}" in doc["channels"]
    kit = set(build_document([])["components"]["schemas"])
    ours = set(build_document([API])["components"]["schemas"]) - kit
    kit_jobs = {"JobAccepted", "JobProgress", "JobResult", "CancelRequest", "CancelReply"}  # the kit's, for `flash`
    assert ours and all(name.startswith("Epuck") for name in ours - kit_jobs), sorted(ours)
