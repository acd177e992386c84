"""`robobus foxglove` against an independent implementation of the Foxglove WebSocket protocol: the protocol's own
client (@foxglove/ws-protocol, Node.js: tests/foxglove/wsclient/client.js) on `make run`'s whole system (every
service on its simulator, subprocesses on free ports, a broker of the test's own). The client subscribes to every
channel as it is advertised and validates each message against the JSON Schema the channel advertised, and each
service response against the service's response schema. Also: the demo layout (deploy/foxglove/robobus-demo.json)
against the live view and against an MCAP file `robobus record` made of the same bus."""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.messages import StopState
from shared.rpc import RpcClient
from shared.settings import KitSettings
from shared.stop import stop_topic
from shared.tools.bus_catalog import TopicCatalog, load_document
from shared.tools.localbroker import REPO
from tests.dashboard.stack import DEVICES, NODES, ROI_MODULES, SimStack, roi_prefix
from tests.fixtures import Broker, free_port, mosquitto_bin
from tests.foxglove.stack import WsClient, client_missing, start_bridge, wait_for_true

pytestmark = pytest.mark.slow
ROOT = "robobus"
LAYOUT = REPO / "deploy" / "foxglove" / "robobus-demo.json"


class Demo:
    def __init__(self, stack: SimStack, client: RpcClient, port: int, ws: WsClient, recording: Path,
                 broker: Broker) -> None:
        self.stack, self.client, self.port, self.ws, self.recording = stack, client, port, ws, recording
        self.broker = broker

    def report(self) -> dict[str, Any]:
        return self.ws.report()


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    why = client_missing() or (None if mosquitto_bin() else "mosquitto is not installed")
    if why:
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="robobus-foxglove-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        stack = SimStack(None, Path(d), broker.url)  # type: ignore[arg-type]  # (the broker is the fixture's)
        client = RpcClient(KitSettings(mqtt_url=broker.url), name="foxglove-test")
        ws: WsClient | None = None
        try:
            client.connect()
            stack.start_services(NODES)
            procfile_roi(stack)
            port = start_bridge(stack)
            recording = Path(d) / "bus.mcap"
            stack.spawn("recorder", ["-m", "shared.tools.record_cli", "record", "-o", str(recording)])
            stack.wait_online(client, NODES)
            ws = WsClient(port)
            yield Demo(stack, client, port, ws, recording, broker)
        finally:
            if ws is not None:
                ws.close()
            client.close()
            stack.stop()
            broker.kill()


def procfile_roi(stack: SimStack) -> None:
    """The ROI modules as deploy/Procfile.sim has them (the actuator answers its length, the service reads it: a
    position to plot), where tests/dashboard/stack.py starts them plainer."""
    for name in ("roi-modules", "roi-sim"):
        stack.kill(name)
    prefix = roi_prefix()
    stack.spawn("roi-sim", ["-m", "services.roi_modules.sim", "--prefix", prefix, "--modules",
                            ",".join(f"{kind}:{octet}" for _, octet, kind in ROI_MODULES), "--actuator-length"])
    modules: list[dict[str, Any]] = [{"name": n, "octet": o, "type": k} for n, o, k in ROI_MODULES]
    extra: dict[str, dict[str, Any]] = {"gpio": {"pin_modes": {"0": "input_pullup", "1": "input", "3": "output"}},
                                        "odrive": {"initial_mode": "velocity"}, "actuator": {"length_feedback": "on"}}
    for m in modules:
        m.update(extra[str(m["type"])])
    stack.spawn("roi-modules", ["-m", "services.roi_modules"], {
        "ROBOBUS_ROI_NETWORK": prefix, "ROBOBUS_ROI_HOST_OCTET": "100", "ROBOBUS_ROI_MODULES": json.dumps(modules)})


