"""Where the 1 kHz cycle runs: the `HandBackend` interface the MQTT surface talks to.

Two implementations: `model_backend.ModelBackend` (driver + palm model in one thread of the MQTT
process: `make run` and fast tests) and `transport.ProcessBackend` (the realtime cycle in its own
process, pysoem against the virtual EtherCAT hand or a real NIC). `service.build` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import CanRxFrame, ControlMessage
from services.ethercat_loop.driver import DEFAULT_POLLING, PalmDriver
from services.ethercat_loop.models import EthercatLoopStats
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.snapshot import PalmSnapshot

CanRxHandler = Callable[[list[CanRxFrame]], None]
STOP_ZERO_CYCLES = 20  # zero-demand cycles sent before leaving OP


class BackendUnavailable(RuntimeError):
    """The configured backend cannot run here (missing privileges, no NIC, no palm)."""


def build_driver(settings: EthercatSettings, calibration: HandCalibration, protocol: str | None = None) -> PalmDriver:
    """The driver as the settings describe it (the wire backends build theirs in the cycle process)."""
    return PalmDriver(protocol or settings.ethercat_protocol, calibration,
                      {**DEFAULT_POLLING, **settings.ethercat_polling}, settings.ethercat_demand_timeout_ms,
                      settings.ethercat_control_mode, settings.ethercat_tactile_data_type)


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
    def snapshot(self, motors: bool = True) -> PalmSnapshot | None:
        """The latest driver snapshot (None before the first cycle). `motors=False`: the caller needs no
        motor (its `motors` may be empty): the joints state at 100 Hz, which a backend may serve cheaper."""

    @abstractmethod
    def stats(self) -> EthercatLoopStats:
        """Loop statistics of the last full 1 s window (`loop_stats.LoopWindow`), without `counters`."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Identity: vendor, product, revision, serial (None when unknown), protocol, backend; and the link:
        connected (valid process data are being exchanged: not merely "the slaves say OP"), state (one of
        the states listed in the README), error (fatal or persistent error text, or ""), no_data (no valid
        status for `error_after_lost` cycles), issue (what the recovery is working on, or "") and
        recovery (its steps, for health details)."""

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


