"""The simulated e-puck2's world: differential drive in a square arena with one round obstacle,
proximity and ToF from ray casts, and a synthetic camera picture that follows the pose.

Pure computation (numpy for the camera); the simulated robots (wifi.py, serial.py) drive it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from services.epuck_gateway.protocol.wifi import (
    ACC_COUNTS_PER_G,
    IMAGE_HEIGHT,
    IMAGE_WIDTH,
    SET_CALIBRATE_IR,
    SET_OBSTACLE_AVOIDANCE,
    SET_STEPS,
    EpuckCommand,
    EpuckRawSensors,
    rgb888_to_rgb565,
)

WHEEL_RADIUS_MM = 20.5
AXLE_MM = 53.0
MM_PER_STEP = 2 * math.pi * WHEEL_RADIUS_MM / 1000  # 1000 steps per wheel revolution
ROBOT_RADIUS_MM = 37.0
MOTOR_SPEED_LIMIT = 1100  # the F407 clamps here, not at the nominal 1000
# IR sensor bearings (rad, counter-clockwise from forward): prox0 front-right ... prox7 front-left
PROX_ANGLES = (-0.30, -0.80, -math.pi / 2, -2.64, 2.64, math.pi / 2, 0.80, 0.30)
PROX_BASE = 60  # uncalibrated offset of every IR sensor (removed by calibration)
CAMERA_FOV = math.radians(56.0)
WALL_HALF_HEIGHT_MM = 50.0
MAX_SUBSTEP_S = 0.02


def _c565(r: int, g: int, b: int) -> int:
    return rgb888_to_rgb565(r, g, b)


WALL_COLORS = np.array([  # east, north, west, south; light and dark stripe of each
    [_c565(220, 40, 40), _c565(140, 20, 20)],
    [_c565(40, 200, 60), _c565(20, 120, 30)],
    [_c565(50, 80, 230), _c565(25, 40, 140)],
    [_c565(230, 210, 40), _c565(150, 130, 20)],
], dtype=np.uint16)
OBSTACLE_COLOR = _c565(230, 60, 230)
CEILING = _c565(200, 200, 210)
FLOOR = _c565(90, 90, 90)


@dataclass
class EpuckWorld:
    """One robot in its own arena (mm, rad). Actuator state mirrors the last command applied."""

    x: float = 250.0
    y: float = 250.0
    theta: float = 0.0
    arena_mm: float = 1000.0
    obstacle: tuple[float, float, float] = (600.0, 600.0, 60.0)  # x, y, radius
    speed_left: int = 0
    speed_right: int = 0
    steps_left: float = 0.0
    steps_right: float = 0.0
    leds: int = 0
    rgb: tuple[tuple[int, int, int], ...] = ((0, 0, 0),) * 4  # LED2, LED4, LED6, LED8
    obstacle_avoidance: bool = False
    calibration: list[int] = field(default_factory=lambda: [0] * 8)
    calibrations: int = 0  # cycles that applied the calibrate flag (it is level-triggered)
    sound_starts: int = 0  # cycles that (re)started a melody
    sound: int = 0  # last melody started, 0 when none
    melodies: list[int] = field(default_factory=list)  # sound bits of every command that started a melody anew
    _last_sound_bits: int = 0
    omega: float = 0.0

    # -- actuators ------------------------------------------------------------------------------
    def apply(self, cmd: EpuckCommand) -> None:
        """One firmware cycle with `cmd` (the F407's -0x09 handler): every flag is level-triggered."""
        if cmd.settings & SET_STEPS:
            self.steps_left, self.steps_right = float(cmd.left), float(cmd.right)
        else:
            self.speed_left = max(-MOTOR_SPEED_LIMIT, min(MOTOR_SPEED_LIMIT, cmd.left))
            self.speed_right = max(-MOTOR_SPEED_LIMIT, min(MOTOR_SPEED_LIMIT, cmd.right))
        self.obstacle_avoidance = bool(cmd.settings & SET_OBSTACLE_AVOIDANCE)
        self.leds = cmd.leds
        # values > 100 mean "leave unchanged" in the firmware
        rgb: list[tuple[int, int, int]] = []
        for led, prev in zip(cmd.rgb, self.rgb, strict=True):
            r, g, b = (new if new <= 100 else old for new, old in zip(led, prev, strict=True))
            rgb.append((r, g, b))
        self.rgb = tuple(rgb)
        if cmd.settings & SET_CALIBRATE_IR:
            self.calibrations += 1
            self.calibration = self._reflected()
        if cmd.sound:
            self.sound_starts += 1  # ML_FORCE_CHANGE: every cycle restarts the melody
            self.sound = 0 if cmd.sound == 0x20 else cmd.sound
            if cmd.sound != self._last_sound_bits:
                self.melodies.append(cmd.sound)
        self._last_sound_bits = cmd.sound

    # -- physics --------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        while dt > 1e-9:
            h = min(dt, MAX_SUBSTEP_S)
            self._step(h)
            dt -= h

    def _step(self, dt: float) -> None:
        vl, vr = float(self.speed_left), float(self.speed_right)
        if self.obstacle_avoidance:  # a simple Braitenberg stand-in for the firmware's behaviour
            prox = self.proximity()
            vl += 0.3 * (prox[7] + prox[6]) - 0.3 * (prox[0] + prox[1])
            vr += 0.3 * (prox[0] + prox[1]) - 0.3 * (prox[7] + prox[6])
            vl = max(-MOTOR_SPEED_LIMIT, min(MOTOR_SPEED_LIMIT, vl))
            vr = max(-MOTOR_SPEED_LIMIT, min(MOTOR_SPEED_LIMIT, vr))
        self.steps_left += vl * dt
        self.steps_right += vr * dt
        v = (vl + vr) / 2 * MM_PER_STEP
        self.omega = (vr - vl) * MM_PER_STEP / AXLE_MM
        self.theta = (self.theta + self.omega * dt) % (2 * math.pi)
        nx = self.x + v * math.cos(self.theta) * dt
        ny = self.y + v * math.sin(self.theta) * dt
        r = ROBOT_RADIUS_MM
        nx = min(max(nx, r), self.arena_mm - r)  # walls stop the body; the wheels slip and keep counting
        ny = min(max(ny, r), self.arena_mm - r)
        ox, oy, orad = self.obstacle
        d = math.hypot(nx - ox, ny - oy)
        if d < orad + r:
            k = (orad + r) / max(d, 1e-6)
            nx, ny = ox + (nx - ox) * k, oy + (ny - oy) * k
        self.x, self.y = nx, ny

    # -- sensing --------------------------------------------------------------------------------
    def ray(self, angle: float) -> float:
        """Distance from the robot's centre to the first surface along `angle` (world frame)."""
        dx, dy = math.cos(angle), math.sin(angle)
        ts = []
        if dx > 1e-9:
            ts.append((self.arena_mm - self.x) / dx)
        elif dx < -1e-9:
            ts.append(-self.x / dx)
        if dy > 1e-9:
            ts.append((self.arena_mm - self.y) / dy)
        elif dy < -1e-9:
            ts.append(-self.y / dy)
        t = min(ts)
        ox, oy, orad = self.obstacle
        fx, fy = self.x - ox, self.y - oy
        b = fx * dx + fy * dy
        c = fx * fx + fy * fy - orad * orad
        disc = b * b - c
        if disc >= 0:
            t1 = -b - math.sqrt(disc)
            if 0 <= t1 < t:
                t = t1
        return t

    def _reflected(self) -> list[int]:
        out = []
        for a in PROX_ANGLES:
            d = max(0.0, self.ray(self.theta + a) - ROBOT_RADIUS_MM)
            out.append(PROX_BASE + int(3500 * math.exp(-d / 12.0)))
        return out

    def proximity(self) -> list[int]:
        return [max(0, v - c) for v, c in zip(self._reflected(), self.calibration, strict=True)]

    def tof_mm(self) -> int:
        return int(min(2000.0, max(0.0, self.ray(self.theta) - ROBOT_RADIUS_MM)))

    def sensors(self, mag_x_override: float | None = None) -> EpuckRawSensors:
        g = int(ACC_COUNTS_PER_G)
        gyro_z = int(max(-32768, min(32767, math.degrees(self.omega) * 131.0)))
        mag = (20.0 * math.sin(self.theta), 20.0 * math.cos(self.theta), -40.0)
        if mag_x_override is not None:
            mag = (mag_x_override, mag[1], mag[2])
        ambient = tuple(int(3000 + 600 * math.cos(self.theta + a)) for a in PROX_ANGLES)
        mic = (200, 200, 200, 200) if self.sound else (12, 14, 11, 13)

        def i16(v: float) -> int:
            return (round(v) + 0x8000) % 0x10000 - 0x8000  # the int32 counter truncated

        return EpuckRawSensors(
            acc=(0, 0, g), acceleration=float(g), orientation=0.0, inclination=0.0, gyro=(0, 0, gyro_z),
            mag=mag, temperature=27, proximity=tuple(self.proximity()), ambient=ambient,
            tof=self.tof_mm(), mic=mic, steps=(i16(self.steps_left), i16(self.steps_right)), battery=3400,
            sd_state=1, tv_toggle=0, tv_address=0, tv_data=0, selector=15, ground_proximity=(800, 810, 820),
            ground_ambient=(900, 905, 910), button=0, reserved=0)

    def camera(self) -> bytes:
        """The 38400-byte big-endian RGB565 picture the robot would see from its pose."""
        return render(self.x, self.y, self.theta, self.arena_mm, self.obstacle)


_COLS = np.arange(IMAGE_WIDTH, dtype=np.float64)
_ROWS = np.arange(IMAGE_HEIGHT, dtype=np.float64)[:, None]
_FOCAL = (IMAGE_WIDTH / 2) / math.tan(CAMERA_FOV / 2)


def render(x: float, y: float, theta: float, arena: float,
           obstacle: tuple[float, float, float]) -> bytes:
    rel = CAMERA_FOV / 2 - _COLS / (IMAGE_WIDTH - 1) * CAMERA_FOV  # column 0 looks left
    ang = theta + rel
    dx, dy = np.cos(ang), np.sin(ang)
    with np.errstate(divide="ignore", invalid="ignore"):
        tx = np.where(dx > 1e-9, (arena - x) / dx, np.where(dx < -1e-9, -x / dx, np.inf))
        ty = np.where(dy > 1e-9, (arena - y) / dy, np.where(dy < -1e-9, -y / dy, np.inf))
    hit_x = tx < ty
    t = np.where(hit_x, tx, ty)
    wall = np.where(hit_x, np.where(dx > 0, 0, 2), np.where(dy > 0, 1, 3))
    along = np.where(hit_x, y + t * dy, x + t * dx)
    stripe = (np.floor(along / 100.0).astype(np.int64) % 2)
    color: npt.NDArray[np.uint16] = WALL_COLORS[wall, stripe]
    ox, oy, orad = obstacle
    fx, fy = x - ox, y - oy
    b = fx * dx + fy * dy
    disc = b * b - (fx * fx + fy * fy - orad * orad)
    t_obs = np.where(disc >= 0, -b - np.sqrt(np.maximum(disc, 0.0)), np.inf)
    obs = (t_obs >= 0) & (t_obs < t)
    t = np.where(obs, t_obs, t)
    color = np.where(obs, np.uint16(OBSTACLE_COLOR), color).astype(np.uint16)
    perp = np.maximum(t * np.cos(rel), 1.0)
    half = np.minimum(_FOCAL * WALL_HALF_HEIGHT_MM / perp, IMAGE_HEIGHT / 2)
    mid = IMAGE_HEIGHT / 2
    img = np.where(np.less(_ROWS, mid - half), np.uint16(CEILING),
                   np.where(np.less(_ROWS, mid + half), color[None, :], np.uint16(FLOOR)))
    return img.astype(">u2").tobytes()


def initial_world(index: int) -> EpuckWorld:
    """Different start poses so the robots' pictures differ."""
    return EpuckWorld(x=200.0 + 60.0 * (index % 10), y=200.0 + 50.0 * (index // 10), theta=0.7 * index % (2 * math.pi))
