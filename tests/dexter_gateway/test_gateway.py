"""The gateway process against a simulated DexRun and a real broker: the MQTT surface end to end."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from shared.rpc import RpcClient
from shared.tools.asyncapi import ContractValidator, build_document
from shared.tools.localbroker import Broker
from tests.dexter_gateway.conftest import NODE, Gateway, start_gateway, stop_gateway, wait_until


def test_status_is_published_decoded_with_units(gateway: Gateway) -> None:
    mark = gateway.bus.mark()
    st = gateway.bus.wait_json("/arm1/state/status", lambda d: d["joints"] is not None, mark)
    assert st is not None and st["oplet"] in "gah" and st["status_mode"] == "0"
    assert len(st["joints"]) == 5 and st["j6"]["position_units"] == p.J6_ZERO_UNITS
    assert abs(st["robot_time"] - time.time()) < 5
    h = gateway.bus.wait_json("/arm1/health", lambda d: d["details"].get("rtt_avg_ms", 0) > 0, mark)
    assert h is not None and h["connection"] and h["operational"] and h["details"]["firmware"] == "newest"


def test_move_all_joints_reaches_the_arm_and_wait_motion_done(gateway: Gateway) -> None:
    rep = gateway.call("move_all_joints", {"joints_deg": [10, -5, 2.5, 0, 1], "j7_deg": 29})
    assert rep.ok, rep.error
    assert rep.result["request"].endswith(" a 36000 -18000 9000 0 3600 NaN 100;")  # degrees in, arcsec out
    events: list[dict[str, Any]] = []
    acc, res = gateway.job("wait_motion_done", {}, events.append)
    assert acc.ok and res is not None and res["ok"], res
    assert gateway.sim.angles_arcsec() == [36000, -18000, 9000, 0, 3600]
    status = res["result"]["status"]
    assert status["joints"][0]["angle_deg"] == pytest.approx(10.0)
    assert status["joints"][1]["angle_rad"] == pytest.approx(-0.0872665, abs=1e-6)
    assert status["j7"]["angle_deg"] == pytest.approx(29.0)
    assert any(e["phase"] == "waiting" for e in events)
    rel = gateway.call("move_all_joints_relative", {"joints_deg": [-10, 5, -2.5, 0, -1]})
    assert rel.ok and gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    assert gateway.sim.angles_arcsec() == [0, 0, 0, 0, 0]


def test_every_command_reaches_dexrun_in_its_wire_units(gateway: Gateway) -> None:
    sim = gateway.sim
    assert gateway.call("heartbeat").result["oplet"] == "h"
    t0 = time.monotonic()
    assert gateway.call("sleep", {"seconds": 0.3}).ok and time.monotonic() - t0 >= 0.29
    r = gateway.call("set_parameter", {"name": "MaxSpeed", "value": 360})
    assert r.ok, r.error
    assert sim.params["MaxSpeed"][0] == pytest.approx(360 * p.NBITS_PER_DEG_S, rel=1e-6)
    assert gateway.call("set_parameter", {"name": "1", "value": 7200}).ok  # by index: Acceleration
    assert sim.params["Acceleration"][0] == pytest.approx(7200 * p.NBITS_PER_DEG_S, rel=1e-6)
    r = gateway.call("set_parameter", {"name": "LinkLengths", "values": [0.08255, 0.0508, 0.3302, 0.320675, 0.1651]})
    assert r.ok and sim.params["LinkLengths"] == [82550, 50800, 330200, 320675, 165100]
    assert gateway.call("set_boundaries", {"high_deg": [180] * 5, "low_deg": [-180] * 5}).ok
    assert sim.boundaries[0] == (648000, -648000)
    assert gateway.call("write_fpga", {"address": 42, "value": 7}).ok and sim.registers[42] == 7
    r = gateway.call("pid_move_all_joints", {"offsets_deg": [0.5, 0, 0, 0, 0]})
    assert r.ok and r.result["status"]["joints"][0]["pid_delta_deg"] == pytest.approx(0.5)
    assert gateway.call("pid_move_all_joints", {"offsets_deg": [0, 0, 0, 0, 0]}).ok
    r = gateway.call("move_to", {"xyz": [0, 0.5, 0.1], "direction": [0, 0, -1]})
    assert r.ok, r.error
    assert " M 0 500000 100000 0 0 -1 1 1 1;" in r.result["request"]  # the wiki's own example
    assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    pom = gateway.job("read_file", {"path": "#POM"})[1]
    assert pom is not None and pom["ok"], pom
    m = pom["result"]["value"]
    assert m[0][3] == pytest.approx(0, abs=2) and m[1][3] == pytest.approx(500000, abs=2) \
        and m[2][3] == pytest.approx(100000, abs=2)
    assert gateway.call("move_all_joints", {"joints_deg": [0] * 5}).ok
    assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    raw = gateway.call("raw", {"command": "g;"})
    assert raw.ok and raw.result["status"]["joints"][0]["angle_deg"] == 0
    assert sim.stats.crashes == 0


def test_status_mode_raw_layout_and_back(gateway: Gateway) -> None:
    r = gateway.call("status_mode", {"mode": "1"})
    assert r.ok, r.error
    mark = gateway.bus.mark()
    st = gateway.bus.wait_json("/arm1/state/status", lambda d: d["status_mode"] == "1", mark)
    assert st is not None and st["joints"] is None and st["raw"][8] == ord("1")
    assert gateway.sim.status_mode == "1"  # the poll repeats the mode instead of resetting it
    assert gateway.call("status_mode", {"mode": "0"}).ok
    mark = gateway.bus.mark()
    assert gateway.bus.wait_json("/arm1/state/status", lambda d: d["joints"] is not None, mark)


@pytest.mark.parametrize("command,payload,code", [
    ("move_all_joints", {"joints_deg": [0, 0, 0, 0]}, "invalid_request"),
    ("move_all_joints", {"joints_deg": [0, 0, 0, 0, 1e9]}, "invalid_request"),
    ("sleep", {}, "invalid_request"),
    ("raw", {"command": "z"}, "invalid_request"),  # z without its argument crashed DexRun
    ("raw", {"command": "i"}, "invalid_request"),  # capture_points would block DexRun on stdin
    ("raw", {"command": "g; h;"}, "invalid_request"),
    ("set_parameter", {"name": "NoSuch", "value": 1}, "invalid_request"),
    ("set_parameter", {"name": "RunFile", "value": 1}, "invalid_request"),
    ("move_to", {"xyz": [0, 0.5, 0.1], "direction": [0, 0, -1], "units": "mm"}, "invalid_request"),
    ("read_file", {"path": "/a b"}, "invalid_request"),
    ("read_file", {"path": "/srv/samba/share/nope.txt"}, "not_found"),
])
def test_bad_requests_get_clear_errors_and_never_reach_the_arm(gateway: Gateway, command: str,
                                                               payload: dict[str, Any], code: str) -> None:
    crashes = gateway.sim.stats.crashes
    if command == "read_file":
        acc, res = gateway.job(command, payload)
        err = (res or {}).get("error") if acc.ok else acc.error
    else:
        rep = gateway.call(command, payload)
        assert not rep.ok
        err = rep.error
    assert err is not None and err["code"] == code and err["message"], err
    assert gateway.sim.stats.crashes == crashes


@pytest.mark.parametrize("command,payload", [
    ("write_file", {"path": "a;b", "text": "x"}),
    ("write_file", {"path": "a b", "text": "x"}),
    ("write_file", {"path": "a\x00b", "text": "x"}),
    ("write_file", {"path": "ok.txt", "base64": "not base64!"}),
    ("read_file", {"path": "#POM;h"}),  # a #keyword DexRun would cut at the ';'
    ("read_file", {"path": "/a\x00b"}),
    ("run_file", {"path": "a b.make_ins"}),
    ("run_file", {"path": "a;b"}),
])
def test_jobs_refuse_invalid_requests_before_a_job_starts(gateway: Gateway, command: str,
                                                          payload: dict[str, Any]) -> None:
    """What can be judged up front is refused in the command's reply: no job id, no job events, nothing sent."""
    assert gateway.call("heartbeat").ok  # paho's thread has handed every earlier job event to the recorder
    mark = gateway.bus.mark()
    c0 = gateway.sim.stats.commands
    acc, res = gateway.job(command, payload)
    assert not acc.ok and res is None, (acc, res)
    assert acc.error is not None and acc.error["code"] == "invalid_request" and acc.error["message"], acc.error
    assert gateway.call("heartbeat").ok  # anything the refused request had sent would be in the log before it
    assert gateway.bus.since(mark, "/event/job_result") == [] and gateway.bus.since(mark, "/event/job_progress") == []
    assert _oplets_since(gateway.sim, c0) <= {"g", "h"}


