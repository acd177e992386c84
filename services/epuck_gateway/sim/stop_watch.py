"""The bus stop's time to a simulated robot's wire (benchmarks and tests): once armed, a robot records the first stop
it receives, when its bytes arrive (WiFi: the kernel's arrival time of the read that carried it, see wifi.py;
serial: when the pty's bytes are read, before a reply in progress lets the F407 read them). Armed in code with
`robot.stop_watch.arm()`; the command line (__main__.py) arms every robot on SIGUSR2 and prints one
`{"stop_seen": {"robot", "ts" (Unix time), "monotonic" (CLOCK_MONOTONIC, comparable across processes)}}` per robot."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopSeen:
    robot: str
    ts: float  # time.time() the stop's bytes arrived
    monotonic: float  # time.monotonic() of the same moment (CLOCK_MONOTONIC: one clock for every process)

    def to_json(self) -> str:
        return json.dumps({"stop_seen": {"robot": self.robot, "ts": self.ts, "monotonic": self.monotonic}})


class StopWatch:
    """The first stop a simulated robot receives after `arm()`: the bus stop's time to the wire, for benchmarks
    and tests. `seen` stays None until then; `listener` (if set) is told once, on the simulator's thread."""

    def __init__(self, robot: str) -> None:
        self.robot = robot
        self.armed = False
        self.armed_at = 0.0
        self.seen: StopSeen | None = None
        self.listener: Callable[[StopSeen], None] | None = None

    def arm(self) -> None:
        self.seen = None
        self.armed_at = time.time()
        self.armed = True

    def received(self, left: int, right: int, arrived: float | None = None) -> None:
        """Bytes that set these wheel speeds have arrived: now, or at `arrived` (Unix time) when known. Bytes that
        arrived before the watch was armed (read late) are not its business."""
        if arrived is not None and arrived < self.armed_at:
            return
        if self.armed and left == 0 and right == 0:
            self.armed = False
            unix, mono = time.time(), time.monotonic()
            at = unix if arrived is None else min(arrived, unix)
            self.seen = StopSeen(self.robot, at, mono - (unix - at))
            if self.listener is not None:
                self.listener(self.seen)
