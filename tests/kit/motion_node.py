"""A small service with motion devices, to test the bus stop (shared/stop.py): a motion command, a read-only one,
a slow motion command (to race the stop), a motion job that drives until cancelled, and stop actions that record
when and on which thread they ran. Run on its own: python -m tests.kit.motion_node (ROBOBUS_MQTT_URL=...)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from shared import JobContext, KitSettings, Node, ServiceAPI, load_settings
from shared.logs import setup_logging
from shared.messages import StopState
from shared.stop import LATER


class MotionMove(BaseModel):
    speed: float = Field(ge=-10, le=10)
    hold_s: float = Field(0.0, ge=0, le=5, description="Keep the handler running this long after the write")


class MotionSpeed(BaseModel):
    speed: float


class MotionNothing(BaseModel):
    pass


class MotionDriveResult(BaseModel):
    ticks: int


API = ServiceAPI("motion-test", device_doc="a test device that moves")
MOVE = API.command("move", MotionMove, MotionSpeed, doc="Set the speed (moves)", motion=True)
READ = API.command("read", MotionNothing, MotionSpeed, doc="Read the speed (read-only)")
DRIVE = API.job("drive", MotionMove, MotionDriveResult, doc="Drive at a speed until cancelled", motion=True)
WHEEL = API.kind("wheel", commands=[MOVE, READ], jobs=[DRIVE], doc="A wheel: moves, reads, drives")
SENSOR = API.kind("sensor", commands=[READ], doc="Read-only: no motion command, no stop action")
MOVER = API.kind("mover", commands=[MOVE], doc="Moves, nothing else (a stop action's test device)")


@dataclass
class Wheel:
    """The 'device': a speed, and every write to it (time, speed), as a deadman would see them."""

    name: str
    speed: float = 0.0
    writes: list[tuple[float, float]] = field(default_factory=list)
    stops: list[tuple[float, str, StopState]] = field(default_factory=list)  # (time, thread, stop)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, speed: float) -> float:
        with self.lock:
            self.speed = speed
            t = time.time()
            self.writes.append((t, speed))
            return t


def build(node: Node, devices: tuple[str, ...] = ("wheel1", "wheel2"), later: tuple[str, ...] = (),
          sensors: tuple[str, ...] = ("sensor1",)) -> dict[str, Wheel]:
    """Motion devices `devices` (those in `later` report their stop's write through `stop_written`), and
    read-only devices `sensors` (no motion command, no stop action)."""
    wheels: dict[str, Wheel] = {}
    for name in devices:
        dev = node.device(name, kind=WHEEL.name)
        wheel = wheels[name] = Wheel(name)

        def move(r: MotionMove, wheel: Wheel = wheel) -> MotionSpeed:
            wheel.write(r.speed)
            if r.hold_s:
                time.sleep(r.hold_s)
            return MotionSpeed(speed=wheel.speed)

        def read(r: MotionNothing, wheel: Wheel = wheel) -> MotionSpeed:
            return MotionSpeed(speed=wheel.speed)

        def drive(r: MotionMove, job: JobContext, wheel: Wheel = wheel) -> MotionDriveResult:
            ticks = 0
            while not job.wait(0.01):
                wheel.write(r.speed)
                ticks += 1
            job.check_cancelled()
            return MotionDriveResult(ticks=ticks)

        def stop_now(stop: StopState, wheel: Wheel = wheel, dev: Any = dev, name: str = name) -> Any:
            wheel.stops.append((time.time(), threading.current_thread().name, stop))
            written = wheel.write(0.0)
            if name in later:  # as a deadman that confirms the write from the device's side, a little later
                threading.Timer(0.3, dev.stop_written, args=(written,)).start()
                return LATER
            return written

        dev.bind(MOVE, move)
        dev.bind(READ, read)
        dev.bind_job(DRIVE, drive)
        dev.on_stop(stop_now)
        dev.set_health(connection=True, operational=True, state="running")
    for name in sensors:
        dev = node.device(name, kind=SENSOR.name)
        dev.bind(READ, lambda r: MotionSpeed(speed=0.0))
        dev.set_health(connection=True, operational=True, state="running")
    return wheels


def main() -> None:
    settings = load_settings(KitSettings)
    setup_logging(settings.log_level, settings.log_json)
    node = Node(API, settings)
    build(node)
    node.run()


if __name__ == "__main__":
    main()
