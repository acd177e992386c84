"""can-bootloader's MQTT surface: flash PIC18F motor boards (jobs), read their version and flash, reset them.

One node serves the motor boards of one hand through one device (default `motors`); the two palm CAN buses
(boards 0–9 on bus 1, 10–19 on bus 2) are two python-can buses from configuration, or the palm's CAN bridge.
One flash per bus at a time: a second request for a busy bus is answered `busy`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.can_bootloader import protocol as p
from services.can_bootloader.flasher import (
    Exchange,
    Finished,
    FlashConfig,
    Flasher,
    FlashWarning,
    Phase,
    Rewind,
    read_exchange,
    reset_exchange,
    version_exchange,
)
from services.can_bootloader.image import FlashImage, ImageError, load_intel_hex
from services.can_bootloader.transport import CanBusConfig, CanPort, TransportError
from shared import CommandError, ErrorCode, JobContext, KitSettings, Node, ServiceAPI

log = logging.getLogger("robobus.can_bootloader")

MAX_HEX_CHARS = 4_000_000
BRIDGE_INTERFACE = "robobus_bridge"


# -- requests and replies ----------------------------------------------------------------------------------
class _Firmware(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hex: str | None = Field(None, max_length=MAX_HEX_CHARS, description="The firmware as Intel HEX text")
    path: str | None = Field(None, max_length=1024, description="A .hex file inside the service's firmware folder "
                                                               "(relative to it); nowhere else is readable")
    window: int | None = Field(None, ge=1, le=64, description="Frames in flight (default from configuration)")
    check_bootloader_aware: bool = Field(True, description="After the reset, send the magic packet once more to "
                                                           "prove the new firmware can be reflashed over CAN")

    @model_validator(mode="after")
    def _one_source(self) -> _Firmware:
        if (self.hex is None) == (self.path is None):
            raise ValueError("give exactly one of `hex` (Intel HEX text) or `path` (a file in the firmware folder)")
        return self


class FlashRequest(_Firmware):
    """Flash one motor board (0–19)."""

    board: int = Field(ge=0, le=p.MAX_BOARD_ID, description="Board id: 0–9 on CAN bus 1, 10–19 on CAN bus 2")


class FlashManyRequest(_Firmware):
    """Flash several boards with one image; the two buses run in parallel."""

    boards: list[int] = Field(min_length=1, max_length=20, description="Board ids 0–19, each at most once")

    @field_validator("boards")
    @classmethod
    def _boards(cls, v: list[int]) -> list[int]:
        bad = [b for b in v if not 0 <= b <= p.MAX_BOARD_ID]
        if bad:
            raise ValueError(f"board ids must be 0–{p.MAX_BOARD_ID}, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError("each board at most once")
        return v


class FlashBoardResult(BaseModel):
    """The outcome of flashing one board (the `flash` job result, and the `flash_report` event)."""

    board: int
    bus: int
    ok: bool
    reason: str
    phase: str = Field(description="Where it ended: 'done', or the failing phase (magic, erase, write, verify, ...)")
    address: int | None = Field(None, description="Program memory address of the failure, when there is one")
    bootloader_aware: bool | None = Field(None, description="False: the board can no longer be reflashed over CAN")
    cancelled: bool = False
    image_first: int
    image_last: int
    bytes_written: int
    bytes_verified: int
    frames_sent: int
    frames_received: int
    retries: int
    restarts: int
    duration_s: float
    frames_per_s: float
    warnings: list[str] = Field(default_factory=list)


class FlashManyResult(BaseModel):
    results: list[FlashBoardResult]


class BootBoardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    board: int = Field(ge=0, le=p.MAX_BOARD_ID)


class BootVersionReply(BaseModel):
    board: int
    bus: int
    version: str = Field(description="The bootloader's 4 version bytes as hex (40414243)")


class BootReadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    board: int = Field(ge=0, le=p.MAX_BOARD_ID)
    address: int = Field(ge=0, le=0x3FFFFF, description="First program memory address")
    length: int = Field(ge=1, le=4096, description="Bytes to read (read 8 at a time)")


class BootReadReply(BaseModel):
    board: int
    bus: int
    address: int
    data: str = Field(description="The bytes read, as hex")


class BootResetReply(BaseModel):
    board: int
    bus: int


# error codes beyond the kit's: a bus not configured or failing (unavailable), one exchange per bus (busy),
# no answer (timeout); a flash also refuses paths outside the firmware folder (forbidden) and ends with
# device_error when a board fails verification
_BUS_ERRORS = [ErrorCode.UNAVAILABLE, ErrorCode.BUSY, ErrorCode.TIMEOUT]
_FLASH_ERRORS = [ErrorCode.UNAVAILABLE, ErrorCode.BUSY, ErrorCode.TIMEOUT, ErrorCode.FORBIDDEN, ErrorCode.DEVICE_ERROR]
API = ServiceAPI("can-bootloader",
                 device_doc="the motor boards (PIC18F2580 CAN bootloader) of one hand's two CAN buses",
                 doc="Flashes the Shadow hand's motor boards over CAN (a python-can bus or the palm's CAN bridge).")
FLASH = API.job("flash", FlashRequest, FlashBoardResult, errors=_FLASH_ERRORS,
                doc="Flash one board: magic packet, erase, write, read-back verify, reset, bootloader-aware check")
FLASH_MANY = API.job("flash_many", FlashManyRequest, FlashManyResult, errors=_FLASH_ERRORS,
                     doc="Flash several boards; boards 0–9 and 10–19 (the two buses) in parallel")
READ_VERSION = API.command("read_version", BootBoardRequest, BootVersionReply, errors=_BUS_ERRORS,
                           doc="The bootloader's version")
READ_FLASH = API.command("read_flash", BootReadRequest, BootReadReply, errors=_BUS_ERRORS,
                         doc="Dump program memory (bootloader mode)")
RESET = API.command("reset", BootBoardRequest, BootResetReply, errors=_BUS_ERRORS,
                    doc="RESET: the bootloader marks the application valid (EEPROM[0xFF]=0x42) and starts it")
FLASH_REPORT = API.event("flash_report", FlashBoardResult, doc="One board flashed (or not): the full outcome")


# -- settings ----------------------------------------------------------------------------------------------
class FlashTuning(BaseModel):
    """Timeouts and retries of the flasher (defaults: the original's, but bounded)."""

    model_config = ConfigDict(extra="forbid")
    magic_timeout_s: float = Field(0.1, gt=0)
    magic_tries: int = Field(2, ge=1)
    erase_timeout_s: float = Field(3.0, gt=0)
    erase_tries: int = Field(3, ge=1)
    post_erase_delay_s: float = Field(0.0, ge=0, description="The original slept 1 s after the erase ACK")
    frame_timeout_s: float = Field(0.1, gt=0)
    block_retries: int = Field(20, ge=0)
    read_retries: int = Field(20, ge=1)
    reset_timeout_s: float = Field(1.0, gt=0)
    reset_tries: int = Field(3, ge=1)
    check_delay_s: float = Field(0.05, ge=0)
    check_timeout_s: float = Field(0.5, gt=0)
    check_tries: int = Field(2, ge=1)
    drain_s: float = Field(0.05, ge=0)
    restarts: int = Field(1, ge=0)


def _default_bus(n: int) -> CanBusConfig:
    return CanBusConfig(interface="virtual", channel=f"robobus-can{n}")


class CanBootSettings(KitSettings):
    """can-bootloader configuration: ROBOBUS_CAN_* in the environment (nested values as JSON), or keys of a
    ROBOBUS_CONFIG file. Example: ROBOBUS_CAN_BUS1='{"interface": "socketcan", "channel": "can0"}'."""

    can_device: str = Field("motors", description="Device name on MQTT")
    can_bus1: CanBusConfig | None = Field(default_factory=lambda: _default_bus(1),
                                          description="Palm CAN bus 1 (boards 0–9); null: not served")
    can_bus2: CanBusConfig | None = Field(default_factory=lambda: _default_bus(2),
                                          description="Palm CAN bus 2 (boards 10–19); null: not served")
    can_firmware_dir: Path | None = Field(None, description="The only folder `path` requests may read from")
    can_window: int | None = Field(None, ge=1, le=64, description="Frames in flight; default 12 through the palm "
                                                                  "bridge (it paces 1 frame/ms), 2 on a direct bus "
                                                                  "(the PIC's two receive buffers)")
    can_flash: FlashTuning = Field(default_factory=FlashTuning)
    can_sim: bool = Field(False, description="Run simulated boards on in-process virtual buses (make run, demos)")
    can_sim_boards: list[int] = Field(default_factory=lambda: list(range(20)))
    can_sim_erase_s: float = Field(0.968, ge=0, description="Simulated erase time (484 rows x 2 ms)")
    can_sim_row_write_s: float = Field(0.002, ge=0)


BRIDGE_WINDOW = 12  # the bridge round trip is ~4 palm cycles on a quiet host, more on a loaded one
DIRECT_WINDOW = 2  # the PIC's two receive buffers


def default_window(bus: CanBusConfig) -> int:
    return BRIDGE_WINDOW if bus.interface == BRIDGE_INTERFACE else DIRECT_WINDOW


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
        self._mutex = threading.Lock()
        self._reserved: dict[int, _Reservation] = {}
        self._images: dict[int, FlashImage] = {}
        self._jobs: set[JobContext] = set()
        self._closing = threading.Event()
        self.last_error = ""
        self.dev: Any = None
        self.sims: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def attach(self, node: Node) -> None:
        dev = node.device(self.settings.can_device)
        self.dev = dev
        for port in self.ports.values():
            port.on_garbage = node.count_decode_error
        dev.bind_job(FLASH, self._flash, self._admit_flash)
        dev.bind_job(FLASH_MANY, self._flash_many, self._admit_flash_many)
        dev.bind(READ_VERSION, self._read_version)
        dev.bind(READ_FLASH, self._read_flash)
        dev.bind(RESET, self._reset)
        self.update_health()

    def open(self) -> None:
        for port in self.ports.values():
            try:
                port.open()
            except TransportError as exc:
                self.last_error = str(exc)
                log.error("%s", exc)
        self.update_health()
        threading.Thread(target=self._watch, name="can-health", daemon=True).start()

    def _watch(self) -> None:
        """Health follows the buses: reopen a bus that failed to open, notice a palm bridge going offline."""
        while not self._closing.wait(1.0):
            for port in self.ports.values():
                if not port.connected and port.number not in self._reserved:
                    try:
                        port.open()
                    except TransportError:
                        pass
            self.update_health()

    def close(self) -> None:
        """Shutdown hook: cancel flashes (before RESET the board stays in its bootloader, ready to be flashed
        again), let them stop, then close the buses (the bridge lease is released)."""
        self._closing.set()
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

    def start_sim(self) -> None:
        """Simulated boards on the configured (virtual) buses, in this process."""
        import can

        from services.can_bootloader.sim import BootBusSim, make_boards

        for n, port in self.ports.items():
            ids = [b for b in self.settings.can_sim_boards if p.board_address(b).bus == n]
            bus = can.Bus(interface=port.cfg.interface, channel=port.cfg.channel)
            sim = BootBusSim(bus, make_boards(ids), row_write_s=self.settings.can_sim_row_write_s,
                             erase_s=self.settings.can_sim_erase_s,
                             ignore_sent=port.cfg.interface == "udp_multicast").start()
            self.sims.append(sim)

    # -- health ------------------------------------------------------------------------------------------------
    def update_health(self) -> None:
        if self.dev is None:
            return
        connected = bool(self.ports) and all(pt.connected for pt in self.ports.values())
        with self._mutex:
            busy = {n: r.board for n, r in self._reserved.items()}
        details = {
            f"bus{n}": {"interface": pt.cfg.interface, "channel": pt.cfg.channel, "connected": pt.connected,
                        "flashing_board": busy.get(n), "frames_sent": pt.frames_sent,
                        "frames_received": pt.frames_received, "garbage": pt.garbage}
            for n, pt in self.ports.items()
        }
        self.dev.set_health(connection=connected, operational=connected,
                            state="flashing" if busy else ("idle" if connected else "disconnected"),
                            error=bool(self.last_error), error_message=self.last_error, details=details)

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
            self._port(b)
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
        return FlashConfig(window=window, check_bootloader_aware=req.check_bootloader_aware,
                           **self.settings.can_flash.model_dump())

    def _exchange(self, board: int, ex: Exchange, what: str) -> Exchange:
        port = self._port(board)
        self._reserve([board], what)
        try:
            port.drain()
            port.drive(ex)
        except TransportError as exc:
            self.last_error = str(exc)
            raise CommandError(ErrorCode.UNAVAILABLE, str(exc)) from None
        finally:
            self._release([port.number])
        if not ex.ok:
            raise CommandError(ErrorCode.TIMEOUT, f"board {board} {what}: {ex.error()}")
        return ex

    # -- commands ----------------------------------------------------------------------------------------------
    def _read_version(self, req: BootBoardRequest) -> BootVersionReply:
        a = p.board_address(req.board)
        ex = self._exchange(req.board, version_exchange(a.local_id, self.settings.can_flash.frame_timeout_s),
                            "read_version")
        reply = ex.pipe.replies[0]
        return BootVersionReply(board=req.board, bus=a.bus, version=reply.data.hex() if reply else "")

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

    def _reset(self, req: BootBoardRequest) -> BootResetReply:
        a = p.board_address(req.board)
        self._exchange(req.board, reset_exchange(a.local_id, self.settings.can_flash.reset_timeout_s,
                                                 self.settings.can_flash.reset_tries), "reset")
        return BootResetReply(board=req.board, bus=a.bus)

    # -- flashing ----------------------------------------------------------------------------------------------
    def _admit_flash(self, req: FlashRequest) -> None:
        image = self.load_image(req)  # refused images never reach the bus
        self._reserve([req.board], "flash")
        self._images[id(req)] = image

    def _admit_flash_many(self, req: FlashManyRequest) -> None:
        image = self.load_image(req)
        self._reserve(req.boards, "flash_many")
        self._images[id(req)] = image

    def _track(self, job: JobContext, on: bool) -> None:
        with self._mutex:
            if on:
                self._jobs.add(job)
            else:
                self._jobs.discard(job)

    def _flash(self, req: FlashRequest, job: JobContext) -> FlashBoardResult:
        image = self._images.pop(id(req))
        port = self._port(req.board)
        lock = threading.Lock()
        self._track(job, True)
        try:
            res = self.flash_board(req.board, image, self._config(req, port), job, lock,
                                   lambda snap: job.progress(snap["phase"], snap["done"], snap["total"],
                                                             **{k: v for k, v in snap.items()
                                                                if k not in ("phase", "done", "total")}))
        finally:
            self._track(job, False)
            self._release([port.number])
        if res.cancelled:
            job.cancel()
            job.check_cancelled()
        if not res.ok:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"board {req.board}: {res.reason}")
        return res

    def _flash_many(self, req: FlashManyRequest, job: JobContext) -> FlashManyResult:
        image = self._images.pop(id(req))
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
                                       lambda snap, _b=b: report(_b, snap))  # type: ignore[misc]
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
            raise CommandError(ErrorCode.DEVICE_ERROR, "; ".join(f"board {r.board}: {r.reason}" for r in failed))
        return FlashManyResult(results=ordered)

    @staticmethod
    def _percent(snap: dict[str, Any]) -> float:
        weights = {"magic": (0, 2), "erase": (2, 8), "write": (10, 45), "verify": (55, 40), "reset": (95, 2),
                   "check": (97, 2), "check_reset": (99, 1), "reenter": (95, 2), "done": (100, 0)}
        start, span = weights.get(snap["phase"], (0, 0))
        frac = snap["done"] / snap["total"] if snap.get("total") else 0.0
        return float(start + span * frac)

    def flash_board(self, board: int, image: FlashImage, cfg: FlashConfig, job: JobContext | None,
                    lock: threading.Lock, report: Callable[[dict[str, Any]], None]) -> FlashBoardResult:
        """Flash one board on its (already reserved) bus; never raises for device trouble: the result says."""
        a = p.board_address(board)
        port = self._port(board)
        flasher = Flasher(a.local_id, image, cfg)
        t0 = time.monotonic()
        warnings: list[str] = []
        sent0, recv0 = port.frames_sent, port.frames_received

        def every(now: float) -> None:
            snap = flasher.snapshot()
            for ev in flasher.events():
                if isinstance(ev, FlashWarning):
                    warnings.append(ev.message)
                    log.warning("board %d: %s", board, ev.message)
                elif isinstance(ev, Rewind):
                    where = f" at 0x{ev.address:06X}" if ev.address is not None else ""
                    log.info("board %d: %s retry%s: %s", board, ev.phase.value, where, ev.reason)
            dt = max(now - t0, 1e-6)
            report({"phase": snap.phase.value, "done": snap.done, "total": snap.total, "board": board,
                    "frames_sent": snap.frames_sent, "frames_per_s": round(snap.frames_sent / dt, 1),
                    "retries": snap.retries})

        flasher.start(t0)
        every(t0)
        try:
            port.drain()
            port.drive(flasher, cancel=(lambda: job.cancelled) if job is not None else None,
                       on_cancel=flasher.cancel, every=every)
            result = flasher.result
        except TransportError as exc:
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
        ok_write = result.ok or result.phase in (Phase.VERIFY, Phase.RESET, Phase.CHECK, Phase.CHECK_RESET,
                                                 Phase.REENTER)
        out = FlashBoardResult(
            board=board, bus=a.bus, ok=result.ok, reason=result.reason, phase=phase, address=result.address,
            bootloader_aware=result.bootloader_aware, cancelled=result.cancelled,
            image_first=image.first, image_last=image.last,
            bytes_written=write_total if ok_write else (snap.done if snap.phase is Phase.WRITE else 0),
            bytes_verified=len(image.data) if result.ok else (snap.done if snap.phase is Phase.VERIFY else 0),
            frames_sent=port.frames_sent - sent0, frames_received=port.frames_received - recv0,
            retries=snap.retries, restarts=snap.restarts, duration_s=round(dt, 3),
            frames_per_s=round((port.frames_sent - sent0) / dt, 1) if dt > 0 else 0.0,
            warnings=list(dict.fromkeys(warnings)))
        with lock:
            if result.ok and result.bootloader_aware is False:
                self.last_error = f"board {board}: {result.reason}"
                log.error("BOARD %d CAN NO LONGER BE FLASHED OVER CAN: %s", board, result.reason)
            elif not result.ok and not result.cancelled:
                self.last_error = f"board {board}: {result.reason}"
                log.error("board %d flash failed: %s", board, result.reason)
            elif result.ok:
                self.last_error = ""
        if self.dev is not None:
            self.dev.emit(FLASH_REPORT, out)
        self.update_health()
        return out


def build(node: Node, settings: CanBootSettings) -> CanBootService:
    svc = CanBootService(settings)
    svc.attach(node)
    if settings.can_sim:
        svc.start_sim()
    svc.open()
    node.on_shutdown(svc.close)
    return svc
