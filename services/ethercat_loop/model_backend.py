"""The model backend: `PalmDriver` against the in-process `PalmModel`, in one thread of the MQTT process.

For `make run`, demos and fast tests: no raw sockets, no privileges. It shares the GIL with MQTT, so it is
not the realtime path (that is `transport.ProcessBackend`), but it keeps the same release rule, loop
statistics and link states, so the MQTT surface cannot tell the two apart.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from services.ethercat_loop.backend import (
    STOP_ZERO_CYCLES,
    BackendHooks,
    BackendUnavailable,
    CanRxHandler,
    HandBackend,
    build_driver,
)
from services.ethercat_loop.control import CanRxFrame, ControlMessage, Halt
from services.ethercat_loop.driver import PalmDriver
from services.ethercat_loop.loop_stats import HIST_US, WINDOW_COUNTERS, LoopWindow, new_histogram
from services.ethercat_loop.models import EthercatLoopStats
from services.ethercat_loop.palm_model import CanNode, PalmModel
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.snapshot import PalmSnapshot
from services.ethercat_loop.transport.realtime import next_deadline

log = logging.getLogger("robobus.ethercat.model")
IDLE_BATCH_NS = 100_000_000  # a quiescent palm is stepped every 100 ms in a batch (snapshots, 100 Hz, catch up first)


class ModelBackend(HandBackend):
    """Driver + palm model in one dedicated thread, `period_ns` apart on absolute deadlines, with the
    wire backend's release rule (`transport.realtime.next_deadline`): an overrun snaps to the next period
    boundary (missed cycles are skipped, not caught up, as ros_ethercat does, but with an integer period)."""

    def __init__(self, driver: PalmDriver, model: PalmModel, period_ns: int = 1_000_000,
                 serial: int = 1234, error_after_lost: int = 20) -> None:
        self.driver = driver
        self.error_after_lost = error_after_lost
        self._no_status_run = 0  # consecutive cycles without a status
        self.model = model
        self.period_ns = period_ns
        self.serial = serial
        self._inbox: queue.SimpleQueue[ControlMessage] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._window = LoopWindow(period_ns)
        self._wake = new_histogram()  # wake-up latency, 1 µs bins (what the wire backend keeps in shared memory)
        self._counts = dict.fromkeys((*WINDOW_COUNTERS, "batched"), 0)
        self._rx: deque[CanRxFrame] = deque(maxlen=65536)
        self._rx_event = threading.Event()
        self._rx_handler: CanRxHandler | None = None
        self._rx_thread: threading.Thread | None = None
        self._running = False
        self._stopped = False
        self._report: dict[str, Any] = {}
        self.lose_next = 0  # fault: the next n frames are lost (no status at all)
        self._status: bytes | None = None
        self._status_ns: int | None = None  # CLOCK_MONOTONIC ns of the cycle that produced the newest valid status
        self._deadline = time.monotonic_ns()  # the next release
        self._batching = False  # quiescent: the thread sleeps through releases and runs them in a batch
        self._wakeup = threading.Event()
        self.error = ""
        self._stop_sent = (0, 0)  # (bus stop number, CLOCK_MONOTONIC ns of the command that first carried it)

    # -- HandBackend ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        if self.link is not None:  # the palm model is in this process: always there, open at once
            self.link.attempt()
            self.link.opened()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="palm-cycle", daemon=True)
        self._thread.start()
        self._rx_thread = threading.Thread(target=self._pump_rx, name="palm-can-rx", daemon=True)
        self._rx_thread.start()

    def stop(self) -> None:
        if self._stopped or self._thread is None:
            return
        self._stopped = True
        self.submit(Halt(True))
        deadline = time.monotonic() + 2.0
        while (self.driver.c["halt_zero_cycles"] < STOP_ZERO_CYCLES and time.monotonic() < deadline
               and self._thread.is_alive()):
            time.sleep(0.002)
        self._stop.set()
        self._wakeup.set()
        self._thread.join(2.0)
        self._running = False
        self._rx_event.set()
        with self._lock:
            self._report = {"zero_demand_cycles": self.driver.c["halt_zero_cycles"],
                            "demands_sent_last": [m.demand_sent for m in self.driver.motors],
                            "model_demands": self.model.demands}

    def stop_report(self) -> dict[str, Any]:
        return dict(self._report)

    def submit(self, msg: ControlMessage) -> None:
        self._inbox.put(msg)
        self._wakeup.set()

    def snapshot(self, motors: bool = True) -> PalmSnapshot | None:
        with self._lock:
            self._catch_up(time.monotonic_ns())  # compute the state when asked, not at every release
            if self.driver.cycle_no == 0:
                return None
            return self.driver.snapshot(motors=motors)

    def stats(self) -> EthercatLoopStats:
        with self._lock:
            counts = {**self._counts, "dropped": self.driver.c["dropped"],
                      "decode_errors": self.driver.c["decode_errors"]}
            wake = self._wake.copy()
        return self._window.roll(time.monotonic_ns(), counts, wake)

    def info(self) -> dict[str, Any]:
        no_data = self._no_status_run >= self.error_after_lost
        state = ("no_data" if no_data else "op") if self._running else ("error" if self.error else "stopped")
        return {"vendor": None, "product": self.driver.info.product_codes[0], "revision": 0, "serial": self.serial,
                "protocol": self.driver.protocol, "backend": "model", "connected": self.connected(),
                "state": state, "error": self.error, "no_data": no_data, "issue": "", "recovery": None}

    def on_can_rx(self, handler: CanRxHandler) -> None:
        self._rx_handler = handler

    def valid_statuses(self) -> int:
        return self.last_valid_status()[0]

    def last_valid_status(self) -> tuple[int, float | None]:
        with self._lock:
            self._catch_up(time.monotonic_ns())  # a batch slept through counts its statuses when asked
            at = self._status_ns
            return int(self.driver.c["statuses"]), (None if at is None else at / 1e9)

    def stop_sent_ns(self, seq: int) -> int | None:
        num, at = self._stop_sent  # one tuple: the number and its time together
        return at if num >= seq else None

    def connected(self) -> bool:
        return self._running and self._no_status_run < self.error_after_lost

    # -- the cycle thread -----------------------------------------------------------------------------
    # A palm at rest with nothing to do (no demand armed, no queued control, config or CAN frame, no fault
    # pending) is stepped in batches: the thread sleeps IDLE_BATCH_NS, then runs every cycle it slept
    # through, each at its own release time (the same cycles, the same results, computed later), and a
    # snapshot catches up first, so what the MQTT side sees is current. A submitted message wakes the
    # thread at once: it catches up, then applies the message at the next release, at 1 kHz again.
    # Only the wake-ups are saved (they were most of the idle cost: `make run` idle 37 % of a core).
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    self._catch_up(time.monotonic_ns())
                    if time.monotonic_ns() >= self._deadline:
                        self._real_cycle()
                    self._batching = self._quiescent()
                    wait_until = self._deadline + (IDLE_BATCH_NS - self.period_ns if self._batching else 0)
                    rx = self.driver.take_can_rx()
                if rx:
                    self._rx.extend(rx)
                    self._rx_event.set()
                delay = wait_until - time.monotonic_ns()
                if delay > 0:
                    if self._batching:
                        self._wakeup.wait(delay / 1e9)  # submit() ends a batch at once
                        self._wakeup.clear()
                    else:
                        time.sleep(delay / 1e9)
        except Exception as exc:  # a bug in driver or model: stop cycling, say why (motors stop in 20 ms)
            self.error = f"cycle crashed: {type(exc).__name__}: {exc}"
            self._running = False
            raise

    def _quiescent(self) -> bool:
        """Nothing can change before the next message but time: safe to step in batches."""
        return (not self._stopped and self.lose_next == 0 and self._inbox.empty() and self.driver.idle
                and self.model.at_rest)

    def _catch_up(self, now: int) -> None:
        """Run the cycles of a batch that are due, each at its own release (the caller holds the lock).
        The last one due is left to the woken cycle, which applies messages and records its wake-up."""
        while self._batching and self._deadline + self.period_ns <= now:
            release = self._deadline
            self._step(release, apply_inbox=False)
            self._deadline = release + self.period_ns
            self._counts["cycles"] += 1
            self._counts["batched"] += 1

    def _real_cycle(self) -> None:
        wake = time.monotonic_ns()
        release = self._deadline
        self._step(wake, apply_inbox=True)
        now = time.monotonic_ns()
        self._deadline, skipped = next_deadline(release, wake, now, self.period_ns)
        c = self._counts
        c["cycles"] += 1
        c["overruns"] += skipped > 0
        self._wake[min(max(0, wake - release) // 1000, HIST_US)] += 1

    def _step(self, now_ns: int, apply_inbox: bool) -> None:
        """One cycle: messages (only at a woken release), driver, model, loss bookkeeping."""
        applied = False
        if apply_inbox:
            while not self._inbox.empty():
                self._inbox.get_nowait().apply(self.driver)
                applied = True
        command = self.driver.cycle(self._status, now_ns)
        status: bytes | None = self.model.exchange(command)
        if applied and self.driver.stop_seq != self._stop_sent[0]:  # a bus stop went out with this command
            self._stop_sent = (self.driver.stop_seq, time.monotonic_ns())
        if self.lose_next > 0:
            self.lose_next -= 1
            status = None
        self._status = status
        if status is not None:
            self._status_ns = now_ns  # its cycle's release: when the palm model answered
        self._no_status_run = self._no_status_run + 1 if status is None else 0
        if self._no_status_run == self.error_after_lost:
            self._counts["outages"] += 1
        if status is None:
            self._counts["no_status"] += 1
            self._counts["lost"] += 1

    def _pump_rx(self) -> None:
        while self._running or self._rx:
            self._rx_event.wait(0.5)
            self._rx_event.clear()
            batch: list[CanRxFrame] = []
            with contextlib.suppress(IndexError):
                while True:
                    batch.append(self._rx.popleft())
            if batch and self._rx_handler is not None:
                try:
                    self._rx_handler(batch)
                except Exception:  # the handler's bug must not kill the pump
                    log.exception("CAN rx handler failed")


def load_can_nodes(spec: str, model: PalmModel) -> list[CanNode]:
    """'module:factory' -> the CAN peers factory(model) makes (one, or a list)."""
    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
        made = factory(model)
    except Exception as exc:
        raise BackendUnavailable(f"CAN node factory {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    nodes = list(made) if isinstance(made, list | tuple) else [made]
    for n in nodes:
        if not callable(getattr(n, "on_can_frame", None)):
            raise BackendUnavailable(f"{spec!r} made {n!r}, which has no on_can_frame(bus, sid, data)")
    return nodes


def model_backend(settings: EthercatSettings, hooks: BackendHooks) -> ModelBackend:
    """Transport `ethercat-loop.model` (ROBOBUS_ETHERCAT_BACKEND=model; entry point `robobus.transports`): the
    driver against the palm model in this process, with the CAN peers ROBOBUS_ETHERCAT_CAN_NODES names."""
    calibration = hooks.calibration
    model = PalmModel(settings.ethercat_protocol, calibration=calibration)
    for spec in settings.ethercat_can_nodes:
        for peer in load_can_nodes(spec, model):
            model.add_can_node(peer)
    return ModelBackend(build_driver(settings, calibration), model, settings.ethercat_period_us * 1000,
                        settings.ethercat_serial, settings.ethercat_error_after_lost)
