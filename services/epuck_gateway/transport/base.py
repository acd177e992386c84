"""What the WiFi and the serial link share: one surface whichever way a robot is reached.

Both links are driven the same way (start, close, `request_write` after changing the controller, `write_stop` for
the bus stop) and report the same things: the packets (`PacketsHandler`), the supervisor's state
(`StateHandler`, through `StateReporter`), framing errors, the time a requested write left (`WrittenHandler`) or a
stop owed to a robot whose link was down (`OwedHandler`), and one set of counters (`EpuckLinkStats`).

Health is the kit's link supervisor's (shared/link.py, docs/kit.md "Health"): a link reports what happens (opened,
data, garbage); both links are `shared.transport.AsyncTransport`s and run under the kit's one reconnect loop
(`AsyncReconnectLoop`: the attempts, their failures and the sessions' ends, on the supervisor's back-off, probing
once per probe period once the robot is `unreachable`). A link says how it opens (`_open`, a TCP connection or a
serial port) and what one session is (`_session`, until the link is lost: `_lose(reason)`).

A link's factory has the kit's one signature, `factory(settings, hooks: LinkHooks)`: the service's settings, and
what the robot's device gives its link (the robot's settings, the controller, the callbacks, the supervisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.epuck_gateway.protocol.wifi import EpuckController, FramingError, Packet
from services.epuck_gateway.settings import EpuckSerialRobot, EpuckWifiRobot
from shared.link import LinkPolicy, LinkState, SupervisedLink
from shared.transport import AsyncReconnectLoop, AsyncTransport, LinkEvent

log = logging.getLogger("robobus.epuck.link")
H = TypeVar("H")  # what one session of a link runs on: a TCP transport, a serial port


@dataclass
class EpuckLinkStats:
    connects: int = 0
    reconnects: int = 0
    framing_errors: int = 0
    packets: int = 0
    images: int = 0
    sensors: int = 0
    empty: int = 0
    bytes: int = 0
    commands_sent: int = 0
    commands_requested: int = 0  # state changes asked for; several coalesce into one write
    silences: int = 0
    reply_timeouts: int = 0  # serial: polls not answered in time
    garbage_bytes: int = 0  # bytes that cannot come from the robot (WiFi: a packet that failed its checks)
    resyncs: int = 0  # serial: resynchronisations written (transport/serial.py RESYNC): at each session's start and
    # whenever the line was out of step (a reply late, garbled, or followed by unasked bytes)
    resyncs_unanswered: int = 0  # serial: of those, the ones not answered within their window (written again)


PacketsHandler = Callable[[list[Packet], float], None]
# Told when the link supervisor's state changes: link open, state, message. The state is the supervisor's
# (docs/kit.md "Health"), `streaming` for operational: connecting, unreachable, connected (link open, no
# valid data yet), streaming, silent (link open, no valid data within the budget), lost, recovering, stopped.
StateHandler = Callable[[bool, str, str], None]
ErrorHandler = Callable[[FramingError], None]
# Told when a requested write has left the gateway: the wall-clock time, or None when the link went down
# before it could be written.
WrittenHandler = Callable[[float | None], None]
# Told when a stop owed to a robot whose link was down has left: the wall-clock time of the next connection's
# first command (speeds 0).
OwedHandler = Callable[[float], None]


def budget_s(seconds: float) -> float:
    """A liveness budget as given to the supervisor: rounded up to 0.1 s, so that the small changes of the
    image intervals seen do not change it with every image (the message says the budget applied)."""
    return max(0.1, math.ceil(seconds * 10 - 1e-6) / 10)


def standalone_link(policy: LinkPolicy) -> SupervisedLink:
    """A supervisor bound to no device (a link used on its own, in tests and tools): health goes nowhere."""
    return SupervisedLink(policy, lambda fields: None)


def link_policy(stale_s: float, backoff_min_s: float, backoff_max_s: float, probe_period_s: float) -> LinkPolicy:
    return LinkPolicy(liveness_s=budget_s(stale_s), backoff_min_s=backoff_min_s,
                      backoff_max_s=max(backoff_min_s, backoff_max_s), probe_period_s=probe_period_s)


class StateReporter:
    """Tells the service when the supervisor's state changed (its fail-safe: stop the wheels, drop stale data,
    one `link_lost` fault), with a message from the supervisor's details."""

    def __init__(self, sup: SupervisedLink, on_state: StateHandler) -> None:
        self.sup = sup
        self._on_state = on_state
        self._shown = ""

    def report(self, link_open: bool) -> None:
        st = self.sup.state
        name = "streaming" if st is LinkState.OPERATIONAL else st.value
        if name == self._shown:
            return
        self._shown = name
        d = self.sup.details()
        if st is LinkState.SILENT:
            age = d.get("last_data_age_s")
            msg = (f"no valid data from the robot for {age or 0.0:.1f} s (allowed {d['liveness_s']:.1f} s for "
                   "what it was asked to send)")
        elif st is LinkState.CONNECTED:
            msg = "link open; no valid data from the robot yet"
        elif st is LinkState.OPERATIONAL:
            msg = ""
        else:
            msg = str(d.get("last_failure", ""))
        self._on_state(link_open, name, msg)


@dataclass(frozen=True)
class LinkHooks:
    """What a robot's device gives its link (a transport factory's `hooks`)."""

    robot: EpuckWifiRobot | EpuckSerialRobot
    controller: EpuckController
    on_packets: PacketsHandler
    on_state: StateHandler
    on_framing_error: ErrorHandler
    supervisor: SupervisedLink