def _oplets_since(sim: DexterSim, commands0: int) -> set[str]:
    """The oplets the simulated arm received since its command count was `commands0` (status polls are `g`)."""
    n = sim.stats.commands - commands0
    lines = list(sim.stats.log)[-n:] if n > 0 else []
    return {(line.split(" ", 4) + [""] * 5)[4][:1] for line in lines}


def test_raw_g_with_bad_arguments_leaves_the_status_mode_alone(gateway: Gateway) -> None:
    rep = gateway.call("raw", {"command": "g 1 2"})  # g takes one argument at most
    assert not rep.ok and rep.error is not None and rep.error["code"] == "invalid_request"
    mark = gateway.bus.mark()
    st = gateway.bus.wait_json("/arm1/state/status", lambda d: True, mark)
    assert st is not None and st["status_mode"] == "0" and gateway.sim.status_mode == "0"


@pytest.mark.parametrize("command,payload", [
    ("set_parameter", {"name": "J1BoundryHigh", "value": 1e306}),  # finite in degrees, infinite in arcseconds
    ("set_parameter", {"name": "MaxSpeed", "values": [1, 1e12]}),  # the second value is read with atoi
    ("move_to", {"xyz": [0, 5e6, 0.1]}),  # 5e12 µm: past atoi's int
    ("move_to_straight", {"xyz": [0, 0.5, 0.1], "tool_speed_um_s": 2**31}),
    ("raw", {"command": "a 1 2 3 4 99999999999"}),
    ("raw", {"command": "r 0 /" + "x" * 230}),  # fits with instruction id 1, not with the ids the link sends
])
def test_commands_refuse_values_dexrun_cannot_read(gateway: Gateway, command: str, payload: dict[str, Any]) -> None:
    c0 = gateway.sim.stats.commands
    rep = gateway.call(command, payload)
    assert not rep.ok and rep.error is not None and rep.error["code"] == "invalid_request", rep
    assert gateway.call("heartbeat").ok
    assert gateway.sim.stats.crashes == 0 and _oplets_since(gateway.sim, c0) <= {"g", "h"}


