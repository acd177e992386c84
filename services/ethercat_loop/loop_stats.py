"""The 1 s loop-statistics window, one copy for every backend.

A backend counts (cycles, overruns, lost frames, ...) and keeps a 1 µs histogram of wake-up latencies;
`LoopWindow.roll` differences two readings a second or more apart into an `EthercatLoopStats`. The
in-process model and the realtime cycle process (whose counters live in shared memory) feed it the same
way, with the same percentile routine.

The model's histogram is a Counter of the occupied bins (`new_histogram`): the model backend then runs without
numpy, which would be a third of its process's resident memory (~15 MB) for one counter array, and copies and
differences a few hundred bins rather than 20 001. The realtime cycle's histograms are numpy arrays in shared
memory; every routine here takes either.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import TYPE_CHECKING, TypeAlias

from services.ethercat_loop.models import EthercatLoopStats

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Histogram: TypeAlias = npt.NDArray[np.int64] | Counter[int]

HIST_US = 20_000  # 1 µs bins up to 20 ms; the last bin holds everything later
WINDOW_NS = 1_000_000_000
# the counters a window differences (every backend keeps them; a model without frames leaves some at 0)
WINDOW_COUNTERS = ("cycles", "overruns", "lost", "no_status", "wkc_errors", "late", "dropped", "decode_errors",
                   "outages")


def new_histogram() -> Counter[int]:
    """An in-process histogram: bin -> count, no numpy (see the module's docstring)."""
    return Counter()


def _difference(a: Histogram, b: Histogram) -> Histogram:
    if isinstance(a, Counter) and isinstance(b, Counter):
        return a - b  # counts only grow: what is left is what the window added
    if isinstance(a, Counter) or isinstance(b, Counter):
        raise TypeError("a window differences histograms of one kind")
    return a - b


def percentiles(hist: Histogram, qs: tuple[float, ...] = (0.5, 0.99, 0.999)) -> dict[str, float | None]:
    """Percentiles (µs) of a 1 µs-bin histogram; the last bin stands for 'HIST_US or more'."""
    # only the occupied bins (a few hundred of 20 001): the MQTT process calls this several times a second
    # and holds the GIL while it runs. Copied first: the cycle process keeps counting while we read (numpy's
    # nonzero refuses an array whose count of non-zero elements changes under it).
    hist = hist.copy()
    if isinstance(hist, Counter):
        bins = sorted(i for i, n in hist.items() if n > 0)
        cum: list[int] = []
        running = 0
        for i in bins:
            running += hist[i]
            cum.append(running)
    else:
        import numpy as np  # the caller's array is numpy's: already imported

        bins = np.flatnonzero(hist).tolist()
        cum = np.cumsum(hist[bins]).tolist()
    out: dict[str, float | None] = {}
    if not bins:
        empty: dict[str, float | None] = {f"p{q * 100:g}": None for q in qs}
        return {**empty, "max": None, "count": 0.0}
    total = int(cum[-1])
    for q in qs:
        # the first bin whose cumulative count reaches q of the total (numpy's searchsorted, side="left")
        out[f"p{q * 100:g}"] = float(bins[min(bisect.bisect_left(cum, q * total), len(bins) - 1)])
    out["max"] = float(bins[-1])
    out["count"] = float(total)
    return out


class LoopWindow:
    """Differences of counters and wake-up histogram over the last full window (>= 1 s)."""

    def __init__(self, period_ns: int, window_ns: int = WINDOW_NS) -> None:
        self.period_ns = period_ns
        self.window_ns = window_ns
        self._prev: tuple[int, dict[str, int], Histogram] | None = None
        self.last = EthercatLoopStats(ts=0.0, target_period_us=period_ns / 1000.0)

    def roll(self, now_ns: int, counters: dict[str, int], wake: Histogram) -> EthercatLoopStats:
        """Close the window if it is a window long (else keep the last one); returns the last full window."""
        if self._prev is not None and now_ns - self._prev[0] < self.window_ns:
            return self.last
        wake = wake.copy()
        if self._prev is not None:
            t0, c0, w0 = self._prev
            d = {k: counters.get(k, 0) - c0.get(k, 0) for k in WINDOW_COUNTERS}
            p = percentiles(_difference(wake, w0))
            secs = (now_ns - t0) / 1e9
            self.last = EthercatLoopStats(
                ts=time.time(), period_us=round(secs * 1e6 / d["cycles"], 3) if d["cycles"] else 0.0,
                target_period_us=self.period_ns / 1000.0, cycles=d["cycles"],
                jitter_p50_us=p["p50"] or 0.0, jitter_p99_us=p["p99"] or 0.0, jitter_max_us=p["max"] or 0.0,
                overruns=d["overruns"], drops=d["dropped"], frames_lost=d["lost"], decode_errors=d["decode_errors"],
                late_frames=d["late"], wkc_errors=d["wkc_errors"], no_status=d["no_status"], outages=d["outages"],
                window_s=round(secs, 3),
                total_cycles=counters.get("cycles", 0), total_overruns=counters.get("overruns", 0))
        self._prev = (now_ns, dict(counters), wake)
        return self.last
