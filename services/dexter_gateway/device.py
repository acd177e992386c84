"""dexter-gateway's device: one `DexterArm` per arm (health, decoded status, every DexRun command, file jobs).

One process, one `DexterArm` (device) per configured arm, each with its own `DexterLink` (transport.py).
Command handlers run on the kit's command pool (the short ones start on paho's thread and send there
when the link is idle, waiting a bounded time: `command`), jobs on their own threads (file transfers handed to one
long-lived transfer thread per arm), the status poller on one thread per arm; each does its own exchange
with the robot when its turn in the arm's FIFO comes (strict stop-and-wait), with no hand-off to another
thread on the way.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from pydantic_core import to_json

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
    STATUS,
    STATUS_MODE,
    WAIT_MOTION,
    WRITE_FILE,
    WRITE_FPGA,
)
from services.dexter_gateway.models import (
    ANGLE_LIMIT_DEG,
    J6_MAX_DEG,
    J6_MIN_DEG,
    J7_MAX_DEG,
    J7_MIN_DEG,
    DexterArmConfig,
    DexterCommandReply,
    DexterEmpty,
    DexterErrorInfo,
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
    DexterStatus,
    DexterStatusModeRequest,
    DexterWaitMotionDone,
    DexterWriteFile,
    DexterWriteFpga,
)
from services.dexter_gateway.protocol import Firmware, ProtocolError, Request
from services.dexter_gateway.settings import DexterSettings
from services.dexter_gateway.transport import (
    DexterLinkConfig,
    DexterLinkError,
    LinkFactory,
    LinkHold,
    LinkReply,
    PendingExchange,
)
from shared import CommandError, ErrorCode, JobContext, Node
from shared.device import handles, moves_when, runs
from shared.dispatch import Deferred
from shared.messages import StopState
from shared.payloads import Serialized
from shared.stop import describe

log = logging.getLogger("robobus.dexter")

# The inline path: the short commands run on paho's network thread, which sends the request itself
# when the arm's link is idle and waits at most this long for the reply (a DexRun `h` answers in ~50-100 µs on
# loopback); past it, the wait goes to the command pool (`Deferred`) with the link's turn, so a silent robot holds
# the node's MQTT no longer than this. Capped by the kit's own hand-over wait (`command_handoff_ms`: how long
# paho's thread already waits for a pooled handler; 0 turns the inline path off).
INLINE_WAIT_MAX_S = 0.001

# What the bus stop cannot do on a Dexter, said in its health while the stop is active (reference dexter.md §4:
# no oplet, parameter or register halts a move in progress; `w` drains the FIFO before it writes)
STOP_NOTE = ("DexRun cannot halt a move in progress: the moves it already has (up to 16 queued in its FIFO, and one "
             "waiting for a slot) run to their end; the gateway sends it no motion oplet until the release and a "
             "new command")


# -- conversions ------------------------------------------------------------------------------------

def error_info(value: int, *, errno_reply: bool = False) -> DexterErrorInfo:
    return DexterErrorInfo.model_validate(_error_dict(value, errno_reply))


_ERRORS: dict[tuple[int, bool], dict[str, Any]] = {}  # decoded error words: a robot sends a handful (0, mostly)


def _error_dict(value: int, errno_reply: bool = False) -> dict[str, Any]:
    d = _ERRORS.get((value, errno_reply))
    if d is None:
        e = p.decode_error(value, errno_reply=errno_reply)
        d = {"value": e.value, "code": e.code, "flags": list(e.flags), "message": e.message}
        if len(_ERRORS) >= 256:  # a garbled stream must not grow it without bound
            _ERRORS.clear()
        _ERRORS[(value, errno_reply)] = d
    return d  # validated into a new model each time: the cached dict itself is never handed out


_RAD = math.pi / 180  # what math.radians multiplies by: the same floats
_ARCSEC = p.ARCSEC_PER_DEG
_JOINT_SCALES = tuple((b, p.ARCSEC_PER_DEG * p.DELTA_SCALE[i]) for i, b in enumerate(p.JOINT_BASE))
_NOT_STANDARD = {"joints": None, "j6": None, "j7": None, "end_effector_io": None, "phui_button": None}


def status_dict(reply: p.Reply, mode: str, deg_per_unit: float, j6_zero: int, ts: float,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status of a reply, straight from the 60 ints, as the dict `DexterStatus` validates in one pass
    (pydantic-core). Every command's reply carries it, so it is on the round trip's path: the same values as
    `p.decode_status` (the reference decoder, §3.2; tests/dexter_gateway/test_status.py checks the two agree on
    random replies) without its five frozen dataclasses, its properties and seven nested model constructors.
    Laid out as the model (its field order, every field present), so that pydantic-core's `to_json` of the dict
    is byte for byte the model's JSON (`reply_json`)."""
    v = reply.ints
    head: dict[str, Any] = {"ts": ts, "robot_time": reply.robot_time, "instruction_id": reply.instruction_id,
                            "oplet": reply.oplet, "error": error or _error_dict(reply.error), "status_mode": mode}
    if mode != "0":  # firmware-specific layouts (§3.3): raw
        head.update(_NOT_STANDARD)
        head["raw"] = list(v)
        return head
    joints = []
    for b, scale in _JOINT_SCALES:
        at, delta, pid, force, sin, cos, measured_at, sent = v[b:b + 8]
        angle, measured = at / _ARCSEC, measured_at / _ARCSEC
        joints.append({"angle_deg": angle, "angle_rad": angle * _RAD, "angle_arcsec": at, "delta_deg": delta / scale,
                       "pid_delta_deg": pid / scale, "force_delta_deg": force / _ARCSEC, "measured_deg": measured,
                       "measured_rad": measured * _RAD, "measured_arcsec": measured_at, "sent_raw": sent,
                       "sin_raw": sin, "cos_raw": cos})
    servo_err = v[58]
    j7, j6 = v[18] * deg_per_unit, (v[38] - j6_zero) * deg_per_unit  # 18/28 = ID 1 = J7, 38/48 = ID 3 = J6
    head["joints"] = joints
    head["j6"] = {"position_units": v[38], "load_units": v[48], "error_flags": servo_err & 0xFF, "angle_deg": j6,
                  "angle_rad": j6 * _RAD}
    head["j7"] = {"position_units": v[18], "load_units": v[28], "error_flags": (servo_err >> 8) & 0xFF,
                  "angle_deg": j7, "angle_rad": j7 * _RAD}
    head["end_effector_io"] = v[9]
    head["phui_button"] = bool(v[9] & 1)
    head["raw"] = None
    return head


