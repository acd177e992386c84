"""Where a command round trip's time goes: stage stamps along the kit's path and the bare paho pair's.

The same setup as bench/rpc.py (one mosquitto on loopback, servers in their own processes, QoS 1, MQTT 5 Response
Topic + Correlation Data + Content Type both ways), with each stage of one round trip stamped with
`time.perf_counter_ns()` (CLOCK_MONOTONIC: one clock for every process on the machine), by wrapping the kit's and
paho's functions from outside (the product code is not changed; a stamp costs ~0.3 us, and both sides pay it):

    client: call          -> request queued in paho -> request written to the socket
    server: socket readable (paho loop_read) -> PUBLISH read, decode starts (_handle_publish) -> on_message
            -> [kit: handler thread starts -> request validated -> handler returned -> reply encoded]
            -> reply queued in paho -> reply written
    client: socket readable -> decode starts -> on_message -> waiter released -> caller running again

    python bench/rpc_stages.py [--calls N] [--command echo|echo_inline]

Prints the median of each stage's duration for the kit and the bare pair, side by side (medians of stages do
not add up exactly to the median round trip). A diagnostic, not a benchmark with a target: bench/rpc.py has those.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from shared.mqtt.session import _nodelay, reply_properties  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

ns = time.perf_counter_ns
Stamps = dict[bytes, dict[str, int]]


class Stamper:
    """Stamps keyed by correlation data; the network thread's read stamps wait in a thread-local until the
    message's correlation data is known (on_message)."""

    def __init__(self) -> None:
        self.st: Stamps = {}
        self.local = threading.local()

    def at(self, corr: bytes | None, name: str, t: int | None = None) -> None:
        if corr is not None:
            self.st.setdefault(bytes(corr), {})[name] = ns() if t is None else t

    def read_stamps(self, corr: bytes | None, prefix: str) -> None:
        """At on_message: the socket-readable and decode-start stamps of the packet being handled."""
        self.at(corr, prefix + "readable", getattr(self.local, "sel", None))
        self.at(corr, prefix + "decode", getattr(self.local, "rx", None))

    def wrap_paho_reads(self, c: mqtt.Client) -> None:
        loop_read, handle_publish = c.loop_read, c._handle_publish
        local = self.local

        def loop_read_(max_packets: int = 1) -> Any:
            local.sel = ns()
            return loop_read(max_packets)

        def handle_publish_() -> Any:
            local.rx = ns()
            return handle_publish()

        c.loop_read = loop_read_  # type: ignore[method-assign]
        c._handle_publish = handle_publish_  # type: ignore[method-assign]

    def dump(self) -> dict[str, dict[str, int]]:
        return {k.hex(): v for k, v in self.st.items()}


S = Stamper()


def _corr_of(props: Any) -> bytes | None:
    corr = getattr(props, "CorrelationData", None)
    return bytes(corr) if corr is not None else None


def wrap_publish(c: mqtt.Client, prefix: str) -> None:
    publish = c.publish

    def publish_(topic: str, payload: Any = None, qos: int = 0, retain: bool = False, properties: Any = None) -> Any:
        corr = _corr_of(properties)
        S.at(corr, prefix + "pub_in")
        info = publish(topic, payload, qos=qos, retain=retain, properties=properties)
        S.at(corr, prefix + "queued")
        S.local.last_corr = corr
        return info

    c.publish = publish_  # type: ignore[method-assign]


