"""PalmDriver against PalmModel, cycle by cycle on a simulated clock (no threads, no timing)."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ethercat_loop import protocol as p
from services.ethercat_loop.calibration import HandCalibration, PiecewiseLinear
from services.ethercat_loop.control import (
    CanFrame,
    CanTx,
    Halt,
    MotorConfig,
    NullifyDemands,
    ResetMotors,
    SetCanDirect,
    SetControlMode,
    SetDemands,
    SetMotorConfig,
    SetPolling,
    SetTestMode,
    SystemControls,
)
from services.ethercat_loop.driver import MAX_NON_DEMAND_CYCLES, PalmDriver
from services.ethercat_loop.palm_model import PalmModel

MS = 1_000_000


def apply(driver, msg):
    """What the node does with a control message: validate once (the service), then apply (the cycle)."""
    err = msg.validate(driver.mode)
    if err is None:
        msg.apply(driver)
    return err


class Rig:
    """Driver + model + a simulated clock; records every command and status."""

    def __init__(self, protocol="0220", **kw):
        self.driver = PalmDriver(protocol, **kw)
        self.model = PalmModel(protocol, calibration=self.driver.cal)
        self.t = 0
        self.status = None
        self.commands: list[p.PalmCommand] = []
        self.statuses: list[p.PalmStatus] = []

    def run(self, n=1, lose=False):
        for _ in range(n):
            self.t += MS
            raw = self.driver.cycle(None if lose else self.status, self.t)
            cmd = p.unpack_command(raw, self.driver.protocol)
            assert isinstance(cmd, p.PalmCommand)
            self.commands.append(cmd)
            self.status = self.model.exchange(raw)
            st = p.unpack_status(self.status, self.driver.protocol)
            assert isinstance(st, p.PalmStatus)
            self.statuses.append(st)
        return self

    def snap(self):
        return self.driver.snapshot()


@pytest.fixture(params=["0220", "0230"])
def rig(request):
    return Rig(request.param)


def test_parity_alternates_and_data_types_go_in_pairs(rig):
    rig.run(40)
    which = [c.which_motors for c in rig.commands]
    assert which[:6] == [0, 1, 0, 1, 0, 1]
    for even, odd in zip(rig.commands[0::2], rig.commands[1::2], strict=True):
        assert even.from_motor_data_type == odd.from_motor_data_type
    st = rig.statuses[-1]
    assert st.edc_command == p.EdcCommand.SENSOR_DATA
    assert st.which_motor_data_arrived == (0xAAAAA if st.which_motors else 0x55555)
    snap = rig.snap()
    assert len(snap.tactile) == 5 and snap.tactile_valid == 0x1F
    if rig.driver.protocol == "0230":
        assert len(snap.tactile[0]) == 16 and len(snap.tactile_mid_prox) == 5 and len(snap.aux_spi) == 16
    else:
        assert len(snap.tactile[0]) == 8 and snap.tactile_mid_prox == ()


def test_initialisation_polls_init_types_then_operation(rig):
    rig.run(3)
    assert rig.snap().phase == "init"
    rig.run(400)
    s = rig.snap()
    assert s.phase == "operation" and s.counters["init_timeout"] == 0
    init_types = {p.FromMotorDataType.SLOW_MISC, p.FromMotorDataType.PTERM, p.FromMotorDataType.ITERM,
                  p.FromMotorDataType.DTERM}
    asked = [c.from_motor_data_type for c in rig.commands]
    assert init_types <= set(asked[:200])
    # slow data collected per motor: firmware revision, serial, gear ratio...
    m = s.motors[7]
    assert m.slow["svn_revision"] == 1930 and m.slow["serial_number_low"] == 2007 and m.slow["gear_ratio"] == 131
    assert len(m.slow) == 16 and set(m.terms) == {"pterm", "iterm", "dterm"}
    # in operation, init-only types are no longer asked for; important ones go round robin
    late = set(asked[-100:])
    assert not late & {p.FromMotorDataType.PTERM, p.FromMotorDataType.SLOW_MISC}
    assert {p.FromMotorDataType.SGL, p.FromMotorDataType.SGR, p.FromMotorDataType.PWM, p.FromMotorDataType.FLAGS,
            p.FromMotorDataType.CURRENT} <= late


def test_timed_types_follow_their_period():
    r = Rig(polling={"flags": -1, "current": -1, "temperature": 0.1, "slow_data": -2})
    r.run(1000)
    temp_pairs = sum(1 for c in r.commands[::2] if c.from_motor_data_type == p.FromMotorDataType.TEMPERATURE)
    assert 9 <= temp_pairs <= 11  # every 100 ms over 1 s
    s = r.snap()
    assert s.motors[0].temperature == pytest.approx(30.0, abs=1) and s.motors[0].voltage is None


def test_init_timeout_with_a_silent_motor():
    r = Rig()
    r.model.silence_motor(5)
    r.run(5200)
    s = r.snap()
    assert s.phase == "operation" and s.counters["init_timeout"] == 1
    assert s.motors[5].missed > 1000 and s.motors[5].last_seen_ns is None
    assert s.motors[4].missed == 0 and s.counters["motor_missing"] == s.motors[5].missed


def test_polling_config_is_validated():
    d = PalmDriver()
    assert apply(d, SetPolling({"nonsense": 1})) is not None
    assert apply(d, SetPolling({"flags": 0})) is not None
    assert apply(d, SetPolling({"flags": 0.5})) is None


def test_torque_demand_moves_the_motor_and_the_deadman_zeroes_it(rig):
    rig.run(10)
    assert apply(rig.driver, SetControlMode("torque")) is None
    assert apply(rig.driver, SetDemands({3: 800})) is None
    rig.run(60)
    assert rig.commands[-1].to_motor_data_type == p.ToMotorDataType.DEMAND_TORQUE
    assert rig.commands[-1].motor_data[3] == 800 and rig.model.motors[3].torque == pytest.approx(800, abs=2)
    joint_before = rig.model.angles["MFJ1"]
    rig.run(60)  # past demand_timeout_ms = 100
    assert rig.commands[-1].motor_data[3] == 0
    assert rig.model.motors[3].demand == 0 and rig.snap().counters["demands_expired"] == 1
    assert rig.model.angles["MFJ1"] > joint_before - 1e-9  # the tendon pulled the joint along
    s = rig.snap()
    assert s.motors[3].torque is not None and abs(s.motors[3].torque) < 800


def test_pwm_mode_and_ranges():
    r = Rig()
    assert r.driver.mode == "pwm"
    assert apply(r.driver, SetDemands({0: 0x400})) is not None  # out of the PWM range
    assert apply(r.driver, SetDemands({20: 1})) is not None  # no motor 20
    assert apply(r.driver, SetDemands({0: -0x3FF})) is None
    r.run(4)
    assert r.commands[-1].to_motor_data_type == p.ToMotorDataType.DEMAND_PWM
    assert r.commands[-1].motor_data[0] == -0x3FF and r.model.motors[0].pwm == -0x3FF
    apply(r.driver, SetControlMode("torque"))  # switching zeroes every demand
    r.run(1)
    assert r.commands[-1].motor_data[0] == 0


def test_halt_and_nullify_zero_demands(rig):
    apply(rig.driver, SetDemands({1: 100, 2: -100}))
    rig.run(3)
    assert rig.commands[-1].motor_data[1:3] == (100, -100)
    apply(rig.driver, NullifyDemands(True))
    apply(rig.driver, SetDemands({1: 100}))
    rig.run(2)
    assert set(rig.commands[-1].motor_data) == {0}
    apply(rig.driver, NullifyDemands(False))
    apply(rig.driver, SetDemands({1: 100}))
    rig.run(2)
    assert rig.commands[-1].motor_data[1] == 100
    apply(rig.driver, Halt())
    apply(rig.driver, SetDemands({1: 100}))
    rig.run(5)
    assert set(rig.commands[-1].motor_data) == {0} and rig.snap().counters["halt_zero_cycles"] == 5


def test_config_push_one_type_per_cycle_ending_with_the_crc(rig):
    rig.run(10)
    cfg = MotorConfig(torque_limit=300, torque_limiter_gain=-64, max_pwm=500, sgl_ref=3, sgr_ref=4, f=500, p=6200,
                      i=10, d=20, imax=100, deadband=5, sign=1)
    assert apply(rig.driver, SetMotorConfig((2, 11), cfg)) is None
    n = len(rig.commands)
    rig.run(11)
    pushed = rig.commands[n:]
    assert [c.to_motor_data_type for c in pushed] == list(range(0x5, 0x10))
    words = cfg.words()
    for c in pushed[:-1]:
        assert c.motor_data[2] == p.s16(words[c.to_motor_data_type]) == c.motor_data[11]
        assert c.motor_data[0] == 0
    assert pushed[-1].motor_data[2] & 0xFFFF == p.config_crc(words) and pushed[-1].motor_data[5] == 0
    assert rig.model.motors[2].config[p.ToMotorDataType.CONFIG_P] == 6200
    assert rig.model.motors[11].config_accepted == 1 and rig.model.motors[0].config_accepted == 0
    assert rig.snap().counters["configs_sent"] == 1
    rig.run(1)
    assert rig.commands[-1].to_motor_data_type == p.ToMotorDataType.DEMAND_PWM


def test_bad_crc_and_out_of_range_config_are_flagged_by_the_motor():
    r = Rig()
    m = r.model.motors[4]
    words = [1] * 10
    for t, w in zip(p.CONFIG_TYPES, words, strict=True):
        r.model._to_motors(t, tuple(w if i == 4 else 0 for i in range(20)))
    r.model._to_motors(p.ToMotorDataType.CONFIG_CRC, tuple((p.config_crc(words) ^ 1) if i == 4 else 0
                                                           for i in range(20)))
    assert m.flags & p.MotorFlag.LAST_CONFIG_CRC_FAILED and m.config_accepted == 0
    words = [0x7FFF, 0, 0, 0, 0, 0, 0, 0, 0x7FFF, 0]  # IMAX 0x7FFF > 0x3FFF
    for t, w in zip(p.CONFIG_TYPES, words, strict=True):
        r.model._to_motors(t, tuple(p.s16(w) if i == 4 else 0 for i in range(20)))
    r.model._to_motors(p.ToMotorDataType.CONFIG_CRC, tuple(p.s16(p.config_crc(words)) if i == 4 else 0
                                                           for i in range(20)))
    assert m.flags & p.MotorFlag.LAST_CONFIG_OUT_OF_RANGE and not m.flags & p.MotorFlag.LAST_CONFIG_CRC_FAILED
    assert p.flag_names(m.flags) == ["last_config_out_of_range"]


def test_queued_configs_never_starve_the_demands():
    r = Rig()
    for _ in range(5):
        apply(r.driver, SetMotorConfig(tuple(range(20)), MotorConfig(f=1)))
    r.run(80)
    gap = longest = 0
    for c in r.commands:
        gap = 0 if c.to_motor_data_type in (1, 2) else gap + 1
        longest = max(longest, gap)
    assert longest <= MAX_NON_DEMAND_CYCLES
    assert not any(m.flags & p.MotorFlag.NO_DEMAND_SEEN for m in r.model.motors)


def test_system_controls_and_reset(rig):
    rig.run(4)
    apply(rig.driver, SystemControls((0, 13), int(p.SystemControl.BACKLASH_COMPENSATION_DISABLE
                                                  | p.SystemControl.INITIATE_JIGGLING | p.SystemControl.EEPROM_WRITE)))
    apply(rig.driver, ResetMotors((13,)))
    rig.run(2)
    ctl, rst = rig.commands[-2:]
    assert ctl.to_motor_data_type == p.ToMotorDataType.SYSTEM_CONTROLS and ctl.motor_data[13] == 0xC2
    assert ctl.motor_data[1] == 0
    assert rst.to_motor_data_type == p.ToMotorDataType.SYSTEM_RESET and rst.motor_data[13] == 0x5203
    assert rig.model.motors[0].backlash is False and rig.model.motors[0].eeprom_writes == 1
    assert rig.model.motors[13].resets == 1 and rig.model.motors[0].resets == 0
    rig.run(30)
    flags = rig.snap().motors[0].flag_names
    assert "jiggling_in_progress" in flags


def test_dropped_lost_and_garbage_statuses_are_counted_and_skipped():
    r = Rig()
    r.run(20)
    r.model.drop_status(3)
    r.run(3)
    r.run(1)  # the driver decodes the third dropped status on this cycle
    r.run(2, lose=True)
    s = r.snap()
    assert s.counters["dropped"] == 3 and s.counters["lost"] == 3  # 2 + the first cycle, which has no status
    before = s.counters["statuses"]
    for junk in (b"", b"\xff" * 232, b"\x01" * 10):
        r.t += MS
        r.driver.cycle(junk, r.t)
    s = r.snap()
    assert s.counters["decode_errors"] == 3 and s.counters["statuses"] == before
    assert s.joints and s.joints[0].name == "FFJ0"


def test_flags_temperature_and_serious_errors():
    r = Rig(polling={"flags": -1, "temperature": -1, "current": -1, "voltage": -1})
    r.model.overheat_motor(6)
    r.model.corrupt_motor_data(9)
    r.run(200)
    s = r.snap()
    m6 = s.motors[6]
    assert m6.temperature is not None and m6.temperature > 60
    assert m6.serious and "over_temperature" in m6.flag_names
    assert s.motors[9].data_errors > 0 and s.motors[9].flags is None
    assert s.motors[6].voltage == pytest.approx(24.0) and s.motors[0].current == 0.0
    assert not s.motors[0].serious


def test_channel_number_test_mode(rig):
    rig.run(4)
    apply(rig.driver, SetTestMode(p.EdcCommand.SENSOR_CHANNEL_NUMBERS))
    rig.run(3)
    st = rig.statuses[-1]
    assert st.edc_command == p.EdcCommand.SENSOR_CHANNEL_NUMBERS
    assert st.sensors[p.SENSOR_INDEX["LFJ5"]] == 0x0605
    joints_before = rig.snap().joints
    apply(rig.driver, SetTestMode(p.EdcCommand.SENSOR_DATA))
    rig.run(2)
    assert rig.statuses[-1].sensors[p.SENSOR_INDEX["LFJ5"]] != 0x0605
    assert joints_before  # the joints kept the last real sensor data during the test


def test_joint_calibration_matches_the_model(rig):
    apply(rig.driver, SetControlMode("torque"))
    apply(rig.driver, SetDemands({0: 900}))  # FFJ0: pulls FFJ1 and FFJ2
    rig.run(80)
    s = rig.snap()
    j = {x.name: x for x in s.joints}
    a = rig.model.angles
    assert j["FFJ1"].position == pytest.approx(a["FFJ1"], abs=0.01)
    assert j["FFJ0"].position == pytest.approx(j["FFJ1"].position + j["FFJ2"].position)
    assert j["THJ5"].raw == (rig.model.joint_raw("THJ5"),) * 2
    assert j["WRJ1"].position == pytest.approx(a["WRJ1"], abs=0.01)
    assert len(s.joints) == 28 and len(s.sensors_raw) == 37


def test_a_snapshot_without_motors_has_the_same_joints_and_counters(rig):
    """What the joints state (100 Hz) takes: no motor views, and nothing else differs; the motor blocks
    kept for later are applied by the next full snapshot, as if it had been taken all along."""
    apply(rig.driver, SetControlMode("torque"))
    apply(rig.driver, SetDemands({0: 900}))
    rig.run(80)
    lean = rig.driver.snapshot(motors=False)
    full = rig.snap()
    assert lean.motors == () and len(full.motors) == 20
    assert lean.joints == full.joints and lean.sensors_raw == full.sensors_raw and lean.counters == full.counters
    assert full.motors[0].demand == 900 and all(m.last_seen_ns is not None for m in full.motors)


def test_piecewise_linear_extrapolates_and_inverts():
    f = PiecewiseLinear.from_degrees([(1000, 0.0), (2000, 90.0), (3000, 100.0)])
    assert f(1500) == pytest.approx(0.785398, abs=1e-5)
    assert f(500) == pytest.approx(-0.785398, abs=1e-5)
    assert f.inverse(f(2500)) == pytest.approx(2500)
    cal = HandCalibration.load()
    assert cal.motor_of_joint["FFJ0"] == 0 and cal.joint_of_motor[19] == "WRJ2"


def test_can_direct_mode_bridges_one_frame_each_way_one_cycle_later():
    class Echo:
        def __init__(self):
            self.seen = []

        def on_can_frame(self, bus, sid, data):
            self.seen.append((bus, sid, data))
            return [(bus, sid | 0x10, data)] if sid >> 9 == 3 else []

    r = Rig()
    echo = Echo()
    r.model.add_can_node(echo)
    r.run(5)
    apply(r.driver, SetCanDirect(True))
    apply(r.driver, CanTx((CanFrame(2, 0x60A, bytes.fromhex("55aa55aa55aa55aa")), CanFrame(1, 0x007, b""))))
    r.run(1)
    assert r.commands[-1].edc_command == p.EdcCommand.CAN_DIRECT_MODE
    assert r.commands[-1].can == p.CanBridgeFrame(2, 8, 0x60A, bytes.fromhex("55aa55aa55aa55aa"))
    assert set(r.commands[-1].motor_data) == {0}
    assert r.statuses[-1].can.empty  # never in the same cycle
    r.run(1)
    assert r.statuses[-1].can == p.CanBridgeFrame(2, 8, 0x61A, bytes.fromhex("55aa55aa55aa55aa"))
    assert echo.seen[0] == (2, 0x60A, bytes.fromhex("55aa55aa55aa55aa"))
    r.run(15)
    rx = r.driver.take_can_rx()
    # the echo, then the ten motor boards of bus 1 answering the data request, one per cycle
    assert rx[0].sid == 0x61A and rx[0].data == bytes.fromhex("55aa55aa55aa55aa")
    assert [f.sid for f in rx[1:]] == [p.make_sid(p.CanDirection.FROM_MOTOR, i, 7) for i in range(10)]
    assert len({f.cycle for f in rx}) == len(rx)
    assert r.driver.take_can_rx() == []
    r.run(10)  # no demands in direct mode: the motors stop themselves after 20 ms
    assert all(m.flags & p.MotorFlag.NO_DEMAND_SEEN for m in r.model.motors)
    apply(r.driver, SetCanDirect(False))
    r.run(2)
    assert r.snap().phase == "init"  # slow data (firmware revision...) is read again after direct mode
    assert r.commands[-1].edc_command == p.EdcCommand.SENSOR_DATA
    assert not any(m.flags & p.MotorFlag.NO_DEMAND_SEEN for m in r.model.motors)


def test_model_rejects_garbage_commands():
    m = PalmModel()
    assert m.exchange(b"\x01\x02") == bytes(232)
    assert m.command_errors == 1
    with pytest.raises(ValueError):
        PalmModel("0999")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["0220", "0230"]), st.data())
def test_any_status_bytes_never_break_the_cycle(proto, data):
    d = PalmDriver(proto)
    size = p.PROTOCOLS[proto].status_size
    for _ in range(3):
        buf = data.draw(st.one_of(st.binary(min_size=size, max_size=size), st.binary(max_size=600)))
        cmd = d.cycle(buf, 1_000_000)
        assert len(cmd) == p.PROTOCOLS[proto].command_size
    d.snapshot()


def test_messages_and_snapshots_pickle():
    msgs = [SetControlMode("torque"), SetDemands({1: 2}), NullifyDemands(), Halt(),
            SetMotorConfig((1,), MotorConfig(f=1)), SystemControls((1,), 0x40), ResetMotors((3,)),
            SetTestMode(2), SetCanDirect(True), CanTx((CanFrame(1, 2, b"\x01"),)), SetPolling({"flags": 0.5})]
    for m in msgs:
        assert pickle.loads(pickle.dumps(m)) == m
    r = Rig().run(30)
    snap = r.snap()
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_a_demand_never_takes_effect_after_its_deadline():
    """The client's own deadline for a demand (from its send time, shared.dispatch.request_deadline) reaches the
    driver with it: one already past it when the cycle takes it (it sat in a stalled node's socket) never goes on
    the wire; one that is not yet past it holds until it, or the deadman's 100 ms from the cycle it reached,
    whichever comes first. Made-up times: the rig's clock moves 1 ms a cycle."""
    r = Rig()
    r.run(10)
    apply(r.driver, SetDemands({0: 300}, deadline_ns=r.t))  # the next cycle runs 1 ms past it
    r.run(5)
    assert [c.motor_data[0] for c in r.commands[-5:]] == [0] * 5
    assert r.snap().counters["demands_late"] == 1 and r.model.motors[0].pwm == 0
    apply(r.driver, SetDemands({0: 300}, deadline_ns=r.t + 20 * MS))  # 20 ms left: the deadline, not the deadman
    n = len(r.commands)
    r.run(40)
    sent = [c.motor_data[0] for c in r.commands[n:]]
    assert sent[:20] == [300] * 20 and set(sent[20:]) == {0}, sent
    apply(r.driver, SetDemands({0: 300}, deadline_ns=r.t + 500 * MS))  # the deadman comes first
    apply(r.driver, SetDemands({1: 200}))  # no deadline given: the deadman alone
    n = len(r.commands)
    r.run(120)
    sent0 = [c.motor_data[0] for c in r.commands[n:]]
    sent1 = [c.motor_data[1] for c in r.commands[n:]]
    assert sent0[:101] == [300] * 101 and set(sent0[101:]) == {0}, sent0
    assert sent1[:101] == [200] * 101 and set(sent1[101:]) == {0}, sent1
