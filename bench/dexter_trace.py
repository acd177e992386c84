"""Where a `heartbeat` round trip through dexter-gateway spends its time: monotonic stamps along the whole path.

    python bench/dexter_trace.py [--calls 2000]

The same set-up as bench/dexter.py (a private mosquitto, simulators in their own processes, the gateway in its
own process, the client in this one), but the gateway runs with a tracer patched in (`--serve-gateway`, this
file: wrappers around the kit's and the gateway's functions, in the traced process only; nothing in the
product changes). Stamps are `time.monotonic_ns` (CLOCK_MONOTONIC, one clock for every process on the
host), keyed by the request's Correlation Data:

  client: c0 (call) -> c_pub (request written) ... c_rx (reply on paho's thread) -> c_end (caller has it)
  gateway: gw_rx (paho's on_message) -> pool (command pool thread) -> handler -> ex0 (exchange: send) ->
           sent -> recv (reply bytes) -> ex1 (decoded, matched) -> model (reply model built) -> pub0 (publish)
           -> pub_done

With the inline path (heartbeat on paho's thread while the link is idle), `pool` is where the dispatcher's
`handle` starts on paho's thread: `gw_rx -> pool` is then the kit's routing, with no thread hop.
`c_pub -> gw_rx` is the broker's forward plus the gateway's read; `pub0 -> c_rx` the reply's way back. Each row is
the p50 of that segment over every call (no call dropped); the rows' p50s need not add up to the total's.
In the same interleaved rounds: the raw socket `h` round trip, the bare paho echo (bench/dexter.py's broker hop)
and the kit's client against that same bare echo (so the client side of the comparison is seen too).
The stamps cost a few µs a stage; the figures are for finding where time goes, not for the targets.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

STAGES = ["c0", "c_pub", "gw_rx", "pool", "handler", "ex0", "sent", "recv", "ex1", "model", "pub0", "pub_done",
          "c_rx", "c_end"]


def install_tracer(out: str) -> None:
    """In the gateway process: wrap the functions on the path, stamp per correlation, dump at exit."""
    import socket

    from services.dexter_gateway import device as svc
    from services.dexter_gateway import protocol
    from services.dexter_gateway import transport as tr
    from shared import dispatch
    from shared.mqtt import session as mqtt

    ns = time.monotonic_ns
    rec: dict[bytes, dict[str, int]] = {}
    cur = threading.local()

    def stamp(key: str) -> None:
        c = getattr(cur, "c", None)
        if c is not None:
            rec[c][key] = ns()

    def wrap(cls: Any, name: str, before: str | None, after: str | None) -> None:
        orig: Callable[..., Any] = getattr(cls, name)

        @functools.wraps(orig)  # keeps a handler's @handles mark: Device.bind_all still binds it
        def fn(*a: Any, **k: Any) -> Any:
            if before:
                stamp(before)
            try:
                return orig(*a, **k)
            finally:
                if after:
                    stamp(after)
        setattr(cls, name, fn)

    on_message: Callable[..., Any] = mqtt.MqttSession._on_message

    def traced_on_message(self: Any, client: Any, userdata: Any, msg: Any) -> None:
        t = ns()
        corr = getattr(msg.properties, "CorrelationData", None)
        if corr is not None and msg.topic.endswith("/cmd/heartbeat"):
            rec[bytes(corr)] = {"gw_rx": t}
        on_message(self, client, userdata, msg)

    handle: Callable[..., Any] = dispatch.CommandDispatcher.handle

    def traced_handle(self: Any, topic: str, device: str, command: str, payload: bytes, rt: str | None,
                      corr: bytes | None, qos: int = 1) -> None:
        if command == "heartbeat" and corr is not None and bytes(corr) in rec:
            cur.c = bytes(corr)
            stamp("pool")
        try:
            handle(self, topic, device, command, payload, rt, corr, qos)
        finally:
            stamp("pub_done")
            cur.c = None

    class TracedSocket(socket.socket):
        def sendall(self, data: Any, flags: int = 0) -> None:
            super().sendall(data, flags)
            stamp("sent")

    connect: Callable[..., Any] = socket.create_connection

    arm_ports = {int(arm.get("port", 50000)) for arm in json.loads(os.environ.get("ROBOBUS_DEXTER_ARMS", "[]"))}

    def traced_connect(address: tuple[str, int], *a: Any, **k: Any) -> socket.socket:
        s: socket.socket = connect(address, *a, **k)
        if address[1] not in arm_ports:  # paho's connection to the broker stays as it is
            return s
        timeout = s.gettimeout()
        t = TracedSocket(s.family, s.type, s.proto, fileno=s.detach())
        t.settimeout(timeout)
        return t

    setattr(mqtt.MqttSession, "_on_message", traced_on_message)  # noqa: B010
    setattr(dispatch.CommandDispatcher, "handle", traced_handle)  # noqa: B010
    setattr(socket, "create_connection", traced_connect)  # noqa: B010 (arms' sockets only, above)
    wrap(svc.DexterArm, "cmd_heartbeat", "handler", "model")
    wrap(tr.DexterLink, "_exchange", "ex0", "ex1")
    wrap(tr.DexterLink, "try_inline", "ex0", "ex1")  # the inline path (paho's thread sends and waits, bounded)
    wrap(protocol.ReplyAssembler, "feed", "recv", None)
    wrap(mqtt.MqttSession, "publish", "pub0", None)

    if os.environ.get("DEXTER_TRACE_INLINE"):  # experiment: heartbeat on paho's network thread (no pool hop)
        init: Callable[..., Any] = svc.DexterArm.__init__

        def init_inline(self: Any, *a: Any, **k: Any) -> None:
            init(self, *a, **k)  # binds the arm's commands (Device.bind_all)
            self.dev.inline.add("heartbeat")
        setattr(svc.DexterArm, "__init__", init_inline)  # noqa: B010

    def dump() -> None:
        Path(out).write_text(json.dumps({c.hex(): v for c, v in list(rec.items())}))
    atexit.register(dump)


def serve_gateway(out: str) -> None:
    install_tracer(out)
    from services.dexter_gateway.__main__ import main
    main()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--inline", action="store_true", help="experiment: run heartbeat on the gateway's MQTT network "
                    "thread (the kit's inline binding), to see what the hand-over to the command pool costs")
    ap.add_argument("--serve-gateway", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_gateway:
        return serve_gateway(a.serve_gateway)

    import dexter as bd
    from rpc import bare_round_trips

    from shared.mqtt.session import reply_properties
    from shared.rpc import _Waiter, wait_for
    from shared.tools.localbroker import Broker, free_port

    ns = time.monotonic_ns
    rounds, per = 4, max(a.calls // 4, 1)
    stamps: dict[bytes, dict[str, int]] = {}
    raw_rt: list[float] = []
    hop: list[float] = []
    kit_hop: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dexter-trace-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        gw_port, raw_port = free_port(), free_port()
        sims = [bd.start_sim(gw_port, Path(d) / "gw", env), bd.start_sim(raw_port, Path(d) / "raw", env)]
        bare = subprocess.Popen([sys.executable, str(REPO / "bench/rpc.py"), "--serve-bare", broker.url,
                                 "bench/bare/echo"], env=env, cwd=REPO)
        out = Path(d) / "gateway-stamps.json"
        gw: Any = None
        try:
            assert wait_for(lambda: bd.listening(gw_port) and bd.listening(raw_port), 30), "simulators down"
            time.sleep(0.3)  # the probe connections must have left the simulators' accept loops
            gw, client = bd.start_gateway(broker, gw_port, env, "dexter-trace",
                                          [str(REPO / "bench/dexter_trace.py"), "--serve-gateway", str(out)],
                                          {"DEXTER_TRACE_INLINE": "1"} if a.inline else None)
            assert wait_for(lambda: bool(bare_round_trips(broker.url, "bench/bare/echo", 1)), 60), "no bare echo"
            on_reply = client._on_reply

            def traced_reply(msg: Any) -> None:
                s = stamps.get(bytes(msg.properties.CorrelationData))
                if s is not None:
                    s["c_rx"] = ns()
                on_reply(msg)
            client.session.subscribe(client.reply_topic, traced_reply, qos=1)  # replaces the handler
            raw = bd.RawSide(raw_port)

            def call(topic: str, body: bytes, echo: bool = False) -> dict[str, int]:
                """RpcClient.call's own steps, with stamps (the bare echo answers the request's own bytes)."""
                corr = os.urandom(16)
                w = _Waiter()
                client._pending[corr] = w
                s = stamps[corr] = {"c0": ns()}
                client.session.publish(topic, body, qos=1, now=True,
                                       properties=reply_properties(client.reply_topic, corr, "application/json"))
                s["c_pub"] = ns()
                rep = w.get(5)
                s["c_end"] = ns()
                client._pending.pop(corr, None)
                assert rep is not None and (echo or rep.ok), rep
                return s

            hb = client.topic(bd.NODE, "arm1", "cmd", "heartbeat")
            for _ in range(rounds):
                raw_rt += raw.round_trips(per)
                hop += bare_round_trips(broker.url, "bench/bare/echo", per)
                for _ in range(per):
                    s = call("bench/bare/echo", b'{"seq": 1, "text": "x"}', echo=True)
                    kit_hop.append((s["c_end"] - s["c0"]) / 1e6)
                    del stamps[next(reversed(stamps))]
                for _ in range(per):
                    call(hb, b"{}")
            raw.c.close()
            client.close()
        finally:
            if gw is not None:
                gw.stop()
            for proc in (*sims, bare):
                proc.terminate()
                proc.wait(10)
            broker.kill()
        gwst: dict[str, dict[str, int]] = json.loads(out.read_text())
    pct = bd.pct
    rows = [{**s, **gwst.get(c.hex(), {})} for c, s in stamps.items()]
    total = [(r["c_end"] - r["c0"]) / 1e6 for r in rows]
    res: dict[str, Any] = {"calls": len(rows), "raw_p50_ms": round(pct(raw_rt, 50), 3),
                           "bare_hop_p50_ms": round(pct(hop, 50), 3),
                           "kit_client_hop_p50_ms": round(pct(kit_hop, 50), 3),
                           "heartbeat_p50_ms": round(pct(total, 50), 3), "heartbeat_p99_ms": round(pct(total, 99), 3),
                           "stages_p50_us": {}}
    print(f"raw socket h p50 {res['raw_p50_ms']:.3f} ms; broker hop (bare client, bare echo) p50 "
          f"{res['bare_hop_p50_ms']:.3f} ms; kit client -> bare echo p50 {res['kit_client_hop_p50_ms']:.3f} ms")
    print(f"heartbeat through the gateway p50 {res['heartbeat_p50_ms']:.3f} ms p99 {res['heartbeat_p99_ms']:.3f} ms "
          f"({len(rows)} calls)")
    for a_, b_ in itertools.pairwise(STAGES):
        xs = [(r[b_] - r[a_]) / 1e3 for r in rows if a_ in r and b_ in r]
        if xs:
            res["stages_p50_us"][f"{a_}->{b_}"] = round(pct(xs, 50), 1)
            print(f"  {a_:>8} -> {b_:<8} p50 {pct(xs, 50):7.1f} us   p90 {pct(xs, 90):7.1f} us")
    back = [(r["c_rx"] - r["pub0"]) / 1e3 for r in rows if "pub0" in r and "c_rx" in r]
    if back:
        res["stages_p50_us"]["pub0->c_rx"] = round(pct(back, 50), 1)
        print(f"  {'pub0':>8} -> {'c_rx':<8} p50 {pct(back, 50):7.1f} us   (the reply's way back)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