def status_model(reply: p.Reply, mode: str, deg_per_unit: float, j6_zero: int, ts: float) -> DexterStatus:
    return DexterStatus.model_validate(status_dict(reply, mode, deg_per_unit, j6_zero, ts))


def read_block_dict(reply: p.Reply) -> dict[str, Any]:
    """An `r` reply's block as the dict `DexterReadBlock` validates (its field order: see `status_dict`)."""
    blk = p.decode_read(reply)
    try:
        text: str | None = blk.payload.decode("utf-8")
        b64 = None
    except UnicodeDecodeError:
        text, b64 = None, base64.b64encode(blk.payload).decode()
    return {"error": _error_dict(reply.error, True), "length": blk.length, "text": text, "base64": b64}


def reply_dict(lr: LinkReply, mode: str, deg_per_unit: float, j6_zero: int, ts: float, *,
               errno_reply: bool = False) -> dict[str, Any]:
    """A command's reply as one dict laid out as `DexterCommandReply` (its field order, every field present: see
    `status_dict`): the request as sent, the decoded error, and the status or the `r` block.
    Raises ProtocolError for an `r` reply whose block cannot be decoded."""
    rep = lr.reply
    is_read = rep.oplet == "r"
    err = _error_dict(rep.error, errno_reply or is_read)
    out: dict[str, Any] = {"request": lr.request.text(), "instruction_id": rep.instruction_id, "oplet": rep.oplet,
                           "rtt_ms": round(lr.rtt_s * 1000, 3), "error": err, "status": None, "read": None}
    if is_read:
        out["read"] = read_block_dict(rep)
    else:
        out["status"] = status_dict(rep, mode, deg_per_unit, j6_zero, ts, None if errno_reply else err)
    return out


def link_error(exc: DexterLinkError) -> CommandError:
    return CommandError(ErrorCode(exc.code), exc.message)


# the oplets that move the arm (§4): queued moves and the immediate PID move; calibration/legacy oplets that move
# it (find_home, slow_move, replay...) are not sent at all (protocol.check_oplet)
RAW_MOTION_OPLETS = p.MOTION_OPLETS | {"P"}

ERRNO_CODES = {p.ENOENT: ErrorCode.NOT_FOUND, p.EBUSY: ErrorCode.BUSY, 13: ErrorCode.FORBIDDEN}


