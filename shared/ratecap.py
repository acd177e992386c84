"""Rate-capped state publishing: one slot per state topic, the newest value kept while the slot is busy.

A slot sends at once when its interval has passed (or nearly: up to RATE_CAP_SLACK of it early is
scheduling jitter, counted at its due time, so a fixed-rate publisher never waits for the flusher); too
soon, and only the newest value is kept, to be sent by the flusher when the slot frees."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RATE_CAP_SLACK = 0.1  # a value this fraction of the interval early is sent at once, counted at its due time


@dataclass
class RateSlot:
    """Rate cap for one state topic."""

    topic: str
    interval: float
    retain: bool
    qos: int
    encode: Callable[[Any], bytes]
    content_type: str | None = None
    last_sent: float = 0.0
    pending: Any = None
    has_pending: bool = False
    last_payload: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def offer(self, value: Any, t: float) -> bool:
        """True: send `value` now. False: it is kept as the pending value; schedule a flush at `due()`."""
        with self.lock:
            due = self.last_sent + self.interval
            if t >= due - self.interval * RATE_CAP_SLACK:
                self.last_sent = t if t >= due else due
                self.has_pending = False
                self.pending = None
                return True
            self.pending = value
            self.has_pending = True
            return False

    def due(self) -> float:
        return self.last_sent + self.interval

    def take_pending(self) -> tuple[bool, Any]:
        """The flusher's turn: the pending value, if any, with the slot's time advanced by one interval."""
        with self.lock:
            if not self.has_pending:
                return False, None
            value, self.pending, self.has_pending = self.pending, None, False
            # keep the cadence: the slot's time is when it was due, not when the flusher got to it (else every
            # held-back value stretches the period and 100 Hz becomes ~97 Hz); never further back than one
            # interval, so a late flusher cannot cause a burst
            self.last_sent = max(self.last_sent + self.interval, time.monotonic() - self.interval)
            return True, value


class FlushSchedule:
    """Slots with a pending value, by due time; the housekeeping thread flushes them."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, RateSlot]] = {}
        self._lock = threading.Lock()
        self.wake = threading.Event()

    def schedule(self, slot: RateSlot, due: float) -> None:
        with self._lock:
            if id(slot) not in self._due:
                self._due[id(slot)] = (due, slot)
                self.wake.set()

    def flush(self, send: Callable[[RateSlot, Any], None]) -> float:
        """Send pending values whose time has come; return seconds to the next one (at most 0.5)."""
        t = time.monotonic()
        nxt = 0.5
        with self._lock:
            ready = [s for d, s in self._due.values() if d <= t]
            for s in ready:
                del self._due[id(s)]
            if self._due:
                nxt = min(nxt, min(d for d, _ in self._due.values()) - t)
        for slot in ready:
            has, value = slot.take_pending()
            if has:
                send(slot, value)
        return max(nxt, 0.0005)
