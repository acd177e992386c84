"""The document as generic AsyncAPI tools read it, not only robobus's own code:

- a topic matcher on the official parser's channel model (tests/contract/asyncapi-validate/match.mjs: an
  address parameter is one topic level, as MQTT's `+`) finds a channel for every message on the wire,
  replies on `{root}/_client/<id>/reply` and on `<command topic>/reply` included, and the payload is one of
  that channel's messages;
- a multi-level root (`site1/robobus`) matches the document made for that root (`build_document(root=...)`,
  `robobus schema --root`, `make schema ROOT=...`, the dashboard's /api/asyncapi.json);
- every channel gives its QoS as a number;
- Modelina's DEFAULT TypeScript and Java generators (no options, no presets) give code that compiles;
- the document's AsyncAPI version is the newest that both the parser and Modelina read."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared import Node
from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import ASYNCAPI_VERSION, build_document, render_yaml
from shared.tools.localbroker import NodeProcess
from tests.contract.conftest import CAN_NODE, EPUCK_NODE, ROBOT, Stack
from tests.fixtures import Broker
from tests.kit.echo_node import API as ECHO_API
from tests.kit.echo_node import build

REPO = Path(__file__).resolve().parents[2]
VALIDATOR = REPO / "tests/contract/asyncapi-validate"
MODELINA = REPO / "tests/contract/modelina"
ROOT = "site1/robobus"
TIMEOUT_S = 300  # generous: 2 cores shared with other work
pytestmark = pytest.mark.timeout(3 * TIMEOUT_S)


def _need(path: Path) -> None:
    if shutil.which("node") is None or not path.exists():
        pytest.skip(f"node and {path.relative_to(REPO)} are needed (`make setup` installs them)")


def match(doc: dict[str, Any], messages: list[tuple[str, bytes]], tmp_path: Path) -> list[dict[str, Any]]:
    """match.mjs on `doc`: per message, the channels whose address matches its topic and the
    channel/message ids its payload is valid for."""
    _need(VALIDATOR / "node_modules/@asyncapi/parser")
    doc_file = tmp_path / f"doc-{uuid.uuid4().hex[:8]}.yaml"
    doc_file.write_text(render_yaml(doc))
    msgs = tmp_path / f"messages-{uuid.uuid4().hex[:8]}.json"
    msgs.write_text(json.dumps([{"topic": t, "payload": p.decode("utf-8", "replace")} for t, p in messages]))
    r = subprocess.run(["node", str(VALIDATOR / "match.mjs"), str(doc_file), str(msgs)], capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    results: list[dict[str, Any]] = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    return results


def test_replies_on_both_reply_topics_are_documented_for_a_generic_tool(stack: Stack, tmp_path: Path) -> None:
    """Replies of the running services, to a request with a Response Topic (robobus's `{root}/_client/<id>/reply`)
    and to one without (`<command topic>/reply`), an ok reply and an error reply each."""
    tap = stack.tap("generic-replies")
    try:
        mine = f"robobus/_client/{tap.name}/reply"
        set_speed = f"robobus/{EPUCK_NODE}/{ROBOT}/cmd/set_speed"
        read_version = f"robobus/{CAN_NODE}/motors/cmd/read_version"
        for t in (mine, f"{set_speed}/reply", f"{read_version}/reply"):
            tap.subscribe(t)
        tap.publish(set_speed, b'{"left": 0, "right": 0}', response_topic=mine, correlation=b"c1")
        tap.publish(set_speed, b'{"left": 9999, "right": 0}', response_topic=mine, correlation=b"c2")
        tap.publish(set_speed, b'{"left": 0, "right": 0}')
        tap.publish(read_version, b"not json")
        tap.wait(mine, 2, 20)
        tap.wait(f"{set_speed}/reply", 1, 20)
        tap.wait(f"{read_version}/reply", 1, 20)
        replies = [(s.topic, s.payload) for s in list(tap.seen)]
    finally:
        tap.close()
    assert {json.loads(p)["ok"] for t, p in replies if t == mine} == {True, False}
    results = match(build_document(), replies, tmp_path)
    for r in results:
        assert r["channels"], f"{r['topic']}: no channel of the document has a matching address"
        assert r["valid"], f"{r['topic']}: the payload is none of the channel's messages"
    by_topic = {r["topic"]: r for r in results}
    assert by_topic[mine]["channels"] == ["clientReply"]
    assert f"clientReply/{EPUCK_NODE}_cmd_set_speed_reply" in by_topic[mine]["valid"]
    assert by_topic[f"{set_speed}/reply"]["valid"] == [f"{EPUCK_NODE}_cmd_set_speed_reply/"
                                                        f"{EPUCK_NODE}_cmd_set_speed_reply"]
    assert by_topic[f"{read_version}/reply"]["channels"] == [f"{CAN_NODE}_cmd_read_version_reply"]


def test_reply_channels_have_addresses_and_the_runtime_reply_keeps_its_own(tmp_path: Path) -> None:
    doc = build_document()
    ch = doc["channels"]
    assert ch["epuck-gateway_cmd_set_speed_reply"]["address"] == "{root}/{node}/{device}/cmd/set_speed/reply"
    assert set(ch["epuck-gateway_cmd_set_speed_reply"]["parameters"]) == {"root", "node", "device"}
    assert ch["clientReply"]["address"] == "{root}/_client/{client}/reply"
    assert set(ch["clientReply"]["parameters"]) == {"root", "client"}
    replies = {cid for cid, c in ch.items() if cid.endswith("_reply") and c["x-robobus"]["kind"] == "reply"}
    assert replies and replies == set(ch["clientReply"]["messages"]) == set(ch["responseTopic"]["messages"])
    # AsyncAPI: a reply with an `address` names a channel whose address is null
    op = doc["operations"]["epuck-gateway_cmd_set_speed"]["reply"]
    assert op["address"]["location"] == "$message.header#/responseTopic"
    assert op["channel"] == {"$ref": "#/channels/responseTopic"} and ch["responseTopic"]["address"] is None
    assert op["messages"] == [{"$ref": "#/channels/responseTopic/messages/epuck-gateway_cmd_set_speed_reply"}]


def test_every_channel_gives_its_qos_as_a_number() -> None:
    for make in (build_document, lambda: build_document(root=ROOT)):
        for cid, ch in make()["channels"].items():
            qos = ch["x-robobus"]["qos"]
            assert type(qos) is int and qos in (0, 1, 2), f"{cid}: qos {qos!r}"
            if ch["x-robobus"]["kind"] == "reply":
                assert qos == 1, cid  # the request's QoS, at most 1; the description says so
                assert "the request's QoS" in ch["description"], cid


def test_a_multi_level_root_matches_the_document_made_for_it(broker_session: Broker, tmp_path: Path) -> None:
    """Everything an echo node under `site1/robobus` publishes, and the replies to a client there, matched by the
    generic matcher: against the document for that root every message has its channel and is valid; against
    the generic document (`{root}`, one level) none has."""
    node = Node(ECHO_API, broker_session.settings(node="generic1", topic_root=ROOT, health_interval_s=0.2))
    stop = build(node)
    rpc = RpcClient(broker_session.settings(topic_root=ROOT), name="generic-root")
    rpc.connect()
    seen: list[tuple[str, bytes]] = []
    rpc.subscribe_before(f"{ROOT}/#", lambda m: seen.append((m.topic, bytes(m.payload))))
    node.start()
    try:
        assert node.session.wait_ready(10)
        rpc.call("generic1", "dev1", "echo", {"text": "x"})
        rpc.call_job("generic1", "dev1", "count", {"n": 3}, lambda e: None)
        assert not rpc.call("generic1", "dev1", "echo", {"text": 5}).ok  # an error reply
        rpc.session.publish(f"{ROOT}/generic1/dev1/cmd/echo", b'{"text": "plain"}', qos=1, now=True)
        assert wait_for(lambda: any(t.endswith("/cmd/echo/reply") for t, _ in list(seen)), 20)
        time.sleep(1.0)  # heartbeats, node stats and a tick event
    finally:
        stop.set()
        node.stop()
        rpc.close()
    msgs = [(t, p) for t, p in list(seen) if p]
    kinds = {t.split("/")[-1] for t, _ in msgs}
    assert {"status", "health", "stats", "reply"} <= kinds, kinds
    assert any("/_client/" in t for t, _ in msgs) and any(t.endswith("/cmd/echo/reply") for t, _ in msgs)

    rooted = build_document([ECHO_API], root=ROOT)
    assert all(c["address"] is None or c["address"].startswith(f"{ROOT}/") for c in rooted["channels"].values())
    assert all("root" not in c.get("parameters", {}) for c in rooted["channels"].values())
    for (_, payload), r in zip(msgs, match(rooted, msgs, tmp_path), strict=True):
        assert r["channels"], r
        assert bool(r["valid"]) is (payload != b'{"text": 5}'), r  # that request is the invalid one sent
    assert not [r for r in match(build_document([ECHO_API]), msgs, tmp_path) if r["channels"]]


def test_a_root_with_a_wildcard_or_an_empty_level_is_refused() -> None:
    for bad in ("site1/+", "a//b", "#", "", "/robobus", "{root}"):
        with pytest.raises(ValueError, match="topic root"):
            build_document(root=bad)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.tools.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=TIMEOUT_S, env={**os.environ, **(env or {})})


def test_the_cli_and_make_give_the_document_for_a_root(tmp_path: Path) -> None:
    r = _cli("schema", "--root", ROOT, "--out", "-")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout) == build_document(root=ROOT)
    env = {"ROBOBUS_TOPIC_ROOT": "plant2/robobus"}
    r = _cli("schema", "--running-root", "--out", str(tmp_path / "out"), env=env)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((tmp_path / "out/asyncapi.yaml").read_text())
    assert written["channels"]["status"]["address"] == "plant2/robobus/{node}/status"
    r = _cli("schema", "--root", "site1/#", "--out", "-")
    assert r.returncode == 2 and "topic root" in r.stderr
    # the Makefile passes ROOT on, into build/ (the committed docs/ keep the generic document)
    dry = subprocess.run(["make", "-n", "schema", f"ROOT={ROOT}"], capture_output=True, text=True, cwd=REPO,
                         timeout=TIMEOUT_S)
    assert f"robobus schema --out build/schema/{ROOT} --root {ROOT}" in dry.stdout, dry.stdout + dry.stderr


def test_the_dashboard_serves_the_document_for_its_root() -> None:
    _need(REPO / "shared/tools/dashboard/node_modules")
    proc = NodeProcess(["-m", "shared.tools.cli", "dashboard", "--root", ROOT, "--port", "0"],
                       {"ROBOBUS_DASHBOARD_RELAY": "false", "ROBOBUS_MQTT_URL": "mqtt://127.0.0.1:1"})
    try:
        assert wait_for(lambda: re.search(r"robobus dashboard: (http://\S+)", proc.text()) is not None, 60), \
            proc.text()
        found = re.search(r"robobus dashboard: (http://\S+)", proc.text())
        assert found is not None
        with urllib.request.urlopen(f"{found.group(1).rstrip('/')}/api/asyncapi.json", timeout=30) as resp:
            served = json.load(resp)
    finally:
        proc.stop()
    assert served == json.loads(json.dumps(build_document(root=ROOT)))
    assert served["channels"]["health"]["address"] == f"{ROOT}/{{node}}/{{device}}/health"


def _unnamed_is_what_java_has_no_class_for(schema: dict[str, Any]) -> bool:
    """Java has no type of its own for a string (a binary payload) or for a union of built-in types
    (`int | str`): Modelina writes Object / String in their place."""
    if schema.get("type") in ("string", "integer", "number", "boolean") and "properties" not in schema \
            and "enum" not in schema:
        return True
    branches = schema.get("anyOf") or schema.get("oneOf") or []
    return bool(branches) and all("$ref" not in b and b.get("type") in ("string", "integer", "number", "boolean")
                                  for b in branches)


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`asyncapi generate models typescript|java` as an integrator runs it: Modelina with no options and no
    presets. {"out": the folder, "doc": the document, <language>: {"models", "unnamed"}}."""
    _need(MODELINA / "node_modules/@asyncapi/modelina")
    out = tmp_path_factory.mktemp("defaults")
    doc = build_document()
    doc_file = out / "asyncapi.yaml"
    doc_file.write_text(render_yaml(doc))
    r = subprocess.run(["node", str(MODELINA / "generate-defaults.mjs"), str(doc_file), str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"out": out, "doc": doc, **json.loads(r.stdout.strip().splitlines()[-1])}


def test_modelinas_default_typescript_classes_compile_with_tsc_strict(defaults: dict[str, Any]) -> None:
    """Every reply envelope's `ok` is set (a required boolean constant would be a class field never set)."""
    summary = defaults["typescript"]
    assert summary["unnamed"] == []
    assert {"EpuckActuatorsOk", "DexterEmpty", "Health"} <= set(summary["models"])
    ts = sorted(str(p) for p in (defaults["out"] / "typescript").glob("*.ts"))
    tsc = subprocess.run([str(MODELINA / "node_modules/.bin/tsc"), "--strict", "--noEmit", "--target", "es2022",
                          "--module", "commonjs", *ts], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert tsc.returncode == 0, tsc.stdout + tsc.stderr


def test_modelinas_default_java_classes_compile_with_javac(defaults: dict[str, Any], tmp_path: Path) -> None:
    """Plain Java (Modelina's default Java output needs no Jackson, no other library). A `number` default is
    no int literal in a `Double` field; an empty request is a class; what has no name is only what Java has
    no class for (a binary payload, a list of `int | str`: String and Object in place)."""
    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("javac is not installed (Debian: default-jdk-headless)")
    java = sorted(str(p) for p in (defaults["out"] / "java").glob("*.java"))
    assert len(java) == len(defaults["java"]["models"])
    jc = subprocess.run([javac, "-d", str(tmp_path / "classes"), *java], capture_output=True, text=True,
                        timeout=TIMEOUT_S)
    assert jc.returncode == 0, jc.stdout + jc.stderr
    assert (tmp_path / "classes/robobus/models/EpuckActuatorsOk.class").exists()

    titled = {}  # every schema by its title, inline ones included (a component's title is its key)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("title"), str):
                titled.setdefault(node["title"], node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(defaults["doc"]["components"]["schemas"])
    unnamed = defaults["java"]["unnamed"]
    assert all(_unnamed_is_what_java_has_no_class_for(titled[n]) for n in unnamed), unnamed
    assert {"DexterEmpty", "EpuckActuatorsOk", "EpuckAsciiRequest"} <= set(defaults["java"]["models"])


def test_the_document_is_the_newest_asyncapi_version_the_parser_and_modelina_both_read(tmp_path: Path) -> None:
    """3.0.0 while Modelina reads no 3.1.0 (the parser does): when an installed Modelina does, this fails and
    the document moves on (ASYNCAPI_VERSION in shared/tools/asyncapi.py)."""
    _need(MODELINA / "node_modules/@asyncapi/modelina")
    script = ("import specs from '@asyncapi/specs'; import { AsyncAPIInputProcessor } from '@asyncapi/modelina';"
              "console.log(JSON.stringify({parser: Object.keys(specs.schemas),"
              " modelina: AsyncAPIInputProcessor.supportedVersions}))")
    r = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, cwd=MODELINA,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    versions = json.loads(r.stdout.strip().splitlines()[-1])

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("-")[0].split("."))

    both = sorted((set(versions["parser"]) & set(versions["modelina"])) - {v for v in versions["parser"] if "-" in v},
                  key=key)
    assert build_document()["asyncapi"] == ASYNCAPI_VERSION == both[-1]
    assert "3.1.0" in versions["parser"]
    # and the parser installed here does take the same document as 3.1.0
    _need(VALIDATOR / "node_modules/@asyncapi/parser")
    doc = build_document()
    doc["asyncapi"] = "3.1.0"
    f = tmp_path / "asyncapi-3.1.0.yaml"
    f.write_text(render_yaml(doc))
    v = subprocess.run(["node", str(VALIDATOR / "validate.mjs"), str(f)], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert v.returncode == 0 and json.loads(v.stdout.strip().splitlines()[-1])["valid"], v.stdout + v.stderr
