"""shared/mqtt/paho_private.py holds every use of paho's private API, behind one version check. These tests fail loudly
when a paho upgrade moves what it relies on (a name, a method's parameters, a field's type, a routine it copies),
when the installed paho is not a version it was tested with, and when another kit module reaches into paho; and
they check that on an untested paho the kit falls back to paho's public behaviour, warns once, and still works."""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
import pytest
from packaging.requirements import Requirement
from paho.mqtt import _packet
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared import Node
from shared.mqtt import paho_private
from shared.mqtt.rx import ReceivedProperties
from shared.mqtt.session import MqttSession, PublishProperties, reply_properties, unique_client_id
from shared.rpc import RpcClient, wait_for
from shared.tools.replay import PahoPublisher
from tests.fixtures import Broker
from tests.kit.echo_node import API, build

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / "shared"

# sha256 (first 16 hex digits) of the source of each paho routine the kit copies, replaces or calls for its
# effect, as in the tested version. A mismatch: paho changed it; re-read it against the paho_private function
# named, then update the fingerprint (and TESTED_VERSIONS).
FINGERPRINTS = {
    "Client._handle_publish": "1bbaa3ef0e3afc6d",  # copied in install_publish_decoder
    "Client._packet_queue": "e298fa9ab31e5f79",  # copied in coalesce_wakes
    "Client._packet_write": "d097b7b51bed128d",  # called by packet_writer's caller: drains until empty or blocked
    "Client.loop_write": "57c360e5ae749fd9",  # wrapped by serialize_writes
    "decode_publish": "50c158487fa3d96e",  # paho_decode_publish; shared.mqtt.rx.decode_publish accepts what it accepts
    "Properties.__init__": "39440951e379274d",  # SharedTablesProperties: the tables are all it builds
    "Properties.pack": "e5c3c9f3b95fb939",  # reads the tables through self
    "Properties.__setattr__": "c52d27783e26c0b2",  # the same; the table names are its "private vars"
}
_ROUTINES: dict[str, Any] = {
    "Client._handle_publish": mqtt.Client._handle_publish,
    "Client._packet_queue": mqtt.Client._packet_queue,
    "Client._packet_write": mqtt.Client._packet_write,
    "Client.loop_write": mqtt.Client.loop_write,
    "decode_publish": _packet.decode_publish,
    "Properties.__init__": Properties.__init__,
    "Properties.pack": Properties.pack,
    "Properties.__setattr__": Properties.__setattr__,
}


@pytest.fixture
def fresh_verdict() -> Iterator[None]:
    """The verdict is made once per process: decided again for the test, and again after it."""
    paho_private.verdict.cache_clear()
    yield
    paho_private.verdict.cache_clear()


# -- the installed paho is the tested one, with all the kit relies on ------------------------------
def test_the_installed_paho_is_a_tested_version_within_the_pin() -> None:
    version = paho_private.paho_version()
    assert version == paho.mqtt.__version__
    assert version in paho_private.TESTED_VERSIONS, (
        f"paho-mqtt {version} is installed but shared/mqtt/paho_private.py was tested with "
        f"{paho_private.TESTED_VERSIONS}: the kit's fast paths are OFF. Run tests/kit; if they pass, add it")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in deps if Requirement(d).name == "paho-mqtt"]
    for v in (version, *paho_private.TESTED_VERSIONS):
        assert pin.specifier.contains(v), f"pyproject.toml's {pin} does not admit paho-mqtt {v}"


def test_every_private_name_is_there_with_its_kind_and_signature() -> None:
    lacking = paho_private.missing()
    assert lacking == [], "paho moved what shared/mqtt/paho_private.py relies on:\n  " + "\n  ".join(lacking)
    assert paho_private.verdict().enabled


@pytest.mark.parametrize("name", sorted(FINGERPRINTS))
def test_the_routines_the_kit_copies_or_wraps_are_unchanged(name: str) -> None:
    source = inspect.getsource(_ROUTINES[name])
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == FINGERPRINTS[name], (
        f"paho-mqtt {paho.mqtt.__version__} changed {name}: re-read it against shared/mqtt/paho_private.py")


def test_paho_calls_the_routines_the_kit_replaces_through_self() -> None:
    """An instance attribute over a method only works where paho calls it as self.<name>(...)."""
    assert "self._handle_publish()" in inspect.getsource(mqtt.Client._packet_handle)
    assert "self.loop_write()" in inspect.getsource(mqtt.Client._loop)
    for sender in (mqtt.Client._send_publish, mqtt.Client._send_command_with_mid, mqtt.Client._send_subscribe):
        assert "self._packet_queue(" in inspect.getsource(sender), sender.__name__


