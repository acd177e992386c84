"""Simulated robots run together: `SimRobots`, several robots started and stopped on one asyncio loop, and
`SimThread`, such a group on a loop of its own in a daemon thread (tests and benchmarks talk to the robots from
their own thread; `call` runs a function on the robots' loop). One harness for every kind of simulated robot."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, Self, TypeVar

T = TypeVar("T")


class SimRobot(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


R = TypeVar("R", bound=SimRobot)


class SimRobots(Generic[R]):
    """Several simulated robots on one asyncio loop."""

    def __init__(self, robots: list[R]) -> None:
        self.robots = robots

    async def start(self) -> None:
        for r in self.robots:
            await r.start()

    async def stop(self) -> None:
        for r in self.robots:
            await r.stop()


class SimThread(Generic[R]):
    """Tests and benchmarks: simulated robots on their own loop in a daemon thread."""

    def __init__(self, sim: SimRobots[R], name: str) -> None:
        self.sim = sim
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    @property
    def robots(self) -> list[R]:
        return self.sim.robots

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.sim.start(), self.loop).result(10)
        return self

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the robots' loop, its result here."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def run(self, coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """`await coro_fn()` on the robots' loop, its result here."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.sim.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
