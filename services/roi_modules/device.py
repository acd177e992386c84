"""roi-modules' devices: every configured ROI module is one device (health, state, commands, jobs).

One asyncio loop runs the transport and one maintain task per module (docs/reference/roi.md §4): while the module
answers, every 100 ms a poll that feeds the module's 500 ms watchdog (ODrive GET_ALL, actuator
GET_CURRENT_LENGTH, GPIO READs), and a STATUS_REPORT at start, every 128 ticks and after the module comes back;
while it does not, one STATUS_REPORT probe per probe period (the link supervisor's rhythm), never the resend
ladder. Health is the kit's link supervisor's (docs/kit.md, "Health"): every valid reply is data, a datagram
that does not decode is garbage, the module's own state (§4.2: `blank_state`, `operating`, ...) is the finer
state name, a module fault or a module of another type (§4.2) is a fault. The BLANK_STATE protocol of §4.3
pushes the cached settings after a module reset (and reads the status again at once, so health shows the
configured module) and pulls state when the service starts beside a running module. Command handlers are
coroutines on the same loop; jobs poll the latest state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from services.roi_modules import protocol as p
from services.roi_modules.api import (
    BLACKLIST,
    CLEAR_ERRORS,
    FAULT,
    GO_TO_POSITION,
    GO_TO_RELATIVE,
    GOTO_POSITION,
    GOTO_RELATIVE,
    LINK,
    PIN_STATES,
    PIN_VALUES,
    PING,
    POWER,
    QUEUE_GENERAL,
    QUEUE_SYSADMIN,
    SET_PIN_MODE,
    SET_PIN_OUTPUT,
    SET_TORQUE,
    SET_VELOCITY,
    STATE,
    STATUS_REPORT,
    TEMPERATURE,
)
from services.roi_modules.link import (
    LinkStats,
    RequestLost,
    RequestRefused,
    RoiLink,
    SendGuard,
    background_traffic,
    guard_sends,
)
from services.roi_modules.models import (
    PIN_MODE_CODES,
    PIN_MODE_NAMES,
    RoiAck,
    RoiBlacklistReply,
    RoiBlacklistRequest,
    RoiEmpty,
    RoiFault,
    RoiGotoPosition,
    RoiLinkStats,
    RoiModuleConfig,
    RoiMotionState,
    RoiMoveRequest,
    RoiMoveResult,
    RoiOdrivePower,
    RoiOdriveTemperature,
    RoiPinStates,
    RoiPinValues,
    RoiPong,
    RoiQueueGeneral,
    RoiQueueSysAdmin,
    RoiRawReply,
    RoiSetPinMode,
    RoiSetPinOutput,
    RoiSetTorque,
    RoiSetVelocity,
    RoiStatusReport,
)
from services.roi_modules.resend import Step, StopLadder
from services.roi_modules.settings import RoiSettings
from shared import CommandError, ErrorCode, JobContext, Node
from shared.device import handles, moves_when, runs
from shared.link import LinkPolicy, LinkState
from shared.stop_pass import StopPass

log = logging.getLogger("robobus.roi")

KIND_TYPES = {"gpio": p.ModuleType.GENERAL_GPIO, "odrive": p.ModuleType.O_DRIVE, "actuator": p.ModuleType.ACTUATOR}


@dataclass(frozen=True)
class ModuleContext:
    """What a module uses of the service: the node its device lives on, the settings, the transport that owns the
    sockets, and the bus stop's pass (RoiService.stop_pass) its stop action joins."""

    node: Node
    settings: RoiSettings
    transport: RoiLink
    stop_pass: StopPass


def _unavailable(exc: RequestLost, what: str) -> CommandError:
    return CommandError(ErrorCode.UNAVAILABLE, f"{what}: {exc}")


STOP_CAME = ("the bus stop became active while this command was being sent: nothing more of it was sent (its "
             "resends cancelled), the stop's datagrams are the last the module got")


def _stopped(exc: RequestRefused) -> CommandError:
    return CommandError(ErrorCode.STOPPED, str(exc))


class StopPending(Exception):
    """The module's stop cannot be written yet, but will be (its message says what it waits for)."""


@dataclass
class StopWrite:
    """A module's stop on the wire: its datagrams, their reply futures of the latest write, its ladder."""

    gen: int
    pkts: list[p.GeneralPacket]
    futs: list[asyncio.Future[p.GeneralPacket]]
    ladder: StopLadder


def next_probe(started: float, now: float, wait: float) -> float:
    """When the next probe goes: `wait` (the link supervisor's, counted by it from `now`, when the probe ended)
    counted from when the probe `started` instead, so that a probe's own wait for its reply is not added to the
    probe period; never before `now`."""
    return max(now, started + wait)


