"""Recordings without a broker: what a file holds, inspect, rotation, recover, and replay's choices
(root, topics, commands, retain, properties, rate, loop) through a collecting sink."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from mcap.reader import make_reader
from typer.testing import CliRunner

from shared.tools.bus_catalog import TopicCatalog
from shared.tools.record_cli import app
from shared.tools.recorder import PROPS_TOPIC, RECORDING_META, Recorder, RecordOptions
from shared.tools.replay import RecordingError, Replayer, ReplayOptions, inspect, recover
from tests.record.helpers import document, make_recording, pub

HEALTH = json.dumps({"connection": True, "operational": True, "state": "running", "error": False,
                     "error_message": "", "service": "epuck-gateway", "node": "epuck-gateway",
                     "device": "e1", "version": "0.1.0", "ts": 1.0, "details": {}})
STATUS = json.dumps({"online": True, "service": "epuck-gateway", "node": "epuck-gateway"})


def bus(n: int = 5) -> list[tuple[float, Any]]:
    msgs: list[tuple[float, Any]] = [
        (0.0, pub("robobus/epuck-gateway/status", STATUS, retain=True)),
        (0.01, pub("robobus/epuck-gateway/e1/health", HEALTH, retain=True)),
    ]
    for i in range(n):
        msgs.append((0.1 + i * 0.1, pub("robobus/epuck-gateway/e1/state/link", json.dumps({"i": i}), qos=0)))
    msgs.append((0.25, pub("robobus/epuck-gateway/e1/cmd/set_speed", '{"left": 100, "right": 100}',
                           props={"response_topic": "robobus/_client/c1/reply", "correlation_data": b"\x01\x02",
                                  "user_property": [("who", "test")]})))
    msgs.append((0.26, pub("robobus/_client/c1/reply", '{"ok": true, "result": {}}',
                           props={"correlation_data": b"\x01\x02"})))
    msgs.append((0.3, pub("robobus/epuck-gateway/e1/state/image", b"\xff\xd8jpeg\xff\xd9", qos=0,
                          props={"content_type": "image/jpeg"})))
    return msgs


class Sink:
    def __init__(self) -> None:
        self.got: list[tuple[str, bytes, int, bool, dict[str, Any] | None]] = []

    def __call__(self, topic: str, payload: bytes, qos: int, retain: bool, props: dict[str, Any] | None) -> None:
        self.got.append((topic, payload, qos, retain, props))

    def topics(self) -> list[str]:
        return [g[0] for g in self.got]


def test_file_holds_channels_schemas_metadata_and_properties(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, bus())
    with open(path, "rb") as f:
        reader = make_reader(f)
        summary = reader.get_summary()
        assert summary is not None and summary.statistics is not None
        assert summary.chunk_indexes and all(c.compression == "zstd" for c in summary.chunk_indexes)
        # the raw channels (an image topic has a derived foxglove.CompressedImage channel beside: test_images.py)
        by_topic = {c.topic: c for c in summary.channels.values() if "robobus.derived" not in c.metadata}
        health = by_topic["robobus/epuck-gateway/e1/health"]
        assert health.message_encoding == "json" and health.metadata["mqtt.retain"] == "true"
        schema = summary.schemas[health.schema_id]
        assert schema.encoding == "jsonschema" and schema.name == "Health"
        jsonschema.validate(json.loads(HEALTH), json.loads(schema.data))  # the payload fits its schema
        image = by_topic["robobus/epuck-gateway/e1/state/image"]
        assert image.message_encoding == "image/jpeg" and image.schema_id == 0
        assert by_topic["robobus/epuck-gateway/e1/cmd/set_speed"].metadata["robobus.node_receives"] == "true"
        meta = {m.name: m.metadata for m in reader.iter_metadata()}[RECORDING_META]
        assert meta["root"] == "robobus" and json.loads(meta["filters"]) == ["robobus/#"]
        assert [a.name for a in reader.iter_attachments()] == ["asyncapi.json"]
        props = [json.loads(m.data) for _s, _c, m in reader.iter_messages(topics=[PROPS_TOPIC])]
        cmd = next(p for p in props if p["topic"].endswith("set_speed"))
        assert cmd["response_topic"] == "robobus/_client/c1/reply" and cmd["correlation_data"] == "0102"
        assert cmd["user_properties"] == [["who", "test"]]
        # log time order and payloads as written
        link = [json.loads(m.data)["i"] for _s, c, m in reader.iter_messages() if c.topic.endswith("state/link")]
        assert link == [0, 1, 2, 3, 4]


def test_inspect_reports_topics_counts_rates_time_range_and_schemas(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, bus(n=5))
    s = inspect(path)
    link = next(c for c in s.channels if c.topic.endswith("state/link"))
    assert link.count == 5 and link.schema.startswith("EpuckLinkStats") and link.kind == "state"
    assert s.duration_s == pytest.approx(0.5, abs=1e-6)
    assert link.rate_hz == pytest.approx(10.0)
    assert s.metadata["broker"] == "mqtt://test:1883"
    out = CliRunner().invoke(app, ["inspect", str(path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert {c["topic"] for c in data["channels"]} >= {"robobus/epuck-gateway/status", PROPS_TOPIC}
    table = CliRunner().invoke(app, ["inspect", str(path)])
    assert table.exit_code == 0 and "EpuckLinkStats" in table.stdout and "command" in table.stdout


def test_replay_under_another_root_skips_commands_and_keeps_properties(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, bus())
    sink = Sink()
    stats = Replayer(path, ReplayOptions(rate=0, root="replay/x"), sink).run()
    assert all(t.startswith("replay/x/") for t in sink.topics())
    assert not any(t[-14:] == "/cmd/set_speed" for t in sink.topics())
    assert stats.skipped_commands == 1 and stats.published == len(sink.got) == 9
    status = next(g for g in sink.got if g[0] == "replay/x/epuck-gateway/status")
    assert status[3] is True and status[1] == STATUS.encode()  # retained as published
    link = [g for g in sink.got if g[0].endswith("state/link")]
    assert [json.loads(g[1])["i"] for g in link] == [0, 1, 2, 3, 4] and all(g[2] == 0 and not g[3] for g in link)
    reply = next(g for g in sink.got if g[0].endswith("/c1/reply"))
    assert reply[4] == {"correlation_data": b"\x01\x02"}
    image = next(g for g in sink.got if g[0].endswith("state/image"))
    assert image[4] == {"content_type": "image/jpeg"} and image[1] == b"\xff\xd8jpeg\xff\xd9"


def test_replay_commands_only_when_asked_with_response_topic_moved(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, bus())
    sink = Sink()
    Replayer(path, ReplayOptions(rate=0, root="rp", include_commands=True,
                                 topics=("robobus/+/+/cmd/#",)), sink).run()
    assert sink.topics() == ["rp/epuck-gateway/e1/cmd/set_speed"]
    assert sink.got[0][4] == {"response_topic": "rp/_client/c1/reply", "correlation_data": b"\x01\x02",
                              "user_property": [("who", "test")]}


def test_replay_no_retain_and_rate_scaling(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(i * 0.05, pub("robobus/n/d/state/x", str(i), retain=True)) for i in range(6)])
    sink = Sink()
    stats = Replayer(path, ReplayOptions(rate=2.0, retain=False), sink).run()
    assert [g[1] for g in sink.got] == [str(i).encode() for i in range(6)] and not any(g[3] for g in sink.got)
    assert len(stats.late_ns) == 6  # every message had a due time (0, 25, 50 ... ms at rate 2)


def test_replay_loop_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(i * 0.001, pub("robobus/n/d/state/x", str(i))) for i in range(3)])
    stop = threading.Event()
    sink = Sink()

    def publish(*a: Any) -> None:
        sink(*a)
        if len(sink.got) >= 7:
            stop.set()

    stats = Replayer(path, ReplayOptions(rate=0, loop=True), publish).run(stop)
    assert stats.loops >= 2 and [g[1] for g in sink.got[:6]] == [b"0", b"1", b"2"] * 2


def test_rotation_by_size_numbers_files_and_carries_retained_state(tmp_path: Path) -> None:
    msgs = [(0.0, pub("robobus/epuck-gateway/status", STATUS, retain=True))]
    msgs += [(0.001 * i, pub("robobus/n/d/state/x", json.dumps({"i": i, "pad": "x" * 900}))) for i in range(1, 400)]
    # driven by hand: write, and tick (the rotation check the subscriber loop makes) every 50 messages
    rec = Recorder(RecordOptions(path=tmp_path / "run.mcap", max_bytes=64 * 1024, chunk_bytes=16 * 1024,
                                 compression="none", flush_s=0.001), TopicCatalog.from_document(document(), "robobus"))
    for k, (t, p) in enumerate(msgs):
        rec.write(p, 1_700_000_000_000_000_000 + int(t * 1e9))
        if k % 50 == 0:
            rec.tick()
    rec.close()
    files = sorted(tmp_path.glob("run-*.mcap"))
    assert len(files) >= 3 and [f.name for f in files][:2] == ["run-0000.mcap", "run-0001.mcap"]
    total = 0
    for i, f in enumerate(files):
        s = inspect(f)
        assert s.metadata["part"] == str(i)
        topics = {c.topic: c.count for c in s.channels}
        assert topics.get("robobus/epuck-gateway/status", 0) == 1  # every part starts with the retained state
        total += topics.get("robobus/n/d/state/x", 0)
    assert total == 399


def test_recover_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(i * 0.01, pub("robobus/n/d/state/x", json.dumps({"i": i}))) for i in range(2000)],
                   chunk_bytes=8 * 1024, document=None)
    data = path.read_bytes()
    torn = tmp_path / "torn.mcap"
    torn.write_bytes(data[: len(data) * 2 // 3])  # the summary and a part of a chunk are gone
    with pytest.raises(RecordingError, match="robobus recover"):
        inspect(torn)
    fixed = tmp_path / "fixed.mcap"
    r = recover(torn, fixed)
    assert r.error and 0 < r.messages < 2000
    s = inspect(fixed)
    counts = {c.topic: c.count for c in s.channels}
    assert counts["robobus/n/d/state/x"] == r.messages
    with open(fixed, "rb") as f:
        got = [json.loads(m.data)["i"] for _s, _c, m in make_reader(f).iter_messages()]
    assert got == list(range(r.messages))  # a prefix, in order
    out = CliRunner().invoke(app, ["recover", str(torn), "-o", str(tmp_path / "cli.mcap")])
    assert out.exit_code == 0 and f"{r.messages} messages" in out.output


def test_replay_refuses_an_unfinished_file_with_advice(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mcap"
    bad.write_bytes(b"\x89MCAP0\r\n" + b"\x00" * 50)
    with pytest.raises(RecordingError, match="recover"):
        Replayer(bad, ReplayOptions(), Sink()).run()
    out = CliRunner().invoke(app, ["inspect", str(bad)])
    assert out.exit_code == 1 and "recover" in out.output


def test_replay_realtime_is_for_the_pass_only(tmp_path: Path) -> None:
    """--realtime: SCHED_FIFO for the publishing thread where allowed (else said, and normal priority),
    and the thread's policy is given back after the pass."""
    import os

    path = tmp_path / "a.mcap"
    make_recording(path, [(i * 0.002, pub("robobus/n/d/state/x", str(i))) for i in range(20)])
    before = os.sched_getscheduler(0)
    policies: list[int] = []
    sink = Sink()

    def publish(*a: Any) -> None:
        policies.append(os.sched_getscheduler(0))
        sink(*a)

    rp = Replayer(path, ReplayOptions(realtime=True), publish)
    rp.run()
    assert len(sink.got) == 20 and os.sched_getscheduler(0) == before
    if rp.realtime_note.startswith("SCHED_FIFO"):
        assert set(policies) == {os.SCHED_FIFO}
    else:
        assert "refused" in rp.realtime_note and set(policies) == {before}


