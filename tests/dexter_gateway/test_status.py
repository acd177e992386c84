"""The status every reply carries: `status_model` (one pass from the 60 ints) against the reference decoder; and a
command's reply as published (`reply_dict` through pydantic-core's `to_json`, no model) against the model's JSON."""

from __future__ import annotations

import math
import struct

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic_core import to_json

from services.dexter_gateway import protocol as p
from services.dexter_gateway.device import error_info, reply_dict, status_model
from services.dexter_gateway.models import DexterCommandReply, DexterJoint, DexterServo, DexterStatus
from services.dexter_gateway.transport import LinkReply
from shared.payloads import dump

INT32 = st.integers(-(2**31), 2**31 - 1)


def reference(reply: p.Reply, mode: str, deg_per_unit: float, j6_zero: int, ts: float) -> DexterStatus:
    """The status built through `p.decode_status` (§3.2) and one model per part, as the gateway did before."""
    head = dict(ts=ts, robot_time=reply.robot_time, instruction_id=reply.instruction_id, oplet=reply.oplet,
                error=error_info(reply.error), status_mode=mode)
    if mode != "0":
        return DexterStatus(**head, raw=list(reply.ints))
    s = p.decode_status(reply, deg_per_unit, j6_zero)
    joints = [DexterJoint(angle_deg=j.angle_deg, angle_rad=math.radians(j.angle_deg), angle_arcsec=j.angle_arcsec,
                          delta_deg=j.delta_deg, pid_delta_deg=j.pid_delta_deg, force_delta_deg=j.force_delta_deg,
                          measured_deg=j.measured_deg, measured_rad=math.radians(j.measured_deg),
                          measured_arcsec=j.measured_arcsec, sent_raw=j.sent_raw, sin_raw=j.sin_raw,
                          cos_raw=j.cos_raw) for j in s.joints]

    def servo(v: p.ServoStatus) -> DexterServo:
        return DexterServo(position_units=v.position_units, load_units=v.load_units, error_flags=v.error_flags,
                           angle_deg=v.angle_deg, angle_rad=math.radians(v.angle_deg))
    return DexterStatus(**head, joints=joints, j6=servo(s.j6), j7=servo(s.j7), end_effector_io=s.end_effector_io,
                        phui_button=s.phui_button)


@settings(max_examples=300, deadline=None)
@given(st.lists(INT32, min_size=60, max_size=60), st.integers(0, 999_999), st.integers(33, 126),
       st.sampled_from(["0", "0", "1", "a"]), st.sampled_from([p.XL320_DEG_PER_UNIT, 360 / 4096]),
       st.integers(0, 1023))
def test_status_model_equals_the_reference_decoder(ints: list[int], us: int, oplet: int, mode: str, dpu: float,
                                                   j6_zero: int) -> None:
    ints[3], ints[4] = us, oplet  # a reply decode_reply accepts
    reply = p.decode_reply(struct.pack("<60i", *ints))
    fast = status_model(reply, mode, dpu, j6_zero, 12.5)
    ref = reference(reply, mode, dpu, j6_zero, 12.5)
    assert fast == ref
    assert fast.model_dump_json() == ref.model_dump_json()  # the same bytes on the bus


def test_status_model_decodes_known_values() -> None:
    ints = [0] * 60
    ints[3], ints[4], ints[5] = 7, ord("h"), (1 << 30) | 3  # monitor flag + basic error 3
    ints[10], ints[11], ints[16] = 36000, 3600, -7200  # J1: 10 deg, delta 1 deg, measured -2 deg
    ints[41] = 16 * 3600  # J4 delta: 1/16 arcsec on the wire -> 1 deg
    ints[18], ints[38], ints[58] = 100, 612, 0x0201  # J7 100 units, J6 100 units past its zero, servo errors
    ints[9] = 1
    st_ = status_model(p.decode_reply(struct.pack("<60i", *ints)), "0", 0.29, 512, 1.0)
    assert st_.joints is not None and st_.j6 is not None and st_.j7 is not None
    j1 = st_.joints[0]
    assert (j1.angle_deg, j1.delta_deg, j1.measured_deg) == (10.0, 1.0, -2.0)
    assert math.isclose(j1.angle_rad, math.pi / 18)
    assert st_.joints[3].delta_deg == 1.0
    assert math.isclose(st_.j7.angle_deg, 29.0) and math.isclose(st_.j6.angle_deg, 29.0)
    assert (st_.j6.error_flags, st_.j7.error_flags) == (1, 2)
    assert st_.phui_button is True and st_.end_effector_io == 1
    assert st_.error.code == 3 and st_.error.flags == ["monitor"]


@settings(max_examples=400, deadline=None)
@given(st.lists(INT32, min_size=60, max_size=60), st.integers(0, 999_999),
       st.sampled_from("hgaRPMTSBzwF" + "r" * 4 + "?~!"), st.sampled_from(["0", "0", "1", "a"]),
       st.sampled_from([p.XL320_DEG_PER_UNIT, 360 / 4096, 1.0]), st.integers(0, 1023), st.booleans(),
       st.floats(0, 2000, allow_nan=False), st.binary(max_size=62), st.sampled_from([0, 2, 10, 16, 29, 1 << 30]))
def test_the_published_reply_is_the_models_json(ints: list[int], us: int, oplet: str, mode: str, dpu: float,
                                                j6_zero: int, errno_reply: bool, rtt_ms: float, payload: bytes,
                                                error: int) -> None:
    """Commands publish `to_json(reply_dict(...))` without a model (kit `Serialized`): it must be, byte for byte,
    what validating that dict into `DexterCommandReply` and dumping the model gives, for every layout (the
    standard status, raw g≠0 modes, `r` blocks: text, binary, empty) and error word."""
    ints[3], ints[4] = us, ord(oplet)
    if oplet == "r":
        ints[5], ints[6] = error, len(payload)
        raw = bytearray(struct.pack("<60i", *ints))
        raw[p.PAYLOAD_START:p.PAYLOAD_START + len(payload)] = payload
        reply = p.decode_reply(bytes(raw))
    else:
        reply = p.decode_reply(struct.pack("<60i", *ints))
    req = p.build_request("r", ("0", "/srv/samba/share/x")) if oplet == "r" else p.Request(oplet)
    lr = LinkReply(req, reply, rtt_ms / 1000)
    try:
        d = reply_dict(lr, mode, dpu, j6_zero, 1795717385.371373, errno_reply=errno_reply)
    except p.ProtocolError:
        assume(False)
    published = to_json(d)
    assert published == dump(DexterCommandReply, d)
    assert DexterCommandReply.model_validate_json(published) == DexterCommandReply.model_validate(d)


def test_the_unit_settings_reach_the_reply_as_floats() -> None:
    """A float field must get a float: an int 1 would be written `1` where the model writes `1.0`, so the settings
    that scale the servo angles are floats even when given as integers."""
    from services.dexter_gateway.settings import DexterSettings

    s = DexterSettings(dexter_servo_deg_per_unit=1)
    assert type(s.dexter_servo_deg_per_unit) is float
    reply = p.decode_reply(struct.pack("<60i", 5, 9, 1700000000, 0, ord("h"), 0, *range(54)))
    d = reply_dict(LinkReply(p.Request("h"), reply, 0.0), "0", s.dexter_servo_deg_per_unit, 512, 1.0)
    assert to_json(d) == dump(DexterCommandReply, d)
    # what the float setting guards against: an int scale writes J6/J7 angles as `29` where the model has `29.0`
    assert to_json(reply_dict(LinkReply(p.Request("h"), reply, 0.0), "0", 1, 512, 1.0)) != to_json(d)