def expected_topics() -> set[str]:
    out = {f"{ROOT}/{n}/status" for n in NODES}
    out |= {f"{ROOT}/{n}/{d}/health" for n, devs in DEVICES.items() for d in devs}
    out |= {f"{ROOT}/ethercat-loop/rh/state/joints", f"{ROOT}/dexter-gateway/dexter1/state/status",
            f"{ROOT}/roi-modules/roi_wheel/state/state", f"{ROOT}/roi-modules/roi_arm/state/state",
            f"{ROOT}/epuck-gateway/epuck1/state/image", f"{ROOT}/epuck-gateway/epuck2/state/image",
            f"{ROOT}/epuck-gateway/epuck1/state/sensors"}
    return out


def wait_report(demo: Demo, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        r = demo.report()
        if pred(r) or time.monotonic() > end:
            return r
        time.sleep(0.5)


def test_every_channel_is_the_contracts_and_every_message_validates(demo: Demo) -> None:
    want = expected_topics()
    r = wait_report(demo, lambda r: all(r["topics"].get(t, {}).get("messages", 0) >= 3 - 2 * t.endswith(
        ("/status", "/health")) for t in want))
    topics = r["topics"]
    missing = {t: topics.get(t, {}).get("messages") for t in want if not topics.get(t, {}).get("messages")}
    assert not missing, missing
    catalog = TopicCatalog.from_document(load_document(), ROOT)
    for n in NODES:  # each node named after its service, as the bridge learns from their statuses
        catalog.learn(f"{ROOT}/{n}/status", json.dumps({"service": n}).encode())
    for topic, s in topics.items():
        assert s["invalid"] == 0, (topic, s["errors"])
        assert s["encoding"] == "json" and s["schemaEncoding"] == "jsonschema" and s["hasValidator"], (topic, s)
        info = catalog.info(topic)
        if info.content_type.startswith("image/"):
            assert s["schemaName"] == "foxglove.CompressedImage" and s["jpegs"] == s["messages"], (topic, s)
        else:
            # the recorder's schema for the topic (same catalogue): what a recording carries
            assert s["schemaName"] == info.schema_name, (topic, s["schemaName"], info.schema_name)
    # every message's log time is when the bridge received it: after the publisher's own stamp, and close to it
    joints = topics[f"{ROOT}/ethercat-loop/rh/state/joints"]
    sent_ns = joints["last"]["ts"] * 1e9
    assert sent_ns - 50e6 <= int(joints["lastLogTime"]) <= sent_ns + 5e9, joints
    # status is retained: a client that subscribes after it was sent still gets it (every node's, online)
    assert all(topics[f"{ROOT}/{n}/status"]["last"]["online"] for n in NODES)


def test_commands_and_the_bus_stop_are_services(demo: Demo) -> None:
    ws = demo.ws
    speed = f"{ROOT}/epuck-gateway/epuck1/cmd/set_speed"
    assert wait_for_true(lambda: {speed, f"{ROOT}/_stop/stop", f"{ROOT}/_stop/release"} <= ws.services(), 30)
    svc = {s["name"]: s for s in demo.report()["services"]}
    assert svc[speed]["request"] == "EpuckSpeed" or svc[speed]["request"], svc[speed]
    ok = ws.call(speed, {"left": 100, "right": 100})
    assert ok["ok"] and ok["valid"] and ok["body"]["ok"], ok
    bad = ws.call(speed, {"left": "fast", "right": 0})  # the node's own validation, in the contract's words
    assert bad["valid"] and bad["body"]["error"]["code"] == "invalid_request", bad
    stop = ws.call(f"{ROOT}/_stop/stop", {"reason": "foxglove test"})
    assert stop["valid"] and stop["body"]["ok"], stop
    result = stop["body"]["result"]
    assert result["stop"]["active"] and "via foxglove" in result["stop"]["source"], result["stop"]
    assert set(result["online"]) == set(NODES) and result["silent"] == [], result
    assert all(d["stopped"] for a in result["answers"].values() for d in a["devices"]), result["answers"]
    refused = ws.call(speed, {"left": 100, "right": 100})
    assert refused["valid"] and refused["body"]["error"]["code"] == "stopped", refused
    release = ws.call(f"{ROOT}/_stop/release", {"reason": ""})
    assert release["valid"] and release["body"]["ok"] and not release["body"]["result"]["stop"]["active"], release
    again = ws.call(speed, {"left": 0, "right": 0})
    assert again["body"]["ok"], again
    r = demo.report()
    assert r["topics"][f"{ROOT}/_stop"]["last"]["active"] is False


def test_a_node_that_vanishes_is_withdrawn_and_returns(demo: Demo) -> None:
    ws, stack = demo.ws, demo.stack
    prefix = f"{ROOT}/ethercat-loop/"
    joints = f"{prefix}rh/state/joints"
    assert wait_for_true(lambda: joints in (demo.report()["topics"]), 30)
    t0 = time.monotonic()
    stack.kill("ethercat-loop")  # kill -9: its Last Will says it is offline
    assert wait_for_true(lambda: any(joints in e["topics"] for e in ws.seen("unadvertise", t0)), 20), ws.events[-5:]
    gone = {t for e in ws.seen("unadvertise", t0) for t in e["topics"]}
    assert f"{prefix}rh/health" in gone and f"{prefix}status" not in gone, gone
    assert wait_for_true(lambda: not any(s.startswith(prefix) for s in ws.services()), 10)
    r = demo.report()
    assert r["topics"][f"{prefix}status"]["last"]["online"] is False
    assert not r["topics"][joints]["live"]
    t1 = time.monotonic()
    stack.spawn("ethercat-loop", ["-m", "services.ethercat_loop"], {"ROBOBUS_ETHERCAT_BACKEND": "model"})
    assert wait_for_true(lambda: any(joints in e["topics"] for e in ws.seen("advertise", t1)), 60)
    assert wait_for_true(lambda: f"{prefix}rh/cmd/set_control_mode" in ws.services(), 30)
    before = demo.report()["topics"][joints]["messages"]
    assert wait_for_true(lambda: demo.report()["topics"][joints]["messages"] > before + 10, 30)
    r = demo.report()
    assert r["topics"][joints]["invalid"] == 0 and r["topics"][joints]["live"]
    assert r["topics"][f"{prefix}status"]["last"]["online"] is True


# -- the layout --------------------------------------------------------------------------------------------
_PATH = re.compile(r'^"(?P<topic>[^"]+)"(?P<rest>.*)$')
_SEG = re.compile(r'\.(?P<name>\w+)(?:\[(?P<index>-?\d+|:)\])?(?:\{(?P<field>\w+)=="(?P<value>[^"]*)"\})?')


def layout_paths(layout: dict[str, Any]) -> dict[str, list[str]]:
    """panel id -> the message paths (Plot) or topics (Image, RawMessages) it reads."""
    out: dict[str, list[str]] = {}
    for pid, cfg in layout["configById"].items():
        if pid.startswith("Plot!"):
            out[pid] = [p["value"] for p in cfg["paths"]]
        elif pid.startswith("Image!"):
            out[pid] = [f'"{cfg["imageMode"]["imageTopic"]}"']
        elif pid.startswith("RawMessages!"):
            out[pid] = [cfg["topicPath"]]
    return out


def evaluate(path: str, message: Any) -> list[Any]:
    """The values a message path of the subset the layout uses gives on one message ("topic".a.b[1].c[:]{k=="v"})."""
    m = _PATH.match(path)
    assert m, path
    values = [message]
    rest = m["rest"]
    while rest:
        s = _SEG.match(rest)
        assert s, (path, rest)
        rest = rest[s.end():]
        nxt = []
        for v in values:
            v = v.get(s["name"]) if isinstance(v, dict) else None
            if s["index"] == ":":
                nxt += list(v or [])
            elif s["index"] is not None:
                nxt += [v[int(s["index"])]] if isinstance(v, list) and len(v) > int(s["index"]) else []
            else:
                nxt.append(v)
        if s["field"]:
            nxt = [v for v in nxt if isinstance(v, dict) and str(v.get(s["field"])) == s["value"]]
        values = nxt
    return values


def topic_of(path: str) -> str:
    m = _PATH.match(path)
    assert m, path
    return m["topic"]


def test_the_demo_layout_plots_live_and_on_a_recording(demo: Demo) -> None:
    # the stop panel's topic has a message whatever ran before (this test alone: no stop was ever set on this bus)
    release = StopState(active=False, source="foxglove-test", reason="layout check", ts=time.time())
    assert demo.client.session.publish_wait(stop_topic(ROOT), release.model_dump_json(), qos=1, retain=True)
    layout = json.loads(LAYOUT.read_text())
    assert {"configById", "layout"} <= set(layout)
    leaves: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            leaves.append(node)
        else:
            walk(node["first"])
            walk(node["second"])

    walk(layout["layout"])
    assert sorted(leaves) == sorted(layout["configById"]), "every panel placed once"
    paths = layout_paths(layout)
    topics = {topic_of(p) for ps in paths.values() for p in ps}
    r = wait_report(demo, lambda r: all(r["topics"].get(t, {}).get("messages") for t in topics))
    for pid, ps in paths.items():
        for p in ps:
            live = r["topics"].get(topic_of(p))
            assert live and live["messages"], (pid, p)
            if pid.startswith("Plot!"):
                got = evaluate(p, live["last"])
                assert len(got) == 1 and isinstance(got[0], int | float), (pid, p, got)
    services = demo.ws.services()
    for pid, cfg in layout["configById"].items():
        if pid.startswith("CallService!"):
            assert cfg["serviceName"] in services, cfg
    # the same topics, schema names and paths in an MCAP file `robobus record` made of the same bus
    from mcap.reader import make_reader

    demo.stack.kill("recorder", sig=15)  # SIGTERM: the file is closed cleanly
    last: dict[str, Any] = {}
    schemas: dict[str, set[str]] = {}  # a topic's schema names in the file (the camera: raw bytes and derived)
    with demo.recording.open("rb") as f:
        for schema, channel, message in make_reader(f).iter_messages(topics=sorted(topics)):
            schemas.setdefault(channel.topic, set()).add(schema.name if schema else "")
            if channel.message_encoding == "json":
                last[channel.topic] = json.loads(message.data)
    assert topics <= set(schemas), topics - set(schemas)
    for pid, ps in paths.items():
        for p in ps:
            t = topic_of(p)
            # the camera: the recording's derived foxglove.CompressedImage channel beside the raw JPEG bytes
            assert r["topics"][t]["schemaName"] in schemas[t], (t, schemas[t])
            if pid.startswith("Plot!"):
                got = evaluate(p, last[t])
                assert len(got) == 1 and isinstance(got[0], int | float), (pid, p, got)


def test_the_loss_of_the_broker_is_said_and_its_return_clears_it(demo: Demo) -> None:
    ws = demo.ws
    joints = f"{ROOT}/ethercat-loop/rh/state/joints"
    t0 = time.monotonic()
    demo.broker.restart(down_s=1.0)
    assert wait_for_true(lambda: any(e.get("statusId") == "broker" for e in ws.seen("status", t0)), 20), ws.events[-5:]
    warn = next(e for e in ws.seen("status", t0) if e.get("statusId") == "broker")
    assert "broker" in warn["message"] and warn["level"] == 1, warn  # 1: warning
    assert wait_for_true(lambda: any("broker" in e["statusIds"] for e in ws.seen("removeStatus", t0)), 30)
    before = demo.report()["topics"][joints]["messages"]
    assert wait_for_true(lambda: demo.report()["topics"][joints]["messages"] > before + 10, 60)
