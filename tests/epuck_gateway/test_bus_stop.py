"""The bus-wide software stop (docs/kit.md "Stopping everything") through the gateway process, on both links:

- the stop reaches every robot's wire at once (the simulators time-stamp the stop's bytes as they arrive): a WiFi
  robot whose queue of untaken commands is full and whose cycle is 2 s long gets it before its next cycle, a
  Bluetooth robot (115200 baud, camera on) too; the node's answer carries when it left, the health says `stopped`;
- while the stop is active, motion commands (set_speed, obstacle_avoidance, an ASCII `D`) are refused with
  `stopped` and send nothing; read-only commands work; the release moves nothing, a new command does;
- an ASCII `D` waiting for its slot on the serial line when the stop comes is dropped, never written;
- every robot's stop is written in one pass on the loop, WiFi robots first, each robot once;
- a gateway that starts while the stop is active comes up stopped;
- the simulators' stop watch, armed from the command line (SIGUSR2), prints the time the stop arrived, the time its
  bytes reached the robot's socket, however late the simulator's loop reads them.

Each test has its own topic root: a stop is per root, and no other test may see it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from services.epuck_gateway.protocol.wifi import EpuckCommand
from services.epuck_gateway.sim.serial import EpuckSerialSimConfig, EpuckSerialSimRobot, EpuckSerialSimThread
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimRobot, EpuckSimThread
from shared.messages import StopState
from shared.rpc import Reply, RpcClient
from shared.stop import answer_topic, stop_topic
from tests.epuck_gateway.conftest import GATEWAY, BusRecorder, wait_until
from tests.fixtures import Broker, free_port

NODE = "epuck-stop-gw"
DEADLINE = 20.0  # generous: the machine is shared


class Site:
    """A topic root of the test's own on the session broker, a client on it, and what was published under it."""

    def __init__(self, broker: Broker) -> None:
        self.root = f"stoptest{uuid.uuid4().hex[:8]}"
        self.broker = broker
        self.client = RpcClient(broker.settings(topic_root=self.root), name="epuck-stop-test")
        self.client.connect()
        self.bus = BusRecorder()
        self.client.subscribe_before(f"{self.root}/#", self.bus.on)

    def set_stop(self, active: bool, reason: str = "e-puck test") -> StopState:
        stop = StopState(active=active, source="tester", reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def answer(self, stop: StopState, settled: bool = True) -> dict[str, Any] | None:
        """The node's answer to `stop`, once every device reported (`settled`)."""
        a = self.bus.latest_json(answer_topic(self.root, NODE))
        if a is None or a["stop_ts"] != stop.ts or a["active"] != stop.active:
            return None
        if settled and any(d["pending"] for d in a["devices"]):
            return None
        return a

    def wait_answer(self, stop: StopState) -> dict[str, Any]:
        assert wait_until(lambda: self.answer(stop), DEADLINE), self.bus.latest_json(answer_topic(self.root, NODE))
        a = self.answer(stop)
        assert a is not None
        return a

    def health(self, device: str) -> dict[str, Any] | None:
        return self.bus.latest_json(f"{NODE}/{device}/health")

    def call(self, device: str, command: str, payload: Any = None) -> Reply:
        return self.client.call(NODE, device, command, payload, timeout=10.0)

    def close(self) -> None:
        # the retained stop goes with the test (an empty retained message deletes it)
        self.client.session.publish_wait(stop_topic(self.root), b"", qos=1, retain=True)
        self.client.close()


def start_gateway(site: Site, spawn: Any, robots: list[dict[str, Any]], **env: str) -> Any:
    return spawn(GATEWAY, {"ROBOBUS_MQTT_URL": site.broker.url, "ROBOBUS_TOPIC_ROOT": site.root,
                           "ROBOBUS_NODE": NODE, "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots),
                           "ROBOBUS_HEALTH_INTERVAL_S": "1", "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3",
                           "ROBOBUS_EPUCK_MOTION_TIMEOUT_MS": "60000", **env})


def streaming(site: Site, proc: Any, *devices: str) -> None:
    for d in devices:
        assert site.bus.wait_json(f"{NODE}/{d}/health", lambda h: h["state"] == "streaming", timeout=DEADLINE), \
            proc.text()
    assert site.bus.wait_json(f"{NODE}/status", lambda s: s["online"], timeout=DEADLINE), proc.text()


def moving_commands(received: list[EpuckCommand], since: int) -> list[EpuckCommand]:
    return [c for c in list(received)[since:] if c.left or c.right]


def cycled(robot: EpuckSimRobot, cycles: int) -> bool:
    return robot.stats.cycles >= cycles


def refused_stopped(rep: Reply) -> bool:
    return rep.error is not None and rep.error["code"] == "stopped"


def test_the_stop_reaches_every_robot_at_once_and_holds_it_until_a_new_command(
        broker_session: Broker, spawn: Any, tmp_path: Path) -> None:
    fast = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    slow = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=0.5, image_holds_cycle=True)).start()
    bt = EpuckSerialSimThread(1, str(tmp_path / "ttyBT"), EpuckSerialSimConfig(selector=3, line_baud=115200)).start()
    wf, ws, sr = fast.robots[0], slow.robots[0], bt.robots[0]
    site = Site(broker_session)
    try:
        proc = start_gateway(site, spawn, [{"id": "fast", "host": "127.0.0.1", "port": wf.port},
                                           {"id": "slow", "host": "127.0.0.1", "port": ws.port},
                                           {"id": "bt", "transport": "serial", "port": sr.link, "baud": 115200}])
        streaming(site, proc, "fast", "slow", "bt")
        for dev in ("fast", "slow"):
            assert site.call(dev, "set_speed", {"left": 300, "right": 300}).ok
        assert site.call("bt", "ascii", {"line": "D,300,300"}).result["reply"] == "d"
        assert wait_until(lambda: wf.world.speed_left == 300 and ws.world.speed_left == 300, DEADLINE)
        assert sr.world.speed_left == 300
        # the slow robot (one cycle per 2 s image) has just taken set_speed: two changes fill its queue of
        # untaken commands, so a write that respected the queue would wait for its next cycle
        before = ws.stats.commands
        assert site.call("slow", "leds", {"led1": True}).ok and site.call("slow", "leds", {"led3": True}).ok
        assert wait_until(lambda: ws.stats.commands >= before + 2, DEADLINE)
        sent = {"fast": len(wf.stats.received), "slow": len(ws.stats.received)}
        sent_bt = len(sr.received)
        for r in (wf, ws, sr):
            r.stop_watch.arm()
        cycles = ws.stats.cycles
        stop = site.set_stop(True)

        # every robot's wire carries the stop, the slow robot's before its next cycle (2 s) ...
        assert wait_until(lambda: all(r.stop_watch.seen for r in (wf, ws, sr)), DEADLINE), proc.text()
        slow_seen = ws.stop_watch.seen
        assert slow_seen is not None
        assert slow_seen.ts - stop.ts < 1.0, (slow_seen.ts - stop.ts, cycles, ws.stats.cycles)
        # ... and they apply it (the slow one at that cycle)
        assert wait_until(lambda: all(r.world.speed_left == 0 and r.world.speed_right == 0 for r in (wf, ws, sr)),
                          DEADLINE)
        # the answer says when the stop left for each robot; the health says stopped, by whom and why
        answer = site.wait_answer(stop)
        devices = {d["device"]: d for d in answer["devices"]}
        assert set(devices) == {"fast", "slow", "bt"}, answer
        for d in devices.values():
            assert d["stopped"] and not d["error"] and d["written_ts"] is not None, d
            assert d["written_ts"] >= stop.ts - 0.5, (d, stop.ts)
        for dev in ("fast", "slow", "bt"):
            h = site.bus.wait_json(f"{NODE}/{dev}/health", lambda h: h["state"] == "stopped", timeout=DEADLINE)
            assert h is not None and h["details"]["stop"]["source"] == "tester", h
            assert "e-puck test" in h["error_message"]

        # motion commands are refused with `stopped` and send nothing
        for dev in ("fast", "slow"):
            assert refused_stopped(site.call(dev, "set_speed", {"left": 200, "right": 200}))
            assert refused_stopped(site.call(dev, "obstacle_avoidance", {"enabled": True}))
        assert refused_stopped(site.call("bt", "set_speed", {"left": 200, "right": 200}))
        rep = site.call("bt", "ascii", {"line": "D,200,200"})
        assert refused_stopped(rep), rep.raw
        assert "e-puck test" in rep.error["message"]  # type: ignore[index]
        lines = len(sr.lines)
        assert refused_stopped(site.call("bt", "ascii", {"line": "d,100,100"}))
        # read-only commands work: the state, the proximity line, the LEDs (not motion)
        assert site.call("fast", "stream", {}).result["left_speed"] == 0
        assert site.call("bt", "ascii", {"line": "N"}).result["reply"].startswith("n,")
        assert site.call("fast", "leds", {"led5": True}).ok
        assert wait_until(lambda: wf.world.leds & 0x04, DEADLINE)  # LED5 is bit 2
        assert [text for _, text in sr.lines[lines:]] == ["N"]  # the refused `d` never reached the robot
        assert wait_until(partial(cycled, wf, wf.stats.cycles + 5), DEADLINE)
        assert not moving_commands(list(wf.stats.received), sent["fast"])
        assert not moving_commands(list(ws.stats.received), sent["slow"])
        assert not moving_commands(sr.received, sent_bt)
        assert not wf.world.obstacle_avoidance and wf.world.speed_left == 0

        # the release moves nothing: the robots stay at 0 until a new command
        release = site.set_stop(False)
        answer = site.wait_answer(release)
        assert all(not d["stopped"] for d in answer["devices"]), answer
        assert site.bus.wait_json(f"{NODE}/fast/health", lambda h: h["state"] == "streaming", timeout=DEADLINE)
        assert wait_until(partial(cycled, wf, wf.stats.cycles + 10), DEADLINE)
        for r in (wf, ws, sr):
            assert r.world.speed_left == 0 and r.world.speed_right == 0, r.name
        assert not moving_commands(list(wf.stats.received), sent["fast"])
        assert not moving_commands(sr.received, sent_bt)
        assert site.call("fast", "set_speed", {"left": 150, "right": 150}).ok
        assert wait_until(lambda: wf.world.speed_left == 150, DEADLINE)
        assert site.call("bt", "ascii", {"line": "D,120,120"}).ok and sr.world.speed_left == 120
    finally:
        site.close()
        fast.close()
        slow.close()
        bt.close()


