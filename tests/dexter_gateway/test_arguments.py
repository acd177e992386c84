"""What the typed commands send and the guards of the raw command and the shell target (arguments.py), pure."""

from __future__ import annotations

import math

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.arguments import (
    cartesian,
    check_raw_motion,
    check_shell,
    parse_raw,
    servo_units,
    set_parameter_args,
)
from services.dexter_gateway.models import DexterMoveTo, DexterSetParameter
from shared import CommandError, ErrorCode

PER, ZERO = 0.29, 512


def refused(code: ErrorCode, fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(CommandError) as exc:
        fn(*args, **kw)  # type: ignore[operator]
    assert exc.value.code == code, exc.value
    return str(exc.value)


def test_servo_units() -> None:
    assert servo_units(None, None, PER, ZERO) == []
    assert servo_units(29.0, None, PER, ZERO) == [612]
    j6, j7 = servo_units(None, 29.0, PER, ZERO)
    assert math.isnan(j6) and j7 == 100  # NaN skips J6 when only J7 is given


def test_cartesian_in_microns() -> None:
    req = DexterMoveTo(xyz=[0.1, -0.2, 0.3])
    assert cartesian(req) == [100000, -200000, 300000, 0.0, 0.0, -1.0, 1, 1, 1]
    assert cartesian(DexterMoveTo(xyz=[1, 2, 3], units="um"))[:3] == [1, 2, 3]


def test_set_parameter_args() -> None:
    assert set_parameter_args(DexterSetParameter(name="MaxSpeed", value=1.0)) == ["MaxSpeed", p.NBITS_PER_DEG_S]
    assert set_parameter_args(DexterSetParameter(name="MaxSpeed", value=5, units="wire")) == ["MaxSpeed", 5]
    assert "run_file" in refused(ErrorCode.INVALID_REQUEST, set_parameter_args,
                                 DexterSetParameter(name="RunFile", value=1))
    refused(ErrorCode.INVALID_REQUEST, set_parameter_args, DexterSetParameter(name="NoSuchParam", value=1))


def test_raw_motion_is_held_to_the_typed_limits() -> None:
    limit = round(720 * p.ARCSEC_PER_DEG)
    check_raw_motion("a", [str(limit), "0", "0", "0", "0"], PER, ZERO)
    assert "beyond" in refused(ErrorCode.INVALID_REQUEST, check_raw_motion, "a",
                               [str(limit + 1), "0", "0", "0", "0"], PER, ZERO)
    assert "integer" in refused(ErrorCode.INVALID_REQUEST, check_raw_motion, "R", ["1.5", "0", "0", "0", "0"],
                                PER, ZERO)
    check_raw_motion("a", ["0"] * 5 + ["NaN", "100"], PER, ZERO)  # NaN skips J6
    assert "J6" in refused(ErrorCode.INVALID_REQUEST, check_raw_motion, "a", ["0"] * 5 + ["1100"], PER, ZERO)
    cart = ["0", "0", "0", "0", "0", "-1", "1", "1", "0"]
    check_raw_motion("M", cart, PER, ZERO)
    assert "elbow_up" in refused(ErrorCode.INVALID_REQUEST, check_raw_motion, "M", [*cart[:7], "2", "0"], PER, ZERO)
    assert "at least 1" in refused(ErrorCode.INVALID_REQUEST, check_raw_motion, "T", [*cart, "0"], PER, ZERO)


def test_the_shell_target() -> None:
    refused(ErrorCode.FORBIDDEN, check_shell, "`ls", enabled=False, allowlist=["ls"], firmware=p.Firmware.NEWEST)
    refused(ErrorCode.FORBIDDEN, check_shell, "`rm -rf /", enabled=True, allowlist=["ls"],
            firmware=p.Firmware.NEWEST)
    check_shell("`ls", enabled=True, allowlist=["ls"], firmware=p.Firmware.NEWEST)
    check_shell("`uname -a", enabled=True, allowlist=["uname -a"], firmware=p.Firmware.NEWEST)
    assert "first word" in refused(ErrorCode.INVALID_REQUEST, check_shell, "`uname -a", enabled=True,
                                   allowlist=["uname -a"], firmware=p.Firmware.STABLE)


def test_parse_raw() -> None:
    assert parse_raw("a 1 2 3 4 5") == ("a", ["1", "2", "3", "4", "5"])
    refused(ErrorCode.INVALID_REQUEST, parse_raw, "")
