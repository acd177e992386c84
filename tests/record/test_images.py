"""The camera in a recording as on the live bridge: beside an image topic's raw channel (the JPEG bytes as
published, which replay puts back on the bus) the recorder writes a channel of the same topic as
`foxglove.CompressedImage`, with the schema, encoding and conversion `robobus foxglove` uses
(shared.tools.foxglove.images), so the demo layout's Image panel reads both. That derived channel is not bus
traffic: replay never republishes it; inspect marks it; recover keeps it.

In-process recordings first (no broker); then a live e-puck session (simulator, gateway and recorder in their
own processes) read back by an independent MCAP implementation (pymcap-cli, tests/record/test_mcap_cli.py) and
replayed through the broker by the real CLI."""

from __future__ import annotations

import base64
import io
import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import paho.mqtt.client as mqtt
import pytest
from mcap.reader import make_reader
from PIL import Image
from typer.testing import CliRunner

from shared.rpc import RpcClient, wait_for
from shared.tools.bus_catalog import META_DERIVED, TopicCatalog
from shared.tools.foxglove import images
from shared.tools.localbroker import Broker, free_port
from shared.tools.record_cli import app
from shared.tools.recorder import Recorder, RecorderSettings, RecordOptions
from shared.tools.replay import Replayer, ReplayOptions, inspect, recover
from tests.record.helpers import document, make_recording, pub
from tests.record.test_mcap_cli import CLI

T0 = 1_700_000_000_000_000_000  # make_recording's epoch
CAMERA = "robobus/epuck-gateway/e1/state/image"


def jpeg(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), (shade, 255 - shade, 40)).save(out, "JPEG")
    return out.getvalue()


def camera(shade: int, *, retain: bool = False, ctype: str = "image/jpeg", topic: str = CAMERA) -> Any:
    return pub(topic, jpeg(shade), qos=0, retain=retain, props={"content_type": ctype})


def channels_of(path: Path, topic: str) -> tuple[Any, Any, Any]:
    """(raw channel, derived channel, the derived channel's schema) of one topic."""
    with open(path, "rb") as f:
        summary = make_reader(f).get_summary()
    assert summary is not None
    chans = [c for c in summary.channels.values() if c.topic == topic]
    raw = [c for c in chans if META_DERIVED not in c.metadata]
    derived = [c for c in chans if c.metadata.get(META_DERIVED) == "true"]
    assert len(raw) == 1 and len(derived) == 1, chans
    return raw[0], derived[0], summary.schemas.get(derived[0].schema_id)


def by_channel(path: Path) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    with open(path, "rb") as f:
        for _s, ch, msg in make_reader(f).iter_messages():
            out.setdefault(ch.id, []).append(msg)
    return out


