"""Kit benchmark: command round trip through the kit vs a bare paho echo pair, and validated-JSON
state publish throughput of one process for a 40-field model.

Both round trips run in one run, side by side, against one fresh mosquitto on loopback with
TCP_NODELAY at both ends, QoS 1, MQTT 5 Response Topic + Correlation Data. The servers run in
their own processes, as they would in production.

    python bench/rpc.py [--quick] [--calls N] [--messages N]

Targets: p50 <= 1 ms, p99 <= 5 ms; (on a quiet machine) kit/bare p50 <= 1.15 and p99 <= 1.5,
>= 25,000 validated 40-field messages/s delivered.
Last line: one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from pydantic import BaseModel, create_model  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from shared import Node, ServiceAPI  # noqa: E402
from shared.mqtt.session import _nodelay, reply_properties  # noqa: E402
from shared.rpc import RpcClient, wait_for  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

# A 40-field state model: floats, ints, bools and strings, like a motor or sensor record.
_FIELDS: dict[str, tuple[type, object]] = {}
for i in range(40):
    kind = (float, int, bool, str)[i % 4]
    _FIELDS[f"f{i:02d}"] = (kind, ...)
Wide = create_model("BenchWide40", **_FIELDS)  # type: ignore[call-overload]
API = ServiceAPI("bench-rpc")
WIDE = API.state("wide", Wide, rate_hz=None, retain=False)


class EchoReq(BaseModel):
    seq: int
    text: str = ""


ECHO = API.command("echo", EchoReq, EchoReq)
ECHO_INLINE = API.command("echo_inline", EchoReq, EchoReq)


def sample_dict(i: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, (kind, _) in _FIELDS.items():
        out[k] = {float: i * 0.5, int: i, bool: i % 2 == 0, str: f"v{i}"}[kind]
    return out


# -- servers (run in subprocesses) -------------------------------------------------------------
def serve_kit(url: str) -> None:
    from shared.settings import KitSettings

    node = Node(API, KitSettings(mqtt_url=url, node="bench"))
    node.device("d").bind(ECHO, lambda r: r)
    node.device("d").bind(ECHO_INLINE, lambda r: r, inline=True)
    node.run()


def serve_bare_loop(url: str, topic: str, respond: Callable[[bytes], tuple[bytes, str]]) -> None:
    """A bare paho request/reply server: `respond(request payload) -> (reply payload, content type)`, answered on
    the request's Response Topic with its Correlation Data at QoS 1, from paho's network thread."""
    port = int(url.rsplit(":", 1)[1])
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bare-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5)
    c.on_socket_open = _nodelay

    def on_connect(cl, ud, fl, rc, pr=None):  # type: ignore[no-untyped-def]
        cl.subscribe(topic, qos=1)

    def on_message(cl, ud, msg):  # type: ignore[no-untyped-def]
        p = msg.properties
        payload, content_type = respond(msg.payload)
        cl.publish(p.ResponseTopic, payload, qos=1, properties=reply_properties(None, p.CorrelationData, content_type))

    c.on_connect = on_connect
    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.loop_forever()


def serve_bare(url: str, topic: str) -> None:
    """A bare paho echo: the least a correct MQTT 5 request/reply server can do."""
    serve_bare_loop(url, topic, lambda payload: (payload, "application/json"))


# -- clients -----------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def kit_round_trips(c: RpcClient, n: int, command: str = "echo") -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        rep = c.call("bench", "d", command, {"seq": i, "text": "x"}, timeout=5)
        out.append((time.perf_counter() - t0) * 1000)
        assert rep.ok and rep.result["seq"] == i
    return out


class BareClient:
    """A bare paho requester (QoS 1, Response Topic + Correlation Data) on one connection: `call()` is one
    round trip through the bare echo, in ms."""

    def __init__(self, url: str, topic: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        self.topic = topic
        self.replies: queue.Queue[bytes] = queue.Queue()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"barec-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5)
        c.on_socket_open = _nodelay
        self.rt = f"bench/_bare/{uuid.uuid4().hex[:8]}"
        c.on_message = lambda cl, ud, msg: self.replies.put(msg.properties.CorrelationData)  # type: ignore[union-attr]
        c.connect("127.0.0.1", port)
        c.loop_start()
        c.subscribe(self.rt, qos=1)
        time.sleep(0.3)
        self.c = c
        self.seq = 0

    def call(self) -> float:
        corr = uuid.uuid4().bytes
        payload = json.dumps({"seq": self.seq, "text": "x"})
        self.seq += 1
        t0 = time.perf_counter()
        self.c.publish(self.topic, payload, qos=1, properties=reply_properties(self.rt, corr, "application/json"))
        while self.replies.get(timeout=5) != corr:
            pass
        return (time.perf_counter() - t0) * 1000

    def close(self) -> None:
        self.c.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        self.c.loop_stop()


def bare_round_trips(url: str, topic: str, n: int) -> list[float]:
    c = BareClient(url, topic)
    try:
        return [c.call() for _ in range(n)]
    finally:
        c.close()


def publish_throughput(url: str, n: int) -> dict[str, float]:
    """Validated publishes from one process: dict -> model validation -> JSON -> paho, counted at a subscriber
    in another process (so the figure is messages that reached the broker and came out again)."""
    from shared.settings import KitSettings

    topic = "robobus/benchpub/d/state/wide"
    counter = subprocess.Popen(
        ["mosquitto_sub", "-p", url.rsplit(":", 1)[1], "-h", "127.0.0.1", "-t", topic, "-C", str(n), "-q", "0"],
        stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    node = Node(API, KitSettings(mqtt_url=url, node="benchpub", mqtt_max_queued=n + 10))
    dev = node.device("d")
    dev.bind(ECHO, lambda r: r)  # the node answers its whole API (Node.check_bindings); nothing calls them here
    dev.bind(ECHO_INLINE, lambda r: r, inline=True)
    node.start()
    assert node.session.wait_ready(10)
    samples = [sample_dict(i) for i in range(1000)]
    t0 = time.perf_counter()
    for i in range(n):
        dev.publish(WIDE, Wide.model_validate(samples[i % 1000]))  # validate, then the kit serialises
    t_pub = time.perf_counter() - t0
    try:
        counter.wait(60)
    except subprocess.TimeoutExpired:
        counter.kill()
    t_all = time.perf_counter() - t0
    node.stop()
    return {"messages": n, "publish_rate": n / t_pub, "delivered_rate": n / t_all,
            "delivered_all": counter.returncode == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    ap.add_argument("--calls", type=int, default=None, help="round trips per side")
    ap.add_argument("--messages", type=int, default=None, help="messages for the throughput test")
    ap.add_argument("--serve-kit", help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_kit:
        return serve_kit(a.serve_kit)
    if a.serve_bare:
        return serve_bare(*a.serve_bare)
    calls = a.calls or (1000 if a.quick else 5000)
    messages = a.messages or (30000 if a.quick else 100000)

    with tempfile.TemporaryDirectory() as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        bare_topic = "bench/bare/echo"
        procs = [subprocess.Popen([sys.executable, __file__, "--serve-kit", broker.url], env=env),
                 subprocess.Popen([sys.executable, __file__, "--serve-bare", broker.url, bare_topic], env=env)]
        try:
            c = RpcClient(broker.settings())
            c.connect()

            def up() -> bool:
                try:
                    return c.call("bench", "d", "echo", {"seq": 0}, timeout=0.5).ok
                except TimeoutError:
                    return False

            assert wait_for(up, 20), "kit echo server did not come up"
            kit_round_trips(c, 200)  # warm-up
            bare_round_trips(broker.url, bare_topic, 200)
            # interleave halves so that machine noise hits both sides alike
            kit: list[float] = []
            inline: list[float] = []
            bare: list[float] = []
            for _ in range(2):
                kit += kit_round_trips(c, calls // 2)
                inline += kit_round_trips(c, calls // 2, "echo_inline")
                bare += bare_round_trips(broker.url, bare_topic, calls // 2)
            c.close()
            thr = publish_throughput(broker.url, messages)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
            broker.kill()

    res: dict[str, Any] = {
        "bench": "rpc",
        "calls": len(kit),
        "kit_p50_ms": round(pct(kit, 50), 3), "kit_p99_ms": round(pct(kit, 99), 3),
        "kit_max_ms": round(max(kit), 3),
        "kit_inline_p50_ms": round(pct(inline, 50), 3), "kit_inline_p99_ms": round(pct(inline, 99), 3),
        "bare_p50_ms": round(pct(bare, 50), 3), "bare_p99_ms": round(pct(bare, 99), 3),
        "kit_bare_p50_ratio": round(pct(kit, 50) / pct(bare, 50), 3),
        "kit_bare_p99_ratio": round(pct(kit, 99) / pct(bare, 99), 3),
        "validated_msgs": thr["messages"],
        "validated_publish_per_s": round(thr["publish_rate"]),
        "validated_delivered_per_s": round(thr["delivered_rate"]),
        "delivered_all": thr["delivered_all"],
        "targets": {"p50_ms": 1.0, "p99_ms": 5.0, "kit_bare_p50_ratio": 1.15, "kit_bare_p99_ratio": 1.5,
                    "msgs_per_s": 25000},
    }
    res["ratio_p50_to_target"] = round(res["kit_p50_ms"] / 1.0, 3)
    res["ratio_p99_to_target"] = round(res["kit_p99_ms"] / 5.0, 3)
    res["ratio_p50_ratio_to_target"] = round(res["kit_bare_p50_ratio"] / 1.15, 3)
    res["ratio_p99_ratio_to_target"] = round(res["kit_bare_p99_ratio"] / 1.5, 3)
    res["ratio_msgs_to_target"] = round(res["validated_delivered_per_s"] / 25000, 3)
    res["meets_targets"] = bool(res["kit_p50_ms"] <= 1 and res["kit_p99_ms"] <= 5
                                and res["kit_bare_p50_ratio"] <= 1.15 and res["kit_bare_p99_ratio"] <= 1.5
                                and res["validated_delivered_per_s"] >= 25000)
    print(f"kit  round trip: p50 {res['kit_p50_ms']} ms  p99 {res['kit_p99_ms']} ms  (n={len(kit)})")
    print(f"kit  inline:     p50 {res['kit_inline_p50_ms']} ms  p99 {res['kit_inline_p99_ms']} ms")
    print(f"bare round trip: p50 {res['bare_p50_ms']} ms  p99 {res['bare_p99_ms']} ms")
    print(f"kit / bare:      p50 {res['kit_bare_p50_ratio']} (target 1.15)  "
          f"p99 {res['kit_bare_p99_ratio']} (target 1.5)")
    print(f"validated 40-field publishes: {res['validated_delivered_per_s']}/s delivered "
          f"({res['validated_publish_per_s']}/s handed to paho)")
    report("rpc", res, [
        Figure("kit ÷ bare paho round trip, p50", res["kit_bare_p50_ratio"], "×", "<=", 1.15),
        Figure("kit ÷ bare paho round trip, p99", res["kit_bare_p99_ratio"], "×", "<=", 1.5),
        Figure("kit round trip, p50", res["kit_p50_ms"], "ms", "<=", 1.0),
        Figure("kit round trip, p99", res["kit_p99_ms"], "ms", "<=", 5.0),
        Figure("validated 40-field state messages delivered", res["validated_delivered_per_s"], "/s", ">=", 25000),
    ], variant=variant_name("quick" if a.quick else ""))


if __name__ == "__main__":
    main()
