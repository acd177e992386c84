"""epuck-gateway's device: one `EpuckRobot` per robot (health, sensors, camera, link stats, faults, commands).

One process, one asyncio loop, one `EpuckRobot` per configured robot. Everything that touches a
link runs on the loop (command handlers are coroutines). JPEG encoding runs at the fps cap only, on
the loop by default (a 160x120 frame takes ~0.2 ms, less than handing it to a thread and back) or on
`EPUCK_ENCODE_WORKERS` threads; PNG snapshots always go to a thread.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

from services.epuck_gateway.api import (
    ASCII,
    CALIBRATE_IR,
    FAULT,
    FLASH,
    IMAGE,
    IMAGE_INFO,
    LEDS,
    LINK,
    OBSTACLE,
    RGB_CMD,
    SENSORS,
    SET_SPEED,
    SET_STEPS,
    SNAPSHOT,
    SOUND,
    STREAM,
)
from services.epuck_gateway.image import to_jpeg, to_png
from services.epuck_gateway.models import (
    EpuckActuators,
    EpuckAsciiReply,
    EpuckAsciiRequest,
    EpuckColor,
    EpuckEmpty,
    EpuckFault,
    EpuckFlashRequest,
    EpuckFlashResult,
    EpuckImageInfo,
    EpuckLeds,
    EpuckLinkStats,
    EpuckObstacleAvoidance,
    EpuckRgb,
    EpuckSensors,
    EpuckSetSpeed,
    EpuckSetSteps,
    EpuckSnapshot,
    EpuckSnapshotRequest,
    EpuckSound,
    EpuckStream,
)
from services.epuck_gateway.pacing import RateGate
from services.epuck_gateway.protocol.asercom import ascii_command
from services.epuck_gateway.protocol.firmware import (
    BadFirmware,
    FirmwareError,
    FlashTimeout,
    OneBar,
    ProgrammerBusy,
    ProgrammerNotFound,
    flash_firmware,
    parse_elf,
)
from services.epuck_gateway.protocol.wifi import (
    LED_BITS,
    LED_BODY,
    MIC_NAMES,
    REQ_IMAGE,
    RGB_LEDS,
    SOUNDS,
    SPEED_LIMIT,
    EpuckController,
    EpuckRawSensors,
    FramingError,
    ImagePacket,
    Packet,
    ProtocolError,
    SensorsPacket,
    StepUnwrapper,
    acc_to_g,
    battery_volts,
    finite,
    gyro_to_dps,
    unpack_sensors,
)
from services.epuck_gateway.settings import SERVICE, EpuckSerialRobot, EpuckSettings, EpuckWifiRobot
from services.epuck_gateway.transport.base import LineDropped, LinkHooks, RobotLink, link_policy
from shared import CommandError, ErrorCode, JobContext, Node, ServiceUnavailable
from shared.device import handles, moves_when, runs
from shared.stop_pass import StopPass
from shared.transports import TransportUnavailable, load_transport

log = logging.getLogger("robobus.epuck")


@runtime_checkable
class AsciiLink(Protocol):
    """A link that speaks asercom's ASCII mode (the serial link, transport/serial.py)."""

    async def ascii(self, line: bytes, timeout_s: float = 1.0, motion: bool = False) -> str: ...

