"""The bus-wide software stop (docs/kit.md, "Stopping everything") on roi-modules, against the simulator's wire:
the ODrive set to velocity mode at 0 rev/s, the actuator held where it is, the GPIO pins of `stop_outputs` set
(other pins left as they are), each module stamping the stop bytes it received; motion commands (typed and raw)
refused with `stopped` and nothing sent; read-only commands answered; the release moves nothing; a node that
starts while the stop is active comes up stopped; a stop lost on the wire is sent again; a module that does not
answer shows in the stop answer; every module's first stop datagram leaves before any module's second (one pass);
the simulator stamps a stop with the time it reached the module's socket. Each test has a topic root of its own (the
stop is retained, per root)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.roi_modules import protocol as p
from services.roi_modules.models import RoiModuleConfig
from services.roi_modules.sim import RoiSim, SimModuleSpec, WireRecord
from services.roi_modules.sim import from_args as sim_from_args
from services.roi_modules.sim import parser as sim_parser
from shared.messages import StopState
from shared.rpc import RpcClient
from shared.stop import answer_topic, stop_topic
from tests.fixtures import Broker
from tests.roi_modules.conftest import fresh_prefix, wait_until
from tests.roi_modules.harness import Rig, make_rig
from tests.roi_modules.test_blank import procfile_roi, procfile_sim_argv

DEADLINE = 20.0  # generous: the machine is shared
_roots = itertools.count()
MODULES: list[dict[str, Any]] = [
    {"name": "io", "octet": 10, "type": "gpio", "pin_modes": {"3": "output", "4": "output"}, "stop_outputs": {"3": 0}},
    {"name": "io2", "octet": 11, "type": "gpio", "pin_modes": {"5": "output"}},
    {"name": "wheel", "octet": 20, "type": "odrive", "max_velocity": 20.0, "initial_mode": "velocity"},
    {"name": "arm", "octet": 30, "type": "actuator"},
]
MOTION = ("io", "wheel", "arm")


def fresh_root() -> str:
    return f"roistop{os.getpid()}x{next(_roots)}/robobus"


def set_stop(rig: Rig, active: bool, reason: str = "test") -> StopState:
    stop = StopState(active=active, source="tester", reason=reason, ts=time.time())
    assert rig.client.session.publish_wait(stop_topic(rig.client.root), stop.model_dump_json(), qos=1, retain=True)
    return stop


def clear_stop(rig: Rig) -> None:
    rig.client.session.publish_wait(stop_topic(rig.client.root), b"", qos=1, retain=True)


def answer(rig: Rig, stop: StopState) -> dict[str, Any]:
    """The node's answer to `stop` once every device has reported."""
    suffix = answer_topic(rig.client.root, rig.node)[len(f"{rig.client.root}/{rig.node}"):]

    def settled(a: dict[str, Any]) -> bool:
        return a["stop_ts"] == stop.ts and a["active"] == stop.active and not any(d["pending"] for d in a["devices"])
    a = rig.bus.wait(suffix, settled, timeout=DEADLINE)
    assert a is not None, rig.bus.latest(suffix)
    return a


def health(rig: Rig, device: str) -> dict[str, Any]:
    return rig.bus.latest(f"/{device}/health") or {}


def operational(rig: Rig, *devices: str) -> bool:
    return all(health(rig, d).get("operational") is True for d in devices)


def wheel(rig: Rig) -> tuple[int, int, float, float, float]:
    state: tuple[int, int, float, float, float] = rig.sim.call(
        20, lambda f: (f.control_mode, f.input_mode, f.vel_sp, f.torque_sp, f.vel))
    return state


def polled(rig: Rig, octet: int, n: int = 10) -> None:
    """Wait until the service has sent `n` more general datagrams to the module (its maintain ticks)."""
    start = rig.sim.call(octet, lambda f: f.counters.general_rx)
    assert wait_until(lambda: rig.sim.call(octet, lambda f: f.counters.general_rx) >= start + n, DEADLINE)


@pytest.fixture
def rig(broker_session: Broker) -> Iterator[Rig]:
    r = make_rig(broker_session, MODULES, root=fresh_root())
    try:
        assert wait_until(lambda: operational(r, "io", "io2", "wheel", "arm"), DEADLINE), \
            {n: health(r, n).get("state") for n in ("io", "io2", "wheel", "arm")}
        yield r
    finally:
        clear_stop(r)
        r.close()


def moving(rig: Rig) -> None:
    """Every motion module doing something the stop must end; io2 (no stop_outputs) with an output set."""
    assert rig.call("wheel", "set_velocity", {"velocity": 5.0, "torque_feedforward": 0.2}).ok
    # the first move starts the actuator's estimate at its target: 0 %, where the simulated actuator boots
    assert rig.call("arm", "goto_position", {"position": 0.0}).ok
    assert rig.call("arm", "goto_position", {"position": 90.0, "velocity_feedforward": 5.0}).ok
    assert rig.call("io", "set_pin_output", {"pin": 3, "value": 1}).ok
    assert rig.call("io", "set_pin_output", {"pin": 4, "value": 1}).ok
    assert rig.call("io2", "set_pin_output", {"pin": 5, "value": 1}).ok
    assert wait_until(lambda: wheel(rig)[4] > 1.0, DEADLINE)
    assert wait_until(lambda: rig.sim.call(30, lambda f: f.length[0]) > 0.5, DEADLINE)