@pytest.mark.parametrize("command", [
    "a 2595600 0 0 0 0",  # 721°: move_all_joints refuses it
    "a 3600.5 0 0 0 0",  # atoi would move to 3600
    "a 0 0 0 0 0 2000",  # J6 2000 units = 445° from its zero (typed: ±150°)
    "a 0 0 0 0 0 NaN 2000",  # J7 580° (typed: 0..300°)
    "P 0 0 -2595600 0 0",
    "R 0 0 0 0 2595601",
    "M 0 500000 100000 0 0 -1 1 2 1",  # the configuration is 0 or 1
    "M 0 500000.5 100000 0 0 -1 1 1 1",
    "T 0 500000 100000 0 0 -1 1 1 1 0 10",  # tool speed at least 1
    "C 0 500000 100000 0 0 -1 1 1 1 ",
    "D 0 500000 100000 0 0 -1 1 1 1 10 10 512 5000",
])
def test_raw_motion_is_held_to_the_typed_guards(gateway: Gateway, command: str) -> None:
    c0 = gateway.sim.stats.commands
    rep = gateway.call("raw", {"command": command})
    if command.startswith("C"):  # C without anything wrong: the guard lets a valid move through
        assert rep.ok, rep.error
        assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
        assert gateway.call("move_all_joints", {"joints_deg": [0] * 5}).ok
        assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
        return
    assert not rep.ok and rep.error is not None and rep.error["code"] == "invalid_request", rep
    assert gateway.call("heartbeat").ok
    assert _oplets_since(gateway.sim, c0) <= {"g", "h"}


