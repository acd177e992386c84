"""Rate caps that do not lock onto jitter.

A plain "at most one per 1/rate" cap, fed by a robot that sends at the same nominal rate, makes
every late packet push the next slot later: latency climbs to the worst jitter seen and stays
there. A token bucket keeps the long-run rate at the cap and absorbs the jitter.

The burst must cover the jitter of a source that sends at the cap's own rate (the e-puck's 50 Hz
sensors against a 50 Hz cap): a packet is held only when arrivals bunch by more than (burst - 1)
periods. With burst 2 at 50 Hz that is a 20 ms swing, which a busy host gives to ~1 % of packets
(a stalled sender catching up), each then held up to 20 ms: the whole p99 of the sensor latency.
`for_jitter` sizes the burst to a time window instead (100 ms: 5 packets at 50 Hz, 2 at 10 fps)."""

from __future__ import annotations

from dataclasses import dataclass

JITTER_WINDOW_S = 0.1  # arrivals may bunch by this much without a packet being held


@dataclass
class RateGate:
    rate_hz: float  # 0 = no cap
    burst: float = 2.0
    _tokens: float = 2.0
    _last: float | None = None

    @classmethod
    def for_jitter(cls, rate_hz: float, window_s: float = JITTER_WINDOW_S) -> RateGate:
        """A cap whose burst absorbs `window_s` of bunching (at least 2, as before)."""
        burst = max(2.0, float(round(rate_hz * window_s)))
        return cls(rate_hz, burst=burst, _tokens=burst)

    def _refill(self, now: float) -> None:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate_hz)
        self._last = now

    def try_pass(self, now: float) -> bool:
        if self.rate_hz <= 0:
            return True
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_s(self, now: float) -> float:
        """Seconds until `try_pass` can succeed."""
        if self.rate_hz <= 0:
            return 0.0
        self._refill(now)
        return max(0.0, (1.0 - self._tokens) / self.rate_hz)