# -- servers --------------------------------------------------------------------------------------
def _bench_rpc() -> Any:
    """bench/rpc.py's API and echo commands (loaded by path: bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rpc", Path(__file__).with_name("rpc.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve_kit(url: str) -> None:
    import shared.dispatch as dispatch
    from shared import Node
    from shared.mqtt.session import MqttSession
    from shared.settings import KitSettings

    D = dispatch.CommandDispatcher
    on_message, handle = D.on_message, D.handle
    validate, result = dispatch._validate_request, dispatch._result

    def on_message_(self: Any, msg: mqtt.MQTTMessage) -> None:
        corr = _corr_of(msg.properties)
        S.read_stamps(corr, "s_")
        S.at(corr, "s_on_message")
        on_message(self, msg)
        S.at(corr, "s_handed_over")
        S.local.net_corr = corr

    def handle_(self: Any, topic: str, dev: str, cmd: str, payload: Any, rt: Any, corr: Any, qos: int = 1) -> None:
        S.local.corr = corr
        S.at(corr, "s_handler_thread")
        handle(self, topic, dev, cmd, payload, rt, corr, qos)

    def validate_(model: Any, payload: Any) -> Any:
        out = validate(model, payload)
        S.at(S.local.corr, "s_validated")
        return out

    def result_(model: Any, out: Any) -> Any:
        S.at(S.local.corr, "s_handler_done")
        b = result(model, out)
        S.at(S.local.corr, "s_encoded")
        return b

    write_now = MqttSession.write_now

    def write_now_(self: MqttSession) -> None:
        S.at(getattr(S.local, "last_corr", None), "s_queue_len", len(self.client._out_packet))
        write_now(self)
        S.at(getattr(S.local, "last_corr", None), "s_written")

    D.on_message, D.handle = on_message_, handle_  # type: ignore[method-assign, assignment]
    dispatch._validate_request, dispatch._result = validate_, result_
    MqttSession.write_now = write_now_  # type: ignore[method-assign]

    rpc = _bench_rpc()
    node = Node(rpc.API, KitSettings(mqtt_url=url, node="bench"))
    S.wrap_paho_reads(node.session.client)
    _wrap_net_thread(node.session.client)
    wrap_publish(node.session.client, "s_")
    node.device("d").bind(rpc.ECHO, lambda r: r)
    node.device("d").bind(rpc.ECHO_INLINE, lambda r: r, inline=True)
    _dump_on_signal()
    node.run()


def _wrap_net_thread(c: mqtt.Client) -> None:
    """What the server's network thread does after handing a request over: its PUBACK, and when it next
    blocks in select() (until then the handler thread waits for the GIL)."""
    import select as select_mod
    import types

    import paho.mqtt.client as paho_client

    send_puback = c._send_puback

    def send_puback_(mid: int) -> Any:
        rc = send_puback(mid)
        S.at(getattr(S.local, "net_corr", None), "s_puback_queued")
        return rc

    def select_(r: Any, w: Any, x: Any, timeout: Any = None) -> Any:
        corr = getattr(S.local, "net_corr", None)
        if corr is not None:
            S.at(corr, "s_net_blocks" if not w else "s_net_select_write")
            if not w:
                S.local.net_corr = None
        return select_mod.select(r, w, x, timeout)

    c._send_puback = send_puback_  # type: ignore[method-assign]
    setattr(paho_client, "select", types.SimpleNamespace(select=select_))  # noqa: B010 (this process only)


def serve_bare(url: str, topic: str) -> None:
    """bench/rpc.py's bare echo, stamped."""
    port = int(url.rsplit(":", 1)[1])
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bare-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5)
    c.on_socket_open = _nodelay
    S.wrap_paho_reads(c)
    wrap_publish(c, "s_")

    def on_connect(cl, ud, fl, rc, pr=None):  # type: ignore[no-untyped-def]
        cl.subscribe(topic, qos=1)

    def on_message(cl, ud, msg):  # type: ignore[no-untyped-def]
        p = msg.properties
        corr = _corr_of(p)
        S.read_stamps(corr, "s_")
        S.at(corr, "s_on_message")
        cl.publish(p.ResponseTopic, msg.payload, qos=1,
                   properties=reply_properties(None, p.CorrelationData, "application/json"))

    c.on_connect = on_connect
    c.on_message = on_message
    _dump_on_signal()
    c.connect("127.0.0.1", port)
    c.loop_forever()


def _dump_on_signal() -> None:
    def dump(*_: Any) -> None:
        Path(os.environ["STAGES_OUT"]).write_text(json.dumps(S.dump()))
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)