def test_the_stop_reaches_every_motion_module_on_its_wire(rig: Rig) -> None:
    moving(rig)
    unmatched = {o: rig.service.svc.transport.links[o].unmatched for o in (10, 20, 30)}
    rig.sim.watch_stop()
    stop = set_stop(rig, True, "cell door open")
    a = answer(rig, stop)
    devices = {d["device"]: d for d in a["devices"]}
    assert sorted(devices) == sorted(MOTION)  # io2 has no stop_outputs: not a motion device
    stamps = rig.sim.stop_stamps()
    assert sorted(stamps) == [10, 20, 30], stamps
    for name, octet in (("io", 10), ("wheel", 20), ("arm", 30)):
        d = devices[name]
        assert d["stopped"] and not d["pending"] and d["error"] == "", d
        # the deadman reports when the stop was written, not when it was acknowledged or decided
        assert stop.ts <= d["written_ts"] <= a["ts"]
        assert abs(d["written_ts"] - stamps[octet].unix) < 1.0, (d, stamps[octet])
    # ODrive: velocity mode, VEL_RAMP, 0 rev/s, no torque feed-forward; the axis comes to rest
    assert wheel(rig)[:4] == (p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0, 0.0)
    assert wait_until(lambda: abs(wheel(rig)[4]) < 1e-6, DEADLINE)
    # actuator: held where it was (target = length once it settles), far short of the 90 % it was sent to
    assert wait_until(lambda: rig.sim.call(30, lambda f: abs(f.target[0] - f.length[0]) < 1.0), DEADLINE)
    assert rig.sim.call(30, lambda f: f.target[0]) < 0.9 * p.ACTUATOR_FIRMWARE_MAX_TICKS - 5
    # GPIO: the stop output set, the other outputs left as they are
    assert rig.sim.call(10, lambda f: (f.outputs[3], f.outputs[4])) == (0, 1)
    assert rig.sim.call(11, lambda f: f.outputs[5]) == 1
    # the replies to the stop's own write are replies, not stray datagrams
    assert {o: rig.service.svc.transport.links[o].unmatched for o in (10, 20, 30)} == unmatched
    for name in MOTION:
        h = rig.bus.wait(f"/{name}/health", lambda d: d["state"] == "stopped" and not d["details"]["stop"]["pending"])
        assert h is not None, health(rig, name)
        assert not h["operational"] and not h["error"] and h["connection"]
        assert h["details"]["stop"]["source"] == "tester" and "cell door open" in h["error_message"]
    assert health(rig, "io2")["state"] != "stopped"


def test_every_module_gets_its_first_stop_datagram_before_any_gets_its_second(rig: Rig) -> None:
    """One pass for every motion module (services/roi_modules/stop_pass.py, transport.send_now_many): each module's
    first stop datagram leaves before any module's second, so no module waits behind another's whole sequence
    (the GPIO module's three, the ODrive's five). Seen on the wire: the kernel's arrival time at each module's
    socket (the simulator's stop_log); the GPIO's SET_OUTPUT and the ODrive's SET_VELOCITY 0 come first and
    again last in their module's sequence."""
    moving(rig)
    rig.sim.watch_stop()
    stop = set_stop(rig, True, "order")
    answer(rig, stop)
    seen: dict[int, list[float]] = {}
    for st in rig.sim.stop_log():
        seen.setdefault(st.octet, []).append(st.unix)
    assert sorted(seen) == [10, 20, 30], seen
    assert len(seen[10]) >= 2 and len(seen[20]) >= 2, seen
    last_first = max(times[0] for times in seen.values())
    first_second = min(times[1] for times in seen.values() if len(times) > 1)
    assert last_first < first_second, seen


def test_the_stop_reaches_every_module_while_the_services_loop_is_held(rig: Rig) -> None:
    """A loop that is busy when the stop comes (after a stalled process: seconds of queued datagrams, heartbeats and
    streamed setpoints) does not hold the stop back: the kit's thread that reads the stop writes every module's
    stop datagrams itself (transport.send_from_thread). Order-based: every module has its stop while the loop is
    still held; once it runs, the loop's pass takes the replies to that write as its acknowledgements (none
    counted unmatched, no second write) and the answer reports that write."""
    moving(rig)
    svc = rig.service.svc
    unmatched = {o: svc.transport.links[o].unmatched for o in (10, 20, 30)}
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(DEADLINE + 5)

    rig.sim.watch_stop()
    rig.service.loop.call_soon_threadsafe(hold)
    try:
        assert held.wait(DEADLINE)
        stop = set_stop(rig, True, "loop held")
        assert wait_until(lambda: sorted(rig.sim.stop_stamps()) == [10, 20, 30], DEADLINE), rig.sim.stop_stamps()
        assert not release.is_set()  # the loop was held all along: nothing of this came from it
    finally:
        release.set()
    stamps = rig.sim.stop_stamps()
    a = answer(rig, stop)
    devices = {d["device"]: d for d in a["devices"]}
    for name, octet in (("io", 10), ("wheel", 20), ("arm", 30)):
        d = devices[name]
        assert d["stopped"] and not d["pending"] and d["error"] == "", d
        assert abs(d["written_ts"] - stamps[octet].unix) < 1.0, (d, stamps[octet])
    assert {o: svc.transport.links[o].unmatched for o in (10, 20, 30)} == unmatched
    assert svc.transport.thread_writes >= 1
    assert wheel(rig)[:4] == (p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0, 0.0)