def test_missing_names_what_moved() -> None:
    """The check itself: a client without a field, with a method of other parameters, with a field of another
    type, each named."""
    c = paho_private._probe_client()
    del c._out_packet
    c._in_packet = []  # type: ignore[assignment]

    class Moved(mqtt.Client):
        def _packet_queue(self, packet: bytes) -> None:  # type: ignore[override]
            pass

    c.__class__ = Moved
    lacking = "\n".join(paho_private.missing(c))
    assert "Client()._out_packet: no such attribute" in lacking
    assert "Client()._in_packet: a list, expected dict" in lacking
    assert "Client._packet_queue('self', 'packet'): expected parameters" in lacking


# -- no other kit module touches paho's internals ---------------------------------------------------
def _paho_private_names() -> set[str]:
    """Every `_name` of paho's client: its class's and a new instance's (not just those the kit uses)."""
    c = paho_private._probe_client()
    return {n for n in set(dir(type(c))) | set(vars(c)) if n.startswith("_") and not n.startswith("__")}


def _private_uses(path: Path) -> list[str]:
    """paho internals used in a module: imports of paho.mqtt._*; a paho client's `_name` read from what looks like
    a paho client (`c`, `client`, `<expr>.client`); paho's undocumented module names (paho_private.MODULE_NAMES);
    getattr/setattr/hasattr with any of those names."""
    client_names = _paho_private_names()
    module_names = set(paho_private.MODULE_NAMES)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("paho.mqtt._") or (
                    node.module.startswith("paho") and any(a.name.startswith("_") for a in node.names)):
                out.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            out += [f"{where} import {a.name}" for a in node.names if a.name.startswith("paho.mqtt._")]
        elif isinstance(node, ast.Attribute):
            receiver = ast.unparse(node.value)
            paho_client = receiver == "c" or receiver == "client" or receiver.endswith(".client")
            if (node.attr in client_names and paho_client) or node.attr in module_names:
                out.append(f"{where} .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in client_names | module_names):
            out.append(f"{where} {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_no_other_kit_module_uses_paho_internals() -> None:
    found = [use for p in sorted(SHARED.rglob("*.py")) if p.name != "paho_private.py" for use in _private_uses(p)]
    assert found == [], "paho's private API outside shared/mqtt/paho_private.py:\n  " + "\n  ".join(found)


def test_the_scan_sees_what_it_looks_for(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from paho.mqtt import _packet\nimport paho.mqtt._packet\nx = session.client._out_packet\n"
                   "getattr(c, '_packet_write')\ny = mqtt.sockpair_data\nz = self._thread\nw = client._out_messages\n"
                   "v = node._thread\n")
    assert [u.split(" ", 1)[1] for u in _private_uses(src)] == [
        "from paho.mqtt import ...", "import paho.mqtt._packet", "._out_packet", "getattr(..., '_packet_write')",
        ".sockpair_data", "._out_messages"]


def test_every_paho_internal_used_in_paho_private_is_declared() -> None:
    """What `missing()` checks is what the module uses: a client's `_name` and a lowercase `mqtt.name`."""
    tree = ast.parse((SHARED / "mqtt" / "paho_private.py").read_text())
    declared = set(paho_private.CLIENT_METHODS) | set(paho_private.CLIENT_ATTRIBUTES)
    used_client = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id in ("client", "c") and n.attr.startswith("_")}
    used_module = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "mqtt" and n.attr[0].islower()}
    assert used_client and used_client <= declared, used_client - declared
    assert used_module <= set(paho_private.MODULE_NAMES), used_module - set(paho_private.MODULE_NAMES)


# -- the rule -----------------------------------------------------------------------------------------
TESTED = paho_private.TESTED_VERSIONS[0]


@pytest.mark.parametrize(("version", "mode", "lacking", "enabled", "warn"), [
    (TESTED, "auto", [], True, False),
    (TESTED, "", [], True, False),
    (TESTED, " ON ", [], True, False),
    (TESTED, "off", [], False, False),
    (TESTED, "auto", ["Client._out_packet: no such attribute"], False, True),
    ("2.3.0", "auto", [], False, True),
    ("2.3.0", "on", [], True, True),
    ("2.3.0", "on", ["x"], False, True),
    ("2.3.0", "off", [], False, False),
    (TESTED, "yes", [], False, True),
])
def test_decide(version: str, mode: str, lacking: list[str], enabled: bool, warn: bool) -> None:
    v = paho_private.decide(version, mode, lacking)
    assert (v.enabled, v.warn) == (enabled, warn), v.why
    if warn:
        assert version in v.why


def _flags(s: MqttSession) -> tuple[bool, bool, bool]:
    return s.coalesced_wakes, s.fast_decode, s.direct_writes


def _patched(c: mqtt.Client) -> set[str]:
    return {"_handle_publish", "_packet_queue", "loop_write"} & set(vars(c))


