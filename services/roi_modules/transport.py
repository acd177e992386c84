"""The ROI UDP network: one process owns both sockets (57344 general, 57664 SysAdmin) on the host's address.

The reply is the acknowledgement (docs/reference/roi.md §5.4): a request is resent every `timeout_s` (50 ms) up to
`max_retries` (10) times, then abandoned and counted as lost.

Whether a module is alive is not decided here: the transport reports every matched reply (`on_reply`) and
every datagram from a module that does not decode (`on_garbage`), and the service's link supervisor
(shared/link.py) turns them into health. The caller says how a module is doing through `live(octet)`: a
request to a module that is not live is sent once (no resend ladder to an address nothing answers).

What the original Transport Agent got wrong (§5.5), fixed here:
- replies are matched to requests by source octet, port, subDeviceID and action code (PING -> PONG): the
  original compared an octet string with an int, so nothing ever matched and every packet was resent until
  abandoned;
- the destination address is `<prefix>.<octet>`, built from validated parts (the original used str.replace
  on the whole address, which rewrites every matching digit);
- a reply that matches no request is counted (per module and in total), not published as if it had.
Requests to one module are serialised per port (one in flight: the firmware answers strictly in order and two
requests with the same key could not be told apart); different modules are served concurrently. In that
per-module queue a command goes before the maintain loop's background traffic (`background_traffic()`), and
a background request whose reply is overdue hands the module to a waiting command before it resends, so a
command never waits out a 50 ms resend timer of maintain traffic (see `_Slot`).

The bus stop does not queue at all (`send_now_many`): every module's datagrams are written to the socket at once,
each module's first before any module's second, whatever the module's request in flight, and their replies are
taken as they come. A motion request carries a guard (`guard_sends`, set by the module for its motion commands):
asked before every send and resend, it refuses the request from the moment the bus stop is active, and `halt`
wakes such a request at once when the stop comes, so that no motion datagram follows the stop's. The resend rules
themselves are resend.py's pure `Ladder`, driven here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.roi_modules import protocol as p
from services.roi_modules.link import (
    LinkStats,
    RequestLost,
    RequestRefused,
    TransportConfig,
    TransportHooks,
    background_traffic,
    check_octet,
    guard_sends,
    is_background,
    module_address,
    send_guard,
)
from services.roi_modules.resend import Ladder, Step
from services.roi_modules.settings import RoiSettings
from shared import ServiceUnavailable
from shared.stop_pass import short_switch_interval

log = logging.getLogger("robobus.roi.transport")

# the transport itself, and (for whoever drives it directly: tests, benches) link.py's names it uses
__all__ = ["LinkStats", "RequestLost", "RequestRefused", "RoiTransport", "TransportConfig", "background_traffic",
           "check_bindable", "guard_sends", "module_address", "udp_transport"]


Key = tuple[int, int, int, int]  # octet, port, subDeviceID (-1 for SysAdmin), reply action


@dataclass
class _Pending:
    fut: asyncio.Future[Any]
    sent_at: float = 0.0
    guard: Callable[[], str] | None = None  # the request's guard (halt asks it)


_WAKE = object()  # a pending request's future set by `halt`: decide again (its guard may refuse it now)
class _Slot:
    """One module port's single request in flight, handed over in priority order: commands first (FIFO among
    themselves), then background requests (FIFO). Hand-over keeps the slot busy, so nobody can jump in."""

    def __init__(self) -> None:
        self.busy = False
        self.urgent: deque[tuple[asyncio.Future[None], Key, bytes]] = deque()
        self.background: deque[asyncio.Future[None]] = deque()

    async def acquire(self, urgent: bool, key: Key, data: bytes) -> None:
        if not self.busy and not self.urgent and not self.background:
            self.busy = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (fut, key, data)
        if urgent:
            self.urgent.append(entry)
        else:
            self.background.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed the slot just as we were cancelled: pass it on
            elif urgent:
                # a release() between our cancellation and now has already popped (and skipped) our entry
                with contextlib.suppress(ValueError):
                    self.urgent.remove(entry)
            else:
                with contextlib.suppress(ValueError):
                    self.background.remove(fut)
            raise

    def release(self) -> None:
        while self.urgent or self.background:
            fut = self.urgent.popleft()[0] if self.urgent else self.background.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot stays busy: it is theirs now
                return
        self.busy = False

    def command_waiting(self, key: Key, data: bytes) -> bool:
        """A command waits that may go first. Not one with our key but other bytes: a late reply to our
        unanswered send would match it and be taken for its own answer (identical bytes: any reply fits)."""
        return any(k != key or d == data for _, k, d in self.urgent)


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, owner: RoiTransport, port: int) -> None:
        self.owner = owner
        self.port = port

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.owner._on_datagram(self.port, data, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: the resend timer covers it
        log.debug("socket error", extra={"port": self.port, "error": str(exc)})


@dataclass
class TransportTotals:
    unmatched: int = 0  # replies matching no request, from any source
    foreign: int = 0  # datagrams from outside the prefix or from an octet we do not serve
    decode_errors: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class RoiTransport:
    """Request/reply over the ROI UDP ports; coroutines run on one asyncio loop."""

    def __init__(self, cfg: TransportConfig, octets: list[int], *,
                 live: Callable[[int], bool] | None = None,
                 on_reply: Callable[[int, int, p.GeneralPacket | p.SysAdminPacket], None] | None = None,
                 on_garbage: Callable[[int, str], None] | None = None,
                 on_decode_error: Callable[[str], None] | None = None) -> None:
        """`live(octet)`: the module answers (a request gets the resend ladder; otherwise it is sent once);
        `on_reply(octet, port, packet)`: every reply that matched a request, before its requester sees it;
        `on_garbage(octet, reason)`: a datagram from a served module that does not decode."""
        self.cfg = cfg
        self.links: dict[int, LinkStats] = {check_octet(o): LinkStats() for o in octets}
        self.totals = TransportTotals()
        self.live = live
        self.on_reply = on_reply
        self.on_garbage = on_garbage
        self.on_decode_error = on_decode_error
        self._pending: dict[Key, _Pending] = {}
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._echo: dict[Key, deque[asyncio.Future[p.GeneralPacket]]] = {}  # send_now_many's replies awaited
        self._transports: dict[int, asyncio.DatagramTransport] = {}
        self.opened = asyncio.Event()  # both sockets bound (set by open(), on the loop)
        self._prefix_dot = cfg.prefix + "."
        self._loop: asyncio.AbstractEventLoop | None = None
        self._raw: dict[int, socket.socket] = {}  # the bound sockets, for the stop's write from another thread
        self._echo_lock = threading.Lock()  # _echo is touched by the loop and by send_from_thread
        self.thread_writes = 0  # stop writes made from the kit's thread (send_from_thread): logs and tests

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        for port in (self.cfg.general_port, self.cfg.sysadmin_port):
            try:
                tr, _ = await loop.create_datagram_endpoint(lambda port=port: _Endpoint(self, port),  # type: ignore[misc]
                                                            local_addr=(self.cfg.host_address, port))
            except OSError as exc:
                self.close()
                raise OSError(exc.errno, f"cannot bind {self.cfg.host_address}:{port}: {exc.strerror}") from None
            self._transports[port] = tr
            sock = tr.get_extra_info("socket")
            self._raw[port] = getattr(sock, "_sock", sock)  # asyncio's TransportSocket wraps the real socket
        self._loop = loop
        self.opened.set()

    @property
    def bound(self) -> bool:
        """A socket is bound (open() has bound one or both, and close() has not run since)."""
        return bool(self._transports)

    def close(self) -> None:
        for tr in self._transports.values():
            tr.close()
        self._transports.clear()
        self._raw.clear()
        self.opened.clear()
        for pend in self._pending.values():
            if not pend.fut.done():
                pend.fut.cancel()
        for futs in self._echo.values():
            for f in futs:
                f.cancel()
        self._echo.clear()

    def address(self, octet: int) -> str:
        return module_address(self.cfg.prefix, octet)

    # -- requests ------------------------------------------------------------------------------------
    async def general(self, octet: int, pkt: p.GeneralPacket, *, retries: int | None = None,
                      insist: bool = False) -> p.GeneralPacket:
        """Send a general request; the module's reply (same subDeviceID and action) or RequestLost. `insist`: the
        whole resend ladder even to a module that is not live (the bus stop's resends)."""
        key = (octet, self.cfg.general_port, pkt.sub_device_id, pkt.action)
        if insist and retries is None:
            retries = self.cfg.max_retries
        g = send_guard()
        guard = None if g is None else functools.partial(g, pkt)
        reply: p.GeneralPacket = await self._request(key, pkt.encode(), retries, True, insist=insist, guard=guard)
        return reply

    async def general_once(self, octet: int, pkt: p.GeneralPacket) -> p.GeneralPacket | None:
        """Sent once; a reply taken if one comes within the timeout; silence is not counted as a loss."""
        key = (octet, self.cfg.general_port, pkt.sub_device_id, pkt.action)
        g = send_guard()
        guard = None if g is None else functools.partial(g, pkt)
        return await self._request(key, pkt.encode(), 0, False, guard=guard)  # type: ignore[no-any-return]

    async def sysadmin(self, octet: int, pkt: p.SysAdminPacket, *, retries: int | None = None,
                       expect_reply: bool = True) -> p.SysAdminPacket | None:
        """Send a SysAdmin request. `expect_reply=False` (BLACK_LIST, whose reply the firmware never sends,
        §3.2): sent once, a reply is taken if one comes within the timeout, and silence is not a loss."""
        key = (octet, self.cfg.sysadmin_port, -1, p.sysadmin_reply_action(pkt.action))
        if not expect_reply:
            return await self._request(key, pkt.encode(), 0, False)  # type: ignore[no-any-return]
        reply: p.SysAdminPacket = await self._request(key, pkt.encode(), retries, True)
        return reply

    async def probe(self, octet: int, pkt: p.SysAdminPacket, wait_s: float) -> p.SysAdminPacket | None:
        """One datagram, its reply awaited up to `wait_s` (a module that is not live: one probe, never the
        resend ladder); None when none came. Silence is not counted as a lost request."""
        key = (octet, self.cfg.sysadmin_port, -1, p.sysadmin_reply_action(pkt.action))
        return await self._request(key, pkt.encode(), 0, False, wait_s)  # type: ignore[no-any-return]

    def send_now_many(self, batch: list[tuple[int, list[p.GeneralPacket]]]
                      ) -> list[tuple[float, list[asyncio.Future[p.GeneralPacket]]]]:
        """The bus stop's write (on the loop), for every module of `batch` (octet, its packets in order) at once:
        each module's first packet, then each module's second, and so on (a module's first datagram stops it, or
        most of it: an ODrive in velocity mode; none waits behind another module's whole sequence), every packet
        ahead of its module's queue (a request in flight keeps its slot; this does not wait for it). Returns per
        entry the Unix time its last packet left the socket and one future per packet for its reply. A reply
        goes to a request waiting with the same key first (nothing tells the two apart), else to these, in
        order: a future that stays unanswered is the caller's to resend (`general`) and to `forget`.
        RequestLost when the transport is closed."""
        tr = self._transports.get(self.cfg.general_port)
        if tr is None:
            raise RequestLost("the transport is closed")
        return self._write_batch(asyncio.get_running_loop(), tr.sendto, batch)

    def send_from_thread(self, batch: list[tuple[int, list[p.GeneralPacket]]]
                         ) -> list[tuple[float, list[asyncio.Future[p.GeneralPacket]]]]:
        """send_now_many from any thread (the kit's, which reads the bus stop): written with the socket's own
        sendto (a datagram write is one system call, safe beside the loop's), not queued behind the loop's work
        (after a stall: seconds of datagrams and callbacks). The futures are the loop's, answered on the loop.
        RequestLost when the transport is closed or a write fails (the loop's pass writes it instead)."""
        sock = self._raw.get(self.cfg.general_port)
        loop = self._loop
        if sock is None or loop is None or loop.is_closed():
            raise RequestLost("the transport is closed")

        def write(data: bytes, dest: tuple[str, int]) -> None:
            try:
                sock.sendto(data, dest)
            except OSError as exc:  # a full socket buffer (non-blocking) or closed meanwhile
                raise RequestLost(f"the stop's datagram to {dest[0]} was not written: {exc}") from None

        with short_switch_interval():
            sent = self._write_batch(loop, write, batch)
        self.thread_writes += 1
        return sent

    def _write_batch(self, loop: asyncio.AbstractEventLoop, write: Callable[[bytes, tuple[str, int]], None],
                     batch: list[tuple[int, list[p.GeneralPacket]]]
                     ) -> list[tuple[float, list[asyncio.Future[p.GeneralPacket]]]]:
        port = self.cfg.general_port
        # everything but the writes first (bytes, reply futures: no reply is read before this returns), so that
        # the datagrams leave back to back
        rounds: list[list[tuple[int, bytes, tuple[str, int], bool]]] = []
        futs: list[list[asyncio.Future[p.GeneralPacket]]] = []
        with self._echo_lock:
            for n, (octet, pkts) in enumerate(batch):
                dest = (self.address(octet), port)
                futs.append([])
                for i, pkt in enumerate(pkts):
                    fut: asyncio.Future[p.GeneralPacket] = loop.create_future()
                    self._echo.setdefault((octet, port, pkt.sub_device_id, pkt.action), deque()).append(fut)
                    futs[n].append(fut)
                    if i == len(rounds):
                        rounds.append([])
                    rounds[i].append((n, pkt.encode(), dest, i == len(pkts) - 1))
        left = [0.0] * len(batch)
        for writes in rounds:
            for n, data, dest, last in writes:
                write(data, dest)
                if last:
                    left[n] = time.time()
        for octet, pkts in batch:
            self.links[octet].sent += len(pkts)
        now = time.time()
        return [(t or now, f) for t, f in zip(left, futs, strict=True)]

    def forget(self, octet: int, pkts: list[p.GeneralPacket], futs: list[asyncio.Future[p.GeneralPacket]]) -> None:
        """Stop waiting for send_now_many's replies that did not come (`futs` as it returned them for the module
        at `octet`)."""
        for pkt, fut in zip(pkts, futs, strict=True):
            if fut.done():
                continue
            fut.cancel()
            key = (octet, self.cfg.general_port, pkt.sub_device_id, pkt.action)
            with self._echo_lock:
                q = self._echo.get(key)
                if q is not None:
                    with contextlib.suppress(ValueError):
                        q.remove(fut)
                    if not q:
                        del self._echo[key]

    def _take_echo(self, key: Key) -> asyncio.Future[p.GeneralPacket] | None:
        with self._echo_lock:
            return self._take_echo_locked(key)

    def _take_echo_locked(self, key: Key) -> asyncio.Future[p.GeneralPacket] | None:
        q = self._echo.get(key)
        while q:
            fut = q.popleft()
            if not fut.done():
                if not q:
                    del self._echo[key]
                return fut
        self._echo.pop(key, None)
        return None

    def halt(self, octets: set[int]) -> set[int]:
        """The bus stop is coming to these modules (on the loop, before its write): every request of theirs whose
        guard refuses now is woken and ends at once (RequestRefused), its resends cancelled, its slot free for the
        stop's resends. Returns the octets of the requests halted."""
        n: set[int] = set()
        for key, pend in list(self._pending.items()):
            if key[0] in octets and pend.guard is not None and not pend.fut.done() and pend.guard():
                del self._pending[key]  # a late reply to it is no answer to anyone (or the stop's, if its key)
                pend.fut.set_result(_WAKE)
                n.add(key[0])
        return n

    async def _request(self, key: Key, data: bytes, retries: int | None, counts: bool,
                       wait_s: float | None = None, insist: bool = False,
                       guard: Callable[[], str] | None = None) -> Any:
        """One request through its module port's slot, its sends as resend.Ladder decides (reply, loss, or its
        guard's refusal)."""
        octet, port = key[0], key[1]
        link = self.links.get(octet)
        if link is None:
            raise ValueError(f"octet {octet} is not one of this transport's modules")
        tr = self._transports.get(port)
        if tr is None:
            raise RequestLost("the transport is closed")
        slot = self._slots.get((octet, port))
        if slot is None:
            slot = self._slots[(octet, port)] = _Slot()
        if retries is None:
            retries = self.cfg.max_retries if self.live is None or self.live(octet) else 0
        dest = (self.address(octet), port)
        loop = asyncio.get_running_loop()
        urgent = not is_background()
        ladder = Ladder(wait_s or self.cfg.timeout_s, retries, insist)
        await slot.acquire(urgent, key, data)
        held = True
        expired = False
        try:
            while True:
                now = loop.time()
                if expired:  # the timer fired: the reply is overdue, whatever the clock's resolution says
                    now = max(now, ladder.sends[-1] + ladder.timeout_s)
                d = ladder.decide(now, live=self.live is None or self.live(octet),
                                  refusal=guard() if guard is not None else "")
                if d.step is Step.REFUSED:
                    raise RequestRefused(d.reason)
                if d.step is Step.LOST:
                    break
                if d.step is Step.SEND:
                    if ladder.sends and not urgent and slot.command_waiting(key, data):
                        # our reply is overdue (lost, or the module is slow): let the waiting command go first
                        # rather than make it wait out our resends, then queue again
                        self._pending.pop(key, None)
                        held = False
                        slot.release()
                        await slot.acquire(False, key, data)
                        held = True
                        expired = False
                        continue  # decide again: time passed, the guard may refuse now
                    ladder.sent(now)
                    tr.sendto(data, dest)
                    link.sent += 1
                    if len(ladder.sends) > 1:
                        link.resent += 1
                    until = now + ladder.timeout_s
                else:
                    until = d.until
                fut: asyncio.Future[Any] = loop.create_future()
                self._pending[key] = _Pending(fut, now, guard)
                timer = loop.call_at(until, _expire, fut)
                try:
                    reply = await fut
                finally:
                    timer.cancel()
                if reply is _WAKE:
                    expired = False
                    continue
                if reply is not None:
                    ladder.reply()
                    return reply
                expired = True
        finally:
            if held:
                self._pending.pop(key, None)
                slot.release()
        if not counts:
            return None
        link.lost_since_connect += 1
        link.lost_total += 1
        raise RequestLost(f"no reply from {dest[0]}:{port} after {len(ladder.sends)} sends "
                          f"{self.cfg.timeout_s * 1000:.0f} ms apart")

    # -- replies -------------------------------------------------------------------------------------
    def _decode_error(self, reason: str, what: str) -> None:
        self.totals.decode_errors += 1
        self.totals.by_reason[reason] = self.totals.by_reason.get(reason, 0) + 1
        if self.on_decode_error is not None:
            self.on_decode_error(what)

    def _on_datagram(self, port: int, data: bytes, addr: tuple[Any, int]) -> None:
        host = str(addr[0])
        if not host.startswith(self._prefix_dot):
            self.totals.foreign += 1
            return
        try:
            octet = int(host[len(self._prefix_dot):])
        except ValueError:
            self.totals.foreign += 1
            return
        link = self.links.get(octet)
        if link is None:
            self.totals.foreign += 1
            return
        pkt: p.GeneralPacket | p.SysAdminPacket
        try:
            if port == self.cfg.general_port:
                pkt = p.decode_general(data)[0]
                key = (octet, port, pkt.sub_device_id, pkt.action)
            else:
                pkt = p.decode_sysadmin(data)[0]
                key = (octet, port, -1, pkt.action)
        except p.DecodeError as exc:
            if exc.reason == "checksum":
                link.bad_checksum += 1  # dropped: the request is resent (the original never dropped, §2.4)
            self._decode_error(exc.reason, f"octet {octet} port {port}: {exc}")
            if self.on_garbage is not None:
                try:
                    self.on_garbage(octet, f"port {port}: {exc}")
                except Exception:
                    log.exception("garbage callback failed")
            return
        pend = self._pending.get(key)
        waiter: asyncio.Future[Any] | None = pend.fut if pend is not None and not pend.fut.done() else None
        if waiter is None and port == self.cfg.general_port and self._echo:
            waiter = self._take_echo(key)  # a reply to the bus stop's write (send_now_many)
        if waiter is None:
            link.unmatched += 1
            self.totals.unmatched += 1
            return
        link.replies += 1
        link.last_reply = time.monotonic()
        link.lost_since_connect = 0
        if self.on_reply is not None:
            try:
                self.on_reply(octet, port, pkt)
            except Exception:
                log.exception("reply callback failed")
        waiter.set_result(pkt)


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def check_bindable(host: str) -> None:
    """Both ROI ports on this host's address, or one clear line: the address is not ours, or the ports are
    taken (only one process can own the ROI network, docs/reference/roi.md §1)."""
    for port in (p.GENERAL_PORT, p.SYSADMIN_PORT):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ServiceUnavailable(f"cannot bind {host}:{port} ({exc.strerror}): roi_network and "
                                         "roi_host_octet must name an address of this host, and no other "
                                         "process may own the ROI ports there") from None


def udp_transport(settings: RoiSettings, hooks: TransportHooks) -> RoiTransport:
    """Transport `roi-modules.udp` (ROBOBUS_ROI_TRANSPORT=udp, the default; entry point `robobus.transports`, the
    kit's one signature): the transport on `<roi_network>.<roi_host_octet>` for the modules at `hooks.octets`, with
    the settings' resend ladder and the hooks' callbacks. ServiceUnavailable if this host cannot own both ROI ports
    there (checked now, so that the service stops before it connects, with the reason). The simulator (sim.py) is
    a peer on the same wire, reached at the addresses the settings give."""
    cfg = TransportConfig(settings.roi_network, settings.roi_host_octet, settings.roi_timeout_s,
                          settings.roi_max_retries)
    check_bindable(cfg.host_address)
    return RoiTransport(cfg, sorted(set(hooks.octets)), live=hooks.live, on_reply=hooks.on_reply,
                        on_garbage=hooks.on_garbage, on_decode_error=hooks.on_decode_error)
