"""can-bootloader's MQTT surface: flash PIC18F motor boards (jobs), read their version and flash, reset them.

One node serves the motor boards of one hand through one device (default `motors`); the two palm CAN buses
(boards 0–9 on bus 1, 10–19 on bus 2) are two python-can buses from configuration, or the palm's CAN bridge.
One flash per bus at a time: a second request for a busy bus is answered `busy`.

Health comes from the kit's link supervisor (shared/link.py, docs/kit.md "Health"): the link is the adapter (the
python-can buses, or the palm's bridge), because the boards answer only while in their bootloader and only
when asked. Valid data = every configured bus proved healthy within `can_liveness_s` (a clean read, no error
state; through the bridge: ethercat-loop online); boards are heard only during a flash or a read.

The bus stop (shared/stop.py, docs/kit.md "Stopping everything"): `reset` is a motion command (RESET starts a
board's firmware, which may drive its motor). A flash is not one the kit may cancel (a board stopped in the middle
of its erase or write is left without a valid image), so its start is gated instead: refused `stopped` while the
stop is active; one in progress continues through write and verify, and the RESET it would send is held (the board
stays in its bootloader). The stop action writes nothing (no bootloader frame stops a motor): it waits until no
RESET can leave any more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.can_bootloader import protocol as p
from services.can_bootloader.api import (
    API,
    FLASH,
    FLASH_MANY,
    FLASH_REPORT,
    READ_FLASH,
    READ_VERSION,
    RESET,
)
from services.can_bootloader.flasher import (
    Exchange,
    Finished,
    FlashConfig,
    Flasher,
    FlashWarning,
    Hold,
    Phase,
    PhaseStarted,
    Rewind,
    read_exchange,
    reset_exchange,
    version_exchange,
)
from services.can_bootloader.image import FlashImage, ImageError, load_intel_hex
from services.can_bootloader.models import (
    BootBoardRequest,
    BootReadReply,
    BootReadRequest,
    BootResetReply,
    BootVersionReply,
    FlashBoardResult,
    FlashManyRequest,
    FlashManyResult,
    FlashRequest,
    _Firmware,
)
from services.can_bootloader.settings import BRIDGE_INTERFACE, SIM_TRANSPORT, CanBootSettings, default_window
from services.can_bootloader.transport import BusHooks, CanPort, TransportError
from shared import CommandError, ErrorCode, JobContext, Node, ServiceUnavailable
from shared.device import handles, runs
from shared.lifecycle import Hooks
from shared.link import LinkPolicy, SupervisedLink
from shared.messages import StopState
from shared.stop import describe
from shared.transport import Attempt, ReconnectSteps, on_clock
from shared.transports import TransportUnavailable, load_transport

__all__ = ["CanBootService", "build"]  # the contract is api.py's, the settings settings.py's

log = logging.getLogger("robobus.can_bootloader")


# the reasons of a board the bus stop held (flasher.py's Flasher._held) or kept from starting (_not_started)
_NOT_STARTED = "not started by the bus stop"
_HELD_PREFIXES = ("held by the bus stop", _NOT_STARTED)


class _NoLink:
    """The reconnect machine's link before `attach` gives it the device's: nothing is attempted before then."""

    def attempt(self, now: float) -> None:
        raise RuntimeError("the buses are not attached to a device yet")

    def failed(self, now: float, reason: str) -> None:
        pass

    def closed(self, now: float, reason: str) -> None:
        pass

    def next_attempt_in(self, now: float) -> float:
        return math.inf


# -- the service -------------------------------------------------------------------------------------------
@dataclass
class _Reservation:
    job: str
    board: int


class CanBootService:
    """The device: two CanPorts, their reservations, and the command handlers."""

    def __init__(self, settings: CanBootSettings, ports: dict[int, CanPort] | None = None) -> None:
        self.settings = settings
        if ports is None:
            ports = {}
            for n, cfg in ((1, settings.can_bus1), (2, settings.can_bus2)):
                if cfg is not None:
                    if cfg.interface == BRIDGE_INTERFACE:
                        # the bridge talks to ethercat-loop on this node's broker unless told otherwise
                        opts = {"mqtt_url": settings.mqtt_url, "topic_root": settings.topic_root, **cfg.options}
                        cfg = cfg.model_copy(update={"options": opts})
                    ports[n] = CanPort(n, cfg)
        self.ports = ports
        # per bus: held from a machine's poll to the end of its sends (CanPort.drive), so that the bus stop's action
        # knows when no RESET can leave any more
        self._gates = {n: threading.Lock() for n in ports}
        self._held: dict[int, str] = {}  # board -> why the bus stop left it in its bootloader (RESET held)
        self._stop_shown = False  # the stop's note is in the health details
        self._mutex = threading.Lock()
        self._reserved: dict[int, _Reservation] = {}
        self._images: dict[int, tuple[FlashImage, int | None]] = {}  # admitted request -> image, stop generation
        self._jobs: set[JobContext] = set()
        self._closing = threading.Event()
        self._steps = ReconnectSteps(_NoLink(), max_wait_s=math.inf)  # attach() binds it to the device's link
        self._steps_lock = threading.Lock()
        self.last_error = ""       # the last failure (a flash, an exchange, the adapter): details, never `error`
        self._faults: dict[int, str] = {}  # board -> what it reports (NOT bootloader-aware): the device's `error`
        self.dev: Any = None
        self.link: SupervisedLink | None = None
        self._node: Node | None = None
        self._watcher: threading.Thread | None = None
        self.sims: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def hooks(self) -> Hooks:
        """Nothing for run_service to drive: build() opens the buses and registers close() as the shutdown hook;
        the link watcher and the jobs run on their own threads."""
        return Hooks()

    def attach(self, node: Node) -> None:
        dev = node.device(self.settings.can_device)
        self.dev = dev
        self._node = node
        s = self.settings
        self.link = dev.supervise_link(LinkPolicy(liveness_s=s.can_liveness_s, backoff_min_s=s.can_backoff_min_s,
                                                  backoff_max_s=max(s.can_backoff_max_s, s.can_backoff_min_s),
                                                  probe_period_s=s.can_probe_period_s))
        # the kit's reconnect machine, driven by the link's tick (`_connect`): attempts, failures, sessions' ends
        self._steps = ReconnectSteps(on_clock(self.link), max_wait_s=math.inf)
        if not self.ports:
            self.link.fault("no CAN bus is configured (can_bus1 and can_bus2 are both null)")
        for port in self.ports.values():
            port.on_garbage = self._on_garbage
        dev.bind_all(self)  # the commands and jobs marked below (@handles, @runs)
        dev.on_stop(self._stop_now)
        self.update_health()

    def open(self) -> None:
        self._connect()
        self.check_link()
        self._watcher = threading.Thread(target=self._watch, name="can-link", daemon=True)
        self._watcher.start()

    def _connect(self) -> None:
        """One turn of the kit's reconnect machine (`shared.transport.ReconnectSteps`, driven by the link's tick):
        when the supervisor says so (its back-off, then one probe per probe period), one attempt to open every
        configured bus that is not open; the machine tells the supervisor the attempt and its failure (counted,
        never an `error`). A session is every configured bus open; it is over once one is closed (lost)."""
        closed = [pt for pt in self.ports.values() if not pt.is_open]
        if not closed or self.link is None:
            return
        steps = self._steps
        with self._steps_lock:
            now = time.monotonic()
            if steps.in_session:  # a bus was lost (told by `_lost`): the session is over
                steps.session_over(now, self.last_error)
            if not isinstance(steps.next_action(now), Attempt):
                return
        errors = []
        for port in closed:
            try:
                port.open()
            except TransportError as exc:
                errors.append(str(exc))
        with self._steps_lock:
            if errors:
                self.last_error = "; ".join(errors)
                log.warning("%s", self.last_error)
                steps.open_failed(time.monotonic(), self.last_error)
            else:
                steps.opened()
                self.link.opened()

    def _lost(self, port: CanPort, reason: str) -> None:
        """The adapter failed (error state, a failed send or read, the bridge's palm offline): close the bus, the
        link is lost (or never reached), and it is reopened after the supervisor's back-off. A bus lost while
        others were not open yet (no session) is told all the same."""
        self.last_error = reason
        log.warning("%s", reason)
        port.close()
        if self.link is None or self._closing.is_set():
            return
        with self._steps_lock:
            if not self._steps.lost(time.monotonic(), reason):
                self.link.closed(reason)

    def check_link(self) -> None:
        """One turn of the link: reopen what is closed when the supervisor says so, check the adapters, and
        report valid data when every configured bus proved healthy within the budget."""
        link = self.link
        if link is None or self._closing.is_set():
            return
        if any(not pt.is_open for pt in self.ports.values()) and link.next_attempt_in() <= 0:
            self._connect()
        healthy = bool(self.ports)
        for port in self.ports.values():
            if not port.is_open:
                healthy = False
                continue
            try:
                proven = port.check()
            except TransportError as exc:
                self._lost(port, str(exc))
                healthy = False
                continue
            # between exchanges check() just proved it; during one, the exchange's own reads did (last_ok)
            fresh = port.last_ok is not None and time.monotonic() - port.last_ok <= self.settings.can_liveness_s
            healthy = healthy and proven and fresh
        if healthy and not self._closing.is_set():
            link.data()

    def _watch(self) -> None:
        period = self.settings.can_liveness_s / 4
        next_details = 0.0
        while not self._closing.wait(period):
            self.check_link()
            if time.monotonic() >= next_details or self._stop_active() != self._stop_shown:
                # counters in details: at most once a second; the stop's note as soon as the stop comes or goes
                next_details = time.monotonic() + 1.0
                self.update_health()

    def _on_garbage(self, what: str) -> None:
        """A frame the bootloader never sends, or a malformed answer: counted (node and link), never liveness."""
        if self._node is not None:
            self._node.count_decode_error(what)
        if self.link is not None:
            self.link.garbage(what)

    def close(self) -> None:
        """Shutdown hook: cancel flashes (before RESET the board stays in its bootloader, ready to be flashed
        again), let them stop, then close the buses (the bridge lease is released)."""
        self._closing.set()
        with self._steps_lock:
            self._steps.close()
        if self._watcher is not None:
            self._watcher.join(2.0)
        with self._mutex:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            with self._mutex:
                if not self._reserved:
                    break
            time.sleep(0.02)
        for sim in self.sims:
            sim.stop()
            sim.bus.shutdown()
        for port in self.ports.values():
            port.close()
        if self.link is not None:
            self.link.stop("shutdown")  # final health: stopped, connection false, no valid data

    def start_sim(self) -> None:
        """Simulated boards on the configured (virtual) buses, in this process (`make run`, demos): the transport
        `can-bootloader.sim` (ROBOBUS_CAN_SIM), loaded by name (shared/transports.py), given the settings and the
        ports (`BusHooks`)."""
        try:
            boards = load_transport(API.service, SIM_TRANSPORT)
        except TransportUnavailable as exc:
            raise ServiceUnavailable(str(exc)) from None
        self.sims.extend(boards(self.settings, BusHooks(self.ports)))

    # -- health ------------------------------------------------------------------------------------------------
    def update_health(self) -> None:
        """The service's part of health: its finer state (idle / flashing) while the link is operational, the
        boards' faults as the `error`, and per-bus details. The link supervisor owns the rest (docs/kit.md)."""
        if self.dev is None or self.link is None:
            return
        with self._mutex:
            busy = {n: r.board for n, r in self._reserved.items()}
            flashing = sorted(n for n, r in self._reserved.items() if r.job.startswith("flash"))
            faults = "; ".join(self._faults[b] for b in sorted(self._faults))
        details: dict[str, Any] = {
            f"bus{n}": {"interface": pt.cfg.interface, "channel": pt.cfg.channel, "open": pt.is_open,
                        "connected": pt.connected, "flashing_board": busy.get(n), "frames_sent": pt.frames_sent,
                        "frames_received": pt.frames_received, "frames_idle": pt.frames_idle,
                        "garbage": pt.garbage}
            for n, pt in self.ports.items()
        }
        if self.last_error:
            details["last_failure"] = self.last_error
        stopped = self._stop_active()
        self._stop_shown = stopped
        if stopped:
            details["bus_stop"] = (
                "no flash and no reset starts (refused: stopped); "
                + (f"the flash in progress on bus {' and '.join(str(n) for n in flashing)} continues through write "
                   "and verify (a board stopped mid-write is left without a valid image), its RESET held: the board "
                   "stays in its bootloader, and the boards of a flash_many not begun yet are not flashed"
                   if flashing else "no flash is in progress")
                + ". Nothing is sent to stop a motor: the motor boards' firmware is driven by ethercat-loop")
        with self._mutex:
            held = dict(self._held)
        if held:
            details["reset_held"] = {str(b): why for b, why in sorted(held.items())}
        self.dev.set_health(details=details)
        self.link.device_state("flashing" if busy else "idle")
        if faults:
            self.link.fault(faults)
        elif self.ports:
            self.link.clear_fault()

    # -- the bus stop ---------------------------------------------------------------------------------------------
    def _stop_active(self) -> bool:
        return self._node is not None and self._node.stop_latch.active

    def _hold_reason(self, gen: int | None) -> str | None:
        """Why a RESET must not go out now: the bus stop is active, or one came (and went) since the command
        that would send it was admitted at `gen` (a device moves again only on a new command); else None. The
        kit's latch is the one copy of the stop's state."""
        if self._node is None:
            return None
        latch = self._node.stop_latch
        s = latch.state
        if s is not None and s.active:
            return f"the bus stop is active: {describe(s)}"
        if gen is not None and latch.generation != gen:
            return ("a bus stop came and was released since this command started: a board starts again only on a "
                    "new command")
        return None

    def _hold(self, gen: int | None) -> Hold:
        return lambda: self._hold_reason(gen)

    def _stop_now(self, stop: StopState) -> float:
        """The device's stop action (docs/kit.md "Stopping everything"): the kit already refuses new flashes and
        resets, and every flash in progress holds its RESET from now (Flasher.hold). Nothing is written: the
        bootloader protocol has no stop (reference shadow_ethercat.md §4), a board in its bootloader drives
        nothing, and a running firmware's motor is ethercat-loop's. The stop has reached the boards once no
        RESET decided before it can still be on its way: each bus's gate passed once."""
        for gate in self._gates.values():
            with gate:
                pass
        at = time.time()
        with self._mutex:
            flashing = sorted(r.board for r in self._reserved.values() if r.job.startswith("flash"))
        log.warning("bus stop: no flash or reset starts; flashes in progress continue with their RESET held",
                    extra={"source": stop.source, "reason": stop.reason, "flashing": flashing})
        self.update_health()
        return at

    # -- helpers -----------------------------------------------------------------------------------------------
    def _port(self, board: int) -> CanPort:
        bus = p.board_address(board).bus
        port = self.ports.get(bus)
        if port is None:
            raise CommandError(ErrorCode.UNAVAILABLE, f"board {board} is on CAN bus {bus}, which is not configured")
        return port

    def _reserve(self, boards: list[int], job: str) -> None:
        buses = {p.board_address(b).bus: b for b in reversed(boards)}
        for b in buses.values():
            port = self._port(b)
            if not port.is_open:
                why = f": {port.last_error}" if port.last_error else ""
                raise CommandError(ErrorCode.UNAVAILABLE, f"CAN bus {port.number} is not open{why} (it is reopened "
                                                          "as the health's details.link says)")
        with self._mutex:
            taken = [n for n in buses if n in self._reserved]
            if taken:
                n = taken[0]
                r = self._reserved[n]
                raise CommandError(ErrorCode.BUSY, f"CAN bus {n} is busy ({r.job} on board {r.board}); one flash "
                                                   "per bus at a time")
            for n, b in buses.items():
                self._reserved[n] = _Reservation(job, b)
        self.update_health()

    def _release(self, buses: list[int]) -> None:
        with self._mutex:
            for n in buses:
                self._reserved.pop(n, None)
        self.update_health()

    def load_image(self, req: _Firmware) -> FlashImage:
        try:
            if req.hex is not None:
                return load_intel_hex(req.hex)
            return load_intel_hex(self._read_firmware_file(req.path or ""))
        except ImageError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    def _read_firmware_file(self, rel: str) -> str:
        root = self.settings.can_firmware_dir
        if root is None:
            raise CommandError(ErrorCode.FORBIDDEN, "firmware paths are disabled: no firmware_dir is configured "
                                                    "(send the Intel HEX text in `hex`)")
        base = root.resolve()
        target = (base / rel).resolve()
        if not target.is_relative_to(base) or target == base:
            raise CommandError(ErrorCode.FORBIDDEN, f"{rel!r} is outside the firmware folder")
        if not target.is_file():
            raise CommandError(ErrorCode.NOT_FOUND, f"no firmware file {rel!r} in the firmware folder")
        return target.read_text(encoding="ascii", errors="replace")

    def _config(self, req: _Firmware, port: CanPort) -> FlashConfig:
        window = req.window or self.settings.can_window or default_window(port.cfg)
        return self.settings.can_flash.model_copy(update={"window": window,
                                                          "check_bootloader_aware": req.check_bootloader_aware})

    def _exchange(self, board: int, ex: Exchange, what: str) -> Exchange:
        port = self._port(board)
        self._reserve([board], what)
        try:
            with port.lock:
                port.drain()
                port.drive(ex, guard=self._gates.get(port.number))
        except TransportError as exc:
            self._lost(port, str(exc))
            raise CommandError(ErrorCode.UNAVAILABLE, str(exc)) from None
        finally:
            self._release([port.number])
        if ex.held:
            sent = " (a RESET sent before it was not acknowledged: the board may run its firmware)" \
                if ex.pipe.frames_sent else ""
            raise CommandError(ErrorCode.STOPPED, f"board {board} {what}: not sent, {ex.held}{sent}")
        for frame in ex.malformed:
            self._on_garbage(f"board {board} {what}: malformed answer sid 0x{frame.sid:03X} "
                             f"data {frame.data.hex(' ') or '(none)'}")
        if not ex.ok:
            if ex.malformed:
                last = ex.malformed[-1]
                raise CommandError(ErrorCode.DEVICE_ERROR, f"board {board} {what}: answered with "
                                                           f"{len(ex.malformed)} malformed frame(s), not the "
                                                           f"bootloader's answer (last: sid 0x{last.sid:03X} data "
                                                           f"{last.data.hex(' ') or '(none)'}); {ex.error()}")
            raise CommandError(ErrorCode.TIMEOUT, f"board {board} {what}: {ex.error()}")
        return ex

    # -- commands ----------------------------------------------------------------------------------------------
    @handles(READ_VERSION)
    def _read_version(self, req: BootBoardRequest) -> BootVersionReply:
        a = p.board_address(req.board)
        ex = self._exchange(req.board, version_exchange(a.local_id, self.settings.can_flash.frame_timeout_s),
                            "read_version")
        reply = ex.pipe.replies[0]
        return BootVersionReply(board=req.board, bus=a.bus, version=reply.data.hex() if reply else "")

    @handles(READ_FLASH)
    def _read_flash(self, req: BootReadRequest) -> BootReadReply:
        a = p.board_address(req.board)
        port = self._port(req.board)
        ex = read_exchange(a.local_id, req.address, req.length,
                           window=self.settings.can_window or default_window(port.cfg),
                           timeout_s=self.settings.can_flash.frame_timeout_s,
                           tries=self.settings.can_flash.read_retries)
        self._exchange(req.board, ex, "read_flash")
        blob = b"".join(r.data for r in ex.pipe.replies if r is not None)
        skip = req.address % 8
        return BootReadReply(board=req.board, bus=a.bus, address=req.address, data=blob[skip:skip + req.length].hex())

    @handles(RESET)
    def _reset(self, req: BootBoardRequest) -> BootResetReply:
        """A motion command: the kit refuses it while the bus stop is active; one that the stop overtakes before
        its RESET leaves is answered `stopped` (the frame held, as in a flash)."""
        gen = self._node.stop_latch.generation if self._node is not None else None
        a = p.board_address(req.board)
        self._exchange(req.board, reset_exchange(a.local_id, self.settings.can_flash.reset_timeout_s,
                                                 self.settings.can_flash.reset_tries, hold=self._hold(gen)), "reset")
        with self._mutex:
            self._held.pop(req.board, None)
        self.update_health()
        return BootResetReply(board=req.board, bus=a.bus)

    # -- flashing ----------------------------------------------------------------------------------------------
    def _admit_stop(self) -> int | None:
        """A flash's gate: the kit's own (`stopped` while the bus stop is active, `unavailable` until the node has
        read it). Not `motion=True`: the kit would cancel a running flash, and a board stopped mid-write is left
        without a valid image; a flash in progress holds its RESET instead. The activation count it passed at."""
        return self._node.stop_latch.admit() if self._node is not None else None

    def _admit_flash(self, req: FlashRequest) -> None:
        gen = self._admit_stop()
        image = self.load_image(req)  # refused images never reach the bus
        self._reserve([req.board], "flash")
        self._images[id(req)] = (image, gen)

    def _admit_flash_many(self, req: FlashManyRequest) -> None:
        gen = self._admit_stop()
        image = self.load_image(req)
        self._reserve(req.boards, "flash_many")
        self._images[id(req)] = (image, gen)

    def _track(self, job: JobContext, on: bool) -> None:
        with self._mutex:
            if on:
                self._jobs.add(job)
            else:
                self._jobs.discard(job)

    @runs(FLASH, admit="_admit_flash")
    def _flash(self, req: FlashRequest, job: JobContext) -> FlashBoardResult:
        image, gen = self._images.pop(id(req))
        port = self._port(req.board)
        lock = threading.Lock()
        self._track(job, True)
        try:
            res = self.flash_board(req.board, image, self._config(req, port), job, lock,
                                   lambda snap: job.progress(snap["phase"], snap["done"], snap["total"],
                                                             **{k: v for k, v in snap.items()
                                                                if k not in ("phase", "done", "total")}),
                                   hold=self._hold(gen))
        finally:
            self._track(job, False)
            self._release([port.number])
        if res.cancelled:
            job.cancel()
            job.check_cancelled()
        if self._was_held(res):
            raise CommandError(ErrorCode.STOPPED, f"board {req.board}: {res.reason}")
        if res.no_answer:  # nothing known about the board: `timeout`, as read_version says of a silent board
            raise CommandError(ErrorCode.TIMEOUT, f"board {req.board}: {res.reason}")
        if not res.ok:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"board {req.board}: {res.reason}")
        return res

    @runs(FLASH_MANY, admit="_admit_flash_many")
    def _flash_many(self, req: FlashManyRequest, job: JobContext) -> FlashManyResult:
        image, gen = self._images.pop(id(req))
        hold = self._hold(gen)
        by_bus: dict[int, list[int]] = {}
        for b in req.boards:
            by_bus.setdefault(p.board_address(b).bus, []).append(b)
        results: dict[int, FlashBoardResult] = {}
        progress: dict[int, dict[str, Any]] = {}
        lock = threading.Lock()
        total = 100.0 * len(req.boards)

        def report(board: int, snap: dict[str, Any]) -> None:
            with lock:
                progress[board] = snap
                pct = sum(100.0 if b in results else self._percent(s) for b, s in progress.items())
                pct += sum(100.0 for b in results if b not in progress)
                phases = " ".join(f"{b}:{s['phase']}" for b, s in sorted(progress.items()) if b not in results)
            job.progress("flashing", pct, total, boards=phases, done_boards=len(results),
                         frames_per_s=round(sum(s.get("frames_per_s", 0.0) for b, s in progress.items()
                                                if b not in results), 1))

        def bus_worker(boards: list[int]) -> None:
            for b in boards:
                if job.cancelled:
                    break
                port = self._port(b)
                res = self.flash_board(b, image, self._config(req, port), job, lock,
                                       lambda snap, _b=b: report(_b, snap), hold=hold)  # type: ignore[misc]
                with lock:
                    results[b] = res

        threads = [threading.Thread(target=bus_worker, args=(boards,), name=f"flash-bus{n}", daemon=True)
                   for n, boards in by_bus.items()]
        self._track(job, True)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self._track(job, False)
            self._release(list(by_bus))
        ordered = [results[b] for b in req.boards if b in results]
        if job.cancelled:
            job.check_cancelled()
        failed = [r for r in ordered if not r.ok]
        if failed:
            # the bus stop's boards (RESET held, or not started) alone: `stopped`; any other failure: device_error
            code = ErrorCode.STOPPED if all(self._was_held(r) for r in failed) else \
                ErrorCode.TIMEOUT if all(r.no_answer for r in failed) else ErrorCode.DEVICE_ERROR
            raise CommandError(code, "; ".join(f"board {r.board}: {r.reason}" for r in failed))
        return FlashManyResult(results=ordered)

    @staticmethod
    def _was_held(res: FlashBoardResult) -> bool:
        """The bus stop held this board's RESET, or kept its flash from starting (flash_board's reasons)."""
        return not res.ok and res.reason.startswith(_HELD_PREFIXES)

    @staticmethod
    def _percent(snap: dict[str, Any]) -> float:
        weights = {"magic": (0, 1), "guard": (1, 1), "erase": (2, 8), "write": (10, 45), "verify": (55, 40),
                   "guard_check": (95, 0), "reset": (95, 2), "check": (97, 1), "probe": (98, 1), "check_reset": (99, 1),
                   "reenter": (95, 2), "done": (100, 0)}
        start, span = weights.get(snap["phase"], (0, 0))
        frac = snap["done"] / snap["total"] if snap.get("total") else 0.0
        return float(start + span * frac)

    def flash_board(self, board: int, image: FlashImage, cfg: FlashConfig, job: JobContext | None,
                    lock: threading.Lock, report: Callable[[dict[str, Any]], None],
                    hold: Hold | None = None) -> FlashBoardResult:
        """Flash one board on its (already reserved) bus; never raises for device trouble: the result says.
        `hold()` (the bus stop): asked before the flash starts (a reason: it does not) and before every RESET
        (a reason: the flash ends there, written and verified, the board in its bootloader)."""
        a = p.board_address(board)
        port = self._port(board)
        why = hold() if hold is not None else None
        if why:
            return self._not_started(board, image, why)
        flasher = Flasher(a.local_id, image, cfg, board_id=board, hold=hold)
        t0 = time.monotonic()
        warnings: list[str] = []
        sent0, recv0 = port.frames_sent, port.frames_received

        def every(now: float) -> None:
            snap = flasher.snapshot()
            dt = max(now - t0, 1e-6)
            for ev in flasher.events():
                if isinstance(ev, PhaseStarted) and ev.phase is not snap.phase:
                    # a phase begun and ended between two reports (the erase of a fast board, the guard's
                    # reads): named in the progress all the same
                    report({"phase": ev.phase.value, "done": 0, "total": ev.total_bytes, "board": board,
                            "frames_sent": snap.frames_sent, "frames_per_s": round(snap.frames_sent / dt, 1),
                            "retries": snap.retries})
                elif isinstance(ev, FlashWarning):
                    warnings.append(ev.message)
                    log.warning("board %d: %s", board, ev.message)
                elif isinstance(ev, Rewind):
                    where = f" at 0x{ev.address:06X}" if ev.address is not None else ""
                    log.info("board %d: %s retry%s: %s", board, ev.phase.value, where, ev.reason)
            report({"phase": snap.phase.value, "done": snap.done, "total": snap.total, "board": board,
                    "frames_sent": snap.frames_sent, "frames_per_s": round(snap.frames_sent / dt, 1),
                    "retries": snap.retries})

        flasher.start(t0)
        every(t0)
        try:
            with port.lock:
                port.drain()
                port.drive(flasher, cancel=(lambda: job.cancelled) if job is not None else None,
                           on_cancel=flasher.cancel, every=every, guard=self._gates.get(port.number))
            result = flasher.result
        except TransportError as exc:
            self._lost(port, str(exc))
            where = flasher.current_address()
            at = f" at 0x{where:06X}" if where is not None else ""
            result = Finished(False, f"{flasher.phase.value} failed{at}: {exc}", flasher.phase, where, None)
        assert result is not None
        for ev in flasher.events():
            if isinstance(ev, FlashWarning):
                warnings.append(ev.message)
        dt = time.monotonic() - t0
        snap = flasher.snapshot()
        phase = result.phase.value if isinstance(result.phase, Phase) else str(result.phase)
        write_total = sum(32 for _ in image.write_blocks())
        after_verify = result.phase in (Phase.GUARD_CHECK, Phase.RESET, Phase.CHECK, Phase.PROBE, Phase.CHECK_RESET,
                                        Phase.REENTER)
        ok_write = result.ok or after_verify or result.phase is Phase.VERIFY
        out = FlashBoardResult(
            board=board, bus=a.bus, ok=result.ok, reason=result.reason, phase=phase, address=result.address,
            bootloader_aware=result.bootloader_aware, cancelled=result.cancelled, no_answer=result.no_answer,
            boot_area_intact=result.boot_area_intact,
            image_first=image.first, image_last=image.last,
            bytes_written=write_total if ok_write else (snap.done if snap.phase is Phase.WRITE else 0),
            bytes_verified=len(image.data) if result.ok or after_verify else (snap.done if snap.phase is Phase.VERIFY
                                                                             else 0),
            frames_sent=port.frames_sent - sent0, frames_received=port.frames_received - recv0,
            retries=snap.retries, restarts=snap.restarts, duration_s=round(dt, 3),
            frames_per_s=round((port.frames_sent - sent0) / dt, 1) if dt > 0 else 0.0,
            warnings=list(dict.fromkeys(warnings)))
        with lock, self._mutex:
            # a board whose bootloader area changed is a fault the device reports (`error`, until the board is
            # flashed again without fault); a failed flash is the job's result and details' last_failure
            if result.boot_area_intact is False:
                self._faults[board] = f"board {board}: {result.reason}"
                self.last_error = f"board {board}: {result.reason}"
                log.error("BOARD %d: %s", board, result.reason)
            elif result.held:
                self._held[board] = result.reason
                log.warning("board %d: %s", board, result.reason)
            elif not result.ok and not result.cancelled:
                self.last_error = f"board {board}: {result.reason}"
                log.error("board %d flash failed: %s", board, result.reason)
            elif result.ok:
                self._faults.pop(board, None)
            if not result.held:
                self._held.pop(board, None)
        if self.dev is not None:
            self.dev.emit(FLASH_REPORT, out)
        self.update_health()
        return out

    def _not_started(self, board: int, image: FlashImage, why: str) -> FlashBoardResult:
        """A board whose flash the bus stop kept from starting: nothing was sent to it."""
        out = FlashBoardResult(
            board=board, bus=p.board_address(board).bus, ok=False, phase=Phase.IDLE.value,
            reason=f"{_NOT_STARTED}: {why}; nothing was sent to the board. Flash it again after the release",
            image_first=image.first, image_last=image.last, bytes_written=0, bytes_verified=0, frames_sent=0,
            frames_received=0, retries=0, restarts=0, duration_s=0.0, frames_per_s=0.0)
        log.warning("board %d: %s", board, out.reason)
        if self.dev is not None:
            self.dev.emit(FLASH_REPORT, out)
        return out


def build(node: Node, settings: CanBootSettings) -> CanBootService:
    svc = CanBootService(settings)
    svc.attach(node)
    if settings.can_sim:
        svc.start_sim()
    svc.open()
    node.on_shutdown(svc.close)
    return svc
