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
