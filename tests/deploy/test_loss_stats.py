"""bench/loss_stats.py: bursts apart from isolated losses, the sign test, the bootstrap verdict (no docker)."""

from __future__ import annotations

from bench.loss_stats import BURST_MIN, classify, compare, paired_blocks, sign_test


def test_a_burst_second_is_counted_apart_from_isolated_losses() -> None:
    t = classify([0, 1, 0, BURST_MIN + 4, 2, 0])
    assert (t["lost"], t["burst_seconds"], t["burst_lost"], t["isolated_lost"]) == (BURST_MIN + 7, 1, BURST_MIN + 4, 3)
    assert t["seconds_with_loss"] == 3 and t["lost_per_min"] == 60.0 * (BURST_MIN + 7) / 6


def test_sign_test_two_sided_exact() -> None:
    assert sign_test([1, 1, 1, 1, 1]) == 2 / 32    # 5 of 5 one way
    assert sign_test([1, -1, 0, 0]) == 1.0          # ties dropped, 1 vs 1
    assert sign_test([]) == 1.0


def test_blocks_pair_within_a_round_and_keep_seconds_together() -> None:
    a, b = [list(range(25)), [7, 8]], [list(range(100, 119)), [1, 2, 3]]
    assert paired_blocks(a, b, size=10) == [(list(range(10)), list(range(100, 110))),
                                            (list(range(10, 19)), list(range(110, 119))), ([7, 8], [1, 2])]
    assert paired_blocks([list(range(12))], [list(range(12))], size=10) == [(list(range(10)), list(range(10)))]


def test_same_bursty_process_on_both_sides_is_no_difference_but_a_real_excess_is_shown() -> None:
    # one 8-frame stall in every 20 s and an isolated loss every 5 s, on both sides: no difference shown
    window = [8 if s % 20 == 3 else 1 if s % 5 == 0 else 0 for s in range(30)]
    same = compare([window] * 4, [window[::-1]] * 4)
    assert same["lost_per_min_diff_ci95"][0] <= 0 <= same["lost_per_min_diff_ci95"][1]
    assert same["verdict"].startswith("no difference")
    # the container also stalls 10 frames every 10 s: it loses more, and the excess is in the bursts
    worse = [x + (10 if s % 10 == 6 else 0) for s, x in enumerate(window)]
    more = compare([worse] * 4, [window] * 4)
    assert more["verdict"] == "container loses more" and more["paired_blocks"] == 12
    assert more["sign_test_p"] == round(2 / 2 ** 12, 3) and more["burst_seconds_per_min_diff_ci95"][0] > 0


def test_a_disturbance_that_hits_both_sides_of_a_round_cancels() -> None:
    # round 3: ~200 lost per second on both sides (the machine, not the container); elsewhere the same
    quiet = [0, 0, 8, 0, 1, 0, 0, 0, 0, 1] * 2
    storm_c, storm_o = [200 + (s % 7) for s in range(20)], [200 + (s % 5) for s in range(20)]
    res = compare([quiet, quiet, storm_c], [quiet[::-1], quiet, storm_o])
    assert res["verdict"].startswith("no difference"), res
