"""Benchmark: a fleet at scale against the clustered centre, N sites each sending what a real site sends over its
uplink, and the faults at scale.

The centre is deploy/compose.cluster.yaml as shipped: three ejabberd nodes (mod_mqtt, one Mnesia cluster),
fleet-watch and fleet-gate, its own compose project (bench/fleet_centre.py). Each site is its own host mosquitto
with the bridge make_secrets.bridge_conf generates for it: its own `bridge-<site>` user and password, TLS with the
fleet's CA, the centre's certificate checked against the node's address, all three nodes listed with the site's
main node first (sites spread evenly over the nodes), the shipped queue limits (bench/fleet_sites.py).

Why a recording and not lean site nodes: what the centre pays for is what crosses a site's bridge, and a site's
bridge carries only what its broker's topics carry, so a broker fed the same messages at the same times and sizes
sends the centre the same bytes as a site of real nodes would, at a fraction of the machine (a `make run` site is
~1.5 cores of Python here; 100 of them would be the whole machine 75 times over). The recording is one `make run`
site's uplink, 60 s (bench/fleet_record.py: status, health, events and replies as published, the states through
deploy/uplink.py's own default budget; committed as bench/fleet_sample.json.gz, 246 kB, so every run replays the
same traffic and costs no simulator CPU). One replayer process per step of the sweep plays every site of the step
into its broker (asyncio: one connection a site), each site from its own point of the sample, plus one stamped QoS
1 event a second per site that subscribers at the centre read (the latency and the count of messages lost). What
a recording does not do: answer commands (nothing at the site listens; fleet-gate answers for a cut site) and
send its nodes' status again after a restart (the site broker keeps them retained and the bridge resends them on
every reconnect, as at a real site).

A full run is three sweeps, each with a centre of its own set up once for its largest N (every site's user and
access rule) and sites added step by step (RUNS): idle sites (10, 50, 100, 200, 300: the retained set once, the
heartbeat and the stamped events: what a connected site costs by itself; the faults run at its 100), the sample
(10, 20, 30, 40, 50 sites: how many real sites this machine holds) and the sample with its retain flags cleared
(the same steps: what retained messages cost, by difference). `--budget-min` bounds the run's time: a step that
would end past it is not started, and the result says so (a step not run is not a limit found).
At each step: every new bridge connected and the time for all to connect; after a settle, a steady window: the centre's
CPU (% of a core: each container's cgroup cpuacct over the window) and memory (resident, cgroup), per site and per
message; the site->centre latency of the stamped events (p50, p99) and those lost; the fleet stop (the operator at the
centre publishes every site's {root}/_stop, retained, QoS 1, one after another as a fleet stop would; each site's
replayer stamps its arrival on {root}/_stop/fleet, where every node of a site reads it): p50/p99/max over the sites from
the first publish; then its release. The faults: one node killed (the main node of a third of the sites): each of its
sites' bridge on another node (its own "1" notice), the distribution; QoS 1 lost across the kill; the node back. 10 % of
the sites cut 30 s (their brokers SIGSTOPped: link silent, nothing sent or read): fleet-watch says each unreachable, a
command to each is answered `unavailable` (fleet-gate), the others' latency beside the steady window's; continued, each
back. The whole centre restarted (compose stop, then up): the time to all-green (every site's bridge connected again),
its distribution (no site starved), the QoS 1 messages lost and when they were sent. A sweep stops at the first N the
machine does not hold: a bridge not connected within 120 s, a stamped event lost, or the latency p99 of a steady window
past 2 s (the centre queueing, not keeping up); what broke is said. Last, the capacity model: the centre's CPU fitted as
a base + a cost per connected site + a cost per message not retained + a cost per retained message over every step held,
and what it gives at 1,000 and 10,000 sites (docs/fleet-scale.md).

    python bench/fleet.py                    # the three sweeps and the model (~20 min; run it alone on the machine)
    python bench/fleet.py --budget-min 18    # the same, no step started that would end past 18 min
    python bench/fleet.py --quick            # 10 sites, the fleet stop and a node kill (the test's size)
    python bench/fleet.py --sites 10,20 --traffic idle --faults 20 --window 20     # one sweep
Prints the figures, the ratio to each target, and one JSON line (bench/results.py); bench/results/fleet[-quick].json
with ROBOBUS_BENCH_RESULTS=bench/results. Needs root and docker (deploy/dev/ensure-docker.sh) and mosquitto.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import paho.mqtt.client as mqtt  # noqa: E402
from fleet_centre import DEPLOY, NODES, SERVICES, Centre, Usage, ensure_images, run  # noqa: E402
from fleet_doc import render  # noqa: E402
from fleet_record import SAMPLE, load, summary  # noqa: E402
from fleet_sites import STAMP, STAMP_HZ, TRAFFIC, LogTail, Site, SiteBrokers, site_conf, write_plan  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from results import COMMITTED_DIR, Figure, report, variant_name  # noqa: E402

from shared.rpc import RpcClient  # noqa: E402
from shared.settings import KitSettings  # noqa: E402

CONNECT_WITHIN_S = 120.0  # every new bridge of a step connected within this, or the machine does not hold N
LATENCY_P99_LIMIT_S = 2.0  # past this in a steady window the centre is queueing, not keeping up: the sweep stops
FAILOVER_TARGET_S = 10.0  # tests/deploy/test_cluster.py's bound for one site
CUT_S = 30.0
DRAIN_S = 30.0
WATCHERS = ("ejabberd2", "ejabberd3")
DOCKER_BIN = "/usr/bin/docker"  # the centre's subscribers; ejabberd1 is the node the bench kills
KILLED = "ejabberd1"  # the node the node-kill fault kills: the centre's subscribers are on the other two
BRIDGE_ATTEMPT = re.compile(r"Connecting bridge .*\(([0-9.]+):\d+\)")  # mosquitto's log line for each attempt


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def dist(xs: list[float]) -> dict[str, float | int | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {"n": len(xs), "p50": r(pct(xs, 50)), "p99": r(pct(xs, 99)), "max": r(max(xs) if xs else None)}


def load_secret(folder: Path, user: str) -> tuple[str, str]:
    env = dict(line.split("=", 1) for line in (folder / f"{user}.env").read_text().splitlines()
               if "=" in line and not line.startswith("#"))
    return env["ROBOBUS_MQTT_USERNAME"], env["ROBOBUS_MQTT_PASSWORD"]


class CentreWatch:
    """Subscribers at the centre, one per node of WATCHERS (viewer): every site's stamped events (first arrival
    of each, the union of both: ejabberd can drop one subscriber from a node's index, deploy/README.md) and
    fleet-watch's verdicts, of the sites added so far. They subscribe again every 10 s, as fleet-watch does on
    ejabberd."""

    def __init__(self, centre: Centre, roots: dict[str, str]) -> None:
        self.roots = roots
        self.lock = threading.Lock()
        self.stamps: dict[str, dict[int, tuple[float, float]]] = {s: {} for s in roots}  # seq -> (sent, arrived)
        self.reachable: list[tuple[float, str, str, bool]] = []  # (t, site, value, retained)
        self.by_root = {r: s for s, r in roots.items()}
        self.active: list[str] = []  # the roots subscribed: the sites added so far (`add`)
        self.clients: list[mqtt.Client] = []
        self.connected: list[float] = []  # when each connection (and reconnection) was accepted
        user, password = load_secret(centre.secrets, "viewer")
        for node in WATCHERS:
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"viewer-fleetbench-{node}-{os.getpid()}",
                            protocol=mqtt.MQTTv5)
            c.username_pw_set(user, password)
            c.reconnect_delay_set(1, 2)  # back soon after a restarted centre (paho's default backs off to 120 s)
            c.on_message = self._on_message
            c.on_connect = self._on_connect
            c.connect("127.0.0.1", centre.ports[node], keepalive=30)
            c.loop_start()
            self.clients.append(c)
        self._stop = threading.Event()
        threading.Thread(target=self._resubscribe, daemon=True).start()

    def _on_connect(self, c: mqtt.Client, userdata: object, flags: object, rc: Any, props: object = None) -> None:
        if not rc.is_failure:
            with self.lock:
                self.connected.append(time.time())
            self._subscribe(c)

    def add(self, roots: list[str]) -> None:
        """Watch these sites' roots too (a step's new sites): only the sites that exist are subscribed, so the
        subscriptions renewed every 10 s grow with the sites connected, not with the run's largest step."""
        with self.lock:
            self.active += roots
        for c in self.clients:
            if c.is_connected():
                self._subscribe(c, roots)

    def _subscribe(self, c: mqtt.Client, roots: list[str] | None = None) -> None:
        if roots is None:
            with self.lock:
                roots = list(self.active)
        filters = [(f"{r}/{STAMP}", 1) for r in roots]
        filters += [(f"{r}/_bridge/reachable", 1) for r in roots]
        for i in range(0, len(filters), 50):
            c.subscribe(filters[i:i + 50])

    def _resubscribe(self) -> None:
        """Every 10 s: subscribe again; a client not connected (a node restarted while paho waited out its own
        back-off, or its CONNACK refused while the node was starting) is told to reconnect at once."""
        while not self._stop.wait(10.0):
            for c in self.clients:
                if c.is_connected():
                    self._subscribe(c)
                else:
                    with contextlib.suppress(OSError, ValueError):
                        c.reconnect()

    def _on_message(self, c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        now = time.time()
        root = msg.topic.split("/_bridge/")[0] if "/_bridge/" in msg.topic else msg.topic[:-len(STAMP) - 1]
        site = self.by_root.get(root)
        if site is None:
            return
        if msg.topic.endswith("/_bridge/reachable"):
            with self.lock:
                self.reachable.append((now, site, msg.payload.decode(errors="replace"), bool(msg.retain)))
            return
        with contextlib.suppress(ValueError, KeyError):
            d = json.loads(msg.payload)
            with self.lock:
                self.stamps[site].setdefault(int(d["seq"]), (float(d["t"]), now))

    def latencies(self, t0: float, t1: float, sites: list[str]) -> list[float]:
        with self.lock:
            return [a - s for site in sites for s, a in self.stamps[site].values() if t0 <= s < t1]

    def missing(self, sent: dict[str, int], sites: list[str], t0: float = 0.0) -> dict[str, list[int]]:
        """Per site, the stamped events sent (seq < sent[site]) after t0 that arrived at no subscriber."""
        out: dict[str, list[int]] = {}
        with self.lock:
            for site in sites:
                got = self.stamps[site]
                first = min((q for q, (s, _) in got.items() if s >= t0), default=0) if t0 else 0
                lost = [q for q in range(first, sent.get(site, 0)) if q not in got]
                if lost:
                    out[site] = lost
        return out

    def sent_time(self, site: str, seq: int) -> float | None:
        """When the stamped event `seq` of `site` was sent (one a second: from the nearest one that arrived)."""
        with self.lock:
            got = self.stamps[site]
            if not got:
                return None
            near = min(got, key=lambda q: abs(q - seq))
            return got[near][0] + (seq - near) / STAMP_HZ

    def verdict_after(self, site: str, value: str, t0: float) -> float | None:
        with self.lock:
            return next((t for t, s, v, r in self.reachable if s == site and v == value and t >= t0 and not r), None)

    def close(self) -> None:
        self._stop.set()
        for c in self.clients:
            c.disconnect()
            c.loop_stop()


@dataclass
class Replayer:
    proc: subprocess.Popen[bytes]
    log: Path
    sites: list[Site]
    tail: LogTail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = LogTail(self.log)


@dataclass
class Fleet:
    """The centre, the sites' brokers and their replayers, and the centre's subscribers."""

    work: Path
    max_sites: int
    traffic: str = "sample"
    sites: list[Site] = field(default_factory=list)
    replayers: list[Replayer] = field(default_factory=list)
    centre: Centre | None = None
    brokers: SiteBrokers | None = None
    watch: CentreWatch | None = None

    def names(self, n: int) -> list[str]:
        return [f"site{i:04d}" for i in range(n)]

    def setup(self) -> dict[str, float]:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.brokers = SiteBrokers(exe)
        roots = {s: f"{s}/robobus" for s in self.names(self.max_sites)}
        self.centre = Centre(f"{os.getpid()}", self.work / "centre", roots)
        ensure_images(self.work)
        t0 = time.monotonic()
        self.centre.prepare()
        secrets_s = time.monotonic() - t0
        run([DOCKER_BIN, "compose", "version"])  # fails early, saying so, without compose
        up_s = self.centre.up()
        self.watch = CentreWatch(self.centre, roots)
        return {"secrets_s": round(secrets_s, 1), "centre_up_s": round(up_s, 1)}

    def add_sites(self, n: int) -> list[Site]:
        """Sites up to n in all: their brokers and one replayer for the new ones."""
        assert self.centre is not None and self.brokers is not None
        from fleet_centre import free_port

        start = len(self.sites)
        bridges: dict[str, str] = {}
        todo: list[Site] = []
        for i, name in enumerate(self.names(n)[start:], start):
            (self.work / "sites" / name).mkdir(parents=True, exist_ok=True)
            user, password = load_secret(self.centre.secrets, f"bridge-{name}")
            bridges[name] = make_secrets().bridge_conf(name, f"{name}/robobus", self.centre.addresses(i), user,
                                                       password, str(self.centre.secrets / "fleet-ca.crt"))
            todo.append(Site(name, f"{name}/robobus", 0, (i * 0.618034) % 1.0))
        new: list[Site] = []
        # a port found free can be taken by another process before the broker binds it (the suite's other workers
        # pick ports too: a site's broker exited "Address already in use"); such a site gets another port
        for _attempt in range(5):
            started = []
            for site in todo:
                site = dataclasses.replace(site, port=free_port())
                folder = self.work / "sites" / site.name
                (folder / "mosquitto.log").unlink(missing_ok=True)
                (folder / "mosquitto.conf").write_text(site_conf(site, bridges[site.name], folder))
                self.brokers.start(site, folder / "mosquitto.conf")
                started.append(site)
            running, todo = self.brokers_running(started)
            new += running
            if not todo:
                break
        if todo:
            raise RuntimeError(f"site brokers that would not start: {[s.name for s in todo]}: "
                               f"{self.why_not_connected(todo[0].name)['broker_log']}")
        new.sort(key=lambda s: s.name)
        self.sites += new
        if self.watch is not None:
            self.watch.add([s.root for s in new])
        plan = self.work / f"plan-{n}.json"
        write_plan(new, plan, self.traffic)
        log = self.work / f"replay-{n}.jsonl"
        with open(self.work / f"replay-{n}.err", "w") as err:
            proc = subprocess.Popen([sys.executable, str(BENCH / "fleet_sites.py"), str(plan), str(log)],
                                    stdout=subprocess.DEVNULL, stderr=err)
        self.replayers.append(Replayer(proc, log, new))
        return new

    def events(self) -> list[dict[str, Any]]:
        for r in self.replayers:
            r.tail.read()
        return [e for r in self.replayers for e in r.tail.events]

    def bridge_ups(self, since: float) -> dict[str, float]:
        """site -> its first "1" notice (its bridge connected) at or after `since`."""
        out: dict[str, float] = {}
        for e in self.events():
            if e["k"] == "bridge" and e["v"] == "1" and e["t"] >= since:
                out.setdefault(e["site"], e["t"])
                out[e["site"]] = min(out[e["site"]], e["t"])
        return out

    def brokers_running(self, sites: list[Site], timeout: float = 20.0) -> tuple[list[Site], list[Site]]:
        """(running, exited): each site's broker once it holds its listening socket, or once it has exited (a port
        taken meanwhile). A connect to the port would not tell: the process that took it answers."""
        assert self.brokers is not None
        running: list[Site] = []
        exited: list[Site] = []
        pending = list(sites)
        deadline = time.monotonic() + timeout
        while pending:
            for site in list(pending):
                if self.brokers.procs[site.name].poll() is not None:
                    exited.append(site)
                elif self.brokers.listens(site.name, site.port):
                    running.append(site)
                else:
                    continue
                pending.remove(site)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"site brokers that did not start within {timeout:g} s: "
                                   f"{[s.name for s in pending]}")
            if pending:
                time.sleep(0.05)
        return running, exited

    def why_not_connected(self, site: str) -> dict[str, Any]:
        lines = self.broker_log(site) or ["(no log)"]
        seen = [e for e in self.events() if e.get("site") == site][-5:]
        err_file = self.work / f"replay-{len(self.sites)}.err"  # the step's replayer (add_sites)
        err = err_file.read_text(errors="replace")[-600:] if err_file.exists() else ""
        proc = self.brokers.procs.get(site) if self.brokers is not None else None
        return {"broker_log": lines[-12:], "replayer_events": seen, "replayer_stderr": err,
                "broker": process_state(proc.pid) if proc is not None and proc.poll() is None else "exited"}

    def broker_log(self, site: str) -> list[str]:
        log = self.work / "sites" / site / "mosquitto.log"
        return log.read_text(errors="replace").splitlines() if log.exists() else []

    def bridged_to(self, site: str) -> str | None:
        """The centre node a site's bridge holds now: the address of its broker's last connection attempt (every
        site is connected when asked, so that attempt is the one that held). Its first address is only a
        preference: a node slow to answer at start-up sends the bridge on to the next one."""
        assert self.centre is not None
        lines = self.broker_log(site)
        by_ip = {ip: n for n, ip in self.centre.ips.items()}
        for line in reversed(lines):
            m = BRIDGE_ATTEMPT.search(line)
            if m:
                return by_ip.get(m.group(1))
        return None

    def bridge_downs(self, since: float) -> set[str]:
        return {e["site"] for e in self.events() if e["k"] == "bridge" and e["v"] == "0" and e["t"] >= since}

    def sent(self) -> tuple[dict[str, int], int, int]:
        """Stamped events sent per site, every message the replayers sent and those of them retained, as last
        logged."""
        stamps: dict[str, int] = {}
        msgs = retained = 0
        for r in self.replayers:
            r.tail.read()
            last = r.tail.last_sent
            if last:
                stamps.update(last["stamps"])
                msgs += int(last["msgs"])
                retained += int(last.get("retained", 0))
        return stamps, msgs, retained

    def host_cpu_s(self) -> float:
        """CPU seconds of the bench's own processes so far (the sites' brokers, the replayers, this process with the
        centre's subscribers): load on the same two cores as the centre."""
        assert self.brokers is not None
        pids = self.brokers.pids() + [r.proc.pid for r in self.replayers if r.proc.poll() is None] + [os.getpid()]
        total = 0.0
        for pid in pids:
            with contextlib.suppress(OSError):
                total += proc_stat(pid)[1]
        return total

    def teardown(self) -> None:
        if self.watch:
            self.watch.close()
        for r in self.replayers:
            if r.proc.poll() is None:
                r.proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(10)
        if self.brokers:
            self.brokers.stop_all()
        if self.centre:
            self.centre.down()


