"""Benchmark: dexter-gateway against the simulated DexRun, side by side with a raw socket client.

A private mosquitto and one simulated arm per client (its own process: a simulator serves one client at a
time, as DexRun does), then, in interleaved rounds (the machine is shared: all sides see the same load):
1. a raw TCP client on its own simulator: `h` round trips (p50/p99), and a file written with `W` and read
   back with `r`, 62 bytes a block (blocks per second); the gateway's `DexterLink` alone on a third one;
2. one broker hop: a bare paho request/reply echo (bench/rpc.py's) through the same broker; and a bare bridge
   (`serve_bridge`: that echo making one raw `h` exchange with a fourth simulator, no validation, no decoding:
   the floor for any MQTT-to-DexRun bridge in Python);
3. the gateway process on another simulator: `heartbeat` through MQTT (p50/p99) and the same file through
   the `write_file` / `read_file` jobs (blocks per second over the job's own duration);
4. the round trips of 1-3 again, call by call: raw, broker hop, bare bridge, gateway in turn (the order
   rotating), one call each, so that every call of every side meets the same moment of the machine and comes
   after other traffic, as a command from a bus does.

Targets: MQTT round trip p99 <= 3 ms, and p50 <= 1.5 x raw p50 + one broker hop (the bare echo's
p50), judged call by call (4); file transfer >= 0.8 x the raw client's blocks per second. The back-to-back
ratio (1-3) is printed as well: there the raw client's tight loop keeps its simulator hot on one CPU, and its
p50 is a third to a quarter of its call-by-call p50 on a 2-vCPU VM, where waking a task on the other, idle
vCPU costs tens of us (bench/dexter_wakeups.py; services/dexter_gateway/README.md); the bare bridge
misses that back-to-back bound too. Last line: one JSON object.

    python bench/dexter.py            # 2000 round trips a side and phase, a 128 KiB file (2115 blocks)
    python bench/dexter.py --quick    # 500 round trips, a 64 KiB file (1057 blocks)

The file is long enough to be measured: at ~10 K blocks/s, 16 KiB (265 blocks) took ~25 ms a side, where one
scheduler delay on a shared machine moved the ratio from 0.4 to 1.6 between runs.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results import Figure, report, variant_name  # noqa: E402
from rpc import BareClient, bare_round_trips, serve_bare_loop  # noqa: E402  (bench/rpc.py: the bare paho echo)

from services.dexter_gateway import protocol as p  # noqa: E402
from services.dexter_gateway.link import DexterLinkConfig  # noqa: E402
from services.dexter_gateway.transport import DexterLink  # noqa: E402
from shared.rpc import RpcClient, wait_for  # noqa: E402
from shared.tools.localbroker import Broker, NodeProcess, free_port  # noqa: E402

TARGET_P99_MS = 3.0
TARGET_RATIO = 1.5
TARGET_FILE_RATIO = 0.8
NODE = "dexter-gateway"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class Raw:
    """The least a correct DexRun client does: one 256-byte write, read exactly 240 bytes, next."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.asm = p.ReplyAssembler()
        self.instr = 0

    def cmd(self, oplet: str, args: list[str] | tuple[str, ...] = ()) -> p.Reply:
        self.instr += 1
        self.sock.sendall(p.Request(oplet, tuple(args), instruction_id=self.instr).encode())
        while True:
            out = self.asm.feed(self.sock.recv(4096))
            if out:
                return p.decode_reply(out[0])

    def close(self) -> None:
        self.sock.close()


