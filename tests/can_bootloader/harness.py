"""A discrete-event bench for the sans-I/O flasher: the BootBoard model, a fake clock, a fixed latency.
No threads, no sleeps: deterministic, and fast enough for hypothesis."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from services.can_bootloader import protocol as p
from services.can_bootloader.flasher import Exchange, Flasher
from services.can_bootloader.sim import BootBoard


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Wire:
    boards: list[BootBoard]
    latency: float = 0.001
    clock: Clock = field(default_factory=Clock)
    sent: list[p.BootFrame] = field(default_factory=list)
    extra: list[p.BootFrame] = field(default_factory=list)  # garbage injected before each reply
    drop_replies: set[int] = field(default_factory=set)  # indices (in reply order) of answers lost on the wire
    replies_seen: int = 0
    # The palm's CAN bridge: one frame each way per EtherCAT cycle (its 12-byte CAN struct in the command and in
    # the status), `latency` on top for MQTT. None: a direct bus (every frame after `latency`).
    cycle: float | None = None
    _slot: dict[str, float] = field(default_factory=lambda: {"down": 0.0, "up": 0.0})

    def __post_init__(self) -> None:
        for b in self.boards:
            b.clock = self.clock
            b.power_on()

    def run(self, machine: Flasher | Exchange, limit_s: float = 600.0) -> None:
        seq = itertools.count()
        heap: list[tuple[float, int, str, p.BootFrame]] = []
        if isinstance(machine, Flasher) and machine.phase.value == "idle":
            machine.start(self.clock.t)
        end = self.clock.t + limit_s
        idle = 0
        while not machine.done:
            assert self.clock.t < end, "simulation ran too long"
            for fr in machine.poll(self.clock.t):
                self.sent.append(fr)
                heapq.heappush(heap, (self._when("down", self.clock.t + self.latency), next(seq), "down", fr))
            while heap and heap[0][0] <= self.clock.t:
                _, _, kind, fr = heapq.heappop(heap)
                if kind == "down":
                    for b in self.boards:
                        for r in b.handle(fr.sid, fr.data):
                            at = self._when("up", self.clock.t + r.delay_s) + self.latency
                            heapq.heappush(heap, (at, next(seq), "up", p.BootFrame(r.sid, r.data)))
                else:
                    self.replies_seen += 1
                    if self.replies_seen - 1 in self.drop_replies:
                        continue
                    for g in self.extra:
                        machine.receive(g, self.clock.t)
                    machine.receive(fr, self.clock.t)
            machine.tick(self.clock.t)
            if machine.done:
                break
            nxt = [t for t in (heap[0][0] if heap else None, machine.deadline()) if t is not None]
            if not nxt:
                # nothing in flight and no deadline: the machine sends on the next turn, or it is stuck
                idle += 1
                assert idle < 3, "machine stalled"
                continue
            idle = 0
            self.clock.t = max(self.clock.t, min(nxt))

    def _when(self, way: str, t: float) -> float:
        """When a frame ready at `t` crosses: at once on a direct bus; through the palm, at the next free cycle
        boundary of its direction (one frame per cycle)."""
        if self.cycle is None:
            return t
        c = self.cycle
        slot = max(-(-t // c) * c, self._slot[way] + c)
        self._slot[way] = slot
        return slot