def test_a_write_from_the_kits_thread_that_fails_unexpectedly_leaves_the_stop_to_the_loops_pass(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever breaks the kit thread's write (here: it raises something no socket raises), the
    loop's pass is still scheduled and writes every module's stop; the answer reports those writes."""
    from services.roi_modules.transport import RoiTransport

    def broken(*_: object) -> object:
        raise RuntimeError("not a socket error")

    monkeypatch.setattr(RoiTransport, "send_from_thread", broken)
    moving(rig)
    rig.sim.watch_stop()
    stop = set_stop(rig, True, "thread write broken")
    assert wait_until(lambda: sorted(rig.sim.stop_stamps()) == [10, 20, 30], DEADLINE), rig.sim.stop_stamps()
    devices = {d["device"]: d for d in answer(rig, stop)["devices"]}
    assert all(d["stopped"] and not d["pending"] and d["error"] == "" for d in devices.values()), devices
    assert rig.service.svc.transport.thread_writes == 0


def test_the_simulator_stamps_a_stop_with_its_arrival_not_when_it_got_round_to_it() -> None:
    """One thread serves every simulated module: a stop it reads late (here: while a test holds the simulator's
    lock) is stamped with the time it reached the module's socket (the kernel's), not when it was read; one that
    reached it before the watch was armed is not the watch's."""
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(20, "odrive")]).start()
    try:
        sim.watch_stop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            with sim.lock:  # the simulator's thread cannot handle the datagram until this is released
                t0 = time.time()
                s.sendto(p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0).encode(), (sim.address(20), p.GENERAL_PORT))
                t1 = time.time()  # loopback: the datagram is in the module's socket when sendto returns
                time.sleep(0.3)  # (ordering only: the simulator's thread is waiting for the lock)
            assert wait_until(lambda: 20 in sim.stop_stamps(), DEADLINE)
        stamp = sim.stop_stamps()[20]
        assert t0 <= stamp.unix <= t1, (t0, stamp.unix, t1)
        assert [st.unix for st in sim.stop_log()] == [stamp.unix]
        # a stop that reached the module before the watch was armed, read after: not this watch's
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            with sim.lock:
                n = sim.modules[20].counters.general_rx
                s.sendto(p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0).encode(), (sim.address(20), p.GENERAL_PORT))
                time.sleep(0.3)  # (ordering only: the datagram is in, the simulator's thread waits for the lock)
                sim.watch_stop()
            assert wait_until(lambda: sim.call(20, lambda f: f.counters.general_rx) > n, DEADLINE)
            assert sim.stop_stamps() == {} and sim.stop_log() == []
    finally:
        sim.close()