class RoiModule:
    """One module on the bus: health from the transport and STATUS_REPORT, the maintain loop, sysadmin."""

    unit = "rev"

    def __init__(self, ctx: ModuleContext, cfg: RoiModuleConfig) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.node = ctx.node
        self.dev = ctx.node.device(cfg.name, kind=cfg.type)  # api.py's kinds: gpio, odrive, actuator
        self.module_type = KIND_TYPES[cfg.type]
        self.status: p.StatusReport | None = None
        self.pulled = False  # state pulled (or pushed) since this service started
        self.tick_no = 0
        self.status_due = True
        self.blacklist: set[int] = set()
        self.error_text = ""  # a type-specific error (e.g. decoded ODrive error bits)
        self.state_event = asyncio.Event()
        # health is the kit's link supervisor's (docs/kit.md, "Health"); the budget and the probe rhythm are
        # the README's "Health" section
        probe = ctx.settings.roi_probe_period_s
        self.link = self.dev.supervise_link(LinkPolicy(
            liveness_s=ctx.settings.liveness_s(cfg), backoff_min_s=min(0.2, probe), backoff_max_s=probe,
            probe_period_s=probe))
        self.link.device_state("awaiting_status", operational=False,
                               message="the module answers; waiting for its STATUS_REPORT")
        self.was_live = False
        self.gaps_seen = 0  # resent + lost requests seen by the maintain loop
        self.next_probe_at = 0.0  # loop time of the next probe while the module does not answer (at once at start)
        self.stop_write: StopWrite | None = None  # the bus stop's datagrams on the wire (confirm_stop)
        self.stop_due: int | None = None  # a stop pending (StopPending): its activation count
        self.show_details()
        # every handler marked below and in the subclass (@handles, @runs): api.py's kind of this module
        self.dev.bind_all(self)

    # -- health (§4.2, on the kit's link supervisor) -----------------------------------------------------------
    @property
    def traffic(self) -> LinkStats:
        """The transport's counters for this module's octet."""
        return self.ctx.transport.links[self.cfg.octet]

    @property
    def live(self) -> bool:
        """Valid replies within the liveness budget (the link supervisor's `operational`)."""
        return self.link.state is LinkState.OPERATIONAL

    def details(self, st: p.StatusReport | None = None) -> dict[str, Any]:
        st = st or self.status
        details: dict[str, Any] = {"octet": self.cfg.octet, "address": self.ctx.transport.address(self.cfg.octet),
                                   "type": self.cfg.type, "channel": self.cfg.channel,
                                   "blacklist": sorted(self.blacklist)}
        if st is not None:
            details.update({
                "module_state": st.state, "reported_type": p.module_type_name(st.module_type),
                "time_alive": {"hours": st.hours, "minutes": st.minutes, "seconds": st.seconds},
                "supply_voltage": round(st.supply_volts, 3), "mac": st.mac_text,
                "chain": {"neighbour": st.neighbour, "formed": st.state != p.ModuleState.OPERATING_WITHOUT_CHAIN
                          and st.state in p.OPERATIONAL_STATES}})
        return details

    def show_details(self) -> None:
        self.dev.set_health(details=self.details())

    def apply_status(self, st: p.StatusReport | None) -> None:
        """What a status of this module means for health: the module's state as the finer state name
        (`blank_state`, `operating`, ...; operational as §4.2 and the module type say), and a fault while the
        module reports an error (states 2/4, ODrive error bits) or is of another type (§4.2)."""
        mismatch = st is not None and st.module_type != self.module_type
        fault = ""
        if mismatch:
            fault = self.mismatch_message(st)
        elif self.error_text:
            fault = self.error_text
        elif st is not None and st.state in p.ERROR_STATES:
            fault = self.state_message(st.state)
        if fault:
            self.link.fault(fault)
        else:
            self.link.clear_fault()
        if st is not None and not mismatch:
            self.link.device_state(p.state_name(st.state), operational=self.operational_state(st.state),
                                   message=self.state_message(st.state))

    def sync_health(self) -> None:
        self.apply_status(self.status)
        self.show_details()

    def on_reply(self, port: int, pkt: p.GeneralPacket | p.SysAdminPacket) -> None:
        """Every reply that matched a request (transport callback, on the loop): valid data from this module,
        unless another module type answers at the octet. A STATUS_REPORT's state is applied before the data, so
        the first health of a module that comes back says what it is (`blank_state`, its status details), not
        `operational`."""
        if isinstance(pkt, p.SysAdminPacket):
            kind: int | None = None
            if pkt.action == p.SysAdminAction.STATUS_REPORT:
                st = p.StatusReport.decode(pkt.payload)
                kind = st.module_type
                if kind == self.module_type:
                    self.apply_status(st)
                    self.dev.set_health(details=self.details(st))
            elif pkt.action == p.SysAdminAction.PONG:
                kind = p.Pong.decode(pkt.payload).module_type
            if kind is not None and kind != self.module_type:
                return  # another module type: not our module's data (the mismatch fault is set by on_status)
            if kind is None and (self.kind_mismatch or not self.live):
                return
        elif self.kind_mismatch or not self.live:
            # a general reply proves nothing about who answers: a module that comes back is recognised by its
            # type (a STATUS_REPORT or PONG), since another module may have taken the octet meanwhile
            return
        self.link.data()

    def on_garbage(self, reason: str) -> None:
        self.link.garbage(reason)

    @property
    def kind_mismatch(self) -> bool:
        """The module at the octet is of another type than configured (§4.2): it gets no typed request, its
        replies are not read as measurements, and its commands are refused (device_error)."""
        return self.status is not None and self.status.module_type != self.module_type

    def mismatch_message(self, st: p.StatusReport | None = None) -> str:
        st = st or self.status
        assert st is not None
        return (f"Module type mismatch: {p.module_type_name(st.module_type)} answers at octet "
                f"{self.cfg.octet}, configured {self.cfg.type}. Check IP octet. Nothing is sent to it but "
                "STATUS_REPORT probes until the configured type answers there.")

    def check_kind(self) -> None:
        if self.kind_mismatch:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"{self.cfg.name}: {self.mismatch_message()}")

    @contextlib.contextmanager
    def command_sends(self) -> Iterator[None]:
        """The body of a command that sends general packets, in `with self.command_sends():`. Refused (device_error)
        while a module of another type answers at the octet, before anything is computed or sent; what it sends
        that moves the module is guarded by the bus stop (`stop_guard`: no such datagram, first send or resend,
        once the stop is active; the command is then answered `stopped`)."""
        self.check_kind()
        guard_sends(self.stop_guard())  # the command's own task: its context is its own
        try:
            yield
        except RequestRefused as exc:
            raise _stopped(exc) from None

    def operational_state(self, state: int) -> bool:
        return state in p.OPERATIONAL_STATES

    def state_message(self, state: int) -> str:
        if state == p.ModuleState.BLANK_STATE:
            return (f"Blank state: the module was (re)started and has not been configured since; it takes no "
                    f"part in operation until it is. {self.blank_advice()}")
        return p.STATE_MESSAGES.get(state, f"Unknown module state {state}.")

    def blank_advice(self) -> str:
        """What configures a blank module of this type (§3.3, §4.3)."""
        return ""

    def fault(self, kind: str, message: str) -> None:
        self.dev.emit(FAULT, RoiFault(kind=kind, message=message, ts=time.time()))  # type: ignore[arg-type]

    def watch_link(self) -> None:
        """The link's transitions as events: `connected` when the module answers (again), `disconnected` when its
        budget passed without a valid reply (jobs wake and abort)."""
        live = self.live
        if live == self.was_live:
            return
        self.was_live = live
        addr = self.ctx.transport.address(self.cfg.octet)
        if live:
            self.status_due = True  # it may have rebooted while away
            self.fault("connected", f"{addr} answers")
        else:
            self.fault("disconnected", f"no valid reply from {addr} within {self.link.sup.policy.liveness_s:g} s "
                                       f"({self.link.state.value})")
            self.state_event.set()  # wake jobs: they abort

    def publish_link(self) -> None:
        s = self.traffic
        self.dev.publish(LINK, RoiLinkStats(
            connected=self.live, lost_packets_since_connect=s.lost_since_connect,
            lost_packets_accumulated=s.lost_total, sent=s.sent, resent=s.resent, replies=s.replies,
            unmatched=s.unmatched, bad_checksum=s.bad_checksum, ts=time.time()))

    # -- the bus stop's guard of what moves ---------------------------------------------------------------
    def moves(self, pkt: p.GeneralPacket) -> bool:
        """The packet moves the module (or something it drives): the bus stop's guard holds it back."""
        return False

    def stop_guard(self, *, under_stop: bool = False) -> SendGuard:
        """The guard of the calling task's sends (transport.guard_sends), read now: a packet that moves the module
        is refused once the bus stop is active (`under_stop`: once a stop newer than now is, for the cache pushed
        to a module that reset while stopped, which is the stopped demand). Checked before every send and resend,
        and by the stop's pass as it comes (transport.halt), so nothing that moves follows the stop's datagrams."""
        latch = self.node.stop_latch
        gen = latch.generation

        def guard(pkt: p.GeneralPacket) -> str:
            if not self.moves(pkt):
                return ""
            if latch.generation != gen or (latch.active and not under_stop):
                return STOP_CAME
            return ""
        return guard

    # -- requests ----------------------------------------------------------------------------------------
    async def request(self, pkt: p.GeneralPacket, what: str) -> p.GeneralPacket:
        self.check_kind()  # a module of another type would read this packet as one of its own codes
        try:
            return await self.ctx.transport.general(self.cfg.octet, pkt)
        except RequestLost as exc:
            raise _unavailable(exc, what) from None

    async def set_ok(self, pkt: p.GeneralPacket, what: str) -> None:
        """A setter whose reply [0] is 1 on success (GPIO, ODrive)."""
        rep = await self.request(pkt, what)
        if rep.payload[0] != 1:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"{what}: the module refused (reply {rep.payload[0]})")

    async def sysadmin(self, action: int, payload: bytes = b"", **kw: Any) -> p.SysAdminPacket | None:
        return await self.ctx.transport.sysadmin(
            self.cfg.octet, p.SysAdminPacket(action, payload, 0, self.ctx.settings.roi_host_octet), **kw)

    # -- maintain loop (§4.4) ------------------------------------------------------------------------------
    async def maintain(self, phase: float = 0.0) -> None:
        """`phase` (0..1) offsets this module's ticks in the period: started together, every module would
        poll in the same instant, and a command arriving then would queue behind that burst of requests,
        replies and state publishes (in this loop and in the modules' network) instead of finding it idle."""
        background_traffic()  # what this task sends queues behind commands (the transport's per-module queue)
        loop = asyncio.get_running_loop()
        period = self.ctx.settings.roi_maintain_period_s
        nxt = loop.time() + phase * period
        await asyncio.sleep(phase * period)
        while True:
            try:
                self.watch_link()
                if self.live and not self.kind_mismatch:
                    gaps = self.traffic.resent + self.traffic.lost_total
                    if gaps != self.gaps_seen:
                        # a send went unanswered: what answered after it may be another module (swapped, or an
                        # octet selector changed; a module boots within no budget): its type first, then polls
                        self.gaps_seen = gaps
                        self.status_due = True
                    if self.status_due or self.status is None or self.tick_no % self.ctx.settings.roi_status_every == 0:
                        self.status_due = False
                        try:
                            await self.fetch_status()
                        except RequestLost:
                            self.status_due = True  # ask again next tick
                            raise
                    if self.live and not self.kind_mismatch:
                        await self.poll()
                elif loop.time() >= self.next_probe_at:
                    # not answering, or another module type: one STATUS_REPORT (type-agnostic: another module
                    # type would take a typed poll for one of its own codes) per the supervisor's rhythm
                    await self.probe()
            except (RequestLost, CommandError) as exc:
                log.debug("maintain tick failed", extra={"device": self.cfg.name, "error": str(exc)})
            except Exception:
                log.exception("maintain tick crashed", extra={"device": self.cfg.name})
            self.tick_no += 1
            nxt += period
            now = loop.time()
            if nxt < now:  # late (a lost request took its resends): skip the missed ticks, no burst
                nxt = now + period - (now - nxt) % period
            await asyncio.sleep(nxt - now)

    async def probe(self) -> None:
        """One datagram (STATUS_REPORT), its reply awaited as long as a whole resend ladder would take (at most a
        probe period), never resent: a module that does not answer costs one datagram per probe period."""
        s = self.ctx.settings
        wait = min(s.ladder_s, s.roi_probe_period_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.link.attempt()
        try:
            rep = await self.ctx.transport.probe(
                self.cfg.octet, p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, b"", 0, s.roi_host_octet), wait)
            if rep is None:
                self.link.failed(f"no reply to a STATUS_REPORT probe within {wait:g} s")
                return
            await self.on_status(p.StatusReport.decode(rep.payload))
        finally:
            # the supervisor's wait (a backoff, then the probe period) counts from the failure it was told of,
            # after the probe's own wait: counted from the probe's start instead, one probe per period
            self.next_probe_at = next_probe(started, loop.time(), self.link.next_attempt_in())

    async def poll(self) -> None:
        """One tick's request; it also keeps the module's watchdog fed."""

    async def fetch_status(self) -> p.StatusReport:
        rep = await self.sysadmin(p.SysAdminAction.STATUS_REPORT)
        assert rep is not None
        st = p.StatusReport.decode(rep.payload)
        await self.on_status(st)
        return st

    async def on_status(self, st: p.StatusReport) -> None:
        """§4.3: BLANK_STATE (or an uptime going backwards) means the module was reset: push what we set, then
        read the status again at once (a successful set configures the module), so health shows the configured
        module now rather than at the next periodic report (up to 12.8 s later). Not blank right after our
        start: the module kept running, pull its state. Another module type: a fault, and a failed attempt."""
        prev, self.status = self.status, st
        if st.module_type != self.module_type:
            if prev is None or prev.module_type != st.module_type:
                self.fault("type_mismatch", f"module type {p.module_type_name(st.module_type)} at octet "
                                            f"{self.cfg.octet}, configured {self.cfg.type}")
            # not our module's data: the link fails first, so health never shows `connection: true` with it
            self.link.failed(f"{p.module_type_name(st.module_type)} answers at octet {self.cfg.octet}, "
                             f"configured {self.cfg.type}")
            self.sync_health()
            return
        same = prev is not None and prev.module_type == st.module_type
        reset = same and prev is not None and (
            st.uptime_s < prev.uptime_s or (st.state == p.ModuleState.BLANK_STATE and self.resets_to_blank()
                                            and prev.state != p.ModuleState.BLANK_STATE))
        if reset:
            self.fault("module_reset", f"the module restarted (state {p.state_name(st.state)}, up {st.uptime_s} s)")
        blank = st.state == p.ModuleState.BLANK_STATE
        if self.has_cache() and (reset or (blank and self.resets_to_blank())):
            if await self.push_guarded():
                with contextlib.suppress(RequestLost):
                    rep = await self.sysadmin(p.SysAdminAction.STATUS_REPORT)
                    assert rep is not None
                    after = p.StatusReport.decode(rep.payload)
                    if after.module_type == self.module_type:
                        self.status = after
        elif not self.pulled and not blank:
            await self.pull()
        self.pulled = True
        self.sync_health()

    async def push_guarded(self) -> bool:
        # the cache is what the module must do (the stopped demand while the stop is active); a stop that comes
        # during the push ends it: the stop's datagrams are the last the module gets
        guard_sends(self.stop_guard(under_stop=True))
        try:
            await self.push()
            log.info("settings pushed", extra={"device": self.cfg.name})
            return True
        except RequestRefused as exc:
            self.fault("push_failed", f"re-sending the cached settings stopped: {exc}")
            return False
        except CommandError as exc:
            self.fault("push_failed", f"re-sending the cached settings failed: {exc.message}")
            return False
        finally:
            guard_sends(None)

    def resets_to_blank(self) -> bool:
        return True

    def has_cache(self) -> bool:
        return False

    async def push(self) -> None:
        """Re-send the cached settings to a module that came back blank."""

    async def pull(self) -> None:
        """Read the module's settings into the cache (the service started beside a running module)."""

    async def stop(self) -> None:
        """Fail-safe: zero demands."""

    # -- the bus stop (docs/kit.md, "Stopping everything"; the README's "Stopping everything") ------------------
    def stop_packets(self) -> list[p.GeneralPacket]:
        """The module's stop, in the order it goes out; the cache (what a reset gets re-sent) becomes what the
        stop leaves. CommandError: nothing can be sent (its message says why)."""
        return []

    def stop_problems(self, pkts: list[p.GeneralPacket], replies: list[p.GeneralPacket]) -> list[str]:
        """What the module's replies to the stop's packets say was not applied (nothing: an empty list)."""
        return []

    def supersede_stop(self) -> None:
        """A new stop write for this module is about to go (a stop again, a newer stop): the one on the wire is
        over, its awaited replies forgotten at once, so that the replies to the new write are the new write's."""
        old, self.stop_write = self.stop_write, None
        if old is not None:
            old.ladder.end("superseded by a newer stop write")
            self.ctx.transport.forget(self.cfg.octet, old.pkts, old.futs)

    def stop_written(self, gen: int, pkts: list[p.GeneralPacket], t: float,
                     futs: list[asyncio.Future[p.GeneralPacket]]) -> StopWrite:
        """The stop pass wrote this module's stop (after `supersede_stop`): now the one on the wire."""
        s = self.ctx.settings
        w = StopWrite(gen, pkts, futs, StopLadder(len(pkts), s.roi_timeout_s, s.roi_max_retries))
        w.ladder.written(asyncio.get_running_loop().time(), t)
        self.stop_write = w
        return w

    async def confirm_stop(self, w: StopWrite) -> None:
        """After the service's stop pass wrote this module's stop datagrams (`w`: RoiService.stop_pass, ahead of
        whatever the module's queue holds: transport.send_now_many): the whole sequence is written again, in
        order and ahead of the queue, every resend timeout until the module has acknowledged every datagram of one
        write (its reply is the ack, docs/reference/roi.md §5.4), up to the resend ladder, even to a module that
        looks silent (resend.StopLadder), then every second until it is acknowledged (a module that answers again
        while the stop holds gets it). The node's stop answer reports the time of the write that holds (the latest
        written when the acks came). Not acknowledged (meanwhile), or refused by the module: the answer and the
        health say so; an acknowledgement after that clears it. A newer write for this module (`supersede_stop`) or
        the stop's end ends this one, unreported."""
        tr = self.ctx.transport
        latch = self.node.stop_latch
        loop = asyncio.get_running_loop()
        s = self.ctx.settings
        gen, pkts = w.gen, w.pkts
        problems: list[str] = []
        try:
            while True:
                if latch.generation != gen or not latch.active:
                    w.ladder.end("the stop is over")
                elif self.stop_write is not w:
                    w.ladder.end("superseded by a newer stop write")
                d = w.ladder.decide(loop.time())
                if d.step is Step.REFUSED:
                    return  # superseded (the newer write reports) or the stop is over (nothing to report)
                if d.step is Step.ANSWERED:
                    break
                if d.step is Step.LOST:  # said once; written again every slow_s until acknowledged or over
                    latch.report(self.dev.name, gen, None,
                                 f"the stop was sent, but no reply from {tr.address(self.cfg.octet)} to "
                                 f"{len(w.ladder.writes)} writes of the stop {s.roi_timeout_s * 1000:.0f} ms apart: "
                                 f"written again every {w.ladder.slow_s:g} s until the module acknowledges it")
                    continue
                if self.kind_mismatch:
                    problems.append(f"nothing more sent: {self.mismatch_message()}")
                    break
                if d.step is Step.SEND:
                    log.info("stop not acknowledged: written again", extra={"device": self.cfg.name,
                                                                              "writes": len(w.ladder.writes)})
                    tr.forget(self.cfg.octet, pkts, w.futs)
                    try:
                        [(t, w.futs)] = tr.send_now_many([(self.cfg.octet, pkts)])
                    except RequestLost as exc:
                        problems.append(str(exc))
                        break
                    w.ladder.written(loop.time(), t)
                    continue
                waiting = [f for f in w.futs if not f.done()]
                if waiting:
                    await asyncio.wait(waiting, timeout=max(0.0, d.until - loop.time()))
                for i, f in enumerate(w.futs):
                    if f.done() and not f.cancelled():
                        w.ladder.ack(i)
        finally:
            tr.forget(self.cfg.octet, pkts, w.futs)
            if self.stop_write is w:
                self.stop_write = None
        if not problems and not w.ladder.done:
            problems.append(f"no reply from {tr.address(self.cfg.octet)} to {len(w.ladder.writes)} writes of the "
                            f"stop {s.roi_timeout_s * 1000:.0f} ms apart")
        if not problems:
            problems = self.stop_problems(pkts, [f.result() for f in w.futs])
        if problems:
            latch.report(self.dev.name, gen, None, "the stop was sent, but " + "; ".join(problems))
        else:
            latch.report(self.dev.name, gen, w.ladder.written_at)

    def stop_pending(self, gen: int, why: str) -> None:
        """The stop of activation `gen` cannot be written yet (`why`, StopPending): the node's stop answer says
        `pending` and the health says why, until the module calls `stop_possible`."""
        self.stop_due = gen
        self.dev.stop_note = why
        log.warning("bus stop pending", extra={"device": self.cfg.name, "why": why})
        self.dev.publish_health()
        self.node.stop_latch.note_changed(self.dev.name)

    def stop_possible(self) -> None:
        """What a pending stop waited for came (on the loop): the stop pass writes it now (or reports why not)."""
        gen, self.stop_due = self.stop_due, None
        if gen is None:
            return
        self.dev.stop_note = ""
        latch = self.node.stop_latch
        latch.note_changed(self.dev.name)
        if latch.active and latch.generation == gen:
            self.ctx.stop_pass.request(self.dev.name)
        else:
            self.dev.publish_health()

    def raw_moves(self, pkt: p.GeneralPacket) -> bool:
        """A raw packet that moves something through the bus stop's gate (a GPIO stop output). Not the setters of an
        ODrive or an actuator: those are refused `forbidden` whatever the stop (`raw_motion`)."""
        return False

    # -- commands common to every module ---------------------------------------------------------------------
    def raw_motion(self, pkt: p.GeneralPacket) -> str:
        """Why a raw general packet is refused (it can move the module), or "" when it may go."""
        return ""

    def on_raw_reply(self, pkt: p.GeneralPacket, rep: p.GeneralPacket) -> None:
        """Keep the cache and the published state in step with a raw packet the module accepted."""

    # queue_general_packet, set_pin_mode and set_pin_output move for some requests only (api.py: motion=BY_REQUEST):
    # the kit's bus stop gate takes the requests these predicates say move (`stopped` while the stop is active,
    # `unavailable` until the node has read it; the stop action again after one that ran across the stop)
    @moves_when(QUEUE_GENERAL)
    def queue_general_moves(self, req: RoiQueueGeneral) -> bool:
        return self.raw_moves(p.GeneralPacket(req.sub_device_id, req.action, bytes.fromhex(req.payload_hex)))

    @handles(QUEUE_GENERAL)
    async def cmd_queue_general(self, req: RoiQueueGeneral) -> RoiRawReply:
        with self.command_sends():
            pkt = p.GeneralPacket(req.sub_device_id, req.action, bytes.fromhex(req.payload_hex))
            why = self.raw_motion(pkt)
            if why:
                raise CommandError(ErrorCode.FORBIDDEN, f"{self.cfg.name}: {why}")
            try:
                rep = (await self.ctx.transport.general(self.cfg.octet, pkt, retries=req.retries) if req.wait_reply
                       else await self.ctx.transport.general_once(self.cfg.octet, pkt))
            except RequestLost as exc:
                raise _unavailable(exc, "general packet") from None
            if rep is None:
                return RoiRawReply(replied=False)
            self.on_raw_reply(pkt, rep)
            return RoiRawReply(replied=True, action=rep.action, sub_device_id=rep.sub_device_id,
                               payload_hex=rep.payload.hex())

    @handles(QUEUE_SYSADMIN)
    async def cmd_queue_sysadmin(self, req: RoiQueueSysAdmin) -> RoiRawReply:
        origin = self.ctx.settings.roi_host_octet if req.origin is None else req.origin
        pkt = p.SysAdminPacket(req.action, bytes.fromhex(req.payload_hex), req.meta, origin)
        try:
            rep = await self.ctx.transport.sysadmin(self.cfg.octet, pkt, retries=req.retries,
                                                    expect_reply=req.wait_reply)
        except RequestLost as exc:
            raise _unavailable(exc, "sysAdmin packet") from None
        if rep is None:
            return RoiRawReply(replied=False)
        return RoiRawReply(replied=True, action=rep.action, meta=rep.meta, origin=rep.origin,
                           payload_hex=rep.payload.hex())

    @handles(PING)
    async def cmd_ping(self, req: RoiEmpty) -> RoiPong:
        t0 = time.perf_counter()
        try:
            rep = await self.sysadmin(p.SysAdminAction.PING)
        except RequestLost as exc:
            raise _unavailable(exc, "PING") from None
        assert rep is not None
        pong = p.Pong.decode(rep.payload)
        return RoiPong(operable=pong.operable, module_type=pong.module_type,
                       module_type_name=p.module_type_name(pong.module_type),
                       rtt_ms=round((time.perf_counter() - t0) * 1000, 3))

    @handles(STATUS_REPORT)
    async def cmd_status_report(self, req: RoiEmpty) -> RoiStatusReport:
        try:
            st = await self.fetch_status()
        except RequestLost as exc:
            raise _unavailable(exc, "STATUS_REPORT") from None
        message = self.state_message(st.state) if st.module_type == self.module_type else \
            f"{self.mismatch_message(st)} It reports {p.state_name(st.state)}."
        return RoiStatusReport(state=st.state, state_name=p.state_name(st.state), message=message,
                               hours=st.hours, minutes=st.minutes, seconds=st.seconds,
                               supply_voltage=round(st.supply_volts, 3), module_type=st.module_type,
                               module_type_name=p.module_type_name(st.module_type), chain_neighbour=st.neighbour,
                               mac=st.mac_text)

    @handles(BLACKLIST)
    async def cmd_blacklist(self, req: RoiBlacklistRequest) -> RoiBlacklistReply:
        op = {"add": p.BlacklistOp.ADD, "remove": p.BlacklistOp.REMOVE, "list": p.BlacklistOp.LIST}[req.op]
        if req.op != "list":
            if req.octet is None:
                raise CommandError(ErrorCode.INVALID_REQUEST, f"blacklist {req.op} needs an octet")
            if req.octet == self.ctx.settings.roi_host_octet:
                raise CommandError(ErrorCode.INVALID_REQUEST, f"octet {req.octet} is this host: the module would "
                                                              "ignore the service from then on")
        # the firmware applies ADD/REMOVE but never answers (§3.2): one send, a reply taken if one ever comes
        rep = await self.sysadmin(p.SysAdminAction.BLACK_LIST, p.blacklist_payload(op, req.octet or 0),
                                  expect_reply=False)
        if req.op == "add" and req.octet is not None:
            self.blacklist.add(req.octet)
        elif req.op == "remove" and req.octet is not None:
            self.blacklist.discard(req.octet)
        self.sync_health()
        octets = sorted(self.blacklist)
        if rep is not None and req.op == "list":
            octets = p.decode_blacklist_list(rep.payload)
        return RoiBlacklistReply(op=req.op, octet=req.octet, sent=True, confirmed=rep is not None, octets=octets,
                                 note="" if rep is not None else "the module does not answer BLACK_LIST "
                                                                 "(firmware defect); octets: what this service sent")


