"""Rate caps that do not lock onto jitter.

A plain "at most one per 1/rate" cap, fed by a robot that sends at the same nominal rate, makes
every late packet push the next slot later: latency climbs to the worst jitter seen and stays
there. A token bucket (burst 2) keeps the long-run rate at the cap and absorbs the jitter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RateGate:
    rate_hz: float  # 0 = no cap
    burst: float = 2.0
    _tokens: float = 2.0
    _last: float | None = None

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
