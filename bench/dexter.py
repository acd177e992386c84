"""Benchmark: dexter-gateway against the simulated DexRun, side by side with a raw socket client.

One simulated arm (its own process), a private mosquitto, then:
1. a raw TCP client on the simulator (no gateway): `h` round trips (p50/p99), and a file written with
   `W` and read back with `r`, 62 bytes a block (blocks per second);
2. one broker hop: a bare paho request/reply echo (bench/rpc.py's) through the same broker;
3. the gateway process on the same simulator: `heartbeat` through MQTT (p50/p99) and the same file through
   the `write_file` / `read_file` jobs (blocks per second, from the request to the job's result event).
The simulator serves one client at a time, as DexRun does, so the raw client runs before the gateway.

Targets (issue 12): MQTT round trip p99 <= 3 ms, and p50 <= 1.5 x raw p50 + one broker hop (the bare echo's
p50); file transfer >= 0.8 x the raw client's blocks per second. Last line: one JSON object.

    python bench/dexter.py            # 2000 round trips, a 32 KiB file
    python bench/dexter.py --quick    # 500 round trips, an 8 KiB file
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

from rpc import bare_round_trips  # noqa: E402  (bench/rpc.py: the kit's own bare paho echo)

from services.dexter_gateway import protocol as p  # noqa: E402
from shared.localbroker import Broker, NodeProcess, free_port  # noqa: E402
from shared.rpc import RpcClient, wait_for  # noqa: E402

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


def raw_phase(port: int, calls: int, data: bytes) -> dict[str, Any]:
    c = Raw(port)
    for _ in range(100):
        c.cmd("h")
    rtts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        c.cmd("h")
        rtts.append((time.perf_counter() - t0) * 1000)
    seq = p.write_requests("/srv/samba/share/bench_raw.bin", data)
    t0 = time.perf_counter()
    for oplet, args in seq:
        c.cmd(oplet, args)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = b""
    blocks = 0
    while True:
        blk = p.decode_read(c.cmd("r", (str(blocks), "/srv/samba/share/bench_raw.bin")))
        blocks += 1
        got += blk.payload
        if blk.length < p.MAX_CONTENT_CHARS:
            break
    read_s = time.perf_counter() - t0
    c.close()
    assert got == data, "raw read-back differs"
    return {"p50": pct(rtts, 50), "p99": pct(rtts, 99), "write_blocks_s": (len(seq) - 1) / write_s,
            "read_blocks_s": blocks / read_s}


def gateway_phase(client: RpcClient, calls: int, data: bytes) -> dict[str, Any]:
    for _ in range(100):
        assert client.call(NODE, "arm1", "heartbeat", {}, timeout=5).ok
    rtts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rep = client.call(NODE, "arm1", "heartbeat", {}, timeout=5)
        rtts.append((time.perf_counter() - t0) * 1000)
        assert rep.ok, rep.error
    t0 = time.perf_counter()
    acc, res = client.call_job(NODE, "arm1", "write_file", {"path": "/srv/samba/share/bench_gw.bin",
                                                            "base64": base64.b64encode(data).decode()},
                               lambda ev: None, timeout=600)
    write_s = time.perf_counter() - t0
    assert res is not None and res["ok"], (acc, res)
    write_blocks = res["result"]["blocks"]
    t0 = time.perf_counter()
    acc, res = client.call_job(NODE, "arm1", "read_file", {"path": "/srv/samba/share/bench_gw.bin",
                                                           "encoding": "base64"}, lambda ev: None, timeout=600)
    read_s = time.perf_counter() - t0
    assert res is not None and res["ok"], (acc, res)
    assert base64.b64decode(res["result"]["base64"]) == data, "gateway read-back differs"
    return {"p50": pct(rtts, 50), "p99": pct(rtts, 99), "write_blocks_s": write_blocks / write_s,
            "read_blocks_s": res["result"]["blocks"] / read_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=0)
    ap.add_argument("--file-kib", type=int, default=0)
    a = ap.parse_args()
    calls = a.calls or (500 if a.quick else 2000)
    size = (a.file_kib or (8 if a.quick else 32)) * 1024
    data = bytes((i * 7 + i // 251) & 0xFF for i in range(size))  # every byte value, escapes included
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="dexter-bench-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        sim_port = free_port()
        root = Path(d) / "robot"
        sim = subprocess.Popen([sys.executable, "-m", "services.dexter_gateway.sim", "--port", str(sim_port),
                                "--root", str(root)], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        bare = subprocess.Popen([sys.executable, str(REPO / "bench/rpc.py"), "--serve-bare", broker.url,
                                 "bench/bare/echo"], env=env, cwd=REPO)
        gw: NodeProcess | None = None
        try:
            def sim_up() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", sim_port), 0.2).close()
                    return True
                except OSError:
                    return False
            assert wait_for(sim_up, 20), "simulator did not listen"
            time.sleep(0.2)  # the probe connection above must have left the simulator's accept loop
            raw = raw_phase(sim_port, calls, data)
            def bare_up() -> bool:
                try:
                    return bool(bare_round_trips(broker.url, "bench/bare/echo", 1))
                except queue.Empty:
                    return False
            assert wait_for(bare_up, 60), "bare echo did not come up"
            bare_round_trips(broker.url, "bench/bare/echo", 100)
            hop = bare_round_trips(broker.url, "bench/bare/echo", calls)
            arms = [{"id": "arm1", "host": "127.0.0.1", "port": sim_port}]
            gw = NodeProcess(["-m", "services.dexter_gateway"],
                             {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_DEXTER_ARMS": json.dumps(arms), **env})
            client = RpcClient(broker.settings(), name="dexter-bench")
            client.connect()

            def up() -> bool:
                try:
                    return client.call(NODE, "arm1", "heartbeat", {}, timeout=0.5).ok
                except TimeoutError:
                    return False
            assert wait_for(up, 30), "gateway did not come up:\n" + gw.text()
            g = gateway_phase(client, calls, data)
            client.close()
        finally:
            if gw is not None:
                gw.stop()
            for proc in (sim, bare):
                proc.terminate()
                proc.wait(10)
            broker.kill()
    hop_p50 = pct(hop, 50)
    bound = TARGET_RATIO * raw["p50"] + hop_p50
    res = {
        "calls": calls, "file_bytes": size, "file_blocks": -(-size // 62),
        "raw_p50_ms": round(raw["p50"], 3), "raw_p99_ms": round(raw["p99"], 3),
        "broker_hop_p50_ms": round(hop_p50, 3), "broker_hop_p99_ms": round(pct(hop, 99), 3),
        "mqtt_p50_ms": round(g["p50"], 3), "mqtt_p99_ms": round(g["p99"], 3),
        "mqtt_p50_bound_ms": round(bound, 3), "mqtt_p50_over_bound": round(g["p50"] / bound, 3),
        "raw_write_blocks_s": round(raw["write_blocks_s"], 1), "gw_write_blocks_s": round(g["write_blocks_s"], 1),
        "raw_read_blocks_s": round(raw["read_blocks_s"], 1), "gw_read_blocks_s": round(g["read_blocks_s"], 1),
        "write_ratio": round(g["write_blocks_s"] / raw["write_blocks_s"], 3),
        "read_ratio": round(g["read_blocks_s"] / raw["read_blocks_s"], 3),
        "targets": {"mqtt_p99_ms": TARGET_P99_MS, "mqtt_p50": "<= 1.5 x raw p50 + broker hop p50",
                    "file_ratio": TARGET_FILE_RATIO},
    }
    res["pass"] = (res["mqtt_p99_ms"] <= TARGET_P99_MS and g["p50"] <= bound
                   and res["write_ratio"] >= TARGET_FILE_RATIO and res["read_ratio"] >= TARGET_FILE_RATIO)
    print(f"raw socket   h round trip  p50 {res['raw_p50_ms']:.3f} ms  p99 {res['raw_p99_ms']:.3f} ms")
    print(f"broker hop   bare echo     p50 {res['broker_hop_p50_ms']:.3f} ms  p99 {res['broker_hop_p99_ms']:.3f} ms")
    print(f"MQTT         heartbeat     p50 {res['mqtt_p50_ms']:.3f} ms  p99 {res['mqtt_p99_ms']:.3f} ms "
          f"(p99 target {TARGET_P99_MS} ms: {res['mqtt_p99_ms'] / TARGET_P99_MS:.2f} x; p50 bound "
          f"{res['mqtt_p50_bound_ms']:.3f} ms: {res['mqtt_p50_over_bound']:.2f} x)")
    print(f"file write   raw {res['raw_write_blocks_s']:.0f} blocks/s  gateway {res['gw_write_blocks_s']:.0f} "
          f"blocks/s  ratio {res['write_ratio']:.2f} (target >= {TARGET_FILE_RATIO})")
    print(f"file read    raw {res['raw_read_blocks_s']:.0f} blocks/s  gateway {res['gw_read_blocks_s']:.0f} "
          f"blocks/s  ratio {res['read_ratio']:.2f} (target >= {TARGET_FILE_RATIO})")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
