"""The bus-wide software stop (docs/kit.md, "Stopping everything") on ethercat-loop, on the wire: the node's
realtime cycle (pysoem) -> veth -> the virtual hand, which stamps the first all-zero demand frame after it is
armed. The stop zeroes every demand from the next frame on and keeps sending zero demands (the original driver's
`nullify_demand`); demands, configs, jiggles and TO_MOTOR CAN frames are refused with `stopped` and nothing of them
reaches the palm; read-only commands and the mode switch answer; the release moves nothing (the demand held before
the stop is forgotten); a node that starts while the stop is active comes up stopped. Each test has a topic root of
its own (the stop is retained, per root). Root only (namespaces, raw sockets)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.ethercat_loop.driver import PalmDriver
from services.ethercat_loop.protocol import (
    CanDirection,
    PalmCommand,
    SystemControl,
    ToMotorDataType,
    make_sid,
    unpack_command,
)
from services.ethercat_loop.service import STOP_WRITE_GRACE_S
from services.ethercat_loop.sim.netns import VethNetns
from services.ethercat_loop.sim.virtual_hand import HandControl
from shared.messages import StopState
from shared.rpc import Reply, RpcClient
from shared.stop import answer_topic, stop_topic
from tests.ethercat_loop.wire_fixtures import hand, skip_without_netns, wait_for
from tests.fixtures import Broker, NodeProcess

DEV = "rh"
DEADLINE = 30.0  # generous: the machine is shared
_roots = itertools.count()
# the hand logs changes of the command's TO_MOTOR type and 20 demands only (0220: bytes 10..54), so that a window
# of frames is a handful of entries: a demand, a config or control, CAN direct mode (type INVALID) all show
WATCH = "10:44"


def decoded(hexcmd: str) -> PalmCommand:
    cmd = unpack_command(bytes.fromhex(hexcmd), "0220")
    assert isinstance(cmd, PalmCommand), cmd
    return cmd


class Bus:
    """Everything the node publishes, and a wait for a condition on the latest message of a topic."""

    def __init__(self, client: RpcClient, topic_filter: str) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.cond = threading.Condition()
        client.subscribe_before(topic_filter, self._on)

    def _on(self, msg: Any) -> None:
        try:
            data = json.loads(msg.payload)
        except ValueError:
            return
        with self.cond:
            self.latest[msg.topic] = data
            self.cond.notify_all()

    def wait(self, topic: str, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        end = time.monotonic() + DEADLINE
        with self.cond:
            while True:
                got = self.latest.get(topic)
                if got is not None and pred(got):
                    return got
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}: {got}")
                self.cond.wait(min(left, 0.2))


@dataclass
class Rig:
    root: str
    node: str
    client: RpcClient
    bus: Bus
    ctl: HandControl
    ns: VethNetns
    proc: NodeProcess
    unread: list[PalmCommand] = field(default_factory=list)  # logged commands not yet looked at by until_on_wire

    def call(self, cmd: str, payload: dict[str, Any] | None = None) -> Reply:
        return self.client.call(self.node, DEV, cmd, payload or {}, timeout=DEADLINE)

    def set_stop(self, active: bool, reason: str = "test") -> StopState:
        stop = StopState(active=active, source="tester", reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def answer(self, stop: StopState) -> dict[str, Any]:
        """The node's answer to `stop` once its device has reported."""
        return self.bus.wait(answer_topic(self.root, self.node),
                             lambda a: a["stop_ts"] == stop.ts and a["active"] == stop.active
                             and not any(d["pending"] for d in a["devices"]), "the node's stop answer")

    def health(self, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        return self.bus.wait(f"{self.root}/{self.node}/{DEV}/health", pred, what)

    def changes(self) -> list[tuple[int, int, str]]:
        """The hand's log of command changes (type and demands) since the last call."""
        out: list[tuple[int, int, str]] = []
        while True:
            got = self.ctl.call("changes", max=300)["changes"]
            out += [tuple(c) for c in got]  # type: ignore[misc]
            if len(got) < 300:
                return out

    def until_on_wire(self, pred: Callable[[PalmCommand], bool], what: str) -> list[PalmCommand]:
        """The commands (as logged) up to and including the first that satisfies `pred`."""
        seen: list[PalmCommand] = []
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            self.unread += [decoded(c[2]) for c in self.changes()]
            while self.unread:
                cmd = self.unread.pop(0)  # what comes after the match stays for the next call
                seen.append(cmd)
                if pred(cmd):
                    return seen
            time.sleep(0.01)
        raise AssertionError(f"never on the wire: {what}")

    def last_command(self) -> PalmCommand:
        return decoded(self.ctl.call("stats")["last_command"])


def demanding(cmd: PalmCommand) -> bool:
    return cmd.to_motor_data_type in (ToMotorDataType.DEMAND_TORQUE, ToMotorDataType.DEMAND_PWM)


def moving(cmd: PalmCommand) -> bool:
    return demanding(cmd) and any(cmd.motor_data)


def stop_known(rig: Rig) -> None:
    """Motion commands are `unavailable` until the node has read the bus stop (a round trip after its SUBACKs)."""
    def known() -> bool:
        rep = rig.call("set_demands", {"motors": {}})
        return rep.ok or (rep.error is not None and rep.error["code"] != "unavailable")
    wait_for(known, DEADLINE, "the node to read the bus stop")


@pytest.fixture
def rig_factory(broker_session: Broker, spawn: Any) -> Iterator[Callable[[Callable[[Rig], None] | None], Rig]]:
    """make(before_node): the hand on a veth pair, a topic root of its own, `before_node(rig)` (e.g. set the
    stop), then the node on the virtual backend, running."""
    skip_without_netns()
    rigs: list[Rig] = []
    stack: list[Any] = []

    def make(before_node: Callable[[Rig], None] | None = None) -> Rig:
        root = f"ecstop{os.getpid()}x{next(_roots)}/robobus"
        node = f"ecstop{os.getpid()}"
        cm = hand("0220", ["--watch", WATCH])
        ns, ctl = cm.__enter__()
        stack.append(cm)
        client = RpcClient(broker_session.settings(topic_root=root), name=f"ecstop-test-{os.getpid()}")
        client.connect()
        bus = Bus(client, f"{root}/{node}/#")
        rig = Rig(root, node, client, bus, ctl, ns, None)  # type: ignore[arg-type]
        rigs.append(rig)
        if before_node is not None:
            before_node(rig)
        env = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node, "ROBOBUS_TOPIC_ROOT": root,
               "ROBOBUS_ETHERCAT_BACKEND": "virtual", "ROBOBUS_ETHERCAT_IFNAME": ns.master_if,
               "ROBOBUS_ETHERCAT_NETNS": ns.name, "ROBOBUS_HEALTH_INTERVAL_S": "1",
               # a demand held 10 s: a stop that only paused it would let it come back
               "ROBOBUS_ETHERCAT_DEMAND_TIMEOUT_MS": "10000",
               # a busy shared machine loses frames: not under test here
               "ROBOBUS_ETHERCAT_OVERRUN_THRESHOLD": "1000000", "ROBOBUS_ETHERCAT_LOST_THRESHOLD": "1000000",
               "ROBOBUS_ETHERCAT_SILENT_MOTOR_MS": "600000"}
        rig.proc = spawn(["-m", "services.ethercat_loop"], env)
        rig.health(lambda h: h.get("connection") is True, f"{node} connected (log: {rig.proc.text()[-1500:]})")
        return rig

    try:
        yield make
    finally:
        for r in rigs:
            if r.proc is not None:
                r.proc.stop()
            r.client.session.publish_wait(stop_topic(r.root), b"", qos=1, retain=True)
            r.client.close()
        for cm in reversed(stack):
            cm.__exit__(None, None, None)