class RawSide:
    """A raw client on its own simulator (DexRun serves one client at a time; the gateway holds the other)."""

    def __init__(self, port: int) -> None:
        self.c = Raw(port)
        for _ in range(100):
            self.c.cmd("h")

    def round_trips(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.c.cmd("h")
            out.append((time.perf_counter() - t0) * 1000)
        return out

    def write(self, path: str, data: bytes) -> float:
        """Blocks per second."""
        seq = p.write_requests(path, data)
        t0 = time.perf_counter()
        for oplet, args in seq:
            self.c.cmd(oplet, args)
        return (len(seq) - 1) / (time.perf_counter() - t0)

    def read(self, path: str, data: bytes) -> float:
        t0 = time.perf_counter()
        got = b""
        blocks = 0
        while True:
            blk = p.decode_read(self.c.cmd("r", (str(blocks), path)))
            blocks += 1
            got += blk.payload
            if blk.length < p.MAX_CONTENT_CHARS:
                break
        rate = blocks / (time.perf_counter() - t0)
        assert got == data, "raw read-back differs"
        return rate


class LinkSide:
    """The gateway's transport alone (`DexterLink`, no MQTT) on a third simulator: what the link itself costs."""

    def __init__(self, port: int) -> None:
        self.link = DexterLink("bench", DexterLinkConfig(host="127.0.0.1", port=port)).start()
        assert wait_for(lambda: self.link.serving, 20), self.link.message
        for _ in range(100):
            self.link.request("h")

    def round_trips(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.link.request("h")
            out.append((time.perf_counter() - t0) * 1000)
        return out


class GatewaySide:
    def __init__(self, client: RpcClient) -> None:
        self.client = client
        for _ in range(100):
            assert client.call(NODE, "arm1", "heartbeat", {}, timeout=5).ok

    def round_trips(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            rep = self.client.call(NODE, "arm1", "heartbeat", {}, timeout=5)
            out.append((time.perf_counter() - t0) * 1000)
            assert rep.ok, rep.error
        return out

    def write(self, path: str, data: bytes) -> float:
        acc, res = self.client.call_job(NODE, "arm1", "write_file", {"path": path, "base64": base64.b64encode(data)
                                                                     .decode()}, lambda ev: None, timeout=600)
        assert res is not None and res["ok"], (acc, res)
        # the job's own duration (first block to last): the client's subscribe-and-settle is not the gateway's
        return float(res["result"]["blocks"]) / float(res["duration_s"])

    def read(self, path: str, data: bytes) -> float:
        acc, res = self.client.call_job(NODE, "arm1", "read_file", {"path": path, "encoding": "base64"},
                                        lambda ev: None, timeout=600)
        assert res is not None and res["ok"], (acc, res)
        assert base64.b64decode(res["result"]["base64"]) == data, "gateway read-back differs"
        return float(res["result"]["blocks"]) / float(res["duration_s"])


def serve_bridge(url: str, topic: str, sim_port: int) -> None:
    """The least an MQTT-to-DexRun bridge can do: bench/rpc.py's bare paho echo, whose `on_message` makes one raw
    `h` exchange (`Raw`) with its own simulator and publishes the 240 reply bytes as they are (no validation,
    no decoding beyond the reply's header, no JSON, no health). What any bridge pays for the two hops."""
    raw = Raw(sim_port)
    serve_bare_loop(url, topic, lambda payload: (raw.cmd("h").data, "application/octet-stream"))


def start_gateway(broker: Broker, arm_port: int, env: dict[str, str], name: str,
                  args: list[str] | None = None, extra_env: dict[str, str] | None = None
                  ) -> tuple[NodeProcess, RpcClient]:
    """dexter-gateway in its own process (`args`: another entry point, e.g. a traced one) serving arm1 on
    `arm_port`, and a connected client; returns once a `heartbeat` is answered."""
    arms = [{"id": "arm1", "host": "127.0.0.1", "port": arm_port}]
    gw = NodeProcess(args or ["-m", "services.dexter_gateway"],
                     {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_DEXTER_ARMS": json.dumps(arms), **env,
                      **(extra_env or {})})
    client = RpcClient(broker.settings(), name=name)
    client.connect()

    def up() -> bool:
        try:
            return client.call(NODE, "arm1", "heartbeat", {}, timeout=0.5).ok
        except TimeoutError:
            return False
    if not wait_for(up, 60):
        client.close()
        gw.stop()
        raise AssertionError("gateway did not come up:\n" + gw.text())
    return gw, client


def start_sim(port: int, root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "services.dexter_gateway.sim", "--port", str(port), "--root",
                             str(root)], env=env, cwd=REPO, stdout=subprocess.DEVNULL)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=0)
    ap.add_argument("--file-kib", type=int, default=0)
    ap.add_argument("--serve-bridge", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_bridge:
        return serve_bridge(a.serve_bridge[0], a.serve_bridge[1], int(a.serve_bridge[2]))
    calls = a.calls or (500 if a.quick else 2000)
    rounds = 5 if a.quick else 9  # file pairs: the median of 5 (9) per-pair ratios, not of 3, on a shared machine
    size = (a.file_kib or (64 if a.quick else 128)) * 1024
    data = bytes((i * 7 + i // 251) & 0xFF for i in range(size))  # every byte value, escapes included
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    raw_rt: list[float] = []
    link_rt: list[float] = []
    hop: list[float] = []
    mqtt_rt: list[float] = []
    turn_raw: list[float] = []  # the same three, call by call in turn
    turn_hop: list[float] = []
    turn_mqtt: list[float] = []
    bridge_rt: list[float] = []  # the bare bridge (serve_bridge): the floor for any MQTT-to-DexRun bridge
    turn_bridge: list[float] = []
    ratios: dict[str, list[float]] = {"raw_write": [], "gw_write": [], "raw_read": [], "gw_read": [],
                                      "write": [], "read": []}
    with tempfile.TemporaryDirectory(prefix="dexter-bench-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        raw_port, gw_port, link_port, bridge_port = free_port(), free_port(), free_port(), free_port()
        sims = [start_sim(raw_port, Path(d) / "raw", env), start_sim(gw_port, Path(d) / "gw", env),
                start_sim(link_port, Path(d) / "link", env), start_sim(bridge_port, Path(d) / "bridge", env)]
        bare = subprocess.Popen([sys.executable, str(REPO / "bench/rpc.py"), "--serve-bare", broker.url,
                                 "bench/bare/echo"], env=env, cwd=REPO)
        bridge: subprocess.Popen[bytes] | None = None
        gw: NodeProcess | None = None
        try:
            assert wait_for(lambda: all(listening(x) for x in (raw_port, gw_port, link_port, bridge_port)), 30), \
                "simulators did not listen"
            time.sleep(0.3)  # the probe connections must have left the simulators' accept loops
            bridge = subprocess.Popen([sys.executable, str(REPO / "bench/dexter.py"), "--serve-bridge", broker.url,
                                       "bench/bridge/h", str(bridge_port)], env=env, cwd=REPO)
            gw, client = start_gateway(broker, gw_port, env, "dexter-bench")

            def answers(topic: str) -> bool:
                try:
                    return bool(bare_round_trips(broker.url, topic, 1))
                except queue.Empty:
                    return False
            assert wait_for(lambda: answers("bench/bare/echo"), 60), "bare echo did not come up"
            assert wait_for(lambda: answers("bench/bridge/h"), 60), "bare bridge did not come up"
            bridge_c = BareClient(broker.url, "bench/bridge/h")
            raw = RawSide(raw_port)
            links = LinkSide(link_port)
            gws = GatewaySide(client)
            # Interleaved rounds: this machine is shared, and its load moves within seconds; raw, broker hop
            # and gateway are measured side by side in every round, so they see the same load.
            per = max(calls // rounds, 1)
            for r in range(rounds):
                raw_rt += raw.round_trips(per)
                link_rt += links.round_trips(per)
                hop += bare_round_trips(broker.url, "bench/bare/echo", per)
                bridge_rt += [bridge_c.call() for _ in range(per)]
                mqtt_rt += gws.round_trips(per)
                rw = raw.write(f"/srv/samba/share/r{r}.bin", data)
                gw_w = gws.write(f"/srv/samba/share/g{r}.bin", data)
                rr = raw.read(f"/srv/samba/share/r{r}.bin", data)
                gw_r = gws.read(f"/srv/samba/share/g{r}.bin", data)
                for k, v in (("raw_write", rw), ("gw_write", gw_w), ("raw_read", rr), ("gw_read", gw_r),
                             ("write", gw_w / rw), ("read", gw_r / rr)):
                    ratios[k].append(v)
            # Call by call: raw, broker hop, bare bridge and gateway in turn (the order rotating), one call each,
            # so that all meet the same moment of the machine, and each call comes after the others' traffic, as
            # a command from a bus does; the blocks above measure each side back to back (a raw client in a tight
            # loop keeps its simulator on its own CPU, hot: no command arriving over a bus finds it so).
            bare_c = BareClient(broker.url, "bench/bare/echo")
            sides: list[tuple[list[float], Any]] = [
                (turn_raw, lambda: raw.round_trips(1)[0]), (turn_hop, bare_c.call), (turn_bridge, bridge_c.call),
                (turn_mqtt, lambda: gws.round_trips(1)[0])]
            for i in range(calls):
                turn = i % len(sides)
                for out, fn in sides[turn:] + sides[:turn]:
                    out.append(fn())
            bare_c.close()
            bridge_c.close()
            raw.c.close()
            links.link.close()
            client.close()
        finally:
            if gw is not None:
                gw.stop()
            for proc in (*sims, bare, *([bridge] if bridge is not None else [])):
                proc.terminate()
                proc.wait(10)
            broker.kill()
    raw_p = {"p50": pct(raw_rt, 50), "p99": pct(raw_rt, 99)}
    g = {"p50": pct(mqtt_rt, 50), "p99": pct(mqtt_rt, 99)}
    hop_p50 = pct(hop, 50)
    bound = TARGET_RATIO * raw_p["p50"] + hop_p50
    turn_bound = TARGET_RATIO * pct(turn_raw, 50) + pct(turn_hop, 50)
    res: dict[str, Any] = {
        "calls": calls, "file_bytes": size, "file_blocks": -(-size // 62),
        "rounds": rounds, "raw_p50_ms": round(raw_p["p50"], 3), "raw_p99_ms": round(raw_p["p99"], 3),
        "link_p50_ms": round(pct(link_rt, 50), 3), "link_p99_ms": round(pct(link_rt, 99), 3),
        "broker_hop_p50_ms": round(hop_p50, 3), "broker_hop_p99_ms": round(pct(hop, 99), 3),
        "mqtt_p50_ms": round(g["p50"], 3), "mqtt_p99_ms": round(g["p99"], 3),
        "mqtt_p50_bound_ms": round(bound, 3), "mqtt_p50_over_bound": round(g["p50"] / bound, 3),
        "raw_write_blocks_s": round(pct(ratios["raw_write"], 50), 1),
        "gw_write_blocks_s": round(pct(ratios["gw_write"], 50), 1),
        "raw_read_blocks_s": round(pct(ratios["raw_read"], 50), 1),
        "gw_read_blocks_s": round(pct(ratios["gw_read"], 50), 1),
        "write_ratio": round(pct(ratios["write"], 50), 3),  # median over the rounds of gateway / raw
        "read_ratio": round(pct(ratios["read"], 50), 3),
        "turn_raw_p50_ms": round(pct(turn_raw, 50), 3), "turn_hop_p50_ms": round(pct(turn_hop, 50), 3),
        "bridge_p50_ms": round(pct(bridge_rt, 50), 3), "bridge_p99_ms": round(pct(bridge_rt, 99), 3),
        "bridge_p50_over_bound": round(pct(bridge_rt, 50) / bound, 3),
        "turn_bridge_p50_ms": round(pct(turn_bridge, 50), 3),
        "turn_mqtt_p50_ms": round(pct(turn_mqtt, 50), 3), "turn_mqtt_p99_ms": round(pct(turn_mqtt, 99), 3),
        "turn_mqtt_p50_bound_ms": round(turn_bound, 3),
        "turn_mqtt_p50_over_bound": round(pct(turn_mqtt, 50) / turn_bound, 3),
        "targets": {"mqtt_p99_ms": TARGET_P99_MS, "mqtt_p50": "<= 1.5 x raw p50 + broker hop p50",
                    "file_ratio": TARGET_FILE_RATIO},
    }
    # The p50 verdict is the call-by-call one: the sides side by side, each call in the same conditions.
    # The back-to-back ratio is printed too (its raw client keeps its simulator hot on its own CPU: see above).
    res["back_to_back_p50_met"] = g["p50"] <= bound
    res["pass"] = (res["turn_mqtt_p99_ms"] <= TARGET_P99_MS and res["mqtt_p99_ms"] <= TARGET_P99_MS
                   and pct(turn_mqtt, 50) <= turn_bound
                   and res["write_ratio"] >= TARGET_FILE_RATIO and res["read_ratio"] >= TARGET_FILE_RATIO)
    print("back to back (blocks of calls per side, interleaved by rounds):")
    print(f"  raw socket   h round trip  p50 {res['raw_p50_ms']:.3f} ms  p99 {res['raw_p99_ms']:.3f} ms")
    print(f"  DexterLink   h round trip  p50 {res['link_p50_ms']:.3f} ms  p99 {res['link_p99_ms']:.3f} ms "
          "(the gateway's transport alone)")
    print(f"  broker hop   bare echo     p50 {res['broker_hop_p50_ms']:.3f} ms  p99 {res['broker_hop_p99_ms']:.3f} ms")
    print(f"  bare bridge  h via MQTT    p50 {res['bridge_p50_ms']:.3f} ms  p99 {res['bridge_p99_ms']:.3f} ms "
          f"(p50 bound: {res['bridge_p50_over_bound']:.2f} x)")
    print(f"  MQTT         heartbeat     p50 {res['mqtt_p50_ms']:.3f} ms  p99 {res['mqtt_p99_ms']:.3f} ms "
          f"(p50 bound {res['mqtt_p50_bound_ms']:.3f} ms: {res['mqtt_p50_over_bound']:.2f} x)")
    print("call by call (raw, hop, bridge, gateway in turn: the verdict):")
    print(f"  raw socket   h round trip  p50 {res['turn_raw_p50_ms']:.3f} ms")
    print(f"  broker hop   bare echo     p50 {res['turn_hop_p50_ms']:.3f} ms")
    print(f"  bare bridge  h via MQTT    p50 {res['turn_bridge_p50_ms']:.3f} ms "
          f"(p50 bound: {res['turn_bridge_p50_ms'] / turn_bound:.2f} x)")
    print(f"  MQTT         heartbeat     p50 {res['turn_mqtt_p50_ms']:.3f} ms  p99 {res['turn_mqtt_p99_ms']:.3f} ms "
          f"(p99 target {TARGET_P99_MS} ms: {res['turn_mqtt_p99_ms'] / TARGET_P99_MS:.2f} x; p50 bound "
          f"{res['turn_mqtt_p50_bound_ms']:.3f} ms: {res['turn_mqtt_p50_over_bound']:.2f} x)")
    print(f"file write   raw {res['raw_write_blocks_s']:.0f} blocks/s  gateway {res['gw_write_blocks_s']:.0f} "
          f"blocks/s  ratio {res['write_ratio']:.2f} (target >= {TARGET_FILE_RATIO})")
    print(f"file read    raw {res['raw_read_blocks_s']:.0f} blocks/s  gateway {res['gw_read_blocks_s']:.0f} "
          f"blocks/s  ratio {res['read_ratio']:.2f} (target >= {TARGET_FILE_RATIO})")
    report("dexter", res, [
        Figure("`heartbeat` p50 ÷ (1.5 × raw p50 + broker hop), call by call", res["turn_mqtt_p50_over_bound"],
               "×", "<=", 1.0),
        Figure("`heartbeat` p99, call by call", res["turn_mqtt_p99_ms"], "ms", "<=", TARGET_P99_MS),
        Figure("`heartbeat` p99, back to back", res["mqtt_p99_ms"], "ms", "<=", TARGET_P99_MS),
        Figure("file write, gateway ÷ raw socket", res["write_ratio"], "×", ">=", TARGET_FILE_RATIO),
        Figure("file read, gateway ÷ raw socket", res["read_ratio"], "×", ">=", TARGET_FILE_RATIO),
    ], variant=variant_name("quick" if a.quick else ""))


if __name__ == "__main__":
    main()