def stop_passes(text: str) -> list[dict[str, Any]]:
    """The gateway's "robots stopped in one pass" records (ROBOBUS_LOG_JSON=1)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{") and "robots stopped in one pass" in line:
            out.append(json.loads(line))
    return out


def test_every_robot_is_stopped_in_one_pass(broker_session: Broker, spawn: Any,
                                          tmp_path: Path) -> None:
    """Five WiFi robots and a Bluetooth one, all driving: the stop is one pass over every robot on the loop
    (services/epuck_gateway/stop_pass.py), the WiFi robots first (a serial write can wait for its line), each
    robot stamped as its stop left; every robot's wire carries it; the kit's own calls for the robots the pass
    covered write nothing more (the pass is the only one, and each robot's answer is that pass's time)."""
    wifi = EpuckSimThread(5, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    bt = EpuckSerialSimThread(1, str(tmp_path / "ttyBT"), EpuckSerialSimConfig(selector=3, line_baud=115200)).start()
    robots = {f"w{i}": r for i, r in enumerate(wifi.robots)}
    sr = bt.robots[0]
    every: list[EpuckSimRobot | EpuckSerialSimRobot] = [*robots.values(), sr]
    site = Site(broker_session)
    try:
        proc = start_gateway(site, spawn, [{"id": n, "host": "127.0.0.1", "port": r.port} for n, r in robots.items()]
                             + [{"id": "bt", "transport": "serial", "port": sr.link, "baud": 115200}],
                             ROBOBUS_LOG_JSON="1")
        streaming(site, proc, *robots, "bt")
        for n in robots:
            assert site.call(n, "set_speed", {"left": 200, "right": 200}).ok
        assert site.call("bt", "set_speed", {"left": 200, "right": 200}).ok
        assert wait_until(lambda: all(r.world.speed_left == 200 for r in every), DEADLINE)
        for r in every:
            r.stop_watch.arm()
        stop = site.set_stop(True, reason="one pass")
        assert wait_until(lambda: all(r.stop_watch.seen for r in every), DEADLINE), proc.text()
        answer = site.wait_answer(stop)
        written = {d["device"]: d["written_ts"] for d in answer["devices"]}
        assert set(written) == {*robots, "bt"} and all(w is not None for w in written.values()), answer
        # one pass, naming every robot once, WiFi first; each robot's time is the one its write in it took
        assert wait_until(lambda: stop_passes(proc.text()), DEADLINE), proc.text()
        passes = stop_passes(proc.text())
        assert len(passes) == 1, passes
        assert passes[0]["robots"] == [*robots, "bt"] and passes[0]["owed"] == [], passes[0]
        assert passes[0]["reason"] == "one pass"
        assert written["bt"] >= max(written[n] for n in robots), written
        for n, r in robots.items():
            seen = r.stop_watch.seen
            assert seen is not None and abs(seen.ts - written[n]) < 1.0, (n, seen, written[n])
        assert wait_until(lambda: all(r.world.speed_left == 0 for r in every), DEADLINE)
        assert proc.alive()
    finally:
        site.close()
        wifi.close()
        bt.close()


def test_an_ascii_d_waiting_for_its_slot_when_the_stop_comes_is_never_written(
        broker_session: Broker, spawn: Any, tmp_path: Path) -> None:
    """The robot answers one poll 2 s late (within the stale timeout, so the link waits for it): a `D` line sent
    meanwhile waits for the poller, and the stop comes while it waits."""
    serial = EpuckSerialSimThread(1, str(tmp_path / "ttyACM")).start()
    robot = serial.robots[0]
    site = Site(broker_session)
    try:
        proc = start_gateway(site, spawn, [{"id": "usb1", "transport": "serial", "port": robot.link}],
                             ROBOBUS_EPUCK_STALE_TIMEOUT_S="3")
        streaming(site, proc, "usb1")
        robot.late_s = 2.0
        serial.call(lambda: setattr(robot, "late_replies", 1))
        assert wait_until(lambda: robot.late_replies == 0, DEADLINE)  # a poll is out, its reply held back
        replies: list[Reply] = []
        t = threading.Thread(target=lambda: replies.append(site.call("usb1", "ascii",
                                                                       {"line": "D,200,200", "timeout_s": 5})))
        t.start()
        time.sleep(0.3)  # (ordering only: the line reaches the gateway and waits behind the late reply)
        stop = site.set_stop(True)
        t.join(DEADLINE)
        assert replies and refused_stopped(replies[0]), replies[0].raw if replies else "no reply"
        site.wait_answer(stop)
        assert wait_until(partial(cycled_serial, robot, robot.stats.chains + 10), DEADLINE)
        assert not any(text.upper().startswith("D") for _, text in robot.lines), robot.lines
        assert robot.world.speed_left == 0 and robot.world.speed_right == 0
    finally:
        site.close()
        serial.close()


def cycled_serial(robot: EpuckSerialSimRobot, chains: int) -> bool:
    return robot.stats.chains >= chains


def test_a_gateway_started_under_the_stop_comes_up_stopped(broker_session: Broker, spawn: Any,
                                                           tmp_path: Path) -> None:
    """Robots a previous client left driving (a robot keeps its last speeds without a client): the gateway that
    starts while the stop is active stops them with its first command, reports when, and refuses motion."""
    wifi = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=10)).start()
    usb = EpuckSerialSimThread(1, str(tmp_path / "ttyACM")).start()
    wr, sr = wifi.robots[0], usb.robots[0]
    site = Site(broker_session)
    try:
        for r in (wr, sr):
            r.world.speed_left = r.world.speed_right = 250
            r.stop_watch.arm()
        stop = site.set_stop(True, reason="maintenance")
        proc = start_gateway(site, spawn, [{"id": "wifi1", "host": "127.0.0.1", "port": wr.port},
                                           {"id": "usb1", "transport": "serial", "port": sr.link}])
        answer = site.wait_answer(stop)
        devices = {d["device"]: d for d in answer["devices"]}
        assert set(devices) == {"wifi1", "usb1"}, answer
        # the answer says when each stop left the gateway (into the robot's socket or pty); the simulators read
        # their bytes on a thread of their own, which a busy machine may run after the answer came: wait for it
        assert wait_until(lambda: all(r.stop_watch.seen for r in (wr, sr)), DEADLINE), \
            ([r.name for r in (wr, sr) if r.stop_watch.seen is None], answer, proc.text())
        for name, r in (("wifi1", wr), ("usb1", sr)):
            d = devices[name]
            assert d["stopped"] and not d["error"] and d["written_ts"] is not None, d
            seen = r.stop_watch.seen
            assert seen is not None and abs(d["written_ts"] - seen.ts) < 1.0, (d, seen)
        assert wait_until(lambda: wr.world.speed_left == 0 and sr.world.speed_left == 0, DEADLINE)
        for dev in ("wifi1", "usb1"):
            h = site.bus.wait_json(f"{NODE}/{dev}/health", lambda h: h["state"] == "stopped", timeout=DEADLINE)
            assert h is not None and h["details"]["stop"]["reason"] == "maintenance", h
            assert refused_stopped(site.call(dev, "set_speed", {"left": 100, "right": 100}))
        assert site.call("wifi1", "stream", {}).ok  # read-only
        assert not moving_commands(list(wr.stats.received), 0) and not moving_commands(sr.received, 0)
        assert proc.alive()
    finally:
        site.close()
        wifi.close()
        usb.close()


def test_the_simulator_prints_when_the_first_stop_arrived_after_sigusr2() -> None:
    """The WiFi simulator from the command line, as a benchmark runs it: SIGUSR2 arms every robot's stop watch,
    and the robot prints a `stop_seen` line at the first command with speeds 0 after it (not before)."""
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "services.epuck_gateway.sim", "--count", "1",
                            "--base-port", str(port)], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[2])
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert sim.stdout is not None
        for line in sim.stdout:
            if line.startswith("{"):
                lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: any("ready" in x for x in lines), DEADLINE)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(EpuckCommand(request=0, left=0, right=0).encode())  # a stop before the watch: not seen
            s.sendall(EpuckCommand(request=0, left=200, right=200).encode())
            assert s.recv(1) == b"\x03"
            os.kill(sim.pid, signal.SIGUSR2)
            assert wait_until(lambda: any("stop_watch_armed" in x for x in lines), DEADLINE)
            assert not any("stop_seen" in x for x in lines)
            s.sendall(EpuckCommand(request=0, left=0, right=0).encode())
            t_sent = time.time()
            assert wait_until(lambda: any("stop_seen" in x for x in lines), DEADLINE)
            seen = next(x["stop_seen"] for x in lines if "stop_seen" in x)
            assert seen["robot"] == "epuck1" and abs(seen["ts"] - t_sent) < 5.0, seen
            assert isinstance(seen["monotonic"], float)
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(10)
        reader.join(5)
    assert sum("stop_seen" in x for x in lines) == 1


def test_the_simulator_stamps_a_stop_with_its_arrival_not_when_its_loop_got_round_to_it() -> None:
    """One loop serves every simulated robot: a stop it reads late (here: its loop held up by a test) is stamped with
    the time its bytes reached the robot's socket (the kernel's), not when the loop read them; bytes that reached
    it before the watch was armed are not the watch's."""
    sim = EpuckSimThread(1, EpuckSimConfig(sensors_hz=50, image_fps=0)).start()
    robot = sim.robots[0]
    try:
        with socket.create_connection(("127.0.0.1", robot.port), timeout=10) as s:
            s.sendall(EpuckCommand(request=0, left=200, right=200).encode())
            assert s.recv(1) == b"\x03"  # the robot took its first command
            robot.stop_watch.arm()
            release = threading.Event()
            sim.loop.call_soon_threadsafe(release.wait, DEADLINE)  # the simulator's loop is held up
            t0 = time.time()
            s.sendall(EpuckCommand(request=0, left=0, right=0).encode())
            t1 = time.time()  # loopback: the bytes are in the robot's socket when sendall returns
            time.sleep(0.3)  # (ordering only: the loop is still held up)
            assert robot.stop_watch.seen is None
            release.set()
            assert wait_until(lambda: robot.stop_watch.seen is not None, DEADLINE)
            seen = robot.stop_watch.seen
            assert seen is not None and t0 <= seen.ts <= t1, (t0, seen, t1)
            # bytes that arrived before the watch was armed, read after: not this watch's stop
            release.clear()
            sim.loop.call_soon_threadsafe(release.wait, DEADLINE)
            taken = robot.stats.commands
            s.sendall(EpuckCommand(request=0, left=0, right=0).encode())
            time.sleep(0.3)  # (ordering only: the bytes are in, the loop still held up)
            robot.stop_watch.arm()
            release.set()
            assert wait_until(lambda: robot.stats.commands > taken, DEADLINE)
            assert robot.stop_watch.seen is None and robot.stop_watch.armed
            s.sendall(EpuckCommand(request=0, left=0, right=0).encode())
            assert wait_until(lambda: robot.stop_watch.seen is not None, DEADLINE)
    finally:
        sim.close()


def test_the_serial_simulator_sees_every_kind_of_stop(tmp_path: Path) -> None:
    """-0x09 with speeds 0 (not a step-counter write), binary -D 0,0, ASCII `S` and `D,0,0`: each is the stop."""
    from services.epuck_gateway.protocol.asercom import encode_chain, set_all_actuators

    sim = EpuckSerialSimThread(1, str(tmp_path / "tty")).start()
    r = sim.robots[0]
    try:
        def feed(data: bytes) -> None:
            sim.call(lambda: r.inject_input(data))

        moving = EpuckCommand(request=0, left=100, right=100)
        steps0 = EpuckCommand(request=0, settings=0x04, left=0, right=0)
        cases = [encode_chain([set_all_actuators(EpuckCommand(request=0, left=0, right=0))]),
                 bytes([0x100 - ord("D")]) + b"\x00\x00\x00\x00\x00", b"S\r", b"D,0,0\r"]
        for case in cases:
            r.stop_watch.arm()
            feed(encode_chain([set_all_actuators(moving)]) + encode_chain([set_all_actuators(steps0)]) + b"E\r")
            assert r.stop_watch.seen is None
            feed(case)
            assert r.stop_watch.seen is not None, case
    finally:
        sim.close()