class GpioModule(RoiModule):
    """§3.5: pins 0..7 digital, 10..17 analog; values read round robin, a full sweep every 16/n ticks."""

    def __init__(self, ctx: ModuleContext, cfg: RoiModuleConfig) -> None:
        super().__init__(ctx, cfg)
        self.modes = [0] * p.GPIO_COUNT
        for pin, name in cfg.pin_modes.items():  # settings: pushed when the module is blank, like a cache
            self.modes[pin] = PIN_MODE_CODES[name]
        self.outputs: dict[int, int] = {}
        self.values: list[int | None] = [None] * p.GPIO_COUNT
        self.cursor = 0
        if cfg.stop_outputs:  # a motion device: the bus stop sets these pins (other pins are left as they are)
            self.dev.on_stop(ctx.stop_pass.action(self.dev.name), inline=True)  # RoiService.stop_pass

    def stop_packets(self) -> list[p.GeneralPacket]:
        """SET_OUTPUT of each stop output first (the pins are outputs: pin_modes), then, for a module that lost
        its pin modes (reset, not yet re-configured, where that first SET_OUTPUT is refused), SET_PIN_MODE
        output and SET_OUTPUT again (docs/reference/roi.md §3.5: SET_OUTPUT fails unless the pin is an output)."""
        outs, again = [], []
        for pin, level in sorted(self.cfg.stop_outputs.items()):
            self.outputs[pin] = level
            self.values[pin] = level
            outs.append(p.GeneralPacket(pin, p.GpioAction.SET_OUTPUT, bytes([level])))
            again += [p.GeneralPacket(pin, p.GpioAction.SET_PIN_MODE, bytes([p.PinMode.OUTPUT])), outs[-1]]
        return outs + again

    def stop_problems(self, pkts: list[p.GeneralPacket], replies: list[p.GeneralPacket]) -> list[str]:
        n = len(self.cfg.stop_outputs)
        return [f"the module refused {p.GpioAction(pkt.action).name} {pkt.sub_device_id} (reply {r.payload[0]})"
                for pkt, r in zip(pkts[n:], replies[n:], strict=False) if r.payload[0] != 1]

    def raw_moves(self, pkt: p.GeneralPacket) -> bool:
        return pkt.action in (p.GpioAction.SET_OUTPUT, p.GpioAction.SET_PIN_MODE) and \
            pkt.sub_device_id in self.cfg.stop_outputs

    def moves(self, pkt: p.GeneralPacket) -> bool:
        return self.raw_moves(pkt)  # the setters of a stop output: other pins are not the stop's

    @moves_when(SET_PIN_MODE)
    @moves_when(SET_PIN_OUTPUT)
    def pin_moves(self, req: RoiSetPinMode | RoiSetPinOutput) -> bool:
        """A pin of `stop_outputs` drives something that moves (the kit's bus stop gate); the other pins do not."""
        return req.pin in self.cfg.stop_outputs

    def blank_advice(self) -> str:
        return ("A GPIO module is configured by its first successful set_pin_mode: send one, or give the module "
                "`pin_modes` in the service's settings and the service sets them at start and after every reset.")

    async def pull(self) -> None:
        """No mode getter in the firmware: a module already running gets the configured pin modes (the same
        SET_PIN_MODE when they match), so that the published modes are true."""
        for pin, name in self.cfg.pin_modes.items():
            await self.set_ok(p.GeneralPacket(pin, p.GpioAction.SET_PIN_MODE, bytes([PIN_MODE_CODES[name]])),
                              f"SET_PIN_MODE {pin}")
        if self.cfg.pin_modes:
            self.publish_modes()

    def on_raw_reply(self, pkt: p.GeneralPacket, rep: p.GeneralPacket) -> None:
        pin, ok = pkt.sub_device_id, rep.payload[0] == 1
        if not ok or pin >= p.GPIO_COUNT:
            return
        if pkt.action == p.GpioAction.SET_PIN_MODE:
            self.modes[pin] = pkt.payload[0]
            if pkt.payload[0] != p.PinMode.OUTPUT:
                self.outputs.pop(pin, None)
            self.publish_modes()
        elif pkt.action == p.GpioAction.SET_OUTPUT:
            self.outputs[pin] = 1 if pkt.payload[0] else 0
            self.values[pin] = self.outputs[pin]

    def publish_modes(self) -> None:
        self.dev.publish(PIN_STATES, RoiPinStates(modes=list(self.modes),
                                                  names=[PIN_MODE_NAMES.get(m, str(m)) for m in self.modes],
                                                  ts=time.time()))

    async def poll(self) -> None:
        for _ in range(self.ctx.settings.roi_gpio_reads_per_tick):
            pin = p.GPIO_PINS[self.cursor]
            rep = await self.ctx.transport.general(self.cfg.octet, p.GeneralPacket(pin, p.GpioAction.READ))
            self.values[pin] = p.gpio_read_value(pin, rep.payload)
            self.cursor = (self.cursor + 1) % len(p.GPIO_PINS)
            if self.cursor == 0:
                self.dev.publish(PIN_VALUES, RoiPinValues(values=list(self.values), ts=time.time()))

    def has_cache(self) -> bool:
        return any(self.modes)

    async def push(self) -> None:
        for pin in p.GPIO_PINS:
            if self.modes[pin]:
                await self.set_ok(p.GeneralPacket(pin, p.GpioAction.SET_PIN_MODE, bytes([self.modes[pin]])),
                                  f"SET_PIN_MODE {pin}")
        for pin, value in self.outputs.items():
            await self.set_ok(p.GeneralPacket(pin, p.GpioAction.SET_OUTPUT, bytes([value])), f"SET_OUTPUT {pin}")
        self.publish_modes()

    @handles(SET_PIN_MODE)
    async def cmd_set_pin_mode(self, req: RoiSetPinMode) -> RoiAck:
        with self.command_sends():
            mode = PIN_MODE_CODES[req.mode]
            await self.set_ok(p.GeneralPacket(req.pin, p.GpioAction.SET_PIN_MODE, bytes([mode])), "SET_PIN_MODE")
            self.modes[req.pin] = mode
            if mode != p.PinMode.OUTPUT:
                self.outputs.pop(req.pin, None)
            self.publish_modes()
            return RoiAck(accepted=True, detail=f"pin {req.pin} is {req.mode}")

    @handles(SET_PIN_OUTPUT)
    async def cmd_set_pin_output(self, req: RoiSetPinOutput) -> RoiAck:
        with self.command_sends():
            if self.modes[req.pin] not in (0, p.PinMode.OUTPUT):
                mode = PIN_MODE_NAMES[self.modes[req.pin]]
                raise CommandError(ErrorCode.INVALID_REQUEST, f"pin {req.pin} is {mode}; set_pin_mode output first")
            await self.set_ok(p.GeneralPacket(req.pin, p.GpioAction.SET_OUTPUT, bytes([req.value])), "SET_OUTPUT")
            self.outputs[req.pin] = req.value
            self.values[req.pin] = req.value
            return RoiAck(accepted=True, detail=f"pin {req.pin} = {req.value}")


