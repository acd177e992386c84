"""The sensors state built from a decoded packet: every field in place, NaN/inf as null, any 104 bytes
give a valid `EpuckSensors` whose JSON survives the contract's strict round trip; the gateway's path straight
from the wire values gives the same fields and the same JSON bytes as the decoded packet's."""

from __future__ import annotations

import math
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from services.epuck_gateway.device import sensors_fields, sensors_fields_of, sensors_model
from services.epuck_gateway.models import EpuckSensors
from services.epuck_gateway.protocol.wifi import (
    SENSORS_SIZE,
    EpuckRawSensors,
    StepUnwrapper,
    acc_to_g,
    battery_volts,
    gyro_to_dps,
)
from shared.payloads import dump


def _model(raw: EpuckRawSensors, seq: int = 7) -> EpuckSensors:
    return sensors_model(raw, 1234.5, seq, StepUnwrapper(), StepUnwrapper())


def test_every_field_lands_in_its_place() -> None:
    raw = EpuckRawSensors(acc=(1, -2, 768), acceleration=768.0, orientation=90.0, inclination=180.0,
                          gyro=(100, -200, 300), mag=(1.5, -2.5, 3.5), temperature=-5,
                          proximity=tuple(range(8)), ambient=tuple(range(100, 108)), tof=321,
                          mic=(11, 12, 13, 14), steps=(-1234, 32767), battery=3400, sd_state=1, tv_toggle=1,
                          tv_address=5, tv_data=6, selector=15, ground_proximity=(1, 2, 3),
                          ground_ambient=(4, 5, 6), button=1)
    m = _model(raw)
    assert (m.seq, m.ts) == (7, 1234.5)
    assert (m.acc_raw.x, m.acc_raw.y, m.acc_raw.z) == (1, -2, 768)
    assert m.acc_g.z == acc_to_g(768) and m.acceleration_g == acc_to_g(768.0)
    assert (m.orientation_deg, m.inclination_deg) == (90.0, 180.0)
    assert (m.gyro_raw.x, m.gyro_dps.y) == (100, gyro_to_dps(-200))
    assert (m.magnetometer_ut.x, m.magnetometer_ut.y, m.magnetometer_ut.z) == (1.5, -2.5, 3.5)
    assert m.temperature_c == -5 and m.tof_mm == 321
    assert m.proximity == list(range(8)) and m.ambient == list(range(100, 108))
    assert m.microphones.model_dump() == {"right": 11, "left": 12, "back": 13, "front": 14}
    assert m.steps.model_dump() == {"left": -1234, "right": 32767, "left_total": -1234, "right_total": 32767}
    assert m.battery_raw == 3400 and m.battery_v == round(battery_volts(3400), 4)
    assert m.sd_card is True and m.button is True and m.selector == 15
    assert m.tv_remote.model_dump() == {"toggle": 1, "address": 5, "data": 6}
    assert m.ground_proximity == [1, 2, 3] and m.ground_ambient == [4, 5, 6]


def test_non_finite_floats_are_null() -> None:
    m = _model(EpuckRawSensors(acceleration=math.nan, orientation=math.inf, inclination=-math.inf,
                               mag=(math.nan, 1.0, math.inf)))
    assert m.acceleration_raw is None and m.acceleration_g is None
    assert m.orientation_deg is None and m.inclination_deg is None
    assert (m.magnetometer_ut.x, m.magnetometer_ut.y, m.magnetometer_ut.z) == (None, 1.0, None)
    assert b"NaN" not in m.model_dump_json().encode() and b"Infinity" not in m.model_dump_json().encode()


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=SENSORS_SIZE, max_size=SENSORS_SIZE))
def test_any_packet_gives_a_state_that_passes_the_contract(data: bytes) -> None:
    m = _model(EpuckRawSensors.decode(data))
    text = m.model_dump_json()
    again = EpuckSensors.model_validate_json(text, strict=True)
    assert again.model_dump_json() == text
    assert struct.unpack_from("<3h", data) == (m.acc_raw.x, m.acc_raw.y, m.acc_raw.z)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=SENSORS_SIZE, max_size=SENSORS_SIZE), st.integers(0, 2**31), st.floats(0, 2e9))
def test_the_wire_path_gives_the_decoded_packets_fields_and_json(data: bytes, seq: int, ts: float) -> None:
    ul1, ur1, ul2, ur2 = StepUnwrapper(), StepUnwrapper(), StepUnwrapper(), StepUnwrapper()
    for _ in range(2):  # the unwrappers' second update counts on from the first
        decoded = sensors_fields(EpuckRawSensors.decode(data), ts, seq, ul1, ur1)
        wire = sensors_fields_of(data, ts, seq, ul2, ur2)
        assert wire == decoded
        assert [type(v) for v in wire.values()] == [type(v) for v in decoded.values()]
        assert (dump(EpuckSensors, EpuckSensors.model_validate(wire))
                == dump(EpuckSensors, EpuckSensors.model_validate(decoded)))
