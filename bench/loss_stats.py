"""Does one side lose more frames than the other? Per-second loss counts of interleaved windows, compared.

Lost frames on this VM come in bursts (5-45 frames within one second, on both sides: vCPU stalls), so the
total of one short window says little. Each side gives per-second counts (the cycle's 1 s loop_stats
windows); a second with at least BURST_MIN lost frames is a burst, its frames burst losses; losses in
quieter seconds are isolated. The comparison:
- per round (one window of each side, run one after the other): container minus outside, and a two-sided
  sign test over the rounds (ties dropped);
- a block bootstrap of the difference in lost frames per minute: 10 s blocks (a burst stays inside its
  block) resampled within each side; the container loses more only if the 95 % interval lies above 0.
Pure functions, no I/O: bench/deploy.py feeds them, tests/deploy/test_loss_stats.py checks them.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

BURST_MIN = 3   # lost frames within one 1 s window that make it a burst (a stall), not isolated losses
BLOCK_S = 10    # bootstrap block: seconds kept together


def classify(lost_per_s: list[int]) -> dict[str, float]:
    """Totals of one side: seconds, lost, burst seconds and their frames, isolated frames, per minute."""
    n = len(lost_per_s)
    bursts = [x for x in lost_per_s if x >= BURST_MIN]
    total = sum(lost_per_s)
    return {"seconds": n, "lost": total, "burst_seconds": len(bursts), "burst_lost": sum(bursts),
            "isolated_lost": total - sum(bursts), "seconds_with_loss": sum(1 for x in lost_per_s if x),
            "lost_per_min": round(60.0 * total / n, 2) if n else float("nan")}


def sign_test(diffs: list[float]) -> float:
    """Two-sided exact sign test p-value of paired differences (zeros dropped)."""
    pos, neg = sum(1 for d in diffs if d > 0), sum(1 for d in diffs if d < 0)
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    tail: float = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def blocks(windows: list[list[int]], size: int = BLOCK_S) -> list[list[int]]:
    """Each window cut into consecutive blocks of `size` seconds (a shorter tail block is kept)."""
    return [w[i:i + size] for w in windows for i in range(0, len(w), size) if w[i:i + size]]


def bootstrap_diff_per_min(a: list[list[int]], b: list[list[int]], n: int = 10_000,
                           seed: int = 13) -> tuple[float, float, float]:
    """Lost frames per minute, side a minus side b: the point estimate and a 95 % percentile interval from
    resampling each side's blocks with replacement."""
    rng = random.Random(seed)

    def rate(bs: list[list[int]]) -> float:
        secs = sum(len(x) for x in bs)
        return 60.0 * sum(sum(x) for x in bs) / secs

    point = rate(a) - rate(b)
    diffs = sorted(rate(rng.choices(a, k=len(a))) - rate(rng.choices(b, k=len(b))) for _ in range(n))
    return point, diffs[int(0.025 * n)], diffs[min(n - 1, int(0.975 * n))]


def compare(container: list[list[int]], outside: list[list[int]]) -> dict[str, Any]:
    """container[i], outside[i]: per-second lost frames of round i's window on each side."""
    flat_c = [x for w in container for x in w]
    flat_o = [x for w in outside for x in w]
    per_round = [sum(c) - sum(o) for c, o in zip(container, outside, strict=True)]
    point, lo, hi = bootstrap_diff_per_min(blocks(container), blocks(outside))
    bc = bootstrap_diff_per_min([[1 if x >= BURST_MIN else 0 for x in blk] for blk in blocks(container)],
                                [[1 if x >= BURST_MIN else 0 for x in blk] for blk in blocks(outside)])
    iso = bootstrap_diff_per_min([[x if x < BURST_MIN else 0 for x in blk] for blk in blocks(container)],
                                 [[x if x < BURST_MIN else 0 for x in blk] for blk in blocks(outside)])
    verdict = ("container loses more" if lo > 0 else
               "container loses less" if hi < 0 else "no difference shown (interval includes 0)")
    return {
        "container": classify(flat_c), "outside": classify(flat_o),
        "per_round_lost": [[sum(c), sum(o)] for c, o in zip(container, outside, strict=True)],
        "per_round_diff_median": statistics.median(per_round) if per_round else float("nan"),
        "sign_test_p": round(sign_test([float(d) for d in per_round]), 3),
        "lost_per_min_diff": round(point, 2), "lost_per_min_diff_ci95": [round(lo, 2), round(hi, 2)],
        "burst_seconds_per_min_diff_ci95": [round(bc[1], 2), round(bc[2], 2)],
        "isolated_per_min_diff_ci95": [round(iso[1], 2), round(iso[2], 2)],
        "verdict": verdict,
    }
