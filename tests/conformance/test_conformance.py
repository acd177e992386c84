"""Every registered service against the same fault script (tests/conformance/faults.py), each on its own
simulator in its own process, watched from outside as a subscriber sees it. `make conformance` prints the
table: service x fault x (what was seen, when, verdict)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.tools.simrig import SimRig
from tests.conformance import faults
from tests.conformance.harness import Stack, Verdict, rigs, table
from tests.fixtures import mosquitto_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RIGS = rigs()
VERDICTS: list[Verdict] = []


def test_every_registered_service_has_a_rig() -> None:
    missing = {s: why for s, why in RIGS.items() if not isinstance(why, SimRig)}
    assert not missing, missing


@pytest.fixture(scope="module", params=sorted(s for s, r in RIGS.items() if isinstance(r, SimRig)))
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    rig = RIGS[request.param]
    assert isinstance(rig, SimRig)
    why = rig.needs() if rig.needs else None
    if why:
        pytest.skip(f"{request.param}: {why}")
    s = Stack(request.param, rig)
    s.start_broker()
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("fault", faults.FAULTS)
def test_fault(stack: Stack, fault: str) -> None:
    na = stack.rig.not_applicable.get(fault)
    if na is None and fault == "garbage" and stack.rig.garbage_sim is None:
        na = "the rig offers no garbage device"
    if na is None and fault == "wrong_kind" and stack.rig.wrong_kind_sim is None:
        na = "the rig offers no device of another kind"
    if na is not None:
        VERDICTS.append(Verdict(stack.service, fault, na, None, None))
        pytest.skip(na)
    v = faults.SCRIPT[fault](stack)
    VERDICTS.append(v)
    logs = "" if v.ok else "\n--- node\n" + (stack.node.tail(12) if stack.node else "") + "\n--- sim\n" + (
        stack.sim.tail(6) if stack.sim else "")
    assert v.ok, table([v]) + logs


def test_zz_table() -> None:
    """Printed at the end (pytest -s, or `make conformance`)."""
    print("\n" + table(VERDICTS))
