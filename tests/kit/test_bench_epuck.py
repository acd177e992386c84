"""bench/epuck.py's reference and the parsing of what it prints: the bare reference (a child process that reads the
same robots' bytes without decoding them and publishes the gateway's message rates with stock paho) reads the
simulated robots' streams, publishes at the asked rates, and reports its counters as JSON lines the bench reads.
No CPU figure is asserted here: that is the bench's own verdict."""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from services.epuck_gateway.protocol.wifi import REQ_SENSORS, SENSORS_SIZE
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from shared.tools.localbroker import Broker, free_port

REPO = Path(__file__).resolve().parents[2]
# the bench imports its siblings (`results`, `ethercat_cycle`) as top-level modules: the bench directory on the
# path only for that
sys.path.insert(0, str(REPO / "bench"))
try:
    epuck = importlib.import_module("epuck")
finally:
    sys.path.remove(str(REPO / "bench"))


def test_topic_kind_drops_the_root_service_and_robot() -> None:
    assert epuck.topic_kind("robobus/epuck-gateway/epuck7/state/sensors") == "state/sensors"
    assert epuck.topic_kind("robobus/epuck-gateway/epuck7/health") == "health"
    assert epuck.topic_kind("robobus/epuck-gateway/epuck7/event/fault") == "event/fault"
    assert epuck.topic_kind("odd") == "odd"


def test_reference_messages_are_the_windows_rates_and_mean_sizes() -> None:
    kinds = {"state/sensors": [5000, 3_825_000], "state/image": [500, 2_500_000], "state/link": [0, 0]}
    assert epuck.reference_messages(kinds, 10.0) == [["state/image", 5000, 50.0], ["state/sensors", 765, 500.0]]
    assert epuck.reference_messages(kinds, 0.0) == []


def test_cpu_ratio_is_none_without_a_reference() -> None:
    assert epuck.cpu_ratio(30.0, 20.0) == 1.5
    assert epuck.cpu_ratio(30.0, 0.0) is None


def test_rate_of_nominal_says_how_much_of_the_robots_rate_arrived() -> None:
    assert epuck.rate_of_nominal(2250.0, 50, 50.0) == 0.9
    assert epuck.rate_of_nominal(400.0, 50, 50.0) < epuck.STARVED_BELOW
    assert epuck.rate_of_nominal(10.0, 0, 50.0) is None


def test_read_json_line_skips_other_output_and_finds_its_key() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('log line'); print('{\"other\": 1}'); "
                             "print('{\"bare\": {\"bytes\": 5}}')"], stdout=subprocess.PIPE, text=True)
    try:
        assert epuck.read_json_line(proc, "bare", 10) == {"bare": {"bytes": 5}}
    finally:
        proc.wait(10)


def test_a_window_measures_a_process_and_the_load_at_its_start_and_end() -> None:
    import os

    w = epuck.Window(os.getpid(), [os.getpid()])
    end = time.thread_time() + 0.05
    while time.thread_time() < end:  # some CPU of our own
        pass
    w.end()
    assert w.seconds > 0 and w.cpu_s > 0 and w.cpu_pct > 0
    assert len(w.loads) == 2 and w.other_cores >= 0


@pytest.mark.slow
def test_the_bare_reference_reads_every_robot_and_publishes_at_the_asked_rates(tmp_path: Path) -> None:
    broker = Broker(free_port(), tmp_path)
    broker.start()
    sims = EpuckSimThread(2, EpuckSimConfig(sensors_hz=50.0, image_holds_cycle=False)).start()
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def on_message(_c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with lock:
            key = f"{msg.topic.split('/')[2]}/{msg.topic.split('/', 3)[3]}:{len(msg.payload)}"
            seen[key] = seen.get(key, 0) + 1

    sub = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sub.on_message = on_message
    sub.connect("127.0.0.1", broker.port)
    sub.subscribe("bench/bare/#")
    sub.loop_start()
    spec = {"robots": [["127.0.0.1", r.port] for r in sims.robots], "robot_names": [r.name for r in sims.robots],
            "request": REQ_SENSORS, "broker": broker.url,
            "messages": [["state/sensors", 700, 100.0], ["state/link", 400, 2.0]]}
    bare = subprocess.Popen([sys.executable, str(REPO / "bench" / "epuck.py"), "--bare", json.dumps(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert epuck.read_json_line(bare, "bare_ready", 20) == {"bare_ready": {"robots": 2}}
        bare.send_signal(signal.SIGUSR1)
        c0 = epuck.read_json_line(bare, "bare", 10)["bare"]
        time.sleep(2.0)
        bare.send_signal(signal.SIGUSR1)
        c1 = epuck.read_json_line(bare, "bare", 10)["bare"]
        bare.send_signal(signal.SIGTERM)
        last = epuck.read_json_line(bare, "bare", 10)["bare"]
        assert bare.wait(10) == 0
    finally:
        if bare.poll() is None:
            bare.kill()
            bare.wait(5)
        sub.loop_stop()
        sims.close()
        broker.kill()
    # two robots' sensors at 50 Hz each (1 id byte + the packet), read without decoding: about 2 s worth
    per_s = (c1["bytes"] - c0["bytes"]) / 2.0
    assert 0.5 * 100 * (1 + SENSORS_SIZE) < per_s < 1.5 * 100 * (1 + SENSORS_SIZE), (c0, c1)
    assert c1["reads"] > c0["reads"]
    # 102 messages a second in all, spread over both robots, of the asked sizes
    assert 0.7 * 102 * 2 < c1["published"] - c0["published"] < 1.3 * 102 * 2, (c0, c1)
    assert last["published"] >= c1["published"]
    with lock:
        assert set(seen) >= {"epuck1/state/sensors:700", "epuck2/state/sensors:700", "epuck1/state/link:400"}, seen
        assert {k.split(":")[1] for k in seen} == {"700", "400"}
