"""The rate cap keeps the long-run rate and absorbs jitter instead of locking onto it."""

from __future__ import annotations

import random

from services.epuck_gateway.pacing import RateGate


def test_jittery_source_at_the_cap_rate_is_not_thinned() -> None:
    gate = RateGate(50.0)
    rng = random.Random(1)
    passed = sum(gate.try_pass(k * 0.02 + rng.uniform(-0.004, 0.004)) for k in range(1, 1001))
    assert passed >= 995  # a plain 20 ms minimum interval would refuse about half of these


def test_fast_source_is_capped() -> None:
    gate = RateGate(10.0)
    passed = sum(gate.try_pass(k * 0.001) for k in range(10_000))  # 1 kHz for 10 s
    assert 100 <= passed <= 102  # 10 Hz plus the burst


def test_wait_and_no_cap() -> None:
    gate = RateGate(10.0)
    assert gate.try_pass(0.0) and gate.try_pass(0.0) and not gate.try_pass(0.0)
    assert abs(gate.wait_s(0.0) - 0.1) < 1e-9
    assert gate.try_pass(0.1)
    free = RateGate(0.0)
    assert all(free.try_pass(0.0) for _ in range(100)) and free.wait_s(0.0) == 0.0


def _bunched_arrivals(n: int, seed: int) -> list[float]:
    """A 50 Hz sender on a busy host: small noise, and 1 % of sends stalled 5..40 ms, after which it
    catches up on its absolute schedule (as the simulator and a real sender's timer do)."""
    rng = random.Random(seed)
    out, tick, t = [], 0.0, 0.0
    for _ in range(n):
        stall = rng.uniform(0.005, 0.04) if rng.random() < 0.01 else 0.0
        t = max(t, tick + rng.uniform(0.0, 0.001) + stall)
        out.append(t)
        tick += 0.02
    return out


def test_the_gateway_cap_holds_no_packet_of_a_bunched_source_at_its_rate() -> None:
    arrivals = _bunched_arrivals(20_000, seed=3)
    old, new = RateGate(50.0), RateGate.for_jitter(50.0)
    held_old = sum(not old.try_pass(t) for t in arrivals)
    held_new = sum(not new.try_pass(t) for t in arrivals)
    assert held_old > 20  # burst 2 holds about 1 % of them (each up to 20 ms): the p99 of the latency
    assert held_new == 0
    assert new.burst == 5 and RateGate.for_jitter(10.0).burst == 2 and RateGate.for_jitter(1.0).burst == 2


def test_a_jitter_sized_cap_still_caps_a_fast_source() -> None:
    gate = RateGate.for_jitter(50.0)
    passed = sum(gate.try_pass(k * 0.0005) for k in range(20_000))  # 2 kHz for 10 s
    assert 500 <= passed <= 505  # 50 Hz plus the burst
