"""End to end over the wire: a client on a real broker -> the ethercat-loop node (MQTT process) ->
its realtime cycle process (pysoem) -> veth -> the virtual hand running the palm model, and back.
Root only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.ethercat_loop.backend import STOP_ZERO_CYCLES
from services.ethercat_loop.protocol import PalmCommand, unpack_command
from services.ethercat_loop.sim.virtual_hand import HandControl
from shared.rpc import RpcClient
from shared.tools.asyncapi import ContractValidator, build_document
from tests.ethercat_loop.wire_fixtures import hand, skip_without_netns, wait_for
from tests.fixtures import Broker, NodeProcess

pytestmark = pytest.mark.root
DEV = "rh"


class Seen:
    def __init__(self, client: RpcClient, topic_filter: str) -> None:
        self.msgs: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        client.subscribe_before(topic_filter, self._on)

    def _on(self, msg: Any) -> None:
        with self.lock:
            self.msgs.append((msg.topic, bytes(msg.payload)))

    def latest(self, suffix: str) -> dict[str, Any] | None:
        with self.lock:
            for topic, payload in reversed(self.msgs):
                if topic.endswith(f"/{DEV}/{suffix}"):
                    return dict(json.loads(payload))
        return None


def demand_of(hexcmd: str, motor: int) -> int | None:
    cmd = unpack_command(bytes.fromhex(hexcmd), "0220")
    return cmd.motor_data[motor] if isinstance(cmd, PalmCommand) else None


def motor_demand(ctl: HandControl, motor: int) -> int | None:
    return demand_of(ctl.call("stats")["last_command"], motor)


def stream_until_on_wire(client: RpcClient, node: str, motor: int, value: int, ctl: HandControl,
                         timeout: float = 10.0) -> None:
    """Send the demand again and again, as a client streams demands, until the hand sees it: one demand alone is
    on the wire only until the deadman (100 ms), which a poll of the hand on a busy machine can miss."""
    deadline = time.monotonic() + timeout
    while True:
        assert client.call(node, DEV, "set_demands", {"motors": {str(motor): value}}).ok
        if motor_demand(ctl, motor) == value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"demand {value} of motor {motor} never seen on the wire")
        time.sleep(0.02)


# the node without CAP_SYS_NICE and CAP_IPC_LOCK (what a container without them gets): setpriv execs the
# same interpreter in the same process, so NodeProcess's SIGTERM still reaches the node
DROP = "-sys_nice,-ipc_lock"
UNPRIVILEGED = ["-c", "import os, sys; os.execvp('setpriv', ['setpriv', '--inh-caps=" + DROP + "', "
                "'--bounding-set=" + DROP + "', sys.executable, '-m', 'services.ethercat_loop'])"]


@pytest.fixture
def wire_node(broker_session: Broker, spawn: Any,
              request: pytest.FixtureRequest) -> Iterator[tuple[str, NodeProcess, RpcClient, HandControl, Seen]]:
    skip_without_netns()
    unprivileged = getattr(request, "param", "") == "unprivileged"
    if unprivileged and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop CAP_SYS_NICE and CAP_IPC_LOCK")
    node = f"wire{os.getpid()}"
    # the stricter slave: FMMUs take effect only on PRE-OP -> SAFE-OP
    with hand("0220", ["--serial", "4242", "--fmmus-on-safeop"]) as (ns, ctl):
        env = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node, "ROBOBUS_ETHERCAT_BACKEND": "virtual",
               "ROBOBUS_ETHERCAT_IFNAME": ns.master_if, "ROBOBUS_ETHERCAT_NETNS": ns.name,
               "ROBOBUS_HEALTH_INTERVAL_S": "1"}
        if unprivileged:  # a normal-priority cycle on a busy shared machine loses frames: not under test here
            env.update({"ROBOBUS_ETHERCAT_OVERRUN_THRESHOLD": "1000000", "ROBOBUS_ETHERCAT_LOST_THRESHOLD": "1000000",
                        "ROBOBUS_ETHERCAT_SILENT_MOTOR_MS": "600000"})
        client = RpcClient(broker_session.settings(), name=f"wire-test-{os.getpid()}")
        client.connect()
        seen = Seen(client, f"robobus/{node}/#")
        proc = spawn(UNPRIVILEGED if unprivileged else ["-m", "services.ethercat_loop"], env)
        try:
            wait_for(lambda: (h := seen.latest("health")) and h.get("state") == "running", 30,
                     f"{node} running (log: {proc.text()[-1500:]})")
            yield node, proc, client, ctl, seen
        finally:
            proc.stop()
            client.close()


def test_demand_and_status_over_mqtt_and_the_wire(wire_node: Any) -> None:
    node, _proc, client, ctl, seen = wire_node
    health = seen.latest("health")
    assert health is not None and health["connection"] is True
    assert health["details"]["serial"] == 4242 and health["details"]["product"] == 6
    assert health["details"]["backend"] == "virtual"
    # Each demand sent over MQTT reaches the palm's command. "Within 3 cycles" is the node's promise from
    # the moment the demand reaches it, so it is checked on the node's own clock: the cycle measures
    # submit -> the frame that carried it (loop_stats totals.command_us), median of 7 within 3 periods.
    # The MQTT path before it (client, broker, paho) is this shared machine's to slow down; its p99
    # is the bench's figure (demand-to-wire), here only a loose bound against gross regressions.
    time.sleep(1.0)  # after the start-up burst (config push to 20 motors, init polling), as the bench does
    lags = []
    for k in range(7):
        while len(ctl.call("changes", max=500)["changes"]) == 500:  # drain in datagrams that fit (208 KB)
            pass
        t0 = time.monotonic_ns()
        rep = client.call(node, DEV, "set_demands", {"motors": {"3": 111 + k}})
        assert rep.ok, rep.error
        def on_wire(want: int = 111 + k) -> Any:
            return next((c for c in ctl.call("changes")["changes"] if demand_of(c[2], 3) == want), None)

        change = wait_for(on_wire, 5, "the demand on the wire")
        lags.append((change[0] - t0) / 1e6)
    assert sorted(lags)[3] <= 50, f"MQTT demand reached the wire after {sorted(lags)} ms"
    period_us = 1000.0

    def cycle_share() -> Any:
        s = seen.latest("state/loop_stats")
        cmd = (s or {}).get("totals", {}).get("command_us", {})
        return cmd if cmd.get("count", 0) >= 7 else None

    cmd = wait_for(cycle_share, 5, "the submit -> frame histogram")
    assert cmd["p50"] <= 3 * period_us, f"submit -> frame {cmd} (MQTT -> wire {sorted(lags)} ms)"
    joints = wait_for(lambda: seen.latest("state/joints"), 5, "joints state")
    assert joints["joints"] and any(j.get("position") is not None for j in joints["joints"])
    stats = wait_for(lambda: (s := seen.latest("state/loop_stats")) and s.get("cycles") and s, 5, "loop stats")
    assert stats["totals"]["cycles"] > 0 and "wake_us" in stats["totals"]
    validator = ContractValidator(build_document())
    with seen.lock:
        msgs = list(seen.msgs)
    channels = {validator.validate(t, p) for t, p in msgs}  # raises on anything off-contract
    assert {"ethercat-loop_state_joints", "ethercat-loop_state_loop_stats", "health"} <= channels


def test_health_reports_loss_and_recovers(wire_node: Any) -> None:
    """100 frames lost (100 ms: shorter than the liveness budget): the palm stays connected, the message warns of
    the lost frames and the outage for their 1 s window; `error` is for faults the palm reports (docs/kit.md)."""
    _node, _proc, _client, ctl, seen = wire_node
    with seen.lock:
        n0 = len(seen.msgs)
    ctl.call("drop", n=100)
    wait_for(lambda: "frames lost" in (seen.latest("health") or {}).get("error_message", ""), 10,
             "the loss in health")
    h = seen.latest("health") or {}
    assert "warning: " in h["error_message"] and not h["error"], h
    wait_for(lambda: (h := seen.latest("health")) and not h["error_message"] and h["operational"], 15,
             "health clear again")
    with seen.lock:
        healths = [json.loads(p) for t, p in seen.msgs[n0:] if t.endswith(f"/{DEV}/health")]
    assert not [x for x in healths if x["error"]], healths


def test_power_cycle_shows_in_health_and_is_recovered(wire_node: Any) -> None:
    """Issue 19 end to end: the hand loses power for 0.5 s; health says connection false (`silent`, no error:
    the link supervisor's liveness budget passed) while no valid process data flow, whatever the AL states say,
    names the recovery's steps, and is back to running."""
    _node, _proc, _client, ctl, seen = wire_node
    with seen.lock:
        n0 = len(seen.msgs)
    ctl.call("power_cycle", off_ms=500)
    wait_for(lambda: (h := seen.latest("health")) and not h["connection"], 10, "the outage in health")
    h = seen.latest("health") or {}
    assert not h["operational"] and not h["error"] and h["state"] == "silent", h
    wait_for(lambda: (h := seen.latest("health")) and h["connection"] and h["state"] == "running", 15,
             "health back to running")

    def steps_of(h: dict[str, Any]) -> list[str]:
        return [s["step"] for s in (h["details"].get("recovery") or {}).get("steps", [])]
    # valid data make health `running` at once; the ladder notes "valid process data again" at its next state
    # check in the cycle's slack (every 250 ms, later on a busy host): a later health carries it
    try:
        wait_for(lambda: (h := seen.latest("health")) and any(s.startswith("valid process data again")
                                                              for s in steps_of(h)), 15, "the recovery's last step")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the latest health: {seen.latest('health')}") from None
    with seen.lock:
        healths = [json.loads(p) for t, p in seen.msgs[n0:] if t.endswith(f"/{DEV}/health")]
    rec = (healths[-1]["details"].get("recovery") or {})
    steps = steps_of(healths[-1])
    assert rec.get("escalations", 0) >= 1 and any(s.startswith("step safeop: FMMUs written") for s in steps), rec
    assert healths[-1]["connection"] and healths[-1]["state"] == "running", healths[-1]
    assert all(h["details"]["link"]["valid_data"] == h["connection"] for h in healths), healths
    assert not [x for x in healths if x["error"]], healths
    validator = ContractValidator(build_document())
    with seen.lock:
        for topic, payload in seen.msgs[n0:]:
            validator.validate(topic, payload)


def test_a_lost_frame_does_not_flicker_health(wire_node: Any) -> None:
    _node, _proc, _client, ctl, seen = wire_node
    with seen.lock:
        n = len(seen.msgs)
    for _ in range(3):
        ctl.call("drop", n=1)
        time.sleep(0.3)
    ctl.call("drop", n=5)  # below the threshold (10 per second) and short of 20 in a row
    wait_for(lambda: ctl.call("stats")["dropped"] >= 8, 5, "the frames dropped")
    time.sleep(2.0)  # the 1 s window they fell in, and the health checks after it
    with seen.lock:
        health = [json.loads(p) for t, p in seen.msgs[n:] if t.endswith(f"/{DEV}/health")]
    assert not [h for h in health if h["error"] or not h["operational"]], health
    h = seen.latest("health")
    assert h is not None and h["operational"] and not h["error"]


@pytest.mark.parametrize("wire_node", ["unprivileged"], indirect=True)
def test_refused_realtime_is_a_warning_in_health(wire_node: Any) -> None:
    node, proc, client, ctl, seen = wire_node
    try:
        h = wait_for(lambda: (h := seen.latest("health")) and h["operational"] and h, 10, "operational")
    except AssertionError:
        raise AssertionError(f"not operational: {seen.latest('health')}") from None
    assert h["connection"] and not h["error"] and h["state"] == "running"
    assert h["error_message"].startswith("warning: ") and "SCHED_FIFO priority 80 refused" in h["error_message"]
    assert "mlockall refused" in h["error_message"]
    rt = h["details"]["realtime"]
    assert rt["policy"] == "SCHED_OTHER/0" and any("SCHED_FIFO" in w for w in rt["warnings"])
    assert "SCHED_FIFO priority 80 refused" in proc.text()  # and in the logs
    stream_until_on_wire(client, node, 2, 77, ctl)  # it runs anyway


def test_sigterm_zeroes_demands_before_leaving_op(wire_node: Any) -> None:
    node, proc, client, ctl, _seen = wire_node
    stream_until_on_wire(client, node, 0, 90, ctl)
    proc.stop()  # SIGTERM
    st = ctl.call("stats")
    assert st["left_op"] >= 1 and st["palm_state"] != 8
    assert st["zero_demand_frames_before_leaving_op"] >= STOP_ZERO_CYCLES


def _cycle_pid(parent: int) -> int | None:
    """The cycle process the node started (`python -m services.ethercat_loop.transport.cycle`)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"services.ethercat_loop.transport.cycle" in cmd:
            return int(entry)
    return None


def test_a_killed_cycle_process_is_restarted_and_health_says_so(wire_node: Any) -> None:
    """kill -9 of the realtime cycle process: health goes `recovering` (not connected, the death named), then
    back to running and operational by itself, the restart counted in details."""
    _node, proc, _client, _ctl, seen = wire_node
    wait_for(lambda: (h := seen.latest("health")) and h["operational"], 15, "operational")
    pid = _cycle_pid(proc.proc.pid)
    assert pid is not None
    with seen.lock:
        n0 = len(seen.msgs)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (h := seen.latest("health")) and h["state"] == "recovering", 10, "recovering in health")
    h = seen.latest("health") or {}
    assert not h["connection"] and not h["operational"] and "cycle process died (killed by SIGKILL)" in \
        h["error_message"], h
    assert h["details"]["serial"] == 4242 and h["details"]["link"]["valid_data"] is False, h  # the hand still named
    wait_for(lambda: (h := seen.latest("health")) and h["operational"] and h["state"] == "running", 30,
             f"operational again (log: {proc.text()[-1500:]})")
    h = seen.latest("health") or {}
    assert h["connection"] and h["details"]["restarts"] == 1 and h["details"]["last_exit"] == "killed by SIGKILL", h
    new = _cycle_pid(proc.proc.pid)
    assert new is not None and new != pid
    with seen.lock:
        healths = [json.loads(p) for t, p in seen.msgs[n0:] if t.endswith(f"/{DEV}/health")]
    assert all(x["details"]["link"]["valid_data"] == x["connection"] for x in healths), healths
