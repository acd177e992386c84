"""Cost of `robobus prometheus`: the exporter's CPU and resident memory while `make run`'s services stream on their
simulators and Prometheus's scrape comes every second.

Starts `make run`'s shape (the chaos harness's stack: a private broker, every service of deploy/Procfile.sim on its
simulator, on free ports), then side by side for `--seconds`: the exporter (`python -m shared.tools.prometheus`),
scraped every second by this process, and a reference measured in the same run: a bare paho subscriber to the same
topic filters that only counts what it receives (the floor of any MQTT-fed exporter in Python). Samples both from
/proc: CPU (utime + stime over the window, as a fraction of one core) and resident memory (mean of the samples).

    python bench/prometheus.py [--seconds 60] [--quick]

Targets: the exporter <= 5 % of one core and <= 60 MB resident; each scrape <= 100 ms (p99). Prints the figures,
the ratio to each target, and one JSON line (bench/results.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from footprint import sample  # noqa: E402  (one process's resident kB and CPU seconds, from /proc)
from results import Figure, report, variant_name  # noqa: E402

from shared.tools.localbroker import NodeProcess, free_port  # noqa: E402
from shared.tools.prometheus.view import SUBSCRIPTIONS  # noqa: E402
from tests.chaos.stack import SimStack  # noqa: E402  (make run's processes on a private broker)

TARGET_CPU_PCT = 5.0
TARGET_RSS_MB = 60.0
TARGET_SCRAPE_MS = 100.0

# the reference: paho alone, subscribed to what the exporter subscribes to, counting messages
REFERENCE = """
import sys, time, paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
host, port, filters = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
n = [0]
c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
c.on_connect = lambda cl, *_: cl.subscribe([(f, 0) for f in filters])
def on_message(cl, u, msg):
    n[0] += 1
c.on_message = on_message
c.connect(host, port)
c.loop_forever()
"""


class Scraper(threading.Thread):
    """GET /metrics every `period_s`, as Prometheus would; keeps each scrape's time and size."""

    def __init__(self, url: str, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s = url, period_s
        self.times_ms: list[float] = []
        self.sizes: list[int] = []
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        next_t = time.monotonic()
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    body = r.read()
                self.times_ms.append((time.perf_counter() - t0) * 1000)
                self.sizes.append(len(body))
            except OSError:
                self.failures += 1
            next_t += self.period_s
            self.stop.wait(max(0.0, next_t - time.monotonic()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="the window measured")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after the exporter serves, before the window")
    ap.add_argument("--quick", action="store_true", help="a 20 s window")
    a = ap.parse_args()
    seconds = 20.0 if a.quick else a.seconds
    stack = SimStack()
    stack.start()
    procs: list[NodeProcess] = []
    try:
        env = {"ROBOBUS_MQTT_URL": stack.broker.url, "ROBOBUS_TOPIC_ROOT": stack.root}
        port = free_port()
        exporter = NodeProcess(["-m", "shared.tools.prometheus", "--port", str(port)], env)
        filters = [f"{stack.root}/{suffix}" for _, suffix in SUBSCRIPTIONS]
        reference = NodeProcess(["-c", REFERENCE, "127.0.0.1", str(stack.broker.port), *filters], {})
        procs += [exporter, reference]
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if b"robobus_device_connection" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the exporter served no device within 60 s:\n{exporter.text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(a.settle)
        pids = {"exporter": exporter.proc.pid, "reference": reference.proc.pid}
        scraper = Scraper(url)
        first = {n: sample(p) for n, p in pids.items()}
        msgs_before = _messages(url)
        scraper.start()
        rss: dict[str, list[int]] = {n: [] for n in pids}
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for n, p in pids.items():
                s = sample(p)
                if s is not None:
                    rss[n].append(s[0])
            time.sleep(1.0)
        window = time.monotonic() - t0
        last = {n: sample(p) for n, p in pids.items()}
        scraper.stop.set()
        scraper.join(10)
        msgs_after = _messages(url)
    finally:
        for proc in procs:
            proc.stop(5)
        stack.stop()
    out: dict[str, dict[str, float]] = {}
    for n in pids:
        f, lt = first[n], last[n]
        if f is None or lt is None or not rss[n]:
            raise RuntimeError(f"{n} died during the window")
        out[n] = {"cpu_pct": round(100 * (lt[1] - f[1]) / window, 2),
                  "rss_mb": round(statistics.mean(rss[n]) / 1024, 1)}
    times = sorted(scraper.times_ms)
    p50 = times[len(times) // 2] if times else None
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))] if times else None
    rate = (msgs_after - msgs_before) / window
    print(f"`make run` streaming, {window:.0f} s window, a scrape every second ({len(times)} scrapes, "
          f"{scraper.failures} failed, {statistics.mean(scraper.sizes) / 1024 if scraper.sizes else 0:.1f} kB each); "
          f"{rate:.1f} messages/s reach the exporter")
    print(f"{'process':<34} {'CPU % core':>11} {'RSS MB':>8}")
    for n, v in out.items():
        print(f"{n:<34} {v['cpu_pct']:>11.2f} {v['rss_mb']:>8.1f}")
    result: dict[str, Any] = {"bench": "prometheus", "window_s": round(window, 1), "processes": out,
                              "messages_per_s": round(rate, 1), "scrapes": len(times),
                              "scrape_failures": scraper.failures, "scrape_ms_p50": p50 and round(p50, 2),
                              "scrape_ms_p99": p99 and round(p99, 2),
                              "scrape_kb": round(statistics.mean(scraper.sizes) / 1024, 1) if scraper.sizes else None,
                              "load": round(os.getloadavg()[0], 2),
                              "targets": {"cpu_pct": TARGET_CPU_PCT, "rss_mb": TARGET_RSS_MB,
                                          "scrape_ms_p99": TARGET_SCRAPE_MS}}
    ex, ref = out["exporter"], out["reference"]
    report("prometheus", result, [
        Figure("exporter CPU, make run streaming, a scrape every 1 s", ex["cpu_pct"], "% of a core", "<=",
               TARGET_CPU_PCT),
        Figure("exporter resident memory", ex["rss_mb"], "MB", "<=", TARGET_RSS_MB),
        Figure("scrape time p99", p99 and round(p99, 2), "ms", "<=", TARGET_SCRAPE_MS),
        Figure("reference: bare paho subscriber to the same topics, CPU", ref["cpu_pct"], "% of a core"),
        Figure("reference: bare paho subscriber, resident memory", ref["rss_mb"], "MB"),
        Figure("exporter over the reference, CPU", round(ex["cpu_pct"] - ref["cpu_pct"], 2), "% of a core"),
        Figure("messages reaching the exporter", round(rate, 1), "per s"),
    ], variant=variant_name("quick" if a.quick else ""))


def _messages(url: str) -> float:
    """The exporter's count of messages received, all kinds."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("robobus_exporter_messages_total{"))


if __name__ == "__main__":
    main()
