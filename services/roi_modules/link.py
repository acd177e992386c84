"""The ROI network as the modules and the service see it: the transport's configuration and addresses, its
errors, the per-module counters, the send guard and the background mark a task sets for what it sends, what the
service gives the transport (`TransportHooks`) and what it drives of it (`RoiLink`). device.py and service.py
import this, never the transport's module: the transport (`udp`: transport.py's `RoiTransport`) is loaded by name,
through the kit's transport loader (docs/kit.md, "Transports"), and made by its factory with the kit's one
signature, `factory(settings, hooks: TransportHooks) -> RoiLink`.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.roi_modules import protocol as p


class RequestLost(Exception):
    """Every send of a request went unanswered: it was abandoned (and counted)."""


class RequestRefused(Exception):
    """The request's guard refused a send (the bus stop came): nothing more of it was sent. Not a loss."""


# a motion request's guard: why this packet may not be sent now ("" when it may); see `guard_sends`
SendGuard = Callable[[p.GeneralPacket], str]


@dataclass(frozen=True)
class TransportConfig:
    prefix: str  # three octets, e.g. "192.168.2" (the firmware's network) or "127.0.2" (simulators)
    host_octet: int  # our own address on that network
    timeout_s: float = 0.05
    max_retries: int = 10
    general_port: int = p.GENERAL_PORT
    sysadmin_port: int = p.SYSADMIN_PORT

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        check_octet(self.host_octet)

    @property
    def host_address(self) -> str:
        return module_address(self.prefix, self.host_octet)


def check_prefix(prefix: str) -> str:
    parts = prefix.split(".")
    if len(parts) != 3 or not all(x.isdigit() and 0 <= int(x) <= 255 and str(int(x)) == x for x in parts):
        raise ValueError(f"network prefix {prefix!r} must be three decimal octets, e.g. 192.168.2")
    return prefix


def check_octet(octet: int) -> int:
    if not 1 <= octet <= 254:
        raise ValueError(f"octet {octet} must be 1..254 (0 is the network, 255 broadcast)")
    return octet


def module_address(prefix: str, octet: int) -> str:
    """`<prefix>.<octet>`, built from parts (never a text replace on a whole address, §5.5)."""
    return str(ipaddress.IPv4Address(f"{check_prefix(prefix)}.{check_octet(octet)}"))


@dataclass
class LinkStats:
    """One module's traffic counters (ConnectionState of §5.2 without its liveness rule: that is the link
    supervisor's). `lost_since_connect`: requests abandoned since the module last answered."""

    lost_since_connect: int = 0
    lost_total: int = 0
    sent: int = 0
    resent: int = 0
    replies: int = 0
    unmatched: int = 0
    bad_checksum: int = 0
    last_reply: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"lost_since_connect": self.lost_since_connect,
                "lost_total": self.lost_total, "sent": self.sent, "resent": self.resent, "replies": self.replies,
                "unmatched": self.unmatched, "bad_checksum": self.bad_checksum}


_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("roi_background", default=False)
_GUARD: contextvars.ContextVar[SendGuard | None] = contextvars.ContextVar("roi_send_guard", default=None)


def guard_sends(guard: SendGuard | None) -> None:
    """Every general request the calling task sends from now on asks `guard(packet)` before each send and resend
    (the first included): a non-empty answer ends the request with RequestRefused, nothing more sent. A motion
    command's guard refuses once the bus stop is active (device.py). A task's context is its own."""
    _GUARD.set(guard)


def background_traffic() -> None:
    """Mark what the calling task sends from now on as background (the maintain loop): it queues behind
    commands for its module and yields to them between resends. A task's context is its own."""
    _BACKGROUND.set(True)


def send_guard() -> SendGuard | None:
    """The guard the calling task set (`guard_sends`), if any."""
    return _GUARD.get()


def is_background() -> bool:
    """The calling task marked what it sends as background (`background_traffic`)."""
    return _BACKGROUND.get()


@dataclass(frozen=True)
class TransportHooks:
    """What the service gives its transport (the factory's `hooks`): the octets it serves and its callbacks
    (`live(octet)`: the module answers; `on_reply(octet, port, packet)`: every matched reply; `on_garbage(octet,
    reason)`: a datagram from a served module that does not decode; `on_decode_error(what)`)."""

    octets: Sequence[int]
    live: Callable[[int], bool] | None = None
    on_reply: Callable[[int, int, p.GeneralPacket | p.SysAdminPacket], None] | None = None
    on_garbage: Callable[[int, str], None] | None = None
    on_decode_error: Callable[[str], None] | None = None


Sent = list[tuple[float, list[asyncio.Future[p.GeneralPacket]]]]  # per module: when it left, its replies awaited


class RoiLink(Protocol):
    """What the service and its modules drive of the transport (transport.py's `RoiTransport`)."""

    cfg: TransportConfig
    links: dict[int, LinkStats]
    opened: asyncio.Event

    @property
    def bound(self) -> bool: ...
    async def open(self) -> None: ...
    def close(self) -> None: ...
    def address(self, octet: int) -> str: ...
    async def general(self, octet: int, pkt: p.GeneralPacket, *, retries: int | None = None,
                      insist: bool = False) -> p.GeneralPacket: ...
    async def general_once(self, octet: int, pkt: p.GeneralPacket) -> p.GeneralPacket | None: ...
    async def sysadmin(self, octet: int, pkt: p.SysAdminPacket, *, retries: int | None = None,
                       expect_reply: bool = True) -> p.SysAdminPacket | None: ...
    async def probe(self, octet: int, pkt: p.SysAdminPacket, wait_s: float) -> p.SysAdminPacket | None: ...
    def send_now_many(self, batch: list[tuple[int, list[p.GeneralPacket]]]) -> Sent: ...
    def send_from_thread(self, batch: list[tuple[int, list[p.GeneralPacket]]]) -> Sent: ...
    def forget(self, octet: int, pkts: list[p.GeneralPacket],
               futs: list[asyncio.Future[p.GeneralPacket]]) -> None: ...
    def halt(self, octets: set[int]) -> set[int]: ...