def assert_derived_matches_raw(raw: list[Any], derived: list[Any], frame_id: str, fmt: str = "jpeg") -> None:
    """Each derived message is what the live bridge logs for the raw one received at that time, valid against
    the schema it advertises, and its image bytes are the raw bytes."""
    validator = jsonschema.Draft202012Validator(images.SCHEMA)
    assert [m.log_time for m in derived] == [m.log_time for m in raw]
    assert [m.sequence for m in derived] == list(range(1, len(raw) + 1))
    for r, d in zip(raw, derived, strict=True):
        assert d.data == images.compressed_image(r.data, r.log_time, frame_id, fmt)
        body = json.loads(d.data)
        validator.validate(body)
        assert base64.b64decode(body["data"], validate=True) == r.data
        assert body["timestamp"] == {"sec": r.log_time // 10**9, "nsec": r.log_time % 10**9}
        assert (body["frame_id"], body["format"]) == (frame_id, fmt)


def test_an_image_topic_gets_a_compressed_image_channel_beside_its_raw_one(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(0.1 * i, camera(i * 40)) for i in range(5)] + [
        (0.05, pub("robobus/epuck-gateway/e1/state/link", '{"i": 0}')),
        (0.06, pub("robobus/n/d/state/blob", b"\x00\x01", props={"content_type": "application/octet-stream"})),
        (0.07, camera(9, ctype="image/png", topic="robobus/n/cam2/state/frame"))])
    raw, derived, schema = channels_of(path, CAMERA)
    assert raw.message_encoding == "image/jpeg" and raw.schema_id == 0  # the raw channel as it always was
    # what the live bridge advertises for the camera: schema name, encoding and bytes, message encoding, metadata
    assert derived.message_encoding == "json" and schema is not None
    assert (schema.name, schema.encoding, schema.data) == (images.SCHEMA_NAME, "jsonschema", images.SCHEMA_BYTES)
    assert derived.metadata == {"mqtt.topic": CAMERA, "robobus.kind": "state", "mqtt.content_type": "image/jpeg",
                                "asyncapi.channel": raw.metadata["asyncapi.channel"], META_DERIVED: "true"}
    msgs = by_channel(path)
    assert [m.data for m in msgs[raw.id]] == [jpeg(i * 40) for i in range(5)]  # untouched
    assert_derived_matches_raw(msgs[raw.id], msgs[derived.id], "e1")
    # another image type gets its format; a binary that is no image and a JSON topic get no second channel
    png_raw, png_derived, _ = channels_of(path, "robobus/n/cam2/state/frame")
    assert_derived_matches_raw(msgs[png_raw.id], msgs[png_derived.id], "cam2", "png")
    s = inspect(path)
    assert [c.topic for c in s.channels].count("robobus/n/d/state/blob") == 1
    assert [c.topic for c in s.channels].count("robobus/epuck-gateway/e1/state/link") == 1


def test_replay_republishes_the_raw_bytes_only(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(0.1 * i, camera(i * 40)) for i in range(5)])
    for opts in (ReplayOptions(rate=0), ReplayOptions(rate=0, include_commands=True, topics=(CAMERA,)),
                 ReplayOptions(rate=0, root="replay")):
        got: list[tuple[str, bytes, dict[str, Any] | None]] = []
        stats = Replayer(path, opts, lambda t, d, q, r, p: got.append((t, d, p))).run()  # noqa: B023
        assert [d for _t, d, _p in got] == [jpeg(i * 40) for i in range(5)], opts
        assert all(p == {"content_type": "image/jpeg"} for _t, _d, p in got)
        assert stats.published == 5 and stats.skipped_derived == 5