def test_motion_commands_are_refused_and_send_nothing_read_only_commands_work(rig: Rig) -> None:
    moving(rig)
    stop = set_stop(rig, True)
    answer(rig, stop)
    before = (wheel(rig)[:4], rig.sim.call(30, lambda f: (f.target[0], f.speed[0])),
              rig.sim.call(10, lambda f: (list(f.modes), list(f.outputs))))
    refused: list[tuple[str, str, dict[str, Any]]] = [
        ("wheel", "set_velocity", {"velocity": 3.0}), ("wheel", "set_torque", {"torque": 0.5}),
        ("wheel", "goto_position", {"position": 10.0}), ("wheel", "goto_relative_position", {"position": 1.0}),
        ("wheel", "clear_errors", {}), ("wheel", "go_to_position", {"position": 10.0}),
        ("wheel", "go_to_relative_position", {"position": 1.0}),
        ("arm", "goto_position", {"position": 10.0}), ("arm", "set_velocity", {"velocity": 50.0}),
        ("arm", "go_to_position", {"position": 10.0}),
        ("io", "set_pin_output", {"pin": 3, "value": 1}), ("io", "set_pin_mode", {"pin": 3, "mode": "input"}),
        # raw: the stop output's setters
        ("io", "queue_general_packet", {"sub_device_id": 3, "action": p.GpioAction.SET_OUTPUT, "payload_hex": "01"}),
        ("io", "queue_general_packet", {"sub_device_id": 3, "action": p.GpioAction.SET_PIN_MODE,
                                        "payload_hex": bytes([p.PinMode.INPUT]).hex()}),
    ]
    for device, command, payload in refused:
        rep = rig.call(device, command, payload)
        assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped", (device, command, rep.raw)
        assert "tester" in rep.error["message"]
    # a raw ODrive setter stays forbidden (always, not only during the stop)
    rep = rig.call("wheel", "queue_general_packet", {"action": p.OdriveAction.SET_VELOCITY,
                                                     "payload_hex": p.f32(3.0).hex()})
    assert not rep.ok and rep.error is not None and rep.error["code"] == "forbidden"
    polled(rig, 20)
    after = (wheel(rig)[:4], rig.sim.call(30, lambda f: (f.target[0], f.speed[0])),
             rig.sim.call(10, lambda f: (list(f.modes), list(f.outputs))))
    assert after == before
    # read-only commands, and outputs that are not stop outputs, work during the stop
    assert rig.call("wheel", "ping").unwrap()["module_type"] == p.ModuleType.O_DRIVE
    assert rig.call("arm", "status_report").ok
    rep = rig.call("wheel", "queue_general_packet", {"action": p.OdriveAction.GET_CONTROL_MODE}).unwrap()
    assert bytes.fromhex(rep["payload_hex"])[0] == p.ControlMode.VELOCITY
    rep = rig.call("io", "queue_general_packet", {"sub_device_id": 3, "action": p.GpioAction.READ}).unwrap()
    assert bytes.fromhex(rep["payload_hex"])[0] == 0
    assert rig.call("io", "set_pin_output", {"pin": 4, "value": 0}).ok
    assert rig.call("io", "queue_general_packet", {"sub_device_id": 4, "action": p.GpioAction.SET_OUTPUT,
                                                   "payload_hex": "01"}).ok
    assert rig.call("io2", "set_pin_output", {"pin": 5, "value": 0}).ok
    assert rig.sim.call(10, lambda f: f.outputs[4]) == 1 and rig.sim.call(11, lambda f: f.outputs[5]) == 0


def test_the_release_moves_nothing_until_a_new_command(rig: Rig) -> None:
    moving(rig)
    answer(rig, set_stop(rig, True))
    assert wait_until(lambda: abs(wheel(rig)[4]) < 1e-6, DEADLINE)
    held = rig.sim.call(30, lambda f: f.target[0])
    rig.sim.watch_stop()
    release = set_stop(rig, False)
    a = answer(rig, release)
    assert all(not d["stopped"] for d in a["devices"])
    assert wait_until(lambda: all(health(rig, n).get("state") != "stopped" for n in MOTION), DEADLINE)
    polled(rig, 20)
    polled(rig, 30)
    assert wheel(rig)[:4] == (p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0, 0.0)
    assert abs(wheel(rig)[4]) < 1e-6
    assert rig.sim.call(30, lambda f: f.target[0]) == held
    assert rig.sim.call(10, lambda f: f.outputs[3]) == 0
    assert rig.sim.stop_stamps() == {}  # nothing stop-like either: nothing was sent to move or hold anything
    # a new command moves again
    assert rig.call("wheel", "set_velocity", {"velocity": 2.0}).ok
    assert wait_until(lambda: wheel(rig)[4] > 0.5, DEADLINE)
    assert rig.call("io", "set_pin_output", {"pin": 3, "value": 1}).ok
    assert rig.sim.call(10, lambda f: f.outputs[3]) == 1


def test_a_node_started_while_the_stop_is_active_comes_up_stopped(broker_session: Broker) -> None:
    root = fresh_root()
    sim = RoiSim(fresh_prefix(), [SimModuleSpec(20, "odrive"), SimModuleSpec(10, "gpio")], seed=5).start()
    # a module left running by a service that is gone: velocity mode at 4 rev/s
    def running(f: Any) -> None:
        f.configured, f.control_mode, f.vel_sp = True, p.ControlMode.VELOCITY, 4.0
    sim.call(20, running)
    assert wait_until(lambda: sim.call(20, lambda f: f.vel) > 1.0, DEADLINE)
    sim.watch_stop()
    setter = RpcClient(broker_session.settings(topic_root=root), name="roi-stop-setter")
    setter.connect()
    try:
        stop = StopState(active=True, source="tester", reason="before start", ts=time.time())
        assert setter.session.publish_wait(stop_topic(root), stop.model_dump_json(), qos=1, retain=True)
        rig = make_rig(broker_session, [{"name": "wheel", "octet": 20, "type": "odrive"},
                                        {"name": "io", "octet": 10, "type": "gpio", "pin_modes": {"2": "output"},
                                         "stop_outputs": {"2": 1}}], sim=sim, root=root)
        try:
            a = answer(rig, stop)
            assert {d["device"]: (d["stopped"], d["error"]) for d in a["devices"]} == \
                {"wheel": (True, ""), "io": (True, "")}
            assert sorted(sim.stop_stamps()) == [10, 20]
            assert wait_until(lambda: abs(sim.call(20, lambda f: f.vel)) < 1e-6, DEADLINE)
            assert sim.call(20, lambda f: (f.control_mode, f.vel_sp)) == (p.ControlMode.VELOCITY, 0.0)
            assert wait_until(lambda: sim.call(10, lambda f: (f.modes[2], f.outputs[2])) == (p.PinMode.OUTPUT, 1),
                              DEADLINE)
            assert rig.bus.wait("/wheel/health", lambda d: d["state"] == "stopped") is not None
            rep = rig.call("wheel", "set_velocity", {"velocity": 1.0})
            assert not rep.ok and rep.error is not None and rep.error["code"] == "stopped"
        finally:
            clear_stop(rig)
            rig.close()
    finally:
        setter.close()
        sim.close()


