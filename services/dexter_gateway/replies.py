"""DexRun replies as the gateway publishes them, pure (no I/O; the time is passed in): the decoded error word, the
status straight from the 60 ints, an `r` block, a command's whole reply laid out as `DexterCommandReply`, and the
contract's error codes for what the link and the robot report."""

from __future__ import annotations

import base64
import math
from typing import Any

from services.dexter_gateway import protocol as p
from services.dexter_gateway.link import DexterLinkError, LinkReply
from services.dexter_gateway.models import DexterErrorInfo, DexterStatus
from shared import CommandError, ErrorCode


def error_info(value: int, *, errno_reply: bool = False) -> DexterErrorInfo:
    return DexterErrorInfo.model_validate(error_dict(value, errno_reply))


_ERRORS: dict[tuple[int, bool], dict[str, Any]] = {}  # decoded error words: a robot sends a handful (0, mostly)


def error_dict(value: int, errno_reply: bool = False) -> dict[str, Any]:
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
                            "oplet": reply.oplet, "error": error or error_dict(reply.error), "status_mode": mode}
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
    return {"error": error_dict(reply.error, True), "length": blk.length, "text": text, "base64": b64}


def reply_dict(lr: LinkReply, mode: str, deg_per_unit: float, j6_zero: int, ts: float, *,
               errno_reply: bool = False) -> dict[str, Any]:
    """A command's reply as one dict laid out as `DexterCommandReply` (its field order, every field present: see
    `status_dict`): the request as sent, the decoded error, and the status or the `r` block.
    Raises ProtocolError for an `r` reply whose block cannot be decoded."""
    rep = lr.reply
    is_read = rep.oplet == "r"
    err = error_dict(rep.error, errno_reply or is_read)
    out: dict[str, Any] = {"request": lr.request.text(), "instruction_id": rep.instruction_id, "oplet": rep.oplet,
                           "rtt_ms": round(lr.rtt_s * 1000, 3), "error": err, "status": None, "read": None}
    if is_read:
        out["read"] = read_block_dict(rep)
    else:
        out["status"] = status_dict(rep, mode, deg_per_unit, j6_zero, ts, None if errno_reply else err)
    return out


def link_error(exc: DexterLinkError) -> CommandError:
    return CommandError(ErrorCode(exc.code), exc.message)


ERRNO_CODES = {p.ENOENT: ErrorCode.NOT_FOUND, p.EBUSY: ErrorCode.BUSY, 13: ErrorCode.FORBIDDEN}


def errno_error(what: str, errno: int) -> CommandError:
    """An errno DexRun answered (ENOENT, EBUSY...) as the contract's code, `device_error` for the rest."""
    e = p.decode_error(errno, errno_reply=True)
    return CommandError(ERRNO_CODES.get(e.code, ErrorCode.DEVICE_ERROR), f"{what}: {e.message}")


__all__ = ["ERRNO_CODES", "errno_error", "error_dict", "error_info", "link_error", "read_block_dict", "reply_dict",
           "status_dict", "status_model"]