def test_a_raw_move_is_published_as_a_typed_one(gateway: Gateway) -> None:
    """DexRun moves are position goals (no deadman on either path); after a raw move the published status is
    the arm's, as after the typed one."""
    rep = gateway.call("raw", {"command": "a 36000 -18000 0 0 3600 NaN 100"})
    assert rep.ok and rep.result["status"] is not None, rep
    assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    assert gateway.sim.angles_arcsec() == [36000, -18000, 0, 0, 3600]
    mark = gateway.bus.mark()
    st = gateway.bus.wait_json("/arm1/state/status", lambda d: d["joints"] is not None
                               and d["joints"][0]["measured_deg"] == pytest.approx(10.0, abs=0.01), mark)
    assert st is not None and st["joints"][1]["angle_deg"] == pytest.approx(-5.0)
    assert st["j7"]["position_units"] == 100
    typed = gateway.call("move_all_joints", {"joints_deg": [0] * 5})
    assert typed.ok and gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    assert gateway.sim.angles_arcsec() == [0] * 5


def test_device_errors_and_flags_reach_reply_and_health(gateway: Gateway) -> None:
    # injected into the next `h` reply: this gateway's status poller sends `g` whenever the link is idle, and an
    # injection into "the next reply" was taken by a poll now and then on a busy machine (the heartbeat then ok)
    gateway.sim.error_next(1, oplet="h")
    rep = gateway.call("heartbeat")
    assert not rep.ok and rep.error["code"] == "device_error" and "unknown" in rep.error["message"]  # type: ignore
    mark = gateway.bus.mark()
    gateway.sim.error_next(p.ERR_MONITOR, oplet="h")
    rep = gateway.call("heartbeat")
    assert rep.ok and rep.result["error"]["flags"] == ["monitor"]  # a flag describes the arm, not this command
    h = gateway.bus.wait_json("/arm1/health", lambda d: "monitor" in d["error_message"], mark)
    # the kit's table: a fault the device reports is `error` (the link still up: `connection` as it is)
    assert h is not None and h["error"] and h["state"] == "error" and h["connection"] and not h["operational"]
    back = gateway.bus.wait_json("/arm1/health", lambda d: not d["error"], mark)  # cleared by later replies
    assert back is not None and back["state"] == "operational" and back["operational"] and back["connection"]
    rep = gateway.call("raw", {"command": "x"})  # raw returns DexRun's own answer
    assert rep.ok and rep.result["error"]["code"] == 1


def test_timeout_resets_the_link_and_health_shows_the_reconnect(gateway: Gateway) -> None:
    mark = gateway.bus.mark()
    before = gateway.bus.wait_json("/arm1/health", lambda d: "reconnects" in d["details"], 0)
    assert before is not None
    gateway.sim.drop_replies(1, oplet="h")  # not a status poll's `g` (this gateway polls when idle)
    rep = gateway.call("heartbeat")
    assert not rep.ok and rep.error["code"] == "timeout", rep.error  # type: ignore[index]
    h = gateway.bus.wait_json("/arm1/health", lambda d: d["connection"] and d["details"]["reconnects"]
                              > before["details"]["reconnects"], mark)
    assert h is not None and h["details"]["timeouts"] >= 1
    assert gateway.call("heartbeat").ok