def test_a_stop_lost_on_the_wire_is_sent_again(rig: Rig) -> None:
    moving(rig)
    rig.sim.set_faults(20, drop_next=3)  # the first stop datagrams never arrive
    stop = set_stop(rig, True)
    a = answer(rig, stop)
    d = next(d for d in a["devices"] if d["device"] == "wheel")
    assert d["error"] == "" and d["written_ts"] is not None, d
    assert rig.sim.call(20, lambda f: f.counters.dropped) >= 3
    assert wheel(rig)[:4] == (p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0, 0.0)
    assert wait_until(lambda: abs(wheel(rig)[4]) < 1e-6, DEADLINE)


def test_a_module_that_does_not_answer_the_stop_shows_in_the_answer_and_health(rig: Rig) -> None:
    rig.sim.set_faults(20, offline=True)
    stop = set_stop(rig, True)
    a = answer(rig, stop)
    d = next(d for d in a["devices"] if d["device"] == "wheel")
    assert d["stopped"] and "the stop was sent, but" in d["error"] and "no reply" in d["error"], d
    h = rig.bus.wait("/wheel/health", lambda h: h["state"] == "stopped" and "stop action failed" in h["error_message"])
    assert h is not None, health(rig, "wheel")


def test_a_running_move_job_ends_stopped_and_the_axis_stops(rig: Rig) -> None:
    assert rig.bus.wait("/wheel/state/state", lambda d: d["position"] is not None) is not None
    mark = rig.bus.mark()
    job = rig.call("wheel", "go_to_position", {"position": 500.0, "velocity_feedforward": 3.0, "timeout_s": 60})
    job_id = job.unwrap()["job_id"]
    assert wait_until(lambda: wheel(rig)[4] > 1.0, DEADLINE), (wheel(rig), rig.bus.since(mark, "job_result"),
                                                               rig.bus.since(mark, "job_progress")[-1:])
    answer(rig, set_stop(rig, True))
    res = rig.bus.wait("/wheel/event/job_result", lambda d: d["job_id"] == job_id, mark)
    assert res is not None and not res["ok"] and res["error"]["code"] == "stopped", res
    assert wait_until(lambda: abs(wheel(rig)[4]) < 1e-6, DEADLINE)
    assert wheel(rig)[2] == 0.0


def test_stop_outputs_must_be_gpio_outputs() -> None:
    RoiModuleConfig(name="io", octet=10, type="gpio", pin_modes={3: "output"}, stop_outputs={3: 0})
    with pytest.raises(ValueError, match="must be an output in pin_modes"):
        RoiModuleConfig(name="io", octet=10, type="gpio", pin_modes={3: "input"}, stop_outputs={3: 0})
    with pytest.raises(ValueError, match="cannot be an output"):
        RoiModuleConfig(name="io", octet=10, type="gpio", pin_modes={16: "output"}, stop_outputs={16: 0})
    with pytest.raises(ValueError, match="GPIO setting"):
        RoiModuleConfig(name="w", octet=20, type="odrive", stop_outputs={3: 0})


