"""Link supervision: one state machine per device link, and the one meaning of the health fields.

Pure (h11 style): the transport reports what happened (`attempt`, `opened`, `failed`, `data`, `closed`,
`fault`, ...) with the time it happened, and asks `tick(now)` when a deadline may have passed; the machine
answers with its state, the health fields that state means, and when to try connecting again. No I/O, no
clock, no thread: the same machine runs inside an asyncio gateway, a thread, or a test with made-up times.

States (docs/kit.md, "Health: one meaning in every service"):

    connecting   -> trying to reach a device not heard from yet; budget not yet passed
    unreachable  -> never heard from within the budget: one probe per probe period from then on
    connected    -> the link is open; no valid data yet (connection stays false until data comes)
    operational  -> valid data within the liveness budget
    silent       -> the link is open but no valid data within the budget (a hung or muted device)
    lost         -> the link closed or failed after the device had been heard from; reconnecting
    error        -> the device reports a fault, or is not the kind configured (an overlay: see `fault`)
    recovering   -> a helper process of the link is being restarted
    stopped      -> the service has stopped the link for good

`connection` is true only in `operational` (valid data within the budget); a failed reconnect attempt is
counted in `details`, never an `error`; `error` is true only while a fault is reported, and says how.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class LinkState(enum.StrEnum):
    CONNECTING = "connecting"
    UNREACHABLE = "unreachable"
    CONNECTED = "connected"
    OPERATIONAL = "operational"
    SILENT = "silent"
    LOST = "lost"
    ERROR = "error"
    RECOVERING = "recovering"
    STOPPED = "stopped"


@dataclass(frozen=True)
class LinkPolicy:
    """A device's liveness budget and its reconnect rhythm."""

    liveness_s: float                  # valid data must arrive within this, or the device is silent/unreachable
    backoff_min_s: float = 0.2         # first wait after a failed attempt or a lost link
    backoff_max_s: float = 5.0         # cap of the doubling waits
    probe_period_s: float = 5.0        # an unreachable device: one attempt per period (never the full ladder)
    good_session_s: float | None = None  # a session operational this long resets the backoff (None: budget)

    def __post_init__(self) -> None:
        if self.liveness_s <= 0 or self.backoff_min_s <= 0 or self.backoff_max_s < self.backoff_min_s:
            raise ValueError(f"invalid link policy {self}")
        if self.probe_period_s <= 0:
            raise ValueError("probe_period_s must be > 0")


@dataclass
class LinkCounters:
    attempts: int = 0
    failures: int = 0          # attempts that failed, and sessions that ended
    sessions: int = 0          # times the link opened
    silences: int = 0          # times the device went silent with the link open
    garbage: int = 0           # invalid data received (counted, never refreshes liveness)
    restarts: int = 0          # helper process restarts (`recovering`)
    last_failure: str = ""


