"""A command's reply as JSON bytes, written straight from the dicts `_reply_model` builds (issue #12).

`DexterCommandReply` (models.py) stays the contract and the AsyncAPI schema; this writes the same bytes its
serializer would (`model_validate` then `model_dump_json`) for the layouts every status-carrying command
returns, without building the ten nested models first: the reply's model and JSON were ~50 µs of a ~600 µs
round trip. tests/dexter_gateway/test_status.py proves the bytes identical to the model's on random replies.
Anything outside the fixed layout (a read block, a g≠0 raw layout) goes through the model as before.

Formatting rules that make the bytes identical (pydantic-core's JSON writer):
* floats: Python's `repr` gives the same shortest round-trip digits; only exponent notation differs
  (pydantic writes 1e-5 as 0.00001 and 1.5e-07 as 1.5e-7), so any repr with an `e` goes through pydantic-core;
* ints as `str`, bools as true/false, None as null;
* strings: `json.dumps(s, ensure_ascii=False)` (UTF-8, the same escapes).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import to_json

_dumps = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: no per-call keyword handling


def _f(x: float) -> str:
    r = repr(float(x))  # ints in a float field are dumped as floats by the model (1 -> 1.0)
    if "e" in r or "n" in r:  # exponent notation, inf, nan: pydantic-core's own writer
        return to_json(float(x)).decode()
    return r


def _s(s: str) -> str:
    return _dumps(s)


_ERR_JSON: dict[tuple[int, int, tuple[str, ...], str], str] = {}


def _error(e: dict[str, Any]) -> str:
    key = (e["value"], e["code"], tuple(e["flags"]), e["message"])
    j = _ERR_JSON.get(key)
    if j is None:
        flags = ",".join(_s(f) for f in e["flags"])
        j = f'{{"value":{int(e["value"])},"code":{int(e["code"])},"flags":[{flags}],"message":{_s(e["message"])}}}'
        if len(_ERR_JSON) >= 256:  # a garbled stream must not grow it without bound
            _ERR_JSON.clear()
        _ERR_JSON[key] = j
    return j


def _joint(j: dict[str, Any]) -> str:
    return (f'{{"angle_deg":{_f(j["angle_deg"])},"angle_rad":{_f(j["angle_rad"])},'
            f'"angle_arcsec":{int(j["angle_arcsec"])},"delta_deg":{_f(j["delta_deg"])},'
            f'"pid_delta_deg":{_f(j["pid_delta_deg"])},"force_delta_deg":{_f(j["force_delta_deg"])},'
            f'"measured_deg":{_f(j["measured_deg"])},"measured_rad":{_f(j["measured_rad"])},'
            f'"measured_arcsec":{int(j["measured_arcsec"])},"sent_raw":{int(j["sent_raw"])},'
            f'"sin_raw":{int(j["sin_raw"])},"cos_raw":{int(j["cos_raw"])}}}')


def _servo(s: dict[str, Any]) -> str:
    return (f'{{"position_units":{int(s["position_units"])},"load_units":{int(s["load_units"])},'
            f'"error_flags":{int(s["error_flags"])},"angle_deg":{_f(s["angle_deg"])},'
            f'"angle_rad":{_f(s["angle_rad"])}}}')


def standard_status_json(st: dict[str, Any]) -> str:
    """`DexterStatus` (g0 layout, as `status_dict` builds it) as JSON text."""
    joints = ",".join(_joint(j) for j in st["joints"])
    return (f'{{"ts":{_f(st["ts"])},"robot_time":{_f(st["robot_time"])},'
            f'"instruction_id":{int(st["instruction_id"])},"oplet":{_s(st["oplet"])},"error":{_error(st["error"])},'
            f'"status_mode":{_s(st["status_mode"])},"joints":[{joints}],"j6":{_servo(st["j6"])},'
            f'"j7":{_servo(st["j7"])},"end_effector_io":{int(st["end_effector_io"])},'
            f'"phui_button":{"true" if st["phui_button"] else "false"},"raw":null}}')


def fits(out: dict[str, Any]) -> bool:
    """Whether `command_reply_json` writes this reply: a standard-layout status, no read block."""
    st = out.get("status")
    return "read" not in out and st is not None and "joints" in st


def command_reply_json(out: dict[str, Any]) -> bytes:
    """`DexterCommandReply.model_validate(out).model_dump_json()` as bytes, for replies that `fits`."""
    return (f'{{"request":{_s(out["request"])},"instruction_id":{int(out["instruction_id"])},'
            f'"oplet":{_s(out["oplet"])},"rtt_ms":{_f(out["rtt_ms"])},"error":{_error(out["error"])},'
            f'"status":{standard_status_json(out["status"])},"read":null}}').encode()
