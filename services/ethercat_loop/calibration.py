"""Joint calibration: raw 12-bit sensor values -> radians, and which motor drives which joint.

File format (YAML, documented in README.md; example: calibration/right_hand.yaml):

    hand: right                    # free text
    motors: {FFJ0: 8, FFJ3: 9, ...} # actuated joint -> motor id 0..19 (bus 1: 0..9, bus 2: 10..19)
    sensors:                       # calibrated joint -> [[raw, degrees], ...] (at least two points)
      FFJ1: [[200, 0.0], [3800, 90.0]]
      THJ5: [...]                  # applied to the mean of THJ5A and THJ5B
      WRJ1: [...]                  # applied to the mean of WRJ1A and WRJ1B

Like sr_robot_lib: points are converted to radians and interpolated piecewise-linearly (linear beyond
the ends); J0 = J1 + J2, each calibrated on its own; THJ5 and WRJ1 combine A/B first, then calibrate.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from services.ethercat_loop.protocol import ACTUATED_JOINTS, JOINT_NAMES, NUM_MOTORS, SENSOR_INDEX

DEFAULT_CALIBRATION = Path(__file__).parent / "calibration" / "right_hand.yaml"

# calibrated name -> the sensors it reads (their mean is calibrated)
CALIBRATED_SENSORS: dict[str, tuple[str, ...]] = {
    **{n: (n,) for n in JOINT_NAMES if not n.endswith("J0") and n not in ("THJ5", "WRJ1")},
    "THJ5": ("THJ5A", "THJ5B"),
    "WRJ1": ("WRJ1A", "WRJ1B"),
}


@dataclass(frozen=True)
class PiecewiseLinear:
    """raw -> radians through sorted (raw, rad) points, extrapolating the end segments."""

    raws: tuple[float, ...]
    rads: tuple[float, ...]

    def __post_init__(self) -> None:
        pairs = sorted(zip(self.rads, self.raws, strict=True))
        object.__setattr__(self, "_inv", (tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))

    @classmethod
    def from_degrees(cls, points: list[tuple[float, float]]) -> PiecewiseLinear:
        pts = sorted(points)
        return cls(tuple(p[0] for p in pts), tuple(math.radians(p[1]) for p in pts))

    @staticmethod
    def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def __call__(self, raw: float) -> float:
        return self._interp(self.raws, self.rads, raw)

    def inverse(self, rad: float) -> float:
        """radians -> raw (the palm model uses it to produce sensor values); needs monotonic points."""
        xs, ys = self._inv  # type: ignore[attr-defined]
        return self._interp(xs, ys, rad)

    @property
    def range_rad(self) -> tuple[float, float]:
        return min(self.rads), max(self.rads)


class PalmCalibrationFile(BaseModel):
    """The YAML file, validated."""

    hand: str = "right"
    motors: dict[str, int] = Field(description="actuated joint -> motor id")
    sensors: dict[str, list[tuple[float, float]]] = Field(description="joint -> [[raw, degrees], ...]")

    @field_validator("motors")
    @classmethod
    def _motors(cls, v: dict[str, int]) -> dict[str, int]:
        bad = sorted(set(v) - set(ACTUATED_JOINTS))
        if bad:
            raise ValueError(f"unknown actuated joints {bad} (known: {list(ACTUATED_JOINTS)})")
        ids = list(v.values())
        if any(not 0 <= m < NUM_MOTORS for m in ids) or len(set(ids)) != len(ids):
            raise ValueError("motor ids must be distinct and in 0..19")
        return v

    @field_validator("sensors")
    @classmethod
    def _sensors(cls, v: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
        for name, pts in v.items():
            if name not in CALIBRATED_SENSORS:
                raise ValueError(f"unknown calibrated joint {name!r} (known: {sorted(CALIBRATED_SENSORS)})")
            if len(pts) < 2 or len({p[0] for p in pts}) != len(pts):
                raise ValueError(f"{name}: need at least two points with distinct raw values")
        return v

    @model_validator(mode="after")
    def _complete(self) -> PalmCalibrationFile:
        missing = sorted(set(CALIBRATED_SENSORS) - set(self.sensors))
        if missing:
            raise ValueError(f"no calibration for {missing}")
        return self


@dataclass(frozen=True)
class PalmJointReading:
    name: str
    position: float  # rad
    raw: tuple[int, ...]  # the sensor words it was computed from


class HandCalibration:
    """Turns the 37 raw sensor words of a status into the 28 joints."""

    def __init__(self, spec: PalmCalibrationFile) -> None:
        self.spec = spec
        self.tables = {n: PiecewiseLinear.from_degrees(list(p)) for n, p in spec.sensors.items()}
        self.motor_of_joint = dict(spec.motors)
        self.joint_of_motor = {m: j for j, m in spec.motors.items()}
        self._idx = {n: tuple(SENSOR_INDEX[s] for s in ss) for n, ss in CALIBRATED_SENSORS.items()}
        # the sensor words the joints depend on are sensors[:sensor_span] (the IMU and analog words follow)
        self.sensor_span = 1 + max(max(ix) for ix in self._idx.values())

    @classmethod
    def load(cls, path: Path | str | None = None) -> HandCalibration:
        p = Path(path) if path else DEFAULT_CALIBRATION
        data = yaml.safe_load(p.read_text())
        return cls(PalmCalibrationFile.model_validate(data))

    def raw_of(self, name: str, sensors: tuple[int, ...]) -> float:
        idx = self._idx[name]
        return sum(sensors[i] for i in idx) / len(idx)

    def joints(self, sensors: tuple[int, ...]) -> list[PalmJointReading]:
        cal: dict[str, float] = {n: self.tables[n](self.raw_of(n, sensors)) for n in self.tables}
        out = []
        for name in JOINT_NAMES:
            if name.endswith("J0"):
                f = name[:2]
                j1, j2 = f"{f}J1", f"{f}J2"
                out.append(PalmJointReading(name, cal[j1] + cal[j2],
                                            (sensors[SENSOR_INDEX[j1]], sensors[SENSOR_INDEX[j2]])))
            else:
                out.append(PalmJointReading(name, cal[name], tuple(sensors[i] for i in self._idx[name])))
        return out