class MotionModule(RoiModule, ABC):
    """What the ODrive and the actuator share: jobs that move and follow, and raw packets that only read."""

    # raw general packets take getters only: a setter moves the module or changes how it moves behind the service's
    # back (its published set-points, its re-sends after a reset, its stop)
    raw_get_mask: ClassVar[int]
    raw_actions: ClassVar[type[IntEnum]]
    raw_what: ClassVar[tuple[str, str]]  # (the module's kind, what a setter moves)
    raw_instead: ClassVar[str]  # the typed commands to use

    def __init__(self, ctx: ModuleContext, cfg: RoiModuleConfig) -> None:
        super().__init__(ctx, cfg)
        self.position: float | None = None
        self.velocity = 0.0
        self.dev.on_stop(ctx.stop_pass.action(self.dev.name), inline=True)  # RoiService.stop_pass

    def moves(self, pkt: p.GeneralPacket) -> bool:
        return not pkt.action & self.raw_get_mask  # every setter moves the module or changes how it moves

    def raw_motion(self, pkt: p.GeneralPacket) -> str:
        if pkt.action & self.raw_get_mask:
            return ""
        try:
            name = self.raw_actions(pkt.action).name
        except ValueError:
            name = "unknown setter"
        kind, moved = self.raw_what
        return (f"raw action 0x{pkt.action:04x} ({name}) is an {kind} setter: it moves {moved} or changes how it "
                f"moves. Raw packets to an {kind} take getters only (get bit 0x{self.raw_get_mask:x}); use "
                f"{self.raw_instead}")

    @property
    @abstractmethod
    def tolerance(self) -> float:
        """How close to a target counts as arrived, in the module's units."""

    @property
    def estimated(self) -> bool:
        return False

    @abstractmethod
    async def goto(self, target: float, req: RoiGotoPosition) -> None:
        """Send the module towards `target` (its own units), switching its mode as the firmware needs."""

    @abstractmethod
    async def cmd_set_velocity(self, req: RoiSetVelocity) -> RoiAck:
        """The `set_velocity` command in the module's own terms."""

    def current_position(self) -> float:
        if self.position is None or not self.live:
            raise CommandError(ErrorCode.UNAVAILABLE, f"{self.cfg.name}: no current position (module not answering)")
        return self.position

    @handles(GOTO_POSITION)
    async def cmd_goto(self, req: RoiGotoPosition) -> RoiAck:
        with self.command_sends():
            await self.goto(req.position, req)
            return RoiAck(accepted=True, detail=f"target {req.position} {self.unit}")

    @handles(GOTO_RELATIVE)
    async def cmd_goto_relative(self, req: RoiGotoPosition) -> RoiAck:
        with self.command_sends():
            target = self.current_position() + req.position
            await self.goto(target, req)
            return RoiAck(accepted=True, detail=f"target {target} {self.unit}")

    def admit_job(self, req: RoiMoveRequest) -> None:
        if self.dev.running_jobs():
            raise CommandError(ErrorCode.BUSY, f"{self.cfg.name} is already moving (job {self.dev.running_jobs()[0]})")
        self.check_kind()
        if not self.live:
            raise CommandError(ErrorCode.UNAVAILABLE, f"{self.cfg.name} is not connected ({self.link.state.value})")

    @runs(GO_TO_POSITION, admit="admit_job")
    async def job_absolute(self, req: RoiMoveRequest, job: JobContext) -> RoiMoveResult:
        return await self.move(req.position, req, job)

    @runs(GO_TO_RELATIVE, admit="admit_job")
    async def job_relative(self, req: RoiMoveRequest, job: JobContext) -> RoiMoveResult:
        return await self.move(self.current_position() + req.position, req, job)

    def module_error(self) -> str:
        h = self.dev.health
        return str(h["error_message"]) if h["connection"] and h["error"] else ""

    async def move(self, target: float, req: RoiMoveRequest, job: JobContext) -> RoiMoveResult:
        """Success within tolerance (the original waited while position == goal, §4.5)."""
        guard_sends(self.stop_guard())  # this job's own task: nothing that moves once the bus stop is active
        try:
            return await self._move(target, req, job)
        except RequestRefused as exc:
            job.check_cancelled()  # the stop cancelled the job: its result says `stopped`, with the stop's reason
            raise _stopped(exc) from None

    async def _move(self, target: float, req: RoiMoveRequest, job: JobContext) -> RoiMoveResult:
        tol = req.tolerance or self.tolerance
        start = self.current_position()
        await self.goto(target, req)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout_s
        total = abs(target - start)
        while True:
            pos = self.position if self.position is not None else start
            job.progress("moving", done=max(0.0, total - abs(target - pos)), total=total, position=pos,
                         velocity=self.velocity, target=target, estimated=self.estimated)
            if abs(target - pos) <= tol:
                return RoiMoveResult(target=target, position=pos, velocity=self.velocity, unit=self.unit,  # type: ignore[arg-type]
                                     estimated=self.estimated)
            if job.cancelled:
                with contextlib.suppress(RequestRefused):  # the bus stop cancelled it: its datagrams hold the module
                    await self.stop()
                job.check_cancelled()
            if not self.live:
                raise CommandError(ErrorCode.UNAVAILABLE, f"{self.cfg.name} disconnected during the move")
            err = self.module_error()
            if err:
                with contextlib.suppress(CommandError):
                    await self.stop()
                raise CommandError(ErrorCode.DEVICE_ERROR, f"{self.cfg.name}: {err}")
            if loop.time() >= deadline:
                with contextlib.suppress(CommandError):
                    await self.stop()
                raise CommandError(ErrorCode.TIMEOUT, f"{self.cfg.name} not within {tol} {self.unit} of {target} "
                                                      f"after {req.timeout_s} s (at {pos:.4g}); stopped")
            self.state_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state_event.wait(), 0.1)


