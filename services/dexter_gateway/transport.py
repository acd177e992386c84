"""The TCP link to one Dexter (DexRun, port 50000): strict stop-and-wait, timeouts, keepalive, reconnect.

asyncio, one `DexterLink` per arm, on the service's loop.

* **One command in flight.** DexRun treats each `recv` as one command, so a second command in the same
  segment is lost (reference §1); the wiki: "wait for the status to be returned before sending the next
  oplet". Callers (several MQTT clients, jobs, the status poll, the keepalive) go through one queue,
  served in order; a full queue answers `busy`.
* **A reply timeout per command** (DDE has none, §8), longer where DexRun legitimately waits: `F`
  (FIFO drain), `w` (flushes the FIFO first), `z` (its sleep), queued moves (no reply while the 16-deep
  FIFO is full), `S RunFile`. A timed-out link is reset (a late reply would be out of step) and the caller
  gets `timeout`.
* **Replies reassembled** from any segmentation (`ReplyAssembler`); each must echo the instruction id we
  sent and our oplet. An older id is a stale copy (dropped and counted); anything else means the byte
  stream is out of step: counted, the link is reset.
* **Keepalive**: DexRun closes a connection idle for 30 s (`SO_RCVTIMEO`, §1); after `keepalive_s` of
  silence a `g` goes out through the same queue.
* **Connect** with a timeout, a `g` probe (a second client is accepted by the kernel but never served
  while another holds the arm), then capped exponential backoff between attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.dexter_gateway.protocol import (
    MOTION_OPLETS,
    Firmware,
    ProtocolError,
    Reply,
    ReplyAssembler,
    Request,
    build_request,
    decode_reply,
    resolve_param,
)

log = logging.getLogger("robobus.dexter.link")


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
    reconnect_max_s: float = 5.0
    queue_limit: int = 64
    job_id: int = 1


@dataclass
class DexterLinkStats:
    connects: int = 0
    reconnects: int = 0
    commands: int = 0
    timeouts: int = 0
    out_of_step: int = 0
    stale_replies: int = 0
    keepalives: int = 0
    busy: int = 0
    rtt_last_ms: float = 0.0
    rtt_avg_ms: float = 0.0  # exponentially weighted, 1/16
    rtt_max_ms: float = 0.0


@dataclass
class LinkReply:
    request: Request
    reply: Reply
    rtt_s: float


@dataclass
class _Pending:
    request: Request
    timeout_s: float
    future: asyncio.Future[LinkReply]


StateHandler = Callable[[bool, str, str], None]  # connected, state, message
ReplyHandler = Callable[[LinkReply], None]
DecodeErrorHandler = Callable[[str], None]


class _Wire(asyncio.Protocol):
    def __init__(self, link: DexterLink) -> None:
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link._on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._on_lost(f"connection lost: {exc}" if exc else "connection closed by the robot")


class DexterLink:
    """One arm's link. `start()` on the loop; `await request(oplet, args)`; `await close()`."""

    def __init__(self, name: str, config: DexterLinkConfig, *, on_state: StateHandler | None = None,
                 on_reply: ReplyHandler | None = None, on_decode_error: DecodeErrorHandler | None = None,
                 keepalive_args: Callable[[], Sequence[str]] | None = None) -> None:
        self.name = name
        self.config = config
        self.stats = DexterLinkStats()
        self.serving = False  # connected and DexRun answered our probe
        self.state = "starting"
        self.message = ""
        self._on_state = on_state or (lambda c, s, m: None)
        self._on_reply = on_reply or (lambda r: None)
        self._on_decode_error = on_decode_error or (lambda what: None)
        self._keepalive_args = keepalive_args or (lambda: ())
        self._queue: asyncio.Queue[_Pending] | None = None
        self._asm = ReplyAssembler()
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Future[str] | None = None
        self._inflight: tuple[Request, asyncio.Future[Reply]] | None = None
        self._instr = 0
        self._last_tx = 0.0
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        self._queue = asyncio.Queue(self.config.queue_limit)
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())
        return self._task

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    @property
    def busy(self) -> bool:
        return self._inflight is not None or self.queued > 0

    def prepare(self, oplet: str, args: Sequence[Any] = ()) -> Request:
        """Validate now (ProtocolError), so nothing invalid is ever queued."""
        return build_request(oplet, args, job_id=self.config.job_id, firmware=self.config.firmware)

    def timeout_for(self, req: Request) -> float:
        c = self.config
        if req.oplet in ("F", "w"):
            return c.motion_timeout_s
        if req.oplet == "z":
            return int(req.args[0]) / 1e6 + c.reply_timeout_s
        if req.oplet in MOTION_OPLETS:
            return c.fifo_timeout_s
        if req.oplet == "S" and resolve_param(req.args[0]) == "RunFile":
            return c.motion_timeout_s
        return c.reply_timeout_s

    async def request(self, oplet: str, args: Sequence[Any] = (), *, timeout_s: float | None = None) -> LinkReply:
        """Queue one command and wait for its reply. Raises ProtocolError (invalid), DexterLinkError."""
        return await self.submit(self.prepare(oplet, args), timeout_s=timeout_s)

    async def submit(self, req: Request, *, timeout_s: float | None = None) -> LinkReply:
        if self._queue is None or self._closing:
            raise DexterLinkError("unavailable", f"arm {self.name}: the link is stopping")
        if not self.serving:
            raise DexterLinkError("unavailable", f"arm {self.name} ({self.config.host}:{self.config.port}) is not "
                                  f"connected" + (f": {self.message}" if self.message else ""))
        fut: asyncio.Future[LinkReply] = asyncio.get_running_loop().create_future()
        pending = _Pending(req, self.timeout_for(req) if timeout_s is None else timeout_s, fut)
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            self.stats.busy += 1
            raise DexterLinkError("busy", f"arm {self.name}: {self.config.queue_limit} commands already queued "
                                  "(one runs at a time)") from None
        return await fut

    async def close(self) -> None:
        """Refuse new commands, fail the queued ones, let the one in flight finish briefly, close."""
        self._closing = True
        self._fail_queued("unavailable", "the gateway is stopping")
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._inflight[1]), 1.0)
        if self._wake is not None:
            self._wake.set()
        self._drop_transport()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def reset(self, why: str) -> None:
        """Drop the connection (a timed-out or out-of-step link); the run loop reconnects."""
        log.warning("resetting the link", extra={"arm": self.name, "why": why})
        self._on_lost(why)
        self._drop_transport()

    # -- connection loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        delay = cfg.reconnect_min_s
        while not self._closing:
            self._set_state(False, "connecting", self.message)
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_connection(lambda: _Wire(self), cfg.host, cfg.port), cfg.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                self._set_state(False, "disconnected", f"cannot connect to {cfg.host}:{cfg.port}: {exc or 'timeout'}")
                await self._pause(delay)
                delay = min(delay * 2, cfg.reconnect_max_s)
                continue
            assert isinstance(transport, asyncio.Transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):  # one 256-byte write per command: never wait for Nagle
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._transport = transport
            self._lost = loop.create_future()
            self._asm.reset()
            served = await self._session()
            if self._closing:
                break
            self._set_state(False, "disconnected", self.message)
            delay = cfg.reconnect_min_s if served else min(delay * 2, cfg.reconnect_max_s)
            await self._pause(delay)

    async def _session(self) -> bool:
        """Probe, then serve the queue until the link is lost. True if DexRun answered us."""
        assert self._lost is not None and self._queue is not None
        probe = build_request("g", self._keepalive_args(), job_id=self.config.job_id, firmware=self.config.firmware)
        try:
            first = await self._exchange(probe, self.config.reply_timeout_s)
        except DexterLinkError as exc:
            msg = exc.message
            if exc.code == "timeout":
                msg = ("connected, but DexRun did not answer within "
                       f"{self.config.reply_timeout_s:g} s (another client may hold the arm)")
            self.message = msg
            self._drop_transport()
            return False
        self.stats.connects += 1
        if self.stats.connects > 1:
            self.stats.reconnects += 1
        self.serving = True
        self.message = ""
        self._set_state(True, "connected", "")
        log.info("arm connected", extra={"arm": self.name, "host": self.config.host, "port": self.config.port})
        self._on_reply(first)
        keepalive = asyncio.ensure_future(self._keepalive())
        try:
            while True:
                getter = asyncio.ensure_future(self._queue.get())
                waiting: set[asyncio.Future[Any]] = {getter, self._lost}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await getter
                    if getter.done() and not getter.cancelled():  # got one in the same instant: put back
                        self._fail_one(getter.result())
                    break
                pending = getter.result()
                if pending.future.done():  # the caller gave up before it was sent
                    continue
                req = dataclasses.replace(pending.request, job_id=self.config.job_id)
                try:
                    rep = await self._exchange(req, pending.timeout_s)
                except DexterLinkError as exc:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                    if self._lost.done():
                        break
                    continue
                if not pending.future.done():
                    pending.future.set_result(rep)
                self._on_reply(rep)
        finally:
            keepalive.cancel()
            self.serving = False
            self._drop_transport()
            self._fail_queued("unavailable", f"link to arm {self.name} lost: {self.message}")
        return True

    async def _exchange(self, req: Request, timeout_s: float) -> LinkReply:
        """Send one request and wait for its reply (the only place that writes)."""
        assert self._lost is not None
        if self._transport is None or self._transport.is_closing() or self._lost.done():
            raise DexterLinkError("unavailable", f"link to arm {self.name} lost: {self.message}")
        self._instr = self._instr + 1 if self._instr < 2**31 - 1 else 1
        req = dataclasses.replace(req, instruction_id=self._instr)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._inflight = (req, fut)
        t0 = time.monotonic()
        self._transport.write(req.encode())  # the whole command in one write
        self._last_tx = t0
        self.stats.commands += 1
        try:
            waiting: set[asyncio.Future[Any]] = {fut, self._lost}
            done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._inflight = None
        if fut in done and not fut.cancelled() and fut.exception() is None:
            rtt = time.monotonic() - t0
            self._note_rtt(rtt)
            return LinkReply(req, fut.result(), rtt)
        if fut.done() and not fut.cancelled() and fut.exception() is not None:
            exc = fut.exception()
            assert isinstance(exc, DexterLinkError)
            raise exc
        fut.cancel()
        if self._lost.done():
            raise DexterLinkError("unavailable", f"link to arm {self.name} lost before the reply to "
                                  f"{req.oplet!r}: {self._lost.result()}")
        self.stats.timeouts += 1
        self.message = f"no reply to {req.oplet!r} within {timeout_s:g} s; link reset"
        self.reset(self.message)
        raise DexterLinkError("timeout", f"arm {self.name}: {self.message}")

    def _note_rtt(self, rtt: float) -> None:
        ms = rtt * 1000
        s = self.stats
        s.rtt_last_ms = round(ms, 3)
        s.rtt_avg_ms = round(ms if s.rtt_avg_ms == 0 else s.rtt_avg_ms + (ms - s.rtt_avg_ms) / 16, 3)
        s.rtt_max_ms = round(max(s.rtt_max_ms, ms), 3)

    async def _keepalive(self) -> None:
        """A `g` through the queue after `keepalive_s` of silence, so DexRun's 30 s idle close never fires."""
        ka = self.config.keepalive_s
        while True:
            idle = time.monotonic() - self._last_tx
            if idle >= ka and not self.busy:
                self.stats.keepalives += 1
                with contextlib.suppress(DexterLinkError):
                    await self.request("g", self._keepalive_args())
                continue
            await asyncio.sleep(max(ka - idle, 0.01) if not self.busy else ka / 4)

    def _fail_one(self, pending: _Pending) -> None:
        if not pending.future.done():
            pending.future.set_exception(DexterLinkError("unavailable", f"link to arm {self.name} lost"))

    def _fail_queued(self, code: str, message: str) -> None:
        if self._queue is None:
            return
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(DexterLinkError(code, message))

    async def _pause(self, seconds: float) -> None:
        assert self._wake is not None
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _set_state(self, connected: bool, state: str, message: str) -> None:
        self.state = state
        self.message = message
        self._on_state(connected, state, message)

    def _drop_transport(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            t.close()

    # -- protocol callbacks ----------------------------------------------------------------------
    def _on_lost(self, reason: str) -> None:
        if self._lost is not None and not self._lost.done():
            if not self.message:
                self.message = reason
            self._lost.set_result(reason)

    def _on_data(self, data: bytes) -> None:
        for raw in self._asm.feed(data):
            try:
                rep = decode_reply(raw)
            except ProtocolError as exc:
                self._out_of_step(str(exc))
                return
            inflight = self._inflight
            if inflight is not None and not inflight[1].done() and rep.instruction_id == inflight[0].instruction_id \
                    and rep.oplet == inflight[0].oplet:
                inflight[1].set_result(rep)
                continue
            if 0 < rep.instruction_id <= self._instr:  # an older reply again (a coalesced copy): stale
                self.stats.stale_replies += 1
                self._on_decode_error(f"stale reply to instruction {rep.instruction_id} ({rep.oplet!r}) dropped")
                continue
            self._out_of_step(f"reply to instruction {rep.instruction_id} ({rep.oplet!r}) was not asked for")
            return

    def _out_of_step(self, why: str) -> None:
        self.stats.out_of_step += 1
        self._on_decode_error(why)
        self.message = f"reply stream out of step ({why}); link reset"
        inflight = self._inflight
        if inflight is not None and not inflight[1].done():
            inflight[1].set_exception(DexterLinkError("device_error", f"arm {self.name}: {self.message}"))
        self.reset(self.message)
