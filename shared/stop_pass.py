"""The bus stop for every motion device of a service in one pass on its event loop (docs/kit.md "Stopping
everything"): for services whose devices share one loop and whose stops are many small writes (an e-puck2 swarm's
sockets, ROI modules' datagrams).

The kit calls a motion device's stop action once per device when the stop becomes active, and again for one
device after a motion command that ran across the stop. Given a coroutine action, it schedules one coroutine per
device on the loop: each its own hand-off from the MQTT network thread, its own task, started one loop iteration
later, with the loop's other work (other devices' packets, JPEG encoding, maintain loops) in between, so the last
device's stop left tens of milliseconds after the first (bench/stop.py). Here the action is inline (on the network
thread): the first call of an activation puts every device of the pass in one pass, scheduled with one hand-off;
the pass runs as one loop callback (the service's runner) that writes every device's stop, one after another with
nothing in between, each stamped as it is written; the reports (the node's stop answer, the health) come after the
last write. The kit's call that scheduled the pass waits for its writes (at most PASS_WAIT_S: an inline action
that waits, bounded): the kit's thread would otherwise go on with the activation's per-device health publishes
and take the GIL from the pass at every switch interval.

A service whose loop may be busy when the stop comes (after a stalled process or broker: seconds of queued
packets, commands and publishes) also gives an `early` writer: the first call of an activation runs it on the
kit's thread, before it schedules the pass, to write every device's stop it can from there, ahead of the loop's
queue (ROI's datagrams, the e-puck2 WiFi robots' commands); the pass then does the bookkeeping and writes what
the early writer could not.

No device is written twice by one activation: the kit's own call for a device the activation's pass already
covers does nothing. Any other call (a motion command that ran across the stop: the kit's `done`; a device made
during the stop) puts that device in the next pass, so the stop is written again after whatever the command sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shared import Node
from shared.messages import StopState
from shared.stop import LATER

log = logging.getLogger("robobus.stop")

# Run on the loop with the devices due (name -> the stop activation count they are due for); it writes each one,
# and reports it (StopLatch.report with that count) once the writes are done, in a later turn of the loop.
PassRunner = Callable[[dict[str, int]], None]
PASS_WAIT_S = 0.1  # the longest the kit's thread waits for the pass it scheduled (StopPass.request)
# On the kit's thread, the first call of an activation: write the stop of the devices named (the pass's members)
# for that activation, from there; whatever it leaves, the pass writes. It returns, per device it wrote, what the
# pass needs of that write (its time, its packets...), which the pass takes back with `StopPass.take_early`.
EarlyWriter = Callable[[int, list[str]], dict[str, Any]]
WRITE_SWITCH_INTERVAL_S = 1e-5  # the interpreter's switch interval while the stop is written from a thread


@contextlib.contextmanager
def short_switch_interval() -> Iterator[None]:
    """The interpreter's switch interval at WRITE_SWITCH_INTERVAL_S for a write from a thread beside a busy loop:
    every send gives up the GIL, and taking it back from a busy thread waited a whole interval (1 ms) per
    write (measured: 250 datagrams beside a busy thread, 240 ms; at 10 us, 22 ms)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, WRITE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class StopPass:
    """Gathers the stop actions of one activation into one pass on the loop."""

    def __init__(self, node: Node, run: PassRunner, wait_s: float = PASS_WAIT_S,
                 early: EarlyWriter | None = None) -> None:
        self.node = node
        self._run_pass = run
        self.wait_s = wait_s
        self._early = early
        self._lock = threading.Lock()
        self._members: list[str] = []  # the devices whose stop action is this pass's, in their order
        self._gen: int | None = None  # the activation whose calls are covered by its pass
        self._covered: set[str] = set()  # the devices of that activation whose own call has not come yet
        self._due: dict[str, int] = {}
        self._scheduled = False
        self._written_early: dict[str, tuple[int, Any]] = {}  # device -> (activation, what the early writer wrote)
        self.passes = 0  # passes run (logs and tests)

    def action(self, name: str) -> Callable[[StopState], Any]:
        """The inline stop action of device `name` (`Device.on_stop(..., inline=True)`)."""
        with self._lock:
            if name not in self._members:
                self._members.append(name)

        def stop_action(stop: StopState) -> Any:
            self.request(name)
            return LATER  # the pass reports the write (StopLatch.report)

        return stop_action

    def request(self, name: str) -> None:
        """On the kit's thread: `name` must be stopped (again). The call that schedules a pass waits for its
        writes (at most `wait_s`), unless it is on the loop itself; the others return at once."""
        gen = self.node.stop_latch.generation
        loop = self.node.loop
        if loop is None or not loop.is_running():
            raise RuntimeError("the service's event loop is not running")
        on_loop = _running_loop() is loop
        if self._early is not None and not on_loop:
            with self._lock:
                first, members = gen != self._gen, list(self._members)
            if first:
                try:
                    with short_switch_interval():  # the loop's thread, busy, must not take the GIL 1 ms at a time
                        wrote = self._early(gen, members)
                    with self._lock:
                        self._written_early.update((n, (gen, w)) for n, w in wrote.items())
                except Exception:  # whatever failed here, the pass writes every device's stop
                    log.exception("bus stop: the write from the kit's thread failed (the pass writes it)")
        with self._lock:
            if gen != self._gen:  # a new activation: every device in one pass
                self._gen = gen
                self._covered = set(self._members)
                self._covered.discard(name)
                for n in self._members:
                    self._due[n] = gen
                self._due[name] = gen
            elif name in self._covered:
                self._covered.discard(name)  # the activation's own call: its pass has it (done or to come)
                return
            else:
                self._due[name] = gen  # a stop again (a command ran across it), or a device made meanwhile
            if self._scheduled:
                return
            self._scheduled = True
        written = threading.Event()
        try:
            loop.call_soon_threadsafe(self._run, written)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                self._scheduled = False
            raise
        if not on_loop:
            # Hold the kit's thread (the MQTT network thread) until the pass has written: it would otherwise go on
            # with the activation's per-device health publishes and take the GIL from the pass every switch
            # interval, and on a busy host each hand-back waits for a CPU (measured: a pass of 0.5 ms of work took
            # 3-12 ms). Bounded: a loop that does not run the pass in time is not waited for.
            written.wait(self.wait_s)

    def take_early(self, name: str) -> tuple[int, Any] | None:
        """For the pass: (activation, what the early writer returned) for `name`'s last write from the kit's thread,
        forgotten here; None if there was none. One of an older activation is the caller's to discard."""
        with self._lock:
            return self._written_early.pop(name, None)

    def _run(self, written: threading.Event) -> None:
        with self._lock:
            due, self._due = self._due, {}
            self._scheduled = False
        try:
            if not due:
                return
            self.passes += 1
            try:
                self._run_pass(due)
            except Exception:
                log.exception("bus stop pass failed", extra={"devices": sorted(due)})
                latch = self.node.stop_latch
                for name, gen in due.items():
                    latch.report(name, gen, None, "the stop pass failed (see the service's log)")
        finally:
            written.set()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
