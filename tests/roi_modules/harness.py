"""The service in this process on its own asyncio loop (a thread), the simulator beside it, a bus recorder."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt

from services.roi_modules.api import API
from services.roi_modules.service import RoiService, build
from services.roi_modules.settings import RoiSettings
from services.roi_modules.sim import RoiSim, SimModuleSpec
from shared import Node
from shared.lifecycle import apply_process_settings
from shared.rpc import RpcClient
from tests.fixtures import Broker
from tests.roi_modules.conftest import fresh_prefix, wait_until

NODE = "roi-modules"
_rigs = itertools.count()


@dataclass
class Recorded:
    topic: str
    payload: bytes
    retained: bool


@dataclass
class BusRecorder:
    messages: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append(Recorded(msg.topic, bytes(msg.payload), bool(msg.retain)))

    def mark(self) -> int:
        with self.lock:
            return len(self.messages)

    def since(self, mark: int, suffix: str) -> list[Recorded]:
        with self.lock:
            return [m for m in self.messages[mark:] if m.topic.endswith(suffix)]

    def latest(self, suffix: str, since: int = 0) -> dict[str, Any] | None:
        found = self.since(since, suffix)
        return json.loads(found[-1].payload) if found else None

    def wait(self, suffix: str, pred: Callable[[dict[str, Any]], bool], since: int = 0,
             timeout: float = 15.0) -> dict[str, Any] | None:
        def check() -> dict[str, Any] | None:
            for m in reversed(self.since(since, suffix)):
                data = json.loads(m.payload)
                if pred(data):
                    return data  # type: ignore[no-any-return]
            return None
        return wait_until(check, timeout)  # type: ignore[no-any-return]


class ServiceThread:
    """Node + RoiService on an asyncio loop in a thread: what run_service does, minus the process."""

    def __init__(self, settings: RoiSettings, bus_delay_s: float = 0.0) -> None:
        self.settings = settings
        self.bus_delay_s = bus_delay_s  # connect to the broker this long after the modules are served
        self.node = Node(API, settings)
        apply_process_settings(settings)  # as run_service does before build (the switch interval)
        self.svc: RoiService = build(self.node, settings)
        self.loop = asyncio.new_event_loop()
        self.node.attach_loop(self.loop)
        self._task: asyncio.Future[None] | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="roi-service", daemon=True)
        self.thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self._done = asyncio.Event()
            if not self.bus_delay_s:
                self.node.start()
            self._task = asyncio.ensure_future(self.svc.serve())
            self._ready.set()
            if self.bus_delay_s:  # a slow broker connection: the modules answer (and are pulled) first
                await asyncio.sleep(self.bus_delay_s)
                self.node.start()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            await self._done.wait()  # the loop stays up for shutdown(), as the kit's runner keeps it

        self.loop.run_until_complete(main())

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """The kit's order: serve() cancelled, shutdown() (stop motors) on the loop, offline status."""
        try:
            if self._task is not None:
                self.loop.call_soon_threadsafe(self._task.cancel)
            self.call(self.svc.shutdown(), 10)
        finally:
            self.loop.call_soon_threadsafe(self._done.set)
            self.thread.join(10)
            self.node.stop("shutdown", hooks=False)


@dataclass
class Rig:
    sim: RoiSim
    service: ServiceThread
    client: RpcClient
    bus: BusRecorder
    node: str

    def call(self, device: str, command: str, payload: Any = None, timeout: float = 15.0) -> Any:
        return self.client.call(self.node, device, command, payload, timeout=timeout)

    def close(self) -> None:
        self.service.stop()
        self.client.close()
        self.sim.close()


DEFAULT_MODULES: list[dict[str, Any]] = [
    {"name": "io", "octet": 10, "type": "gpio"},
    {"name": "wheel", "octet": 20, "type": "odrive", "max_velocity": 20.0},
    {"name": "arm", "octet": 30, "type": "actuator"},
]


def make_rig(broker: Broker, modules: list[dict[str, Any]] | None = None,
             sim_modules: list[SimModuleSpec] | None = None, sim: RoiSim | None = None, bus_delay_s: float = 0.0,
             root: str = "robobus", **settings: Any) -> Rig:
    """The service beside simulated modules, returned once the node is online on the bus.

    Online means its birth (the retained `status`) was seen: the kit publishes it only after the broker has
    acknowledged the command subscription. Before that a command is dropped by the broker, unanswered (issue
    #11: a test that waited only for the modules' side commanded a node whose subscription was not in yet).
    It also waits until the node has read the bus stop of its `root` (motion commands are `unavailable` before).
    A test that sets the stop gives the rig a root of its own: the stop is retained, per root."""
    modules = modules or DEFAULT_MODULES
    if sim is None:
        specs = sim_modules or [SimModuleSpec(m["octet"], m["type"]) for m in modules]
        sim = RoiSim(fresh_prefix(), specs, seed=3).start()
    node = f"{NODE}-{next(_rigs)}"  # rigs alive at once must not answer each other's commands
    kw: dict[str, Any] = {"node": node, "mqtt_url": broker.url, "roi_network": sim.prefix, "roi_modules": modules,
                          "roi_status_every": 10, "health_interval_s": 1.0, "topic_root": root, **settings}
    client = RpcClient(broker.settings(topic_root=root), name="roi-tests")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"{root}/{node}/#", bus.on)
    service = ServiceThread(RoiSettings(**kw), bus_delay_s)
    rig = Rig(sim, service, client, bus, node)
    if bus.wait("/status", lambda d: d["online"] is True, timeout=20) is None:
        rig.close()
        raise AssertionError(f"node {node} did not come online on the bus within 20 s")
    if not service.node.stop_latch.known_event.wait(20):
        rig.close()
        raise AssertionError(f"node {node} did not read the bus stop within 20 s")
    return rig
