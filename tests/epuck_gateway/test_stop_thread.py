"""The bus stop is written to every WiFi robot from the kit's stop thread, ahead of whatever the gateway's loop has
queued (services/epuck_gateway/transport/wifi.py `write_stop_from_thread`): after a stalled broker the loop drains
hundreds of commands and packets, and a stop that waited for the loop's pass reached the last of 20 robots up to
100 ms late (bench/stop.py --stall broker). The gateway runs here in the test's process, its loop on a thread of
its own, so that the test can hold that loop while the stop comes."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from services.epuck_gateway.api import API
from services.epuck_gateway.service import EpuckGateway, build
from services.epuck_gateway.settings import EpuckSettings
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimThread
from shared import Node
from shared.lifecycle import apply_process_settings
from shared.messages import StopState
from shared.rpc import RpcClient
from shared.stop import answer_topic, stop_topic
from tests.epuck_gateway.conftest import BusRecorder, wait_until
from tests.fixtures import Broker

NODE = "epuck-thread-gw"
DEADLINE = 20.0  # generous: the machine is shared
ROBOTS = 3


@dataclass
class InProcess:
    """The gateway's node and service on an asyncio loop in a thread (what run_service does, minus the process),
    its simulated robots, and a client on the test's own topic root."""

    gateway: EpuckGateway
    node: Node
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    task: asyncio.Future[None]
    sims: EpuckSimThread
    client: RpcClient
    bus: BusRecorder
    root: str

    def set_stop(self, active: bool, reason: str) -> StopState:
        stop = StopState(active=active, source="tester", reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def answer(self, stop: StopState) -> dict[str, Any] | None:
        a = self.bus.latest_json(answer_topic(self.root, NODE))
        if a is None or a["stop_ts"] != stop.ts or any(d["pending"] for d in a["devices"]):
            return None
        return a


@pytest.fixture
def gw(broker_session: Broker) -> Iterator[InProcess]:
    sims = EpuckSimThread(ROBOTS, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    root = f"stopthread{uuid.uuid4().hex[:8]}"
    settings = EpuckSettings(
        mqtt_url=broker_session.url, topic_root=root, node=NODE, health_interval_s=1.0,
        epuck_motion_timeout_ms=60000,
        epuck_robots=[{"id": f"w{i}", "host": "127.0.0.1", "port": r.port} for i, r in enumerate(sims.robots)])
    client = RpcClient(broker_session.settings(topic_root=root), name="epuck-stop-thread-test")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"{root}/#", bus.on)
    node = Node(API, settings)
    apply_process_settings(settings)  # as run_service does (the switch interval)
    gateway = build(node, settings)
    loop = asyncio.new_event_loop()
    node.attach_loop(loop)
    started = threading.Event()
    box: list[asyncio.Future[None]] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            node.start()
            box.append(asyncio.ensure_future(gateway.serve()))
            started.set()
            try:
                await box[0]
            except asyncio.CancelledError:
                pass

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="epuck-gateway-loop", daemon=True)
    thread.start()
    assert started.wait(10)
    g = InProcess(gateway, node, loop, thread, box[0], sims, client, bus, root)
    try:
        for i in range(ROBOTS):
            assert bus.wait_json(f"{NODE}/w{i}/health", lambda h: h["state"] == "streaming", timeout=DEADLINE)
        assert node.stop_latch.known_event.wait(DEADLINE)
        yield g
    finally:
        client.session.publish_wait(stop_topic(root), b"", qos=1, retain=True)
        loop.call_soon_threadsafe(g.task.cancel)
        thread.join(10)
        node.stop("shutdown", hooks=False)
        client.close()
        sims.close()
        loop.close()


def test_every_wifi_robot_gets_the_stop_while_the_gateways_loop_is_held(gw: InProcess) -> None:
    """Order-based: the loop is held when the stop comes; every robot's wire has the stop (the simulator stamps
    its bytes on arrival) before the loop is let go. Then the loop's pass writes it again and the answer reports
    the time the first write left; every robot ends at speed 0."""
    for i in range(ROBOTS):
        assert gw.client.call(NODE, f"w{i}", "set_speed", {"left": 300, "right": 300}, timeout=10).ok
    robots = gw.sims.robots
    assert wait_until(lambda: all(r.world.speed_left == 300 for r in robots), DEADLINE)
    for r in robots:
        r.stop_watch.arm()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(DEADLINE + 5)

    gw.loop.call_soon_threadsafe(hold)
    try:
        assert held.wait(DEADLINE)
        stop = gw.set_stop(True, "loop held")
        assert wait_until(lambda: all(r.stop_watch.seen for r in robots), DEADLINE), \
            [r.stop_watch.seen for r in robots]
        assert not release.is_set()  # the loop was held all along: none of these writes was the loop's
    finally:
        release.set()
    assert wait_until(lambda: gw.answer(stop), DEADLINE), gw.bus.latest_json(answer_topic(gw.root, NODE))
    a = gw.answer(stop)
    assert a is not None
    written = {d["device"]: d for d in a["devices"]}
    for i, r in enumerate(robots):
        d, seen = written[f"w{i}"], r.stop_watch.seen
        assert d["stopped"] and d["error"] == "" and seen is not None, d
        assert abs(d["written_ts"] - seen.ts) < 1.0, (d, seen)  # the thread's write, not the pass's
    assert all(r.link.thread_stops == 1 for r in gw.gateway.robots)
    assert wait_until(lambda: all(r.world.speed_left == 0 and r.world.speed_right == 0 for r in robots), DEADLINE)


def test_a_robot_whose_socket_holds_half_a_command_of_the_loops_gets_the_stop_from_the_pass(gw: InProcess) -> None:
    """The thread never writes into a command the loop left half written (bytes waiting in the transport's
    buffer): that robot's stop is the loop's pass's, written after those bytes; the others' are the thread's."""
    robots = gw.sims.robots
    link = gw.gateway.robots[0].link
    transport = link._transport
    assert transport is not None
    real = transport.get_write_buffer_size
    setattr(transport, "get_write_buffer_size", lambda: 7)  # noqa: B010 (as if 7 bytes were waiting)
    try:
        for r in robots:
            r.stop_watch.arm()
        stop = gw.set_stop(True, "half a command")
        assert wait_until(lambda: all(r.stop_watch.seen for r in robots), DEADLINE)
        assert wait_until(lambda: gw.answer(stop), DEADLINE)
    finally:
        setattr(transport, "get_write_buffer_size", real)  # noqa: B010
    assert link.thread_stops == 0
    assert [r.link.thread_stops for r in gw.gateway.robots[1:]] == [1] * (ROBOTS - 1)
    a = gw.answer(stop)
    assert a is not None and all(d["stopped"] for d in a["devices"]), a
