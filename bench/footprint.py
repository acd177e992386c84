"""Footprint of `make run`: resident memory and CPU of every process of the whole simulated system, idle.

Starts what `make run` starts (deploy/dev/supervise.py over deploy/Procfile.sim: the broker, every service on its
simulator, the dashboard and the banner, under one supervisor process), on free ports and a private broker so
that it runs beside anything; waits until every registered service has a node online; then samples every process
of the tree (the supervisor, its children and theirs, e.g. the EtherCAT cycle process) for `--seconds`: resident
memory (VmRSS, the mean of the samples) and CPU (utime + stime over the window, as a fraction of one core); and,
at the end of the window, what the memory is made of: the process's own (heap, stacks) and mapped files (the
interpreter, shared libraries and extension modules, whose pages the processes share), and its threads.

    python bench/footprint.py [--seconds 30] [--quick]

Targets: the whole system <= 400 MB resident and <= 20 % of one core idle; each service process <= 45 MB.
Prints a table per process, the totals with their ratio to the targets, and met / not met; last line: one JSON
object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from shared.registry import service_plugins  # noqa: E402
from shared.tools.localbroker import free_port  # noqa: E402

TARGET_TOTAL_MB = 400.0
TARGET_TOTAL_CORE = 0.20
TARGET_SERVICE_MB = 45.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
# the Procfile's fixed addresses, replaced by free ones so the bench runs beside a `make run`
FIXED_PORTS = ("50000", "8080")
# the e-puck simulator's robots: on consecutive ports from its --base-port
EPUCK_BASE_PORT, EPUCK_ROBOTS = 11000, 2


def _free_run(count: int) -> int:
    """The first of `count` consecutive free ports."""
    for _ in range(100):
        base = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base + 1, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def procfile(tmp: Path) -> Path:
    text = (REPO / "deploy" / "Procfile.sim").read_text()
    for fixed in FIXED_PORTS:
        text = re.sub(rf"\b{fixed}\b", str(free_port()), text)
    base = _free_run(EPUCK_ROBOTS)  # every robot's port moves: the gateway reaches each of them
    for i in range(EPUCK_ROBOTS):
        text = re.sub(rf"\b{EPUCK_BASE_PORT + i}\b", str(base + i), text)
    text = text.replace("/tmp/robobus-epuck-serial", str(tmp / "epuck-serial"))
    # Home Assistant discovery runs only on request (ROBOBUS_HOMEASSISTANT=true), as in deploy/dev/run-local.sh
    if os.environ.get("ROBOBUS_HOMEASSISTANT", "false") != "true":
        text = "\n".join(line for line in text.splitlines() if not line.startswith("homeassistant:")) + "\n"
    # and the recorder only when recording (ROBOBUS_RECORD=1), as deploy/dev/run-local.sh
    if os.environ.get("ROBOBUS_RECORD", "0") != "1":
        text = "\n".join(line for line in text.splitlines() if not line.startswith("recorder:")) + "\n"
    out = tmp / "Procfile"
    out.write_text(text)
    return out


def tree(root: int) -> dict[int, str]:
    """pid -> a short name, for `root` and every process under it."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
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
        names[int(d.name)] = _name([c.decode(errors="replace") for c in cmd if c])
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        out[pid] = names.get(pid, "?")
        todo.extend(children.get(pid, []))
    return out


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
        env = {**os.environ, "ROBOBUS_MOSQUITTO_CONF": str(conf), "ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{port}",
               "ROBOBUS_ROI_NETWORK": f"127.{40 + os.getpid() % 200}.9",
               "PATH": f"{REPO / '.venv' / 'bin'}:/usr/sbin:{os.environ.get('PATH', '')}"}
        # as deploy/dev/run-local.sh starts it (-S: the supervisor needs no site-packages)
        sup = subprocess.Popen([sys.executable, "-S", str(REPO / "deploy/dev/supervise.py"), "--procfile",
                                str(procfile(tmp)), "--rundir", str(tmp / "run")],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        try:
            services = {p.name for p in service_plugins()}
            online_s = wait_online(port, services, 90.0)
            time.sleep(a.settle)
            pids = tree(sup.pid)
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
        rows.append({"pid": pid, "process": pids[pid], "rss_mb": round(mb, 1),
                     "cpu_core": round((last[pid][1] - cpu0) / window, 4), "anon_mb": made[pid].get("RssAnon"),
                     "file_mb": made[pid].get("RssFile"), "threads": made[pid].get("Threads")})
    rows.sort(key=lambda r: -r["rss_mb"])
    service_mods = {p.module.rsplit(".", 1)[0].replace("services.", "") for p in service_plugins()}
    total_mb = sum(r["rss_mb"] for r in rows)
    total_core = sum(r["cpu_core"] for r in rows)
    print(f"`make run` idle, {len(rows)} processes, {window:.0f} s window ({online_s:.1f} s to every node online)")
    print(f"{'process':<44} {'RSS MB':>8} {'CPU % core':>11}   {'own MB':>7} {'files MB':>9} {'threads':>8}")
    over = []
    for r in rows:
        is_service = r["process"] in service_mods
        flag = ""
        if is_service and r["rss_mb"] > TARGET_SERVICE_MB:
            flag = f"  > {TARGET_SERVICE_MB:.0f} MB"
            over.append(r["process"])
        print(f"{r['process']:<44} {r['rss_mb']:>8.1f} {100 * r['cpu_core']:>11.1f}   {r['anon_mb'] or 0:>7.1f} "
              f"{r['file_mb'] or 0:>9.1f} {r['threads'] or 0:>8}{flag}")
    met_mb, met_core = total_mb <= TARGET_TOTAL_MB, total_core <= TARGET_TOTAL_CORE
    print(f"{'total':<44} {total_mb:>8.1f} {100 * total_core:>11.1f}")
    print(f"total RSS {total_mb:.0f} MB / {TARGET_TOTAL_MB:.0f} MB = {total_mb / TARGET_TOTAL_MB:.2f}: "
          f"{'met' if met_mb else 'not met'}")
    print(f"total CPU {100 * total_core:.1f} % / {100 * TARGET_TOTAL_CORE:.0f} % of a core = "
          f"{total_core / TARGET_TOTAL_CORE:.2f}: {'met' if met_core else 'not met'}")
    print(f"each service <= {TARGET_SERVICE_MB:.0f} MB: {'met' if not over else 'not met (' + ', '.join(over) + ')'}")
    result = {"bench": "footprint", "processes": rows, "total_rss_mb": round(total_mb, 1),
              "total_cpu_core": round(total_core, 4), "window_s": round(window, 1),
              "load": round(os.getloadavg()[0], 2),
              "targets": {"total_rss_mb": TARGET_TOTAL_MB, "total_cpu_core": TARGET_TOTAL_CORE,
                          "service_rss_mb": TARGET_SERVICE_MB},
              "met": {"total_rss": met_mb, "total_cpu": met_core, "service_rss": not over}}
    service_rows: list[dict[str, Any]] = [r for r in rows if r["process"] in service_mods]
    biggest = max(service_rows, key=lambda r: float(r["rss_mb"]), default=None)
    report("footprint", result, [
        Figure(f"`make run` idle, {len(rows)} processes: resident memory", round(total_mb), "MB", "<=",
               TARGET_TOTAL_MB),
        Figure("`make run` idle: CPU", round(100 * total_core, 1), "% of a core", "<=", 100 * TARGET_TOTAL_CORE),
        Figure(f"largest service process ({biggest['process'] if biggest else '-'})",
               float(biggest["rss_mb"]) if biggest else None, "MB", "<=", TARGET_SERVICE_MB),
    ], variant=variant_name("quick" if a.quick else ""))


if __name__ == "__main__":
    main()
