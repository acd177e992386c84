"""Where the 1 kHz cycle runs: the `HandBackend` interface and the in-process backend.

`InProcessBackend` runs `PalmDriver` against `PalmModel` in one dedicated thread at absolute deadlines
(`make run` and most tests; it shares the GIL with MQTT, so it is not the realtime path). The realtime
path is `services.ethercat_loop.cycle.ProcessBackend`: the same interface with the cycle in its own
process driving pysoem against the virtual EtherCAT hand or a real NIC.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.cycle_rt import next_deadline
from services.ethercat_loop.driver import (
    DEFAULT_POLLING,
    CanRxFrame,
    ControlMessage,
    Halt,
    PalmDriver,
    PalmSnapshot,
    SetPolling,
    check_message,
)
from services.ethercat_loop.sim import CanNode, PalmModel
from shared.settings import KitSettings

log = logging.getLogger("robobus.ethercat")
CanRxHandler = Callable[[list[CanRxFrame]], None]
STOP_ZERO_CYCLES = 20  # zero-demand cycles sent before leaving OP


class HandBackend(ABC):
    """One palm's cycle, wherever it runs. All methods are called from non-realtime threads."""

    @abstractmethod
    def start(self) -> None:
        """Bring the palm to OP and start cycling (returns once cycling, or raises)."""

    @abstractmethod
    def stop(self) -> None:
        """Zero demands for a few cycles, then leave OP and stop. Idempotent."""

    @abstractmethod
    def submit(self, msg: ControlMessage) -> None:
        """Hand a control message to the driver; never blocks on the cycle."""

    @abstractmethod
    def snapshot(self) -> PalmSnapshot | None:
        """The latest driver snapshot (None before the first cycle)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Loop statistics of the last full 1 s window; keys as `LoopStatsWindow.result`."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Identity: vendor, product, revision, serial (None when unknown), protocol, backend, connected
        (palm found and in OP), state (short text), error (last fatal error text or "")."""

    @abstractmethod
    def on_can_rx(self, handler: CanRxHandler) -> None:
        """Call `handler(frames)` from a non-realtime thread with the bridge frames received since its
        last call (at most once per cycle)."""

    def stop_report(self) -> dict[str, Any]:
        """After stop(): what was sent before leaving OP (e.g. {"zero_demand_cycles": 20})."""
        return {}

    def connected(self) -> bool:
        """info()["connected"], cheap enough to ask on every command (backends may answer from state
        their own threads keep current)."""
        return bool(self.info().get("connected"))


class LoopStatsWindow:
    """Per-cycle timing folded into 1 s windows: period, wake-up jitter p50/p99/max, overruns, drops, lost."""

    def __init__(self, period_ns: int, window_ns: int = 1_000_000_000) -> None:
        self.period_ns = period_ns
        self.window_ns = window_ns
        self._start: int | None = None
        self._prev: int | None = None
        self._jitter: list[int] = []
        self._periods: list[int] = []
        self._overruns = 0
        self.total_overruns = 0
        self.total_cycles = 0
        self._result: dict[str, Any] = {}
        self._base_counts: dict[str, int] = {}

    def record(self, wake_ns: int, deadline_ns: int, overrun: bool, counters: dict[str, int]) -> None:
        if self._start is None:
            self._start = wake_ns
            self._base_counts = dict(counters)
        if self._prev is not None:
            self._periods.append(wake_ns - self._prev)
        self._prev = wake_ns
        self._jitter.append(max(0, wake_ns - deadline_ns))
        self.total_cycles += 1
        if overrun:
            self._overruns += 1
            self.total_overruns += 1
        if wake_ns - self._start >= self.window_ns:
            self._close(wake_ns, counters)

    def _close(self, now_ns: int, counters: dict[str, int]) -> None:
        j = sorted(self._jitter)
        periods = self._periods or [self.period_ns]

        def pct(p: float) -> float:
            return j[min(len(j) - 1, int(p * len(j)))] / 1000.0 if j else 0.0

        self._result = {
            "period_us": round(sum(periods) / len(periods) / 1000.0, 3),
            "target_period_us": self.period_ns / 1000.0,
            "cycles": len(self._jitter),
            "jitter_p50_us": round(pct(0.5), 1), "jitter_p99_us": round(pct(0.99), 1),
            "jitter_max_us": round(j[-1] / 1000.0, 1) if j else 0.0,
            "overruns": self._overruns,
            "drops": counters.get("dropped", 0) - self._base_counts.get("dropped", 0),
            "frames_lost": counters.get("lost", 0) - self._base_counts.get("lost", 0),
            "decode_errors": counters.get("decode_errors", 0) - self._base_counts.get("decode_errors", 0),
            "window_s": round((now_ns - (self._start or now_ns)) / 1e9, 3),
            "total_cycles": self.total_cycles, "total_overruns": self.total_overruns,
        }
        self._start, self._jitter, self._periods, self._overruns = now_ns, [], [], 0
        self._base_counts = dict(counters)

    def result(self) -> dict[str, Any]:
        return dict(self._result)