def test_inspect_marks_the_derived_channel(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(0.0, camera(1)), (0.1, camera(2))])
    cams = [c for c in inspect(path).channels if c.topic == CAMERA]
    assert [(c.encoding, c.derived, c.count) for c in cams] == [("image/jpeg", False, 2), ("json", True, 2)]
    assert cams[1].schema == "foxglove.CompressedImage (jsonschema)"
    data = json.loads(CliRunner().invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert [c["derived"] for c in data["channels"] if c["topic"] == CAMERA] == [False, True]
    table = CliRunner().invoke(app, ["inspect", str(path)])
    assert table.exit_code == 0 and "derived, not replayed" in table.stdout


def test_a_cleared_retained_image_derives_nothing_and_a_carried_one_is_derived_again(tmp_path: Path) -> None:
    rec = Recorder(RecordOptions(path=tmp_path / "run.mcap", max_bytes=1 << 30),
                   TopicCatalog.from_document(document(), "robobus"))
    rec.write(camera(1, retain=True), T0)
    rec.write(pub(CAMERA, b"", qos=0, retain=True, props={"content_type": "image/jpeg"}), T0 + 1)  # cleared
    rec.write(camera(2, retain=True), T0 + 2)
    rec.rotate()  # the next part starts with the latest retained image, and its foxglove.CompressedImage
    rec.close()
    first, second = sorted(tmp_path.glob("run-*.mcap"))
    raw, derived, _ = channels_of(first, CAMERA)
    msgs = by_channel(first)
    assert [m.data for m in msgs[raw.id]] == [jpeg(1), b"", jpeg(2)]
    assert [json.loads(m.data)["data"] for m in msgs[derived.id]] == \
        [base64.b64encode(jpeg(1)).decode(), base64.b64encode(jpeg(2)).decode()]
    raw2, derived2, _ = channels_of(second, CAMERA)
    msgs2 = by_channel(second)
    assert [m.data for m in msgs2[raw2.id]] == [jpeg(2)]
    assert_derived_matches_raw(msgs2[raw2.id], msgs2[derived2.id], "e1")


def test_recover_keeps_the_derived_channel_and_replay_still_skips_it(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    make_recording(path, [(0.01 * i, camera(i % 250)) for i in range(400)], chunk_bytes=8 * 1024, document=None)
    data = path.read_bytes()
    torn = tmp_path / "torn.mcap"
    torn.write_bytes(data[: len(data) * 2 // 3])
    fixed = tmp_path / "fixed.mcap"
    r = recover(torn, fixed)
    assert r.error and 0 < r.messages < 800
    raw, derived, schema = channels_of(fixed, CAMERA)
    assert schema is not None and schema.data == images.SCHEMA_BYTES and derived.metadata[META_DERIVED] == "true"
    msgs = by_channel(fixed)
    n = len(msgs[derived.id])
    assert n > 0 and len(msgs[raw.id]) - n in (0, 1)  # a chunk holds an image and its derived message together
    assert_derived_matches_raw(msgs[raw.id][:n], msgs[derived.id], "e1")
    got: list[bytes] = []
    stats = Replayer(fixed, ReplayOptions(rate=0), lambda t, d, q, rt, p: got.append(d)).run()
    assert got == [m.data for m in msgs[raw.id]] and stats.skipped_derived == n


def test_the_derived_channel_can_be_turned_off(tmp_path: Path) -> None:
    settings = RecorderSettings(record_foxglove_images=False)
    opts = RecordOptions.from_settings(settings, ["robobus/#"], None, str(tmp_path / "a.mcap"))
    assert opts.foxglove_images is False
    rec = Recorder(opts, TopicCatalog.from_document(document(), "robobus"))
    rec.write(camera(1), T0)
    rec.close()
    cams = [c for c in inspect(tmp_path / "a.mcap").channels if c.topic == CAMERA]
    assert [(c.encoding, c.derived) for c in cams] == [("image/jpeg", False)]
    assert rec.stats.derived_records == 0


# -- live: an e-puck simulator streaming images, the gateway, the recorder, each in its own process -------------
def pymcap(*args: str) -> str:
    assert CLI is not None
    r = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def flushed_images(out: Path, probe: Path, topic: str) -> int:
    """Raw images the running recorder has flushed so far (its file is unfinished: read through recover)."""
    try:
        recover(out, probe)
        with open(probe, "rb") as f:
            return sum(1 for _s, c, _m in make_reader(f).iter_messages(topics=[topic])
                       if META_DERIVED not in c.metadata)
    except Exception:
        return 0


@pytest.mark.slow
@pytest.mark.skipif(CLI is None, reason="pymcap-cli not installed: `make setup` puts it in .venv-mcapcli")
def test_a_live_camera_recording_reads_as_compressed_images_and_replays_raw(
        broker_session: Broker, spawn: Any, tmp_path: Path) -> None:
    root = f"cam{time.monotonic_ns() % 10**9}"
    topic = f"{root}/epuck-gateway/epuck1/state/image"
    out = tmp_path / "cam.mcap"
    base = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root}
    port = free_port()
    sim = spawn(["-m", "services.epuck_gateway.sim", "--count", "1", "--base-port", str(port), "--image-fps", "10"],
                {})
    rec = spawn(["-m", "shared.tools.record_cli", "record", "-o", str(out)], {**base, "ROBOBUS_RECORD_FLUSH_S": "0.2"})
    assert wait_for(lambda: any("subscribed" in line for line in rec.output), 60), rec.text()
    gw = spawn(["-m", "services.epuck_gateway"], {
        **base, "ROBOBUS_EPUCK_ROBOTS": json.dumps([{"id": "epuck1", "host": "127.0.0.1", "port": port}])})
    assert wait_for(lambda: flushed_images(out, tmp_path / "probe.mcap", topic) >= 8, 90), gw.text() + sim.text()
    rec.signal(signal.SIGINT)
    rec.proc.wait(30)
    assert rec.proc.returncode == 0, rec.text()
    gw.stop()
    sim.stop()

    # -- read back by the independent implementation: its summary, its schemas, its decoding of each message ----
    info = json.loads(pymcap("info-json", str(out)))
    chans = [c for c in info["channels"] if c["topic"] == topic]
    assert len(chans) == 2, chans
    schemas = {s["id"]: s for s in info["schemas"]}
    raw_ch = next(c for c in chans if c["schema_id"] == 0)
    derived_ch = next(c for c in chans if c["schema_id"] != 0)
    schema = schemas[derived_ch["schema_id"]]
    assert (schema["name"], schema["encoding"]) == ("foxglove.CompressedImage", "jsonschema")
    assert json.loads(schema["data"]) == images.SCHEMA  # what the live bridge advertises
    assert raw_ch["message_count"] == derived_ch["message_count"] >= 8
    listing = tmp_path / "cat.jsonl"
    pymcap("cat", str(out), "--bytes", "base64", "-o", str(listing))
    lines = [json.loads(line) for line in listing.read_text().splitlines()]
    mine = [m for m in lines if m["topic"] == topic]
    raw = [m for m in mine if "schema" not in m]
    derived = [m for m in mine if m.get("schema") == "foxglove.CompressedImage"]
    assert len(raw) == len(derived) == raw_ch["message_count"] and len(mine) == len(raw) + len(derived)
    validator = jsonschema.Draft202012Validator(json.loads(schema["data"]))
    for r, d in zip(raw, derived, strict=True):
        validator.validate(d["message"])
        image = base64.b64decode(d["message"]["data"], validate=True)
        assert image == base64.b64decode(r["message"]), "the derived image is the raw one"
        assert d["log_time"] == r["log_time"] and d["message"]["format"] == "jpeg"
        assert d["message"]["frame_id"] == "epuck1"
        assert d["message"]["timestamp"]["sec"] * 10**9 + d["message"]["timestamp"]["nsec"] == r["log_time"]
        with Image.open(io.BytesIO(image)) as im:  # a real JPEG, whole
            assert im.format == "JPEG" and im.size[0] > 0
            im.load()

    # -- replayed through the broker by the real CLI: only the raw bytes, once each -------------------------------
    new_root = f"{root}-replay"
    arrived: list[tuple[str, bytes, str | None]] = []
    lock = threading.Lock()

    def on(m: mqtt.MQTTMessage) -> None:
        with lock:
            arrived.append((m.topic, bytes(m.payload), getattr(m.properties, "ContentType", None)))

    with RpcClient(broker_session.settings(), name="cam-replay-sub") as sub:
        sub.subscribe_before(f"{new_root}/epuck-gateway/epuck1/state/image", on)
        rp = spawn(["-m", "shared.tools.record_cli", "replay", str(out), "--root", new_root, "--rate", "0"],
                   {"ROBOBUS_MQTT_URL": broker_session.url})
        rp.proc.wait(120)
        assert rp.proc.returncode == 0, rp.text()
        assert wait_for(lambda: len(arrived) >= len(raw), 20), (len(arrived), len(raw))
    # derived messages, had they been republished, would come each right after its image: among the first ones
    assert [d for _t, d, _c in arrived] == [base64.b64decode(r["message"]) for r in raw]
    assert all(c == "image/jpeg" for _t, _d, c in arrived)
