"""Health is the kit's link supervisor's (docs/kit.md, "Health: one meaning in every service"): an absent arm is
counted, `connecting`, then `unreachable` within its budget and probed once per probe period, never an error; an
arm that appears is operational at its first reply; a hung arm is not `connection: true` past the budget and is
operational again when it goes on; an idle arm stays operational with no status polling; garbage at the port is
counted, never an error; a host that does not resolve is a configuration error that does not flap; shutdown
leaves `stopped`. The gateway as a process, a real broker, the simulator on a real socket."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from shared.rpc import RpcClient
from shared.tools.localbroker import REPO, Broker, NodeProcess, free_port
from tests.dexter_gateway.conftest import GATEWAY, BusRecorder, wait_until

# short timings so the tests do not wait the defaults out; the same rules as the defaults (models.py)
FAST = {"reply_timeout_s": 0.5, "reconnect_min_s": 0.05, "reconnect_max_s": 0.2, "liveness_s": 1.0,
        "probe_period_s": 1.0, "connect_timeout_s": 1.0}


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once to find it, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(broker: Broker, node: str, arm: dict[str, Any], **env: str
           ) -> tuple[NodeProcess, RpcClient, BusRecorder]:
    """The gateway as node `node` (one per test: a node's retained health outlives its process)."""
    client = RpcClient(broker.settings(), name=f"dexter-health-{node}")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{node}/#", bus.on)
    full_env = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_DEXTER_ARMS": json.dumps([arm]),
                "ROBOBUS_HEALTH_INTERVAL_S": "0.2", "ROBOBUS_NODE": node, **env}
    return NodeProcess(GATEWAY, full_env), client, bus


def _link(h: dict[str, Any]) -> dict[str, Any]:
    """The kit's `details.link` (the very first health, published as the device's supervisor is made, has none)."""
    return h["details"].get("link") or {"attempts": 0, "failures": 0, "garbage": 0, "valid_data": False}  # type: ignore


def test_an_absent_arm_is_counted_then_unreachable_never_an_error_and_operational_when_it_appears(
        broker_session: Broker) -> None:
    port = _closed_port()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": port, **FAST}
    proc, client, bus = _start(broker_session, "dexter-absent", arm)
    sim: DexterSim | None = None
    try:
        h = bus.wait_json("/arm1/health", lambda d: d["state"] == "unreachable", timeout=30)
        assert h is not None, proc.text()
        link = _link(h)
        assert link["attempts"] >= 2 and link["failures"] >= 2 and link["liveness_s"] == 1.0, link
        assert "refused" in link["last_failure"].lower() and "cannot connect" in h["error_message"]
        healths = bus.since(0, "/arm1/health")
        assert healths and not any(d["error"] for d in healths), [d for d in healths if d["error"]]
        assert not any(d["connection"] or d["operational"] for d in healths)
        states = [d["state"] for d in healths]
        # `connecting` within the budget, then `unreachable`, and never back (the probes go on)
        first = states.index("unreachable")
        assert set(states[:first]) <= {"starting", "connecting"} and set(states[first:]) == {"unreachable"}, states
        assert link["time_in_s"].get("connecting", 0) <= 1.0 + 1.0, link  # the budget, and the observer's share

        # unreachable: one probe per probe period (1 s here), not the back-off's 0.05..0.2 s ladder
        n0, t0 = _link(h)["attempts"], time.monotonic()
        time.sleep(3.0)
        later = bus.wait_json("/arm1/health", lambda d: True)
        assert later is not None
        probes = _link(later)["attempts"] - n0
        assert 1 <= probes <= (time.monotonic() - t0) / 1.0 + 2, (probes, _link(later))
        assert later["state"] == "unreachable" and not later["error"]

        sim = DexterSim(DexterSimConfig(port=port)).start()  # the arm appears
        h = bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30)
        assert h is not None, proc.text()
        assert h["connection"] and h["state"] == "operational" and not h["error"] and h["error_message"] == ""
        assert _link(h)["sessions"] == 1 and _link(h)["valid_data"]
        assert not any(d["error"] for d in bus.since(0, "/arm1/health"))
        assert wait_until(lambda: client.call("dexter-absent", "arm1", "heartbeat", {}, timeout=5).ok, 20)

        # lost after it was reached: `lost` at once, then `unreachable` after the budget, still no error
        mark = bus.mark()
        sim.close()
        sim = None
        h = bus.wait_json("/arm1/health", lambda d: d["state"] == "unreachable", mark, timeout=30)
        assert h is not None and not h["connection"], proc.text()
        after = bus.since(mark, "/arm1/health")
        assert not any(d["error"] for d in after), [d for d in after if d["error"]]
        assert "lost" in {d["state"] for d in after}
    finally:
        if sim is not None:
            sim.close()
        proc.stop()
        client.close()


