"""An arm's link as the device sees it: its configuration, its errors and replies, what the device gives the
transport (`LinkHooks`) and what it drives (`ArmLink`). The device module and the service import this, never the
transport's module: the transport (`tcp`: transport.py's `DexterLink`) is loaded by name, through the kit's
transport loader (docs/kit.md, "Transports"), and made by its factory with the kit's one signature,
`factory(settings, hooks: LinkHooks) -> ArmLink`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from services.dexter_gateway.protocol import Firmware, Reply, Request
from services.dexter_gateway.settings import DexterSettings
from shared.link import LinkPolicy, SupervisedLink
from shared.transport import TransportFactory


class DexterLinkError(Exception):
    """A command that did not complete; `code` is one of the contract's error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class DexterLinkConfig:
    host: str
    port: int = 50000
    firmware: Firmware = Firmware.NEWEST
    connect_timeout_s: float = 3.0
    reply_timeout_s: float = 2.0
    motion_timeout_s: float = 300.0  # F / w / RunFile: until the motion FIFO has drained
    fifo_timeout_s: float = 120.0  # a queued move while the FIFO is full: until a slot frees
    keepalive_s: float = 10.0  # DexRun closes after 30 s of silence
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 2.0
    liveness_s: float = 3.0  # valid data must come within this (the kit's supervisor: silent / unreachable)
    probe_period_s: float = 3.0  # an unreachable arm: one attempt per period
    queue_limit: int = 64
    job_id: int = 1

    def policy(self) -> LinkPolicy:
        """The link's budget and reconnect rhythm, for the kit's supervisor."""
        return LinkPolicy(liveness_s=self.liveness_s, backoff_min_s=self.reconnect_min_s,
                          backoff_max_s=max(self.reconnect_max_s, self.reconnect_min_s),
                          probe_period_s=self.probe_period_s)

    @property
    def idle_probe_s(self) -> float:
        """Silence after which the link sends a `g`: DexRun's idle close (keepalive_s < 30 s), and soon enough
        that its reply, or its timeout, comes within one liveness budget."""
        return max(0.05, min(self.keepalive_s, self.liveness_s - self.reply_timeout_s))


@dataclass
class DexterLinkStats:
    connects: int = 0  # sessions: DexRun answered our probe
    reconnects: int = 0
    commands: int = 0
    timeouts: int = 0
    out_of_step: int = 0
    stale_replies: int = 0
    keepalives: int = 0
    busy: int = 0
    stopped: int = 0  # motion requests the bus stop kept from the arm (queued, or checked at the write)
    rtt_last_ms: float = 0.0
    rtt_avg_ms: float = 0.0  # exponentially weighted, 1/16
    rtt_max_ms: float = 0.0


@dataclass
class LinkReply:
    request: Request
    reply: Reply
    rtt_s: float


ChangeHandler = Callable[[], None]  # serving or config_fault changed
ReplyHandler = Callable[[LinkReply], None]
DecodeErrorHandler = Callable[[str], None]
Cancelled = Callable[[], bool]
MotionStopped = Callable[[], str]  # why motion may not be sent now ("" when it may)




@dataclass(frozen=True)
class LinkHooks:
    """What an arm gives its link (a transport factory's `hooks`)."""

    name: str
    config: DexterLinkConfig
    supervisor: SupervisedLink | None = None
    on_change: ChangeHandler | None = None
    on_reply: ReplyHandler | None = None
    on_decode_error: DecodeErrorHandler | None = None
    keepalive_args: Callable[[], Sequence[str]] | None = None
    motion_stopped: MotionStopped | None = None


class PendingReply(Protocol):
    """A command sent inline whose reply is still to come; it keeps the link's turn until `finish()`."""

    def finish(self) -> LinkReply: ...


class Hold(Protocol):
    """A turn kept for a run of exchanges (a file transfer); `held`: the turn is this run's now."""

    held: bool

    def exchange(self, req: Request, *, timeout_s: float | None = None) -> LinkReply: ...


class ArmLink(Protocol):
    """What the arm drives of its link (transport.py's `DexterLink`)."""

    config: DexterLinkConfig
    stats: DexterLinkStats
    serving: bool
    message: str
    config_fault: str

    def start(self) -> Any: ...
    def close(self) -> None: ...
    @property
    def queued(self) -> int: ...
    @property
    def busy(self) -> bool: ...
    def prepare(self, oplet: str, args: Sequence[Any] = ()) -> Request: ...
    def request(self, oplet: str, args: Sequence[Any] = (), *, timeout_s: float | None = None,
                cancelled: Cancelled | None = None) -> LinkReply: ...
    def submit(self, req: Request, *, timeout_s: float | None = None,
               cancelled: Cancelled | None = None) -> LinkReply: ...
    def try_inline(self, req: Request, wait_s: float) -> LinkReply | PendingReply | None: ...
    def hold(self, cancelled: Cancelled | None = None) -> AbstractContextManager[Hold]: ...
    def stop_motion(self, why: str) -> float: ...


# what a `robobus.transports` entry point `dexter-gateway.<name>` names (`tcp`: transport.py's `tcp_link`): loaded
# by name once when the service is built, called once per arm
LinkFactory = TransportFactory[DexterSettings, LinkHooks, ArmLink]
