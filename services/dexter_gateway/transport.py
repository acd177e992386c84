"""The TCP link to one Dexter (DexRun, port 50000): strict stop-and-wait, timeouts, keepalive, reconnect.

Blocking sockets, one `DexterLink` per arm. The caller's own thread (a command-pool thread, a job thread,
the status poller) does its exchange: it takes its turn in the arm's FIFO, writes the command, reads the
reply, and hands the link to the next caller. No thread hop sits between a caller and the robot, so a file
transfer runs at the robot's block round trip, not at the speed of hand-offs between threads.

* **One command in flight.** DexRun treats each `recv` as one command, so a second command in the same
  segment is lost (docs/reference/dexter.md §1); the wiki: "wait for the status to be returned before sending the next
  oplet". Callers queue in arrival order (FIFO, never interleaved); more than `queue_limit` waiting get
  `busy`.
* **A reply timeout per command** (DDE has none, §8), longer where DexRun legitimately waits: `F`
  (FIFO drain), `w` (flushes the FIFO first), `z` (its sleep), queued moves (no reply while the 16-deep
  FIFO is full), `S RunFile`. A timed-out link is reset (a late reply would be out of step) and the caller
  gets `timeout`.
* **Replies reassembled** from any segmentation (`ReplyAssembler`); each must echo the instruction id we
  sent and our oplet. An older id is a stale copy (a coalesced duplicate: dropped and counted); anything
  else means the byte stream is out of step: counted, the link is reset.
* **Keepalive**: DexRun closes a connection idle for 30 s (`SO_RCVTIMEO`, §1); after `keepalive_s` of
  silence the supervisor sends a `g` through the same FIFO. While idle it also peeks at the socket, so a
  close by the robot shows in health at once.
* **Inline** (`try_inline`): with the link idle, the dispatching thread (paho's) sends and waits a bounded
  time; a later reply is left to a `PendingExchange`, which keeps the turn until another thread has it.
* **Transfers own the link** (`hold()`): a file job takes its turn once and runs its blocks back to back
  on its own thread, still one command in flight, each with its reply timeout; a command that queues
  meanwhile goes between two blocks (the holder gives its turn to the waiters, then takes the next).
* **Connect** with a timeout, then a `g` probe: the link counts as open only once DexRun answers it (a
  second client's TCP connect completes in the kernel backlog and is never served while another client holds
  the arm, §1: an accepted socket is not a served link).
* **Health is the kit's** (shared/link.py, docs/kit.md "Health: one meaning in every service"): the link
  reports to its `SupervisedLink` what happens (`attempt`, `failed`, `opened` once the probe is answered,
  `data` for every valid reply, `garbage` for bytes that are not a DexRun reply, `closed` when a served link
  ends) and waits `next_attempt_in()` between attempts: the supervisor's back-off while the arm is `lost`, one
  probe per probe period once it is `unreachable`. The link keeps no liveness rule or state of its own;
  `config_fault` says only that the configuration is wrong (the host name does not resolve), for the service
  to report as a fault.
* **The bus stop** (`motion_stopped`, `stop_motion`): DexRun has no oplet, parameter or register that halts a
  move in progress (reference dexter.md §4: `w` drains the FIFO before it writes), so the link's stop is that no
  motion request (`protocol.moves`) leaves it while the stop is active: each is checked right before its write,
  under a lock the stop action takes, and the ones waiting for their turn are answered `stopped` at once.
* **Keepalive within the budget**: with nothing else on the link, a `g` goes out after
  min(`keepalive_s`, `liveness_s` - `reply_timeout_s`) of silence, so that a hung arm shows within one
  liveness budget even with no status polling (its `g` times out and the link is reset).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from services.dexter_gateway.link import (
    Cancelled,
    ChangeHandler,
    DecodeErrorHandler,
    DexterLinkConfig,
    DexterLinkError,
    DexterLinkStats,
    LinkHooks,
    LinkReply,
    MotionStopped,
    ReplyHandler,
)
from services.dexter_gateway.protocol import (
    MAX_INSTRUCTION_ID,
    MOTION_OPLETS,
    ProtocolError,
    Reply,
    ReplyAssembler,
    Request,
    build_request,
    decode_reply,
    moves,
    resolve_param,
)
from services.dexter_gateway.settings import DexterSettings
from shared.link import SupervisedLink
from shared.transport import OpenFailed, ReconnectLoop, Transport

log = logging.getLogger("robobus.dexter.link")


@dataclass
class _Turn:
    granted: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    motion: bool = False  # its request moves the arm (`protocol.moves`)
    stopped: str = ""  # the bus stop took its turn away: why


@dataclass
class _Sent:
    """A command written to the robot, its reply not yet read."""
    req: Request
    sock: socket.socket
    t0: float
    deadline: float
    timeout_s: float


class PendingExchange:
    """A command sent by `DexterLink.try_inline` whose reply did not come within the inline wait. It keeps the
    link's turn (stop-and-wait: queued commands stay behind it, in order) until `finish()` has its reply."""

    def __init__(self, link: DexterLink, sent: _Sent) -> None:
        self.link = link
        self.sent = sent
        self._done = False

    def finish(self) -> LinkReply:
        """Wait for the reply until the command's own deadline (from when it was sent); hand the turn on.
        Once only (the turn is released at the first call)."""
        if self._done:
            raise RuntimeError("this exchange has already finished")
        self._done = True
        try:
            rep = self.link._await(self.sent, None)
        finally:
            self.link._release()
        assert rep is not None  # no early return without a bound
        self.link.on_reply(rep)
        return rep


