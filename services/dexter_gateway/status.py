"""An arm's status and health: the newest status any reply brought, DexRun's error flags as the arm's fault, the
link's counters beside the kit's `details.link`, and `state/status` at DEXTER_STATUS_HZ (a `g` polled only when
nothing else brought a status within the period).

`StatusBook` is the bookkeeping, pure (no I/O, no clock: every time is passed in, wall-clock seconds);
`ArmStatus` feeds it the link's replies and does the publishing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.dexter_gateway import protocol as p
from services.dexter_gateway.api import STATUS
from services.dexter_gateway.link import ArmLink, DexterLinkError, LinkReply
from services.dexter_gateway.models import DexterArmConfig, DexterStatus
from services.dexter_gateway.protocol import Firmware, ProtocolError
from services.dexter_gateway.replies import status_model
from services.dexter_gateway.settings import DexterSettings
from shared import Device
from shared.link import SupervisedLink

Latest = tuple[p.Reply, str, float]  # a standard-status reply, the status mode it was read in, its time


class StatusBook:
    """The newest status (every reply but `r` carries one), the one last published, and DexRun's error flags."""

    def __init__(self, firmware: Firmware) -> None:
        self.newest_firmware = firmware is Firmware.NEWEST
        self.mode = "0"  # the status mode the arm was last set to (newest only; `g` alone resets it)
        self.latest: Latest | None = None
        self.published = -1  # the instruction id of the status last published
        self.flags: tuple[str, ...] = ()
        self._error_value = 0  # the error word last decoded into flags

    def seen(self, lr: LinkReply, ts: float) -> bool:
        """A reply the link read, at `ts`: whether DexRun's error flags changed with it."""
        rep = lr.reply
        if rep.oplet == "r":
            return False  # not a status
        mode = self.mode if self.newest_firmware else "0"
        if lr.request.oplet == "g":
            mode = lr.request.args[0][0] if lr.request.args and self.newest_firmware else "0"
        self.latest = (rep, mode, ts)
        if rep.error == self._error_value:
            return False  # the same error word as before (every block of a write): nothing new for health
        self._error_value = rep.error
        flags = p.decode_error(rep.error).flags
        if flags == self.flags:
            return False
        self.flags = flags
        return True

    def fresh(self, now: float, period: float) -> bool:
        """Whether a status not yet published arrived within the last period (then no poll is needed)."""
        latest = self.latest
        return latest is not None and now - latest[2] < period and latest[0].instruction_id != self.published

    def take(self) -> Latest | None:
        """The newest status if it is not published yet (marked published), else None."""
        latest = self.latest
        if latest is None or latest[0].instruction_id == self.published:
            return None
        self.published = latest[0].instruction_id
        return latest

    def g_args(self) -> Sequence[str]:
        # newest: `g` without an argument resets the status mode to '0', so polls repeat the current mode
        return (self.mode,) if self.newest_firmware and self.mode != "0" else ()


class ArmStatus:
    """Publishes an arm's `state/status` and the details of its health; its fault goes to the kit's supervisor."""

    def __init__(self, cfg: DexterArmConfig, settings: DexterSettings, firmware: Firmware, dev: Device,
                 sup: SupervisedLink) -> None:
        self.cfg = cfg
        self.settings = settings
        self.dev = dev
        self.sup = sup
        self.book = StatusBook(firmware)
        self._fault = ""  # what the arm's health reports as its fault (`apply_fault`)
        self._fault_lock = threading.Lock()  # replies arrive on several threads
        self._link: ArmLink | None = None
        self._transferring: Callable[[], bool] = lambda: False

    def attach(self, link: ArmLink, transferring: Callable[[], bool]) -> None:
        """The link it reads counters from and polls, once made; `transferring`: a file job holds the link."""
        self._link = link
        self._transferring = transferring

    @property
    def link(self) -> ArmLink:
        assert self._link is not None, "ArmStatus.attach comes before the link runs"
        return self._link

    # -- the link's hooks ---------------------------------------------------------------------------
    def on_reply(self, lr: LinkReply) -> None:
        if self.book.seen(lr, time.time()):
            self.apply_fault()

    def apply_fault(self) -> None:
        """The arm's fault for the kit's supervisor (`error`, and what `error_message` says): DexRun's error
        flags in its replies (a servo, the monitor, a firmware/gateware mismatch), or a configuration that cannot
        work (a host name that does not resolve). Never an absent or silent arm: the supervisor counts failed
        attempts and says `connecting` / `lost` / `unreachable` / `silent` without an error."""
        parts = ([self.link.config_fault] if self.link.config_fault else []) + [p.FLAG_TEXT[f] for f in self.book.flags]
        fault = "; ".join(parts)
        with self._fault_lock:
            if fault == self._fault:
                return
            self._fault = fault
            if fault:
                self.sup.fault(fault)
            else:
                self.sup.clear_fault()

    # -- health details -----------------------------------------------------------------------------
    def static_details(self) -> dict[str, Any]:
        return {"host": self.cfg.host, "port": self.cfg.port, "firmware": self.cfg.firmware.value,
                "status_mode": self.book.mode}

    def details(self) -> dict[str, Any]:
        """The link's own counters beside the kit's `details.link` (attempts, failures, states, budget)."""
        s = self.link.stats
        d = self.static_details()
        d.update(rtt_last_ms=s.rtt_last_ms, rtt_avg_ms=s.rtt_avg_ms, rtt_max_ms=s.rtt_max_ms,
                 reconnects=s.reconnects, timeouts=s.timeouts, out_of_step=s.out_of_step,
                 stale_replies=s.stale_replies, commands=s.commands, keepalives=s.keepalives,
                 busy_refusals=s.busy, stopped_requests=s.stopped, queued=self.link.queued)
        return d

    def publish_details(self) -> None:
        self.dev.set_health(details=self.details())  # published when changed; the kit's heartbeat besides

    # -- the publishers (one thread each) -----------------------------------------------------------
    def health_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.health_interval_s):
            self.publish_details()

    def status_loop(self, stop: threading.Event) -> None:
        """Publish the newest status at the configured rate; poll `g` only when nothing else brought one."""
        hz = self.settings.dexter_status_hz
        if hz <= 0:
            return
        period = 1.0 / hz
        book, link = self.book, self.link
        while not stop.wait(period):
            # a file job holds the link for its whole run and lets a queued `g` in between two blocks (reads bring
            # no status of their own); otherwise only an idle link is polled (commands' replies are status)
            if not book.fresh(time.time(), period) and link.serving and (not link.busy or self._transferring()):
                with contextlib.suppress(DexterLinkError, ProtocolError):
                    link.request("g", book.g_args())
            latest = book.take()
            if latest is not None:
                self.dev.publish(STATUS, self.status(latest))

    def status(self, latest: Latest) -> DexterStatus:
        rep, mode, ts = latest
        return status_model(rep, mode, self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units, ts)


__all__ = ["ArmStatus", "Latest", "StatusBook"]
