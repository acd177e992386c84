"""Chaos against the whole simulated system (every `make run` process on a private broker): broker kill -9,
kill -9 of each node, each simulator vanishing, garbage on every command topic, a flooding client. Every
invariant of tests/chaos/faults.py must hold; the table is printed (pytest -s, or `make chaos` for the long
version with the 30-minute soak)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos import faults
from tests.chaos.stack import SimStack, sim_stack
from tests.fixtures import can_netns, mosquitto_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RESULTS: list[faults.FaultResult] = []


@pytest.fixture(scope="module")
def stack() -> Iterator[SimStack]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    with sim_stack() as s:
        assert s.expected_nodes, "no node came online: " + "; ".join(
            f"{p.name}: {p.tail(5)}" for p in s.procs.values())
        yield s
    print("\n" + faults.table(RESULTS))


def _run(result: faults.FaultResult, stack: SimStack) -> None:
    RESULTS.append(result)
    logs = "\n".join(f"--- {p.name}\n{p.tail(8)}" for p in stack.procs.values() if not p.alive())
    assert not result.violations, faults.table([result]) + ("\n" + logs if logs else "")


def test_broker_kill9(stack: SimStack) -> None:
    _run(faults.broker_kill9(stack), stack)


def test_device_vanishes(stack: SimStack) -> None:
    _run(faults.device_vanish(stack), stack)


def test_garbage_on_every_command_topic(stack: SimStack) -> None:
    # 200 per topic in the suite (every garbage kind 14 times over); `make chaos` sends 1,000
    _run(faults.garbage(stack, per_topic=200), stack)


def test_flooding_client(stack: SimStack) -> None:
    _run(faults.flood(stack), stack)


def test_node_kill9(stack: SimStack) -> None:
    _run(faults.node_kill9(stack), stack)


def test_soak(stack: SimStack) -> None:
    """The suite's soak: 50 s, sampled every 5 s, the growth judged after a 20 s warm-up (the stack has run the
    faults before it); the same invariants as `make chaos` (3 minutes) and `make soak` (30 minutes), which are the
    long ones."""
    _run(faults.soak(stack, duration_s=50, sample_every_s=5, warmup_s=20), stack)


def test_network_partition() -> None:
    reason = can_netns()
    if reason:
        pytest.skip(reason)
    from tests.chaos.partition import partition

    result = partition()
    RESULTS.append(result)
    assert not result.violations, faults.table([result])