def test_off_by_the_setting_on_a_tested_paho(fresh_verdict: None, monkeypatch: pytest.MonkeyPatch,
                                             broker_session: Broker, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(paho_private.ENV, "off")
    s = MqttSession(broker_session.settings(), unique_client_id("off"))
    assert _flags(s) == (False, False, False) and _patched(s.client) == set()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_forced_on_for_an_untested_paho_that_has_everything(fresh_verdict: None, monkeypatch: pytest.MonkeyPatch,
                                                            broker_session: Broker,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(paho.mqtt, "__version__", "2.9.1")
    monkeypatch.setenv(paho_private.ENV, "on")
    with caplog.at_level(logging.WARNING, "robobus.mqtt"):
        sessions = [MqttSession(broker_session.settings(), unique_client_id("forced")) for _ in range(3)]
    assert all(_flags(s) == (True, True, True) for s in sessions)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "2.9.1" in warnings[0] and "=on" in warnings[0], warnings


def test_an_untested_paho_falls_back_to_pahos_public_behaviour(fresh_verdict: None, monkeypatch: pytest.MonkeyPatch,
                                                               broker_session: Broker,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Every shortcut off, one warning naming the version for the whole process, and the kit still works end to
    end: a command round trip (reply written by paho's network thread), a batch, properties both ways."""
    monkeypatch.setattr(paho.mqtt, "__version__", "2.9.1")
    monkeypatch.delenv(paho_private.ENV, raising=False)
    with caplog.at_level(logging.WARNING, "robobus.mqtt"):
        node = Node(API, broker_session.settings(node=f"echo-{time.monotonic_ns()}"))
        stop = build(node)
        client = RpcClient(broker_session.settings(), name="fallback-client")
        sub = MqttSession(broker_session.settings(), unique_client_id("fallback-sub"))
        pub = MqttSession(broker_session.settings(), unique_client_id("fallback-pub"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "2.9.1" in warnings[0] and "not a tested version" in warnings[0], warnings
    for s in (node.session, client.session, sub, pub):
        assert _flags(s) == (False, False, False)
        assert _patched(s.client) == set(), "paho's own routines must be left in place"
    props = reply_properties("r/t", b"\x01\x02", "application/json")
    assert isinstance(props, PublishProperties)
    assert props.pack() == _paho_props("r/t", b"\x01\x02", "application/json").pack()  # type: ignore[no-untyped-call]
    props.UserProperty = ("k", "v")
    paho_packed = _paho_props("r/t", b"\x01\x02", "application/json", ("k", "v")).pack()  # type: ignore[no-untyped-call]
    assert props.pack() == paho_packed

    topic = f"robobus/test/fallback/{uuid.uuid4().hex[:8]}"
    got: list[mqtt.MQTTMessage] = []
    node.start()
    client.connect()
    sub.subscribe(topic, got.append, qos=1)
    sub.start()
    pub.start()
    try:
        assert node.session.wait_ready(10) and sub.wait_ready(10) and pub.wait_connected(10)
        rep = client.call(node.name, "dev1", "echo", {"text": "hello", "count": 3})
        assert rep.ok and rep.result == {"text": "hello", "count": 3}, rep
        assert pub.publish(topic, b"now", qos=1, properties=props, now=True)
        with pub.batch():
            for i in range(5):
                assert pub.publish(topic, f"b{i}".encode(), qos=i % 2)
        assert wait_for(lambda: len(got) == 6, 10), [m.payload for m in got]
        first = next(m for m in got if m.payload == b"now")
        assert not isinstance(first.properties, ReceivedProperties)  # paho's own decoder
        p: Any = first.properties
        assert (p.ResponseTopic, p.CorrelationData, p.ContentType, p.UserProperty) == \
            ("r/t", b"\x01\x02", "application/json", [("k", "v")])
        assert sorted(m.payload for m in got if m.payload != b"now") == [f"b{i}".encode() for i in range(5)]
    finally:
        pub.stop()
        sub.stop()
        client.close()
        stop.set()
        node.stop()


def _paho_props(rt: str, corr: bytes, ct: str, user: tuple[str, str] | None = None) -> Properties:
    p = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    p.ResponseTopic = rt
    p.CorrelationData = corr
    p.ContentType = ct
    if user:
        p.UserProperty = user
    return p


# -- replay over paho: drained by paho's public on_publish, not its private queue ----------------------
def test_replay_paho_publisher_drains_by_acknowledgement(broker_session: Broker) -> None:
    topic = f"robobus/test/replay/{uuid.uuid4().hex[:8]}"
    got: list[bytes] = []
    sub = MqttSession(broker_session.settings(), unique_client_id("replay-sub"))
    sub.subscribe(topic, lambda m: got.append(bytes(m.payload)), qos=1)
    sub.start()
    assert sub.wait_ready(10)
    pub = PahoPublisher(broker_session.settings(), unique_client_id("replay-pub"))
    sent = [f"{i}".encode() for i in range(600)]

    def send(k: int) -> None:
        for i in range(k, 600, 3):
            pub.publish(topic, sent[i], i % 2, False, None)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pub.drain(30), f"{len(pub._pending)} never acknowledged"
        assert not pub._pending and not pub._early and pub.dropped == 0
        assert wait_for(lambda: len(got) == 600, 10), len(got)
        assert sorted(got) == sorted(sent)
    finally:
        pub.close()
        sub.stop()