class DexterArm:
    """One arm: its device, its link, its status, its commands and jobs."""

    def __init__(self, node: Node, cfg: DexterArmConfig, settings: DexterSettings, link_factory: LinkFactory) -> None:
        """`link_factory`: the transport ROBOBUS_DEXTER_TRANSPORT names, loaded by the service (`tcp`: tcp.py)."""
        self.node = node
        self.cfg = cfg
        self.settings = settings
        self.firmware = Firmware(cfg.firmware)
        self.dev = node.device(cfg.id)
        self.status_mode = "0"
        link_cfg = DexterLinkConfig(
            host=cfg.host, port=cfg.port, firmware=self.firmware, connect_timeout_s=cfg.connect_timeout_s,
            reply_timeout_s=cfg.reply_timeout_s, motion_timeout_s=cfg.motion_timeout_s,
            fifo_timeout_s=cfg.fifo_timeout_s, keepalive_s=cfg.keepalive_s, reconnect_min_s=cfg.reconnect_min_s,
            reconnect_max_s=cfg.reconnect_max_s, liveness_s=cfg.liveness_s, probe_period_s=cfg.probe_period_s,
            queue_limit=cfg.queue_limit)
        # health is the kit's link supervisor's (docs/kit.md): the link reports to it, the arm adds its faults
        self.sup = self.dev.supervise_link(link_cfg.policy())
        self.dev.set_health(details=self._static_details())
        self.link = link_factory(cfg.id, link_cfg, supervisor=self.sup, on_change=self._apply_fault,
                                 on_reply=self._on_reply, on_decode_error=self._on_decode_error,
                                 keepalive_args=self._g_args, motion_stopped=self._motion_stopped)
        self.dev.on_stop(self._stop_now, note=STOP_NOTE)
        self._latest: tuple[p.Reply, str, float] | None = None  # newest standard-status reply, its mode, time
        self._published_instr = -1
        self._flags: tuple[str, ...] = ()
        self._error_value = 0  # the error word last decoded into _flags
        self._argless: dict[str, Request] = {}  # validated requests without arguments, by oplet (_prepare)
        self._file_job: str | None = None  # r/W keep state on the robot: one file job at a time
        self._file_lock = threading.Lock()
        # file transfers run on this one long-lived thread per arm (one hop per job, none per block): measured,
        # a new thread per job waited ~35-40 µs longer for each block's reply than the raw client (README)
        self._inline_wait_s = min(INLINE_WAIT_MAX_S, settings.command_handoff_ms / 1000)
        self._transfers = ThreadPoolExecutor(1, thread_name_prefix=f"dexter-transfer-{cfg.id}")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fault = ""  # what the arm's health reports as its fault (`_apply_fault`)
        self._fault_lock = threading.Lock()  # replies arrive on several threads
        self.dev.bind_all(self)  # the handlers marked below (@handles, @runs)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start()
        self._threads = [threading.Thread(target=self._status_loop, name=f"dexter-status-{self.cfg.id}", daemon=True),
                         threading.Thread(target=self._health_loop, name=f"dexter-health-{self.cfg.id}", daemon=True)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """The link stops (its supervisor first: the final health is `stopped`, `connection: false`)."""
        self._stop.set()
        self.link.close()
        self._transfers.shutdown(wait=False)  # a running transfer ends at its next block (the link is stopping)
        for t in self._threads:
            t.join(2)
        self.dev.set_health(details=self._details())

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
        self._publish_details()
        return at

    def _g_args(self) -> Sequence[str]:
        # newest: `g` without an argument resets the status mode to '0', so polls repeat the current mode
        return (self.status_mode,) if self.firmware is Firmware.NEWEST and self.status_mode != "0" else ()

    # -- link callbacks ------------------------------------------------------------------------------
    def _on_decode_error(self, what: str) -> None:
        self.node.count_decode_error(f"{self.cfg.id}: {what}")

    def _on_reply(self, lr: LinkReply) -> None:
        rep = lr.reply
        if rep.oplet == "r":
            return  # not a status
        mode = self.status_mode if self.firmware is Firmware.NEWEST else "0"
        if lr.request.oplet == "g":
            mode = lr.request.args[0][0] if lr.request.args and self.firmware is Firmware.NEWEST else "0"
        self._latest = (rep, mode, time.time())
        if rep.error == self._error_value:
            return  # the same error word as before (every block of a write): nothing new for health
        self._error_value = rep.error
        flags = p.decode_error(rep.error).flags
        if flags != self._flags:
            self._flags = flags
            self._apply_fault()

    def _apply_fault(self) -> None:
        """The arm's fault for the kit's supervisor (`error`, and what `error_message` says): DexRun's error
        flags in its replies (a servo, the monitor, a firmware/gateware mismatch), or a configuration that cannot
        work (a host name that does not resolve). Never an absent or silent arm: the supervisor counts failed
        attempts and says `connecting` / `lost` / `unreachable` / `silent` without an error."""
        parts = ([self.link.config_fault] if self.link.config_fault else []) + [p.FLAG_TEXT[f] for f in self._flags]
        fault = "; ".join(parts)
        with self._fault_lock:
            if fault == self._fault:
                return
            self._fault = fault
            if fault:
                self.sup.fault(fault)
            else:
                self.sup.clear_fault()

    def _static_details(self) -> dict[str, Any]:
        return {"host": self.cfg.host, "port": self.cfg.port, "firmware": self.cfg.firmware.value,
                "status_mode": self.status_mode}

    def _details(self) -> dict[str, Any]:
        """The link's own counters beside the kit's `details.link` (attempts, failures, states, budget)."""
        s = self.link.stats
        d = self._static_details()
        d.update(rtt_last_ms=s.rtt_last_ms, rtt_avg_ms=s.rtt_avg_ms, rtt_max_ms=s.rtt_max_ms,
                 reconnects=s.reconnects, timeouts=s.timeouts, out_of_step=s.out_of_step,
                 stale_replies=s.stale_replies, commands=s.commands, keepalives=s.keepalives,
                 busy_refusals=s.busy, stopped_requests=s.stopped, queued=self.link.queued)
        return d

    def _publish_details(self) -> None:
        self.dev.set_health(details=self._details())  # published when changed; the kit's heartbeat besides

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.health_interval_s):
            self._publish_details()

    def _status_loop(self) -> None:
        """Publish the newest status at the configured rate; poll `g` only when nothing else brought one."""
        hz = self.settings.dexter_status_hz
        if hz <= 0:
            return
        period = 1.0 / hz
        while not self._stop.wait(period):
            latest = self._latest
            fresh = latest is not None and time.time() - latest[2] < period and \
                latest[0].instruction_id != self._published_instr
            # a file job holds the link for its whole run and lets a queued `g` in between two blocks (reads bring
            # no status of their own); otherwise only an idle link is polled (commands' replies are status)
            if not fresh and self.link.serving and (not self.link.busy or self._file_job is not None):
                with contextlib.suppress(DexterLinkError, ProtocolError):
                    self.link.request("g", self._g_args())
                latest = self._latest
            if latest is not None and latest[0].instruction_id != self._published_instr:
                self._published_instr = latest[0].instruction_id
                self.dev.publish(STATUS, self._status(latest))

    def _status(self, latest: tuple[p.Reply, str, float]) -> DexterStatus:
        rep, mode, ts = latest
        return status_model(rep, mode, self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units, ts)

    # -- sending ------------------------------------------------------------------------------------------
    def send(self, oplet: str, args: Sequence[Any] = (), *, timeout_s: float | None = None,
             errno_reply: bool = False, fail_on_error: bool = True, job: JobContext | None = None,
             prepared: Request | None = None) -> DexterCommandReply:
        """One command, on the caller's thread; a job's cancel stops it waiting for its turn (a command
        already sent completes on the robot). `prepared`: the request already validated by the caller."""
        req = prepared if prepared is not None else self._prepare(oplet, args)
        try:
            lr = self.link.submit(req, timeout_s=timeout_s, cancelled=None if job is None else lambda: job.cancelled)
        except DexterLinkError as exc:
            raise link_error(exc) from None
        return self._reply_model(lr, errno_reply=errno_reply, fail_on_error=fail_on_error)

    def _prepare(self, oplet: str, args: Sequence[Any]) -> Request:
        if not args:  # `h`, `F`, `g`...: the same request every time (the link numbers each one as it sends it)
            req = self._argless.get(oplet)
            if req is not None:
                return req
        try:
            req = self.link.prepare(oplet, args)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        if not args:  # keyed by oplet: at most one per oplet DexRun knows (the rest fail validation above)
            self._argless[oplet] = req
        return req

    def command(self, oplet: str, args: Sequence[Any] = ()) -> Serialized:
        """A bound command's one exchange: on paho's thread (the inline path, `INLINE_WAIT_MAX_S`) when the
        link is idle and its reply comes in time; otherwise raises `Deferred`, and the kit's pool finishes it:
        the reply's wait (the turn kept: nothing overtakes it), or, with the link busy, a turn like everyone's.
        Either way the reply goes out as `Serialized` (`_reply_json`)."""
        req = self._prepare(oplet, args)
        if self._inline_wait_s <= 0:
            return self._on_pool(lambda: self.link.submit(req))
        try:
            out = self.link.try_inline(req, self._inline_wait_s)
        except DexterLinkError as exc:
            raise link_error(exc) from None
        if out is None:  # in use or queued: take a turn like everyone else, on the pool
            raise Deferred(lambda: self._on_pool(lambda: self.link.submit(req)))
        if isinstance(out, PendingExchange):
            pending = out
            raise Deferred(lambda: self._on_pool(pending.finish))
        return self._reply_json(out)

    def _on_pool(self, exchange: Callable[[], LinkReply]) -> Serialized:
        """The rest of an inline command on the kit's pool: its exchange (a turn, or the pending reply's wait)."""
        try:
            lr = exchange()
        except DexterLinkError as exc:
            raise link_error(exc) from None
        return self._reply_json(lr)

    def _reply_dict(self, lr: LinkReply, *, errno_reply: bool, fail_on_error: bool) -> dict[str, Any]:
        """The reply as one dict laid out as `DexterCommandReply` (`reply_dict`); a non-zero basic code fails
        the command when `fail_on_error`."""
        rep = lr.reply
        errno = errno_reply or rep.oplet == "r"
        if fail_on_error and rep.error:
            err = _error_dict(rep.error, errno)
            if err["code"] != 0:
                code = ERRNO_CODES.get(err["code"], ErrorCode.DEVICE_ERROR) if errno else ErrorCode.DEVICE_ERROR
                raise CommandError(code, f"arm {self.cfg.id}: {lr.request.oplet!r} failed: {err['message']}")
        mode = self._latest[1] if self._latest is not None and self._latest[0] is rep else self.status_mode
        try:
            return reply_dict(lr, mode, self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units,
                              time.time(), errno_reply=errno_reply)
        except ProtocolError as exc:
            self._on_decode_error(str(exc))
            raise CommandError(ErrorCode.DEVICE_ERROR, f"arm {self.cfg.id}: undecodable reply: {exc}") from None

    def _reply_model(self, lr: LinkReply, *, errno_reply: bool, fail_on_error: bool) -> DexterCommandReply:
        """The reply as a model (for the jobs and the commands that read it), validated in one pass."""
        return DexterCommandReply.model_validate(self._reply_dict(lr, errno_reply=errno_reply,
                                                                  fail_on_error=fail_on_error))

    def _reply_json(self, lr: LinkReply) -> Serialized:
        """A bound command's reply as the bytes the kit publishes: pydantic-core's `to_json` of the dict, which
        is laid out as the model, so the bytes are the model's (tests/dexter_gateway/test_status.py proves it on
        random replies) at a third of the cost of validating the dict and dumping the model (~6 against ~21 µs
        here); the dict comes from our own decoder, so there is nothing in it to validate."""
        return Serialized(to_json(self._reply_dict(lr, errno_reply=False, fail_on_error=True)))

    def _servo_units(self, j6_deg: float | None, j7_deg: float | None) -> list[Any]:
        """J6/J7 degrees -> Dynamixel units; NaN skips J6 when only J7 is given (§2)."""
        per = self.settings.dexter_servo_deg_per_unit
        if j6_deg is None and j7_deg is None:
            return []
        j6: Any = float("nan") if j6_deg is None else round(self.settings.dexter_j6_zero_units + j6_deg / per)
        return [j6] if j7_deg is None else [j6, round(j7_deg / per)]

    # -- commands --------------------------------------------------------------------------------------
    @property
    def inline_commands(self) -> bool:
        """Whether the commands marked `inline="inline_commands"` run on the MQTT network thread: when a reply wait
        is configured (command_handoff_ms > 0), as they are one `command` and nothing after it. Not inline: `z`
        sleeps and `w` drains the motion FIFO by design (they would always wait the bound), status_mode and raw
        change state around their `send`."""
        return self._inline_wait_s > 0

    @handles(MOVE_ALL, inline="inline_commands")
    def cmd_move_all(self, req: DexterMoveAllJoints) -> Serialized:
        args = [p.arcsec(a) for a in req.joints_deg] + self._servo_units(req.j6_deg, req.j7_deg)
        return self.command("a", args)

    @handles(MOVE_REL, inline="inline_commands")
    def cmd_move_relative(self, req: DexterMoveRelative) -> Serialized:
        return self.command("R", [p.arcsec(a) for a in req.joints_deg])

    @handles(PID_MOVE, inline="inline_commands")
    def cmd_pid_move(self, req: DexterPidMove) -> Serialized:
        args = [p.arcsec(a) for a in req.offsets_deg] + self._servo_units(req.j6_deg, req.j7_deg)
        return self.command("P", args)

    def _cartesian(self, req: DexterMoveTo) -> list[Any]:
        scale = p.UM_PER_M if req.units == "m" else 1.0
        xyz = [round(v * scale) for v in req.xyz]
        c = req.config
        return [*xyz, *req.direction, int(c.right_arm), int(c.elbow_up), int(c.wrist_out)]

    @handles(MOVE_TO, inline="inline_commands")
    def cmd_move_to(self, req: DexterMoveTo) -> Serialized:
        return self.command("M", self._cartesian(req))

    @handles(MOVE_STRAIGHT, inline="inline_commands")
    def cmd_move_to_straight(self, req: DexterMoveToStraight) -> Serialized:
        args = self._cartesian(req)
        extras: list[Any] = [x for x in (req.tool_speed_um_s, req.resolution_um) if x is not None]
        if req.j6_deg is not None:
            extras += self._servo_units(req.j6_deg, req.j7_deg)
        return self.command("T", args + extras)

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
        try:
            oplet, args = p.parse_command_line(req.command)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        return p.moves(oplet, args)

    @handles(SET_PARAM, inline="inline_commands")
    def cmd_set_parameter(self, req: DexterSetParameter) -> Serialized:
        try:
            name = p.resolve_param(req.name)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        if name == "RunFile":
            raise CommandError(ErrorCode.INVALID_REQUEST, "S RunFile is the run_file job")
        vals = [req.value] if req.value is not None else list(req.values or [])
        if req.units == "user":
            vals = [p.convert_param(name, v) for v in vals]
        if not all(math.isfinite(v) for v in vals):  # a finite value in user units can overflow in wire units
            raise CommandError(ErrorCode.INVALID_REQUEST, f"{name}: a value is too large once converted to "
                               f"{p.param_unit(name).value}")
        unit = p.param_unit(name)
        # DexRun reads the first value with atof and the rest with atoi
        wire: list[Any] = [round(v) if unit in (p.ParamUnit.ARCSEC, p.ParamUnit.MICRONS) else v for v in vals[:1]]
        wire += [round(v) for v in vals[1:]]
        return self.command("S", [req.name if req.name.isdigit() else name, *wire])

    @handles(SET_BOUNDS, inline="inline_commands")
    def cmd_set_boundaries(self, req: DexterSetBoundaries) -> Serialized:
        args: list[int] = []
        for hi, lo in zip(req.high_deg, req.low_deg, strict=True):
            args += [p.arcsec(hi), p.arcsec(lo)]
        return self.command("B", args)

    @handles(SLEEP)
    def cmd_sleep(self, req: DexterSleep) -> DexterCommandReply:
        return self.send("z", [round(req.seconds * 1e6)])

    @handles(HEARTBEAT, inline="inline_commands")
    def cmd_heartbeat(self, req: DexterEmpty) -> Serialized:
        return self.command("h")

    @handles(WRITE_FPGA)
    def cmd_write_fpga(self, req: DexterWriteFpga) -> DexterCommandReply:
        return self.send("w", [req.address, req.value])

    @handles(STATUS_MODE)
    def cmd_status_mode(self, req: DexterStatusModeRequest) -> DexterCommandReply:
        if self.firmware is Firmware.STABLE:
            raise CommandError(ErrorCode.INVALID_REQUEST,
                               "the stable DexRun has no status modes (`g` ignores its argument)")
        if req.mode in " ,;\x00":
            raise CommandError(ErrorCode.INVALID_REQUEST, f"status mode {req.mode!r} cannot be sent")
        reply = self.send("g", [req.mode] if req.mode != "0" else [])
        self.status_mode = req.mode
        self._publish_details()
        return reply

    def check_shell(self, target: str) -> None:
        """The backtick shell target: forbidden unless enabled, and then only allowlisted command lines."""
        line = target[1:].strip()
        s = self.settings
        if not s.dexter_shell_enabled:
            raise CommandError(ErrorCode.FORBIDDEN, "the shell target of `r` is disabled on this gateway "
                               "(ROBOBUS_DEXTER_SHELL_ENABLED)")
        if line and line not in s.dexter_shell_allowlist:
            raise CommandError(ErrorCode.FORBIDDEN, f"shell command {line!r} is not on the allowlist "
                               "(ROBOBUS_DEXTER_SHELL_ALLOWLIST)")
        if line and self.firmware is Firmware.STABLE and " " in line:
            raise CommandError(ErrorCode.INVALID_REQUEST, "the stable DexRun hands only the first word of a shell "
                               "command to the shell")

    @handles(RAW)
    def cmd_raw(self, req: DexterRawCommand) -> DexterCommandReply:
        try:
            oplet, args = p.parse_command_line(req.command)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        if oplet == "r" and len(args) > 1 and p.target_kind(args[1]) == "shell":
            self.check_shell(args[1])
        if oplet in "rW" and self._file_job is not None:
            raise CommandError(ErrorCode.BUSY, f"a {self._file_job} job holds the arm's file channel")
        request = self._prepare(oplet, args)  # judged before anything changes (the status mode below)
        if oplet in RAW_MOTION_OPLETS:
            self.check_raw_motion(oplet, request.args)
        if oplet == "g" and self.firmware is Firmware.NEWEST:
            self.status_mode = args[0][0] if args else "0"
            self._publish_details()  # details.status_mode, as the status_mode command does
        return self.send(oplet, args, fail_on_error=False, prepared=request)

    def check_raw_motion(self, oplet: str, args: Sequence[str]) -> None:
        """A raw oplet that moves the arm is held to the guards of its typed command (models.py): J1..J5 within
        ±ANGLE_LIMIT_DEG, J6/J7 within their ranges, the Cartesian configuration 0 or 1, speeds at least 1, and
        integers wherever the typed command sends integers (DexRun reads them with atoi: `3600.5` would silently
        become 3600). The typed moves have no deadman, and neither has this path: DexRun moves are queued
        position goals that end on their own (README, "Motion and stop")."""
        def fail(what: str) -> NoReturn:
            raise CommandError(ErrorCode.INVALID_REQUEST, f"raw {oplet!r}: {what}")

        def integer(i: int, name: str) -> int:
            tok = args[i]
            if not p.is_int(tok):
                fail(f"{name} {tok!r} must be an integer (DexRun reads it with atoi; the typed command sends one)")
            return int(tok)

        per, zero = self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units

        def servo(i: int, name: str, lo: float, hi: float, zero_units: int) -> None:
            if i >= len(args) or args[i] == "NaN":  # NaN skips it (§2)
                return
            deg = (integer(i, name) - zero_units) * per
            if not lo <= deg <= hi:
                fail(f"{name} {args[i]} Dynamixel units is {deg:.1f}°, outside {lo:g}..{hi:g}° (the typed limit)")

        if oplet in "aPR":
            for j in range(5):
                v = integer(j, f"J{j + 1}")
                if abs(v) > ANGLE_LIMIT_DEG * p.ARCSEC_PER_DEG:
                    fail(f"J{j + 1} {v} arcsec is beyond ±{ANGLE_LIMIT_DEG:g}° (the typed limit)")
            servo(5, "J6", J6_MIN_DEG, J6_MAX_DEG, zero)
            servo(6, "J7", J7_MIN_DEG, J7_MAX_DEG, 0)
            return
        for i, axis in enumerate("xyz"):  # M T C D: x y z µm, direction, configuration, [speed, resolution, J6, J7]
            integer(i, f"{axis} (µm)")
        for i, name in zip(range(6, 9), ("right_arm", "elbow_up", "wrist_out"), strict=True):
            if args[i] not in ("0", "1"):
                fail(f"{name} must be 0 or 1, got {args[i]!r}")
        for i, name in ((9, "tool speed (µm/s)"), (10, "resolution (µm)")):
            if i < len(args) and integer(i, name) < 1:
                fail(f"{name} must be at least 1, got {args[i]}")
        servo(11, "J6", J6_MIN_DEG, J6_MAX_DEG, zero)
        servo(12, "J7", J7_MIN_DEG, J7_MAX_DEG, 0)

    # -- jobs ----------------------------------------------------------------------------------------
    def admit_file(self, req: Any) -> None:
        if not self.link.serving:
            raise link_error(DexterLinkError("unavailable", f"arm {self.cfg.id} is not connected: {self.link.message}"))
        with self._file_lock:
            if self._file_job is not None:
                raise CommandError(ErrorCode.BUSY, f"a {self._file_job} job is using the arm's file channel "
                                   "(DexRun keeps one write handle, one keyword and one shell)")
            self._file_job = "read_file" if isinstance(req, DexterReadFile) else "write_file"

    # Every job's request is judged before a job id exists: what can be refused up front (a path DexRun would
    # cut or misparse, data that is not base64, a request over 255 bytes) gets `invalid_request` in the command's
    # reply and no job starts; only what the robot alone can say (ENOENT, EBUSY...) ends in the job's result.
    def admit_read(self, req: DexterReadFile) -> None:
        if p.target_kind(req.path) == "shell":
            self.check_shell(req.path)
        self._prepare("r", ("0", req.path))  # block 0 in full: a file path, a #keyword or a shell line
        self.admit_file(req)

    def admit_write(self, req: DexterWriteFile) -> None:
        self._write_data(req)
        self._prepare("W", ("f", "0", req.path))  # the data blocks are write_requests' own, valid by construction
        self.admit_file(req)

    def admit_run_file(self, req: DexterRunFile) -> None:
        self._prepare("S", ("RunFile", req.path))

    @runs(WAIT_MOTION)
    def job_wait_motion(self, req: DexterWaitMotionDone, job: JobContext) -> DexterMotionDone:
        """`F` blocks the link until the FIFO drains: it runs on a helper thread so that a cancel ends the
        job at once (the `F` itself completes on the robot; its reply is read and dropped)."""
        t0 = time.monotonic()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["reply"] = self.send("F", timeout_s=req.timeout_s or self.cfg.motion_timeout_s)
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

    @contextlib.contextmanager
    def _transfer(self, job: JobContext) -> Iterator[LinkHold]:
        """A file job owns the link for its whole run (`DexterLink.hold`): its blocks go back to back on the
        job's thread; link errors become the contract's codes, a cancel while waiting a cancelled result."""
        try:
            with self.link.hold(cancelled=lambda: job.cancelled) as hold:
                yield hold
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except DexterLinkError as exc:
            if job.cancelled and exc.code == "unavailable":
                job.check_cancelled()  # gave up its turn because of the cancel: a cancelled result, not an error
            raise link_error(exc) from None

    def _read_block(self, hold: LinkHold, block: int, target: str) -> p.ReadBlock:
        # block 0 is validated in full; later blocks differ only in the block number
        req = self.link.prepare("r", (str(block), target)) if block == 0 else p.Request("r", (str(block), target))
        rep = hold.exchange(req).reply
        try:
            return p.decode_read(rep)
        except ProtocolError as exc:
            self._on_decode_error(str(exc))
            raise CommandError(ErrorCode.DEVICE_ERROR, f"arm {self.cfg.id}: undecodable r reply: {exc}") from None

    def _fail_errno(self, what: str, errno: int) -> CommandError:
        e = p.decode_error(errno, errno_reply=True)
        return CommandError(ERRNO_CODES.get(e.code, ErrorCode.DEVICE_ERROR), f"{what}: {e.message}")

    @runs(READ_FILE, admit="admit_read")
    def job_read_file(self, req: DexterReadFile, job: JobContext) -> DexterFileContent:
        def run() -> DexterFileContent:
            with self._transfer(job) as hold:
                return self._read_file(req, job, hold)
        try:
            return self._transfers.submit(run).result()
        finally:
            self._file_job = None

    def _read_file(self, req: DexterReadFile, job: JobContext, hold: LinkHold, phase: str = "reading",
                   total: int = 0) -> DexterFileContent:
        kind = p.target_kind(req.path)
        data = bytearray()
        blocks = 0
        exit_status = None
        if kind == "shell":
            shell = p.ShellRead()
            target = req.path
            while not shell.done:
                job.check_cancelled()
                blk = self._read_block(hold, 1 if blocks else 0, target if not blocks else "`")
                if blocks == 0 and blk.error in (p.EBUSY, p.ECHILD):
                    raise self._fail_errno(f"shell {req.path[1:]!r}", blk.error)
                blocks += 1
                shell.feed(blk)
                job.progress("reading", len(shell.output), 0, blocks=blocks)
                if len(shell.output) > req.max_bytes:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"output exceeds max_bytes={req.max_bytes}")
                if not blk.payload and not shell.done:
                    job.wait(0.005)  # still running: output trickles
            data, exit_status = shell.output, shell.exit_status
        else:
            prev = b""
            while True:
                job.check_cancelled()
                blk = self._read_block(hold, blocks, req.path)
                if blk.error:
                    if kind == "keyword" and blk.error == p.ESPIPE and blocks > 0:
                        break  # newest: keyword data exhausted
                    raise self._fail_errno(f"read {req.path!r}", blk.error)
                if kind == "keyword" and blocks > 0 and blk.payload == prev and blk.length == p.MAX_CONTENT_CHARS:
                    break  # stable: past the end it repeats the previous reply's stale bytes
                blocks += 1
                data += blk.payload
                prev = blk.payload
                job.progress(phase, len(data), total, blocks=blocks)
                if len(data) > req.max_bytes:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"{req.path!r} exceeds max_bytes={req.max_bytes}")
                if blk.length < p.MAX_CONTENT_CHARS:
                    break
                if kind == "keyword" and self.firmware is Firmware.STABLE and _complete_json(data):
                    break  # stable never says "exhausted": stop at a complete value
        out = DexterFileContent(path=req.path, kind=kind, bytes=len(data), blocks=blocks, exit_status=exit_status)
        raw = bytes(data)
        if req.encoding != "base64":
            try:
                out.text = raw.decode("utf-8")
            except UnicodeDecodeError:
                if req.encoding == "text":
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"{req.path!r} is not UTF-8 text; "
                                       "ask for encoding=base64") from None
        if out.text is None:
            out.base64 = base64.b64encode(raw).decode()
        if kind == "keyword" and out.text is not None:
            try:
                out.value = p.decode_keyword(req.path, out.text)
            except ProtocolError as exc:
                self._on_decode_error(str(exc))
        return out

    @runs(WRITE_FILE, admit="admit_write")
    def job_write_file(self, req: DexterWriteFile, job: JobContext) -> DexterFileWritten:
        try:
            return self._transfers.submit(self._write_file, req, job).result()
        finally:
            self._file_job = None

    @staticmethod
    def _write_data(req: DexterWriteFile) -> bytes:
        if req.text is not None:
            return req.text.encode("utf-8")
        try:
            return base64.b64decode(req.base64 or "", validate=True)
        except (binascii.Error, ValueError):
            raise CommandError(ErrorCode.INVALID_REQUEST, "base64 is not valid base64") from None

    def _write_file(self, req: DexterWriteFile, job: JobContext) -> DexterFileWritten:
        data = self._write_data(req)  # admitted (admit_write): these cannot fail here
        try:
            seq = p.write_requests(req.path, data)
            # `W f <path>` is checked in full; the data blocks are write_requests' own escaped chunks (valid by
            # construction, tests/dexter_gateway/test_protocol.py), so each is built without unescaping it again
            built = [self.link.prepare(*seq[0]), *(p.Request(oplet, tuple(args)) for oplet, args in seq[1:])]
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        # bytes each block carries: every '%' in an escaped chunk starts a 3-character escape of one byte
        sizes = [0, *(len(args[2]) - 2 * args[2].count("%") if len(args) > 2 else 0 for _oplet, args in seq[1:])]
        done = 0
        last = len(built) - 1
        with self._transfer(job) as hold:
            for i, request in enumerate(built):
                if job.cancelled:
                    if i > 0:  # close DexRun's write handle (the file keeps what was written), then report it
                        with contextlib.suppress(DexterLinkError, ProtocolError):
                            hold.exchange(self.link.prepare("W", ["e", "0"]))
                    job.check_cancelled()
                try:
                    rep = hold.exchange(request).reply
                except DexterLinkError:
                    if job.cancelled and i > 0 and not hold.held:  # cancelled while waiters had the link
                        with contextlib.suppress(DexterLinkError, ProtocolError):
                            self.link.request("W", ["e", "0"])
                    raise
                if rep.error:  # DexRun reports no fopen/fwrite errors (§4.2); anything here is worth stopping for
                    raise self._fail_errno(f"write {req.path!r}", rep.error)
                done += sizes[i]
                job.progress("writing", done, len(data), force=i == last, blocks=i)
            verified = None
            if req.verify:
                back = self._read_file(DexterReadFile(path=req.path, encoding="base64",
                                                      max_bytes=max(len(data) + 62, 62)), job, hold, "verifying",
                                       len(data))
                verified = base64.b64decode(back.base64 or "") == data if back.base64 is not None else \
                    (back.text or "").encode() == data
        if not verified and req.verify:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"{req.path!r} reads back {back.bytes} bytes that differ "
                               f"from the {len(data)} written (DexRun does not report write errors)")
        return DexterFileWritten(path=req.path, bytes=len(data), blocks=len(seq) - 1, verified=verified)

    @runs(RUN_FILE, admit="admit_run_file")
    def job_run_file(self, req: DexterRunFile, job: JobContext) -> DexterRunFileResult:
        job.progress("running", force=True)
        rep = self.send("S", ["RunFile", req.path], errno_reply=True, fail_on_error=False, job=job)
        if rep.error.code:
            raise self._fail_errno(f"RunFile {req.path!r}", rep.error.code)
        return DexterRunFileResult(path=req.path, error=rep.error, status=rep.status)


def _complete_json(data: bytearray) -> bool:
    try:
        json.loads(bytes(data))
    except ValueError:
        return False
    return True


__all__ = ["STOP_NOTE", "DexterArm", "error_info", "read_block_dict", "reply_dict", "status_dict", "status_model"]
