"""bench/ethercat_cycle.py reads cyclictest's histogram (the run itself is the bench: not here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ethercat_cycle

# `cyclictest -h N -q` prints one line per microsecond bin, then the overflows (wake-ups past the last bin)
HISTOGRAM = "\n".join([
    "# Histogram",
    *(f"{us:06d} {n:06d}" for us, n in [(20, 900), (30, 80), (949, 1), (951, 2), (999, 3), (1000, 4), (1500, 5)]),
    "# Total: 000000995",
    "# Histogram Overflows: 00005",
])


def test_late_and_near_late_wake_ups_are_counted_from_the_histogram() -> None:
    r = ethercat_cycle.parse_cyclictest(HISTOGRAM, 1000)
    assert r["samples"] == 1000
    assert r["over_period"] == 4 + 5 + 5  # 1000 us and above, and the overflows
    assert r["near_period"] == 2 + 3  # 950-999 us: late by less than a period, within 50 us of it
    assert r["p50_us"] == 20 and r["max_us"] >= 1500


def test_no_histogram_is_an_error_not_zero_late_wake_ups() -> None:
    assert "error" in ethercat_cycle.parse_cyclictest("cyclictest: permission denied", 1000)