# -- clients --------------------------------------------------------------------------------------
def kit_client(url: str, n: int, command: str) -> Stamps:
    from shared.rpc import RpcClient, wait_for
    from shared.settings import KitSettings

    on_reply = RpcClient._on_reply

    def on_reply_(self: RpcClient, msg: mqtt.MQTTMessage) -> None:
        corr = _corr_of(msg.properties)
        S.read_stamps(corr, "c_")
        S.at(corr, "c_on_message")
        on_reply(self, msg)
        S.at(corr, "c_released")

    RpcClient._on_reply = on_reply_  # type: ignore[method-assign]
    from shared.mqtt.session import MqttSession

    write_now = MqttSession.write_now

    def write_now_(self: MqttSession) -> None:
        S.at(getattr(S.local, "last_corr", None), "c_queue_len", len(self.client._out_packet))
        write_now(self)
        S.at(getattr(S.local, "last_corr", None), "c_written")

    MqttSession.write_now = write_now_  # type: ignore[method-assign]
    c = RpcClient(KitSettings(mqtt_url=url))
    S.wrap_paho_reads(c.session.client)
    wrap_publish(c.session.client, "c_")
    c.connect()

    def up() -> bool:
        try:
            return c.call("bench", "d", command, {"seq": 0}, timeout=0.5).ok
        except TimeoutError:
            return False

    assert wait_for(up, 20), "kit echo server did not come up"
    for i in range(200):
        c.call("bench", "d", command, {"seq": i, "text": "x"}, timeout=5)
    S.st.clear()
    for i in range(n):
        t0 = ns()
        rep = c.call("bench", "d", command, {"seq": i, "text": "x"}, timeout=5)
        t1 = ns()
        assert rep.ok
        corr = S.local.last_corr
        S.at(corr, "c_call", t0)
        S.at(corr, "c_returned", t1)
    c.close()
    return dict(S.st)


def bare_client(url: str, topic: str, n: int) -> Stamps:
    port = int(url.rsplit(":", 1)[1])
    replies: queue.Queue[bytes] = queue.Queue()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"barec-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5)
    c.on_socket_open = _nodelay
    S.wrap_paho_reads(c)
    wrap_publish(c, "c_")
    rt = f"bench/_bare/{uuid.uuid4().hex[:8]}"

    def on_message(cl, ud, msg):  # type: ignore[no-untyped-def]
        corr = _corr_of(msg.properties)
        S.read_stamps(corr, "c_")
        S.at(corr, "c_on_message")
        replies.put(msg.properties.CorrelationData)
        S.at(corr, "c_released")

    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe(rt, qos=1)
    time.sleep(0.3)
    out: Stamps = {}
    try:
        for rnd in (200, n):
            S.st.clear()
            for i in range(rnd):
                corr = uuid.uuid4().bytes
                payload = json.dumps({"seq": i, "text": "x"})
                t0 = ns()
                c.publish(topic, payload, qos=1, properties=reply_properties(rt, corr, "application/json"))
                while replies.get(timeout=5) != corr:
                    pass
                t1 = ns()
                S.at(corr, "c_call", t0)
                S.at(corr, "c_returned", t1)
        out = dict(S.st)
    finally:
        c.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        c.loop_stop()
    return out