@dataclass
class LinkSupervisor:
    """The state of one device link. Every method takes `now` (monotonic seconds)."""

    policy: LinkPolicy
    now: float
    state: LinkState = LinkState.CONNECTING
    counters: LinkCounters = field(default_factory=LinkCounters)
    _since: float = 0.0                 # entered the current state
    _absent_since: float | None = None  # no link and no valid data since (the first attempt, or the loss)
    _heard: bool = False                # valid data ever seen (lost vs unreachable)
    _last_data: float | None = None
    _opened_at: float | None = None
    _operational_at: float | None = None
    _backoff: float = 0.0
    _next_attempt: float = 0.0
    _fault: str = ""
    _message: str = ""
    # the message as a function of the time it is read: an age it states is the age when published, not when the
    # state was entered ("no valid data for 0.3 s" repeated by every heartbeat of a 12 s cut)
    _render: Callable[[float], str] | None = None
    _time_in: dict[str, float] = field(default_factory=dict)
    _device_state: str | None = None     # the service's finer name while operational ("streaming")
    _device_operational: bool = True     # the service may say a reachable device cannot work (blank state)
    _device_message: str = ""
    _quiet_until: float | None = None    # an exchange answered only when done: no data expected before this

    def __post_init__(self) -> None:
        self._since = self.now
        self._next_attempt = self.now
        self._backoff = self.policy.backoff_min_s

    # -- what the transport reports ------------------------------------------------------------
    def attempt(self, now: float) -> None:
        """A connect (or probe) attempt starts."""
        self.counters.attempts += 1
        if self._absent_since is None and self.state is not LinkState.CONNECTED:
            self._absent_since = now
        self.tick(now)

    def opened(self, now: float) -> None:
        """The link is open (TCP connected, socket bound, port open); data has not been seen yet."""
        self.counters.sessions += 1
        self._opened_at = now
        # operational already: the device's data came before the transport said the link was open (a helper
        # process that streams as soon as it is up); they prove it open, and health must not flicker back
        if self.state not in (LinkState.STOPPED, LinkState.OPERATIONAL):
            self._enter(LinkState.CONNECTED, now, "link open; waiting for the device's first valid data")
        self.tick(now)

    def failed(self, now: float, reason: str) -> None:
        """An attempt failed (refused, timed out, no answer to the probe). Counted, never an error."""
        self.counters.failures += 1
        self.counters.last_failure = reason
        self._schedule_retry(now)
        if self.state in (LinkState.STOPPED, LinkState.RECOVERING):
            return
        if self._absent_since is None:
            self._absent_since = now
        if self.state is LinkState.UNREACHABLE:
            self._enter(LinkState.UNREACHABLE, now, render=self._unreachable_message)
        elif self._heard:
            self._enter(LinkState.LOST, now, f"link lost: {reason}; reconnecting")
        else:
            self._enter(LinkState.CONNECTING, now, f"not reached yet: {reason}")
        self.tick(now)

    def closed(self, now: float, reason: str) -> None:
        """An open link closed (peer closed, reset, read error)."""
        self._opened_at = None
        self._last_data = None
        self.failed(now, reason)

    def data(self, now: float, at: float | None = None) -> None:
        """Valid data arrived from the device: at `now`, or at `at` when they were seen first elsewhere (a helper
        process's own stamp) and reported later. The liveness budget counts from their arrival: data older than
        the budget prove the device was heard from, not that it is alive now."""
        t = now if at is None else min(at, now)
        if at is None or self._last_data is None or t > self._last_data:
            self._last_data = t
        self._heard = True
        if self.state in (LinkState.STOPPED, LinkState.RECOVERING):
            return
        if now - t > self.policy.liveness_s:
            self.tick(now)
            return
        self._absent_since = None
        self._quiet_until = None
        if self.state is not LinkState.OPERATIONAL:
            self._operational_at = t
            self._enter(LinkState.OPERATIONAL, now, "")
        good = self.policy.good_session_s if self.policy.good_session_s is not None else self.policy.liveness_s
        if self._operational_at is not None and t - self._operational_at >= good:
            self._backoff = self.policy.backoff_min_s  # a good session: the next loss retries quickly

    def set_budget(self, now: float, seconds: float) -> None:
        """Change the liveness budget from `now` on, for a device whose allowed silence follows what it was
        asked to send (an e-puck2's image interval). A deadline already counting is judged by the new budget,
        and the messages say the budget applied."""
        if seconds <= 0:
            raise ValueError(f"liveness budget must be > 0, got {seconds}")
        if seconds != self.policy.liveness_s:
            self.policy = dataclasses.replace(self.policy, liveness_s=seconds)
        self.tick(now)

    def expect_silence(self, now: float, seconds: float) -> None:
        """An exchange the device answers only when it is done (a Dexter's `F`: when its moves have ended): no data
        is owed before `now + seconds`, so the liveness budget counts from then, until the next valid data."""
        until = now + seconds
        if self._quiet_until is None or until > self._quiet_until:
            self._quiet_until = until

    def garbage(self, now: float, what: str) -> None:
        """Invalid data: counted; it does not prove the device alive."""
        self.counters.garbage += 1
        self.tick(now)

    def fault(self, message: str) -> None:
        """The device reports a fault, or is not the kind configured: `error` until `clear_fault`."""
        self._fault = message

    def clear_fault(self) -> None:
        self._fault = ""

    def device_state(self, name: str | None, *, operational: bool = True, message: str = "") -> None:
        """The service's own view while the link is operational: a finer state name, and whether the device
        can do its job (a reachable ROI module in blank state cannot)."""
        self._device_state = name
        self._device_operational = operational
        self._device_message = message

    def recovering(self, now: float, reason: str) -> None:
        """A helper process of the link died and is being restarted."""
        self.counters.restarts += 1
        self._last_data = None
        self._enter(LinkState.RECOVERING, now, f"restarting: {reason}")

    def recovered(self, now: float) -> None:
        """The helper process runs again: back to waiting for valid data."""
        if self.state is LinkState.RECOVERING:
            self._enter(LinkState.CONNECTED, now, "restarted; waiting for valid data")

    def stop(self, now: float, reason: str = "stopped") -> None:
        self._last_data = None
        self._opened_at = None
        self._enter(LinkState.STOPPED, now, reason)

    # -- deadlines ---------------------------------------------------------------------------------
    def tick(self, now: float) -> LinkState:
        """Apply the deadlines that have passed by `now`; returns the state."""
        budget = self.policy.liveness_s
        st = self.state
        if (st is LinkState.OPERATIONAL and self._last_data is not None
                and now - max(self._last_data, self._quiet_until or 0.0) > budget):
            self.counters.silences += 1
            owed = "" if self._quiet_until is None else " after an exchange answered when done"
            last = self._last_data
            self._enter(LinkState.SILENT, now, render=lambda t: f"no valid data for {_secs(t - last)} s "
                                                                f"(allowed {_secs(budget)} s{owed})")
        elif st is LinkState.CONNECTED and self._opened_at is not None and now - self._opened_at > budget:
            opened = self._opened_at
            if self._heard:
                self._enter(LinkState.SILENT, now, render=lambda t: (
                    f"link open but no valid data since it opened {t - opened:.1f} s ago (allowed {_secs(budget)} s)"))
            else:
                self._enter(LinkState.UNREACHABLE, now, render=lambda t: (
                    f"link open but the device never sent valid data in {t - opened:.1f} s "
                    f"(allowed {_secs(budget)} s)"))
        elif (st in (LinkState.CONNECTING, LinkState.LOST) and self._absent_since is not None
              and now - self._absent_since > budget):
            self._enter(LinkState.UNREACHABLE, now, render=self._unreachable_message)
        return self.state

    def next_attempt_in(self, now: float) -> float:
        """Seconds until the transport should try (or probe) again; 0: now."""
        return max(0.0, self._next_attempt - now)

    def next_deadline(self, now: float) -> float | None:
        """Seconds until `tick` may change the state (None: no deadline pending)."""
        budget = self.policy.liveness_s
        st = self.state
        if st is LinkState.OPERATIONAL and self._last_data is not None:
            return max(0.0, max(self._last_data, self._quiet_until or 0.0) + budget - now)
        if st is LinkState.CONNECTED and self._opened_at is not None:
            return max(0.0, self._opened_at + budget - now)
        if st in (LinkState.CONNECTING, LinkState.LOST) and self._absent_since is not None:
            return max(0.0, self._absent_since + budget - now)
        return None

    @property
    def unreachable(self) -> bool:
        """Never heard from within the budget: the transport probes once per probe period."""
        return self.state is LinkState.UNREACHABLE

    @property
    def valid_data(self) -> bool:
        return self.state is LinkState.OPERATIONAL

    # -- health ------------------------------------------------------------------------------------
    def health(self, now: float) -> dict[str, Any]:
        """The health fields this state means (the same table in every service)."""
        self.tick(now)
        st = self.state
        connection = st is LinkState.OPERATIONAL
        operational = connection and self._device_operational and not self._fault
        if self._fault:
            state, message = LinkState.ERROR.value, self._fault
        elif connection:
            state, message = (self._device_state or st.value), self._device_message
        else:
            state, message = st.value, self._message  # as entered: health is pushed on a change, not on a tick
        return {"connection": connection, "operational": operational, "state": state,
                "error": bool(self._fault), "error_message": message, "details": {"link": self.details(now)}}

    def details(self, now: float) -> dict[str, Any]:
        c = self.counters
        time_in = dict(self._time_in)
        time_in[self.state.value] = time_in.get(self.state.value, 0.0) + (now - self._since)
        out: dict[str, Any] = {
            "state": self.state.value, "since_s": round(now - self._since, 3),
            "valid_data": self.state is LinkState.OPERATIONAL,
            "last_data_age_s": None if self._last_data is None else round(now - self._last_data, 3),
            "liveness_s": self.policy.liveness_s,
            "attempts": c.attempts, "failures": c.failures, "sessions": c.sessions, "silences": c.silences,
            "garbage": c.garbage, "restarts": c.restarts,
            "next_attempt_s": round(self.next_attempt_in(now), 3),
            "quiet_for_s": None if self._quiet_until is None else round(max(0.0, self._quiet_until - now), 3),
            "time_in_s": {k: round(v, 3) for k, v in time_in.items()},
        }
        if c.last_failure:
            out["last_failure"] = c.last_failure
        return out

    # -- inside ------------------------------------------------------------------------------------
    def message(self, now: float) -> str:
        """The state's message as of `now` (the ages it states counted to `now`)."""
        return self._render(now) if self._render is not None else self._message

    def live_message(self, now: float, shown: str) -> str:
        """`shown`, the health message last pushed, told again at `now`: the same text with the ages it states
        counted to `now` when it is this supervisor's own (not operational, no fault), else `shown`."""
        if self._fault or self.state is LinkState.OPERATIONAL or self._render is None:
            return shown
        return self._render(now) if shown == self._message else shown

    def _enter(self, state: LinkState, now: float, message: str = "",
               render: Callable[[float], str] | None = None) -> None:
        if state is not self.state:
            self._time_in[self.state.value] = self._time_in.get(self.state.value, 0.0) + (now - self._since)
            self._since = now
            self.state = state
        self._message = message if render is None else render(now)
        self._render = render

    def _schedule_retry(self, now: float) -> None:
        absent_long = self._absent_since is not None and now - self._absent_since > self.policy.liveness_s
        if self.state is LinkState.UNREACHABLE or absent_long:
            wait = max(self.policy.probe_period_s, self._backoff)
        else:
            wait = self._backoff
            self._backoff = min(self._backoff * 2, self.policy.backoff_max_s)
        self._next_attempt = now + wait

    def _unreachable_message(self, now: float) -> str:
        since = self._absent_since if self._absent_since is not None else now
        why = f"; last: {self.counters.last_failure}" if self.counters.last_failure else ""
        return (f"no valid data from the device for {now - since:.1f} s "
                f"({self.counters.attempts} attempts{why}); probing every {self.policy.probe_period_s:g} s")


