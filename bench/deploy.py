"""Deployment benchmark: the containerised system against the same code outside containers, in one run.

    python bench/deploy.py [--seconds 30] [--rounds 6] [--calls 400] [--quick] [--cycle-only | --rtt-only]

1. up -> every node online: `deploy/compose.sh up -d` of the sim profile (images already built; the build
   time is printed apart) until the viewer sees every node's retained status online; then until every
   container reports healthy.
2. Command round trip: `nullify_demands` on ethercat-loop (palm model backend) by an operator client through
   the containerised broker (node in its container, broker reached on its published port), and the same node
   as a host process through a host mosquitto, both up at once and called in alternating batches; a third
   path, the container's broker at its own address, shows what the published port (docker-proxy) costs.
   Median and p99 of each, ratio container / host.
3. The EtherCAT cycle at 1 kHz against the virtual hand, in the realtime container (the `hand` profile
   against the virtual hand's container, deploy/vhand.sh) and outside containers (backend `virtual`: the same
   hand in a private namespace), with the same settings (cycle SCHED_FIFO 80 on CPU 1, hand SCHED_FIFO 70 on
   CPU 0), interleaved: --rounds rounds of one --seconds window per side. Per-second lost frames, bursts
   (>= loss_stats.BURST_MIN in one second) apart from isolated losses, and whether the container loses more:
   a block bootstrap interval of the difference and a sign test over rounds (bench/loss_stats.py).
4. --uplink: a simulated site's uplink to a centre (bytes on the fleet link, default budget and full rate).
5. --centre: how many sites a centre holds at the default uplink budget: the messages per second one simulated
   site (`make up`'s sim profile, bridged with the default budget) brings to a mosquitto centre, against each
   centre's capacity on this machine: the messages per second (QoS 1, 200 bytes, the shape of a site's health,
   status and events) a single mosquitto centre, and the three-node ejabberd cluster (deploy/compose.cluster.yaml;
   publishers on nodes 1 and 2, the subscriber on node 3: every message crosses the cluster), deliver to one
   subscriber at the centre while --centre-publishers processes publish as fast as they are acknowledged. The
   load generator shares the machine with the brokers: the figures are this machine's, not the brokers' limits.
Needs root and docker (deploy/dev/ensure-docker.sh installs/starts what is missing). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from loss_stats import BLOCK_S, BURST_MIN, compare  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402  (notes the machine's load when imported)

from shared.rpc import RpcClient  # noqa: E402
from shared.settings import KitSettings  # noqa: E402
from shared.tools.localbroker import Broker, NodeProcess, free_port  # noqa: E402
from tests.deploy.stack import DOCKER, Stack, expected_nodes, run  # noqa: E402  (the tests' compose helper)

DEPLOY = REPO / "deploy"
# Targets: the containerised command path within 1.5 x the host's; lost frames in the container
# no higher than outside; wake-up p99 in the container within 1.5 x outside.
RTT_RATIO_TARGET = 1.5
WAKE_RATIO_TARGET = 1.5
RTT_BATCHES = 10  # round trips alternate between the paths in this many batches
SETTLE_S = 5.0  # both sides: the window starts this long after the node is online (bring-up, first recoveries)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def round_trips(c: RpcClient, calls: int) -> list[float]:
    out: list[float] = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rep = c.call("ethercat-loop", "rh", "nullify_demands", {}, timeout=30)
        out.append((time.perf_counter() - t0) * 1e3)
        if not rep.ok:
            raise RuntimeError(f"nullify_demands failed: {rep.error}")
    return out


def wait_online(settings: KitSettings, nodes: list[str], timeout: float) -> float:
    t0 = time.monotonic()
    online: set[str] = set()
    with RpcClient(settings, name="bench-deploy-watch") as c:
        def until(topic: str, payload: bytes) -> bool:
            if json.loads(payload).get("online"):
                online.add(topic.split("/")[-2])
            return set(nodes) <= online
        c.collect(f"{settings.topic_root}/+/status", timeout, until=until)
    if not set(nodes) <= online:
        raise RuntimeError(f"not online within {timeout} s: {sorted(set(nodes) - online)}")
    return time.monotonic() - t0


def wait_healthy(stack: Stack, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        cs = [c for c in stack.containers() if c["Service"] not in ("epuck-sim", "roi-sim", "dexter-sim")]
        if cs and all(c.get("Health") == "healthy" for c in cs):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError("containers not healthy in time")


def cycle_window(settings: KitSettings, seconds: float) -> dict[str, Any]:
    """The cycle's 1 s loop_stats windows over `seconds`: per-second lost frames and wake-up p99, and the
    realtime policy. A repeated window (the same `ts`: published before the next one closed) counts once."""
    msgs: list[dict[str, Any]] = []

    def keep(topic: str, payload: bytes) -> bool:
        m = json.loads(payload)
        if not msgs or m.get("ts") != msgs[-1].get("ts"):
            msgs.append(m)
        return False

    steal0, soft0 = steal_ticks(), ksoftirqd_ticks()
    with RpcClient(settings, name="bench-deploy-cycle") as c:
        c.collect(f"{settings.topic_root}/ethercat-loop/rh/state/loop_stats", seconds / 2, until=keep)
        rt = rt_threads()  # mid-window: who else runs at realtime priority (a suspect when both sides lose)
        c.collect(f"{settings.topic_root}/ethercat-loop/rh/state/loop_stats", seconds / 2, until=keep)
    msgs = msgs[1:]  # the first is the retained one (or a window that began before this one)
    if len(msgs) < 2:
        raise RuntimeError("no loop_stats from ethercat-loop")
    return {"lost_per_s": [int(m["frames_lost"]) for m in msgs], "cycles": sum(int(m["cycles"]) for m in msgs),
            "overruns": sum(int(m["overruns"]) for m in msgs),
            "wake_p99_us": [float(m["jitter_p99_us"]) for m in msgs],
            "policy": (msgs[-1].get("realtime") or {}).get("policy"), "steal_ticks": steal_ticks() - steal0,
            "ksoftirqd_ticks": ksoftirqd_ticks() - soft0, "rt_threads": rt}


def ksoftirqd_ticks() -> int:
    """CPU time of the ksoftirqd threads so far (USER_HZ ticks). Softirqs (the veth's packet delivery among
    them) move from the sender's context to these SCHED_OTHER threads when the machine is busy with them: a
    suspect when both sides lose frames for seconds on end."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if "(ksoftirqd/" in f[0]:
            rest = f[1].split()
            total += int(rest[11]) + int(rest[12])
    return total


def rt_threads() -> list[str]:
    """User threads at SCHED_FIFO/RR on this machine, as 'comm/prio@cpu' (kernel threads left out)."""
    ps = subprocess.run(["ps", "-eLo", "cls=,rtprio=,psr=,comm=,args="], capture_output=True, text=True).stdout
    out = []
    for line in ps.splitlines():
        f = line.split(None, 4)
        if len(f) == 5 and f[0] in ("FF", "RR") and not f[4].startswith("["):
            out.append(f"{f[3]}/{f[1]}@{f[2]}")
    return sorted(out)


def steal_ticks() -> int:
    """The VM's stolen time so far (both vCPUs, USER_HZ ticks): the hypervisor's share, a covariate."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="cycle window, each side and round")
    ap.add_argument("--calls", type=int, default=400, help=f"round trips per path, in {RTT_BATCHES} alternating "
                    "batches")
    ap.add_argument("--rounds", type=int, default=6, help="cycle: interleaved rounds (one window each side)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 20 s windows, 200 calls")
    ap.add_argument("--healthcheck-interval", default="2s",
                    help="the containers' healthcheck period for part 1 (make up's default: 10s)")
    ap.add_argument("--cycle-only", action="store_true", help="only part 3 (the cycle inside vs outside), e.g. to "
                    "repeat that comparison several times without the sim stack")
    ap.add_argument("--rtt-only", action="store_true", help="only parts 1 and 2 (up, command round trips)")
    ap.add_argument("--uplink", action="store_true", help="only part 4: a simulated site's uplink to a centre "
                    "(the sim profile of make up, bridged over TLS), default budget vs full rate")
    ap.add_argument("--uplink-seconds", type=float, default=30.0, help="part 4: each window")
    ap.add_argument("--centre", action="store_true", help="only part 5: sites per centre, mosquitto vs the cluster")
    ap.add_argument("--centre-seconds", type=float, default=20.0, help="part 5: each window")
    ap.add_argument("--centre-publishers", type=int, default=2, help="part 5: publisher processes")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.calls, a.rounds = 20.0, 200, 3
    if os.geteuid() != 0:
        sys.exit("bench/deploy.py needs root (docker, namespaces, SCHED_FIFO)")
    base = subprocess.run([str(DEPLOY / "dev" / "ensure-docker.sh")], capture_output=True, text=True, check=True)
    os.environ["ROBOBUS_BASE_IMAGE"] = base.stdout.strip().rsplit("=", 1)[-1]
    out: dict[str, Any] = {"bench": "deploy", "seconds": a.seconds, "rounds": a.rounds, "calls": a.calls,
                           "load_before": os.getloadavg()[0]}
    tmp = Path(tempfile.mkdtemp(prefix="robobus-bench-deploy-"))

    if a.uplink:
        uplink(a, out, tmp)
    elif a.centre:
        centre_capacity(a, out, tmp)
    else:
        if not a.cycle_only:
            up_and_round_trips(a, out, tmp)
        if not a.rtt_only:
            cycle_inside_vs_outside(a, out, tmp)
    out["load_after"] = os.getloadavg()[0]
    figures: list[Figure] = []
    if "rtt_ratio_container_over_host" in out:
        figures.append(Figure("command round trip p50, containerised ÷ host broker",
                              out["rtt_ratio_container_over_host"], "×", "<=", RTT_RATIO_TARGET))
    if "cycle" in out:
        figures += [Figure("EtherCAT wake-up p99, container ÷ outside", out["wake_p99_ratio_container_over_outside"],
                           "×", "<=", WAKE_RATIO_TARGET),
                    Figure("lost frames/min, container - outside: the 95 % interval's low end",
                           out["cycle"]["lost_per_min_diff_ci95"][0], "/min", "<=", 0)]
    if "uplink" in out:
        d = out["uplink"]["default"]
        figures += [Figure("a site's default uplink", d["mbit_s"], "Mbit/s", "<=", UPLINK_TARGET_MBIT_S),
                    Figure("health at the centre within", d["health_late_max_s"], "s", "<=", HEALTH_WITHIN_S)]
    if "centre" in out:
        c = out["centre"]
        figures += [Figure("a site's messages at the centre (default budget)", c["site_msgs_s"], "msg/s"),
                    Figure("mosquitto centre: capacity", c["mosquitto"]["msgs_s"], "msg/s"),
                    Figure("ejabberd cluster (3 nodes): capacity", c["cluster"]["msgs_s"], "msg/s"),
                    Figure("mosquitto centre: sites", c["mosquitto"]["sites"], "sites"),
                    Figure("ejabberd cluster: sites", c["cluster"]["sites"], "sites")]
    report("deploy", out, figures, variant=variant_name(
        "quick" if a.quick else "", "uplink" if a.uplink else "", "centre" if a.centre else "",
        "cycle-only" if a.cycle_only else "",
        "rtt-only" if a.rtt_only else ""))


def up_and_round_trips(a: argparse.Namespace, out: dict[str, Any], tmp: Path) -> None:
    """1: the sim profile up -> online. 2: round trips through the containerised broker and through a host
    broker, both running at once and called in alternating batches (so both see the same machine load),
    plus the container's broker at its own address (no docker-proxy: which part of the gap is the proxy)."""
    sim = Stack(f"robobus-bench-{os.getpid()}", tmp / "sim",
                extra_env={"ROBOBUS_HEALTHCHECK_INTERVAL": a.healthcheck_interval})
    sim.make_secrets()
    d = tempfile.TemporaryDirectory()
    broker = Broker(free_port(), Path(d.name))
    node: NodeProcess | None = None
    try:
        sim.build()
        t0 = time.monotonic()
        sim.compose("up", "-d")
        nodes = expected_nodes()
        online_s = time.monotonic() - t0 + wait_online(sim.settings("viewer"), nodes, 300)
        healthy_s = time.monotonic() - t0 + wait_healthy(sim, 300)
        out["build_s_cached"] = round(sim.timings["build_s"], 1)
        out["up_to_all_online_s"] = round(online_s, 1)
        out["up_to_all_healthy_s"] = round(healthy_s, 1)
        out["healthcheck_interval"] = a.healthcheck_interval
        print(f"up -> {len(nodes)} nodes online {online_s:.1f} s, every container healthy {healthy_s:.1f} s "
              f"(healthcheck every {a.healthcheck_interval}; build, cached: {sim.timings['build_s']:.1f} s)")
        broker.start()
        node = NodeProcess(["-m", "services.ethercat_loop"], {"ROBOBUS_MQTT_URL": broker.url,
                                                             "ROBOBUS_ETHERCAT_BACKEND": "model"})
        wait_online(broker.settings(), ["ethercat-loop"], 60)
        ip = run([DOCKER, "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                  sim.container_id("broker")]).stdout.split()[0]
        direct = sim.settings("operator").model_copy(update={"mqtt_url": f"mqtt://{ip}:1883"})
        paths = {"container": sim.settings("operator"), "host": broker.settings(), "container_direct": direct}
        rtt: dict[str, list[float]] = {k: [] for k in paths}
        with contextlib.ExitStack() as stack:
            clients = {k: stack.enter_context(RpcClient(v, name=f"bench-deploy-{k}")) for k, v in paths.items()}
            for c in clients.values():
                round_trips(c, 5)  # warm up
            batch = max(1, a.calls // RTT_BATCHES)
            for i in range(RTT_BATCHES):
                order = list(clients) if i % 2 == 0 else list(reversed(clients))
                for k in order:
                    rtt[k] += round_trips(clients[k], batch)
    finally:
        if node is not None:
            node.stop()
        broker.kill()
        d.cleanup()
        sim.down()
    med = {k: statistics.median(v) for k, v in rtt.items()}
    out["rtt_ms"] = {f"{k}_{q}": round(f(v), 3) for k, v in rtt.items()
                     for q, f in (("p50", statistics.median), ("p99", lambda xs: pct(xs, 0.99)))}
    out["rtt_ratio_container_over_host"] = round(med["container"] / med["host"], 2)
    out["rtt_ratio_direct_over_host"] = round(med["container_direct"] / med["host"], 2)
    for k, v in rtt.items():
        print(f"command round trip {k:16s} p50 {statistics.median(v):.2f} ms, p99 {pct(v, .99):.2f} ms ({len(v)})")
    print(f"ratio container / host {out['rtt_ratio_container_over_host']} (target <= {RTT_RATIO_TARGET}); "
          f"without docker-proxy (the broker's container address) {out['rtt_ratio_direct_over_host']}")


UPLINK_TARGET_MBIT_S = 0.3  # a site's default uplink (LTE, shared lab Wi-Fi)
HEALTH_WITHIN_S = 2.0  # the centre sees every device's health within this of a change


def wan_tx_bytes(container: str, network: str) -> int:
    """Bytes the container sent on its interface in `network` (the fleet's link, TLS and MQTT included)."""
    mac = run([DOCKER, "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{network}").MacAddress}}}}',
               container]).stdout.strip()
    listing = run([DOCKER, "exec", container, "sh", "-c", "for i in /sys/class/net/*; do "
                   "echo $(cat $i/address) $(cat $i/statistics/tx_bytes); done"]).stdout
    for line in listing.splitlines():
        addr, _, n = line.partition(" ")
        if addr == mac:
            return int(n)
    raise RuntimeError(f"no interface with {mac} in {container}: {listing}")