def test_the_stop_zeroes_every_demand_on_the_wire_refuses_motion_and_the_release_moves_nothing(
        rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory()
    stop_known(rig)
    assert rig.health(lambda h: h.get("operational") is True, "operational")["state"] != "stopped"
    rep = rig.call("set_demands", {"motors": {"3": 200, "13": -150}})
    assert rep.ok, rep.error
    rig.until_on_wire(lambda c: moving(c) and c.motor_data[3] == 200 and c.motor_data[13] == -150, "the demands")

    assert rig.ctl.call("watch_stop")["watching"] is True
    stop = rig.set_stop(True, "cell door open")
    a = rig.answer(stop)
    assert [d["device"] for d in a["devices"]] == [DEV]
    d = a["devices"][0]
    assert d["stopped"] and not d["pending"] and d["error"] == "", d
    stamp = wait_for(lambda: rig.ctl.call("stop_stamp")["stamp"], DEADLINE, "the hand's stop stamp")
    # the demands were on the wire until the stop, then an all-zero demand frame: the stop's
    assert stamp["moving_frames_before"] > 0, stamp
    assert stamp["unix"] >= stop.ts - 0.5, (stamp, stop.ts)
    # the deadman reports when the frame left the master, not when the stop was decided: the hand got it after
    assert d["written_ts"] is not None and abs(stamp["unix"] - d["written_ts"]) < 0.2, (d, stamp)
    # and zero demands keep being sent, every cycle
    frames = rig.ctl.call("stats")["pd_frames"]
    wait_for(lambda: rig.ctl.call("stats")["pd_frames"] > frames + 50, DEADLINE, "frames after the stop")
    last = rig.last_command()
    assert demanding(last) and not any(last.motor_data), last
    h = rig.health(lambda h: h.get("state") == "stopped", "health stopped")
    assert h["operational"] is False and h["error"] is False and "cell door open" in h["error_message"]
    assert h["details"]["stop"]["source"] == "tester" and h["connection"] is True

    # motion refused with `stopped`, typed and raw; nothing of it reaches the palm
    rig.changes()
    rig.unread.clear()
    refused: list[tuple[str, dict[str, Any]]] = [
        ("set_demands", {"motors": {"3": 100}}),
        ("set_motor_config", {"motors": [3], "torque_limit": 300}),
        ("system_controls", {"motors": [3], "jiggle": True}),
        ("send_can", {"bus": 1, "sid": make_sid(CanDirection.TO_MOTOR, 3, ToMotorDataType.DEMAND_PWM), "data": "6400",
                      "window_ms": 20})]
    for cmd, payload in refused:
        rep = rig.call(cmd, payload)
        assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", (cmd, rep)
        assert "cell door open" in rep.error["message"]
    # read-only commands answer, and the commands that move nothing (the mode, nullify, a backlash control, whose
    # frame marks the end of the window: the pipe is ordered, so a refused command's demand would be before it)
    rep = rig.call("test_adc_channels", {})
    assert rep.ok and rep.result["matches"] is True, rep
    assert rig.call("set_control_mode", {"mode": "pwm"}).ok  # the mode it is in: the held demands stay as they are
    assert rig.call("nullify_demands", {"enable": True}).ok
    assert rig.call("system_controls", {"motors": [3], "backlash": True}).ok
    window = rig.until_on_wire(lambda c: c.to_motor_data_type == ToMotorDataType.SYSTEM_CONTROLS, "the control")
    assert not any(moving(c) for c in window), window
    assert all(c.motor_data[3] == SystemControl.BACKLASH_COMPENSATION_ENABLE for c in window[-1:]), window

    # the release: nothing moves by itself, not even when the demands are enabled again (nullify off): the demand
    # held before the stop (for 10 s) is forgotten; a backlash control marks the end of the window
    release = rig.set_stop(False)
    a = rig.answer(release)
    assert a["devices"][0]["stopped"] is False
    rig.health(lambda h: h.get("state") != "stopped", "health no longer stopped")
    assert rig.call("nullify_demands", {"enable": False}).ok
    assert rig.call("system_controls", {"motors": [3], "backlash": False}).ok
    window = rig.until_on_wire(lambda c: c.to_motor_data_type == ToMotorDataType.SYSTEM_CONTROLS, "the control")
    assert not any(moving(c) for c in window), window
    assert not any(moving(c) for c in rig.until_on_wire(demanding, "a demand frame after the control"))
    # a new command after the release moves again
    rep = rig.call("set_demands", {"motors": {"3": 120}})
    assert rep.ok, rep.error
    rig.until_on_wire(lambda c: moving(c) and c.motor_data[3] == 120, "the new demand")


def test_a_node_started_while_the_stop_is_active_comes_up_stopped(rig_factory: Callable[..., Rig]) -> None:
    box: dict[str, StopState] = {}

    def before(rig: Rig) -> None:
        assert rig.ctl.call("watch_stop")["watching"] is True
        box["stop"] = rig.set_stop(True, "maintenance")

    rig = rig_factory(before)
    stop = box["stop"]
    # the stop reached the palm: a frame of the running cycle carried it (not an error, not pending). On a loaded
    # host the palm may reach OP past the write's grace: the answer says so first, then the frame clears it
    a = rig.bus.wait(answer_topic(rig.root, rig.node),
                     lambda a: a["stop_ts"] == stop.ts and a["active"] and a["devices"][0]["written_ts"] is not None,
                     "the answer with the stop's frame")
    d = a["devices"][0]
    assert d["stopped"] and not d["pending"] and d["error"] == "" and d["written_ts"] >= stop.ts, d
    rig.health(lambda h: h.get("state") == "stopped" and "maintenance" in h.get("error_message", ""),
               "health stopped")
    rep = rig.call("set_demands", {"motors": {"3": 100}})
    assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", rep
    stamp = wait_for(lambda: rig.ctl.call("stop_stamp")["stamp"], DEADLINE, "the hand's stamp")
    assert stamp["moving_frames_before"] == 0, stamp  # never a demand on the wire
    frames = rig.ctl.call("stats")["pd_frames"]
    wait_for(lambda: rig.ctl.call("stats")["pd_frames"] > frames + 50, DEADLINE, "frames")
    assert not any(moving(decoded(c[2])) for c in rig.changes())

    # the raw CAN bridge: the lease is granted (a flash may go on), but a TO_MOTOR frame (a demand to motor 3)
    # never reaches the palm's bus while the stop is active; the data request sent behind it does
    rep = rig.call("bridge_lease", {"holder": "tester", "ttl_ms": 5000})
    assert rep.ok, rep.error
    demand = make_sid(CanDirection.TO_MOTOR, 3, ToMotorDataType.DEMAND_PWM)
    request = make_sid(CanDirection.DATA_REQUEST, 0, 3)
    rig.client.session.publish(f"{rig.root}/{rig.node}/{DEV}/stream/can_tx", json.dumps(
        {"lease_id": rep.result["lease_id"], "frames": [{"bus": 1, "sid": demand, "data": "6400"},
                                                        {"bus": 1, "sid": request, "data": ""}]}), qos=1)
    log = wait_for(lambda: [f for f in rig.ctl.call("can_log")["frames"] if f[2] == request], DEADLINE,
                   "the data request on the palm's CAN bus")
    assert log and not [f for f in rig.ctl.call("can_log")["frames"] if f[2] == demand]


def test_a_palm_that_reaches_op_past_the_writes_grace_is_said_then_stopped_by_its_first_frame(
        rig_factory: Callable[..., Rig]) -> None:
    """The stop active before the node starts, the palm (the hand process) frozen until past the write's grace: the
    answer says no frame carried the stop (an error, not pending); the stop is still sent while it holds, and the
    first frame of the cycle that reaches OP is reported: the error clears, with the frame's time."""
    answers: list[dict[str, Any]] = []
    box: dict[str, Any] = {}

    def before(rig: Rig) -> None:
        def on(msg: Any) -> None:
            if msg.payload:
                answers.append(json.loads(msg.payload))
        rig.client.subscribe_before(answer_topic(rig.root, rig.node), on)
        box["stop"] = rig.set_stop(True, "maintenance")
        pid = rig.ns.hand_proc.pid
        os.killpg(pid, signal.SIGSTOP)
        box["thaw"] = threading.Timer(STOP_WRITE_GRACE_S + 2.0, os.killpg, (pid, signal.SIGCONT))
        box["thaw"].start()

    try:
        rig = rig_factory(before)
    finally:
        if "thaw" in box:
            box["thaw"].join()
    stop = box["stop"]
    final = rig.bus.wait(answer_topic(rig.root, rig.node),
                         lambda a: a["stop_ts"] == stop.ts and a["devices"][0]["written_ts"] is not None,
                         "the answer with the stop's frame")
    d = final["devices"][0]
    assert d["stopped"] and not d["pending"] and d["error"] == "" and d["written_ts"] >= stop.ts, d
    said = [a["devices"][0] for a in answers if a["stop_ts"] == stop.ts and a["devices"]]
    failed = [x for x in said if "the palm is not in OP" in x["error"]]
    assert failed and not failed[0]["pending"] and failed[0]["written_ts"] is None, said
    assert said.index(failed[0]) < said.index(d) if d in said else True, said
    rep = rig.call("set_demands", {"motors": {"3": 100}})
    assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", rep


def test_the_driver_forgets_demands_and_drops_a_queued_jiggle_at_the_stop() -> None:
    """Sans-I/O: the stop's frame is the next one, with every demand zero; a queued jiggle does not leave (its
    other control bits do); a demand held before the stop does not come back after it."""
    d = PalmDriver("0220", demand_timeout_ms=10_000, mode="pwm")
    d.phase = "operation"
    d.queue_demands({3: 200})
    d.queue_to_motors(ToMotorDataType.SYSTEM_CONTROLS,
                      {3: int(SystemControl.INITIATE_JIGGLING), 4: int(SystemControl.INITIATE_JIGGLING
                                                                       | SystemControl.BACKLASH_COMPENSATION_ENABLE)},
                      config=False)
    d.bus_stop(7)
    assert d.stop_seq == 7
    sent = [decoded(d.cycle(None, 1_000_000 * (i + 1)).hex()) for i in range(30)]
    controls = [c for c in sent if c.to_motor_data_type == ToMotorDataType.SYSTEM_CONTROLS]
    assert [c.motor_data[3:5] for c in controls] == [(0, int(SystemControl.BACKLASH_COMPENSATION_ENABLE))]
    assert all(not any(c.motor_data) for c in sent if demanding(c)) and any(demanding(c) for c in sent)
    d.nullified = False
    assert not any(decoded(d.cycle(None, 40_000_000).hex()).motor_data)


def test_the_model_backend_reports_the_stop_and_zeroes_its_motors(broker_session: Broker, spawn: Any) -> None:
    """`make run`'s backend (the palm model in the node's process): the same stop, reported with the time of the
    command that carried it; the model's motors get zero demands; demands refused."""
    root = f"ecstop{os.getpid()}x{next(_roots)}/robobus"
    node = f"ecstopm{os.getpid()}"
    client = RpcClient(broker_session.settings(topic_root=root), name=f"ecstop-model-{os.getpid()}")
    client.connect()
    try:
        bus = Bus(client, f"{root}/{node}/#")
        proc = spawn(["-m", "services.ethercat_loop"], {
            "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node, "ROBOBUS_TOPIC_ROOT": root,
            "ROBOBUS_ETHERCAT_BACKEND": "model", "ROBOBUS_HEALTH_INTERVAL_S": "1",
            "ROBOBUS_ETHERCAT_DEMAND_TIMEOUT_MS": "10000", "ROBOBUS_STATE_RATES": json.dumps({"motors": 50})})
        rig = Rig(root, node, client, bus, None, None, proc)  # type: ignore[arg-type]
        rig.health(lambda h: h.get("state") == "running", "running")
        stop_known(rig)
        motors = f"{root}/{node}/{DEV}/state/motors"
        assert rig.call("set_demands", {"motors": {"3": 200}}).ok
        bus.wait(motors, lambda m: m["motors"][3]["demand_sent"] == 200, "the demand sent")
        stop = rig.set_stop(True, "model")
        d = rig.answer(stop)["devices"][0]
        assert d["stopped"] and d["error"] == "" and d["written_ts"] >= stop.ts, d
        bus.wait(motors, lambda m: all(x["demand_sent"] == 0 for x in m["motors"]), "zero demands")
        rep = rig.call("set_demands", {"motors": {"3": 100}})
        assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", rep
    finally:
        client.session.publish_wait(stop_topic(root), b"", qos=1, retain=True)
        client.close()


def test_sigterm_under_a_demand_stream_zeroes_the_demands_and_exits_promptly(rig_factory: Callable[..., Rig]) -> None:
    """SIGTERM while a client streams demands: the fail-safe first (zero demands on the wire, then the palm leaves
    OP), then the readers of the cycle's shared memory stop, then it is closed. The node exits cleanly within a few
    seconds (it crashed with `mmap closed or invalid` on a reader still running after the close, and hung past
    10 s)."""
    rig = rig_factory()
    stop_known(rig)
    streaming = threading.Event()
    streaming.set()

    def stream() -> None:  # 200 Hz, each demand living 100 ms, as a client drives the hand
        while streaming.is_set():
            rig.client.send(rig.node, DEV, "set_demands", {"motors": {"0": 120, "3": -80}})
            time.sleep(0.005)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        rig.until_on_wire(moving, "the streamed demand")
        t0 = time.monotonic()
        rig.proc.signal(signal.SIGTERM)
        try:
            code = rig.proc.proc.wait(8.0)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 8 s after SIGTERM: {rig.proc.text()[-3000:]}") from None
        took = time.monotonic() - t0
    finally:
        streaming.clear()
        t.join(2)
    log = rig.proc.text()
    assert code == 0 and "Traceback" not in log and "closed or invalid" not in log, log[-3000:]
    assert took < 5.0, f"exited {took:.1f} s after SIGTERM"
    stats = rig.ctl.call("stats")
    assert stats["zero_demand_frames_before_leaving_op"] >= 20, stats
    assert not any(decoded(stats["last_command"]).motor_data), stats["last_command"]