def _secs(x: float) -> str:
    """Seconds to one decimal, or to two when one would misstate them (a 0.25 s budget is not "0.2 s", and an age
    of 0.26 s past it is not "0.3 s")."""
    one = f"{x:.1f}"
    return one if abs(float(one) - x) < 0.005 else f"{x:.2f}"


class SupervisedLink:
    """A `LinkSupervisor` bound to a device's health, safe from any thread, on the monotonic clock.

    Made by `Device.supervise_link(policy)`. The transport reports events; health is set from the state at
    once on every transition (so `lost` is published when the link closes, not at the next heartbeat), and the
    node's housekeeping thread calls `tick()` at the nearest deadline (so `silent` and `unreachable` are
    published when the budget passes, without the transport's help). `details.link` is filled at every publish.
    """

    def __init__(self, policy: LinkPolicy, on_health: Callable[[dict[str, Any]], None],
                 clock: Callable[[], float] = time.monotonic, wake: Callable[[], None] | None = None,
                 start: bool = True) -> None:
        self._clock = clock
        self._wake = wake               # wakes whoever applies the deadlines (the node's housekeeping)
        self.sup = LinkSupervisor(policy, self._clock())
        # reentrant: setting health publishes it, and the publish reads details() back
        self._lock = threading.RLock()
        self._on_health = on_health     # the device's set_health
        self._shown: tuple[Any, ...] = ()
        self._source: Callable[[], float | None] | None = None  # see watch()
        self._fed: float | None = None  # the newest arrival time reported (data(at=) / the source)
        if start:
            self.show()

    def show(self) -> None:
        """Set health from the link's state now (made with `start=False`: once whoever reads it back is ready)."""
        with self._lock:
            self._shown = ()
            self._push_locked(self._clock())

    # every event: under the lock, then health if what it shows changed
    def attempt(self) -> None:
        self._event(lambda now: self.sup.attempt(now))

    def opened(self) -> None:
        self._event(lambda now: self.sup.opened(now))

    def failed(self, reason: str) -> None:
        self._event(lambda now: self.sup.failed(now, reason))

    def closed(self, reason: str) -> None:
        self._event(lambda now: self.sup.closed(now, reason))

    def data(self, at: float | None = None) -> None:
        """Valid data arrived: now, or at `at` (this clock's time: monotonic seconds) when another process saw them
        first and stamped them. An `at` not newer than one reported before is no news."""
        now = self._clock()
        with self._lock:
            self._data_locked(now, at)

    def watch(self, source: Callable[[], float | None]) -> None:
        """`source()`: the arrival time of the newest valid data (monotonic seconds; None: nothing to report), read
        under the link's lock before every deadline is applied (`tick`). For data stamped where they arrive (a
        helper process): the device is judged silent on when they last arrived, not on when a thread of this
        process last looked, which a loaded host can hold up past the budget while the data flow."""
        with self._lock:
            self._source = source

    def _data_locked(self, now: float, at: float | None) -> None:
        if at is not None:
            if self._fed is not None and at <= self._fed:
                return
            self._fed = at
        if self.sup.state is LinkState.OPERATIONAL and (at is None or now - at <= self.sup.policy.liveness_s):
            self.sup.data(now, at)   # the hot path: no health work while nothing changes
            return
        self.sup.data(now, at)
        self._push_locked(now)

    def garbage(self, what: str) -> None:
        self._event(lambda now: self.sup.garbage(now, what))

    def set_budget(self, seconds: float) -> None:
        """Change the liveness budget at run time (cheap when unchanged). A shorter budget may bring the next
        deadline forward: the thread applying the deadlines is woken to see it."""
        now = self._clock()
        with self._lock:
            if seconds == self.sup.policy.liveness_s:
                return
            self.sup.set_budget(now, seconds)
            self._push_locked(now)
        if self._wake is not None:
            self._wake()

    def expect_silence(self, seconds: float) -> None:
        """No data is owed for `seconds` (an exchange answered only when done): see LinkSupervisor."""
        self._event(lambda now: self.sup.expect_silence(now, seconds))
        if self._wake is not None:
            self._wake()

    def fault(self, message: str) -> None:
        self._event(lambda now: self.sup.fault(message))

    def clear_fault(self) -> None:
        self._event(lambda now: self.sup.clear_fault())

    def device_state(self, name: str | None, *, operational: bool = True, message: str = "") -> None:
        self._event(lambda now: self.sup.device_state(name, operational=operational, message=message))

    def recovering(self, reason: str) -> None:
        self._event(lambda now: self.sup.recovering(now, reason))

    def recovered(self) -> None:
        self._event(lambda now: self.sup.recovered(now))

    def stop(self, reason: str = "stopped") -> None:
        self._event(lambda now: self.sup.stop(now, reason))

    def tick(self) -> float | None:
        """Apply deadlines; returns seconds to the next one (None: none pending)."""
        now = self._clock()
        with self._lock:
            if self._source is not None:
                at = self._source()
                if at is not None:
                    self._data_locked(now, at)
            self.sup.tick(now)
            self._push_locked(now)
            return self.sup.next_deadline(now)

    # reads
    @property
    def state(self) -> LinkState:
        return self.sup.state

    def next_attempt_in(self) -> float:
        with self._lock:
            return self.sup.next_attempt_in(self._clock())

    def details(self) -> dict[str, Any]:
        with self._lock:
            return self.sup.details(self._clock())

    def live_message(self, shown: str) -> str:
        """The health message `shown` as of now (LinkSupervisor.live_message): every health published states the
        ages as they are when it goes out (the kit's one rule for the age a message states)."""
        with self._lock:
            return self.sup.live_message(self._clock(), shown)

    def _event(self, fn: Callable[[float], None]) -> None:
        now = self._clock()
        with self._lock:
            fn(now)
            self._push_locked(now)

    def _push_locked(self, now: float) -> None:
        fields = self.sup.health(now)
        shown = (fields["connection"], fields["operational"], fields["state"], fields["error"],
                 fields["error_message"])
        if shown != self._shown:
            self._shown = shown
            del fields["details"]   # filled at publish time (Device.health_message), always fresh
            self._on_health(fields)
