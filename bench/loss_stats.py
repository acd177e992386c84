"""Does one side lose more frames than the other? Per-second loss counts of interleaved windows, compared.

Lost frames on this VM come in bursts (5-45 frames within one second, on both sides: vCPU stalls), and the
machine's load changes by the minute (a whole minute of ~200 lost frames per second on both sides was seen),
so the total of one short window says little. Each side gives per-second counts (the cycle's 1 s loop_stats
windows); a second with at least BURST_MIN lost frames is a burst, its frames burst losses; losses in
quieter seconds are isolated. The comparison is paired: round i ran one window of each side back to back,
so block j (BLOCK_S seconds) of round i's container window is paired with block j of its outside window,
and what disturbed both (the other sessions' load) cancels in the difference. Over the paired blocks:
- a two-sided sign test of the differences (ties dropped);
- a bootstrap of the mean difference, in lost frames per minute: the container loses more only if the 95 %
  interval lies above 0 (a burst stays inside its block; blocks are resampled as pairs).
Pure functions, no I/O: bench/deploy.py feeds them, tests/deploy/test_loss_stats.py checks them.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
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


def paired_blocks(a: list[list[int]], b: list[list[int]], size: int = BLOCK_S) -> list[tuple[list[int], list[int]]]:
    """Round by round, block j of a's window with block j of b's (windows cut to the shorter one; a tail
    shorter than half a block is left out, a window shorter than a block is one block)."""
    out = []
    for wa, wb in zip(a, b, strict=True):
        n = min(len(wa), len(wb))
        out += [(wa[i:min(i + size, n)], wb[i:min(i + size, n)]) for i in range(0, n, size)
                if n - i >= min(n, (size + 1) // 2)]
    return out


def bootstrap_paired_per_min(pairs: list[tuple[list[int], list[int]]], n: int = 10_000,
                             seed: int = 13) -> tuple[float, float, float]:
    """Mean per-minute difference (first minus second) over the pairs, and a 95 % percentile interval from
    resampling the pairs with replacement."""
    rng = random.Random(seed)
    d = [60.0 * (sum(x) - sum(y)) / len(x) for x, y in pairs]
    if not d:
        return float("nan"), float("nan"), float("nan")
    means = sorted(statistics.fmean(rng.choices(d, k=len(d))) for _ in range(n))
    return statistics.fmean(d), means[int(0.025 * n)], means[min(n - 1, int(0.975 * n))]


def compare(container: list[list[int]], outside: list[list[int]]) -> dict[str, Any]:
    """container[i], outside[i]: per-second lost frames of round i's window on each side."""
    flat_c = [x for w in container for x in w]
    flat_o = [x for w in outside for x in w]
    pairs = paired_blocks(container, outside)

    def part(keep: Callable[[int], int]) -> tuple[float, float, float]:
        return bootstrap_paired_per_min([([keep(x) for x in c], [keep(x) for x in o]) for c, o in pairs])

    point, lo, hi = part(lambda x: x)
    _, blo, bhi = part(lambda x: 1 if x >= BURST_MIN else 0)
    _, ilo, ihi = part(lambda x: x if x < BURST_MIN else 0)
    verdict = ("container loses more" if lo > 0 else
               "container loses less" if hi < 0 else "no difference shown (interval includes 0)")
    return {
        "container": classify(flat_c), "outside": classify(flat_o),
        "per_round_lost": [[sum(c), sum(o)] for c, o in zip(container, outside, strict=True)],
        "paired_blocks": len(pairs),
        "block_diff_median": statistics.median([sum(c) - sum(o) for c, o in pairs]) if pairs else float("nan"),
        "sign_test_p": round(sign_test([float(sum(c) - sum(o)) for c, o in pairs]), 3),
        "lost_per_min_diff": round(point, 2), "lost_per_min_diff_ci95": [round(lo, 2), round(hi, 2)],
        "burst_seconds_per_min_diff_ci95": [round(blo, 2), round(bhi, 2)],
        "isolated_per_min_diff_ci95": [round(ilo, 2), round(ihi, 2)],
        "verdict": verdict,
    }


def main(argv: list[str] | None = None) -> None:
    """Pool the rounds of several bench/deploy.py runs (their last output line, saved to files):
    python bench/loss_stats.py run1.json run2.json"""
    import json
    import sys

    files = sys.argv[1:] if argv is None else argv
    con: list[list[int]] = []
    out: list[list[int]] = []
    for f in files:
        with open(f) as fh:
            w = json.loads(fh.read().strip().splitlines()[-1])["cycle"]["windows"]
        con += [x["lost_per_s"] for x in w["container"]]
        out += [x["lost_per_s"] for x in w["outside"]]
    print(json.dumps({"runs": len(files), "rounds": len(con), **compare(con, out)}))


if __name__ == "__main__":
    main()