class OdriveModule(MotionModule):
    """§3.6/§7.1: GET_ALL every tick; commands switch control/input modes first."""

    raw_get_mask = p.ODRIVE_GETMASK  # the firmware's getter test (§3.6)
    raw_actions = p.OdriveAction
    raw_what = ("ODrive", "the motor")
    raw_instead = ("goto_position, set_velocity, set_torque or clear_errors, which keep the set-points the service "
                   "publishes, re-sends after a module reset and stops on shutdown")

    def __init__(self, ctx: ModuleContext, cfg: RoiModuleConfig) -> None:
        super().__init__(ctx, cfg)
        self.cache: dict[str, float] = {}  # control_mode, input_mode, torque, position, velocity: what we set
        self.torque_sp = 0.0
        self.errors = 0
        if cfg.initial_mode is not None:  # settings: pushed when the module is blank, like a cache
            cm, im = p.COMMAND_MODES[cfg.initial_mode]
            self.cache.update({"control_mode": cm, "input_mode": im, cfg.initial_mode: 0.0})

    def blank_advice(self) -> str:
        return ("An ODrive module is configured by any set command (set_velocity, set_torque, goto_position): "
                "send one, or give the module `initial_mode` (velocity or torque) in the service's settings and "
                "the service sets that mode at a zero demand at start and after every reset.")

    @property
    def tolerance(self) -> float:
        return self.cfg.tolerance or self.ctx.settings.roi_odrive_tolerance

    async def poll(self) -> None:
        rep = await self.ctx.transport.general(self.cfg.octet, p.odrive_request(p.OdriveAction.GET_ALL))
        a = p.OdriveAll.decode(rep.payload)
        self.position, self.velocity = a.position, a.velocity
        now = time.time()
        self.dev.publish(STATE, RoiMotionState(position=a.position, velocity=a.velocity, torque=self.torque_sp,
                                               unit="rev", estimated=False, ts=now))
        self.dev.publish(POWER, RoiOdrivePower(voltage=a.bus_voltage, current=a.current, ts=now))
        self.dev.publish(TEMPERATURE, RoiOdriveTemperature(fet_temperature=a.fet_temperature,
                                                           motor_temperature=a.motor_temperature, ts=now))
        if a.error != self.errors:
            self.errors = a.error
            self.error_text = p.odrive_error_text(a.error)
            if a.error:
                self.fault("module_error", self.error_text)
            self.sync_health()
        self.state_event.set()

    def has_cache(self) -> bool:
        return bool(self.cache)

    async def push(self) -> None:
        # the order of §4.3: control mode, input mode, torque, position, velocity
        for key, act in (("control_mode", p.OdriveAction.SET_CONTROL_MODE),
                         ("input_mode", p.OdriveAction.SET_INPUT_MODE), ("torque", p.OdriveAction.SET_TORQUE),
                         ("position", p.OdriveAction.SET_POSITION), ("velocity", p.OdriveAction.SET_VELOCITY)):
            if key in self.cache:
                await self.set_ok(p.odrive_request(act, self.cache[key]), f"push {key}")

    async def pull(self) -> None:
        for key, act in (("control_mode", p.OdriveAction.GET_CONTROL_MODE),
                         ("input_mode", p.OdriveAction.GET_INPUT_MODE),
                         ("torque", p.OdriveAction.GET_TORQUE_SETPOINT),
                         ("position", p.OdriveAction.GET_POSITION_SETPOINT),
                         ("velocity", p.OdriveAction.GET_VELOCITY_SETPOINT)):
            rep = await self.request(p.odrive_request(act), f"pull {key}")
            self.cache[key] = rep.payload[0] if key.endswith("_mode") else p.read_f32(rep.payload)
        self.torque_sp = self.cache.get("torque", 0.0)

    async def set_value(self, key: str, act: p.OdriveAction, value: float) -> None:
        await self.set_ok(p.odrive_request(act, value), act.name)
        self.cache[key] = value

    async def modes(self, kind: str) -> None:
        """§7.1: switch control and input mode first when the cached ones differ."""
        cm, im = p.COMMAND_MODES[kind]
        if self.cache.get("control_mode") != cm:
            await self.set_value("control_mode", p.OdriveAction.SET_CONTROL_MODE, cm)
        if self.cache.get("input_mode") != im:
            await self.set_value("input_mode", p.OdriveAction.SET_INPUT_MODE, im)

    def check_limits(self, velocity: float = 0.0, torque: float = 0.0) -> None:
        if self.cfg.max_velocity is not None and abs(velocity) > self.cfg.max_velocity:
            raise CommandError(ErrorCode.INVALID_REQUEST, f"|velocity| {abs(velocity)} > max_velocity "
                                                          f"{self.cfg.max_velocity} rev/s")
        if self.cfg.max_torque is not None and abs(torque) > self.cfg.max_torque:
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"|torque| {abs(torque)} > max_torque {self.cfg.max_torque} Nm")

    async def goto(self, target: float, req: RoiGotoPosition) -> None:
        if not p.fits_f32(target):
            raise CommandError(ErrorCode.INVALID_REQUEST, f"target {target} does not fit a float32")
        self.check_limits(req.velocity_feedforward, req.torque_feedforward)
        await self.modes("position")
        if req.velocity_feedforward:
            await self.set_value("velocity", p.OdriveAction.SET_VELOCITY, req.velocity_feedforward)
        if req.torque_feedforward:
            await self.set_value("torque", p.OdriveAction.SET_TORQUE, req.torque_feedforward)
        # relative moves too go as SET_POSITION: a resent SET_RELATIVE_POSITION whose first reply was lost
        # would be applied twice (the protocol has no sequence number)
        await self.set_value("position", p.OdriveAction.SET_POSITION, target)

    @handles(SET_VELOCITY)
    async def cmd_set_velocity(self, req: RoiSetVelocity) -> RoiAck:
        with self.command_sends():
            self.check_limits(req.velocity, req.torque_feedforward)
            await self.modes("velocity")
            if req.torque_feedforward:
                await self.set_value("torque", p.OdriveAction.SET_TORQUE, req.torque_feedforward)
            await self.set_value("velocity", p.OdriveAction.SET_VELOCITY, req.velocity)
            return RoiAck(accepted=True, detail=f"velocity {req.velocity} rev/s")

    @handles(SET_TORQUE)
    async def cmd_set_torque(self, req: RoiSetTorque) -> RoiAck:
        with self.command_sends():
            self.check_limits(torque=req.torque)
            await self.modes("torque")
            await self.set_value("torque", p.OdriveAction.SET_TORQUE, req.torque)
            self.torque_sp = req.torque
            return RoiAck(accepted=True, detail=f"torque {req.torque} Nm")

    @handles(CLEAR_ERRORS)
    async def cmd_clear_errors(self, req: RoiEmpty) -> RoiAck:
        with self.command_sends():
            await self.set_ok(p.odrive_request(p.OdriveAction.CLEAR_ERRORS), "CLEAR_ERRORS")
            # the module state (2/4) would otherwise stay in health until the next STATUS_REPORT (up to 12.8 s)
            with contextlib.suppress(RequestLost):
                await self.poll()
                await self.fetch_status()
            return RoiAck(accepted=True, detail="errors cleared")

    async def stop(self) -> None:
        """Velocity mode, 0 rev/s (the original's cancel sent velocity 0 in whatever mode was active, which
        in position mode only zeroes a feed-forward)."""
        await self.modes("velocity")
        await self.set_value("velocity", p.OdriveAction.SET_VELOCITY, 0.0)

    def stop_packets(self) -> list[p.GeneralPacket]:
        """The bus stop (docs/reference/roi.md §3.6): velocity 0 first (it stops a velocity-mode axis at once), the
        torque feed-forward 0, then velocity mode with VEL_RAMP and velocity 0 again, so that the axis ends in
        velocity mode at 0 rev/s whatever mode it was in. The ROI protocol has no code for the ODrive's IDLE
        state (only the module's own watchdog idles the axis, and the released firmware is built without it,
        §6.3): the axis stays in closed loop, held at 0 rev/s."""
        cm, im = p.COMMAND_MODES["velocity"]
        self.cache.pop("position", None)  # a reset gets the stopped demand re-sent, not an old target
        self.cache.update({"control_mode": cm, "input_mode": im, "torque": 0.0, "velocity": 0.0})
        self.torque_sp = 0.0
        return [p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0), p.odrive_request(p.OdriveAction.SET_TORQUE, 0.0),
                p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, cm),
                p.odrive_request(p.OdriveAction.SET_INPUT_MODE, im), p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0)]

    def stop_problems(self, pkts: list[p.GeneralPacket], replies: list[p.GeneralPacket]) -> list[str]:
        return [f"the module refused {p.OdriveAction(pkt.action).name} (reply {r.payload[0]})"
                for pkt, r in zip(pkts, replies, strict=False) if r.payload[0] != 1]


