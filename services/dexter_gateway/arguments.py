"""What the typed commands send, and what a request must pass before it is sent, pure (no I/O): DexRun's
arguments in wire units from the typed requests (models.py), and the guards of the raw command (its moves held to
the typed commands' limits) and of the shell target of `r`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn

from services.dexter_gateway import protocol as p
from services.dexter_gateway.models import (
    ANGLE_LIMIT_DEG,
    J6_MAX_DEG,
    J6_MIN_DEG,
    J7_MAX_DEG,
    J7_MIN_DEG,
    DexterMoveTo,
    DexterSetParameter,
)
from services.dexter_gateway.protocol import Firmware, ProtocolError
from shared import CommandError, ErrorCode

# the oplets that move the arm (§4): queued moves and the immediate PID move; calibration/legacy oplets that move
# it (find_home, slow_move, replay...) are not sent at all (protocol.check_oplet)
RAW_MOTION_OPLETS = p.MOTION_OPLETS | {"P"}


def servo_units(j6_deg: float | None, j7_deg: float | None, deg_per_unit: float, j6_zero: int) -> list[Any]:
    """J6/J7 degrees -> Dynamixel units; NaN skips J6 when only J7 is given (§2)."""
    if j6_deg is None and j7_deg is None:
        return []
    j6: Any = float("nan") if j6_deg is None else round(j6_zero + j6_deg / deg_per_unit)
    return [j6] if j7_deg is None else [j6, round(j7_deg / deg_per_unit)]


def cartesian(req: DexterMoveTo) -> list[Any]:
    """`M`/`T`'s first nine arguments: x y z in µm, the direction, the configuration bits."""
    scale = p.UM_PER_M if req.units == "m" else 1.0
    xyz = [round(v * scale) for v in req.xyz]
    c = req.config
    return [*xyz, *req.direction, int(c.right_arm), int(c.elbow_up), int(c.wrist_out)]


def set_parameter_args(req: DexterSetParameter) -> list[Any]:
    """`S`'s arguments: the parameter (its index as given, else its resolved name) and its values in wire units."""
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
    return [req.name if req.name.isdigit() else name, *wire]


def parse_raw(command: str) -> tuple[str, list[str]]:
    """A raw command line as (oplet, args); a line that does not parse is the request's error."""
    try:
        return p.parse_command_line(command)
    except ProtocolError as exc:
        raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None


def check_shell(target: str, *, enabled: bool, allowlist: Sequence[str], firmware: Firmware) -> None:
    """The backtick shell target: forbidden unless enabled, and then only allowlisted command lines."""
    line = target[1:].strip()
    if not enabled:
        raise CommandError(ErrorCode.FORBIDDEN, "the shell target of `r` is disabled on this gateway "
                           "(ROBOBUS_DEXTER_SHELL_ENABLED)")
    if line and line not in allowlist:
        raise CommandError(ErrorCode.FORBIDDEN, f"shell command {line!r} is not on the allowlist "
                           "(ROBOBUS_DEXTER_SHELL_ALLOWLIST)")
    if line and firmware is Firmware.STABLE and " " in line:
        raise CommandError(ErrorCode.INVALID_REQUEST, "the stable DexRun hands only the first word of a shell "
                           "command to the shell")


def check_raw_motion(oplet: str, args: Sequence[str], deg_per_unit: float, j6_zero: int) -> None:
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

    def servo(i: int, name: str, lo: float, hi: float, zero_units: int) -> None:
        if i >= len(args) or args[i] == "NaN":  # NaN skips it (§2)
            return
        deg = (integer(i, name) - zero_units) * deg_per_unit
        if not lo <= deg <= hi:
            fail(f"{name} {args[i]} Dynamixel units is {deg:.1f}°, outside {lo:g}..{hi:g}° (the typed limit)")

    if oplet in "aPR":
        for j in range(5):
            v = integer(j, f"J{j + 1}")
            if abs(v) > ANGLE_LIMIT_DEG * p.ARCSEC_PER_DEG:
                fail(f"J{j + 1} {v} arcsec is beyond ±{ANGLE_LIMIT_DEG:g}° (the typed limit)")
        servo(5, "J6", J6_MIN_DEG, J6_MAX_DEG, j6_zero)
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
    servo(11, "J6", J6_MIN_DEG, J6_MAX_DEG, j6_zero)
    servo(12, "J7", J7_MIN_DEG, J7_MAX_DEG, 0)


__all__ = ["RAW_MOTION_OPLETS", "cartesian", "check_raw_motion", "check_shell", "parse_raw", "servo_units",
           "set_parameter_args"]
