"""dexter-gateway's device: one `DexterArm` per arm, the wiring of its jobs.

One process, one `DexterArm` (device) per configured arm, each with its own link (made by the transport's factory,
transport.py's `tcp_link` by default). The arm holds its jobs, each in a module of its own:

- its requests and replies (exchange.py `ArmExchange`: `send`, and `command`, the inline path);
- its status and health (status.py `ArmStatus`: the newest status any reply brought, DexRun's error flags as the
  fault, `state/status` at its rate with a `g` poll when nothing else brought one, the link's counters in health);
- the file channel (files.py `FileJobs`: what the `read_file` / `write_file` jobs do, one at a time per arm);
- what each command sends and the guards a request passes first (arguments.py, pure);
- the replies as published (replies.py, pure);

and keeps here the command and job handlers (the kit binds them here: `bind_all`) and the bus stop's gate. Command
handlers run on the kit's command pool (the short ones start on paho's thread and send there when the link is
idle, waiting a bounded time), jobs on their own threads (file transfers handed to one long-lived transfer thread
per arm), the status poller on one thread per arm; each does its own exchange with the robot when its turn in the
arm's FIFO comes (strict stop-and-wait), with no hand-off to another thread on the way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from services.dexter_gateway import protocol as p
from services.dexter_gateway.api import (
    HEARTBEAT,
    MOVE_ALL,
    MOVE_REL,
    MOVE_STRAIGHT,
    MOVE_TO,
    PID_MOVE,
    RAW,
    READ_FILE,
    RUN_FILE,
    SET_BOUNDS,
    SET_PARAM,
    SLEEP,
    STATUS_MODE,
    WAIT_MOTION,
    WRITE_FILE,
    WRITE_FPGA,
)
from services.dexter_gateway.arguments import (
    RAW_MOTION_OPLETS,
    cartesian,
    check_raw_motion,
    parse_raw,
    servo_units,
    set_parameter_args,
)
from services.dexter_gateway.exchange import ArmExchange
from services.dexter_gateway.files import FileJobs
from services.dexter_gateway.link import ArmLink, DexterLinkConfig, LinkFactory, LinkHooks
from services.dexter_gateway.models import (
    DexterArmConfig,
    DexterCommandReply,
    DexterEmpty,
    DexterFileContent,
    DexterFileWritten,
    DexterMotionDone,
    DexterMoveAllJoints,
    DexterMoveRelative,
    DexterMoveTo,
    DexterMoveToStraight,
    DexterPidMove,
    DexterRawCommand,
    DexterReadFile,
    DexterRunFile,
    DexterRunFileResult,
    DexterSetBoundaries,
    DexterSetParameter,
    DexterSleep,
    DexterStatusModeRequest,
    DexterWaitMotionDone,
    DexterWriteFile,
    DexterWriteFpga,
)
from services.dexter_gateway.protocol import Firmware
from services.dexter_gateway.replies import (
    errno_error,
    error_info,
    read_block_dict,
    reply_dict,
    status_dict,
    status_model,
)
from services.dexter_gateway.settings import DexterSettings
from services.dexter_gateway.status import ArmStatus
from shared import CommandError, ErrorCode, JobContext, Node
from shared.device import handles, moves_when, runs
from shared.messages import StopState
from shared.payloads import Serialized
from shared.stop import describe

log = logging.getLogger("robobus.dexter")

# What the bus stop cannot do on a Dexter, said in its health while the stop is active (reference dexter.md §4:
# no oplet, parameter or register halts a move in progress; `w` drains the FIFO before it writes)
STOP_NOTE = ("DexRun cannot halt a move in progress: the moves it already has (up to 16 queued in its FIFO, and one "
             "waiting for a slot) run to their end; the gateway sends it no motion oplet until the release and a "
             "new command")


class DexterArm:
    """One arm: its device, its link, and the wiring of its jobs (status and health, file jobs, commands)."""

    def __init__(self, node: Node, cfg: DexterArmConfig, settings: DexterSettings, link_factory: LinkFactory) -> None:
        """`link_factory`: the transport ROBOBUS_DEXTER_TRANSPORT names, loaded by the service (`tcp`: transport.py's
        `tcp_link`), called with the kit's one signature: the settings and this arm's `LinkHooks`."""
        self.node = node
        self.cfg = cfg
        self.settings = settings
        self.firmware = Firmware(cfg.firmware)
        self.dev = node.device(cfg.id)
        link_cfg = DexterLinkConfig(
            host=cfg.host, port=cfg.port, firmware=self.firmware, connect_timeout_s=cfg.connect_timeout_s,
            reply_timeout_s=cfg.reply_timeout_s, motion_timeout_s=cfg.motion_timeout_s,
            fifo_timeout_s=cfg.fifo_timeout_s, keepalive_s=cfg.keepalive_s, reconnect_min_s=cfg.reconnect_min_s,
            reconnect_max_s=cfg.reconnect_max_s, liveness_s=cfg.liveness_s, probe_period_s=cfg.probe_period_s,
            queue_limit=cfg.queue_limit)
        # health is the kit's link supervisor's (docs/kit.md): the link reports to it, the arm adds its faults
        self.sup = self.dev.supervise_link(link_cfg.policy())
        self.status = ArmStatus(cfg, settings, self.firmware, self.dev, self.sup)
        self.dev.set_health(details=self.status.static_details())
        self.link: ArmLink = link_factory(settings, LinkHooks(
            cfg.id, link_cfg, supervisor=self.sup, on_change=self.status.apply_fault, on_reply=self.status.on_reply,
            on_decode_error=self._on_decode_error, keepalive_args=self.status.book.g_args,
            motion_stopped=self._motion_stopped))
        self.exchange = ArmExchange(cfg.id, self.link, settings, self.status.book, self._on_decode_error)
        self.files = FileJobs(cfg.id, self.link, self.firmware, settings, self._on_decode_error)
        self.status.attach(self.link, lambda: self.files.busy)
        self.dev.on_stop(self._stop_now, note=STOP_NOTE)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.dev.bind_all(self)  # the handlers marked below (@handles, @runs, @moves_when)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start()
        self._threads = [
            threading.Thread(target=self.status.status_loop, args=(self._stop,), name=f"dexter-status-{self.cfg.id}",
                             daemon=True),
            threading.Thread(target=self.status.health_loop, args=(self._stop,), name=f"dexter-health-{self.cfg.id}",
                             daemon=True)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """The link stops (its supervisor first: the final health is `stopped`, `connection: false`)."""
        self._stop.set()
        self.link.close()
        self.files.close()
        for t in self._threads:
            t.join(2)
        self.status.publish_details()

    # -- the bus stop (README, "Stopping everything") ---------------------------------------------------
    def _motion_stopped(self) -> str:
        """Why no motion oplet may leave now ("" when it may): read from the node's stop latch at each motion
        write, the one copy of the stop's state."""
        s = self.node.stop_latch.state
        return f"the bus stop is active ({describe(s)})" if s is not None and s.active else ""

    def _stop_now(self, stop: StopState) -> float:
        """The arm's stop action: no motion oplet leaves the gateway from the returned time on (a write in
        progress has left; the motion commands waiting for the link are answered `stopped`). DexRun has nothing
        that halts the moves it already has (`STOP_NOTE`), so nothing is written to the arm."""
        at = self.link.stop_motion(f"the bus stop by {describe(stop)}")
        self.status.publish_details()
        return at

    def _on_decode_error(self, what: str) -> None:
        self.node.count_decode_error(f"{self.cfg.id}: {what}")

    def _servo_units(self, j6_deg: float | None, j7_deg: float | None) -> list[Any]:
        return servo_units(j6_deg, j7_deg, self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units)

    # -- commands --------------------------------------------------------------------------------------
    @property
    def inline_commands(self) -> bool:
        """Whether the commands marked `inline="inline_commands"` run on the MQTT network thread: when a reply wait
        is configured (command_handoff_ms > 0), as they are one `command` and nothing after it. Not inline: `z`
        sleeps and `w` drains the motion FIFO by design (they would always wait the bound), status_mode and raw
        change state around their `send`."""
        return self.exchange.inline_wait_s > 0

    @handles(MOVE_ALL, inline="inline_commands")
    def cmd_move_all(self, req: DexterMoveAllJoints) -> Serialized:
        args = [p.arcsec(a) for a in req.joints_deg] + self._servo_units(req.j6_deg, req.j7_deg)
        return self.exchange.command("a", args)

    @handles(MOVE_REL, inline="inline_commands")
    def cmd_move_relative(self, req: DexterMoveRelative) -> Serialized:
        return self.exchange.command("R", [p.arcsec(a) for a in req.joints_deg])

    @handles(PID_MOVE, inline="inline_commands")
    def cmd_pid_move(self, req: DexterPidMove) -> Serialized:
        args = [p.arcsec(a) for a in req.offsets_deg] + self._servo_units(req.j6_deg, req.j7_deg)
        return self.exchange.command("P", args)

    @handles(MOVE_TO, inline="inline_commands")
    def cmd_move_to(self, req: DexterMoveTo) -> Serialized:
        return self.exchange.command("M", cartesian(req))

    @handles(MOVE_STRAIGHT, inline="inline_commands")
    def cmd_move_to_straight(self, req: DexterMoveToStraight) -> Serialized:
        args = cartesian(req)
        extras: list[Any] = [x for x in (req.tool_speed_um_s, req.resolution_um) if x is not None]
        if req.j6_deg is not None:
            extras += self._servo_units(req.j6_deg, req.j7_deg)
        return self.exchange.command("T", args + extras)

    # set_parameter and raw move for some requests only (api.py: motion=BY_REQUEST): the kit's bus stop gate takes
    # the requests these predicates say move (`stopped` while the stop is active, `unavailable` until the node has
    # read it). A race with the stop is caught at the write (`DexterLink`: the check and the write under the lock
    # the stop action takes).
    @moves_when(SET_PARAM)
    def set_parameter_moves(self, req: DexterSetParameter) -> bool:
        """The parameters that move the arm (`protocol.moves`: MOTION_PARAMS); a name that does not resolve does
        not (the handler refuses it)."""
        return p.moves("S", [req.name])

    @moves_when(RAW)
    def raw_moves(self, req: DexterRawCommand) -> bool:
        """An oplet that moves the arm (`protocol.moves` over the parsed line: MOVING_OPLETS, the moving `S`
        parameters). A line that does not parse is the request's error, as in the handler."""
        return p.moves(*parse_raw(req.command))

    @handles(SET_PARAM, inline="inline_commands")
    def cmd_set_parameter(self, req: DexterSetParameter) -> Serialized:
        return self.exchange.command("S", set_parameter_args(req))

    @handles(SET_BOUNDS, inline="inline_commands")
    def cmd_set_boundaries(self, req: DexterSetBoundaries) -> Serialized:
        args: list[int] = []
        for hi, lo in zip(req.high_deg, req.low_deg, strict=True):
            args += [p.arcsec(hi), p.arcsec(lo)]
        return self.exchange.command("B", args)

    @handles(SLEEP)
    def cmd_sleep(self, req: DexterSleep) -> DexterCommandReply:
        return self.exchange.send("z", [round(req.seconds * 1e6)])

    @handles(HEARTBEAT, inline="inline_commands")
    def cmd_heartbeat(self, req: DexterEmpty) -> Serialized:
        return self.exchange.command("h")

    @handles(WRITE_FPGA)
    def cmd_write_fpga(self, req: DexterWriteFpga) -> DexterCommandReply:
        return self.exchange.send("w", [req.address, req.value])

    @handles(STATUS_MODE)
    def cmd_status_mode(self, req: DexterStatusModeRequest) -> DexterCommandReply:
        if self.firmware is Firmware.STABLE:
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               "the stable DexRun has no status modes (`g` ignores its argument)")
        if req.mode in " ,;\x00":
            raise CommandError(ErrorCode.INVALID_REQUEST, f"status mode {req.mode!r} cannot be sent")
        reply = self.exchange.send("g", [req.mode] if req.mode != "0" else [])
        self.status.book.mode = req.mode
        self.status.publish_details()
        return reply

    @handles(RAW)
    def cmd_raw(self, req: DexterRawCommand) -> DexterCommandReply:
        oplet, args = parse_raw(req.command)
        if oplet == "r" and len(args) > 1 and p.target_kind(args[1]) == "shell":
            self.files.check_shell(args[1])
        if oplet in "rW" and self.files.job is not None:
            raise CommandError(ErrorCode.BUSY, f"a {self.files.job} job holds the arm's file channel")
        request = self.exchange.prepare(oplet, args)  # judged before anything changes (the status mode below)
        if oplet in RAW_MOTION_OPLETS:
            check_raw_motion(oplet, request.args, self.settings.dexter_servo_deg_per_unit,
                             self.settings.dexter_j6_zero_units)
        if oplet == "g" and self.firmware is Firmware.NEWEST:
            self.status.book.mode = args[0][0] if args else "0"
            self.status.publish_details()  # details.status_mode, as the status_mode command does
        return self.exchange.send(oplet, args, fail_on_error=False, prepared=request)

    # -- jobs ----------------------------------------------------------------------------------------
    def admit_read(self, req: DexterReadFile) -> None:
        self.files.admit_read(req)

    def admit_write(self, req: DexterWriteFile) -> None:
        self.files.admit_write(req)

    @runs(READ_FILE, admit="admit_read")
    def job_read_file(self, req: DexterReadFile, job: JobContext) -> DexterFileContent:
        return self.files.read(req, job)

    @runs(WRITE_FILE, admit="admit_write")
    def job_write_file(self, req: DexterWriteFile, job: JobContext) -> DexterFileWritten:
        return self.files.write(req, job)

    def admit_run_file(self, req: DexterRunFile) -> None:
        self.exchange.prepare("S", ("RunFile", req.path))

    @runs(WAIT_MOTION)
    def job_wait_motion(self, req: DexterWaitMotionDone, job: JobContext) -> DexterMotionDone:
        """`F` blocks the link until the FIFO drains: it runs on a helper thread so that a cancel ends the
        job at once (the `F` itself completes on the robot; its reply is read and dropped)."""
        t0 = time.monotonic()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["reply"] = self.exchange.send("F", timeout_s=req.timeout_s or self.cfg.motion_timeout_s)
            except Exception as exc:
                out["error"] = exc

        waiter = threading.Thread(target=run, name=f"dexter-F-{self.cfg.id}", daemon=True)
        waiter.start()
        while waiter.is_alive():
            job.progress("waiting", round(time.monotonic() - t0, 1), 0, info="F: until the motion FIFO drains")
            if job.wait(0.1):
                job.check_cancelled()
        if "error" in out:
            raise out["error"]
        rep: DexterCommandReply = out["reply"]
        return DexterMotionDone(waited_s=round(time.monotonic() - t0, 3), status=rep.status)

    @runs(RUN_FILE, admit="admit_run_file")
    def job_run_file(self, req: DexterRunFile, job: JobContext) -> DexterRunFileResult:
        job.progress("running", force=True)
        rep = self.exchange.send("S", ["RunFile", req.path], errno_reply=True, fail_on_error=False, job=job)
        if rep.error.code:
            raise errno_error(f"RunFile {req.path!r}", rep.error.code)
        return DexterRunFileResult(path=req.path, error=rep.error, status=rep.status)


__all__ = ["STOP_NOTE", "DexterArm", "error_info", "read_block_dict", "reply_dict", "status_dict", "status_model"]