def test_the_simulator_stamps_the_first_stop_bytes_and_prints_them() -> None:
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(20, "odrive"), SimModuleSpec(30, "actuator")]).start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            def send(octet: int, pkt: p.GeneralPacket) -> None:
                n = sim.call(octet, lambda f: f.counters.general_rx)
                s.sendto(pkt.encode(), (sim.address(octet), p.GENERAL_PORT))
                assert wait_until(lambda: sim.call(octet, lambda f: f.counters.general_rx) > n, DEADLINE)
            send(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0))  # before the watch: not stamped
            sim.watch_stop()
            send(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 3.0))  # not a stop
            send(30, p.GeneralPacket(0, p.ActuatorAction.GET_CURRENT_LENGTH))
            assert sim.stop_stamps() == {}
            t0 = time.time()
            send(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0))
            send(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0))
            send(30, p.GeneralPacket(0, p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.u16(10)))
            stamps = sim.stop_stamps()
            assert sorted(stamps) == [20, 30] and stamps[20].kind == "odrive"
            assert stamps[20].action == p.OdriveAction.SET_VELOCITY and t0 <= stamps[20].unix <= stamps[30].unix
            sim.watch_stop()
            assert sim.stop_stamps() == {}
    finally:
        sim.close()
    # the command line: one JSON line per module on stdout
    prefix = fresh_prefix()
    proc = subprocess.Popen([sys.executable, "-m", "services.roi_modules.sim", "--prefix", prefix, "--modules",
                             "odrive:20", "--watch-stop"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            s.bind(("127.0.0.1", 0))
            # until the simulator answers: it is serving (its reply comes back to this socket's port 57344 only
            # from a module; here the reply goes nowhere, so watch for the line instead)
            line = ""
            end = time.monotonic() + DEADLINE
            os.set_blocking(proc.stdout.fileno(), False)
            while not line and time.monotonic() < end:
                s.sendto(p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0).encode(), (f"{prefix}.20", p.GENERAL_PORT))
                time.sleep(0.05)
                line = proc.stdout.readline()
        rec = json.loads(line)
        assert rec["event"] == "stop_bytes" and rec["octet"] == 20 and rec["kind"] == "odrive", rec
        assert rec["action"] == p.OdriveAction.SET_VELOCITY and rec["unix"] > 0 and rec["monotonic"] > 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_stop_output_that_is_no_longer_an_output_is_made_one(rig: Rig) -> None:
    """The module lost the pin's mode behind the service's back (a reset it has not noticed yet): the stop's
    first SET_OUTPUT is refused (reference roi.md §3.5), the stop makes the pin an output and sets it."""
    assert rig.call("io", "set_pin_output", {"pin": 3, "value": 1}).ok

    def lose_mode(f: Any) -> None:
        f.modes[3] = p.PinMode.INPUT
    rig.sim.call(10, lose_mode)
    stop = set_stop(rig, True)
    d = next(d for d in answer(rig, stop)["devices"] if d["device"] == "io")
    assert d["error"] == "", d
    assert rig.sim.call(10, lambda f: (f.modes[3], f.outputs[3])) == (p.PinMode.OUTPUT, 0)


# -- a motion command admitted just before the stop, its acknowledgements lost ---------------------------------------
def _velocity(v: float) -> p.GeneralPacket:
    return p.odrive_request(p.OdriveAction.SET_VELOCITY, v)


def same(rec: WireRecord, pkt: p.GeneralPacket) -> bool:
    """The datagram the module received is `pkt` (its payload as sent, before the wire's zero padding)."""
    return (rec.sub_device_id, rec.action) == (pkt.sub_device_id, pkt.action) and rec.payload.startswith(pkt.payload)


# device, command, request, octet, the command's datagram, one stop datagram of that module, stop datagrams a write
RACE_CASES = [
    ("wheel", "set_velocity", {"velocity": 1.5}, 20, _velocity(1.5), _velocity(0.0), 2),
    ("io", "set_pin_output", {"pin": 3, "value": 1}, 10, p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x01"),
     p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x00"), 2),
    # the actuator is held where it is estimated: 0 %, where it was sent first (the hold is a length setter too)
    ("arm", "goto_position", {"position": 100.0}, 30,
     p.GeneralPacket(0, p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.u16(150)),
     p.GeneralPacket(0, p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.u16(0)), 1),
]


@pytest.fixture
def slow_rig(broker_session: Broker) -> Iterator[Rig]:
    """The rig with a resend timeout of 0.2 s (the default: 50 ms): a command's resend ladder lasts 2.2 s, so a
    test can set the stop while it runs even on a busy host (the liveness budget follows: 2.3 s)."""
    r = make_rig(broker_session, MODULES, root=fresh_root(), roi_timeout_s=0.2)
    try:
        assert wait_until(lambda: operational(r, "io", "io2", "wheel", "arm"), DEADLINE), \
            {n: health(r, n).get("state") for n in ("io", "io2", "wheel", "arm")}
        yield r
    finally:
        clear_stop(r)
        r.close()


@pytest.mark.parametrize("case", RACE_CASES, ids=[c[0] for c in RACE_CASES])
def test_a_motion_command_in_flight_sends_nothing_after_the_stop_and_the_stop_is_resent_until_acknowledged(
        slow_rig: Rig, case: tuple[str, str, dict[str, Any], int, p.GeneralPacket, p.GeneralPacket, int]) -> None:
    """The module applies every datagram but its replies are lost: the command admitted before the stop is in its
    resend ladder when the stop comes. Seen at the module (the simulator's wire log): after the stop's first
    datagram, nothing of the command arrives (no resend, nor its next datagram); the stop itself is written again
    while unacknowledged (here its first two writes lose their acks, the third is acknowledged), and the node's
    answer reports the time of the write the module acknowledged, not the first one. Before: the command's resends
    went on for up to 0.55 s after the stop, and the stop's own resends waited behind them."""
    rig = slow_rig
    device, command, request, octet, motion, stop_pkt, per_write = case
    if device == "arm":
        assert rig.call("arm", "goto_position", {"position": 0.0}).ok  # the estimate starts there
    seen_stops: list[float] = []

    def on_record(rec: WireRecord) -> None:  # the simulator's thread, before the module handles the datagram
        if rec.octet != octet or not same(rec, stop_pkt):
            return
        seen_stops.append(rec.unix)
        if len(seen_stops) == 2 * per_write + 1:  # the third write of the stop: its acks come back
            rig.sim.set_faults(octet, drop_replies=False)

    rig.sim.record_wire(on_record)
    rig.sim.set_faults(octet, drop_replies=True)
    replies: list[Any] = []
    caller = threading.Thread(target=lambda: replies.append(rig.call(device, command, request)))
    caller.start()
    # the command is in its resend ladder: sent, applied, unacknowledged, sent again
    assert wait_until(lambda: sum(same(r, motion) for r in rig.sim.wire_log(octet)) >= 2, DEADLINE), \
        rig.sim.wire_log(octet)
    stop = set_stop(rig, True, "replies lost")
    a = answer(rig, stop)
    caller.join(DEADLINE)
    d = next(d for d in a["devices"] if d["device"] == device)
    log = rig.sim.wire_log(octet)
    first_stop = next(i for i, r in enumerate(log) if same(r, stop_pkt))
    after = [r for r in log[first_stop:] if same(r, motion)]
    assert after == [], (after, log[first_stop])
    assert d["error"] == "" and d["written_ts"] is not None, d
    # written again until acknowledged: three writes at least; the answer's time is the acknowledged write's (it
    # left after its first datagram reached the module), later than every datagram of the unacknowledged writes
    assert len(seen_stops) >= 2 * per_write + 1, seen_stops
    assert d["written_ts"] >= seen_stops[2 * per_write] > seen_stops[2 * per_write - 1], (d, seen_stops)
    assert d["written_ts"] <= a["ts"]
    assert rig.sim.call(octet, lambda f: f.counters.replies_dropped) >= 2 * per_write
    # the command was cut short by the stop: answered `stopped`
    assert replies and not replies[0].ok and replies[0].error["code"] == "stopped", replies
    if device == "wheel":
        assert wheel(rig)[:4] == (p.ControlMode.VELOCITY, p.InputMode.VELOCITY_RAMP, 0.0, 0.0)
    elif device == "io":
        assert rig.sim.call(10, lambda f: f.outputs[3]) == 0
    else:
        assert rig.sim.call(30, lambda f: f.target[0]) == 0.0


# -- a node (re)started under the stop, and make run's demo ---------------------------------------------------------
def test_a_node_started_under_the_stop_holds_an_actuator_it_measures_at_its_first_length(
        broker_session: Broker) -> None:
    """A lift left moving to 90 % by a service that is gone; the service starts while the stop is active. Its
    position is unknown until the module's first length reply: meanwhile the stop answer says `pending` and the
    health says why; at that reply the lift is held where it is measured, and the answer reports that write.
    Before: "nothing sent: position unknown" at once, and the lift ran on to its old target."""
    root = fresh_root()
    sim = RoiSim(fresh_prefix(), [SimModuleSpec(30, "actuator")], seed=5, actuator_length=True).start()

    def running(f: Any) -> None:
        f.target[0], f.speed[0] = 0.9 * p.ACTUATOR_FIRMWARE_MAX_TICKS, 15.0  # ticks/s: 9 s to get there
    sim.call(30, running)
    assert wait_until(lambda: sim.call(30, lambda f: f.length[0]) > 10.0, DEADLINE)
    setter = RpcClient(broker_session.settings(topic_root=root), name="roi-stop-setter")
    setter.connect()
    try:
        stop = StopState(active=True, source="tester", reason="lift restart", ts=time.time())
        assert setter.session.publish_wait(stop_topic(root), stop.model_dump_json(), qos=1, retain=True)
        rig = make_rig(broker_session, [{"name": "lift", "octet": 30, "type": "actuator"}], sim=sim, root=root)
        try:
            a = answer(rig, stop)
            d = next(d for d in a["devices"] if d["device"] == "lift")
            assert d["stopped"] and d["error"] == "" and d["written_ts"] is not None, d
            # held where it is, far short of its old target
            assert wait_until(lambda: sim.call(30, lambda f: abs(f.target[0] - f.length[0]) < 1.0), DEADLINE)
            assert sim.call(30, lambda f: f.target[0]) < 0.9 * p.ACTUATOR_FIRMWARE_MAX_TICKS - 10
            # meanwhile: pending, in the answer and in the health, each with why
            suffix = answer_topic(root, rig.node)[len(f"{root}/{rig.node}"):]
            answers = [json.loads(m.payload) for m in rig.bus.since(0, suffix)]
            assert any(x["stop_ts"] == stop.ts and x["devices"] and x["devices"][0]["pending"]
                       and x["devices"][0]["error"] == ""
                       and "first GET_CURRENT_LENGTH reply" in x["devices"][0]["note"] for x in answers), answers
            pending = rig.bus.wait("/lift/health", lambda h: h["state"] == "stopped" and h["details"]["stop"]["pending"]
                                   and "stop pending" in h["error_message"]
                                   and "first GET_CURRENT_LENGTH reply" in h["error_message"])
            assert pending is not None, [json.loads(m.payload)["error_message"] for m in rig.bus.since(0, "/health")]
            held = rig.bus.wait("/lift/health", lambda h: h["state"] == "stopped"
                                and not h["details"]["stop"]["pending"])
            assert held is not None and "stop pending" not in held["error_message"], held
        finally:
            clear_stop(rig)
            rig.close()
    finally:
        setter.close()
        sim.close()


def demo(length_feedback: bool) -> tuple[RoiSim, list[dict[str, Any]]]:
    """`make run`'s simulated modules and the service's modules (deploy/Procfile.sim), on a prefix of the test's
    own; `length_feedback` False: the demo's actuator as the released firmware (no length: the simulator's
    default, without --actuator-length), and the service's setting for it left at its default."""
    specs, modules = procfile_roi()
    argv = procfile_sim_argv()
    if not length_feedback:
        argv = [a for a in argv if a != "--actuator-length"]
        modules = [{k: v for k, v in m.items() if k != "length_feedback"} for m in modules]
    sim = sim_from_args(sim_parser().parse_args(argv), prefix=fresh_prefix())
    assert sorted(sim.modules) == sorted(s.octet for s in specs)
    return sim.start(), modules


@pytest.mark.parametrize("length_feedback", [True, False], ids=["as-shipped", "actuator-without-length"])
def test_make_run_demo_stop_holds_every_module(broker_session: Broker, length_feedback: bool) -> None:
    """`make run`'s demo: the stop reaches every motion module and the answer has no error (`robobus stop` exits 0),
    the actuator held at its measured length. Before: roi_arm answered "nothing sent: the actuator's position is
    unknown" (the demo's actuator gave no length) and `robobus stop` exited 1. An actuator that truly cannot be
    held (no length, never moved) still says so, honestly."""
    sim, modules = demo(length_feedback)
    rig = make_rig(broker_session, modules, sim=sim, root=fresh_root())
    try:
        names = [m["name"] for m in modules]
        assert wait_until(lambda: operational(rig, *names), DEADLINE), {n: health(rig, n) for n in names}
        assert rig.bus.wait("/roi_arm/state/state", lambda s: True) is not None  # polled: its length was read
        rig.sim.watch_stop()
        stop = set_stop(rig, True, "demo")
        a = answer(rig, stop)
        devices = {d["device"]: d for d in a["devices"]}
        assert sorted(devices) == ["roi_arm", "roi_wheel"], devices  # roi_io has no stop_outputs
        assert devices["roi_wheel"]["error"] == "" and devices["roi_wheel"]["written_ts"] is not None
        arm = devices["roi_arm"]
        if length_feedback:
            assert arm["error"] == "" and arm["written_ts"] is not None, arm
            assert 30 in rig.sim.stop_stamps()
        else:
            assert arm["error"].startswith("nothing sent: the actuator's position is unknown"), arm
            assert "answers GET_CURRENT_LENGTH with 0" in arm["error"] and arm["written_ts"] is None, arm
            assert 30 not in rig.sim.stop_stamps()
    finally:
        clear_stop(rig)
        rig.close()


def test_a_stop_the_module_does_not_acknowledge_is_written_until_it_does(broker_session: Broker) -> None:
    """The wheel's replies lost past the stop's resend ladder: the answer says the stop is not acknowledged (and
    that it is written again every second); the module answers again while the stop holds: it gets the stop, and
    the answer's error clears with the write that holds. Before: after the ladder nothing more was sent, and the
    error stayed."""
    r = make_rig(broker_session, MODULES, root=fresh_root())
    try:
        assert wait_until(lambda: operational(r, "wheel"), DEADLINE), health(r, "wheel")
        stop_pkt = _velocity(0.0)
        r.sim.record_wire(lambda rec: None)  # the simulator keeps its wire log
        r.sim.set_faults(20, drop_replies=True)
        stop = set_stop(r, True, "replies lost for long")
        failed = answer(r, stop)
        d = next(d for d in failed["devices"] if d["device"] == "wheel")
        assert "no reply" in d["error"] and "written again every" in d["error"], d
        writes = sum(same(rec, stop_pkt) for rec in r.sim.wire_log(20))
        r.sim.set_faults(20, drop_replies=False)

        def cleared(a: dict[str, Any]) -> bool:
            w = next((x for x in a["devices"] if x["device"] == "wheel"), None)
            return a["stop_ts"] == stop.ts and w is not None and w["error"] == "" and w["written_ts"] is not None
        suffix = answer_topic(r.client.root, r.node)[len(f"{r.client.root}/{r.node}"):]
        assert r.bus.wait(suffix, cleared, timeout=DEADLINE) is not None, r.bus.latest(suffix)
        assert sum(same(rec, stop_pkt) for rec in r.sim.wire_log(20)) > writes  # written again after the ladder
    finally:
        clear_stop(r)
        r.close()
