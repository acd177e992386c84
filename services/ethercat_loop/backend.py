"""Where the 1 kHz cycle runs: the `HandBackend` interface the MQTT surface talks to.

Two implementations: `model_backend.ModelBackend` (driver + palm model in one thread of the MQTT
process: `make run` and fast tests) and `transport.ProcessBackend` (the realtime cycle in its own
process, pysoem against the virtual EtherCAT hand or a real NIC). `service.build` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import CanRxFrame, ControlMessage
from services.ethercat_loop.driver import DEFAULT_POLLING, PalmDriver
from services.ethercat_loop.models import EthercatLoopStats
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.snapshot import PalmSnapshot

CanRxHandler = Callable[[list[CanRxFrame]], None]
STOP_ZERO_CYCLES = 20  # zero-demand cycles sent before leaving OP


class BackendUnavailable(RuntimeError):
    """The configured backend cannot run here (missing privileges, no NIC, no palm). `kind`: "absent" (no palm
    answers, or no NIC), "garbage" (frames arrived, none a slave's answer), "wrong_kind" (not the palm
    configured), "" (anything else); `garbage`: how many such frames."""

    def __init__(self, message: str, kind: str = "", garbage: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.garbage = garbage


class LinkEvents(Protocol):
    """What a backend reports of its link: the kit's `SupervisedLink` (shared/link.py), which owns the states,
    the back-off and the liveness deadline (docs/kit.md, "Health"). A backend never decides health itself."""

    def attempt(self) -> None: ...
    def opened(self) -> None: ...
    def failed(self, reason: str) -> None: ...
    def closed(self, reason: str) -> None: ...
    def garbage(self, what: str) -> None: ...
    def fault(self, message: str) -> None: ...
    def clear_fault(self) -> None: ...
    def recovering(self, reason: str) -> None: ...
    def recovered(self) -> None: ...
    def next_attempt_in(self) -> float: ...


@dataclass(frozen=True)
class BackendHooks:
    """What the service gives a backend's factory (the kit's one signature, `factory(settings, hooks)`): the
    hand's calibration, loaded once."""

    calibration: HandCalibration


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

    def attach_link(self, link: LinkEvents) -> None:
        """Report the link's events to `link` from now on, and let `start()` return at once: the backend then
        (re)connects on the link's back-off instead of failing when no palm answers. Call before start()."""
        self.link = link

    link: LinkEvents | None = None

    @abstractmethod
    def valid_statuses(self) -> int:
        """A count that moves with every valid status received (the service feeds the link supervisor from it,
        off the cycle); cheap: no decoding, no lock the cycle takes."""

    def last_valid_status(self) -> tuple[int, float | None]:
        """(`valid_statuses()`, when the newest valid status arrived: time.monotonic() seconds, None when unknown).
        The service judges the palm's liveness on that arrival, not on when it looked. Cheap, like valid_statuses."""
        return self.valid_statuses(), None

    def stop_sent_ns(self, seq: int) -> int | None:
        """When the first frame built after bus stop number `seq` (control.BusStop, or a later one) left for the
        palm (CLOCK_MONOTONIC ns); None while it has not. Cheap: the service asks until it has."""
        return None

    def connected(self) -> bool:
        """info()["connected"], cheap enough to ask on every command (backends may answer from state
        their own threads keep current)."""
        return bool(self.info().get("connected"))


