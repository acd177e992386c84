"""One transport interface, and the one reconnect loop every transport runs under.

As python-can's `BusABC` is to its interfaces, `Transport` (a thread) and `AsyncTransport` (asyncio) are to a
service's ways of reaching its devices, real and simulated alike:

- `open()`: make the link (connect, open the port, answer a probe); raise `OpenFailed(reason)` when it cannot;
- `run_session()`: serve the open link until it ends, release what `open()` made, and return why it ended;
- `close()`: leave the link for good (the transport's own; it stops its `ReconnectLoop`);
- the service's own I/O methods beside those (requests, writes), and the **health hook**: what the transport tells
  the kit's link supervisor itself (`opened` when the link counts as open, `data(at=t)` for valid data, `garbage`).

`ReconnectLoop` (a thread) and `AsyncReconnectLoop` (a coroutine) are two thin drivers of one pure machine,
`ReconnectSteps`: attempt -> `open()` -> `run_session()` -> the end reported (`failed` or `closed`) -> wait what the
supervisor says (`next_attempt_in`: its back-off while lost, one probe per probe period once unreachable) -> again.
Closing is honoured at every wait, and nothing is reported to the link once closing (the shutdown reports
`stop`). A session's end is reported once: at the first of `lost(reason)` (the transport saw the loss on another
thread, and health says so at once) and the end of `run_session()`.

A factory of the `robobus.transports` entry points has one signature, `factory(settings, hooks) -> transport`
(`TransportFactory`): `hooks` is the service's own dataclass of what it gives its transport (callbacks, the
device's supervised link, what it has built). docs/kit.md, "Transports".
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["AsyncReconnectLoop", "AsyncTransport", "Attempt", "Done", "HealthHook", "LinkEvent", "LinkEvents",
           "OpenFailed", "ReconnectLoop", "ReconnectSteps", "Transport", "TransportFactory", "Wait", "on_clock"]

S_contra = TypeVar("S_contra", contravariant=True)
H_contra = TypeVar("H_contra", contravariant=True)
T_co = TypeVar("T_co", covariant=True)


class TransportFactory(Protocol[S_contra, H_contra, T_co]):
    """What a `robobus.transports` entry point names: `factory(settings, hooks)`, the transport not started."""

    def __call__(self, settings: S_contra, hooks: H_contra, /) -> T_co: ...


class OpenFailed(Exception):
    """A link could not be opened; the message says why (the supervisor counts it: never an `error`)."""


class HealthHook(Protocol):
    """What a transport tells the supervisor itself (`shared.link.SupervisedLink` is one)."""

    def opened(self) -> None: ...
    def data(self, at: float | None = None) -> None: ...
    def garbage(self, what: str) -> None: ...


class LinkEvent(enum.StrEnum):
    """What the loop told the link (`Transport.reported`)."""

    ATTEMPT = "attempt"
    FAILED = "failed"
    CLOSED = "closed"


class Transport(ABC):
    """A link served by a thread under `ReconnectLoop`."""

    @abstractmethod
    def open(self) -> None:
        """Make the link; `OpenFailed(reason)` when it cannot (release what was made before raising)."""

    @abstractmethod
    def run_session(self) -> str:
        """Serve the open link until it ends (or the loop closes); release it; the reason it ended."""

    @abstractmethod
    def close(self) -> None:
        """Leave the link for good (stop the loop: `ReconnectLoop.stop`)."""

    def reported(self, event: LinkEvent) -> None:  # noqa: B027 - a hook: most transports need nothing here
        """The loop has just told the link `event` (a transport that mirrors the link's state reports it here)."""


class AsyncTransport(ABC):
    """A link served on an asyncio loop under `AsyncReconnectLoop`."""

    @abstractmethod
    async def open(self) -> None:
        """As `Transport.open`."""

    @abstractmethod
    async def run_session(self) -> str:
        """As `Transport.run_session`."""

    @abstractmethod
    async def close(self) -> None:
        """Leave the link for good (stop the loop: `AsyncReconnectLoop.stop`)."""

    def reported(self, event: LinkEvent) -> None:  # noqa: B027 - a hook: most transports need nothing here
        """As `Transport.reported`."""


class LinkEvents(Protocol):
    """What the loop tells the link and asks of it, at `now`: `shared.link.LinkSupervisor` as it is, or a
    `SupervisedLink` on its own clock (`on_clock`)."""

    def attempt(self, now: float) -> None: ...
    def failed(self, now: float, reason: str) -> None: ...
    def closed(self, now: float, reason: str) -> None: ...
    def next_attempt_in(self, now: float) -> float: ...


class _Clocked(Protocol):
    def attempt(self) -> None: ...
    def failed(self, reason: str) -> None: ...
    def closed(self, reason: str) -> None: ...
    def next_attempt_in(self) -> float: ...


@dataclass(frozen=True)
class _OnClock:
    link: _Clocked

    def attempt(self, now: float) -> None:
        self.link.attempt()

    def failed(self, now: float, reason: str) -> None:
        self.link.failed(reason)

    def closed(self, now: float, reason: str) -> None:
        self.link.closed(reason)

    def next_attempt_in(self, now: float) -> float:
        return self.link.next_attempt_in()


def on_clock(link: _Clocked) -> LinkEvents:
    """A `SupervisedLink` as `LinkEvents`: it stamps every event with its own clock (the `now` given is ignored)."""
    return _OnClock(link)


# -- the pure machine -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    """Wait this long (or until closing), then ask again."""

    seconds: float


@dataclass(frozen=True)
class Attempt:
    """Open the link now (the attempt is reported already)."""


@dataclass(frozen=True)
class Done:
    """Closing: the loop ends."""


Action = Wait | Attempt | Done


class Phase(enum.StrEnum):
    IDLE = "idle"          # between attempts
    OPENING = "opening"    # an attempt under way
    SESSION = "session"    # the link is open
    CLOSED = "closed"      # for good


class ReconnectSteps:
    """The reconnect loop's decisions, pure: every time is passed in, the link is told what happens."""

    def __init__(self, link: LinkEvents, max_wait_s: float = 1.0) -> None:
        self.link = link
        self.max_wait_s = max_wait_s   # a long wait is cut in pieces: the supervisor's rhythm is read again
        self.phase = Phase.IDLE
        self.sessions = 0
        self._end_reported = False     # this session's end is told (lost() before the session returned)

    @property
    def closing(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def in_session(self) -> bool:
        return self.phase is Phase.SESSION

    def next_action(self, now: float) -> Action:
        """Between attempts: wait, attempt (reported here), or end."""
        if self.phase is Phase.CLOSED:
            return Done()
        if self.phase is not Phase.IDLE:
            raise RuntimeError(f"next_action while {self.phase.value}")
        wait = self.link.next_attempt_in(now)
        if wait > 0:
            return Wait(min(wait, self.max_wait_s))
        self.link.attempt(now)
        self.phase = Phase.OPENING
        return Attempt()

    def open_failed(self, now: float, reason: str) -> bool:
        """The attempt failed; True if the link was told (not closing)."""
        if self.phase is Phase.CLOSED:
            return False
        self.phase = Phase.IDLE
        self.link.failed(now, reason)
        return True

    def opened(self) -> None:
        """`open()` returned: the session starts."""
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.SESSION
        self.sessions += 1
        self._end_reported = False

    def lost(self, now: float, reason: str) -> bool:
        """The session's link is lost (seen on any thread): True if this told the link (once per session)."""
        if self.phase is not Phase.SESSION or self._end_reported:
            return False
        self._end_reported = True
        self.link.closed(now, reason)
        return True

    def session_over(self, now: float, reason: str) -> bool:
        """`run_session()` returned `reason`: its end is told unless it was already, or closing; True if told now."""
        told = self.lost(now, reason)
        if self.phase is Phase.SESSION:
            self.phase = Phase.IDLE
        return told

    def close(self) -> None:
        self.phase = Phase.CLOSED


# -- the two drivers --------------------------------------------------------------------------------------------
class ReconnectLoop:
    """`ReconnectSteps` on a thread, for a `Transport` reporting to `link` (a `SupervisedLink`)."""

    def __init__(self, transport: Transport, link: _Clocked, *, name: str, max_wait_s: float = 1.0) -> None:
        self.transport = transport
        self.steps = ReconnectSteps(on_clock(link), max_wait_s)
        self.name = name
        self._closing = threading.Event()
        self._lock = threading.Lock()  # the machine is driven from the loop's thread and `lost` from any
        self._thread: threading.Thread | None = None

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def start(self) -> ReconnectLoop:
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Closing: nothing more is reported, the loop ends at its next wait (a session ends when the transport's
        close makes it)."""
        with self._lock:
            self.steps.close()
        self._closing.set()

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds` unless closing comes first (a session's own rhythm); True when closing."""
        return self._closing.wait(seconds)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def lost(self, reason: str) -> bool:
        """The session's link is lost: health says so now (once per session; nothing once closing)."""
        with self._lock:
            told = self.steps.lost(time.monotonic(), reason)
        if told:
            self.transport.reported(LinkEvent.CLOSED)
        return told

    def run(self) -> None:
        t = self.transport
        while True:
            with self._lock:
                action = self.steps.next_action(time.monotonic())
            if isinstance(action, Done):
                return
            if isinstance(action, Wait):
                self._closing.wait(action.seconds)
                continue
            t.reported(LinkEvent.ATTEMPT)
            try:
                t.open()
            except OpenFailed as exc:
                with self._lock:
                    told = self.steps.open_failed(time.monotonic(), str(exc))
                if told:
                    t.reported(LinkEvent.FAILED)
                continue
            with self._lock:
                self.steps.opened()
            reason = "session ended"
            try:
                reason = t.run_session()
            finally:
                with self._lock:
                    told = self.steps.session_over(time.monotonic(), reason)
                if told:
                    t.reported(LinkEvent.CLOSED)


class AsyncReconnectLoop:
    """`ReconnectSteps` as a coroutine on the running loop, for an `AsyncTransport` reporting to `link`."""

    def __init__(self, transport: AsyncTransport, link: _Clocked, *, max_wait_s: float = 1.0) -> None:
        self.transport = transport
        self.steps = ReconnectSteps(on_clock(link), max_wait_s)
        self._wake = asyncio.Event()

    @property
    def closing(self) -> bool:
        return self.steps.closing

    def stop(self) -> None:
        """Closing: nothing more is reported; a wait in progress ends now."""
        self.steps.close()
        self._wake.set()

    def lost(self, reason: str) -> bool:
        """As `ReconnectLoop.lost` (on the loop's thread)."""
        told = self.steps.lost(time.monotonic(), reason)
        if told:
            self.transport.reported(LinkEvent.CLOSED)
        return told

    async def run(self) -> None:
        t = self.transport
        while True:
            action = self.steps.next_action(time.monotonic())
            if isinstance(action, Done):
                return
            if isinstance(action, Wait):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), action.seconds)
                continue
            t.reported(LinkEvent.ATTEMPT)
            try:
                await t.open()
            except OpenFailed as exc:
                if self.steps.open_failed(time.monotonic(), str(exc)):
                    t.reported(LinkEvent.FAILED)
                continue
            self.steps.opened()
            reason = await t.run_session()
            if self.steps.session_over(time.monotonic(), reason):
                t.reported(LinkEvent.CLOSED)
