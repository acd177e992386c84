"""The I/O side: one python-can bus per palm CAN bus, and the loop that drives a sans-I/O machine on it.

Any python-can interface works (socketcan, pcan, kvaser, slcan, virtual, udp_multicast, ...), and so does
the palm's CAN bridge (`interface="robobus_bridge"`, bridge_bus.py): the code here cannot tell them apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BusHooks:
    """What the service gives a transport of its buses (the factory's `hooks`): its ports, by bus number."""

    ports: Mapping[int, CanPort]


class TransportError(RuntimeError):
    """The bus failed (send error, adapter gone)."""


class NotOpen(TransportError):
    """The bus is not open (it failed to open, or failed since): the link supervisor reopens it."""


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
        self.frames_idle = 0  # frames heard while no exchange ran (dropped: boards answer only when asked)
        self.last_ok: float | None = None  # monotonic time of the last adapter operation that worked
        self.on_garbage: Callable[[str], None] | None = None  # e.g. Node.count_decode_error

    @property
    def connected(self) -> bool:
        """The bus is open (and, for the palm bridge, ethercat-loop is not known to be offline)."""
        return self._bus is not None and getattr(self._bus, "remote_online", True) is not False

    @property
    def is_open(self) -> bool:
        return self._bus is not None

    def check(self, clock: Callable[[], float] = time.monotonic) -> bool:
        """The adapter's health, checked between exchanges (the link's liveness: boards answer only while in
        their bootloader and only when asked, so the adapter is what can be watched). Raises TransportError
        when the adapter reports an error state, a read fails (an interface that vanished), or, through the
        palm's bridge, ethercat-loop is offline. True: healthy, False: not proven (the bridge's palm not seen
        yet). Frames left on the bus are dropped (counted), as `drain` does before every exchange. Skipped
        (True) while an exchange holds the bus: its own reads prove the adapter (`last_ok`)."""
        if not self.lock.acquire(blocking=False):
            return True
        try:
            bus = self._bus
            if bus is None:
                raise NotOpen(f"CAN bus {self.number} is not open")
            try:
                state = bus.state
            except NotImplementedError:  # interfaces without a bus state (virtual, udp_multicast): the read proves it
                state = can.BusState.ACTIVE
            except (can.CanError, OSError) as exc:
                raise self._failed(f"state unreadable: {exc}") from exc
            if state == can.BusState.ERROR:
                raise self._failed("the adapter reports bus state ERROR (bus-off)")
            online = getattr(bus, "remote_online", True)
            if online is False:
                raise self._failed("the palm's CAN bridge is offline (ethercat-loop's status says so)")
            try:
                msg = bus.recv(0)
                while msg is not None:
                    if to_frame(msg) is None:
                        self._garbage(msg)
                    else:
                        self.frames_idle += 1
                    msg = bus.recv(0)
            except (can.CanError, OSError, ValueError) as exc:
                raise self._failed(f"receive failed: {exc}") from exc
            if online is None:
                return False
            self.last_ok = clock()
            return True
        finally:
            self.lock.release()

    def _failed(self, what: str) -> TransportError:
        self.last_error = f"CAN bus {self.number} ({self.cfg.interface}:{self.cfg.channel}): {what}"
        return TransportError(self.last_error)

    def _garbage(self, msg: Any) -> None:
        self.garbage += 1
        if self.on_garbage is not None:
            self.on_garbage(f"CAN bus {self.number}: not a classic 11-bit data frame "
                            f"(id 0x{int(msg.arbitration_id):X}, error={msg.is_error_frame}, "
                            f"remote={msg.is_remote_frame}, extended={msg.is_extended_id})")

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
              every_s: float = 0.1, clock: Callable[[], float] = time.monotonic, max_wait_s: float = 0.02,
              guard: AbstractContextManager[Any] | None = None) -> None:
        """Run `machine` to its end on this bus. `cancel()` is checked each turn; `every(now)` runs every
        `every_s` (progress reports). `guard` (a lock) is held from each `poll` to the end of its sends: whoever
        takes it knows that a frame the machine decided on before has left, and that a later one is decided
        after (the bus stop's action: no RESET leaves once it returns)."""
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
            with guard if guard is not None else nullcontext():
                for out in machine.poll(now):
                    try:
                        bus.send(to_message(out))
                    except (can.CanError, OSError, ValueError) as exc:
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
                        self._garbage(msg)
                    else:
                        self.frames_received += 1
                        machine.receive(frame, clock())
                    msg = bus.recv(0)
            except (can.CanError, OSError, ValueError) as exc:
                self.last_error = f"CAN bus {self.number} receive failed: {exc}"
                raise TransportError(self.last_error) from exc
            now = clock()
            self.last_ok = now
            machine.tick(now)
            if every is not None and now >= next_report:
                every(now)
                next_report = now + every_s
        if every is not None:
            every(clock())