class ActuatorModule(MotionModule):
    """§3.7: lengths in encoder ticks. The released firmware implements no getter (GET_CURRENT_LENGTH is
    answered [0] = 0) while the ROS node at 6ec908d reads a uint16 BE length from it: the reply is the measured
    position where the module answers one (`length_feedback`: on; auto = from its first non-zero length, since
    the released firmware's zero reply reads as length 0); elsewhere the position is estimated from the
    commands (moving toward the target at the commanded velocity) and flagged `estimated`."""

    raw_get_mask = p.ACTUATOR_GET_MASK
    raw_actions = p.ActuatorAction
    raw_what = ("actuator", "the actuator")
    raw_instead = ("goto_position or set_velocity, which keep the target the service publishes, re-sends after a "
                   "module reset and holds on shutdown")

    unit = "percent"
    VELOCITY_WINDOW_S = 0.5  # measured velocity: position difference over about this long (ticks are coarse)

    def __init__(self, ctx: ModuleContext, cfg: RoiModuleConfig) -> None:
        super().__init__(ctx, cfg)
        self.position = None  # unknown until measured or the first absolute move
        self.target: float | None = None
        self.speed = cfg.default_velocity  # %/s
        self.speed_set = False
        self.t_est = time.monotonic()
        self.measured = cfg.length_feedback == "on"  # the position comes from GET_CURRENT_LENGTH replies
        self.samples: list[tuple[float, float]] = []  # (monotonic, %) of recent measurements
        self.lengths_seen = 0  # GET_CURRENT_LENGTH replies since the service started

    @property
    def tolerance(self) -> float:
        return self.cfg.tolerance or self.ctx.settings.roi_actuator_tolerance

    @property
    def estimated(self) -> bool:
        return not self.measured

    def on_length(self, ticks: int) -> None:
        """A GET_CURRENT_LENGTH reply read as the measured length (uint16 BE ticks, the 6ec908d node's layout)."""
        now = time.monotonic()
        pct = ticks / self.cfg.max_position * 100.0
        self.measured = True
        self.samples = [s for s in self.samples if now - s[0] <= self.VELOCITY_WINDOW_S]
        self.velocity = (pct - self.samples[0][1]) / (now - self.samples[0][0]) if self.samples and \
            now > self.samples[0][0] else 0.0
        self.samples.append((now, pct))
        self.position = pct

    def ticks(self, percent: float) -> int:
        return round(max(0.0, min(100.0, percent)) / 100.0 * self.cfg.max_position)

    def resets_to_blank(self) -> bool:
        return False  # the firmware never leaves BLANK_STATE (§3.7): a reset shows as uptime going backwards

    def operational_state(self, state: int) -> bool:
        return state in p.OPERATIONAL_STATES or state == p.ModuleState.BLANK_STATE

    def state_message(self, state: int) -> str:
        if state == p.ModuleState.BLANK_STATE:
            return ("Blank state, operational: the actuator firmware never reports itself configured (it never "
                    "calls notifySystemConfigured), and it moves all the same; nothing to do.")
        return super().state_message(state)

    def estimate(self) -> None:
        if self.measured:
            return
        now = time.monotonic()
        dt, self.t_est = now - self.t_est, now
        if self.position is None or self.target is None:
            self.velocity = 0.0
            return
        err = self.target - self.position
        step = max(-self.speed * dt, min(self.speed * dt, err))
        self.position += step
        self.velocity = (step / dt) if dt > 0 and abs(err) > 1e-9 else 0.0

    async def poll(self) -> None:
        # GET_CURRENT_LENGTH also feeds the module's watchdog where the firmware does not implement it
        rep = await self.ctx.transport.general(self.cfg.octet, p.GeneralPacket(self.cfg.channel,
                                                                                p.ActuatorAction.GET_CURRENT_LENGTH))
        ticks = p.read_u16(rep.payload)
        mode = self.cfg.length_feedback
        self.lengths_seen += 1
        if mode == "on" or (mode == "auto" and (self.measured or ticks != 0)):
            self.on_length(ticks)
        else:
            self.estimate()
        known = self.position is not None
        self.dev.publish(STATE, RoiMotionState(position=self.position, velocity=self.velocity if known else None,
                                               unit="percent", estimated=self.estimated, ts=time.time()))
        self.state_event.set()
        self.stop_possible()  # a stop that waited for the first length: held now (or told why it cannot be)

    def has_cache(self) -> bool:
        return self.target is not None or self.speed_set

    async def push(self) -> None:
        if self.speed_set:
            await self.request(p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_VELOCITY,
                                               p.f32(self.speed / 100.0 * self.cfg.max_position)), "push velocity")
        if self.target is not None:
            await self.request(p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_ABSOLUTE_LENGTH,
                                               p.u16(self.ticks(self.target))), "push length")

    def current_position(self) -> float:
        if self.measured:
            return super().current_position()
        self.estimate()
        if self.position is None:
            raise CommandError(ErrorCode.UNAVAILABLE, f"{self.cfg.name}: position unknown (the module answers no "
                                                      "length); send an absolute goto_position first")
        return self.position

    async def goto(self, target: float, req: RoiGotoPosition) -> None:
        if req.torque_feedforward:
            raise CommandError(ErrorCode.INVALID_REQUEST, "an actuator takes no torque_feedforward")
        if not 0.0 <= target <= 100.0:
            raise CommandError(ErrorCode.INVALID_REQUEST, f"target {target:.4g} % is outside 0..100 % of max_position")
        if req.velocity_feedforward:
            await self.set_speed(req.velocity_feedforward)
        # relative moves go as SET_ABSOLUTE_LENGTH too: SET_RELATIVE_LENGTH is a uint16 (no way back) and a
        # resend after a lost reply would add it twice
        await self.request(p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_ABSOLUTE_LENGTH,
                                           p.u16(self.ticks(target))), "SET_ABSOLUTE_LENGTH")
        self.estimate()
        if self.position is None and not self.measured:
            # first move: where it was is unknown, the estimate starts at the target (flagged estimated)
            self.position = target
        self.target = target

    async def set_speed(self, pct_s: float) -> None:
        if not 0 < pct_s <= 1000:  # NaN too; a negative speed is no direction (the target gives that)
            raise CommandError(ErrorCode.INVALID_REQUEST, f"actuator velocity {pct_s} %/s must be in (0, 1000]: the "
                                                          "speed of its moves (the target gives the direction)")
        await self.request(p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_VELOCITY,
                                           p.f32(pct_s / 100.0 * self.cfg.max_position)), "SET_VELOCITY")
        self.estimate()
        self.speed = pct_s
        self.speed_set = True

    @handles(SET_VELOCITY)
    async def cmd_set_velocity(self, req: RoiSetVelocity) -> RoiAck:
        with self.command_sends():
            if req.torque_feedforward:
                raise CommandError(ErrorCode.INVALID_REQUEST, "an actuator takes no torque_feedforward")
            await self.set_speed(req.velocity)
            return RoiAck(accepted=True, detail=f"moves at {req.velocity} %/s")

    def stop_packets(self) -> list[p.GeneralPacket]:
        """The bus stop: the ROI actuator protocol has no stop code (docs/reference/roi.md §3.7), so the actuator is
        held where it is, SET_ABSOLUTE_LENGTH at the measured (or estimated) position. The firmware answers
        every setter [0] = 0: the reply acknowledges, it does not confirm."""
        self.estimate()
        if self.position is None:
            if self.length_awaited():
                raise StopPending("stop pending: the actuator's position is not known yet (no length reply from the "
                                  "module since the service started); it is held at its measured length as soon as "
                                  "the module's first GET_CURRENT_LENGTH reply comes")
            raise CommandError(ErrorCode.UNAVAILABLE, f"nothing sent: the actuator's position is unknown "
                                                      f"({self.no_length_why()}, no move since the service "
                                                      "started), so there is no length to hold it at, and the "
                                                      "ROI actuator protocol has no stop code")
        self.target = self.position
        return [p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_ABSOLUTE_LENGTH,
                                p.u16(self.ticks(self.position)))]

    def length_awaited(self) -> bool:
        """A length reply may yet say where the actuator is: `on`, or `auto` before the module's first reply."""
        mode = self.cfg.length_feedback
        return mode == "on" or (mode == "auto" and self.lengths_seen == 0)

    def no_length_why(self) -> str:
        if self.cfg.length_feedback == "off":
            return "no length feedback: length_feedback is off"
        return ("no length feedback: the module answers GET_CURRENT_LENGTH with 0, as the released firmware that "
                "implements no getter does")

    async def stop(self) -> None:
        """No stop in the firmware: hold at the measured (or estimated) position."""
        self.estimate()
        if self.position is not None and self.target is not None:
            await self.request(p.GeneralPacket(self.cfg.channel, p.ActuatorAction.SET_ABSOLUTE_LENGTH,
                                               p.u16(self.ticks(self.position))), "hold")
            self.target = self.position


MODULE_CLASSES: dict[str, type[RoiModule]] = {"gpio": GpioModule, "odrive": OdriveModule, "actuator": ActuatorModule}


__all__ = ["MODULE_CLASSES", "ActuatorModule", "GpioModule", "ModuleContext", "MotionModule", "OdriveModule",
           "RoiModule"]