def test_several_clients_are_queued_never_interleaved_and_overflow_is_busy(gateway: Gateway,
                                                                          broker_session: Broker) -> None:
    clients = [RpcClient(broker_session.settings(), name=f"dexter-c{i}") for i in range(3)]
    for c in clients:
        c.connect()
    results: list[Any] = []
    lock = threading.Lock()

    def hammer(c: RpcClient) -> None:
        for _ in range(15):
            r = c.call(NODE, "arm1", "heartbeat", {}, timeout=15)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
    n0 = gateway.sim.stats.commands
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 45
    assert all(r.ok or r.error["code"] == "busy" for r in results), [r.error for r in results if not r.ok]
    assert sum(r.ok for r in results) >= 30
    assert gateway.sim.stats.commands - n0 >= sum(r.ok for r in results) and gateway.sim.stats.crashes == 0
    # overflow: the link holds one sleep, the queue (limit 4) takes four more, the rest are busy
    sleepers: list[Any] = []

    def sleeper(c: RpcClient) -> None:
        r = c.call(NODE, "arm1", "sleep", {"seconds": 0.4}, timeout=30)
        with lock:
            sleepers.append(r)

    threads = [threading.Thread(target=sleeper, args=(clients[i % 3],)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = [r.error["code"] for r in sleepers if not r.ok]
    assert codes and set(codes) == {"busy"} and sum(r.ok for r in sleepers) >= 2
    for c in clients:
        c.close()


def test_file_round_trip_with_progress(gateway: Gateway) -> None:
    data = bytes(range(256)) * 4 + b"semi;colon percent% nul\x00 end"
    progress: list[dict[str, Any]] = []
    acc, res = gateway.job("write_file", {"path": "/srv/samba/share/round.bin",
                                          "base64": base64.b64encode(data).decode(), "verify": True}, progress.append)
    assert acc.ok and res is not None and res["ok"], res
    assert res["result"]["verified"] is True and res["result"]["bytes"] == len(data)
    assert (gateway.sim.cwd / "round.bin").read_bytes() == data
    writing = [e for e in progress if e["phase"] == "writing"]
    assert writing and writing[-1]["done"] == writing[-1]["total"] == len(data)
    assert all(e["done"] <= e["total"] for e in progress) and progress[-1]["phase"] == "verifying"
    progress.clear()
    acc, res = gateway.job("read_file", {"path": "round.bin"}, progress.append)
    assert res is not None and res["ok"] and base64.b64decode(res["result"]["base64"]) == data
    assert res["result"]["blocks"] == len(data) // 62 + 1 and res["result"]["kind"] == "file"
    assert progress and progress[-1]["done"] <= len(data)
    text = "line one\nline two; with a semicolon\n" * 5
    assert gateway.job("write_file", {"path": "notes.txt", "text": text})[1]["ok"]  # type: ignore[index]
    res = gateway.job("read_file", {"path": "/srv/samba/share/notes.txt", "encoding": "text"})[1]
    assert res is not None and res["result"]["text"] == text
    res = gateway.job("read_file", {"path": "#measured_angles"})[1]
    assert res is not None and res["result"]["kind"] == "keyword" and len(res["result"]["value"]) == 5


def test_file_jobs_cancel_between_blocks(gateway: Gateway) -> None:
    data = b"x" * (62 * 400)  # 400 blocks
    started = threading.Event()
    job_id: list[str] = []

    def on_progress(ev: dict[str, Any]) -> None:
        job_id.append(ev["job_id"])
        started.set()

    out: dict[str, Any] = {}

    def run() -> None:
        out["acc"], out["res"] = gateway.job("write_file", {"path": "big.bin", "text": data.decode()}, on_progress)

    gateway.sim.delay_replies(0.02, 300, oplet="W")  # ~6 s of blocks: the cancel lands mid-transfer
    t = threading.Thread(target=run)
    t.start()
    assert started.wait(20)
    canceller = RpcClient(gateway.client.settings, name="dexter-cancel")
    canceller.connect()
    rep = canceller.call(NODE, "arm1", "cancel", {"job_id": job_id[0]})
    assert rep.ok, rep.error
    t.join(30)
    gateway.sim.delay_replies(0, 0)
    res = out["res"]
    assert res is not None and not res["ok"] and res["cancelled"]
    written = (gateway.sim.cwd / "big.bin").read_bytes()
    assert 0 < len(written) < len(data)  # cancelled part-way; DexRun's write handle was closed
    # the file channel is free again
    res2 = gateway.job("write_file", {"path": "small.bin", "text": "ok"})[1]
    assert res2 is not None and res2["ok"]
    # a read cancels the same way
    started.clear()
    job_id.clear()

    # a file of 400 blocks on the arm: the one cancelled above may hold only a few, read before a cancel lands
    (gateway.sim.cwd / "whole.bin").write_bytes(data)

    def run_read() -> None:
        out["acc"], out["res"] = gateway.job("read_file", {"path": "whole.bin"}, on_progress)

    gateway.sim.delay_replies(0.02, 300, oplet="r")
    t = threading.Thread(target=run_read)
    t.start()
    assert started.wait(20)
    assert canceller.call(NODE, "arm1", "cancel", {"job_id": job_id[0]}).ok
    t.join(30)
    gateway.sim.delay_replies(0, 0)
    assert out["res"] is not None and out["res"]["cancelled"]
    canceller.close()


def test_wait_motion_done_cancels_at_once(gateway: Gateway) -> None:
    assert gateway.call("move_all_joints", {"joints_deg": [170, 0, 0, 0, 0]}).ok
    assert gateway.call("move_all_joints", {"joints_deg": [-170, 0, 0, 0, 0]}).ok  # ~2 s of motion queued
    started = threading.Event()
    ids: list[str] = []

    def on_progress(ev: dict[str, Any]) -> None:
        ids.append(ev["job_id"])
        started.set()

    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(res=gateway.job("wait_motion_done", {}, on_progress)[1]))
    t.start()
    assert started.wait(10)
    other = RpcClient(gateway.client.settings, name="dexter-cancel-f")
    other.connect()
    t0 = time.monotonic()
    assert other.call(NODE, "arm1", "cancel", {"job_id": ids[0]}).ok
    t.join(30)
    other.close()
    assert out["res"] is not None and out["res"]["cancelled"] and time.monotonic() - t0 < 1.5
    res = gateway.job("wait_motion_done", {})[1]  # the F still in flight completes; the next one waits for the rest
    assert res is not None and res["ok"] and gateway.sim.fifo_len() == 0
    assert gateway.call("move_all_joints", {"joints_deg": [0] * 5}).ok
    assert gateway.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]