class LineDropped(Exception):
    """A typed ASCII line that moves the robot was waiting for its slot when the bus stop came: not written (the
    serial link's ASCII mode; here, so that the service catches it without importing a link)."""


class RobotLink(AsyncTransport, ABC, Generic[H]):
    """One robot's link: the surface both links share, run under the kit's reconnect loop. `run()` until
    `close()`; `request_write()` after changing the controller."""

    def __init__(self, name: str, controller: EpuckController, on_packets: PacketsHandler, on_state: StateHandler,
                 on_framing_error: ErrorHandler, supervisor: SupervisedLink | None, policy: LinkPolicy) -> None:
        self.name = name
        self.controller = controller
        self.stats = EpuckLinkStats()
        # the kit's supervisor decides the health: the service's device's, or (a link used on its own) one with
        # `policy` bound to no device
        self.sup = supervisor or standalone_link(policy)
        self._reporter = StateReporter(self.sup, on_state)
        self.connected = False
        self.motion_deadline: float | None = None  # time.monotonic() of the deadman's next stop, if any
        self.owed_stop: OwedHandler | None = None  # a bus stop decided while the link was down (write_stop)
        self._on_packets = on_packets
        self._on_framing_error = on_framing_error
        self._written: list[WrittenHandler] = []  # told when the write carrying the requested state has left
        self._dirty = False  # the controller holds state not yet written
        self._urgent = False  # that state is a stop that must not wait (request_write(urgent=True))
        self._lost: asyncio.Future[str] | None = None  # the current session's end, with its reason
        self._closing = False
        self._handle: H | None = None  # opened, its session not begun
        self._reconnect = AsyncReconnectLoop(self, self.sup, max_wait_s=math.inf)
        self._task: asyncio.Task[None] | None = None

    # -- public -------------------------------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.ensure_future(self.run())
        return self._task

    def request_write(self, on_written: WrittenHandler | None = None, urgent: bool = False) -> bool:
        """The controller changed: write its state as soon as the link may (`_write_soon`). `on_written` is told
        when the write carrying this state has left. `urgent` (the deadman's stop, a lost robot's stop): at once,
        past whatever limit the link keeps on writes the robot has not taken yet, and taken by the robot before
        anything written earlier (as the bus stop, `write_stop`)."""
        if not self.connected:
            return False
        self.stats.commands_requested += 1
        self._dirty = True
        self._urgent = self._urgent or urgent
        if on_written is not None:
            self._written.append(on_written)
        self._write_soon()
        return True

    @abstractmethod
    def write_stop(self, on_owed: OwedHandler) -> float | None:
        """The bus stop, already in the controller: write it now; the time it left, or None (link down: then
        `on_owed(time)` when the next session's first command, speeds 0, has left)."""

    def write_stop_from_thread(self) -> float | None:
        """The bus stop written from the stop's own thread, ahead of whatever the loop has queued: the time it
        left, or None when this link cannot write from there (the loop's pass writes it, `write_stop`). A serial
        write can wait for a full line: only a link that never blocks does it (transport/wifi.py)."""
        return None

    @abstractmethod
    async def close(self) -> None:
        """Stop the robot and leave the link for good."""

    # -- under the kit's reconnect loop ------------------------------------------------------------------------
    async def run(self) -> None:
        self._set_budget()
        await self._reconnect.run()

    async def open(self) -> None:
        self._handle = await self._open()

    async def run_session(self) -> str:
        handle, self._handle = self._handle, None
        assert handle is not None
        if self.stats.connects:
            self.stats.reconnects += 1
        self.stats.connects += 1
        reason = await self._session(handle)
        self._session_ended(reason)
        return reason

    def reported(self, event: LinkEvent) -> None:
        if event is LinkEvent.CLOSED:
            self._set_budget()
        self._report()

    @abstractmethod
    async def _open(self) -> H:
        """Open the link (raise `OpenFailed` with the reason)."""

    @abstractmethod
    async def _session(self, handle: H) -> str:
        """One session on an open link, until it is lost: the reason."""

    def _session_ended(self, reason: str) -> None:
        """After a session, before the supervisor hears of its end (close what the session leaves open)."""

    @abstractmethod
    def _set_budget(self) -> None:
        """Give the supervisor the liveness budget for what the robot was asked to send."""

    @abstractmethod
    def _write_soon(self) -> None:
        """The controller holds state not yet written (`_dirty`): write it as soon as the link may."""

    # -- helpers ----------------------------------------------------------------------------------------------
    def _report(self) -> None:
        self._reporter.report(self.connected)

    def _stop_reconnecting(self) -> None:
        """`close()` begins: no attempt any more, a wait in progress ends, nothing more is told to the supervisor."""
        self._closing = True
        self._reconnect.stop()

    def _lose(self, reason: str) -> None:
        """The current session is over (connection lost, port gone, framing error): `_session` returns `reason`."""
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(reason)

    def _tell_written(self, ts: float | None) -> None:
        """The waiting write listeners: the state they asked for left at `ts` (None: never written)."""
        written, self._written = self._written, []
        for cb in written:
            try:
                cb(ts)
            except Exception:
                log.exception("write listener failed", extra={"robot": self.name})

    async def _end_task(self) -> None:
        """Cancel the reconnect loop and wait for it to end."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