def test_timer_slack_is_for_the_pass_only(tmp_path: Path) -> None:
    """The publishing thread sleeps with 1 ns of timer slack (sleeps end when asked, not up to 50 us
    later) during the pass, and gets its own slack back after it."""
    from shared.tools.replay import _set_timer_slack

    path = tmp_path / "a.mcap"
    make_recording(path, [(i * 0.002, pub("robobus/n/d/state/x", str(i))) for i in range(5)])
    own = _set_timer_slack(1)
    if own == 0:
        pytest.skip("no prctl(PR_SET_TIMERSLACK) here")
    _set_timer_slack(own)
    slacks: list[int] = []

    def publish(*_a: Any) -> None:
        slacks.append(_set_timer_slack(1))  # returns the slack in force (and leaves 1 ns)

    Replayer(path, ReplayOptions(), publish).run()
    assert slacks == [1] * 5
    assert _set_timer_slack(own) == own


def test_wait_until_spins_to_the_due_time_and_stops_at_once() -> None:
    """With a spin, the wait never ends before the due time; a stop ends it at once however far it is."""
    import time

    from shared.tools.replay import SPIN_NS, _wait_until

    stop = threading.Event()
    for ahead in (0, SPIN_NS // 2, 3 * SPIN_NS):
        due = time.monotonic_ns() + ahead
        _wait_until(due, stop, SPIN_NS)
        assert time.monotonic_ns() >= due
    stop.set()
    t = time.monotonic()
    _wait_until(time.monotonic_ns() + 3_600_000_000_000, stop, SPIN_NS)
    assert time.monotonic() - t < 60  # returned, instead of sleeping or spinning for an hour
