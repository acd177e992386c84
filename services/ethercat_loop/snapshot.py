"""What the driver knows, as a picklable view (`PalmSnapshot`), and the one place that derives the
status-borne values of it (joints, raw sensors, tactiles, IMU, analog inputs, idle time) from a status:
the driver's own snapshot and the MQTT process's refresh of it from the raw status of every cycle
(transport.process_backend) both call `status_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.ethercat_loop.calibration import HandCalibration
from services.ethercat_loop.control import ControlMode
from services.ethercat_loop.protocol import EdcCommand, PalmStatus, s16


@dataclass(frozen=True)
class PalmMotorSnapshot:
    id: int
    joint: str | None
    torque: int | None
    demand: int  # the latest demand asked for (before expiry)
    demand_sent: int  # what the last demand cycle put on the wire
    flags: int | None
    flag_names: tuple[str, ...]
    serious: bool
    temperature: float | None  # °C
    current: float | None  # A
    voltage: float | None  # V
    pwm: int | None
    sgl: int | None
    sgr: int | None
    last_seen_ns: int | None
    missed: int  # polls without an answer
    data_errors: int
    slow: dict[str, int]
    last_config: tuple[int, int] | None
    can_received: int | None
    can_transmitted: int | None
    can_errors: tuple[int, int] | None  # (tx, rx)
    terms: dict[str, int]


@dataclass(frozen=True)
class PalmJointSnapshot:
    name: str
    position: float | None  # rad
    raw: tuple[int, ...]


@dataclass(frozen=True)
class PalmSnapshot:
    cycle: int
    now_ns: int
    protocol: str
    phase: str  # "init" | "operation"
    mode: ControlMode
    edc_command: int  # what we send
    edc_echo: int  # what the last good status echoed
    status_count: int
    can_direct: bool
    halted: bool
    nullified: bool
    joints: tuple[PalmJointSnapshot, ...]
    sensors_raw: tuple[int, ...]
    motors: tuple[PalmMotorSnapshot, ...]
    tactile_type: int
    tactile_valid: int
    tactile: tuple[tuple[int, ...], ...]
    tactile_mid_prox: tuple[tuple[int, ...], ...]  # 0230 only
    aux_spi_type: int  # 0230 only
    aux_spi: tuple[int, ...]  # 0230 only
    imu: tuple[int, ...]  # ACCX..GYRZ as int16s
    analog: tuple[int, ...]  # AN0..AN3
    idle_time_us: int
    counters: dict[str, int]


def calibrated_joints(cal: HandCalibration, sensors: tuple[int, ...]) -> tuple[PalmJointSnapshot, ...]:
    return tuple(PalmJointSnapshot(j.name, j.position, j.raw) for j in cal.joints(sensors))


def status_fields(st: PalmStatus, cal: HandCalibration | None,
                  joints: tuple[PalmJointSnapshot, ...] = ()) -> dict[str, Any]:
    """The snapshot fields a status carries. Joints are calibrated from a SENSOR_DATA status when `cal` is
    given; otherwise (test modes, CAN direct, or no calibration asked for) `joints` is kept."""
    sensors = st.sensors
    if cal is not None and st.edc_command == EdcCommand.SENSOR_DATA:
        joints = calibrated_joints(cal, sensors)
    return {"edc_echo": st.edc_command, "joints": joints, "sensors_raw": sensors,
            "tactile_type": st.tactile_data_type, "tactile_valid": st.tactile_data_valid, "tactile": st.tactile,
            "tactile_mid_prox": st.tactile_mid_prox, "aux_spi_type": st.aux_spi_data_type,
            "aux_spi": st.aux_spi_sensor, "imu": tuple(s16(v) for v in sensors[26:32]),
            "analog": tuple(sensors[32:36]), "idle_time_us": st.idle_time_us}
