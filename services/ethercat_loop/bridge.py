"""The CAN bridge lease: one exclusive owner of the palm's CAN direct mode at a time."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from services.ethercat_loop.control import (
    CanFrame,
    CanRxFrame,
)
from services.ethercat_loop.models import PalmCanFrameIn, PalmCanFrameOut
from shared import CommandError, ErrorCode


# ------------------------------------------------------------------------------------------- the lease
@dataclass
class Lease:
    holder: str
    lease_id: str
    ttl_s: float
    expires: float


class BridgeLease:
    """The one exclusive owner of CAN direct mode (a remote holder, send_can or the ADC test)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: Lease | None = None

    def acquire(self, holder: str, ttl_ms: int, now: float) -> Lease:
        with self._lock:
            cur = self.current
            if cur is not None and cur.expires > now and cur.holder != holder:
                raise CommandError(ErrorCode.BUSY, f"the CAN bridge is leased by {cur.holder!r} for another "
                                                   f"{(cur.expires - now) * 1000:.0f} ms")
            if cur is not None and cur.holder == holder and cur.expires > now:
                cur.ttl_s, cur.expires = ttl_ms / 1000, now + ttl_ms / 1000
                return cur
            self.current = Lease(holder, uuid.uuid4().hex[:16], ttl_ms / 1000, now + ttl_ms / 1000)
            return self.current

    def touch(self, lease_id: str, now: float) -> bool:
        with self._lock:
            cur = self.current
            if cur is None or cur.lease_id != lease_id or cur.expires <= now:
                return False
            cur.expires = now + cur.ttl_s
            return True

    def release(self, lease_id: str) -> bool:
        with self._lock:
            if self.current is None or self.current.lease_id != lease_id:
                return False
            self.current = None
            return True

    def expire(self, now: float) -> Lease | None:
        """Drop the lease if its holder went quiet; returns the expired lease."""
        with self._lock:
            cur = self.current
            if cur is not None and cur.expires <= now:
                self.current = None
                return cur
            return None

    def holder(self, now: float) -> Lease | None:
        with self._lock:
            cur = self.current
            return cur if cur is not None and cur.expires > now else None


def frame_out(f: CanRxFrame) -> PalmCanFrameOut:
    return PalmCanFrameOut(bus=f.bus, sid=f.sid, data=f.data.hex(), cycle=f.cycle)


def frame_in(f: PalmCanFrameIn) -> CanFrame:
    return CanFrame(f.bus, f.sid, bytes.fromhex(f.data))