class EpuckRobot:
    """One robot's device on the bus, wired to its link."""

    def __init__(self, node: Node, cfg: EpuckWifiRobot | EpuckSerialRobot, settings: EpuckSettings,
                 pool: ThreadPoolExecutor, stop_pass: StopPass) -> None:
        self.cfg = cfg
        self.stop_pass = stop_pass
        self.settings = settings
        self.dev = node.device(cfg.id)
        self.node = node
        self.pool = pool
        self.controller = EpuckController()
        self.want_image = settings.epuck_stream_image
        self.want_sensors = settings.epuck_stream_sensors
        self._snapshot_holds = 0
        self._apply_stream()
        # The kit's link supervisor drives the health (docs/kit.md "Health"); the links report to it and set
        # its budget from what the robot was asked to send (transport/liveness.py).
        self.sup = self.dev.supervise_link(link_policy(settings.epuck_stale_timeout_s, settings.epuck_reconnect_min_s,
                                                       settings.epuck_reconnect_max_s, settings.epuck_probe_period_s))
        self.sup.device_state("streaming")
        self.link: RobotLink[Any] = self._make_link()
        self._flashing = False
        self.firmware_state = ""  # what a failed update left on the robot, until a flash succeeds
        self.sensors_gate = RateGate.for_jitter(settings.epuck_sensors_hz)
        self.image_gate = RateGate.for_jitter(settings.epuck_image_fps)
        self.unwrap_l, self.unwrap_r = StepUnwrapper(), StepUnwrapper()
        self.sensors_seq = 0
        self.sensors_published = 0
        self._pending_sensors: tuple[bytes, float, int] | None = None
        self._sensors_timer: asyncio.TimerHandle | None = None
        self.image_seq = 0
        self.images_published = 0
        self.frames_dropped = 0
        self._frame: tuple[ImagePacket, float, int] | None = None  # newest frame not yet encoded
        self._encoding = False
        self._image_timer: asyncio.TimerHandle | None = None
        self._snapshot_waiters: list[asyncio.Future[tuple[ImagePacket, float, int]]] = []
        self._motion_timer: asyncio.TimerHandle | None = None
        self._motion_deadline: float | None = None
        self._was_connected = False
        self._was_streaming = False
        self._stats_prev: tuple[float, int, int, int, int, int] | None = None
        self._bind()

    def _make_link(self) -> RobotLink[Any]:
        """The robot's link: the transport its `transport` names (`epuck-gateway.wifi`, `.serial`), loaded by name
        (shared/transports.py); the factory gets the service's settings and the hooks: the robot's settings, the
        controller, the callbacks and the supervisor."""
        try:
            factory = load_transport(SERVICE, self.cfg.transport)
        except TransportUnavailable as exc:
            raise ServiceUnavailable(f"robot {self.cfg.id}: {exc}") from None
        return cast(RobotLink[Any], factory(self.settings, LinkHooks(
            self.cfg, self.controller, self._on_packets, self._on_link_state, self._on_framing_error, self.sup)))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.dev.set_health(details=self._details())
        self.link.start()

    async def close(self) -> None:
        self._cancel_motion_timer()
        for t in (self._sensors_timer, self._image_timer):
            if t is not None:
                t.cancel()
        was_connected = self.link.connected
        await self.link.close()
        self.sup.stop("shutdown" + ("; the robot was sent a stop command" if was_connected else ""))

    async def pause_link(self, why: str) -> None:
        """Firmware update: stop the robot and leave its link, so nothing polls or judges a halted MCU."""
        self._cancel_motion_timer()
        await self.link.close()
        self._was_connected = self._was_streaming = False
        self.sup.recovering(why)  # `recovering` until the link is up again after the update
        self.publish_link_stats()

    async def resume_link(self) -> None:
        old = self.link
        self.link = self._make_link()
        self.link.stats = old.stats  # counters run on across the update
        self.link.owed_stop = old.owed_stop  # a bus stop decided meanwhile: the new link's first command
        self.link.start()

    async def stats_loop(self) -> None:
        while True:
            with self.node.session.batch():  # one socket write for both (see _publish_image)
                self.dev.set_health(details=self._details())  # published only when a counter changed
                self.publish_link_stats()
            await asyncio.sleep(1.0)

    # -- link callbacks (on the loop) --------------------------------------------------------------
    def _on_link_state(self, connected: bool, state: str, message: str) -> None:
        """The supervisor's state changed (it has set the health already): the service's fail-safe."""
        if state == "streaming":
            self._was_streaming = True
        elif state in ("silent", "lost", "unreachable", "connecting"):
            self._lost_robot(message)
        if connected != self._was_connected:
            self._was_connected = connected
            self.unwrap_l.reset()  # a new link: the robot may have restarted its counters
            self.unwrap_r.reset()
            self.publish_link_stats()

    def _lost_robot(self, message: str) -> None:
        """The robot stopped talking or the link went: fail safe, drop stale data, tell the operator once."""
        self._cancel_motion_timer()
        if self.controller.left or self.controller.right:
            self.controller.set_speed(0, 0)  # never resume motion by itself when the robot talks again
            self.link.request_write(urgent=True)
        self._pending_sensors = None  # data from a dead link must not be published later
        if self._frame is not None:
            self._frame = None
            self.frames_dropped += 1
        for fut in self._snapshot_waiters:
            if not fut.done():
                fut.set_exception(CommandError(ErrorCode.UNAVAILABLE, f"robot link lost: {message}"))
        self._snapshot_waiters.clear()
        if self._was_streaming:
            self.dev.emit(FAULT, EpuckFault(kind="link_lost", message=message, ts=time.time()))
        self._was_streaming = False

    def _details(self) -> dict[str, Any]:
        s = self.link.stats
        out: dict[str, Any] = {"transport": self.cfg.transport, "address": self.cfg.address,
                               "reconnects": s.reconnects, "framing_errors": s.framing_errors}
        since = getattr(self.link, "resync_since", None)  # serial: no poll until the robot answers a resync
        if since is not None:
            out["resync"] = {"since_s": round(time.monotonic() - since, 1),
                             "unanswered": getattr(self.link, "resync_unanswered", 0),
                             "message": "resynchronising the serial line: no poll until the robot answers"}
        if self.firmware_state:
            out["firmware"] = self.firmware_state
        return out

    def _on_framing_error(self, err: FramingError) -> None:
        self.node.count_decode_error(f"{self.cfg.id}: {err.describe()}")
        self.dev.emit(FAULT, EpuckFault(kind="framing_error", ts=time.time(), message=f"{err.describe()}; link reset"))

    def _on_packets(self, packets: list[Packet], ts: float) -> None:
        # Only the newest sensors packet and the newest image of a read matter: older ones are stale.
        sensors: SensorsPacket | None = None
        image: ImagePacket | None = None
        for p in packets:
            if isinstance(p, SensorsPacket):
                sensors = p
                self.sensors_seq += 1
            elif isinstance(p, ImagePacket):
                if image is not None:
                    self.frames_dropped += 1
                image = p
                self.image_seq += 1
        if sensors is not None:
            self._offer_sensors(sensors.data, ts, self.sensors_seq)
        if image is not None:
            self._offer_image(image, ts, self.image_seq)

    # -- sensors -----------------------------------------------------------------------------------
    def _offer_sensors(self, data: bytes, ts: float, seq: int) -> None:
        loop = asyncio.get_running_loop()
        if self.sensors_gate.try_pass(loop.time()):
            self._pending_sensors = None
            self._publish_sensors(data, ts, seq)
            return
        self._pending_sensors = (data, ts, seq)
        if self._sensors_timer is None:
            self._sensors_timer = loop.call_later(self.sensors_gate.wait_s(loop.time()), self._flush_sensors)

    def _flush_sensors(self) -> None:
        self._sensors_timer = None
        pending, self._pending_sensors = self._pending_sensors, None
        if pending is not None:
            self._offer_sensors(*pending)

    def _publish_sensors(self, data: bytes, ts: float, seq: int) -> None:
        try:
            state = EpuckSensors.model_validate(sensors_fields_of(data, ts, seq, self.unwrap_l, self.unwrap_r))
            with self.node.session.batch():  # written by this thread at once (see _publish_image)
                self.dev.publish(SENSORS, state)
            self.sensors_published += 1
        except ProtocolError as exc:  # cannot happen with a 104-byte payload; counted all the same
            self.node.count_decode_error(f"{self.cfg.id}: {exc}")

    # -- images ------------------------------------------------------------------------------------
    def _offer_image(self, data: ImagePacket, ts: float, seq: int) -> None:
        for fut in self._snapshot_waiters:
            if not fut.done():
                fut.set_result((data, ts, seq))
        self._snapshot_waiters.clear()
        if not self.want_image:
            return  # a frame fetched for a snapshot only
        if self._frame is not None:
            self.frames_dropped += 1  # superseded before it was encoded
        self._frame = (data, ts, seq)
        self._pump_images()

    def _pump_images(self) -> None:
        if self._encoding or self._frame is None:
            return
        loop = asyncio.get_running_loop()
        if not self.image_gate.try_pass(loop.time()):
            if self._image_timer is None:
                self._image_timer = loop.call_later(self.image_gate.wait_s(loop.time()), self._image_due)
            return
        frame, self._frame = self._frame, None
        img, ts, seq = frame
        quality = self.settings.epuck_jpeg_quality
        if self.settings.epuck_encode_workers == 0:
            # On the loop: a 160x120 JPEG takes ~0.2 ms, less than the two thread hand-offs (submit, then
            # the result back to the loop) it would cost on the pool, 200 times a second for 20 robots.
            try:
                jpeg = to_jpeg(img.data, quality, img.width, img.height)
            except Exception:
                log.exception("JPEG encoding failed", extra={"robot": self.cfg.id})
            else:
                self._publish_image(jpeg, ts, seq, img.width, img.height)
            return
        self._encoding = True
        fut = loop.run_in_executor(self.pool, to_jpeg, img.data, quality, img.width, img.height)
        fut.add_done_callback(lambda f: self._encoded(f, ts, seq, img.width, img.height))

    def _image_due(self) -> None:
        self._image_timer = None
        self._pump_images()

    def _encoded(self, fut: asyncio.Future[bytes], ts: float, seq: int, width: int, height: int) -> None:
        self._encoding = False
        try:
            jpeg = fut.result()
        except Exception:
            log.exception("JPEG encoding failed", extra={"robot": self.cfg.id})
        else:
            self._publish_image(jpeg, ts, seq, width, height)
        self._pump_images()

    def _publish_image(self, jpeg: bytes, ts: float, seq: int, width: int, height: int) -> None:
        # The loop writes its publishes to the broker's socket itself (the kit's batch): queued for paho's network
        # thread, each one woke that thread (a socket write, then the GIL handed over and back), a third of the
        # CPU of a sensors message.
        with self.node.session.batch():
            self.dev.publish(IMAGE, jpeg)
            self.dev.publish(IMAGE_INFO, EpuckImageInfo(seq=seq, ts=ts, width=width, height=height,
                                                        bytes=len(jpeg), quality=self.settings.epuck_jpeg_quality))
        self.images_published += 1

    # -- link stats ----------------------------------------------------------------------------------
    def publish_link_stats(self) -> None:
        s = self.link.stats
        now = time.monotonic()
        cur = (now, s.packets, s.images, s.sensors, s.empty, s.bytes)
        prev = self._stats_prev or cur
        self._stats_prev = cur
        dt = (now - prev[0]) or 1.0

        def rate(i: int) -> float:
            return round((cur[i] - prev[i]) / dt, 2)

        self.dev.publish(LINK, EpuckLinkStats(
            connected=self.link.connected, transport=self.cfg.transport, address=self.cfg.address,
            packets_per_s=rate(1),
            images_per_s=rate(2), sensors_per_s=rate(3), empty_per_s=rate(4), bytes_per_s=rate(5),
            framing_errors=s.framing_errors, reconnects=s.reconnects, images_received=self.image_seq,
            reply_timeouts=s.reply_timeouts, garbage_bytes=s.garbage_bytes,
            images_published=self.images_published, frames_dropped=self.frames_dropped,
            sensors_received=self.sensors_seq, sensors_published=self.sensors_published,
            commands_sent=s.commands_sent, commands_requested=s.commands_requested, silences=s.silences,
            image_stream=self.want_image, sensors_stream=self.want_sensors,
            ts=time.time()))

    # -- commands (coroutines: they run on the loop, next to the link) ------------------------------
    def _bind(self) -> None:
        """Every command and the job, each marked on its handler below (`@handles`, `@runs`); the kit refuses to
        start a node whose robot leaves one unbound."""
        self.dev.bind_all(self)
        self.dev.on_stop(self.stop_pass.action(self.cfg.id), inline=True)  # one pass for every robot (stop_pass.py)

    # -- the bus stop (docs/kit.md "Stopping everything") ---------------------------------------------
    def stop_now(self) -> float | None:
        """The robot's part of the gateway's stop pass (EpuckGateway.stop_pass, on the loop beside its link):
        speeds 0, the on-board obstacle avoidance off (it drives the wheels itself), pending one-shots dropped,
        the deadman disarmed (nothing left to stop), and the whole state written at once, past the image and the
        queue limits (transport/wifi.py and transport/serial.py `write_stop`). Returns the time the stop left, or None
        when the link is down: then the next connection's first command (speeds 0 always) is the stop,
        reported when it leaves (`_stop_reached`)."""
        self._cancel_motion_timer()
        c = self.controller
        c.set_speed(0, 0)
        c.obstacle_avoidance = False
        c.drop_oneshots()
        return self.link.write_stop(self._stop_reached)

    def _stop_reached(self, at: float) -> None:
        self.dev.stop_written(at=at)

    def _motion_admitted(self) -> int:
        """On the loop, as a motion change is about to be made: the kit's gate again (it raises `stopped` while
        the bus stop is active). Kept against a race: a request that reaches the loop straight from the network
        thread has passed the kit's gate in this very loop step, but one that went through the command pool passed
        it on a pool thread, and its coroutine starts on the loop later; a stop that came between them has had its
        action (the stop pass) run on the loop already, and the change must not undo it."""
        return self.node.stop_latch.admit()

    @staticmethod
    def _ascii_command(line: str) -> str:
        """What the firmware will make of the line's letter (docs/reference/epuck2.md §6, Asercom2.c's ASCII mode):
        it upper-cases every letter but `b` and `g`."""
        letter = line.split(",", 1)[0]
        return letter if letter in ("b", "g") else letter.upper()

    @moves_when(ASCII)
    def ascii_moves(self, req: EpuckAsciiRequest) -> bool:
        """A `D` line to a robot on a serial port moves it (api.py ASCII: motion=BY_REQUEST; the kit's bus stop
        gate, and the stop action again after one that ran across the stop). `P` is refused, `S` stops it; a
        robot on WiFi takes no ASCII line at all (the handler refuses it)."""
        return isinstance(self.link, AsciiLink) and self._ascii_command(req.line) == "D"

    @handles(ASCII)
    async def cmd_ascii(self, req: EpuckAsciiRequest) -> EpuckAsciiReply:
        link = self.link
        if not isinstance(link, AsciiLink):
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               f"robot {self.cfg.id} is on WiFi: the ASCII mode is asercom's, over a serial port")
        self._require_link()
        letter, *fields = req.line.split(",")
        args = [int(a) for a in fields]
        # A line that moves the robot goes through the gateway's own state, so the deadman covers it and the
        # actuator state says what the robot does.
        cmd = self._ascii_command(req.line)
        motion = cmd == "D"  # the one line that moves the robot (`ascii_moves`: the kit's gate ran before this)
        if motion:
            if len(args) != 2 or any(not -SPEED_LIMIT <= a <= SPEED_LIMIT for a in args):
                # the firmware's sscanf leaves a missing speed at the value of an earlier ASCII `D`
                raise CommandError(ErrorCode.INVALID_REQUEST, f"`D` takes two speeds, D,left,right, each within "
                                                              f"+-{SPEED_LIMIT} steps/s")
            self._motion_admitted()  # the second gate, on the loop (see there)
            # before the line goes: the deadman covers the robot even if its answer never comes
            self.controller.set_speed(args[0], args[1])
            self._arm_motion(args[0], args[1])
        elif cmd == "P":
            raise CommandError(ErrorCode.INVALID_REQUEST, "`P` sets the motor step counters behind the gateway's "
                                                          "back: use the `set_steps` command")
        try:
            reply = await link.ascii(ascii_command(letter, *args), req.timeout_s, motion=motion)
        except LineDropped:
            self._motion_admitted()  # the stop that dropped it: `stopped`, as for a line that came after it
            raise CommandError(ErrorCode.UNAVAILABLE, "the bus stop came and went before the line was written: "
                                                      "not sent") from None
        except (TimeoutError, ConnectionError) as exc:
            raise CommandError(ErrorCode.TIMEOUT if isinstance(exc, TimeoutError) else ErrorCode.UNAVAILABLE,
                               str(exc) or f"no ASCII reply from {self.cfg.id}") from None
        if cmd == "S":  # the firmware's stop: speeds 0 and the body LED off
            self.controller.set_speed(0, 0)
            self.controller.leds &= ~LED_BODY
            self._arm_motion(0, 0)
        return EpuckAsciiReply(reply=reply)

    # -- firmware update (a job: its own thread) ----------------------------------------------------
    def _admit_flash(self, req: EpuckFlashRequest) -> None:
        if self._flashing:
            raise CommandError(ErrorCode.BUSY, f"a firmware update of {self.cfg.id} is already running")
        if not (req.programmer or self.cfg.programmer):
            # a state of the installation, not of the request: nothing on this host can flash the robot
            raise CommandError(ErrorCode.UNAVAILABLE, f"robot {self.cfg.id} has no programmer port configured "
                                                      "(its `programmer` setting) and the request names none")
        try:
            parse_elf(base64.b64decode(req.elf_base64, validate=True), Path("the ELF"), req.force)
        except (ValueError, BadFirmware) as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    @runs(FLASH, admit="_admit_flash")
    def _flash_job(self, req: EpuckFlashRequest, job: JobContext) -> EpuckFlashResult:
        programmer = req.programmer or self.cfg.programmer
        assert programmer is not None and self.node.loop is not None
        loop = self.node.loop
        self._flashing = True
        try:
            with tempfile.TemporaryDirectory(prefix="epuck-flash-") as tmp:
                elf = Path(tmp) / "firmware.elf"
                elf.write_bytes(base64.b64decode(req.elf_base64))
                job.progress("pause", force=True)
                asyncio.run_coroutine_threadsafe(
                    self.pause_link(f"firmware update through {programmer}"), loop).result(15)
                bar = OneBar(req.verify)

                def progress(phase: str, done: int, total: int) -> None:
                    # one bar: its total covers load and verify; the end of each is always sent (rate cap)
                    done_all, total_all = bar.update(phase, done, total)
                    job.progress(phase, done_all, total_all, force=OneBar.final(phase, done, total))

                try:
                    res = flash_firmware(programmer, elf, progress, verify=req.verify, cancelled=lambda: job.cancelled,
                                         force=req.force, stall_s=self.settings.epuck_flash_stall_s)
                except FirmwareError as exc:
                    self._firmware_failed(exc)
                    raise _flash_error(exc) from None
                finally:
                    job.progress("resume", force=True)
                    asyncio.run_coroutine_threadsafe(self.resume_link(), loop).result(15)
        finally:
            self._flashing = False
        self._firmware_ok()
        log.info("firmware updated", extra={"robot": self.cfg.id, "bytes": res.bytes_loaded, "s": res.duration_s})
        return EpuckFlashResult(programmer=programmer, bytes_loaded=res.bytes_loaded, sections=res.sections,
                                verified=res.verified, duration_s=res.duration_s)

    def _firmware_failed(self, exc: FirmwareError) -> None:
        """A failed update that touched the robot's flash: its health says what it left until a flash succeeds
        (`details.firmware`; a robot left without a valid firmware is an `error` saying so)."""
        if not exc.robot_state:
            return  # nothing was written: the robot runs what it ran
        self.firmware_state = f"the last firmware update failed: {exc.robot_state}"
        if exc.no_valid_firmware:
            self.sup.fault(self.firmware_state)
        else:
            self.sup.clear_fault()
        self.dev.set_health(details=self._details())

    def _firmware_ok(self) -> None:
        self.firmware_state = ""
        self.sup.clear_fault()
        self.dev.set_health(details=self._details())

    def _require_link(self) -> None:
        if not self.link.connected:
            h = self.dev.health
            raise CommandError(ErrorCode.UNAVAILABLE,
                               f"robot {self.cfg.id} ({self.cfg.address}) is not connected"
                               + (f": {h['error_message']}" if h.get("error_message") else ""))

    def _send(self) -> EpuckActuators:
        self.link.request_write()
        return self.actuators()

    def actuators(self) -> EpuckActuators:
        c = self.controller
        left = self._motion_deadline
        expires = None if left is None else max(0, int((left - asyncio.get_running_loop().time()) * 1000))
        return EpuckActuators(
            connected=self.link.connected, left_speed=c.left, right_speed=c.right, motion_expires_in_ms=expires,
            leds={name: bool(c.leds & bit) for name, bit in LED_BITS.items()},
            rgb={name: EpuckColor(red=v[0], green=v[1], blue=v[2]) for name, v in zip(RGB_LEDS, c.rgb, strict=True)},
            obstacle_avoidance=c.obstacle_avoidance, image_stream=self.want_image, sensors_stream=self.want_sensors)

    @handles(SET_SPEED)
    async def cmd_set_speed(self, req: EpuckSetSpeed) -> EpuckActuators:
        self._require_link()
        self._motion_admitted()
        self.controller.set_speed(req.left, req.right)
        self._arm_motion(req.left, req.right)
        return self._send()

    def _arm_motion(self, left: int, right: int) -> None:
        """(Re)start the deadman for the speeds just set; speeds 0 need none."""
        self._cancel_motion_timer()
        if left or right:
            loop = asyncio.get_running_loop()
            timeout = self.settings.epuck_motion_timeout_ms / 1000.0
            self._motion_deadline = loop.time() + timeout
            self._motion_timer = loop.call_later(timeout, self._motion_expired)
            # the serial link starts no camera image that would still be on the line at the deadline
            self.link.motion_deadline = time.monotonic() + timeout

    def _cancel_motion_timer(self) -> None:
        if self._motion_timer is not None:
            self._motion_timer.cancel()
        self._motion_timer = None
        self._motion_deadline = None
        self.link.motion_deadline = None

    def _motion_expired(self) -> None:
        """Fail safe: a commanding client that went quiet must not leave the robot driving. The fault is
        published once the stop has been written to the robot, with that time (not when it was decided)."""
        self._motion_timer = None
        self._motion_deadline = None
        self.link.motion_deadline = None
        if self.controller.left or self.controller.right:
            self.controller.set_speed(0, 0)
            decided = time.time()
            # urgent: past the link's limit of untaken commands, and taken before them (transport/wifi.py)
            if not self.link.request_write(lambda ts: self._motion_stop_written(decided, ts), urgent=True):
                self._motion_stop_written(decided, None)

    def _motion_stop_written(self, decided: float, ts: float | None) -> None:
        timeout = self.settings.epuck_motion_timeout_ms
        if ts is None:
            msg = f"no set_speed for {timeout} ms; the stop could not be written: the robot's link is down"
        else:
            msg = (f"no set_speed for {timeout} ms: stop written to the robot "
                   f"{max(0.0, (ts - decided) * 1000):.0f} ms after the deadline")
        log.warning(msg, extra={"robot": self.cfg.id})
        self.dev.emit(FAULT, EpuckFault(kind="motion_timeout", message=msg, ts=ts if ts is not None else time.time()))

    @handles(SET_STEPS)
    async def cmd_set_steps(self, req: EpuckSetSteps) -> EpuckActuators:
        self._require_link()
        self.controller.set_steps(req.left, req.right)
        return self._send()

    @handles(LEDS)
    async def cmd_leds(self, req: EpuckLeds) -> EpuckActuators:
        self._require_link()
        self.controller.set_leds(**req.model_dump())
        return self._send()

    @handles(RGB_CMD)
    async def cmd_rgb(self, req: EpuckRgb) -> EpuckActuators:
        self._require_link()
        colors = [None if c is None else (c.red, c.green, c.blue) for c in (req.led2, req.led4, req.led6, req.led8)]
        self.controller.set_rgb(colors)
        return self._send()

    @handles(SOUND)
    async def cmd_sound(self, req: EpuckSound) -> EpuckActuators:
        self._require_link()
        self.controller.play(SOUNDS[req.sound])
        return self._send()

    @handles(CALIBRATE_IR)
    async def cmd_calibrate_ir(self, req: EpuckEmpty) -> EpuckActuators:
        self._require_link()
        self.controller.calibrate_ir()
        return self._send()

    @handles(OBSTACLE)
    async def cmd_obstacle(self, req: EpuckObstacleAvoidance) -> EpuckActuators:
        self._require_link()
        self._motion_admitted()
        self.controller.obstacle_avoidance = req.enabled
        return self._send()

    @handles(STREAM)
    async def cmd_stream(self, req: EpuckStream) -> EpuckActuators:
        self._require_link()
        if req.image is not None:
            self.want_image = req.image
        if req.sensors is not None:
            self.want_sensors = req.sensors
        self._apply_stream()
        reply = self._send()
        self.publish_link_stats()
        return reply

    def _apply_stream(self) -> None:
        self.controller.set_stream(image=self.want_image or self._snapshot_holds > 0, sensors=self.want_sensors)

    @handles(SNAPSHOT)
    async def cmd_snapshot(self, req: EpuckSnapshotRequest) -> EpuckSnapshot:
        self._require_link()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[ImagePacket, float, int]] = loop.create_future()
        self._snapshot_waiters.append(fut)
        hold = not (self.controller.request & REQ_IMAGE)
        if hold:  # image stream off: turn it on for one frame
            self._snapshot_holds += 1
            self._apply_stream()
            self.link.request_write()
        try:
            img, ts, seq = await asyncio.wait_for(fut, req.timeout_s)
        except TimeoutError:
            raise CommandError(ErrorCode.TIMEOUT, f"no image from {self.cfg.id} within {req.timeout_s} s") from None
        finally:
            if fut in self._snapshot_waiters:
                self._snapshot_waiters.remove(fut)
            if hold:
                self._snapshot_holds -= 1
                self._apply_stream()
                if self.link.connected:
                    self.link.request_write()
        png = await loop.run_in_executor(self.pool, to_png, img.data, img.width, img.height)
        return EpuckSnapshot(png_base64=base64.b64encode(png).decode(), width=img.width, height=img.height,
                             seq=seq, ts=ts)