def test_a_hung_arm_is_not_connected_past_its_budget_and_operational_again_when_it_goes_on(
        broker_session: Broker) -> None:
    """DexRun stuck (its sockets open; the kernel completes our reconnects into the backlog, nothing answers):
    `connection: false` within the budget (the status poll's `g` times out), probes that get no answer are
    counted, never an error; when it goes on it serves the old connections we closed, then ours."""
    sim = DexterSim(DexterSimConfig(port=0)).start()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": sim.port, **FAST}
    proc, client, bus = _start(broker_session, "dexter-hang", arm)
    try:
        assert bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30), proc.text()
        mark = bus.mark()
        sim.hang()
        t0 = time.monotonic()
        h = bus.wait_json("/arm1/health", lambda d: not d["connection"], mark, timeout=10)
        took = time.monotonic() - t0
        assert h is not None and h["state"] in ("lost", "silent"), proc.text()
        assert took < 1.0 + 1.5, took  # the budget, and a busy machine's share
        # several probes into the hung arm's backlog, each unanswered: counted, no error, never connected
        assert bus.wait_json("/arm1/health", lambda d: _link(d)["failures"] >= 3, mark, timeout=30), proc.text()
        after = bus.since(mark, "/arm1/health")
        first_down = next(i for i, d in enumerate(after) if not d["connection"])
        assert not any(d["connection"] for d in after[first_down:])
        assert not any(d["error"] for d in after)
        mark = bus.mark()
        sim.resume()
        h = bus.wait_json("/arm1/health", lambda d: d["operational"], mark, timeout=20)
        assert h is not None and not h["error"], proc.text()
        assert wait_until(lambda: client.call("dexter-hang", "arm1", "heartbeat", {}, timeout=5).ok, 20)
    finally:
        sim.resume()
        proc.stop()
        client.close()
        sim.close()


def test_an_idle_arm_stays_operational_without_status_polling(broker_session: Broker) -> None:
    """No status polling and no commands: the link's own `g` (after liveness - reply_timeout of silence, below
    the 10 s keepalive) keeps valid data coming within the budget, so the arm never turns `silent`."""
    sim = DexterSim(DexterSimConfig(port=0)).start()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": sim.port, **FAST, "keepalive_s": 10.0}
    proc, client, bus = _start(broker_session, "dexter-idle", arm, ROBOBUS_DEXTER_STATUS_HZ="0")
    try:
        assert bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30), proc.text()
        mark = bus.mark()
        time.sleep(4.0)  # four budgets without a command
        after = bus.since(mark, "/arm1/health")
        assert after and all(d["connection"] and d["state"] == "operational" for d in after), \
            [(d["state"], _link(d)) for d in after if not d["connection"]]
        assert _link(after[-1])["silences"] == 0 and after[-1]["details"]["keepalives"] >= 3
    finally:
        proc.stop()
        client.close()
        sim.close()


