"""The I/O side: one python-can bus per palm CAN bus, and the loop that drives a sans-I/O machine on it.

Any python-can interface works (socketcan, pcan, kvaser, slcan, virtual, udp_multicast, ...), and so does
the palm's CAN bridge (`interface="robobus_bridge"`, bridge_bus.py): the code here cannot tell them apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import can
from pydantic import BaseModel, ConfigDict, Field

from services.can_bootloader import protocol as p

log = logging.getLogger("robobus.can_bootloader.transport")


class CanBusConfig(BaseModel):
    """One CAN bus as python-can opens it: `can.Bus(interface=..., channel=..., bitrate=..., **options)`."""

    model_config = ConfigDict(extra="forbid")
    interface: str = Field("virtual", description="python-can interface: socketcan, pcan, kvaser, slcan, virtual, "
                                                  "udp_multicast, robobus_bridge, ...")
    channel: str = Field("robobus-can1", description="Interface channel (can0, PCAN_USBBUS1, palm bus '1', ...)")
    bitrate: int | None = Field(None, description="Bit rate, for interfaces that set it (1 Mbit/s on the hand)")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for can.Bus")


class TransportError(RuntimeError):
    """The bus failed (send error, adapter gone)."""


class Machine(Protocol):
    """What `drive` needs: Flasher and Exchange both are one."""

    @property
    def done(self) -> bool: ...

    def poll(self, now: float) -> list[p.BootFrame]: ...

    def receive(self, frame: p.BootFrame, now: float) -> None: ...

    def tick(self, now: float) -> None: ...

    def deadline(self) -> float | None: ...


def open_bus(cfg: CanBusConfig) -> Any:
    kwargs: dict[str, Any] = dict(cfg.options)
    if cfg.bitrate is not None:
        kwargs["bitrate"] = cfg.bitrate
    return can.Bus(interface=cfg.interface, channel=cfg.channel, **kwargs)


def to_frame(msg: Any) -> p.BootFrame | None:
    """A python-can message as a BootFrame; None for what the bootloader never sends (error, remote,
    extended-id and CAN FD frames longer than 8 bytes)."""
    if msg.is_error_frame or msg.is_remote_frame or msg.is_extended_id or len(msg.data) > 8:
        return None
    return p.BootFrame(int(msg.arbitration_id) & p.SID_MASK, bytes(msg.data))


def to_message(frame: p.BootFrame) -> Any:
    return can.Message(arbitration_id=frame.sid, data=frame.data, is_extended_id=False)


class CanPort:
    """One CAN bus (palm bus 1 or 2) and its lock: one flash per bus at a time."""

    def __init__(self, number: int, cfg: CanBusConfig, bus: Any | None = None) -> None:
        self.number = number
        self.cfg = cfg
        self._bus = bus
        self.lock = threading.Lock()
        self.garbage = 0
        self.last_error = ""
        self.frames_sent = 0
        self.frames_received = 0
        self.on_garbage: Callable[[str], None] | None = None  # e.g. Node.count_decode_error

    @property
    def connected(self) -> bool:
        """The bus is open (and, for the palm bridge, ethercat-loop is not known to be offline)."""
        return self._bus is not None and getattr(self._bus, "remote_online", True) is not False

    def open(self) -> Any:
        if self._bus is None:
            try:
                self._bus = open_bus(self.cfg)
            except Exception as exc:
                self.last_error = f"cannot open CAN bus {self.number} ({self.cfg.interface}:{self.cfg.channel}): {exc}"
                raise TransportError(self.last_error) from exc
        return self._bus

    def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None:
            try:
                bus.shutdown()
            except Exception as exc:
                log.debug("bus shutdown: %s", exc)

    def drain(self) -> None:
        """Drop frames left over from earlier work (late ACKs, boot ACKs)."""
        bus = self.open()
        while bus.recv(0) is not None:
            pass

    def drive(self, machine: Machine, *, cancel: Callable[[], bool] | None = None,
              on_cancel: Callable[[float], object] | None = None, every: Callable[[float], None] | None = None,
              every_s: float = 0.1, clock: Callable[[], float] = time.monotonic, max_wait_s: float = 0.02) -> None:
        """Run `machine` to its end on this bus. `cancel()` is checked each turn; `every(now)` runs every
        `every_s` (progress reports)."""
        bus = self.open()
        next_report = clock()
        cancel_sent = False
        while not machine.done:
            now = clock()
            if cancel is not None and not cancel_sent and cancel() and on_cancel is not None:
                on_cancel(now)
                cancel_sent = True
                if machine.done:
                    break
            for out in machine.poll(now):
                try:
                    bus.send(to_message(out))
                except can.CanError as exc:
                    self.last_error = f"CAN bus {self.number} send failed: {exc}"
                    raise TransportError(self.last_error) from exc
                self.frames_sent += 1
            dl = machine.deadline()
            wait = max_wait_s if dl is None else min(max(dl - clock(), 0.0), max_wait_s)
            try:
                msg = bus.recv(wait)
                while msg is not None:
                    frame = to_frame(msg)
                    if frame is None:
                        self.garbage += 1
                        if self.on_garbage is not None:
                            self.on_garbage(f"CAN bus {self.number}: not a classic 11-bit data frame "
                                            f"(id 0x{int(msg.arbitration_id):X}, error={msg.is_error_frame}, "
                                            f"remote={msg.is_remote_frame}, extended={msg.is_extended_id})")
                    else:
                        self.frames_received += 1
                        machine.receive(frame, clock())
                    msg = bus.recv(0)
            except can.CanError as exc:
                self.last_error = f"CAN bus {self.number} receive failed: {exc}"
                raise TransportError(self.last_error) from exc
            now = clock()
            machine.tick(now)
            if every is not None and now >= next_report:
                every(now)
                next_report = now + every_s
        if every is not None:
            every(clock())
