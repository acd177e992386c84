"""The palm's CAN bridge as this service serves it: the lease of CAN direct mode (bridge.py `BridgeLease`: one
holder at a time, a remote client, `send_can` or the ADC test), the driver told when it starts and ends, the
frames to the motors' buses (`stream/can_tx`) and from them (`stream/can_rx`, or collected for `send_can`).

Handlers (service.py) call it; the frames come on the MQTT network thread and the backend's reader: all quick.
"""

from __future__ import annotations

import logging
import threading
import time

from services.ethercat_loop.api import CAN_RX
from services.ethercat_loop.backend import HandBackend
from services.ethercat_loop.bridge import BridgeLease, Lease, frame_in, frame_out
from services.ethercat_loop.control import CanFrame, CanRxFrame, CanTx, SetCanDirect
from services.ethercat_loop.models import PalmCanFrameIn, PalmCanRx, PalmCanTx, PalmSendCanReply, PalmSendCanRequest
from services.ethercat_loop.protocol import CanDirection, split_sid
from shared import CommandError, Device, ErrorCode, Node

log = logging.getLogger("robobus.ethercat")
SEND_CAN_HOLDER = "_send_can"  # the service's own holders start with '_' (a client's may not)


class CanBridge:
    """Who holds CAN direct mode, what the driver was last told, and the frames both ways."""

    def __init__(self, node: Node, dev: Device, backend: HandBackend) -> None:
        self.node = node
        self.dev = dev
        self.backend = backend
        self.lease = BridgeLease()
        self._active: Lease | None = None  # what the driver was last told
        self._lock = threading.Lock()
        self._collect: list[CanRxFrame] | None = None  # send_can's window: frames kept for its reply

    def holder(self, now: float) -> Lease | None:
        return self.lease.holder(now)

    def open(self, holder: str, ttl_ms: int, now: float) -> Lease:
        """A remote holder's lease (taken or renewed): the hand in CAN direct mode while it is held."""
        lease = self.lease.acquire(holder, ttl_ms, now)
        with self._lock:
            if self._active is None or self._active.lease_id != lease.lease_id:
                self._active = lease
                self.backend.submit(SetCanDirect(True))
                log.info("CAN bridge leased", extra={"holder": holder, "lease_id": lease.lease_id})
        return lease

    def release(self, lease_id: str) -> None:
        """A remote holder gives its lease back (the service's own leases are not theirs to release)."""
        cur = self.lease.holder(time.monotonic())
        if cur is not None and cur.holder.startswith("_"):
            raise CommandError(ErrorCode.NOT_FOUND, f"no lease {lease_id!r}")
        if not self.lease.release(lease_id):
            raise CommandError(ErrorCode.NOT_FOUND, f"no lease {lease_id!r} (expired or released)")
        self._end_direct(lease_id, "released")

    def expire(self, now: float) -> None:
        """A remote holder gone quiet past its ttl: back to normal operation (publisher thread, every tick)."""
        gone = self.lease.expire(now)
        if gone is not None and not gone.holder.startswith("_"):
            self._end_direct(gone.lease_id, f"holder {gone.holder!r} quiet for {gone.ttl_s * 1000:.0f} ms")

    def _end_direct(self, lease_id: str, why: str) -> None:
        with self._lock:
            if self._active is not None and self._active.lease_id == lease_id:
                self._active = None
                self.backend.submit(SetCanDirect(False))
                log.info("CAN bridge back to normal operation", extra={"lease_id": lease_id, "why": why})

    def send_and_collect(self, req: PalmSendCanRequest, data: bytes) -> PalmSendCanReply:
        """`send_can`: one frame out in CAN direct mode, and every frame that comes back within the window."""
        lease = self.lease.acquire(SEND_CAN_HOLDER, req.window_ms + 2000, time.monotonic())
        try:
            with self._lock:
                self._collect = []
                self._active = lease
                self.backend.submit(SetCanDirect(True))
                self.backend.submit(CanTx((CanFrame(req.bus, req.sid, data),)))
            time.sleep(req.window_ms / 1000)
            with self._lock:
                got, self._collect = self._collect or [], None
                self._active = None
                self.backend.submit(SetCanDirect(False))
        finally:
            self.lease.release(lease.lease_id)
        sent = PalmCanFrameIn(bus=req.bus, sid=req.sid, data=data.hex())
        return PalmSendCanReply(sent=sent, frames=[frame_out(f) for f in got])

    # -- the streams ----------------------------------------------------------------------------------
    def on_can_tx(self, msg: PalmCanTx) -> None:
        """Network thread: quick. A stale lease id is counted and dropped."""
        if not self.lease.touch(msg.lease_id, time.monotonic()):
            self.node.count_decode_error(f"can_tx for lease {msg.lease_id!r}, which is not held")
            return
        frames = msg.frames
        # the bus stop: no TO_MOTOR frame (docs/reference/shadow_ethercat.md §1.9) leaves
        if frames and self.node.stop_latch.active:
            frames = [f for f in frames if split_sid(f.sid)[0] != CanDirection.TO_MOTOR]
            for _ in range(len(msg.frames) - len(frames)):
                self.node.count_decode_error("can_tx: a TO_MOTOR frame dropped while the bus stop is active")
        if frames:
            self.backend.submit(CanTx(tuple(frame_in(f) for f in frames)))

    def on_can_rx(self, frames: list[CanRxFrame]) -> None:
        with self._lock:
            lease = self._active
            if self._collect is not None:
                self._collect.extend(frames)
                return
        if lease is not None:
            self.dev.stream_publish(CAN_RX, PalmCanRx(lease_id=lease.lease_id, frames=[frame_out(f) for f in frames]))


__all__ = ["SEND_CAN_HOLDER", "CanBridge"]