def test_garbage_at_the_port_is_counted_never_connected_never_an_error(broker_session: Broker) -> None:
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-m", "shared.tools.simrig", "garbage-tcp", "--port", str(port)], cwd=REPO)
    arm = {"id": "arm1", "host": "127.0.0.1", "port": port, **FAST}
    proc, client, bus = _start(broker_session, "dexter-garbage", arm)
    try:
        h = bus.wait_json("/arm1/health", lambda d: _link(d)["garbage"] >= 2, timeout=30)
        assert h is not None, proc.text()
        healths = bus.since(0, "/arm1/health")
        assert not any(d["connection"] or d["error"] for d in healths), [d for d in healths if d["error"]]
        assert h["state"] in ("connecting", "unreachable")
    finally:
        peer.kill()
        peer.wait(10)
        proc.stop()
        client.close()


def test_a_host_that_does_not_resolve_is_a_configuration_error(broker_session: Broker) -> None:
    arm = {"id": "arm1", "host": "no-such-host.invalid", **FAST}
    proc, client, bus = _start(broker_session, "dexter-badhost", arm)
    try:
        h = bus.wait_json("/arm1/health", lambda d: _link(d)["failures"] >= 3, timeout=30)
        assert h is not None, proc.text()
        assert h["error"] and h["state"] == "error" and "resolve" in h["error_message"] and not h["connection"]
        # it stays an error across the attempts (no flapping)
        later = [d for d in bus.since(0, "/arm1/health") if _link(d)["failures"] >= 1]
        assert later and all(d["error"] for d in later)
    finally:
        proc.stop()
        client.close()


def test_shutdown_leaves_the_arm_stopped(broker_session: Broker) -> None:
    sim = DexterSim(DexterSimConfig(port=0)).start()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": sim.port, **FAST}
    proc, client, bus = _start(broker_session, "dexter-stop", arm)
    try:
        assert bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30), proc.text()
        assert proc.stop() == 0, proc.text()
        assert wait_until(lambda: bus.since(0, "/status") and not bus.since(0, "/status")[-1]["online"], 10)
        last = bus.since(0, "/arm1/health")[-1]
        assert last["state"] == "stopped" and not last["connection"] and not last["operational"], last
        assert not _link(last)["valid_data"] and not last["error"]
    finally:
        client.close()
        sim.close()


def test_a_long_wait_for_the_motion_to_end_is_not_a_silent_arm(broker_session: Broker) -> None:
    """DexRun answers `F` only when the arm's moves have ended, and every status poll waits behind it: a move that
    takes several budgets is an arm at work, not a silent one (the link owes no data until the F's own timeout)."""
    sim = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=20.0, acceleration_deg_s2=200.0)).start()
    arm = {"id": "arm1", "host": "127.0.0.1", "port": sim.port, **FAST}
    node = "dexter-long-f"
    proc, client, bus = _start(broker_session, node, arm)
    try:
        assert bus.wait_json("/arm1/health", lambda d: d["operational"], timeout=30), proc.text()
        # a motion command is answered `unavailable` until the node has read the bus stop's state: wait for it
        moved: list[Any] = []
        assert wait_until(lambda: moved.append(client.call(node, "arm1", "move_all_joints",
                                                           {"joints_deg": [90, 0, 0, 0, 0]})) or moved[-1].ok,
                          30), moved[-1].error
        mark = bus.mark()
        t0 = time.monotonic()
        _acc, res = client.call_job(node, "arm1", "wait_motion_done", {}, lambda e: None, timeout=60)
        took = time.monotonic() - t0
        assert res is not None and res["ok"], res
        assert took > 3 * FAST["liveness_s"], f"the move took {took:.1f} s: too short to test anything"
        during = bus.since(mark, "/arm1/health")
        assert during and all(d["connection"] and d["state"] == "operational" for d in during), \
            [(d["state"], d["error_message"]) for d in during if not d["connection"]]
    finally:
        proc.stop()
        client.close()
        sim.close()
