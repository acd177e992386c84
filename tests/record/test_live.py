"""`robobus record` as its own process against a real mosquitto: retained flags and MQTT 5 properties as
the broker delivers them, a clean file on Ctrl-C (SIGINT) and SIGTERM, a recoverable file after SIGKILL,
recording resumed after the broker comes back, and `replay` through the broker."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from mcap.reader import make_reader

from shared.mqtt.session import reply_properties
from shared.rpc import RpcClient, wait_for
from shared.tools.localbroker import Broker, NodeProcess
from shared.tools.replay import RecordingError, inspect, recover

RECORD = ["-m", "shared.tools.record_cli", "record"]


def start_recorder(spawn: Any, broker: Broker, out: Path, *args: str, **env: str) -> NodeProcess:
    proc: NodeProcess = spawn([*RECORD, "-o", str(out), *args],
                              {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_RECORD_FLUSH_S": "0.2", **env})
    assert wait_for(lambda: any("subscribed" in line for line in proc.output) or not proc.alive(), 60), proc.text()
    assert proc.alive(), proc.text()
    return proc


def messages(path: Path) -> list[tuple[str, bytes, dict[str, str]]]:
    with open(path, "rb") as f:
        return [(c.topic, m.data, dict(c.metadata)) for _s, c, m in make_reader(f).iter_messages()]


def test_sigint_closes_a_complete_file_with_retained_flags_and_properties(
        broker_session: Broker, client: RpcClient, spawn: Any, tmp_path: Path) -> None:
    root = f"rec{time.monotonic_ns() % 10**9}"
    client.session.publish_wait(f"{root}/n1/status", b'{"online": true}', retain=True)
    out = tmp_path / "a.mcap"
    proc = start_recorder(spawn, broker_session, out, "--root", root)
    for i in range(20):
        client.session.publish(f"{root}/n1/d/state/x", json.dumps({"i": i}), qos=1)
    client.session.publish(f"{root}/n1/d/cmd/go", b"{}", qos=1,
                           properties=reply_properties("me/reply", b"\x07\x08", "application/json"))
    client.session.publish(f"{root}/n1/d/state/image", b"\x00\x01binary", qos=0,
                           properties=reply_properties(None, None, "image/png"))
    assert wait_for(lambda: any("state/image" in t for t, _, _ in _try(tmp_path, out)), 20)
    proc.signal(signal.SIGINT)
    proc.proc.wait(30)
    assert proc.proc.returncode == 0, proc.text()
    got = messages(out)  # a complete file: the seeking reader needs the summary
    status = [m for t, _, m in got if t == f"{root}/n1/status"]
    assert status and status[0]["mqtt.retain"] == "true"
    xs = [json.loads(d)["i"] for t, d, _ in got if t.endswith("state/x")]
    assert xs == list(range(20))
    image = next(m for t, _, m in got if t.endswith("state/image"))
    assert image["mqtt.content_type"] == "image/png"
    props = [json.loads(d) for t, d, _ in got if t == "_robobus/mqtt_properties"]
    assert props and props[0]["response_topic"] == "me/reply" and props[0]["correlation_data"] == "0708"
    assert any("messages on" in line for line in proc.output), proc.text()


def _try(tmp_path: Path, out: Path) -> list[tuple[str, bytes, dict[str, str]]]:
    """What a recorder has flushed so far (the file is unfinished while it runs)."""
    probe = tmp_path / "probe.mcap"
    try:
        recover(out, probe)
        return messages(probe)
    except Exception:
        return []


def test_sigkill_leaves_a_file_recover_repairs(broker_session: Broker, client: RpcClient, spawn: Any,
                                               tmp_path: Path) -> None:
    root = f"kill{time.monotonic_ns() % 10**9}"
    out = tmp_path / "killed.mcap"
    proc = start_recorder(spawn, broker_session, out, "--root", root)
    for i in range(300):
        client.session.publish(f"{root}/n/d/state/x", json.dumps({"i": i}), qos=1)
    # flushed at least every ROBOBUS_RECORD_FLUSH_S: wait until all 300 are on disk, then kill -9
    assert wait_for(lambda: sum(t.endswith("state/x") for t, _, _ in _try(tmp_path, out)) == 300, 30)
    proc.signal(signal.SIGKILL)
    proc.proc.wait(10)
    try:
        inspect(out)
        raise AssertionError("a killed recorder's file should have no summary")
    except RecordingError as exc:
        assert "robobus recover" in str(exc)
    fixed = tmp_path / "fixed.mcap"
    r = recover(out, fixed)
    xs = [json.loads(d)["i"] for t, d, _ in messages(fixed) if t.endswith("state/x")]
    assert xs == list(range(300)), r
    assert inspect(fixed).messages == r.messages


def test_sigterm_and_duration_rotation(broker_session: Broker, client: RpcClient, spawn: Any,
                                       tmp_path: Path) -> None:
    root = f"rot{time.monotonic_ns() % 10**9}"
    out = tmp_path / "run.mcap"
    proc = start_recorder(spawn, broker_session, out, "--root", root, "--max-duration", "1")
    sent = 0
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("run-*.mcap"))) < 3 and time.monotonic() < deadline:
        client.session.publish(f"{root}/n/d/state/x", json.dumps({"i": sent}), qos=1)
        sent += 1
        time.sleep(0.01)
    # the last one acknowledged by the broker, then time for it to reach the recorder: what is in flight at
    # SIGTERM is not what this test is about (nothing lost or repeated across the parts is)
    client.session.publish_wait(f"{root}/n/d/state/x", json.dumps({"i": sent}), qos=1)
    sent += 1
    time.sleep(2.0)
    proc.stop(30)
    assert proc.proc.returncode == 0, proc.text()
    files = sorted(tmp_path.glob("run-*.mcap"))
    assert len(files) >= 3
    xs = [json.loads(d)["i"] for f in files for t, d, _ in messages(f) if t.endswith("state/x")]
    assert xs == list(range(sent))  # nothing lost or repeated across the parts


def test_recording_resumes_after_the_broker_restarts(broker: Broker, spawn: Any, tmp_path: Path) -> None:
    out = tmp_path / "b.mcap"
    proc = start_recorder(spawn, broker, out, "--wait-broker", "0", ROBOBUS_MQTT_RECONNECT_MAX_S="0.5")
    with RpcClient(broker.settings(), name="t") as c:
        c.session.publish_wait("robobus/n/d/state/x", b'{"i": 0}')
        assert wait_for(lambda: len(_try(tmp_path, out)) >= 1, 20)
    broker.restart()
    n = len(proc.output)
    assert wait_for(lambda: any("subscribed" in line for line in proc.output[n:]), 30), proc.text()
    with RpcClient(broker.settings(), name="t2") as c:
        c.session.publish_wait("robobus/n/d/state/x", b'{"i": 1}')
        assert wait_for(lambda: len(_try(tmp_path, out)) >= 2, 20)
    proc.stop(30)
    assert [json.loads(d)["i"] for t, d, _ in messages(out) if t.endswith("state/x")] == [0, 1]


def test_no_broker_exits_3_with_one_clear_line(spawn: Any, tmp_path: Path) -> None:
    from shared.tools.localbroker import free_port

    proc = spawn([*RECORD, "-o", str(tmp_path / "x.mcap"), "--wait-broker", "1"],
                 {"ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{free_port()}"})
    proc.proc.wait(60)
    assert proc.proc.returncode == 3, proc.text()
    assert wait_for(lambda: any("no broker at" in line for line in proc.output), 5), proc.text()


def test_if_enabled_idles_until_stopped_when_recording_is_off(spawn: Any, tmp_path: Path) -> None:
    """make run's `recorder` process: off unless ROBOBUS_RECORD=1, and then it must stay up (make run's
    supervisor starts a process that exits again) and stop cleanly."""
    proc = spawn([*RECORD, "--if-enabled", "-o", str(tmp_path / "x.mcap")], {"ROBOBUS_RECORD": "0"})
    assert wait_for(lambda: any("recording off" in line for line in proc.output), 60), proc.text()
    time.sleep(0.5)
    assert proc.alive()
    assert proc.stop(20) == 0, proc.text()
    assert not (tmp_path / "x.mcap").exists()


def test_if_enabled_records_when_on(broker_session: Broker, client: RpcClient, spawn: Any, tmp_path: Path) -> None:
    root = f"on{time.monotonic_ns() % 10**9}"
    out = tmp_path / "on.mcap"
    proc = start_recorder(spawn, broker_session, out, "--if-enabled", "--root", root, ROBOBUS_RECORD="1")
    client.session.publish_wait(f"{root}/n/d/state/x", b'{"i": 0}')
    assert wait_for(lambda: len(_try(tmp_path, out)) >= 1, 20)
    assert proc.stop(30) == 0, proc.text()
    assert [t for t, _, _ in messages(out)] == [f"{root}/n/d/state/x"]


def test_a_full_disk_stops_the_recorder_with_a_clear_error(broker_session: Broker, client: RpcClient,
                                                           tmp_path: Path) -> None:
    """Writes failing (here: RLIMIT_FSIZE, EFBIG; Python ignores SIGXFSZ) end the recording with one
    line and exit 1, instead of a reconnect loop that would look like a broker problem."""
    import os
    import resource
    import subprocess
    import sys

    from shared.tools.localbroker import REPO

    root = f"full{time.monotonic_ns() % 10**9}"
    out = tmp_path / "full.mcap"
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_RECORD_FLUSH_S": "0.1",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.tools.record_cli", "record", "-o", str(out), "--root", root], cwd=REPO,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000)))
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if "subscribed" in line:
                break
        deadline = time.monotonic() + 60
        i = 0
        while proc.poll() is None and time.monotonic() < deadline:
            client.session.publish(f"{root}/n/d/state/x", json.dumps({"i": i, "r": os.urandom(400).hex()}))
            i += 1
            if i % 50 == 0:
                time.sleep(0.05)
        rest = proc.communicate(timeout=30)[0]
        text = "".join(lines) + rest
        assert proc.returncode == 1, text
        assert "cannot write" in text and "File too large" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