class LinkHold:
    """A turn kept for a run of exchanges (a file transfer): see `DexterLink.hold`."""

    def __init__(self, link: DexterLink, cancelled: Cancelled | None) -> None:
        self.link = link
        self.cancelled = cancelled
        self.held = True

    def exchange(self, req: Request, *, timeout_s: float | None = None) -> LinkReply:
        """One command of the run (a validated `Request`); strict stop-and-wait as `submit`."""
        link = self.link
        if link._turns:  # someone queued (a command, the poller): they go now, we take the next turn (FIFO)
            self.held = False
            link._release()
            link._acquire(self.cancelled)
            self.held = True
        link._check_up()
        rep = link._exchange(req, link.timeout_for(req) if timeout_s is None else timeout_s)
        link.on_reply(rep)
        return rep


class DexterLink(Transport):
    """One arm's link. `start()`; `request(oplet, args)` from any thread; `close()`. A `shared.transport.Transport`
    under the kit's reconnect loop: `open()` connects and has DexRun answer a probe, `run_session()` keeps the
    served link alive until it is lost."""

    def __init__(self, name: str, config: DexterLinkConfig, *, supervisor: SupervisedLink | None = None,
                 on_change: ChangeHandler | None = None, on_reply: ReplyHandler | None = None,
                 on_decode_error: DecodeErrorHandler | None = None,
                 keepalive_args: Callable[[], Sequence[str]] | None = None,
                 motion_stopped: MotionStopped | None = None) -> None:
        self.name = name
        self.config = config
        self.stats = DexterLinkStats()
        # the kit's supervisor of this link (a device's, from `Device.supervise_link`); standalone: one of its own
        self.sup = supervisor if supervisor is not None else SupervisedLink(config.policy(), lambda fields: None)
        self.serving = False  # connected and DexRun answered our probe
        self.message = ""  # why the link is not serving (for `unavailable` errors)
        self.config_fault = ""  # the configuration is wrong (the host name does not resolve); not: absent
        self.on_change = on_change or (lambda: None)
        self.on_reply = on_reply or (lambda r: None)
        self.on_decode_error = on_decode_error or (lambda what: None)
        self.keepalive_args = keepalive_args or (lambda: ())
        # the bus stop's state, read where it is kept (the node's stop latch): never a copy of it here
        self.motion_stopped = motion_stopped or (lambda: "")
        self._motion_lock = threading.Lock()  # a motion request's check and write; the stop action waits on it
        self._sock: socket.socket | None = None
        self._asm = ReplyAssembler()
        self._instr = 0
        self._last_tx = 0.0
        self._closing = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()  # guards the turn queue
        self._turns: deque[_Turn] = deque()
        self._held = False
        self._first: LinkReply | None = None  # the probe's reply: the session's first valid data
        self._loop = ReconnectLoop(self, self.sup, name=f"dexter-link-{name}")

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> DexterLink:
        self._loop.start()
        return self

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._turns)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._held or bool(self._turns)

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

    def request(self, oplet: str, args: Sequence[Any] = (), *, timeout_s: float | None = None,
                cancelled: Cancelled | None = None) -> LinkReply:
        """Send one command when it is this caller's turn and return its reply (blocking).
        Raises ProtocolError (invalid request) or DexterLinkError (unavailable, busy, timeout, device_error)."""
        return self.submit(self.prepare(oplet, args), timeout_s=timeout_s, cancelled=cancelled)

    def submit(self, req: Request, *, timeout_s: float | None = None, cancelled: Cancelled | None = None
               ) -> LinkReply:
        self._check_up()
        self._acquire(cancelled, moves(req.oplet, req.args))
        try:
            self._check_up()
            rep = self._exchange(req, self.timeout_for(req) if timeout_s is None else timeout_s)
        finally:
            self._release()
        self.on_reply(rep)
        return rep

    @contextlib.contextmanager
    def hold(self, cancelled: Cancelled | None = None) -> Iterator[LinkHold]:
        """Keep the turn for a run of exchanges: a file transfer's blocks go back to back on the caller's
        thread, with no turn taken and handed over per block (nor the status poller's `g` between them,
        nor a keepalive: the blocks are traffic). Waiters still get the link between two blocks."""
        self._check_up()
        self._acquire(cancelled)
        h = LinkHold(self, cancelled)
        try:
            yield h
        finally:
            if h.held:
                self._release()

    def stop_motion(self, why: str) -> float:
        """The bus stop's action on the link (the stop is already active where `motion_stopped` reads it): wait
        for a motion request's write in progress to leave, answer the motion requests waiting for their turn
        `stopped` (nothing of them is sent). Returns the Unix time from which no motion request leaves the link.
        What was sent before stays sent: DexRun runs its queued moves to their end."""
        with self._motion_lock:
            at = time.time()
        with self._lock:
            keep: deque[_Turn] = deque()
            for t in self._turns:
                if t.motion and not t.abandoned:
                    t.abandoned = True
                    t.stopped = why
                    self.stats.stopped += 1
                    t.granted.set()
                else:
                    keep.append(t)
            dropped = len(self._turns) - len(keep)
            self._turns = keep
        if dropped:
            log.warning("bus stop: queued motion requests dropped", extra={"arm": self.name, "dropped": dropped})
        return at

    def close(self) -> None:
        """Refuse new commands, fail the queued ones; the one in flight finishes; close the socket."""
        self._closing.set()
        self._loop.stop()
        self.sup.stop("shutdown")  # first: the teardown below is not a loss
        with self._lock:
            for t in self._turns:
                t.abandoned = True
                t.granted.set()
        self._lost.set()
        self._loop.join(5)
        with self._lock:
            held = self._held
        if not held:
            self._drop_socket()
        self.serving = False
        self.message = "gateway stopped"
        self.on_change()

    def reset(self, why: str) -> None:
        """Drop the connection (a timed-out or out-of-step link); the supervisor reconnects."""
        log.warning("resetting the link", extra={"arm": self.name, "why": why})
        self.message = why
        self._went_down(why)
        self._drop_socket()
        self._lost.set()

    # -- turns: FIFO, bounded ------------------------------------------------------------------------
    def _acquire(self, cancelled: Cancelled | None, motion: bool = False) -> None:
        with self._lock:
            if not self._held and not self._turns:
                self._held = True
                return
            if len(self._turns) >= self.config.queue_limit:
                self.stats.busy += 1
                raise DexterLinkError("busy", f"arm {self.name}: {self.config.queue_limit} commands already queued "
                                      "(one runs at a time)")
            turn = _Turn(motion=motion)
            self._turns.append(turn)
        while not turn.granted.wait(0.1):
            if (cancelled is not None and cancelled()) or self._closing.is_set():
                with self._lock:
                    if not turn.granted.is_set():
                        turn.abandoned = True
                        self._turns.remove(turn)
                        break
        if turn.stopped:  # taken out of the queue by `stop_motion`: it never had the turn
            raise DexterLinkError("stopped", f"arm {self.name}: the bus stop came while this motion request waited "
                                  f"for the link ({turn.stopped}): nothing was sent")
        if turn.abandoned or self._closing.is_set():
            if turn.granted.is_set() and not turn.abandoned:
                self._release()
            raise DexterLinkError("unavailable", f"arm {self.name}: gave up waiting for the link "
                                  f"({'stopping' if self._closing.is_set() else 'cancelled'})")

    def _release(self) -> None:
        with self._lock:
            while self._turns:
                nxt = self._turns.popleft()
                if not nxt.abandoned:
                    nxt.granted.set()  # the turn passes on; _held stays True
                    return
            self._held = False

    def _check_up(self) -> None:
        if self._closing.is_set():
            raise DexterLinkError("unavailable", f"arm {self.name}: the link is stopping")
        if not self.serving:
            raise DexterLinkError("unavailable", f"arm {self.name} ({self.config.host}:{self.config.port}) is not "
                                  "connected" + (f": {self.message}" if self.message else ""))

    # -- the inline path: a short wait on the dispatching thread ------------------------------------------
    def try_inline(self, req: Request, wait_s: float) -> LinkReply | PendingExchange | None:
        """When the link is idle (nothing in flight, no hold, nobody queued), send `req` on this thread and wait
        up to `wait_s` for its reply: the `LinkReply`, or a `PendingExchange` that still holds the turn (its
        `finish()`, on another thread, waits out the rest of the command's timeout exactly as `submit` would).
        None when the link is not idle: the caller goes the ordinary way (`submit`), and nothing was sent.
        Raises DexterLinkError as `submit` (unavailable, timeout, device_error)."""
        self._check_up()
        with self._lock:
            if self._held or self._turns:
                return None
            self._held = True
        done = False
        try:
            self._check_up()
            timeout_s = self.timeout_for(req)
            sent = self._send(req, timeout_s)
            rep = self._await(sent, time.monotonic() + wait_s)
            if rep is None:
                done = True  # the turn goes with the pending exchange
                return PendingExchange(self, sent)
        finally:
            if not done:
                self._release()
        self.on_reply(rep)
        return rep

    # -- one exchange (the caller holds the turn) ------------------------------------------------------
    def _exchange(self, req: Request, timeout_s: float) -> LinkReply:
        rep = self._await(self._send(req, timeout_s), None)
        assert rep is not None  # no early return without a bound
        return rep

    def _send(self, req: Request, timeout_s: float) -> _Sent:
        """Write the command (numbered with our next instruction id) in one write."""
        sock = self._sock
        if sock is None:
            raise DexterLinkError("unavailable", f"link to arm {self.name} lost: {self.message}")
        if moves(req.oplet, req.args):
            with self._motion_lock:  # the check and the write as one: `stop_motion` returns after both
                why = self.motion_stopped()
                if why:
                    self.stats.stopped += 1
                    raise DexterLinkError("stopped", f"arm {self.name}: {why}: nothing was sent")
                req, t0 = self._write(sock, req)
        else:
            req, t0 = self._write(sock, req)
        self._last_tx = t0
        self.stats.commands += 1
        if timeout_s > self.config.reply_timeout_s:
            # DexRun answers this one only when it is done (F, w, RunFile, z, a move into a full FIFO): the arm owes
            # no reply before then, and the strict stop-and-wait holds every status poll behind it
            self.sup.expect_silence(timeout_s)
        return _Sent(req, sock, t0, t0 + timeout_s, timeout_s)

    def _write(self, sock: socket.socket, req: Request) -> tuple[Request, float]:
        """Number the command with our next instruction id and write it (the caller holds the turn)."""
        self._instr = self._instr + 1 if self._instr < MAX_INSTRUCTION_ID else 1
        req = Request(req.oplet, req.args, self.config.job_id, self._instr, req.start_ms, req.end)
        t0 = time.monotonic()
        try:
            sock.sendall(req.encode())  # the whole command in one write (TCP_NODELAY: one segment)
        except OSError as exc:
            self._lose(f"send failed: {exc}")
            raise DexterLinkError("unavailable", f"link to arm {self.name} lost: {exc}") from None
        return req, t0

    def _await(self, sent: _Sent, until: float | None) -> LinkReply | None:
        """Read until the reply to `sent` is in (decoded, matched); None if `until` (monotonic) comes first
        (nothing is lost: the bytes read so far stay in the assembler, the turn stays with the caller)."""
        req, sock = sent.req, sent.sock
        pending: list[bytes] = []
        while True:
            while pending:
                raw = pending.pop(0)
                rep = self._match(req, raw)
                if rep is not None:
                    rtt = time.monotonic() - sent.t0
                    self._note_rtt(rtt)
                    if self.serving:  # the probe's reply opens the link (`_session`)
                        self.sup.data()
                    if pending:  # more replies in the same segment: copies nobody asked for
                        self.stats.stale_replies += len(pending)
                        self.on_decode_error(f"{len(pending)} unsolicited replies after {req.oplet!r} dropped")
                    return LinkReply(req, rep, rtt)
            now = time.monotonic()
            left = sent.deadline - now
            if left <= 0:
                self.stats.timeouts += 1
                msg = f"no reply to {req.oplet!r} within {sent.timeout_s:g} s; link reset"
                self.reset(msg)
                raise DexterLinkError("timeout", f"arm {self.name}: {msg}")
            if until is not None:
                if now >= until:
                    return None
                left = min(left, until - now)
            try:
                sock.settimeout(left)
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as exc:
                self._lose(f"connection lost: {exc}")
                raise DexterLinkError("unavailable", f"link to arm {self.name} lost before the reply to "
                                      f"{req.oplet!r}: {exc}") from None
            if not data:
                self._lose("connection closed by the robot")
                raise DexterLinkError("unavailable", f"link to arm {self.name} closed by the robot before the "
                                      f"reply to {req.oplet!r}")
            pending += self._asm.feed(data)

    def _match(self, req: Request, raw: bytes) -> Reply | None:
        try:
            rep = decode_reply(raw)
        except ProtocolError as exc:
            self._out_of_step(str(exc))
        if rep.instruction_id == req.instruction_id and rep.oplet == req.oplet:
            return rep
        if 0 < rep.instruction_id < req.instruction_id:  # an older reply again (a coalesced copy): stale
            self.stats.stale_replies += 1
            self.on_decode_error(f"stale reply to instruction {rep.instruction_id} ({rep.oplet!r}) dropped")
            return None
        self._out_of_step(f"reply to instruction {rep.instruction_id} ({rep.oplet!r}) was not asked for")

    def _out_of_step(self, why: str) -> NoReturn:
        self.stats.out_of_step += 1
        self.on_decode_error(why)
        self.sup.garbage(why)  # counted; it proves nothing alive
        msg = f"reply stream out of step ({why}); link reset"
        self.reset(msg)
        raise DexterLinkError("device_error", f"arm {self.name}: {msg}")

    def _note_rtt(self, rtt: float) -> None:
        ms = rtt * 1000
        s = self.stats
        s.rtt_last_ms = round(ms, 3)
        s.rtt_avg_ms = round(ms if s.rtt_avg_ms == 0 else s.rtt_avg_ms + (ms - s.rtt_avg_ms) / 16, 3)
        s.rtt_max_ms = round(max(s.rtt_max_ms, ms), 3)

    def _went_down(self, why: str) -> None:
        """The served link ends: the supervisor hears it once, at once, from the thread that saw it (the kit's loop:
        `closed`, lost, reconnecting with back-off; nothing while closing: the supervisor is stopped already)."""
        if self.serving:
            self.serving = False
            self._loop.lost(why)
            self.on_change()

    def _lose(self, why: str) -> None:
        if not self._lost.is_set():
            self.message = why
        self._went_down(why)
        self._drop_socket()
        self._lost.set()

    def _drop_socket(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()

    # -- under the kit's reconnect loop: connect and probe, then keep the link alive ---------------------------
    def _set_config_fault(self, fault: str) -> None:
        if fault != self.config_fault:
            self.config_fault = fault
            self.on_change()

    def _failed(self, why: str) -> OpenFailed:
        """An attempt that did not give a served link: counted by the supervisor (the loop), never an error."""
        self.message = why
        return OpenFailed(why)

    def open(self) -> None:
        """Connect, then have DexRun answer a `g` probe: only a served link counts as open (the loop waits what the
        kit's supervisor says between attempts: its back-off while lost; one probe per probe period once the arm
        is unreachable)."""
        cfg = self.config
        try:
            sock = socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout_s)
        except socket.gaierror as exc:  # the host name does not resolve: the configuration is wrong
            why = f"cannot resolve {cfg.host!r}: {exc}"
            self._set_config_fault(why)
            raise self._failed(why) from None
        except OSError as exc:
            self._set_config_fault("")
            raise self._failed(f"cannot connect to {cfg.host}:{cfg.port}: {exc or 'timeout'}") from None
        self._set_config_fault("")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._asm.reset()
        self._lost.clear()
        probe = build_request("g", self.keepalive_args(), job_id=self.config.job_id, firmware=self.config.firmware)
        self._acquire(None)
        try:
            self._first = self._exchange(probe, self.config.reply_timeout_s)
        except DexterLinkError as exc:
            msg = exc.message
            if exc.code == "timeout":
                msg = ("connected, but DexRun did not answer within "
                       f"{self.config.reply_timeout_s:g} s (another client may hold the arm, or it hangs)")
            self._drop_socket()
            raise self._failed(msg) from None  # a peer that is not DexRun sent garbage: counted (`_out_of_step`)
        finally:
            self._release()

    def run_session(self) -> str:
        """Keep the served link alive until it is lost."""
        first, self._first = self._first, None
        assert first is not None
        self.stats.connects += 1
        if self.stats.connects > 1:
            self.stats.reconnects += 1
        self.sup.opened()  # DexRun serves us: the link is open, and the probe's reply is its first valid data
        self.sup.data()
        self.serving = True
        self.message = ""
        self.on_change()
        log.info("arm connected", extra={"arm": self.name, "host": self.config.host, "port": self.config.port})
        self.on_reply(first)
        ka = self.config.idle_probe_s
        while not self._lost.wait(min(0.25, ka / 2)):
            if self._closing.is_set():
                break
            if time.monotonic() - self._last_tx >= ka and not self.busy:
                self.stats.keepalives += 1
                with contextlib.suppress(DexterLinkError, ProtocolError):
                    self.request("g", self.keepalive_args())
            elif not self.busy:
                self._peek()
        why = self.message or "link closed"
        self._went_down(why)
        return why

    def _peek(self) -> None:
        """While idle: has the robot closed the connection (DexRun's idle close, a reboot)?"""
        with self._lock:
            if self._held or self._turns:
                return
            self._held = True
        try:
            sock = self._sock
            if sock is None:
                return
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                try:
                    data = sock.recv(4096, socket.MSG_PEEK)
                except OSError as exc:
                    self._lose(f"connection lost: {exc}")
                    return
                if not data:
                    self._lose("connection closed by the robot")
        finally:
            self._release()


def tcp_link(settings: DexterSettings, hooks: LinkHooks) -> DexterLink:
    """Transport `dexter-gateway.tcp` (ROBOBUS_DEXTER_TRANSPORT=tcp, the default; entry point `robobus.transports`):
    the arm's link to DexRun at `hooks.config.host:port`, not started (the arm starts it). The simulator (sim.py) is
    a peer on the same wire, reached at the host and port an arm's settings give."""
    return DexterLink(hooks.name, hooks.config, supervisor=hooks.supervisor, on_change=hooks.on_change,
                      on_reply=hooks.on_reply, on_decode_error=hooks.on_decode_error,
                      keepalive_args=hooks.keepalive_args, motion_stopped=hooks.motion_stopped)
