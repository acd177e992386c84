"""The palm's health for the kit's link supervisor (docs/kit.md, "Health"), off the cycle.

`PalmHealth` feeds the supervisor from what this process reads of the cycle (the count of valid statuses, when the
newest arrived, the cycle process's starts, deaths and exits), never from the cycle itself, and says the palm's
finer state, its faults and the details. What it judges is pure (no I/O, no clock: times passed in):
`LossJudge` (lost frames, wrong working counters, overruns, dropped statuses: a warning for a second, a problem
when sustained), `MotorWatch` (serious motor flags, silent motors), `health_details` and `realtime_details`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from services.ethercat_loop.api import MOTOR_FAULT
from services.ethercat_loop.backend import HandBackend
from services.ethercat_loop.models import EthercatLoopStats, PalmMotorFault
from services.ethercat_loop.protocol import EdcCommand, MotorFlag, serious_flags
from services.ethercat_loop.settings import EthercatSettings, overrun_threshold
from services.ethercat_loop.snapshot import PalmMotorSnapshot, PalmSnapshot
from shared import Device
from shared.link import LinkState, SupervisedLink

RECOVERY_STEPS_SHOWN = 12
DIRECT_QUIET_S = 1.0  # after CAN direct mode, the motors' no-demand flag is expected this long


class LossJudge:
    """(problems, warnings) of a link that delivers valid data: what the palm's `operational` and the health
    message say. Whether data flow at all is the link supervisor's (`silent` past the liveness budget), and
    `error` is for faults the palm reports (docs/kit.md, "Health"). Per 1 s window, counts above their
    thresholds (lost frames, wrong working counters, overruns, dropped statuses) are a warning; sustained for
    `ethercat_loss_sustain_s` they are a problem: not operational, the message names each. A healthy link on
    a loaded host loses a burst of frames to a scheduling stall now and then, and health that flips for that
    one second is an alarm nobody can act on. An outage shorter than the budget (20 cycles or more without a
    valid status, the motors' cut-out) is a warning for its window."""

    def __init__(self, settings: EthercatSettings) -> None:
        self.settings = settings
        self.bad_since: float | None = None  # since when a 1 s window's counts are over their thresholds

    def judge(self, stats: EthercatLoopStats, now: float) -> tuple[list[str], list[str]]:
        s = self.settings
        warnings: list[str] = []
        if stats.outages:
            warnings.append(f"warning: {stats.outages} outage(s) of {s.ethercat_error_after_lost} cycles or more "
                            "without valid process data in the last second")
        rates: list[str] = []
        lost = stats.frames_lost
        if lost > s.ethercat_lost_threshold:
            rates.append(f"{lost} frames lost in the last second (threshold {s.ethercat_lost_threshold})")
        wkc = stats.wkc_errors
        if wkc > s.ethercat_lost_threshold:
            rates.append(f"{wkc} frames with a wrong working counter in the last second "
                         f"(threshold {s.ethercat_lost_threshold})")
        overruns, limit = stats.overruns, overrun_threshold(s)
        if overruns > limit:
            rates.append(f"{overruns} overruns in the last second (threshold {limit})")
        drops = stats.drops
        if drops > s.ethercat_drop_threshold:
            rates.append(f"{drops} dropped statuses in the last second (threshold {s.ethercat_drop_threshold})")
        if not rates:
            self.bad_since = None
            return [], warnings
        if self.bad_since is None:
            self.bad_since = now
        lasted = now - self.bad_since
        if lasted >= s.ethercat_loss_sustain_s:
            return [f"{r}, for {lasted:.0f} s" for r in rates], warnings
        return [], [f"warning: {r}" for r in rates] + warnings


class MotorWatch:
    """The faults the palm reports: serious motor flags (each new one an event) and motors that do not answer."""

    def __init__(self, silent_motor_ms: int) -> None:
        self.silent_ns = silent_motor_ms * 1_000_000
        self._known: dict[int, int] = {}  # motor -> the serious flags last reported
        self._direct_until = 0.0  # ignore no-demand flags until then (CAN direct mode just ended)

    def judge(self, s: PalmSnapshot, now: float, heard_since: float
              ) -> tuple[list[str], list[tuple[PalmMotorSnapshot, list[str]]]]:
        """(faults, new): every fault as the health message says it, and the motors whose serious flags are new
        since the last look (with their names). `heard_since`: valid data flow since then; after an outage every
        motor was unseen for its length, so silence counts once data have flowed that long."""
        direct = s.can_direct
        if direct:
            self._direct_until = now + DIRECT_QUIET_S
        quiet_flags = MotorFlag.NO_DEMAND_SEEN if now < self._direct_until else 0
        judge_silence = now - heard_since > self.silent_ns / 1e9
        faults: list[str] = []
        new: list[tuple[PalmMotorSnapshot, list[str]]] = []
        for m in s.motors:
            flags = (m.flags or 0) & ~quiet_flags
            bad = serious_flags(flags)
            if bad:
                faults.append(f"motor {m.id} ({m.joint}): {', '.join(bad)}")
                if self._known.get(m.id) != flags:
                    new.append((m, bad))
            self._known[m.id] = flags if bad else 0
            if (judge_silence and not direct and s.phase == "operation" and
                    (m.last_seen_ns is None or s.now_ns - m.last_seen_ns > self.silent_ns) and s.cycle > 1000):
                faults.append(f"motor {m.id} ({m.joint}) not answering")
        return faults, new


def palm_state(s: PalmSnapshot, info: dict[str, Any]) -> str:
    """The palm's finer state while valid data flow."""
    if info.get("issue"):
        return "slave_recovery"  # data flow, but a slave is being brought back
    if s.can_direct:
        return "can_direct"
    if s.edc_command != EdcCommand.SENSOR_DATA:
        return "test_mode"
    return "initializing" if s.phase == "init" else "running"


def realtime_details(info: dict[str, Any], stats: EthercatLoopStats) -> dict[str, Any] | None:
    """The cycle's scheduling and the realtime settings it was refused (None: the backend has no
    realtime cycle to report on, e.g. the in-process model)."""
    rt = stats.realtime
    if not isinstance(rt, dict) and "warnings" not in info:
        return None
    rt = rt if isinstance(rt, dict) else {}
    warnings = [str(w) for w in rt.get("warnings") or []]
    warnings += [str(w) for w in info.get("warnings") or [] if str(w) not in warnings]
    return {"policy": rt.get("policy") or info.get("realtime_policy") or "", "warnings": warnings}


def health_details(info: dict[str, Any], stats: EthercatLoopStats, now_ns: int) -> dict[str, Any]:
    """The details beside the kit's `details.link`: identity, the bus as the cycle sees it (the cycle's state,
    what recovery works on, stale replies since start), restarts of the cycle process, the recovery's steps."""
    details = {k: info.get(k) for k in ("vendor", "product", "revision", "serial", "protocol", "backend")}
    bus: dict[str, Any] = {"cycle": str(info.get("state", "")), "issue": info.get("issue") or ""}
    totals = stats.totals or {}
    if "stale" in totals:  # wire backends: replies dropped as not belonging to the frame just sent (since start)
        bus["stale_replies"] = int(totals["stale"])
    details["bus"] = bus
    if "restarts" in info:  # wire backends: cycle processes started again after one died
        details["restarts"] = int(info["restarts"])
        if info.get("last_exit"):
            details["last_exit"] = str(info["last_exit"])
    recovery = info.get("recovery")
    if recovery:
        details["recovery"] = {
            **{k: recovery.get(k, 0) for k in ("escalations", "escalation_failures", "rescans", "recoveries")},
            "steps": [{"ago_s": round((now_ns - int(t)) / 1e9, 3), "step": str(text)}
                      for t, text in recovery.get("steps", [])[-RECOVERY_STEPS_SHOWN:]]}
    return details


class BackendLink:
    """The link events as the backend reports them, to the kit's supervisor; only the fault is kept apart: the
    backend's (a device of the wrong kind) and the service's (motor faults the palm reports) are one `error`,
    set and cleared by `PalmHealth.apply_fault`."""

    def __init__(self, link: SupervisedLink, apply_fault: Callable[[str], None]) -> None:
        self._apply_fault = apply_fault
        self.attempt, self.opened, self.failed, self.closed = link.attempt, link.opened, link.failed, link.closed
        self.garbage, self.recovering, self.recovered = link.garbage, link.recovering, link.recovered
        self.next_attempt_in = link.next_attempt_in

    def fault(self, message: str) -> None:
        self._apply_fault(message)

    def clear_fault(self) -> None:
        self._apply_fault("")


class PalmHealth:
    """The palm's view for the link supervisor, which owns connection, state and error (docs/kit.md). Checked by
    the publisher thread and, last, closed by shutdown: the final `stopped` must not be overwritten by a check
    that was under way, and it keeps the last details with the link marked down."""

    def __init__(self, settings: EthercatSettings, backend: HandBackend, dev: Device, link: SupervisedLink) -> None:
        self.settings = settings
        self.backend = backend
        self.dev = dev
        self.link = link
        self.loss = LossJudge(settings)
        self.motors = MotorWatch(settings.ethercat_silent_motor_ms)
        self._lock = threading.Lock()
        self._final = False
        self._last_details: dict[str, Any] = {}
        self._fault_lock = threading.Lock()
        self._kind_fault = ""  # the backend's: not the palm configured
        self._device_faults = ""  # the palm's: serious motor flags, silent motors
        self._statuses_seen = backend.last_valid_status()[0]
        self._heard_since = time.monotonic()  # valid data flow since (a motor is judged silent only after that)
        # liveness is judged on when the newest valid status arrived (the cycle's own stamp), read again by the
        # node's deadline thread before it judges: a publisher held up on a loaded host is not a silent palm
        link.watch(self.arrival)
        backend.attach_link(BackendLink(link, lambda kind: self.apply_fault(kind=kind)))

    # -- liveness -----------------------------------------------------------------------------------
    def feed_link(self) -> None:
        """Valid process data seen since the last look (the cycle's count of valid statuses moved): the link's
        liveness, with the time the newest of them arrived (the cycle's stamp, not this look's: a look held up
        past the budget must not pass off old data as live). Every tick of the publisher (10 ms at the default
        joints rate), off the cycle."""
        n, at = self.backend.last_valid_status()
        if n != self._statuses_seen:
            self._statuses_seen = n
            now = time.monotonic()
            fresh = at is None or now - at <= self.settings.ethercat_liveness_s
            if fresh and self.link.state is not LinkState.OPERATIONAL:
                # the palm is heard from again: its identity, finer state and faults before `connection` flips
                self._heard_since = now
                self.check(self.backend.snapshot(), arriving=True)
            self.link.data(at=at)

    def arrival(self) -> float | None:
        """The link's source (docs/kit.md, SupervisedLink.watch), on the node's deadline thread: when the newest valid
        status arrived, while the palm is operational. Coming back is the publisher's (`feed_link`), which sets
        the palm's finer state and faults first."""
        if self.link.state is not LinkState.OPERATIONAL:
            return None
        return self.backend.last_valid_status()[1]

    # -- the check ----------------------------------------------------------------------------------
    def check(self, s: PalmSnapshot | None, arriving: bool = False) -> None:
        with self._lock:
            if not self._final:
                self._check_locked(s, arriving)

    def _check_locked(self, s: PalmSnapshot | None, arriving: bool) -> None:
        """While valid data flow, the finer state (initializing, running, ...) and whether the palm can work; the
        faults it reports (serious motor flags, silent motors) as the device's fault; and the details (identity,
        the bus, recovery, realtime, restarts)."""
        info = self.backend.info()
        stats = self.backend.stats()
        now = time.monotonic()
        problems, warnings = self.loss.judge(stats, now)
        realtime = realtime_details(info, stats)
        valid = arriving or self.link.state is LinkState.OPERATIONAL
        name = "starting"  # valid data, no snapshot yet
        faults: list[str] = []
        if s is not None and valid:
            faults, new = self.motors.judge(s, now, self._heard_since)
            for m, bad in new:
                self.dev.emit(MOTOR_FAULT, PalmMotorFault(ts=time.time(), motor=m.id, joint=m.joint,
                                                          flags=m.flags or 0, serious=bad))
            name = palm_state(s, info)
        details = health_details(info, stats, time.monotonic_ns())
        # refused realtime settings are warnings: in details and the message, never an error by themselves
        warnings += [f"warning: {w}" for w in realtime["warnings"]] if realtime else []
        if realtime is not None:
            details["realtime"] = realtime
        self._last_details = details
        self.dev.set_health(details=details)
        if valid:  # the palm's view, as last seen while it was heard from
            self.apply_fault(device="; ".join(faults[:6]))
            ready = s is not None and s.phase == "operation" and not s.can_direct and not problems
            self.link.device_state(name, operational=ready, message="; ".join(problems[:6] + warnings))

    def apply_fault(self, kind: str | None = None, device: str | None = None) -> None:
        """The one `error` of the device: a palm of the wrong kind (the backend) and the faults the palm reports
        (the check), together."""
        with self._fault_lock:
            if kind is not None:
                self._kind_fault = kind
            if device is not None:
                self._device_faults = device
            if self._final:
                return
            text = "; ".join(t for t in (self._kind_fault, self._device_faults) if t)
            if text:
                self.link.fault(text)
            else:
                self.link.clear_fault()

    def close(self, why: str) -> None:
        """The last word, on shutdown: the last details with the bus marked stopped, no fault, the link stopped
        (connection false, no valid data: the kit's details.link says so), whatever the last check saw."""
        with self._lock, self._fault_lock:
            self._final = True
            details = dict(self._last_details)
            details["bus"] = {**details.get("bus", {}), "issue": "stopped"}
            self.dev.set_health(details=details)
            self.link.clear_fault()
            self.link.stop(why)


__all__ = ["BackendLink", "LossJudge", "MotorWatch", "PalmHealth", "health_details", "palm_state",
           "realtime_details"]