def test_second_file_job_is_busy(gateway: Gateway) -> None:
    gateway.sim.delay_replies(0.5, 2, oplet="W")  # the first job's, not a status poll's
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(gateway.job("write_file", {"path": "a.txt", "text": "a"})))
    t.start()
    time.sleep(0.2)
    other = RpcClient(gateway.client.settings, name="dexter-other")  # its own subscriptions to job events
    other.connect()
    acc, res = other.call_job(NODE, "arm1", "read_file", {"path": "a.txt"}, lambda ev: None)
    other.close()
    assert not acc.ok and acc.error["code"] == "busy" and res is None  # type: ignore[index]
    t.join(30)
    assert results[0][1]["ok"]


def test_run_file(gateway: Gateway) -> None:
    (gateway.sim.cwd / "moves.make_ins").write_text("S MaxSpeed 2000000;\na 3600 0 0 0 0;\na 0 0 0 0 0;\n")
    res = gateway.job("run_file", {"path": "moves.make_ins"})[1]
    assert res is not None and res["ok"], res
    assert gateway.sim.params["MaxSpeed"] == [2000000]
    res = gateway.job("run_file", {"path": "missing.make_ins"})[1]
    assert res is not None and not res["ok"] and res["error"]["code"] == "not_found"


def test_shell_target_is_forbidden_when_disabled(gateway: Gateway) -> None:
    n0 = gateway.sim.stats.commands
    acc, res = gateway.job("read_file", {"path": "`ls"})
    assert res is None
    assert not acc.ok and acc.error["code"] == "forbidden" and "disabled" in acc.error["message"]  # type: ignore
    rep = gateway.call("raw", {"command": "r 0 `ls"})
    assert not rep.ok and rep.error["code"] == "forbidden"  # type: ignore[index]
    rep = gateway.call("raw", {"command": "r 1 `"})
    assert not rep.ok and rep.error["code"] == "forbidden"  # type: ignore[index]
    assert not any(line.split(" ", 4)[-1].startswith("r") and "`" in line
                   for line in list(gateway.sim.stats.log)[-(gateway.sim.stats.commands - n0 + 1):])


def test_every_published_message_matches_the_contract(gateway: Gateway) -> None:
    doc = build_document()
    validator = ContractValidator(doc)
    rep = gateway.call("heartbeat")
    validator.validate_reply(doc, f"{NODE}_cmd_heartbeat", rep.raw)
    bad = gateway.call("sleep", {"seconds": -1})
    validator.validate_reply(doc, f"{NODE}_cmd_sleep", bad.raw)
    seen = set()
    for topic, payload in list(gateway.bus.messages):
        if topic.startswith(f"robobus/{NODE}/") and "/cmd/" not in topic:
            seen.add(validator.validate(topic, payload))
    # health, status and the job events are the kit's shared messages (named once in the document)
    assert {f"{NODE}_state_status", "health", "status"} <= seen, seen
    assert any(s.endswith("_event_job_progress") for s in seen) and any(s.endswith("_event_job_result") for s in seen)


