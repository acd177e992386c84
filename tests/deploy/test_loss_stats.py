"""bench/loss_stats.py: bursts apart from isolated losses, the sign test, the bootstrap verdict (no docker)."""

from __future__ import annotations

from bench.loss_stats import BURST_MIN, blocks, classify, compare, sign_test


def test_a_burst_second_is_counted_apart_from_isolated_losses() -> None:
    t = classify([0, 1, 0, BURST_MIN + 4, 2, 0])
    assert (t["lost"], t["burst_seconds"], t["burst_lost"], t["isolated_lost"]) == (BURST_MIN + 7, 1, BURST_MIN + 4, 3)
    assert t["seconds_with_loss"] == 3 and t["lost_per_min"] == 60.0 * (BURST_MIN + 7) / 6


def test_sign_test_two_sided_exact() -> None:
    assert sign_test([1, 1, 1, 1, 1]) == 2 / 32    # 5 of 5 one way
    assert sign_test([1, -1, 0, 0]) == 1.0          # ties dropped, 1 vs 1
    assert sign_test([]) == 1.0


def test_blocks_keep_seconds_together_within_a_window() -> None:
    assert blocks([list(range(25)), [7, 8]], size=10) == [list(range(10)), list(range(10, 20)),
                                                         list(range(20, 25)), [7, 8]]


def test_same_bursty_process_on_both_sides_is_no_difference_but_a_real_excess_is_shown() -> None:
    # one 8-frame stall in every 20 s and an isolated loss every 5 s, on both sides: no difference shown
    window = [8 if s % 20 == 3 else 1 if s % 5 == 0 else 0 for s in range(30)]
    same = compare([window] * 4, [window[::-1]] * 4)
    assert same["lost_per_min_diff_ci95"][0] <= 0 <= same["lost_per_min_diff_ci95"][1]
    assert same["verdict"].startswith("no difference")
    # the container also stalls 10 frames every 10 s: it loses more, and the excess is in the bursts
    worse = [x + (10 if s % 10 == 6 else 0) for s, x in enumerate(window)]
    more = compare([worse] * 4, [window] * 4)
    assert more["verdict"] == "container loses more" and more["sign_test_p"] == 0.125
    assert more["burst_seconds_per_min_diff_ci95"][0] > 0
