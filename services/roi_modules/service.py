"""roi-modules' MQTT surface: `RoiService` owns the transport (the one ROBOBUS_ROI_TRANSPORT names, loaded by name:
`udp`, both UDP sockets, by default) and one device per configured ROI module (device.py: each built from a
`ModuleContext`, not the service), runs one maintain task per module on one asyncio loop, and sends the bus stop;
`build()` wires it all (the transport's factory checks the ROI ports).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, cast

from services.roi_modules import protocol as p
from services.roi_modules.api import API
from services.roi_modules.device import MODULE_CLASSES, ModuleContext, MotionModule, RoiModule, StopPending
from services.roi_modules.link import RequestLost, RoiLink, TransportHooks
from services.roi_modules.settings import RoiSettings
from shared import CommandError, Node, ServiceUnavailable
from shared.lifecycle import Hooks
from shared.stop_pass import StopPass
from shared.transports import TransportUnavailable, load_transport

log = logging.getLogger("robobus.roi")

Early = tuple[list[p.GeneralPacket], float, list[asyncio.Future[p.GeneralPacket]]]  # pkts, t, futs


PHASE_SLOTS = 5  # maintain ticks go out in this many groups spread over the period (RoiService.serve)


class RoiService:
    """The hooks the kit runs: `serve()` on node.loop, `shutdown()` before the node says offline."""

    def __init__(self, node: Node, settings: RoiSettings) -> None:
        self.node = node
        self.settings = settings
        self.modules: list[RoiModule] = []
        self.by_octet: dict[int, list[RoiModule]] = {}
        self.transport = make_transport(self, settings)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        # the first call of an activation writes every module's stop on the kit's thread (`_write_early`): the
        # loop's pass may wait behind whatever the loop has queued (after a stalled process: seconds of
        # datagrams, heartbeats and streamed setpoints)
        self.stop_pass = StopPass(node, self._stop_pass, early=self._write_early)
        self.stop_timing: dict[str, float] = {}  # the last activation: early write, pass start (ms after read)
        self.by_name: dict[str, RoiModule] = {}
        self._confirming: set[asyncio.Task[None]] = set()
        # what a module uses of the service (device.py)
        self.context = ModuleContext(node, settings, self.transport, self.stop_pass)

    def build_modules(self) -> None:
        for cfg in self.settings.roi_modules:
            mod = MODULE_CLASSES[cfg.type](self.context, cfg)
            self.modules.append(mod)
            self.by_octet.setdefault(cfg.octet, []).append(mod)
            self.by_name[mod.dev.name] = mod

    # -- the bus stop (docs/kit.md, "Stopping everything"; the README's "Stopping everything") ------------------
    def _write_early(self, gen: int, members: list[str]) -> dict[str, Early]:
        """On the kit's thread, when it reads a stop: every member module's stop datagrams written at once from
        here (transport.send_from_thread), ahead of anything the loop has queued. The loop's pass does the rest
        (halt, reports, acks); a module whose stop cannot be built here is left to the pass (it says why)."""
        t0 = time.monotonic()
        if not self.transport.opened.is_set():
            return {}
        batch: list[tuple[RoiModule, list[p.GeneralPacket]]] = []
        for name in members:
            m = self.by_name.get(name)
            if m is None or m.kind_mismatch:
                continue
            try:
                batch.append((m, m.stop_packets()))
            except Exception:  # StopPending, CommandError, ...: the pass decides and reports
                continue
        if not batch:
            return {}
        try:
            sent = self.transport.send_from_thread([(m.cfg.octet, pkts) for m, pkts in batch])
        except RequestLost as exc:
            log.warning("bus stop: the write from the kit's thread failed (the pass writes it)",
                        extra={"error": str(exc)})
            return {}
        self.stop_timing = {"early_start": t0, "early_ms": (time.monotonic() - t0) * 1000}
        return {m.dev.name: (pkts, t, futs) for (m, pkts), (t, futs) in zip(batch, sent, strict=True)}

    def _take_early(self, name: str, gen: int) -> Early | None:
        """What the kit's thread wrote to `name` for activation `gen`; one of an older activation is forgotten."""
        e = self.stop_pass.take_early(name)
        if e is None:
            return None
        written_gen, early = e
        if written_gen != gen:
            self.transport.forget(self.by_name[name].cfg.octet, early[0], early[2])
            return None
        return cast(Early, early)

    def _stop_pass(self, due: dict[str, int]) -> None:
        """The bus stop of the modules `due` (name -> the stop's activation count), on the loop: every module's
        stop datagrams written at once (transport.send_now_many), then each module's acknowledgements awaited on
        their own (`confirm_stop`). A node that starts under the stop: once its sockets are bound."""
        if not self.transport.opened.is_set():
            self._confirm(self._stop_when_open(due))
            return
        latch = self.node.stop_latch
        start = self.stop_timing.get("early_start")
        if start is not None and "pass_ms" not in self.stop_timing:
            self.stop_timing["pass_ms"] = (time.monotonic() - start) * 1000
            log.info("bus stop written from the kit's thread", extra={k: round(v, 2) for k, v in
                                                                      self.stop_timing.items() if k != "early_start"})
        # nothing that moves may follow the stop's datagrams: the motion requests in flight to these modules end
        # now, their resends cancelled and their slots free (their guards refuse from the stop's activation on)
        halted = self.transport.halt({m.cfg.octet for m in (self.by_name.get(n) for n in due) if m is not None})
        batch: list[tuple[RoiModule, int, list[p.GeneralPacket]]] = []
        for name, gen in due.items():
            m = self.by_name.get(name)
            if m is None:
                continue
            early = self._take_early(name, gen)
            if early is not None:
                if m.cfg.octet not in halted:  # written already, ahead of the loop's queue: the bookkeeping
                    m.supersede_stop()
                    self._confirm(m.confirm_stop(m.stop_written(gen, *early)))
                    continue
                # a motion request was in flight as the thread wrote: the stop is written again after it
                self.transport.forget(m.cfg.octet, early[0], early[2])
            if m.kind_mismatch:
                latch.report(name, gen, None, f"nothing sent: {m.mismatch_message()}")
                continue
            try:
                batch.append((m, gen, m.stop_packets()))
            except StopPending as exc:
                m.stop_pending(gen, str(exc))  # reported when it can be written (the module calls the pass again)
            except CommandError as exc:
                latch.report(name, gen, None, exc.message)
            except Exception as exc:  # one module's failure must not keep the stop from the others
                log.exception("bus stop: the module's stop failed", extra={"device": name})
                latch.report(name, gen, None, f"{type(exc).__name__}: {exc}")
        # a stop write still awaiting its acks gives way to this one (the replies to come are this write's)
        for m, _, _ in batch:
            m.supersede_stop()
        try:
            sent = self.transport.send_now_many([(m.cfg.octet, pkts) for m, _, pkts in batch])
        except RequestLost as exc:
            for m, gen, _ in batch:
                latch.report(m.dev.name, gen, None, str(exc))
            return
        for (m, gen, pkts), (t, futs) in zip(batch, sent, strict=True):
            self._confirm(m.confirm_stop(m.stop_written(gen, pkts, t, futs)))

    async def _stop_when_open(self, due: dict[str, int]) -> None:
        await self.transport.opened.wait()
        self._stop_pass(due)

    def _confirm(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._confirming.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._confirming.discard)

    def _live(self, octet: int) -> bool:
        return any(m.live for m in self.by_octet.get(octet, ()))

    def _on_reply(self, octet: int, port: int, pkt: p.GeneralPacket | p.SysAdminPacket) -> None:
        for m in self.by_octet.get(octet, ()):
            m.on_reply(port, pkt)

    def _on_garbage(self, octet: int, reason: str) -> None:
        for m in self.by_octet.get(octet, ()):
            m.on_garbage(reason)

    def _on_decode_error(self, what: str) -> None:
        self.node.count_decode_error(what)

    def hooks(self) -> Hooks:
        """One asyncio main (the transport, one maintain task per module); shutdown() stops the motion modules."""
        return Hooks(serve=self.serve, shutdown=self.shutdown)

    async def serve(self) -> None:
        await self.transport.open()
        log.info("serving ROI modules", extra={"host": self.transport.cfg.host_address,
                                               "modules": [f"{m.cfg.name}@{m.cfg.octet}" for m in self.modules]})
        # ticks in PHASE_SLOTS groups spread over the period: all modules in one instant made a burst a command
        # could queue behind for the whole tick's work; one slot per module lost the batching (each request,
        # reply and publish woke the loop and paho's thread on its own) and doubled the CPU
        slots = min(PHASE_SLOTS, len(self.modules))
        self._tasks = [asyncio.ensure_future(m.maintain((i % slots) / slots)) for i, m in enumerate(self.modules)]
        self._tasks.append(asyncio.ensure_future(self._link_stats()))
        try:
            await asyncio.gather(*self._tasks)
        finally:
            for t in self._tasks:
                t.cancel()

    async def _link_stats(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for m in self.modules:
                m.publish_link()

    async def shutdown(self) -> None:
        """Fail-safe: stop the maintain loops, zero every motor's demand, close the sockets."""
        if self._stopped:
            return
        self._stopped = True
        for t in [*self._tasks, *self._confirming]:
            t.cancel()
        if self.transport.bound:
            stops = [m.stop() for m in self.modules if isinstance(m, MotionModule) and m.live
                     and not m.kind_mismatch]
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), 2.0)
        self.transport.close()
        for m in self.modules:
            m.link.clear_fault()
            m.link.stop("service stopped; motors were sent a stop")


def make_transport(svc: RoiService, settings: RoiSettings) -> RoiLink:
    """The transport ROBOBUS_ROI_TRANSPORT names, through the kit's transport loader (shared/transports.py, entry
    points `roi-modules.<name>`; `udp`: transport.py's `udp_transport`). Its factory gets the settings and the
    hooks (the configured modules' octets and the service's callbacks), once, when the service is built."""
    try:
        factory = load_transport(API.service, settings.roi_transport)
    except TransportUnavailable as exc:
        raise ServiceUnavailable(str(exc)) from None
    hooks = TransportHooks(sorted({m.octet for m in settings.roi_modules}), live=svc._live, on_reply=svc._on_reply,
                           on_garbage=svc._on_garbage, on_decode_error=svc._on_decode_error)
    return cast(RoiLink, factory(settings, hooks))


def build(node: Node, settings: RoiSettings) -> RoiService:
    # the switch interval is the kit's setting (switch_interval_ms: 1 ms by default here, settings.py); the
    # transport's factory checks that it can own the ROI ports (transport.py) before anything connects
    svc = RoiService(node, settings)
    svc.build_modules()
    return svc


__all__ = ["RoiService", "build", "make_transport"]  # the contract is api.py's, the settings settings.py's