# -- report ---------------------------------------------------------------------------------------
# (stage, from stamp, to stamp); the bare pair has no handler thread, validation or encoding
STAGES = [
    ("client: call -> request queued in paho", "c_call", "c_queued"),
    ("client: queued -> written (kit: by the caller; bare: by paho's thread)", "c_queued", "c_written"),
    ("broker: request written -> server socket readable", "c_written", "s_readable"),
    ("  (bare: request queued -> server socket readable)", "c_queued", "s_readable"),
    ("server: readable -> PUBLISH read (decode starts)", "s_readable", "s_decode"),
    ("server: decode (topic, properties) -> on_message", "s_decode", "s_on_message"),
    ("server: on_message -> handler thread running", "s_on_message", "s_handler_thread"),
    ("  server net thread: on_message -> handed over (pool submit)", "s_on_message", "s_handed_over"),
    ("  server net thread: on_message -> PUBACK queued", "s_on_message", "s_puback_queued"),
    ("  server net thread: on_message -> select() for the PUBACK write", "s_on_message", "s_net_select_write"),
    ("  server net thread: on_message -> blocks in select()", "s_on_message", "s_net_blocks"),
    ("  server: net thread blocks -> handler thread running", "s_net_blocks", "s_handler_thread"),
    ("server: handler thread -> request validated", "s_handler_thread", "s_validated"),
    ("server: validated -> handler returned", "s_validated", "s_handler_done"),
    ("server: handler returned -> reply encoded", "s_handler_done", "s_encoded"),
    ("server: reply encoded -> reply queued in paho", "s_encoded", "s_queued"),
    ("  (bare: on_message -> reply queued in paho)", "s_on_message", "s_queued"),
    ("server: queued -> written (kit)", "s_queued", "s_written"),
    ("broker: reply queued -> client socket readable", "s_queued", "c_readable"),
    ("client: readable -> PUBLISH read (decode starts)", "c_readable", "c_decode"),
    ("client: decode -> on_message", "c_decode", "c_on_message"),
    ("client: on_message -> waiter released", "c_on_message", "c_released"),
    ("client: released -> caller running", "c_released", "c_returned"),
    ("round trip", "c_call", "c_returned"),
    ("client + server in Python (request queued -> written + server + reply parse + wake)", "", ""),
]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def stage_table(st: Stamps) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, a, b in STAGES:
        if not a:
            continue
        d = [(v[b] - v[a]) / 1000 for v in st.values() if a in v and b in v]
        if len(d) >= max(10, len(st) // 2):
            out[name] = median(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--command", default="echo", choices=["echo", "echo_inline"])
    ap.add_argument("--serve-kit", help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_kit:
        return serve_kit(a.serve_kit)
    if a.serve_bare:
        return serve_bare(*a.serve_bare)

    def merged(client: Callable[[], Stamps], proc: subprocess.Popen[bytes], out: Path) -> Stamps:
        st = client()
        proc.send_signal(signal.SIGUSR1)
        proc.wait(10)
        server = json.loads(out.read_text())
        for k, v in st.items():
            v.update(server.get(k.hex(), {}))
        return st

    with tempfile.TemporaryDirectory() as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        kit_out, bare_out = Path(d) / "kit.json", Path(d) / "bare.json"
        bare_topic = "bench/bare/echo"
        kit_p = subprocess.Popen([sys.executable, __file__, "--serve-kit", broker.url],
                                 env={**env, "STAGES_OUT": str(kit_out)})
        bare_p = subprocess.Popen([sys.executable, __file__, "--serve-bare", broker.url, bare_topic],
                                  env={**env, "STAGES_OUT": str(bare_out)})
        try:
            kit = merged(lambda: kit_client(broker.url, a.calls, a.command), kit_p, kit_out)
            S.st.clear()
            bare = merged(lambda: bare_client(broker.url, bare_topic, a.calls), bare_p, bare_out)
        finally:
            for p in (kit_p, bare_p):
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
            broker.kill()

    k, b = stage_table(kit), stage_table(bare)
    for side in ("c_", "s_"):  # packets in paho's queue when the kit's thread wrote its own (PUBACKs not yet out)
        lens = [v[side + "queue_len"] for v in kit.values() if side + "queue_len" in v]
        if lens:
            k[f"{side}queue_len>1 share"] = sum(n > 1 for n in lens) / len(lens)
    print(f"median per stage, us ({a.command}, {a.calls} calls each)")
    print(f"{'stage':<88} {'kit':>7} {'bare':>7}")
    for name in [n for n, _, _ in STAGES] + ["c_queue_len>1 share", "s_queue_len>1 share"]:
        if name in k or name in b:
            kv = f"{k[name]:7.1f}" if name in k else "      -"
            bv = f"{b[name]:7.1f}" if name in b else "      -"
            print(f"{name:<88} {kv} {bv}")
    print(json.dumps({"bench": "rpc_stages", "command": a.command, "kit": k, "bare": b}))


if __name__ == "__main__":
    main()
