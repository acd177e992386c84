"""The fleet bench's site traffic: one `make run` site's uplink, recorded once, committed as bench/fleet_sample.json.gz.

What crosses a site's bridge (make_secrets.bridge_conf): its nodes' status, health and events (QoS 1, as
published), the replies to the centre's requests, and the states only through deploy/uplink.py's budget (2 per
second and 4096 B/s per state topic by default, no camera frames). The recorder runs `make run`'s processes on
their simulators (tests/chaos/stack.py: the same deploy/Procfile.sim), subscribes to exactly those topics, passes
the states through uplink.py's own `Budget` with its default settings, and keeps every message that would cross:
its time, topic (under the root), QoS, retain flag and payload. A quiet site is commanded by nobody, so the sample
holds no replies; the bench's commands at the centre add their own.

    python bench/fleet_record.py [--seconds 60] [--out bench/fleet_sample.json.gz]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import importlib.util
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

SAMPLE = REPO / "bench" / "fleet_sample.json.gz"
ROOT = "robobus"
# what the bridge carries out as it comes (make_secrets.BRIDGE_OUT but the bridge's own topics); states apart
AS_PUBLISHED = ("+/status", "+/+/health", "+/+/event/+", "_client/+/reply", "+/+/cmd/+/reply")
STATES = "+/+/state/+"


@dataclass(frozen=True)
class Message:
    t: float  # seconds from the start of the sample
    topic: str  # under the site's root
    qos: int
    retain: bool
    payload: bytes


def load_uplink() -> Any:
    spec = importlib.util.spec_from_file_location("robobus_uplink", REPO / "deploy" / "uplink.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # pydantic resolves the settings' annotations through it
    spec.loader.exec_module(mod)
    return mod


def record(seconds: float) -> tuple[list[Message], list[Message], float]:
    from tests.chaos.stack import SimStack  # late: starts nothing on import, but imports the kit

    uplink = load_uplink()
    defaults = uplink.UplinkSettings()
    out: list[Message] = []
    initial: dict[str, Message] = {}
    lock = threading.Lock()
    t0 = [0.0]

    def keep(topic: str, payload: bytes, qos: int, retain: bool) -> None:
        if t0[0] == 0.0:
            if retain:  # what the site holds retained when its bridge connects (its nodes' status among them)
                initial[topic[len(ROOT) + 1:]] = Message(0.0, topic[len(ROOT) + 1:], qos, retain, payload)
            return
        with lock:
            out.append(Message(time.monotonic() - t0[0], topic[len(ROOT) + 1:], qos, retain, payload))

    budget = uplink.Budget(defaults.uplink_state_hz, set(defaults.uplink_drop.split()),
                           lambda topic, payload, retain, props: keep(topic, payload, 0, retain),
                           bytes_s=defaults.uplink_state_bytes_s)
    stack = SimStack(ROOT)
    stack.start()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fleet-record", protocol=mqtt.MQTTv5)

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        # the retain flag as published (status, health and states are retained: the centre stores them too); the
        # retained copies from before the start arrive before t0: the site's retained set, not its traffic
        if "/state/" in msg.topic and t0[0]:
            budget.state(msg.topic, bytes(msg.payload), bool(msg.retain), None)
        else:
            keep(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain))

    client.on_message = on_message
    stop = threading.Event()
    try:
        client.connect("127.0.0.1", stack.broker.port)
        client.subscribe([(f"{ROOT}/{t}", SubscribeOptions(qos=1, retainAsPublished=True)) for t in AS_PUBLISHED]
                         + [(f"{ROOT}/{STATES}", SubscribeOptions(qos=0, retainAsPublished=True))])
        client.loop_start()
        time.sleep(2.0)
        t0[0] = time.monotonic()

        def tick() -> None:  # what uplink.py's loop does: held-back states go when their slot opens
            while not stop.wait(0.05):
                budget.tick()

        threading.Thread(target=tick, daemon=True).start()
        time.sleep(seconds)
    finally:
        stop.set()
        client.loop_stop()
        stack.stop()
    with lock:
        return [m for m in out if m.t <= seconds], list(initial.values()), seconds


def save(messages: list[Message], initial: list[Message], seconds: float, path: Path) -> None:
    doc = {"duration_s": seconds, "root": ROOT, "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "how": "bench/fleet_record.py: make run's processes on simulators, the bridge's topics, states through "
                  "deploy/uplink.py's default budget",
           "messages": [[round(m.t, 4), m.topic, m.qos, int(m.retain), base64.b64encode(m.payload).decode()]
                        for m in sorted(messages, key=lambda m: m.t)],
           # sent once when a site's bridge connects (mosquitto gives a new bridge subscription the retained set)
           "retained": [[m.topic, m.qos, base64.b64encode(m.payload).decode()] for m in initial]}
    path.write_bytes(gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), 9, mtime=0))


def load(path: Path = SAMPLE) -> tuple[list[Message], list[Message], float]:
    """(the messages, the retained set at the start, the sample's length in seconds)."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    msgs = [Message(t, topic, qos, bool(retain), base64.b64decode(p)) for t, topic, qos, retain, p in doc["messages"]]
    initial = [Message(0.0, topic, qos, True, base64.b64decode(p)) for topic, qos, p in doc["retained"]]
    return msgs, initial, float(doc["duration_s"])


def summary(messages: list[Message], seconds: float) -> dict[str, Any]:
    """Messages and bytes per second of one site's uplink, by kind (the topic's last-but-one level or status)."""
    kinds: dict[str, list[int]] = {}
    for m in messages:
        parts = m.topic.split("/")
        kind = "reply" if parts[-1] == "reply" else "state" if parts[-2] == "state" else parts[-1]
        k = kinds.setdefault(kind, [0, 0])
        k[0] += 1
        k[1] += len(m.payload)
    return {"seconds": seconds, "msgs_per_s": round(len(messages) / seconds, 2),
            "bytes_per_s": round(sum(len(m.payload) for m in messages) / seconds, 1),
            "topics": len({m.topic for m in messages}),
            "by_kind": {k: {"msgs_per_s": round(n / seconds, 2), "bytes_per_s": round(b / seconds, 1),
                            "mean_bytes": round(b / n, 1)} for k, (n, b) in sorted(kinds.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=SAMPLE)
    args = ap.parse_args()
    messages, initial, seconds = record(args.seconds)
    save(messages, initial, seconds, args.out)
    print(json.dumps({**summary(messages, seconds), "retained_at_start": len(initial),
                      "retained_bytes": sum(len(m.payload) for m in initial)}, indent=1))
    print(f"{len(messages)} messages, {args.out.stat().st_size} bytes in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