def _flash_error(exc: FirmwareError) -> CommandError:
    """A failed update as the job's error (the message says the robot's state when its flash was touched)."""
    if isinstance(exc, ProgrammerNotFound):
        return CommandError(ErrorCode.UNAVAILABLE, str(exc))
    if isinstance(exc, ProgrammerBusy):
        return CommandError(ErrorCode.BUSY, str(exc))
    if isinstance(exc, FlashTimeout):
        return CommandError(ErrorCode.TIMEOUT, str(exc))
    if isinstance(exc, BadFirmware):
        return CommandError(ErrorCode.INVALID_REQUEST, str(exc))
    return CommandError(ErrorCode.DEVICE_ERROR, str(exc))


def sensors_fields(s: EpuckRawSensors, ts: float, seq: int, unwrap_l: StepUnwrapper,
                   unwrap_r: StepUnwrapper) -> dict[str, Any]:
    """`EpuckSensors` as plain data, for one validation pass in pydantic-core (`sensors_model`)."""
    ax, ay, az = s.acc
    gx, gy, gz = s.gyro
    mx, my, mz = s.mag
    acc = finite(s.acceleration)
    return {
        "seq": seq, "ts": ts,
        "acc_raw": {"x": ax, "y": ay, "z": az}, "acc_g": {"x": acc_to_g(ax), "y": acc_to_g(ay), "z": acc_to_g(az)},
        "acceleration_raw": acc, "acceleration_g": None if acc is None else acc_to_g(acc),
        "orientation_deg": finite(s.orientation), "inclination_deg": finite(s.inclination),
        "gyro_raw": {"x": gx, "y": gy, "z": gz},
        "gyro_dps": {"x": gyro_to_dps(gx), "y": gyro_to_dps(gy), "z": gyro_to_dps(gz)},
        "magnetometer_ut": {"x": finite(mx), "y": finite(my), "z": finite(mz)},
        "temperature_c": s.temperature, "proximity": s.proximity, "ambient": s.ambient, "tof_mm": s.tof,
        "microphones": dict(zip(MIC_NAMES, s.mic, strict=True)),
        "steps": {"left": s.steps[0], "right": s.steps[1], "left_total": unwrap_l.update(s.steps[0]),
                  "right_total": unwrap_r.update(s.steps[1])},
        "battery_raw": s.battery, "battery_v": round(battery_volts(s.battery), 4), "sd_card": s.sd_state == 1,
        "tv_remote": {"toggle": s.tv_toggle, "address": s.tv_address, "data": s.tv_data}, "selector": s.selector,
        "ground_proximity": s.ground_proximity, "ground_ambient": s.ground_ambient, "button": s.button == 1,
    }


