"""What the palm's health judges (health.py), pure: made-up loop statistics, snapshots and times. Loss counts over
their thresholds are a warning, a problem once sustained; a serious motor flag is a fault, an event once per
change; the no-demand flag is expected for a second after CAN direct mode; a motor is silent only once data have
flowed longer than the silence limit; the details and the finer state."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.ethercat_loop.health import LossJudge, MotorWatch, health_details, palm_state, realtime_details
from services.ethercat_loop.models import EthercatLoopStats
from services.ethercat_loop.protocol import EdcCommand, MotorFlag
from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.snapshot import PalmMotorSnapshot, PalmSnapshot

T0 = 500.0  # an arbitrary CLOCK_MONOTONIC, seconds
NS = 1_000_000_000
SETTINGS = EthercatSettings(ethercat_lost_threshold=10, ethercat_drop_threshold=10, ethercat_loss_sustain_s=3.0,
                            ethercat_overrun_threshold=5, ethercat_silent_motor_ms=500)


def stats(**kw: Any) -> EthercatLoopStats:
    return EthercatLoopStats(ts=0.0, **kw)


def motor(i: int, flags: int = 0, last_seen_ns: int | None = 0) -> PalmMotorSnapshot:
    return PalmMotorSnapshot(
        id=i, joint=f"J{i}", torque=0, demand=0, demand_sent=0, flags=flags, flag_names=(), serious=False,
        temperature=None, current=None, voltage=None, pwm=None, sgl=None, sgr=None, last_seen_ns=last_seen_ns,
        missed=0, data_errors=0, slow={}, last_config=None, can_received=None, can_transmitted=None, can_errors=None,
        terms={})


def snapshot(*motors: PalmMotorSnapshot, now_ns: int = 0, **kw: Any) -> PalmSnapshot:
    base = PalmSnapshot(
        cycle=5000, now_ns=now_ns, protocol="0220", phase="operation", mode="torque",
        edc_command=EdcCommand.SENSOR_DATA, edc_echo=EdcCommand.SENSOR_DATA, status_count=5000, can_direct=False,
        halted=False, nullified=False, joints=(), sensors_raw=(), motors=motors, tactile_type=0, tactile_valid=0,
        tactile=(), tactile_mid_prox=(), aux_spi_type=0, aux_spi=(), imu=(), analog=(), idle_time_us=0, counters={})
    return replace(base, **kw)


def test_losses_are_a_warning_then_a_problem_once_sustained() -> None:
    j = LossJudge(SETTINGS)
    assert j.judge(stats(frames_lost=10), T0) == ([], [])  # at the threshold: fine
    problems, warnings = j.judge(stats(frames_lost=11, overruns=6), T0)
    assert problems == [] and len(warnings) == 2 and all(w.startswith("warning: ") for w in warnings)
    problems, warnings = j.judge(stats(frames_lost=11), T0 + 2.9)
    assert problems == [] and "11 frames lost" in warnings[0]
    problems, _ = j.judge(stats(frames_lost=11, drops=12), T0 + 3.0)  # sustained: not operational
    assert problems == ["11 frames lost in the last second (threshold 10), for 3 s",
                        "12 dropped statuses in the last second (threshold 10), for 3 s"]
    assert j.judge(stats(), T0 + 4.0) == ([], [])  # a good second starts it over
    assert j.judge(stats(wkc_errors=11), T0 + 4.5)[0] == []
    _, warnings = j.judge(stats(outages=1), T0 + 5.0)
    assert warnings == ["warning: 1 outage(s) of 20 cycles or more without valid process data in the last second"]


def test_a_serious_flag_is_a_fault_and_an_event_once_per_change() -> None:
    w = MotorWatch(500)
    bad = int(MotorFlag.A3950_NFAULT)
    faults, new = w.judge(snapshot(motor(0, bad), motor(1)), T0, heard_since=T0)
    assert faults == ["motor 0 (J0): a3950_nfault"] and [(m.id, b) for m, b in new] == [(0, ["a3950_nfault"])]
    faults, new = w.judge(snapshot(motor(0, bad), motor(1)), T0 + 0.25, heard_since=T0)
    assert faults == ["motor 0 (J0): a3950_nfault"] and new == []  # the same flags: no second event
    assert w.judge(snapshot(motor(0), motor(1)), T0 + 0.5, heard_since=T0) == ([], [])
    assert len(w.judge(snapshot(motor(0, bad)), T0 + 0.75, heard_since=T0)[1]) == 1  # back: an event again


def test_no_demand_is_expected_for_a_second_after_can_direct() -> None:
    w = MotorWatch(500)
    no_demand = int(MotorFlag.NO_DEMAND_SEEN)
    assert w.judge(snapshot(motor(0, no_demand), can_direct=True), T0, heard_since=T0 - 10)[0] == []
    assert w.judge(snapshot(motor(0, no_demand)), T0 + 0.99, heard_since=T0 - 10)[0] == []
    assert w.judge(snapshot(motor(0, no_demand)), T0 + 1.0, heard_since=T0 - 10)[0] == [
        "motor 0 (J0): no_demand_seen"]


def test_a_motor_is_silent_only_once_data_flowed_longer_than_the_limit() -> None:
    w = MotorWatch(500)
    s = snapshot(motor(0, last_seen_ns=0), motor(1, last_seen_ns=NS), now_ns=NS)  # motor 0 unseen for 1 s
    assert w.judge(s, T0 + 0.5, heard_since=T0)[0] == []  # data back for 0.5 s only: every motor was unseen
    assert w.judge(s, T0 + 0.6, heard_since=T0)[0] == ["motor 0 (J0) not answering"]
    assert w.judge(replace(s, can_direct=True), T0 + 0.6, heard_since=T0)[0] == []  # direct: not judged
    assert w.judge(replace(s, cycle=1000), T0 + 0.6, heard_since=T0)[0] == []  # starting up
    assert w.judge(replace(s, phase="init"), T0 + 0.6, heard_since=T0)[0] == []


def test_the_palm_state_and_the_details() -> None:
    s = snapshot()
    assert palm_state(s, {}) == "running"
    assert palm_state(replace(s, phase="init"), {}) == "initializing"
    assert palm_state(replace(s, edc_command=EdcCommand.SENSOR_CHANNEL_NUMBERS), {}) == "test_mode"
    assert palm_state(replace(s, can_direct=True), {}) == "can_direct"
    assert palm_state(replace(s, can_direct=True), {"issue": "slave 1 in SAFE-OP"}) == "slave_recovery"
    info = {"vendor": 0x530, "state": "op", "issue": "", "restarts": 2, "last_exit": "signal 9",
            "recovery": {"escalations": 1, "steps": [[i * NS, f"step {i}"] for i in range(20)]}}
    d = health_details(info, stats(totals={"stale": 3}), 20 * NS)
    assert d["vendor"] == 0x530 and d["product"] is None
    assert d["bus"] == {"cycle": "op", "issue": "", "stale_replies": 3}
    assert d["restarts"] == 2 and d["last_exit"] == "signal 9"
    steps = d["recovery"]["steps"]
    assert len(steps) == 12 and steps[0] == {"ago_s": 12.0, "step": "step 8"}
    assert steps[-1] == {"ago_s": 1.0, "step": "step 19"}  # the last 12, newest last
    assert d["recovery"]["rescans"] == 0
    assert realtime_details({}, stats()) is None  # no realtime cycle (the model)
    assert realtime_details({"warnings": ["no SCHED_FIFO"], "realtime_policy": "other"}, stats(
        realtime={"policy": "", "warnings": ["no mlockall"]})) == {"policy": "other",
                                                                   "warnings": ["no mlockall", "no SCHED_FIFO"]}
