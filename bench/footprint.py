"""Footprint of `make run`: resident memory and CPU of every process of the whole simulated system, idle.

Starts what `make run` starts (deploy/dev/supervise.py over deploy/Procfile.sim: the broker, every service on its
simulator, the dashboard and the banner, under one supervisor process), on ports and links of its own (the
Procfile's `${ROBOBUS_PORT_*}` / `${ROBOBUS_LINK_*}` variables, shared/tools/simrig.py) and a private broker so
that it runs beside anything; waits until every registered service has a node online; then samples every process
of the tree (the supervisor, its children and theirs, e.g. the EtherCAT cycle process) for `--seconds`: resident
memory (VmRSS, the mean of the samples) and CPU (utime + stime over the window, as a fraction of one core); and,
at the end of the window, what the memory is made of: the process's own (heap, stacks) and mapped files (the
interpreter, shared libraries and extension modules, whose pages the processes share), and its threads.

    python bench/footprint.py [--seconds 30] [--quick]

Each part is judged against its own bound, so that a service added to `make run` brings its own budget:
- the kit's overhead (the supervisor, the broker, the dashboard, the banner: every process that serves no
  registered service) <= 75 MB resident and <= 3 % of one core;
- each tool beside the kit (the Foxglove bridge, the Prometheus exporter: `TOOLS`) against its own bound;
- each registered service (its node, the processes the node starts, and its simulators, `<x>-sim` serving `<x>-...`)
  against the bound its rig declares (`SimRig.footprint`, each service's from its own measured shape), by default
  node <= 45 MB, all <= 70 MB and <= 4 % of a core.
The whole system's figures are judged against the sum of those bounds. Prints a table per process, one per part,
met / not met; last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from shared.registry import service_packages  # noqa: E402
from shared.tools.localbroker import free_port  # noqa: E402
from shared.tools.simrig import Footprint, footprint_of, own_procfile_env, procfile_commands, sim_serves  # noqa: E402

# the kit's own processes: the supervisor, the broker, the dashboard, the banner (and the recorder or Home
# Assistant's bridge when asked for); every process that serves no registered service
KIT_MB = 75.0
KIT_CORE = 0.03
# the tools `make run` starts beside the kit, each with a bound of its own (resident MB, fraction of a core): a
# server for people's tools that reads the bus, idle here with no client connected
TOOLS: dict[str, tuple[float, float]] = {"foxglove": (70.0, 0.03), "prometheus": (50.0, 0.02)}
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
KIT = "kit"


def procfile(tmp: Path) -> tuple[Path, dict[str, str]]:
    """`make run`'s Procfile with the lines deploy/dev/run-local.sh starts, and the environment that gives its
    ports and links ones of this run's own (the Procfile's `${ROBOBUS_PORT_*}` / `${ROBOBUS_LINK_*}` variables)."""
    lines = procfile_commands()
    # Home Assistant discovery runs only on request (ROBOBUS_HOMEASSISTANT=true), as in deploy/dev/run-local.sh
    if os.environ.get("ROBOBUS_HOMEASSISTANT", "false") != "true":
        lines.pop("homeassistant", None)
    # and the recorder only when recording (ROBOBUS_RECORD=1), as deploy/dev/run-local.sh
    if os.environ.get("ROBOBUS_RECORD", "0") != "1":
        lines.pop("recorder", None)
    out = tmp / "Procfile"
    out.write_text("".join(f"{name}: {command}\n" for name, command in lines.items()))
    return out, own_procfile_env(lines.values(), tmp)


def parts(procs: dict[str, int], pids: dict[int, int]) -> dict[int, str]:
    """pid -> the part it counts to: the registered service whose node or simulator it is (or descends from),
    else the kit. `procs`: Procfile process -> pid, as the supervisor spawned it; `pids`: pid -> its parent."""
    services = set(service_packages())
    serves = sim_serves(procs)
    owner = {pid: (name if name in services or name in TOOLS else serves.get(name, KIT))
             for name, pid in procs.items()}
    out: dict[int, str] = {}
    for pid in pids:
        p, hops = pid, 0
        while p not in owner and p in pids and hops < 32:
            p, hops = pids[p], hops + 1
        out[pid] = owner.get(p, KIT)
    return out


def spawned(log: Path) -> dict[str, int]:
    """Procfile process -> its pid, from the supervisor's log (the last `spawned: 'name' with pid N` of each)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"spawned: '([^']+)' with pid (\d+)", log.read_text())}


def bounds() -> dict[str, Footprint]:
    """Each registered service's bound: its rig's (SimRig.footprint), else the default."""
    return {name: footprint_of(pkg) for name, pkg in service_packages().items()}


def tree(root: int) -> tuple[dict[int, str], dict[int, int]]:
    """pid -> a short name, and pid -> its parent, for `root` and every process under it."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
        parent[int(d.name)] = ppid
        names[int(d.name)] = _name([c.decode(errors="replace") for c in cmd if c])
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        out[pid] = names.get(pid, "?")
        todo.extend(children.get(pid, []))
    return out, {pid: parent[pid] for pid in out if pid in parent}


def _name(argv: list[str]) -> str:
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        mod = argv[argv.index("-m") + 1]
        name = mod.replace("services.", "").replace("shared.tools.", "").replace("shared.", "")
        return name + (" " + argv[-1] if mod.endswith("cycle") else "")
    joined = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv))
    for key in ("supervise", "mosquitto", "dashboard", "banner", "sleep"):
        if key in joined:
            return key
    return joined[:40]


def sample(pid: int) -> tuple[int, float] | None:
    """(resident kB, CPU seconds) of one process."""
    try:
        statm = Path(f"/proc/{pid}/statm").read_text().split()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(statm[1]) * PAGE_KB, (int(stat[11]) + int(stat[12])) / CLK_TCK


def makeup(pid: int) -> dict[str, float]:
    """What a process's resident memory is made of (MB): its own (heap, stacks: RssAnon) and mapped files
    (the interpreter, shared libraries, extension modules: RssFile, partly shared with the other processes);
    and its threads."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
            elif key == "Threads":
                out[key] = int(value)
    except OSError:
        pass
    return out


def wait_online(port: int, services: set[str], timeout: float) -> float:
    seen: dict[str, bool] = {}
    lock = threading.Lock()

    def on_message(_c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        try:
            s = json.loads(msg.payload)
        except ValueError:
            return
        with lock:
            seen[str(s.get("service"))] = bool(s.get("online"))

    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.on_connect = lambda cl, *_: cl.subscribe("robobus/+/status", qos=1)
    c.on_message = on_message
    c.connect_async("127.0.0.1", port)
    c.loop_start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            with lock:
                if services <= {s for s, on in seen.items() if on}:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError(f"not every service online within {timeout} s: {seen}")
    finally:
        c.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        c.loop_stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="the idle window sampled")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after every node is online")
    ap.add_argument("--quick", action="store_true", help="a 10 s window")
    a = ap.parse_args()
    seconds = 10.0 if a.quick else a.seconds
    with tempfile.TemporaryDirectory(prefix="robobus-bench-footprint-") as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        conf = tmp / "mosquitto.conf"
        conf.write_text(f"allow_anonymous true\npersistence false\nset_tcp_nodelay true\nlistener {port} 127.0.0.1\n")
        procfile_path, own_env = procfile(tmp)
        env = {**os.environ, "ROBOBUS_MOSQUITTO_CONF": str(conf), "ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{port}",
               "ROBOBUS_ROI_NETWORK": f"127.{40 + os.getpid() % 200}.9",
               "PATH": f"{REPO / '.venv' / 'bin'}:/usr/sbin:{os.environ.get('PATH', '')}", **own_env}
        sup_log = tmp / "supervise.log"
        # as deploy/dev/run-local.sh starts it (-S: the supervisor needs no site-packages)
        with sup_log.open("wb") as out:
            sup = subprocess.Popen([sys.executable, "-S", str(REPO / "deploy/dev/supervise.py"), "--procfile",
                                    str(procfile_path), "--rundir", str(tmp / "run")],
                                   cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            services = set(service_packages())
            online_s = wait_online(port, services, 90.0)
            time.sleep(a.settle)
            pids, parents = tree(sup.pid)
            part = parts(spawned(sup_log), parents)
            first = {pid: s for pid in pids if (s := sample(pid)) is not None}
            rss: dict[int, list[int]] = {pid: [] for pid in first}
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                for pid in first:
                    s = sample(pid)
                    if s is not None:
                        rss[pid].append(s[0])
                time.sleep(1.0)
            window = time.monotonic() - t0
            last = {pid: s for pid in first if (s := sample(pid)) is not None}
            made = {pid: makeup(pid) for pid in last}
        finally:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(60)
            except subprocess.TimeoutExpired:
                sup.kill()
    rows: list[dict[str, Any]] = []
    for pid, (_, cpu0) in first.items():
        if pid not in last or not rss[pid]:
            continue
        mb = sum(rss[pid]) / len(rss[pid]) / 1024
        rows.append({"pid": pid, "process": pids[pid], "part": part.get(pid, KIT), "rss_mb": round(mb, 1),
                     "cpu_core": round((last[pid][1] - cpu0) / window, 4), "anon_mb": made[pid].get("RssAnon"),
                     "file_mb": made[pid].get("RssFile"), "threads": made[pid].get("Threads")})
    rows.sort(key=lambda r: (r["part"] != KIT, r["part"], -r["rss_mb"]))
    judged = judge(rows, bounds(), {p.name: p for p in spawned_nodes(rows)})
    print(f"`make run` idle, {len(rows)} processes, {window:.0f} s window ({online_s:.1f} s to every node online)")
    print(f"{'part':<16} {'process':<36} {'RSS MB':>8} {'CPU % core':>11}   {'own MB':>7} {'files MB':>9} "
          f"{'threads':>8}")
    for r in rows:
        print(f"{r['part']:<16} {r['process']:<36} {r['rss_mb']:>8.1f} {100 * r['cpu_core']:>11.1f}   "
              f"{r['anon_mb'] or 0:>7.1f} {r['file_mb'] or 0:>9.1f} {r['threads'] or 0:>8}")
    for f in judged:
        print(f"{f.name}: {f.value} {f.unit} {f.op} {f.target:g} = {f.ratio}: {'met' if f.met else 'not met'}")
    total_mb = sum(r["rss_mb"] for r in rows)
    total_core = sum(r["cpu_core"] for r in rows)
    result = {"bench": "footprint", "processes": rows, "total_rss_mb": round(total_mb, 1),
              "total_cpu_core": round(total_core, 4), "window_s": round(window, 1),
              "load": round(os.getloadavg()[0], 2),
              "targets": {"kit": {"rss_mb": KIT_MB, "cpu_core": KIT_CORE},
                          **{s: vars(b) for s, b in bounds().items()}},
              "met": {f.name: f.met for f in judged}}
    report("footprint", result, judged, variant=variant_name("quick" if a.quick else ""))


def spawned_nodes(rows: list[dict[str, Any]]) -> list[Node]:
    """The node process of each service: the part's process whose name is its package's (not a simulator's, not
    a process the node started)."""
    packages = service_packages()
    out = []
    for r in rows:
        pkg = packages.get(r["part"])
        if pkg is not None and r["process"] == pkg.replace("services.", ""):
            out.append(Node(r["part"], float(r["rss_mb"])))
    return out


@dataclass(frozen=True)
class Node:
    name: str
    rss_mb: float


def judge(rows: list[dict[str, Any]], service_bounds: dict[str, Footprint], nodes: dict[str, Node]) -> list[Figure]:
    """The figures, headline first: the whole system against the sum of the bounds; then the kit's overhead and
    each service (node, all its processes, its CPU) against its own bound."""
    def total(part: str, key: str) -> float:
        return sum(float(r[key]) for r in rows if r["part"] == part)

    tools = {name: bound for name, bound in TOOLS.items() if any(r["part"] == name for r in rows)}
    budget_mb = KIT_MB + sum(b.total_mb for b in service_bounds.values()) + sum(mb for mb, _ in tools.values())
    budget_core = (KIT_CORE + sum(b.cpu_core for b in service_bounds.values())
                   + sum(core for _, core in tools.values()))
    all_mb = sum(float(r["rss_mb"]) for r in rows)
    all_core = sum(float(r["cpu_core"]) for r in rows)
    figures = [
        Figure(f"`make run` idle, {len(rows)} processes: resident memory (kit + each service's bound)", round(all_mb),
               "MB", "<=", budget_mb),
        Figure("`make run` idle: CPU (kit + each service's bound)", round(100 * all_core, 1), "% of a core", "<=",
               round(100 * budget_core, 1)),
        Figure("the kit's overhead (supervisor, broker, dashboard): resident memory", round(total(KIT, "rss_mb"), 1),
               "MB", "<=", KIT_MB),
        Figure("the kit's overhead: CPU", round(100 * total(KIT, "cpu_core"), 1), "% of a core", "<=",
               100 * KIT_CORE),
    ]
    for name, (mb, core) in sorted(tools.items()):
        figures += [
            Figure(f"{name} (a tool beside the kit): resident memory", round(total(name, "rss_mb"), 1), "MB", "<=",
                   mb),
            Figure(f"{name}: CPU", round(100 * total(name, "cpu_core"), 1), "% of a core", "<=", round(100 * core, 1)),
        ]
    for name, b in sorted(service_bounds.items()):
        node = nodes.get(name)
        figures += [
            Figure(f"{name}: node process resident memory", node.rss_mb if node else None, "MB", "<=", b.node_mb),
            Figure(f"{name}: node, its processes and simulators, resident memory", round(total(name, "rss_mb"), 1),
                   "MB", "<=", b.total_mb),
            Figure(f"{name}: CPU", round(100 * total(name, "cpu_core"), 1), "% of a core", "<=",
                   round(100 * b.cpu_core, 1)),
        ]
    return figures


if __name__ == "__main__":
    main()
