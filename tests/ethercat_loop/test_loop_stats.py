"""The loop-statistics window on both kinds of histogram: the model backend's Counter and the realtime
cycle's numpy arrays give the same percentiles; the model backend, as `make run` starts it, runs without numpy
(a third of its process's resident memory)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import numpy as np

from services.ethercat_loop.loop_stats import HIST_US, LoopWindow, new_histogram, percentiles
from shared.tools.localbroker import REPO


def _filled(seed: int, n: int) -> tuple[Counter[int], np.ndarray]:
    rng = random.Random(seed)
    as_counter, as_array = new_histogram(), np.zeros(HIST_US + 1, np.int64)
    for _ in range(n):
        i = min(int(rng.expovariate(1 / 40)), HIST_US)
        as_counter[i] += 1
        as_array[i] += 1
    as_counter[HIST_US] += 3  # 'HIST_US or more'
    as_array[HIST_US] += 3
    return as_counter, as_array


def test_a_counter_and_a_numpy_histogram_give_the_same_percentiles() -> None:
    for seed, n in ((1, 1), (2, 7), (3, 5000)):
        as_counter, as_array = _filled(seed, n)
        qs = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)
        assert percentiles(as_counter, qs) == percentiles(as_array, qs)
        assert percentiles(as_counter)["max"] == float(HIST_US)
    assert percentiles(new_histogram()) == {"p50": None, "p99": None, "p99.9": None, "max": None, "count": 0.0}


def test_the_window_differences_a_counter_histogram() -> None:
    window = LoopWindow(1_000_000)
    first = new_histogram()
    first[5] = 10
    window.roll(0, {"cycles": 10}, first)
    second = first.copy()
    second[7] += 98
    second[900] += 2
    stats = window.roll(1_000_000_000, {"cycles": 110}, second)
    assert stats.cycles == 100
    assert (stats.jitter_p50_us, stats.jitter_p99_us, stats.jitter_max_us) == (7.0, 900.0, 900.0)
    # within the window: the last full window again, whatever the counters say
    assert window.roll(1_500_000_000, {"cycles": 999}, second) is stats


def test_the_model_backend_runs_without_numpy() -> None:
    script = """
import sys, time
import services.ethercat_loop.__main__
from services.ethercat_loop.service import make_backend
from services.ethercat_loop.settings import EthercatSettings
backend = make_backend(EthercatSettings(backend="model"))
backend.start()
deadline = time.monotonic() + 60
while backend.stats().cycles == 0 and time.monotonic() < deadline:
    time.sleep(0.2)
assert backend.stats().cycles > 0, backend.stats()
backend.stop()
print(sorted(m for m in sys.modules if m == "numpy" or m.startswith("numpy.")))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "ROBOBUS_LOG_LEVEL": "WARNING"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
