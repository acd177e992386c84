"""The AsyncAPI document: current, valid for the official parser, and true to what nodes publish."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from shared import Node
from shared.registry import service_names, service_plugins
from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import ContractValidator, build_document, discover_apis, render_yaml, write_docs
from tests.fixtures import Broker
from tests.kit.echo_node import API as ECHO_API
from tests.kit.echo_node import build

REPO = Path(__file__).resolve().parents[2]
VALIDATOR = REPO / "tests/contract/asyncapi-validate"


def test_committed_document_is_current() -> None:
    committed = (REPO / "docs/asyncapi.yaml").read_text()
    assert committed == render_yaml(build_document()), "docs/asyncapi.yaml is stale: run `make schema`"


def test_committed_schemas_are_current(tmp_path: Path) -> None:
    write_docs(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "schemas").glob("*.json"))
    committed = sorted(p.name for p in (REPO / "docs/schemas").glob("*.json"))
    assert fresh == committed, "docs/schemas is stale: run `make schema`"
    for name in fresh:
        assert (tmp_path / "schemas" / name).read_text() == (REPO / "docs/schemas" / name).read_text(), name


def _parse(doc_path: Path) -> dict:
    if shutil.which("node") is None or not (VALIDATOR / "node_modules").exists():
        pytest.skip("node and tests/contract/asyncapi-validate/node_modules are needed (make test installs them)")
    r = subprocess.run(["node", str(VALIDATOR / "validate.mjs"), str(doc_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_official_parser_accepts_the_committed_document() -> None:
    summary = _parse(REPO / "docs/asyncapi.yaml")
    assert summary["valid"] and summary["errors"] == 0
    assert summary["channels"] >= 3 and summary["operations"] >= 3


def test_official_parser_accepts_a_document_with_jobs_and_streams(tmp_path: Path) -> None:
    # The echo test API has commands, a job (with the kit's job events and cancel) and state.
    doc = tmp_path / "echo.yaml"
    doc.write_text(render_yaml(build_document([ECHO_API])))
    assert _parse(doc)["valid"]


def test_every_service_package_is_registered_and_discovered() -> None:
    # every services/<pkg>/service.py declares an API; each must be a `robobus.services` entry point
    packages = {p.parent.name for p in (REPO / "services").glob("*/service.py")}
    apis = discover_apis()
    declared = {p.module.split(".")[1] for p in service_plugins()}
    assert declared == packages
    assert sorted(a.service for a in apis) == service_names()


def test_everything_the_echo_node_publishes_validates(broker_session: Broker, client: RpcClient) -> None:
    validator = ContractValidator(build_document([ECHO_API]))
    node = Node(ECHO_API, broker_session.settings(node="contract1", health_interval_s=0.2))
    stop = build(node)
    seen: list[tuple[str, bytes]] = []
    expected = {"status", "health", "nodeStats", "echo-test_state_counter", "echo-test_event_tick",
                "echo-test_event_job_progress", "echo-test_event_job_result"}

    found: set[str] = set()
    checked = [0]

    def channels() -> set[str]:
        """Every message seen so far validated (each once), and the channels they were on."""
        batch = seen[checked[0]:]
        checked[0] += len(batch)
        found.update(validator.validate(t, p) for t, p in batch if not t.endswith("/reply"))
        return found

    client.subscribe_before("robobus/contract1/#", lambda m: seen.append((m.topic, bytes(m.payload))))
    node.start()
    assert node.session.wait_ready(10)
    try:
        client.call("contract1", "dev1", "echo", {"text": "x"})
        client.call_job("contract1", "dev1", "count", {"n": 5}, lambda e: None)
        client.call("contract1", "dev1", "boom", {})
        # heartbeats, node stats, counter state and a tick event (every 100th count of a 100 Hz counter: about a
        # second on a quiet host, longer on a busy one, hence a deadline rather than a fixed sleep)
        wait_for(lambda: expected <= channels(), timeout=20, interval=0.1)
    finally:
        stop.set()
        node.stop()
    time.sleep(0.3)
    assert expected <= channels()