def uplink(a: argparse.Namespace, out: dict[str, Any], tmp: Path) -> None:
    """4: a centre and a site running `make up`'s sim profile, bridged over TLS on a shared docker network; the
    bytes the site's broker sends on that link per second (network level: TLS, MQTT and bridge traffic) in a
    window with the default budget (deploy/uplink.py) and one at full rate (the centre's `_uplink/set`), and how
    late each device's health reaches the centre (its `ts` against the arrival, one clock)."""
    tag = f"{os.getpid()}"
    wan = f"robobus-bench-wan-{tag}"
    central = Stack(f"robobus-bench-central-{tag}", tmp / "central", profiles="central",
                    extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": "central",
                               "ROBOBUS_CENTRAL_SITES": "site-a=site-a/robobus"})
    site = Stack(f"robobus-bench-site-{tag}", tmp / "site", root="site-a/robobus",
                 extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": "site-a-broker"})
    central.make_secrets("--central", "--site", "site-a=site-a/robobus", "--tls-name", "central")
    site.make_secrets("--site", "site-a", "--bridge-to", "central:8883", "--bridge-credentials",
                      str(central.secrets / "bridge-site-a.env"), "--bridge-ca", str(central.secrets / "fleet-ca.crt"))
    run([DOCKER, "network", "create", wan])
    windows: dict[str, dict[str, Any]] = {}
    try:
        central.build()
        site.build()
        central.up()
        site.up()
        broker = site.container_id("broker")
        nodes = expected_nodes()
        wait_online(central.settings("viewer", topic_root="site-a/robobus"), nodes, 120)
        for name, request in (("default", None), ("full_rate", b'{"state_hz": 0, "drop": [], "for_s": 600}')):
            with RpcClient(central.settings("operator", topic_root="site-a/robobus"), name="bench-uplink") as c:
                if request is not None:
                    c.session.publish("site-a/robobus/_uplink/set", request, qos=1, now=True)
                time.sleep(5.0)  # the budget applies, the link settles
                late: list[float] = []
                topics: set[str] = set()
                by_topic: dict[str, int] = {}

                def on(msg: Any, late: list[float] = late, topics: set[str] = topics,
                       by_topic: dict[str, int] = by_topic) -> None:
                    topics.add(msg.topic)
                    by_topic[msg.topic] = by_topic.get(msg.topic, 0) + len(msg.topic) + len(msg.payload)
                    if msg.topic.endswith("/health") and not msg.retain:
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            late.append(time.time() - float(json.loads(msg.payload)["ts"]))

                c.session.subscribe("site-a/robobus/#", on, qos=0)
                b0, t0 = wan_tx_bytes(broker, wan), time.monotonic()
                time.sleep(a.uplink_seconds)
                b1, t1 = wan_tx_bytes(broker, wan), time.monotonic()
                c.session.unsubscribe("site-a/robobus/#")
            mbit = (b1 - b0) * 8 / (t1 - t0) / 1e6
            top = sorted(by_topic.items(), key=lambda kv: -kv[1])[:8]
            print(f"uplink {name}: payload + topic bytes at the centre {sum(by_topic.values())} in "
                  f"{len(by_topic)} topics; most: " + ", ".join(f"{t.split('/', 2)[-1]} {n}" for t, n in top))
            windows[name] = {"mbit_s": round(mbit, 3), "bytes": b1 - b0, "seconds": round(t1 - t0, 1),
                             "health_msgs": len(late), "health_late_max_s": round(max(late), 3) if late else None,
                             "image_topics": sorted(t for t in topics if t.endswith("/image"))}
            print(f"uplink {name}: {mbit:.3f} Mbit/s over {t1 - t0:.0f} s ({b1 - b0} bytes, TLS + MQTT); "
                  f"{len(late)} health messages at the centre, latest {windows[name]['health_late_max_s']} s "
                  f"after their ts; image topics {windows[name]['image_topics'] or 'none'}")
    finally:
        site.down()
        central.down()
        run([DOCKER, "network", "rm", wan], check=False)
    d = windows["default"]
    out["uplink"] = windows
    ok = d["mbit_s"] <= UPLINK_TARGET_MBIT_S and d["health_late_max_s"] is not None and \
        d["health_late_max_s"] <= HEALTH_WITHIN_S
    print(f"default uplink {d['mbit_s']} Mbit/s (target <= {UPLINK_TARGET_MBIT_S}), health at the centre within "
          f"{d['health_late_max_s']} s (target <= {HEALTH_WITHIN_S}): {'met' if ok else 'NOT MET'}")


def _load_publisher(port: int, user: str, password: str, cid: str, topic: str, seconds: float, sent: Any) -> None:
    """One publisher process: QoS 1, 200-byte messages, as fast as the broker acknowledges (100 in flight)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.max_inflight_messages_set(100)
    c.max_queued_messages_set(200)
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    payload = b"x" * 200
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        info = c.publish(topic, payload, qos=1)
        if info.rc != 0:  # the queue is full: the broker has not acknowledged enough yet
            time.sleep(0.001)
            continue
        n += 1
    with sent.get_lock():
        sent.value += n
    c.disconnect()
    c.loop_stop()


def broker_capacity(pub_ports: list[int], sub_port: int, secrets: Path, seconds: float, publishers: int
                    ) -> dict[str, Any]:
    """Messages per second one subscriber receives while `publishers` processes publish (QoS 1) as `bridge-site-a`
    (what a site's bridge may write) on `pub_ports` in turn; the subscriber (`viewer`) on `sub_port`. The rate is
    counted over the window less its first and last 2 s."""
    import multiprocessing

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from tests.deploy.mqttprobe import creds

    user, password = creds(secrets, "bridge-site-a")
    vu, vp = creds(secrets, "viewer")
    topic = "site-a/robobus/load/dev/event/load"
    stamps: list[float] = []
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"viewer-bench-{os.getpid()}", protocol=mqtt.MQTTv5)
    sub.username_pw_set(vu, vp)
    sub.on_message = lambda c, u, m: stamps.append(time.monotonic())
    sub.connect("127.0.0.1", sub_port, keepalive=30)
    sub.loop_start()
    sub.subscribe("site-a/robobus/+/+/event/+", qos=1)
    time.sleep(1.0)
    ctx = multiprocessing.get_context("fork")
    sent = ctx.Value("q", 0)
    procs = [ctx.Process(target=_load_publisher, args=(pub_ports[i % len(pub_ports)], user, password,
                                                      f"bridge-site-a-load{i}", topic, seconds, sent))
             for i in range(publishers)]
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(seconds + 60)
    time.sleep(3.0)  # what is still in flight
    sub.disconnect()
    sub.loop_stop()
    lo, hi = t0 + 2.0, t0 + seconds - 2.0
    window = [t for t in stamps if lo <= t <= hi]
    rate = len(window) / (hi - lo) if hi > lo else 0.0
    return {"msgs_s": round(rate), "sent": sent.value, "received": len(stamps), "publishers": publishers,
            "seconds": seconds}


def site_message_rate(a: argparse.Namespace, tmp: Path) -> float:
    """Messages per second one simulated site (the sim profile, default uplink budget) brings to a mosquitto
    centre, counted at the centre over --centre-seconds after the link settled."""
    tag = f"{os.getpid()}"
    wan = f"robobus-bench-cwan-{tag}"
    central = Stack(f"robobus-bench-ccentral-{tag}", tmp / "rate-central", profiles="central",
                    extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": "central",
                               "ROBOBUS_CENTRAL_SITES": "site-a=site-a/robobus"})
    site = Stack(f"robobus-bench-csite-{tag}", tmp / "rate-site", root="site-a/robobus",
                 extra_env={"ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_WAN_ALIAS": "site-a-broker"})
    central.make_secrets("--central", "--site", "site-a=site-a/robobus", "--tls-name", "central")
    site.make_secrets("--site", "site-a", "--bridge-to", "central:8883", "--bridge-credentials",
                      str(central.secrets / "bridge-site-a.env"), "--bridge-ca", str(central.secrets / "fleet-ca.crt"))
    run([DOCKER, "network", "create", wan])
    try:
        central.build()
        site.build()
        central.up()
        site.up()
        wait_online(central.settings("viewer", topic_root="site-a/robobus"), expected_nodes(), 120)
        with RpcClient(central.settings("operator", topic_root="site-a/robobus"), name="bench-centre") as c:
            time.sleep(5.0)
            count = [0]
            c.session.subscribe("site-a/robobus/#", lambda msg: count.__setitem__(0, count[0] + 1), qos=1)
            time.sleep(2.0)  # the retained messages the subscription brings are not the rate
            n0, t0 = count[0], time.monotonic()
            time.sleep(a.centre_seconds)
            n1, t1 = count[0], time.monotonic()
        rate = (n1 - n0) / (t1 - t0)
        print(f"centre: one simulated site brings {rate:.1f} messages/s to the centre (default uplink budget, "
              f"{n1 - n0} in {t1 - t0:.0f} s)")
        return rate
    finally:
        site.down()
        central.down()
        run([DOCKER, "network", "rm", wan], check=False)


def centre_capacity(a: argparse.Namespace, out: dict[str, Any], tmp: Path) -> None:
    """5: one site's message rate at the default budget, each centre's capacity, and the sites each holds."""
    site_rate = site_message_rate(a, tmp)
    res: dict[str, Any] = {"site_msgs_s": round(site_rate, 1)}
    mosq = Stack(f"robobus-bench-mcentre-{os.getpid()}", tmp / "mosquitto", profiles="central",
                 extra_env={"ROBOBUS_CENTRAL_SITES": "site-a=site-a/robobus"})
    mosq.make_secrets("--central", "--site", "site-a=site-a/robobus")
    try:
        mosq.up("broker")
        res["mosquitto"] = broker_capacity([mosq.port], mosq.port, mosq.secrets, a.centre_seconds,
                                           a.centre_publishers)
    finally:
        mosq.down()
    print(f"centre: a single mosquitto delivers {res['mosquitto']['msgs_s']} messages/s")
    secrets = tmp / "cluster"
    run(["python3", str(DEPLOY / "make_secrets.py"), "--dir", str(secrets), "--central", "--cluster", "--site",
         "site-a=site-a/robobus"])
    ports = [free_port() for _ in range(3)]
    wan = f"robobus-bench-clwan-{os.getpid()}"
    env = {"ROBOBUS_PROJECT": f"robobus-bench-cluster-{os.getpid()}", "ROBOBUS_SECRETS_DIR": str(secrets),
           "ROBOBUS_WAN_NETWORK": wan, "ROBOBUS_HEALTHCHECK_INTERVAL": "1s",
           **{f"ROBOBUS_CLUSTER_PORT_{i + 1}": str(p) for i, p in enumerate(ports)}}
    compose = [DOCKER, "compose", "-f", str(DEPLOY / "compose.cluster.yaml"), "--profile", "cluster"]
    run([DOCKER, "network", "create", wan])
    try:
        run([*compose, "build"], env)
        # the three nodes only: the capacity of the brokers (the profile's fleet-watch and fleet-gate need the
        # sites, ROBOBUS_CENTRAL_SITES, and are not what is measured)
        run([*compose, "up", "-d", "--wait", "--wait-timeout", "300", "ejabberd1", "ejabberd2", "ejabberd3"], env,
            timeout=400)
        res["cluster"] = broker_capacity(ports[:2], ports[2], secrets, a.centre_seconds, a.centre_publishers)
    finally:
        run([*compose, "down", "-v", "-t", "5"], env, check=False)
        run([DOCKER, "network", "rm", wan], check=False)
    print(f"centre: the three-node ejabberd cluster delivers {res['cluster']['msgs_s']} messages/s across nodes")
    for k in ("mosquitto", "cluster"):
        res[k]["sites"] = int(res[k]["msgs_s"] // site_rate) if site_rate > 0 else None
    print(f"centre: at {site_rate:.1f} messages/s per site, a single mosquitto holds {res['mosquitto']['sites']} "
          f"sites, the ejabberd cluster {res['cluster']['sites']} (this machine, {a.centre_publishers} publisher "
          "processes beside the brokers)")
    out["centre"] = res


def cycle_inside_vs_outside(a: argparse.Namespace, out: dict[str, Any], tmp: Path) -> None:
    """3: the cycle in the realtime container and outside, interleaved: each round runs one window of each
    side (the order alternating by round), the container stack staying up while only its ethercat-loop is
    stopped and started again. Same cycle settings both sides: SCHED_FIFO 80 on CPU 1, the virtual hand at
    SCHED_FIFO 70 pinned to CPU 0, a veth pair, 1 kHz."""
    hand = Stack(f"robobus-bench-rt-{os.getpid()}", tmp / "rt", profiles="hand",
                 extra_env={"ROBOBUS_VHAND": "1", "ROBOBUS_FIRMWARE_DIR": str(tmp / "firmware")})
    hand.make_secrets()
    windows: dict[str, list[dict[str, Any]]] = {"container": [], "outside": []}
    try:
        run([str(DEPLOY / "vhand.sh"), "up", "--wait-timeout", "300", "broker", "virtual-hand"], hand.env,
            timeout=400)
        for i in range(a.rounds):
            for side in (("container", "outside") if i % 2 == 0 else ("outside", "container")):
                w = container_window(hand, a.seconds) if side == "container" else outside_window(a.seconds)
                windows[side].append(w)
                if len(w["lost_per_s"]) < 0.9 * a.seconds:  # loop_stats messages missing: those seconds are not counted
                    print(f"round {i + 1} {side}: only {len(w['lost_per_s'])} of ~{a.seconds:.0f} loop_stats windows "
                          "arrived; the pairing uses the shorter window", flush=True)
                print(f"round {i + 1} {side:9s}: lost {sum(w['lost_per_s'])} {w['lost_per_s']}, overruns "
                      f"{w['overruns']}, wake p99 median {statistics.median(w['wake_p99_us']):.0f} us, "
                      f"{w['policy']}, steal {w['steal_ticks']}, ksoftirqd {w['ksoftirqd_ticks']} ticks, realtime "
                      f"threads {w['rt_threads']}", flush=True)
    finally:
        hand.down()
    cmp = compare([w["lost_per_s"] for w in windows["container"]], [w["lost_per_s"] for w in windows["outside"]])
    wake = {k: statistics.median([p for w in ws for p in w["wake_p99_us"]]) for k, ws in windows.items()}
    out["cycle"] = {"rounds": a.rounds, "window_s": a.seconds, "burst_min": BURST_MIN, **cmp,
                    "wake_p99_us_median": wake, "windows": windows}
    out["wake_p99_ratio_container_over_outside"] = round(wake["container"] / max(1.0, wake["outside"]), 2)
    for side in ("container", "outside"):
        t = cmp[side]
        print(f"cycle {side:9s}: {t['seconds']} s, lost {t['lost']} ({t['lost_per_min']}/min): {t['burst_seconds']} "
              f"burst seconds (>= {BURST_MIN}) with {t['burst_lost']}, isolated {t['isolated_lost']}; wake p99 "
              f"median {wake[side]:.0f} us")
    print(f"container - outside: {cmp['lost_per_min_diff']} lost/min, 95 % interval "
          f"{cmp['lost_per_min_diff_ci95']} (burst seconds/min {cmp['burst_seconds_per_min_diff_ci95']}, isolated/min "
          f"{cmp['isolated_per_min_diff_ci95']}) over {cmp['paired_blocks']} paired {BLOCK_S} s blocks, sign test p "
          f"{cmp['sign_test_p']}; per round {cmp['per_round_lost']}: {cmp['verdict']} (target: no higher). "
          f"Wake p99 ratio {out['wake_p99_ratio_container_over_outside']} (target <= {WAKE_RATIO_TARGET})")


def container_window(hand: Stack, seconds: float) -> dict[str, Any]:
    hand.compose("up", "-d", "--no-deps", "--wait", "--wait-timeout", "300", "ethercat-loop", timeout=400)
    try:
        wait_online(hand.settings("viewer"), ["ethercat-loop"], 120)
        time.sleep(SETTLE_S)
        return cycle_window(hand.settings("viewer"), seconds)
    finally:
        hand.compose("stop", "-t", "10", "ethercat-loop", timeout=120)


def outside_window(seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        node = NodeProcess(["-m", "services.ethercat_loop"], {
            "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_ETHERCAT_BACKEND": "virtual", "ROBOBUS_ETHERCAT_CPUS": "[1]",
            "ROBOBUS_ETHERCAT_RT_PRIORITY": "80", "ROBOBUS_ETHERCAT_VIRTUAL_ARGS": '["--cpus", "0"]'})
        try:
            wait_online(broker.settings(), ["ethercat-loop"], 120)
            time.sleep(SETTLE_S)
            w = cycle_window(broker.settings(), seconds)
            if len(w["lost_per_s"]) < 0.9 * seconds:  # the node's own account of the gap
                print(f"outside window short (node alive: {node.alive()}); its log ends:\n{node.text()[-3000:]}",
                      flush=True)
            return w
        finally:
            node.stop()
            broker.kill()


if __name__ == "__main__":
    main()