class InProcessBackend(HandBackend):
    """Driver + palm model in one dedicated thread, `period_ns` apart on absolute deadlines, with the
    wire backend's release rule (`cycle_rt.next_deadline`): an overrun snaps to the next period
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
        self._loop = LoopStatsWindow(period_ns)
        self._rx: deque[CanRxFrame] = deque(maxlen=65536)
        self._rx_event = threading.Event()
        self._rx_handler: CanRxHandler | None = None
        self._rx_thread: threading.Thread | None = None
        self._running = False
        self._stopped = False
        self._report: dict[str, Any] = {}
        self.lose_next = 0  # fault: the next n frames are lost (no status at all)
        self.error = ""

    # -- HandBackend ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
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

    def snapshot(self) -> PalmSnapshot | None:
        with self._lock:
            if self.driver.cycle_no == 0:
                return None
            return self.driver.snapshot()

    def stats(self) -> dict[str, Any]:
        """The last 1 s window, plus `health_error`: error_after_lost cycles in a row without a status."""
        return {**self._loop.result(), "health_error": self._no_status_run >= self.error_after_lost}

    def info(self) -> dict[str, Any]:
        return {"vendor": None, "product": self.driver.info.product_codes[0], "revision": 0, "serial": self.serial,
                "protocol": self.driver.protocol, "backend": "model", "connected": self._running,
                "state": "op" if self._running else "stopped", "error": self.error}

    def on_can_rx(self, handler: CanRxHandler) -> None:
        self._rx_handler = handler

    def connected(self) -> bool:
        return self._running

    # -- the cycle thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        status: bytes | None = None
        deadline = time.monotonic_ns()
        try:
            while not self._stop.is_set():
                wake = time.monotonic_ns()
                with self._lock:
                    while True:
                        try:
                            self.driver.apply(self._inbox.get_nowait())
                        except queue.Empty:
                            break
                    command = self.driver.cycle(status, wake)
                    status = self.model.exchange(command)
                    if self.lose_next > 0:
                        self.lose_next -= 1
                        status = None
                    self._no_status_run = self._no_status_run + 1 if status is None else 0
                    rx = self.driver.take_can_rx()
                    counters = self.driver.c
                now = time.monotonic_ns()
                release = deadline
                deadline, skipped = next_deadline(release, wake, now, self.period_ns)
                self._loop.record(wake, release, skipped > 0, counters)
                if rx:
                    self._rx.extend(rx)
                    self._rx_event.set()
                time.sleep(max(0.0, (deadline - time.monotonic_ns()) / 1e9))
        except Exception as exc:  # a bug in driver or model: stop cycling, say why (motors stop in 20 ms)
            self.error = f"cycle crashed: {type(exc).__name__}: {exc}"
            self._running = False
            raise

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


# ------------------------------------------------------------------------------------------- settings
class EthercatSettings(KitSettings):
    """ethercat-loop settings: ROBOBUS_ETHERCAT_* in the environment (or keys of ROBOBUS_CONFIG)."""

    backend: Literal["model", "virtual", "nic"] = Field(
        "model", validation_alias=AliasChoices("robobus_ethercat_backend", "ethercat_backend", "backend"),
        description="model: driver + palm model in-process; virtual: pysoem against the virtual EtherCAT hand; "
                    "nic: pysoem on a real NIC (ROBOBUS_ETHERCAT_BACKEND)")
    ethercat_protocol: Literal["0220", "0230"] = Field("0220", description="Palm protocol (model backend; the "
                                                       "wire backends take it from the product code)")
    ethercat_ifname: str = Field("", description="Network interface of the EtherCAT segment (virtual/nic)")
    ethercat_device: str = Field("rh", description="Device name on the bus (topic level 3)")
    ethercat_period_us: int = Field(1000, ge=100, le=100_000, description="Cycle period")
    ethercat_calibration: Path | None = Field(None, description="Calibration YAML (default: the shipped "
                                                                "example right hand)")
    ethercat_polling: dict[str, float] = Field(default_factory=dict, description="motor_data_polling overrides, "
                                               "e.g. {\"temperature\": 0.5}")
    ethercat_demand_timeout_ms: float = Field(100.0, ge=5, le=10_000, description="Deadman: a demand older "
                                              "than this is replaced by zero")
    ethercat_control_mode: Literal["torque", "pwm"] = Field("pwm", description="Control mode at start "
                                                            "(PWM, like sr_edc.launch)")
    ethercat_tactile_data_type: int = Field(0, ge=0, le=0xFFFFFFFF, description="tactile_data_type requested")
    ethercat_push_config_on_start: bool = Field(True, description="Send the default motor config at start")
    ethercat_drop_threshold: int = Field(10, ge=0, description="Dropped statuses (empty palm mailbox) per 1 s "
                                         "window above which health reports an error")
    ethercat_lost_threshold: int = Field(10, ge=0, description="Lost frames (no reply, or a wrong working "
                                         "counter) per 1 s window above which health reports an error; a "
                                         "single lost frame never does")
    ethercat_error_after_lost: int = Field(20, ge=1, description="Consecutive cycles without a valid status "
                                           "after which health reports an error (the motors cut out at 20 ms)")
    ethercat_overrun_threshold: int | None = Field(
        None, ge=0, description="Overruns per 1 s window above which health reports an error (default 10; 250 "
                                "for the model backend, whose thread shares the GIL with MQTT and is no realtime path)")
    ethercat_silent_motor_ms: int = Field(500, ge=10, description="A motor unseen this long is reported")
    ethercat_serial: int = Field(1234, description="Serial the palm model reports")
    ethercat_can_nodes: list[str] = Field(
        default_factory=list, description="Model backend: CAN peers to plug into the palm model's buses, as "
        "'module:factory'; factory(model) returns a CanNode or a list of them (e.g. PIC18F bootloader boards)")

    @field_validator("ethercat_polling")
    @classmethod
    def _polling(cls, v: dict[str, float]) -> dict[str, float]:
        err = check_message(SetPolling(v))
        if err:
            raise ValueError(err)
        return v


def overrun_threshold(settings: EthercatSettings) -> int:
    if settings.ethercat_overrun_threshold is not None:
        return settings.ethercat_overrun_threshold
    return 250 if settings.backend == "model" else 10


def build_driver(settings: EthercatSettings, protocol: str | None = None) -> PalmDriver:
    """The driver as the settings describe it (ProcessBackend builds its own in the cycle process)."""
    cal = HandCalibration.load(settings.ethercat_calibration)
    return PalmDriver(protocol or settings.ethercat_protocol, cal, {**DEFAULT_POLLING, **settings.ethercat_polling},
                      settings.ethercat_demand_timeout_ms, settings.ethercat_control_mode,
                      settings.ethercat_tactile_data_type)


class BackendUnavailable(RuntimeError):
    pass


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


def make_backend(settings: EthercatSettings) -> HandBackend:
    if settings.backend == "model":
        driver = build_driver(settings)
        model = PalmModel(settings.ethercat_protocol, calibration=driver.cal)
        for spec in settings.ethercat_can_nodes:
            for node in load_can_nodes(spec, model):
                model.add_can_node(node)
        return InProcessBackend(driver, model, settings.ethercat_period_us * 1000, settings.ethercat_serial,
                                settings.ethercat_error_after_lost)
    # imported late: it needs pysoem and the realtime machinery the model backend does not
    try:
        cls = getattr(importlib.import_module("services.ethercat_loop.cycle"), "ProcessBackend")  # noqa: B009
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"backend {settings.backend!r} needs services.ethercat_loop.cycle.ProcessBackend, "
                                 f"which cannot be imported here: {exc}") from exc
    backend = cls(settings)
    if not isinstance(backend, HandBackend):
        raise BackendUnavailable(f"{cls!r} does not implement HandBackend")
    return backend