def make_secrets() -> Any:
    from tests.deploy.deployfiles import make_secrets as mod

    return mod


def wait_for(pred: Any, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


# -- phases -----------------------------------------------------------------------------------------------------
def connect_step(fleet: Fleet, n: int) -> dict[str, Any]:
    t0 = time.time()
    new = fleet.add_sites(n)
    names = {s.name for s in new}
    wait_for(lambda: names <= set(fleet.bridge_ups(t0)), CONNECT_WITHIN_S, 0.5)
    ups = fleet.bridge_ups(t0)
    took = [ups[s] - t0 for s in names if s in ups]
    missing = sorted(names - set(ups))
    return {"new_sites": len(new), "connected": len(took), "all_connected_s": round(max(took), 2) if took else None,
            "connect_s": dist(took), "not_connected": missing[:20],
            # what a site not connected was doing: its broker's log and what its replayer connection saw
            "not_connected_why": {s: fleet.why_not_connected(s) for s in missing[:3]}}


def settle(fleet: Fleet, least_s: float = 5.0, timeout: float = 45.0) -> float:
    """Seconds until the centre has absorbed a step's joins (each new site's retained set comes at once, a burst
    of retained writes): every site's stamped events of the last seconds arrived, within 0.5 s at p99."""
    assert fleet.watch is not None
    names = [s.name for s in fleet.sites]
    t0 = time.monotonic()
    time.sleep(least_s)
    while time.monotonic() - t0 < timeout:
        now = time.time()
        lat = fleet.watch.latencies(now - 3.0, now - 1.0, names)
        if len(lat) >= len(names) * 2 * STAMP_HZ * 0.95 and (pct(lat, 99) or 0.0) < 0.5:
            break
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def machine_cpu() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine (/proc/stat): what was left for the centre, whoever else ran."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def steady(fleet: Fleet, window_s: float) -> dict[str, Any]:
    assert fleet.centre is not None and fleet.watch is not None
    containers = fleet.centre.containers()
    n = len(fleet.sites)
    _, msgs0, ret0 = fleet.sent()
    host0 = fleet.host_cpu_s()
    u0, t0, w0, m0 = fleet.centre.usage(containers), time.monotonic(), time.time(), machine_cpu()
    time.sleep(window_s)
    u1, t1, w1, m1 = fleet.centre.usage(containers), time.monotonic(), time.time(), machine_cpu()
    _, msgs1, ret1 = fleet.sent()
    host1 = fleet.host_cpu_s()
    secs = t1 - t0
    per: dict[str, dict[str, float]] = {}
    for s in SERVICES:
        a, b = u0.get(s), u1.get(s)
        if isinstance(a, Usage) and isinstance(b, Usage):
            per[s] = {"cpu_pct": round((b.cpu_ns - a.cpu_ns) / 1e9 / secs * 100, 2), "rss_mb": round(b.rss / 2**20, 1)}
    nodes_cpu = sum(per[s]["cpu_pct"] for s in NODES if s in per)
    centre_cpu = sum(p["cpu_pct"] for p in per.values())
    centre_mb = sum(p["rss_mb"] for p in per.values())
    nodes_mb = sum(per[s]["rss_mb"] for s in NODES if s in per)
    # what crossed into the centre: the replayed messages (every one is on a bridged topic), plus each site's
    # heartbeat (one per 2 s)
    msg_rate = (msgs1 - msgs0) / secs + n / 2.0
    lat = fleet.watch.latencies(w0, w1 - 2.0, [s.name for s in fleet.sites])
    return {"sites": n, "window_s": round(secs, 1), "per_container": per,
            "centre_cpu_pct": round(centre_cpu, 1), "nodes_cpu_pct": round(nodes_cpu, 1),
            "centre_rss_mb": round(centre_mb, 1), "nodes_rss_mb": round(nodes_mb, 1),
            "msgs_per_s_in": round(msg_rate, 1), "retained_per_s_in": round((ret1 - ret0) / secs, 1),
            "cpu_pct_per_site": round(centre_cpu / n, 3), "rss_mb_per_site": round(nodes_mb / n, 3),
            "cpu_us_per_msg": round(centre_cpu / 100 * 1e6 / msg_rate, 1) if msg_rate else None,
            "latency_s": dist(lat), "window_wall": [w0, w1],
            "host_side_cpu_pct": round((host1 - host0) / secs * 100, 1),
            "machine_idle_pct": round((m1[0] - m0[0]) / max(1, m1[1] - m0[1]) * 100, 1)}


def proc_stat(pid: int) -> tuple[str, float]:
    """A process's scheduler state (R, S, T...) and its CPU seconds so far, user + system (/proc/<pid>/stat)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return f[0], (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def process_state(pid: int, over_s: float = 1.0) -> dict[str, Any]:
    """A process's scheduler state and its CPU share over `over_s` (a broker spinning, stopped, or asleep)."""
    try:
        _, a = proc_stat(pid)
        time.sleep(over_s)
        state, b = proc_stat(pid)
    except (OSError, IndexError, ValueError) as e:
        return {"error": str(e)}
    return {"pid": pid, "state": state, "cpu_pct": round((b - a) / over_s * 100, 1)}


def operator(centre: Centre, node: str = "ejabberd2") -> mqtt.Client:
    user, password = load_secret(centre.secrets, "operator")
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"operator-fleetbench-{os.getpid()}", protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.connect("127.0.0.1", centre.ports[node], keepalive=30)
    c.loop_start()
    return c


def fleet_stop(fleet: Fleet, timeout: float = 60.0) -> dict[str, Any]:
    """Every site's {root}/_stop set, one publish after another from one operator at the centre, then released;
    each site's arrival on {root}/_stop/fleet, from the first publish."""
    assert fleet.centre is not None
    op = operator(fleet.centre)
    out: dict[str, Any] = {}
    try:
        for active in (True, False):
            tag = f"fleet-bench {os.getpid()} {time.time():.3f}"
            t0 = time.time()
            infos = []
            for s in fleet.sites:
                body = json.dumps({"active": active, "source": "fleet-bench", "reason": tag, "ts": time.time()})
                infos.append(op.publish(f"{s.root}/_stop", body.encode(), qos=1, retain=True))
            published = time.time() - t0
            names = {s.name for s in fleet.sites}

            def arrived(tag: str = tag) -> dict[str, float]:
                got: dict[str, float] = {}
                for e in fleet.events():
                    if e["k"] == "stop" and tag in e["v"]:
                        got.setdefault(e["site"], e["t"])
                return got

            wait_for(lambda names=names, arrived=arrived: names <= set(arrived()), timeout, 0.2)
            got = arrived()
            lat = [t - t0 for t in got.values()]
            out["stop" if active else "release"] = {**dist(lat), "reached": len(got), "sites": len(names),
                                                    "published_all_s": round(published, 3)}
    finally:
        op.disconnect()
        op.loop_stop()
    return out


def drain_and_count(fleet: Fleet, sites: list[str], since: float) -> tuple[int, int]:
    """(lost, sent) stamped events of `sites` sent at or after `since`, once every one sent has had DRAIN_S."""
    assert fleet.watch is not None
    sent, _, _ = fleet.sent()
    wait_for(lambda: not fleet.watch.missing(sent, sites, since) if fleet.watch else True, DRAIN_S, 0.5)
    missing = fleet.watch.missing(sent, sites, since)
    with fleet.watch.lock:
        total = sum(1 for s in sites for q, (t, _) in fleet.watch.stamps[s].items() if t >= since)
    return sum(len(v) for v in missing.values()), total + sum(len(v) for v in missing.values())


def node_kill(fleet: Fleet, after_s: float = 20.0) -> dict[str, Any]:
    """Kill one node of the centre; the sites whose bridges it held (from their brokers' logs, not from their
    address order) must move to another node, and no QoS 1 event of any site may be lost."""
    assert fleet.centre is not None
    where = {s.name: fleet.bridged_to(s.name) for s in fleet.sites}
    on_killed = sorted(s for s, n in where.items() if n == KILLED)
    per_node = {n: sum(1 for v in where.values() if v == n) for n in NODES}
    cid = fleet.centre.container(KILLED)
    t_kill = time.time()
    run([DOCKER_BIN, "kill", cid])
    wait_for(lambda: set(on_killed) <= set(fleet.bridge_ups(t_kill)), 120, 0.5)
    ups = fleet.bridge_ups(t_kill)
    moved = [ups[s] - t_kill for s in on_killed if s in ups]
    others_down = sorted(fleet.bridge_downs(t_kill) - set(on_killed))
    # a bridge that never moved: its broker's log and state (mosquitto 2.0.11 has been seen spinning in
    # keepalive__check after a failed TLS bridge connection: deploy/fleet/watchdog.py)
    not_moved = {s: fleet.why_not_connected(s) for s in on_killed if s not in ups}
    for s, why in not_moved.items():  # and what the nodes left made of it
        why["centre_log"] = {n: fleet.centre.log_lines(n, s) for n in NODES if n != KILLED}
    time.sleep(after_s)
    lost, counted = drain_and_count(fleet, [s.name for s in fleet.sites], t_kill - 5.0)
    t0 = time.monotonic()
    fleet.centre.compose("up", "-d", "--wait", "--wait-timeout", "300", KILLED, timeout=400)
    return {"killed": KILLED, "bridges_per_node": per_node, "sites_on_killed_node": len(on_killed),
            "moved": len(moved), "failover_s": dist(moved),
            "other_sites_that_dropped": others_down[:20], "not_moved_why": not_moved,
            "qos1_lost": lost, "qos1_counted": counted,
            "node_back_s": round(time.monotonic() - t0, 1)}


def cut_sites(fleet: Fleet, baseline: dict[str, Any]) -> dict[str, Any]:
    assert fleet.centre is not None and fleet.brokers is not None and fleet.watch is not None
    k = max(1, len(fleet.sites) // 10)
    cut = [s for s in fleet.sites[1::max(1, len(fleet.sites) // k)]][:k]
    cut_names = [s.name for s in cut]
    rest = [s.name for s in fleet.sites if s.name not in cut_names]
    t_cut = time.time()
    fleet.brokers.signal(cut_names, signal.SIGSTOP)
    answers: dict[str, str] = {}
    answered_s: list[float] = []
    try:
        wait_for(lambda: all(fleet.watch.verdict_after(n, "0", t_cut) for n in cut_names) if fleet.watch else True,
                 20, 0.5)
        unreachable = [v - t_cut for n in cut_names if (v := fleet.watch.verdict_after(n, "0", t_cut))]
        for s in cut:
            if time.time() - t_cut > CUT_S - 5:
                break
            settings = KitSettings(mqtt_url=f"mqtt://127.0.0.1:{fleet.centre.ports['ejabberd2']}",
                                   mqtt_username="operator",
                                   mqtt_password=load_secret(fleet.centre.secrets, "operator")[1],
                                   topic_root=s.root)
            t0 = time.monotonic()
            try:
                with RpcClient(settings, name="operator-fleetbench") as c:
                    t0 = time.monotonic()
                    rep = c.call("fleetbench", "probe", "ping", {}, timeout=10)
                answers[s.name] = (rep.error or {}).get("code", "ok") if not rep.ok else "ok"
                answered_s.append(time.monotonic() - t0)
            except TimeoutError:
                answers[s.name] = "timeout"
        time.sleep(max(0.0, t_cut + CUT_S - time.time()))
        others = fleet.watch.latencies(t_cut, t_cut + CUT_S, rest)
    finally:
        t_back = time.time()
        fleet.brokers.signal(cut_names, signal.SIGCONT)
    wait_for(lambda: all(fleet.watch.verdict_after(n, "1", t_back) for n in cut_names) if fleet.watch else True,
             60, 0.5)
    back = [v - t_back for n in cut_names if (v := fleet.watch.verdict_after(n, "1", t_back))]
    lost, counted = drain_and_count(fleet, [s.name for s in fleet.sites], t_cut - 5.0)
    base = baseline["latency_s"]
    return {"cut": len(cut), "said_unreachable_s": dist(unreachable),
            "answers": {a: list(answers.values()).count(a) for a in set(answers.values())},
            "unavailable": list(answers.values()).count("unavailable"), "answer_s": dist(answered_s),
            "others_latency_s": dist(others), "baseline_latency_s": base,
            "reachable_again_s": dist(back), "qos1_lost": lost, "qos1_counted": counted}


def centre_restart(fleet: Fleet) -> dict[str, Any]:
    assert fleet.centre is not None
    t_stop = time.time()
    fleet.centre.compose("stop", "-t", "10", timeout=300)
    down_s = time.time() - t_stop
    t_up = time.time()
    up_s = fleet.centre.up()
    names = {s.name for s in fleet.sites}
    wait_for(lambda: names <= set(fleet.bridge_ups(t_up)), 300, 1.0)
    ups = fleet.bridge_ups(t_up)
    back = [ups[s] - t_up for s in names if s in ups]
    assert fleet.watch is not None
    with fleet.watch.lock:
        watchers = sorted(t - t_up for t in fleet.watch.connected if t >= t_up)
    # the sites queue what they send meanwhile (local_cleansession false) and deliver it when their bridge is back;
    # the centre keeps no session (mod_mqtt session_expiry 0), so a subscriber at the centre gets those only if it
    # subscribed again before the bridge delivered them: lost is counted over what was sent from the stop on
    lost, counted = drain_and_count(fleet, list(names), t_stop - 5.0)
    sent, _, _ = fleet.sent()
    when = [t - t_up for site, seqs in fleet.watch.missing(sent, list(names), t_stop - 5.0).items() for q in seqs
            if (t := fleet.watch.sent_time(site, q)) is not None]
    return {"stop_s": round(down_s, 1), "centre_healthy_s": round(up_s, 1), "all_green_s": dist(back),
            "not_back": sorted(names - set(ups))[:20], "watchers_back_s": [round(w, 2) for w in watchers],
            "qos1_lost": lost, "qos1_counted": counted,
            # when the lost ones were sent, from the centre's `up` (negative: while it was stopping or down), and
            # those sent once both subscribers were back (what a subscriber that stays connected would lose)
            "lost_sent_at_s": dist(when), "lost_sent_before_up": sum(1 for w in when if w < 0),
            "lost_sent_after_watchers_back": sum(1 for w in when if len(watchers) >= 2 and w > watchers[1] + 1.0)
            if len(watchers) >= 2 else None}


# -- the run ----------------------------------------------------------------------------------------------------
# The sweeps of a full run: traffic (bench/fleet_sites.py TRAFFIC) -> (steps, the step of the faults). The sample's
# sweep finds how many real sites the machine holds; the unretained one prices the retained messages (by
# difference); the idle one prices a connected site by itself, goes further, and runs the faults at 100 sites.
RUNS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "idle": ((10, 50, 100, 200, 300), 100),
    "sample": ((10, 20, 30, 40, 50), None),
    "sample-unretained": ((10, 20, 30, 40, 50), None),
}
STEP_S = 60.0  # about what a step takes: with --budget-min, no step starts later than this before the end


def sweep(steps: list[int], faults_at: int | None, window_s: float, traffic: str = "sample",
          kill_only: bool = False, after_kill_s: float = 20.0, deadline: float = 0.0,
          latency_limit_s: float = LATENCY_P99_LIMIT_S) -> dict[str, Any]:
    """One centre, sites added step by step until `steps` are done, the machine does not hold them, or the run's
    time is up (`deadline`, monotonic; 0: none)."""
    work = Path(tempfile.mkdtemp(prefix="robobus-fleet-bench-"))
    fleet = Fleet(work, max(steps), traffic)
    result: dict[str, Any] = {"traffic": traffic, "steps": [], "faults": {}}
    try:
        result["setup"] = fleet.setup()
        for n in steps:
            if deadline and time.monotonic() > deadline - STEP_S:
                result["cut_short"] = f"the run's time was up before the step of {n} sites (not a limit found)"
                break
            step: dict[str, Any] = {"sites": n}
            result["steps"].append(step)
            step["connect"] = connect_step(fleet, n)
            if step["connect"]["connected"] < step["connect"]["new_sites"]:
                step["broke"] = f"{step['connect']['new_sites'] - step['connect']['connected']} bridges not " \
                                f"connected within {CONNECT_WITHIN_S:.0f} s"
                break
            step["settle_s"] = settle(fleet)
            step["steady"] = steady(fleet, window_s)
            t_lost = step["steady"]["window_wall"][0]
            step["fleet_stop"] = fleet_stop(fleet)
            lost, counted = drain_and_count(fleet, [s.name for s in fleet.sites], t_lost)
            step["qos1_lost"], step["qos1_counted"] = lost, counted
            p99 = step["steady"]["latency_s"]["p99"]
            if lost or p99 is None or p99 > latency_limit_s:
                step["broke"] = f"{lost} stamped events lost, site->centre latency p99 {p99} s " \
                                f"(the limit: {latency_limit_s} s), centre CPU " \
                                f"{step['steady']['centre_cpu_pct']} % of a core"
                break
            if faults_at is not None and n == faults_at:
                result["faults"]["sites"] = n
                result["faults"]["node_kill"] = node_kill(fleet, after_kill_s)
                if not kill_only:
                    result["faults"]["cut"] = cut_sites(fleet, step["steady"])
                    result["faults"]["centre_restart"] = centre_restart(fleet)
    finally:
        fleet.teardown()
        shutil.rmtree(work, ignore_errors=True)
    return result


def solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares (normal equations, Gauss-Jordan): the coefficients of ys ~ rows."""
    k = len(rows[0]) if rows else 0
    if len(rows) < k or k == 0:
        return None
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
         for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(k):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


def solve_nonnegative(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares with every coefficient >= 0 (a cost is never negative): the best fit over the subsets of the
    columns whose own least-squares coefficients are all >= 0, the others 0 (4 columns: 16 subsets). Where the
    columns are nearly collinear (every site of a sweep sends the same rate, so sites and messages grow together)
    the plain fit can trade one cost for a negative other; this one cannot."""
    k = len(rows[0]) if rows else 0
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 1 << k):
        cols = [i for i in range(k) if mask >> i & 1]
        coef = solve([[r[i] for i in cols] for r in rows], ys)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * k
        for i, c in zip(cols, coef, strict=True):
            full[i] = c
        residual = sum((y - sum(a * b for a, b in zip(r, full, strict=True))) ** 2 for r, y in zip(rows, ys,
                                                                                                  strict=True))
        if best is None or residual < best[0] - 1e-9:
            best = (residual, full)
    return best[1] if best else None


def model(runs: dict[str, Any], sample: dict[str, Any], retained_per_site: float) -> dict[str, Any]:
    """The centre's CPU as a base + a cost per connected site + a cost per message a second not retained + a cost
    per retained message a second, fitted over every steady window held (idle, unretained and sample sites); its
    memory as a base + a cost per site. What that gives at 1,000 and 10,000 sites, and the retained messages a
    second the cluster held and did not (a limit that is not CPU: it broke with cores to spare)."""
    held = [s["steady"] for r in runs.values() for s in r["steps"] if "steady" in s and "broke" not in s]
    rows = [[1.0, st["sites"], st["msgs_per_s_in"] - st["retained_per_s_in"], st["retained_per_s_in"]] for st in held]
    cpu = solve_nonnegative(rows, [st["centre_cpu_pct"] for st in held])
    mem = solve_nonnegative([[1.0, st["sites"]] for st in held], [st["centre_rss_mb"] for st in held])
    out: dict[str, Any] = {"fitted_over": len(held)}
    retained = [s for r in runs.values() if r["traffic"] == "sample" for s in r["steps"] if "steady" in s]
    held_r = [s["steady"]["retained_per_s_in"] for s in retained if "broke" not in s]
    broke_r = [s["steady"]["retained_per_s_in"] for s in retained if "broke" in s]
    out["retained_per_s_held"] = max(held_r, default=None)
    out["retained_per_s_broke"] = min(broke_r, default=None)
    if cpu is None or mem is None:
        return out
    base, per_site, per_msg, per_retained = cpu
    site_rate = sample["msgs_per_s"] + 0.5  # a site's uplink as recorded, and its heartbeat
    worst = max((abs(sum(c * x for c, x in zip(cpu, row, strict=True)) - st["centre_cpu_pct"]) / st["centre_cpu_pct"]
                 for row, st in zip(rows, held, strict=True)), default=0.0)
    out |= {"cpu_base_pct": round(base, 2), "cpu_pct_per_site": round(per_site, 4),
            "cpu_us_per_msg": round(per_msg / 100 * 1e6, 1),
            "cpu_us_per_retained_msg": round(per_retained / 100 * 1e6, 1),
            "rss_base_mb": round(mem[0], 1), "rss_mb_per_site": round(mem[1], 3),
            "worst_fit_error_pct": round(worst * 100, 1), "sample_site_msgs_per_s": site_rate,
            "sample_site_retained_per_s": retained_per_site, "sample_site_bytes_per_s": sample["bytes_per_s"]}
    for n in (1000, 10000):
        unretained = site_rate - retained_per_site
        as_recorded = base + n * (per_site + per_msg * unretained + per_retained * retained_per_site)
        out[f"sites_{n}"] = {"cores_sample_uplink": round(as_recorded / 100, 1),
                             "cores_states_unretained": round((base + n * (per_site + per_msg * site_rate)) / 100, 1),
                             "cores_idle_sites": round((base + n * (per_site + per_msg * 1.5)) / 100, 1),
                             "rss_gb": round((mem[0] + n * mem[1]) / 1024, 2), "msgs_per_s": round(n * site_rate),
                             "retained_per_s": round(n * retained_per_site),
                             "uplink_mb_per_s": round(n * sample["bytes_per_s"] / 1e6, 1)}
    return out


def figures(result: dict[str, Any], tag: str = "") -> list[Figure]:
    out: list[Figure] = []
    held = [s for s in result["steps"] if "steady" in s and "broke" not in s]
    for s in result["steps"]:
        if "steady" not in s:
            continue
        n, st = f"{tag}{s['sites']}", s["steady"]
        out += [Figure(f"{n} sites: centre CPU (3 nodes, watch, gate)", st["centre_cpu_pct"], "% of a core"),
                Figure(f"{n} sites: centre memory (resident)", st["centre_rss_mb"], "MB"),
                Figure(f"{n} sites: messages into the centre", st["msgs_per_s_in"], "msg/s"),
                Figure(f"{n} sites: latency site->centre p99", st["latency_s"]["p99"], "s"),
                Figure(f"{n} sites: all new bridges connected", s["connect"]["all_connected_s"], "s"),
                Figure(f"{n} sites: fleet stop p99", s["fleet_stop"]["stop"]["p99"], "s"),
                Figure(f"{n} sites: QoS 1 lost", s["qos1_lost"], "messages", "==", 0)]
    if held:
        out.append(Figure(f"{tag}sites held", held[-1]["sites"], "sites"))
    f = result["faults"]
    if "node_kill" in f:
        k = f["node_kill"]
        out += [Figure(f"{tag}node killed, {f['sites']} sites: failover p99", k["failover_s"]["p99"], "s", "<=",
                       FAILOVER_TARGET_S),
                Figure(f"node killed: sites moved of {k['sites_on_killed_node']}", k["moved"], "sites", "==",
                       k["sites_on_killed_node"]),
                Figure("node killed: QoS 1 lost", k["qos1_lost"], "messages", "==", 0)]
    if "cut" in f:
        c = f["cut"]
        out += [Figure(f"{c['cut']} sites cut 30 s: commands answered unavailable", c["unavailable"], "of cut", "==",
                       c["cut"]),
                Figure("sites cut: others' latency p99", c["others_latency_s"]["p99"], "s"),
                Figure("sites cut: QoS 1 lost", c["qos1_lost"], "messages", "==", 0)]
    if "centre_restart" in f:
        r = f["centre_restart"]
        out += [Figure("centre restarted: all green (max)", r["all_green_s"]["max"], "s"),
                Figure("centre restarted: QoS 1 lost, sent before the centre's subscribers were back",
                       r["qos1_lost"] - (r["lost_sent_after_watchers_back"] or 0), "messages"),
                Figure("centre restarted: QoS 1 lost, sent after", r["lost_sent_after_watchers_back"], "messages", "==",
                       0)]
    return out


def sample_retained_per_s() -> float:
    """The retained messages a second of one site as recorded (bench/fleet_sample.json.gz)."""
    messages, _, length = load(SAMPLE)
    return round(sum(1 for m in messages if m.retain) / length, 2)


def model_figures(fitted: dict[str, Any]) -> list[Figure]:
    if "cpu_pct_per_site" not in fitted:
        return []
    return [Figure("model: centre CPU per connected site", fitted["cpu_pct_per_site"], "% of a core"),
            Figure("model: centre CPU per message", fitted["cpu_us_per_msg"], "us"),
            Figure("model: centre CPU per retained message", fitted["cpu_us_per_retained_msg"], "us"),
            Figure("model: centre memory per site", fitted["rss_mb_per_site"], "MB"),
            Figure("model: retained messages a second held", fitted["retained_per_s_held"], "msg/s"),
            Figure("model: 1,000 sample sites", fitted["sites_1000"]["cores_sample_uplink"], "cores"),
            Figure("model: 10,000 sample sites", fitted["sites_10000"]["cores_sample_uplink"], "cores")]


def refit(path: Path) -> None:
    """The model fitted again over `path`'s steady windows; its model figures replaced, the measured ones kept, and
    when it was refitted said in the file (`refitted_utc`)."""
    doc = json.loads(path.read_text())
    result = doc["result"]
    fitted = model(result["runs"], result["sample"], sample_retained_per_s())
    result["model"] = fitted
    doc["figures"] = [f for f in doc["figures"] if not f["name"].startswith("model: ")] + \
        [f.as_dict() for f in model_figures(fitted)]
    doc["refitted_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(fitted, default=str))
    if path.parent.resolve() == COMMITTED_DIR.resolve() and not doc.get("variant"):
        render(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 sites of the sample, the fleet stop and a node kill")
    ap.add_argument("--sites", help="one sweep of these steps (e.g. 10,20) instead of the full run")
    ap.add_argument("--traffic", choices=TRAFFIC, default="sample", help="with --sites: what each site sends")
    ap.add_argument("--faults", type=int, default=0, help="with --sites: the step at which the faults run")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of each steady window")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="the full run's time: no sweep or step starts once it would end past it (0: no limit)")
    ap.add_argument("--max-sites", type=int, default=0,
                    help="the full run's sweeps cut at this many sites (the faults at the largest step left)")
    ap.add_argument("--refit", type=Path, metavar="RESULT",
                    help="fit the model again over a result file's measured windows (after a change of the model, "
                         "nothing measured again); the file is rewritten with the new model and figures")
    args = ap.parse_args()
    if args.refit:
        refit(args.refit)
        return
    if os.geteuid() != 0:
        print("fleet: needs root (docker, SIGSTOP of the sites' brokers): nothing measured", file=sys.stderr)
        sys.exit(1)
    proc = run([str(DEPLOY / "dev" / "ensure-docker.sh")], timeout=900, check=False)
    if proc.returncode != 0:
        print(f"fleet: docker cannot run here: {proc.stderr.strip()[-400:]}", file=sys.stderr)
        sys.exit(1)
    os.environ.setdefault("ROBOBUS_BASE_IMAGE", proc.stdout.strip().rsplit("=", 1)[-1])
    messages, _, length = load(SAMPLE)
    sample = summary(messages, length)
    limits = {"connect_within_s": CONNECT_WITHIN_S, "latency_p99_limit_s": LATENCY_P99_LIMIT_S, "cut_s": CUT_S}
    if args.quick or args.sites:
        steps = [10] if args.quick else [int(x) for x in args.sites.split(",")]
        faults = 10 if args.quick else (args.faults or None)
        one = sweep(steps, faults, 20.0 if args.quick else args.window, args.traffic, kill_only=args.quick)
        variant = "quick" if args.quick else variant_name(args.traffic, "sites" + "-".join(map(str, steps)))
        report("fleet", {"sample": sample, "limits": limits, **one}, figures(one), variant=variant)
        return
    runs: dict[str, Any] = {}
    deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else 0.0
    not_run: list[str] = []
    for traffic, (steps_t, faults_t) in RUNS.items():
        if deadline and time.monotonic() > deadline - 3 * STEP_S:
            not_run.append(traffic)
            continue
        steps = [n for n in steps_t if not args.max_sites or n <= args.max_sites] or [min(steps_t)]
        faults_n = None if faults_t is None else max(n for n in steps if n <= faults_t)
        runs[traffic] = sweep(steps, faults_n, args.window, traffic, deadline=deadline)
    fitted = model(runs, sample, sample_retained_per_s())
    figs = [f for traffic, r in runs.items() for f in figures(r, "" if traffic == "sample" else f"{traffic}: ")]
    figs += model_figures(fitted)
    variant = variant_name(f"max{args.max_sites}" if args.max_sites else None)
    path = report("fleet", {"sample": sample, "limits": limits, "runs": runs, "model": fitted, "not_run": not_run},
                  figs, variant=variant)
    if path.parent.resolve() == COMMITTED_DIR.resolve() and not variant:
        render(path)  # docs/fleet-scale.md's figures, from this result


if __name__ == "__main__":
    main()
