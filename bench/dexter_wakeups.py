"""Where a DexRun round trip's wake-ups land: the same CPU or the other one (`perf sched`, root).

    python bench/dexter_wakeups.py [--quick] [--seconds 1.0]

The set-up of bench/dexter.py (a private mosquitto, simulators and the gateway in their own processes), then
three phases, each recorded with `perf sched record` for `--seconds`:
- `gateway`: `heartbeat` through MQTT, back to back;
- `raw`: the raw socket client's `h` round trips, back to back (bench/dexter.py's reference);
- `turns`: the raw client's `h` and a `heartbeat` in turn, one each (bench/dexter.py's call-by-call phase).
For every wake-up between the processes of interest (who woke whom), it prints how often the wakee ran on the
waker's CPU, and the wake-up latency (from `sched_waking` to the wakee running) on the same CPU and across.
On this project's 2-vCPU VM a wake-up across CPUs costs ~35-55 us where one on the same CPU costs a few:
waking an idle vCPU goes through the hypervisor. That is why the raw client's tight loop (which keeps its
simulator on its own CPU, hot) is 3-4 x faster than the same client's round trip taken in turn with other
traffic, and why the bound of bench/dexter.py is judged call by call (services/dexter_gateway/README.md).
Needs `perf` (Debian's linux-perf) and root; without them it says so and exits 0. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import dexter as bd  # noqa: E402  (bench/dexter.py: the same simulators, clients and gateway)

from shared.rpc import wait_for  # noqa: E402
from shared.tools.localbroker import Broker, NodeProcess, free_port  # noqa: E402

EVENT = re.compile(r"\s*\S+\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)")


def tids(pid: int) -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        return set()


def wakeups(data: Path) -> list[tuple[int, int, bool, float]]:
    """(waker tid, wakee tid, same CPU, latency us) for every wake-up in a `perf sched record` file."""
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,cpu,time,event,trace"],
                          capture_output=True, text=True, check=False).stdout
    waking: dict[int, tuple[float, int, int]] = {}
    out = []
    for line in text.splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        tid, cpu, t, ev, rest = int(m[1]), int(m[2]), float(m[3]), m[4], m[5]
        if ev == "sched:sched_waking":
            target = re.search(r"pid=(\d+)", rest)
            if target:
                waking[int(target[1])] = (t, tid, cpu)
        elif ev == "sched:sched_switch":
            nxt = re.search(r"next_pid=(\d+)", rest)
            if nxt and int(nxt[1]) in waking:
                t0, waker, waker_cpu = waking.pop(int(nxt[1]))
                out.append((waker, int(nxt[1]), waker_cpu == cpu, (t - t0) * 1e6))
    return out


def p50(xs: list[float]) -> float | None:
    return round(sorted(xs)[len(xs) // 2], 1) if xs else None


def summarise(events: list[tuple[int, int, bool, float]], groups: dict[str, set[int]],
              pairs: list[tuple[str, str]]) -> dict[str, Any]:
    who = {tid: name for name, ts in groups.items() for tid in ts}
    by: dict[tuple[str, str], list[tuple[bool, float]]] = defaultdict(list)
    for waker, wakee, on_same_cpu, lat in events:
        a, b = who.get(waker), who.get(wakee)
        if a and b and a != b:
            by[(a, b)].append((on_same_cpu, lat))
    res = {}
    for a, b in pairs:
        xs = by.get((a, b), [])
        same = [lat for s, lat in xs if s]
        cross = [lat for s, lat in xs if not s]
        res[f"{a}->{b}"] = {"n": len(xs), "same_cpu": round(len(same) / len(xs), 2) if xs else None,
                            "same_p50_us": p50(same), "cross_p50_us": p50(cross)}
    return res


def record(phase: str, d: Path, seconds: float, work: Callable[[], list[float]]) -> tuple[Path, list[float]]:
    data = d / f"sched-{phase}.data"
    rec = subprocess.Popen(["perf", "sched", "record", "-o", str(data), "--", "sleep", str(seconds + 0.4)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.2)
    end = time.monotonic() + seconds
    rts: list[float] = []
    while time.monotonic() < end:
        rts += work()
    rec.wait(60)
    return data, rts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=0.0)
    a = ap.parse_args()
    seconds = a.seconds or (0.5 if a.quick else 1.0)
    if shutil.which("perf") is None or os.geteuid() != 0:
        print("dexter_wakeups: needs perf (Debian's linux-perf) and root; skipped")
        print(json.dumps({"skipped": True}))
        return
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="dexter-wakeups-") as tmp:
        d = Path(tmp)
        broker = Broker(free_port(), d)
        broker.start()
        gw_port, raw_port = free_port(), free_port()
        sims = [bd.start_sim(gw_port, d / "gw", env), bd.start_sim(raw_port, d / "raw", env)]
        gw: NodeProcess | None = None
        try:
            assert wait_for(lambda: bd.listening(gw_port) and bd.listening(raw_port), 30), "simulators down"
            time.sleep(0.3)
            gw, client = bd.start_gateway(broker, gw_port, env, "dexter-wakeups")
            raw = bd.RawSide(raw_port)
            gws = bd.GatewaySide(client)
            assert broker.proc is not None
            groups = {"bench": tids(os.getpid()), "gateway": tids(gw.proc.pid), "gw_sim": tids(sims[0].pid),
                      "raw_sim": tids(sims[1].pid), "mosquitto": tids(broker.proc.pid)}
            pairs = [("bench", "mosquitto"), ("mosquitto", "gateway"), ("gateway", "gw_sim"), ("gw_sim", "gateway"),
                     ("gateway", "mosquitto"), ("mosquitto", "bench"), ("bench", "raw_sim"), ("raw_sim", "bench")]

            def turns() -> list[float]:
                return [raw.round_trips(1)[0], gws.round_trips(1)[0]]
            phases: dict[str, Any] = {}
            for phase, work in (("gateway", lambda: gws.round_trips(20)), ("raw", lambda: raw.round_trips(20)),
                                ("turns", turns)):
                data, rts = record(phase, d, seconds, work)
                phases[phase] = {"round_trips": len(rts), "wakeups": summarise(wakeups(data), groups, pairs)}
                if phase == "turns":  # raw, gateway, raw, gateway...
                    phases[phase]["raw_p50_ms"] = round(sorted(rts[0::2])[len(rts) // 4], 3)
                    rts = rts[1::2]
                phases[phase]["p50_ms"] = round(sorted(rts)[len(rts) // 2], 3)
            raw.c.close()
            client.close()
        finally:
            if gw is not None:
                gw.stop()
            for proc in sims:
                proc.terminate()
                proc.wait(10)
            broker.kill()
    for phase, r in phases.items():
        extra = f" (the raw client's in turn: {r['raw_p50_ms']:.3f} ms)" if "raw_p50_ms" in r else ""
        print(f"{phase}: {r['round_trips']} round trips, p50 {r['p50_ms']:.3f} ms{extra}")
        for pair, w in r["wakeups"].items():
            if w["n"]:
                print(f"  {pair:22s} n={w['n']:5d}  same CPU {w['same_cpu']:.2f}  latency p50 same "
                      f"{w['same_p50_us']} us, across {w['cross_p50_us']} us")
    print(json.dumps({"seconds": seconds, "phases": phases}))


if __name__ == "__main__":
    main()
