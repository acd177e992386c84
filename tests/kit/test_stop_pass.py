"""The bus stop's one pass (shared/stop_pass.py, used by epuck-gateway and roi-modules): every device
of an activation in one pass on the loop, whatever the order in which the kit's calls come and the loop runs; no
device written twice by one activation; a stop again (a command that ran across it) gets a pass of its own; a
failure is reported for each device, not swallowed; the kit's call that scheduled a pass waits for its writes,
except on the loop itself.

The kit's side is a stand-in here (the latch's activation count and its reports): what is tested is the order of
the calls against a real loop running in its own thread. Every wait is on a condition; "no pass came" is proved by
a marker queued on the loop behind anything the calls could have scheduled (call_soon_threadsafe keeps its order).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shared import stop_pass
from shared.messages import StopState
from shared.stop import LATER

DEADLINE = 20.0
STOP = StopState(active=True, source="tester", reason="test", ts=1.0)


class Latch:
    def __init__(self) -> None:
        self.generation = 1
        self.reports: list[tuple[str, int | None, float | None, str]] = []

    def report(self, device: str, gen: int | None, written_ts: float | None, error: str = "") -> None:
        self.reports.append((device, gen, written_ts, error))


class Node:
    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.stop_latch = Latch()
        self.loop = loop


class Rig:
    """A loop in a thread, a StopPass on it whose passes are recorded, and the loop's order as a marker."""

    def __init__(self, module: Any, loop: asyncio.AbstractEventLoop, wait_s: float = 0.0) -> None:
        self.loop = loop
        self.node = Node(loop)
        self.passes: list[dict[str, int]] = []
        self.fail = False
        self.sp = module.StopPass(self.node, self._run, wait_s=wait_s)
        self.actions = {name: self.sp.action(name) for name in ("a", "b", "c")}

    def _run(self, due: dict[str, int]) -> None:
        assert threading.current_thread() is not threading.main_thread()  # on the loop's thread
        self.passes.append(dict(due))
        if self.fail:
            raise RuntimeError("a broken device")

    def call(self, name: str) -> Any:
        return self.actions[name](STOP)

    def settle(self) -> None:
        """Whatever the calls so far scheduled on the loop has run."""
        done = threading.Event()
        self.loop.call_soon_threadsafe(done.set)
        assert done.wait(DEADLINE)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, name="stop-pass-loop", daemon=True)
    t.start()
    try:
        yield lp
    finally:
        lp.call_soon_threadsafe(lp.stop)
        t.join(DEADLINE)
        lp.close()


MODULES = [pytest.param(stop_pass, id="kit")]


@pytest.mark.parametrize("module", MODULES)
def test_the_first_call_of_an_activation_puts_every_device_in_one_pass(module: Any,
                                                                        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(module, loop)
    # the kit's first call; the loop runs its pass before the kit's calls for the other devices come
    assert rig.call("b") is LATER
    rig.settle()
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}]
    # the kit's own calls for the other devices of this activation: covered, no second write
    rig.call("a")
    rig.call("c")
    rig.settle()
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}]


@pytest.mark.parametrize("module", MODULES)
def test_calls_that_come_together_make_one_pass(module: Any, loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(module, loop)
    hold = threading.Event()
    loop.call_soon_threadsafe(hold.wait, DEADLINE)  # the loop busy while the kit's calls come
    for name in ("a", "b", "c"):
        rig.call(name)
    hold.set()
    rig.settle()
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}]
    assert rig.sp.passes == 1


@pytest.mark.parametrize("module", MODULES)
def test_a_stop_again_gets_a_pass_of_its_own_and_a_new_activation_all_devices(
        module: Any, loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(module, loop)
    for name in ("a", "b", "c"):
        rig.call(name)
    rig.settle()
    # a motion command on `a` ran across the stop: the kit calls its action again, in the same activation
    rig.call("a")
    rig.settle()
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}, {"a": 1}]
    # a new activation (released, stopped again): every device again, with its count
    rig.node.stop_latch.generation = 2
    rig.call("c")
    rig.settle()
    assert rig.passes[2:] == [{"a": 2, "b": 2, "c": 2}]


@pytest.mark.parametrize("module", MODULES)
def test_a_done_call_before_the_activations_own_call_still_leaves_a_write_after_it(
        module: Any, loop: asyncio.AbstractEventLoop) -> None:
    """The kit's `done` for `b` comes while the activation's calls are still going (b's own not yet made): each
    of the two calls is followed by a write of `b`."""
    rig = Rig(module, loop)
    rig.call("a")  # the activation's first call; its pass runs at once
    rig.settle()
    rig.call("b")  # `done` for b, after the pass: it takes the place of b's own call, which is still to come...
    rig.call("b")  # ... and that call, not covered any more, gets a pass of its own: b is written after both
    rig.settle()
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}, {"b": 1}]


@pytest.mark.parametrize("module", MODULES)
def test_a_failed_pass_is_reported_for_every_device(module: Any, loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(module, loop)
    rig.fail = True
    rig.call("a")
    rig.settle()
    reports = sorted(rig.node.stop_latch.reports)
    assert [(d, g, w) for d, g, w, _ in reports] == [("a", 1, None), ("b", 1, None), ("c", 1, None)]
    assert all("failed" in e for *_, e in reports)


@pytest.mark.parametrize("module", MODULES)
def test_no_running_loop_is_an_error_the_kit_reports(module: Any) -> None:
    sp = module.StopPass(Node(None), lambda due: None)
    with pytest.raises(RuntimeError, match="loop is not running"):
        sp.action("a")(STOP)


@pytest.mark.parametrize("module", MODULES)
def test_the_call_that_schedules_a_pass_returns_once_it_has_written(module: Any,
                                                                     loop: asyncio.AbstractEventLoop) -> None:
    """The kit's thread waits for the pass it scheduled (so that its own work after the stop actions does not take
    the GIL from the pass); the other calls of the activation return at once."""
    rig = Rig(module, loop, wait_s=DEADLINE)
    rig.call("a")
    assert rig.passes == [{"a": 1, "b": 1, "c": 1}]  # written by the time the call returned: no settle needed
    rig.call("b")
    rig.call("c")
    rig.settle()
    assert len(rig.passes) == 1


@pytest.mark.parametrize("module", MODULES)
def test_a_call_on_the_loop_itself_does_not_wait_for_the_pass(module: Any, loop: asyncio.AbstractEventLoop) -> None:
    """A motion command handler on the loop that ran across the stop (the kit's `done`): its call schedules a pass
    and returns; waiting there would hold up the very loop that runs the pass (for the whole `wait_s`)."""
    rig = Rig(module, loop, wait_s=DEADLINE)
    rig.call("a")
    order: list[str] = []
    returned = threading.Event()

    took: list[float] = []

    def on_loop() -> None:
        t0 = time.monotonic()
        rig.call("a")  # the activation's own call for `a` came first: this one is a stop again
        took.append(time.monotonic() - t0)
        order.append("returned")
        returned.set()

    loop.call_soon_threadsafe(on_loop)
    assert returned.wait(2 * DEADLINE)
    rig.settle()
    assert took[0] < DEADLINE / 2, took  # waiting would have held the loop for the whole DEADLINE
    assert order == ["returned"] and rig.passes[1:] == [{"a": 1}], (order, rig.passes)