# -- a second gateway: shell enabled with an allowlist, no status polling (keepalive only) ----------------

@pytest.fixture(scope="module")
def shell_gateway(broker_session: Broker) -> Iterator[Gateway]:
    sim = DexterSim(DexterSimConfig(port=0, idle_close_s=1.0)).start()
    gw = start_gateway(broker_session, sim, {"keepalive_s": 0.3}, node="dexter-shell", ROBOBUS_DEXTER_STATUS_HZ="0",
                       ROBOBUS_DEXTER_SHELL_ENABLED="true", ROBOBUS_DEXTER_SHELL_ALLOWLIST='["seq 100", "ls"]')
    yield gw
    stop_gateway(gw)
    sim.close()


def test_shell_allowlisted_runs_to_echild_and_others_are_forbidden(shell_gateway: Gateway) -> None:
    res = shell_gateway.job("read_file", {"path": "`seq 100"})[1]
    assert res is not None and res["ok"], res
    assert res["result"]["text"] == "".join(f"{i}\n" for i in range(1, 101)) and res["result"]["exit_status"] == 0
    assert res["result"]["kind"] == "shell"
    acc, _ = shell_gateway.job("read_file", {"path": "`rm -rf /"})
    assert not acc.ok and acc.error["code"] == "forbidden" and "allowlist" in acc.error["message"]  # type: ignore
    rep = shell_gateway.call("raw", {"command": "r 0 `reboot"})
    assert not rep.ok and rep.error["code"] == "forbidden"  # type: ignore[index]


def test_keepalive_outlives_the_idle_close(shell_gateway: Gateway) -> None:
    sim = shell_gateway.sim
    mark = shell_gateway.bus.mark()
    time.sleep(3.0)  # three idle-close periods (1 s here, 30 s on the robot) with no command and no polling
    assert sim.stats.idle_closes == 0 and sim.stats.connections == 1
    h = shell_gateway.bus.wait_json("/arm1/health", lambda d: d["details"]["keepalives"] >= 5, mark)
    assert h is not None and h["connection"] and h["details"]["reconnects"] == 0
    assert wait_until(lambda: shell_gateway.call("heartbeat").ok, 5)


def test_a_reply_past_the_inline_wait_reaches_its_caller_and_the_next_command_stays_behind(broker_session: Broker
                                                                                          ) -> None:
    """`heartbeat` and the moves run inline on paho's thread while the link is idle; a reply later than the inline
    wait (0.3 s here) is waited for on the pool, and a command arriving meanwhile (inline, link busy) queues
    behind it and goes after it, in order. No status poller here: the delayed reply must be the heartbeat's."""
    sim = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=360, acceleration_deg_s2=7200)).start()
    # its own node name: the module's gateway (with its poller) serves NODE on the same broker
    gw = start_gateway(broker_session, sim, node="dexter-inline", ROBOBUS_DEXTER_STATUS_HZ="0")
    other = RpcClient(broker_session.settings(), name="dexter-inline-2")
    other.connect()
    try:
        n0 = sim.stats.commands
        sim.delay_replies(0.3, 1)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("hb", gw.call("heartbeat")))
        t.start()
        assert wait_until(lambda: sim.stats.commands > n0, 10)  # the heartbeat is on the robot, its reply held
        move = other.call(gw.node, "arm1", "move_all_joints", {"joints_deg": [1, 2, 3, 4, 5]}, timeout=15)
        t.join(15)
        hb = out["hb"]
        assert hb.ok and move.ok, (hb.error, move.error)
        assert move.result["instruction_id"] > hb.result["instruction_id"]  # type: ignore[index]
        assert hb.result["rtt_ms"] >= 250  # type: ignore[index]  # it did wait for the delayed reply
        assert gw.call("heartbeat").ok  # and the link is free again
    finally:
        other.close()
        stop_gateway(gw)
        sim.close()