def sensors_fields_of(data: bytes, ts: float, seq: int, unwrap_l: StepUnwrapper,
                      unwrap_r: StepUnwrapper) -> dict[str, Any]:
    """`sensors_fields(EpuckRawSensors.decode(data), ...)` from the wire values at once: the packet's frozen
    dataclass in between was ~40 % of the decoding (21 -> 13 us a packet); equal for every packet
    (test_sensors_state.py)."""
    v = unpack_sensors(data)
    ax, ay, az, acc, orientation, inclination, gx, gy, gz, mx, my, mz, temperature = v[:13]
    acc = finite(acc)
    return {
        "seq": seq, "ts": ts,
        "acc_raw": {"x": ax, "y": ay, "z": az}, "acc_g": {"x": acc_to_g(ax), "y": acc_to_g(ay), "z": acc_to_g(az)},
        "acceleration_raw": acc, "acceleration_g": None if acc is None else acc_to_g(acc),
        "orientation_deg": finite(orientation), "inclination_deg": finite(inclination),
        "gyro_raw": {"x": gx, "y": gy, "z": gz},
        "gyro_dps": {"x": gyro_to_dps(gx), "y": gyro_to_dps(gy), "z": gyro_to_dps(gz)},
        "magnetometer_ut": {"x": finite(mx), "y": finite(my), "z": finite(mz)},
        "temperature_c": temperature, "proximity": v[13:21], "ambient": v[21:29], "tof_mm": v[29],
        "microphones": dict(zip(MIC_NAMES, v[30:34], strict=True)),
        "steps": {"left": v[34], "right": v[35], "left_total": unwrap_l.update(v[34]),
                  "right_total": unwrap_r.update(v[35])},
        "battery_raw": v[36], "battery_v": round(battery_volts(v[36]), 4), "sd_card": v[37] == 1,
        "tv_remote": {"toggle": v[38], "address": v[39], "data": v[40]}, "selector": v[41],
        "ground_proximity": v[42:45], "ground_ambient": v[45:48], "button": v[48] == 1,
    }


def sensors_model(s: EpuckRawSensors, ts: float, seq: int, unwrap_l: StepUnwrapper,
                  unwrap_r: StepUnwrapper) -> EpuckSensors:
    """The state of one decoded packet, validated in one pydantic-core call from plain data: cheaper than
    building the nine nested models one by one (each its own validation call), and cheaper than
    `model_construct`, which runs in Python (measured with serialisation: 14 vs 17 vs 24 us a packet)."""
    return EpuckSensors.model_validate(sensors_fields(s, ts, seq, unwrap_l, unwrap_r))


__all__ = ["AsciiLink", "EpuckRobot", "sensors_fields", "sensors_fields_of", "sensors_model"]
