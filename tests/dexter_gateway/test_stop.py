"""dexter-gateway under the bus-wide software stop (shared/stop.py; README "Stopping everything").

DexRun has no oplet, parameter or register that halts a move in progress (reference dexter.md §4), so the stop
on a Dexter is: no motion oplet leaves the gateway (the typed moves, `P`, `w`, RunFile and the moving `S`
parameters, typed or raw), the moves waiting for the link are answered `stopped` at once, and the health says what
the stop cannot do. The simulator's stop watch (`DexterSim.watch_stop`) counts what reaches the arm: a stopped
gateway must send it no motion request. Each test runs under a topic root of its own on the session broker."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.api import API
from services.dexter_gateway.device import STOP_NOTE
from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from services.dexter_gateway.transport import DexterLink, DexterLinkConfig, DexterLinkError
from shared.contract import BY_REQUEST, command_errors
from shared.errors import ErrorCode
from shared.messages import StopState
from shared.rpc import RpcClient, wait_for
from shared.stop import answer_topic, stop_topic
from shared.tools.asyncapi import ContractValidator, build_document
from tests.dexter_gateway.conftest import Gateway, start_gateway, stop_gateway, wait_until
from tests.fixtures import Broker

DEADLINE = 20.0  # generous: the machine is shared
ARM = "arm1"

# every way to make the arm move, typed and raw: each refused `stopped` while the stop is active
MOTION_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("move_all_joints", {"joints_deg": [5, 0, 0, 0, 0]}),
    ("move_all_joints_relative", {"joints_deg": [1, 0, 0, 0, 0]}),
    ("pid_move_all_joints", {"offsets_deg": [0.5, 0, 0, 0, 0]}),
    ("move_to", {"xyz": [0, 0.5, 0.1], "direction": [0, 0, -1]}),
    ("move_to_straight", {"xyz": [0, 0.5, 0.1], "direction": [0, 0, -1]}),
    ("write_fpga", {"address": 42, "value": 7}),
    ("set_parameter", {"name": "EERoll", "value": 600}),
    ("set_parameter", {"name": "23", "value": 600}),  # EERoll by its index
    ("raw", {"command": "a 3600 0 0 0 0"}),
    ("raw", {"command": "R 3600 0 0 0 0"}),
    ("raw", {"command": "P 10 0 0 0 0"}),
    ("raw", {"command": "M 0 500000 100000 0 0 -1 1 1 1"}),
    ("raw", {"command": "w 42 7"}),
    ("raw", {"command": "S EESpan 100"}),
    ("raw", {"command": "S RunFile moves.make_ins"}),
]
# what does not move: answered while the stop is active
READ_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("heartbeat", {}),
    ("raw", {"command": "g"}),
    ("raw", {"command": "h"}),
    ("set_parameter", {"name": "MaxSpeed", "value": 300}),
    ("raw", {"command": "S Acceleration 7200"}),
    ("set_boundaries", {"high_deg": [180] * 5, "low_deg": [-180] * 5}),
]


class StopBus:
    """A topic root of its own: its stop, the nodes' answers and everything published under it."""

    def __init__(self, broker: Broker) -> None:
        self.root = f"dexterstop{time.monotonic_ns()}"
        self.client = RpcClient(broker.settings(topic_root=self.root), name="dexter-stop-test")
        self.client.connect()
        self.messages: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.client.subscribe_before(f"{self.root}/#", self._on)

    def _on(self, msg: Any) -> None:
        with self.lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def latest(self, topic: str) -> dict[str, Any] | None:
        with self.lock:
            for t, pl in reversed(self.messages):
                if t == topic:
                    return json.loads(pl) if pl else None
        return None

    def set_stop(self, active: bool, reason: str = "drill", source: str = "alice@lab") -> StopState:
        stop = StopState(active=active, source=source, reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def wait_answer(self, node: str, stop: StopState) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            a = self.latest(answer_topic(self.root, node))
            if a is None or a["stop_ts"] != stop.ts or a["active"] != stop.active:
                return None
            return None if any(d["pending"] for d in a["devices"]) else a
        a = wait_until(settled, DEADLINE)
        assert a is not None, self.latest(answer_topic(self.root, node))
        return a  # type: ignore[no-any-return]

    def health(self, node: str) -> dict[str, Any]:
        return self.latest(f"{self.root}/{node}/{ARM}/health") or {}

    def validate_all(self) -> None:
        v = ContractValidator(build_document([API]))
        with self.lock:
            msgs = [(t, pl) for t, pl in self.messages if pl and "/_client/" not in t]
        for topic, payload in msgs:
            v.validate(topic, payload)

    def close(self) -> None:
        with self.lock:
            retained = {t for t, _ in self.messages}
        for t in retained:  # leave nothing retained under this root on the shared broker
            self.client.session.publish(t, b"", qos=1, retain=True)
        self.client.session.publish_wait(stop_topic(self.root), b"", qos=1, retain=True)
        self.client.close()


@pytest.fixture
def bus(broker_session: Broker) -> Iterator[StopBus]:
    b = StopBus(broker_session)
    yield b
    b.close()


@pytest.fixture
def sim() -> Iterator[DexterSim]:
    s = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=360, acceleration_deg_s2=7200)).start()
    (s.cwd / "moves.make_ins").write_text("a 3600 0 0 0 0;")
    yield s
    s.close()


@pytest.fixture
def gw(broker_session: Broker, bus: StopBus, sim: DexterSim) -> Iterator[Gateway]:
    g = start_gateway(broker_session, sim, root=bus.root, ROBOBUS_DEXTER_STATUS_HZ="20")
    yield g
    stop_gateway(g)


def code(rep: Any) -> str:
    return "ok" if rep.ok else str(rep.error["code"])


def motion_seen(sim: DexterSim) -> int:
    w = sim.stop_watch()
    assert w is not None
    return int(w["motion"])


def status_count(gw: Gateway) -> int:
    return len(gw.bus.since(0, f"/{ARM}/state/status"))


def test_the_contract_says_which_commands_move() -> None:
    motion = {n for n, c in API.commands.items() if c.motion is True} | {n for n, j in API.jobs.items() if j.motion}
    assert motion == {"move_all_joints", "move_all_joints_relative", "pid_move_all_joints", "move_to",
                      "move_to_straight", "write_fpga", "run_file"}
    assert {n for n, c in API.commands.items() if c.motion == BY_REQUEST} == {"set_parameter", "raw"}
    for name in ("set_parameter", "raw"):  # motion for some payloads: `stopped` is one of their codes
        assert ErrorCode.STOPPED in command_errors(API.commands[name]), name
    assert p.moves("S", ["EERoll", "1"]) and p.moves("S", ["23", "1"]) and p.moves("w", ["1", "2"])
    assert not p.moves("S", ["MaxSpeed", "1"]) and not p.moves("g", []) and not p.moves("S", ["Nope"])


def test_stopped_arm_refuses_every_motion_answers_the_rest_and_the_release_moves_nothing(
        gw: Gateway, bus: StopBus, sim: DexterSim) -> None:
    assert code(gw.call("move_all_joints", {"joints_deg": [2, 0, 0, 0, 0]})) == "ok"
    assert gw.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    before = sim.angles_arcsec()
    sim.watch_stop()
    stop = bus.set_stop(True)
    answer = bus.wait_answer(gw.node, stop)
    dev = next(d for d in answer["devices"] if d["device"] == ARM)
    assert dev["stopped"] and dev["error"] == "" and dev["written_ts"] >= stop.ts - 1.0
    assert wait_until(lambda: bus.health(gw.node).get("state") == "stopped", DEADLINE), bus.health(gw.node)
    h = bus.health(gw.node)
    assert h["error_message"] == f"bus stop by alice@lab: drill; {STOP_NOTE}"
    assert h["details"]["stop"]["source"] == "alice@lab" and h["operational"] is False and h["error"] is False
    # every motion command, typed or raw, is refused `stopped` and nothing of it reaches the arm
    for command, payload in MOTION_CALLS:
        rep = gw.call(command, payload)
        # refused by the kit's gate (its message says how to release), before the handler: no turn on the link
        assert code(rep) == "stopped" and "robobus stop --release" in rep.error["message"], (command, rep.error)
    acc, _ = gw.job("run_file", {"path": "moves.make_ins"})
    assert not acc.ok and acc.error["code"] == "stopped", acc.error  # type: ignore[index]
    # what does not move still works, through to the arm
    n0 = sim.stats.commands
    for command, payload in READ_CALLS:
        rep = gw.call(command, payload)
        assert code(rep) == "ok", (command, payload, rep.error)
    assert sim.stats.commands - n0 >= len(READ_CALLS)
    read = gw.job("read_file", {"path": "#measured_angles"})[1]
    assert read is not None and read["ok"], read
    assert gw.job("wait_motion_done", {})[1]["ok"]  # type: ignore[index]
    assert motion_seen(sim) == 0, sim.stop_watch()
    # the release: health back, nothing moves by itself (status polls go on, no motion request reaches the arm)
    release = bus.set_stop(False)
    bus.wait_answer(gw.node, release)
    assert wait_until(lambda: bus.health(gw.node).get("state") not in (None, "stopped"), DEADLINE)
    polled = status_count(gw)
    assert wait_until(lambda: status_count(gw) >= polled + 10, DEADLINE)
    assert motion_seen(sim) == 0 and sim.angles_arcsec() == before
    # a new command moves it again
    assert code(gw.call("move_all_joints", {"joints_deg": [3, 0, 0, 0, 0]})) == "ok"
    assert motion_seen(sim) == 1
    bus.validate_all()


def test_a_move_waiting_for_the_link_is_answered_stopped_at_once_and_never_sent(
        gw: Gateway, bus: StopBus, sim: DexterSim) -> None:
    """The stop action itself: a move queued behind a long exchange (a `z` sleep) gets `stopped` when the stop
    comes, long before the sleep ends, and never reaches the arm."""
    sim.watch_stop()
    replies: dict[str, Any] = {}

    def call(name: str, command: str, payload: dict[str, Any]) -> None:
        replies[name] = gw.call(command, payload, timeout=60)
        replies[name + "_at"] = time.monotonic()

    sleeper = threading.Thread(target=call, args=("sleep", "sleep", {"seconds": 12}))
    sleeper.start()
    assert wait_until(lambda: any(" z " in f" {c} " for c in list(sim.stats.log)), DEADLINE)
    mover = threading.Thread(target=call, args=("move", "move_all_joints", {"joints_deg": [4, 0, 0, 0, 0]}))
    mover.start()
    assert gw.bus.wait_json(f"/{ARM}/health", lambda d: d["details"].get("queued", 0) >= 1, timeout=DEADLINE), \
        "the move did not queue behind the sleep"
    stop = bus.set_stop(True)
    mover.join(DEADLINE)
    assert not mover.is_alive() and code(replies["move"]) == "stopped", replies.get("move")
    assert "nothing was sent" in replies["move"].error["message"]
    assert "sleep" not in replies, "the move was answered only after the sleep: it waited for the link"
    bus.wait_answer(gw.node, stop)
    # while the sleep still holds the link, every motion request is refused at once, typed or raw: none waits for
    # a turn it could not use
    for command, payload in (("move_to", {"xyz": [0, 0.5, 0.1], "direction": [0, 0, -1]}),
                             ("raw", {"command": "a 3600 0 0 0 0"}), ("set_parameter", {"name": "EESpan", "value": 9})):
        rep = gw.call(command, payload)
        assert code(rep) == "stopped" and "robobus stop --release" in rep.error["message"], rep.error
        assert sleeper.is_alive(), f"{command} was answered only after the sleep"
    sleeper.join(60)
    assert code(replies["sleep"]) == "ok"
    assert replies["move_at"] < replies["sleep_at"]
    h = gw.bus.wait_json(f"/{ARM}/health", lambda d: d["details"].get("stopped_requests", 0) >= 1, timeout=DEADLINE)
    assert h is not None
    assert motion_seen(sim) == 0, sim.stop_watch()


def test_a_gateway_started_while_the_stop_is_active_comes_up_stopped(
        broker_session: Broker, bus: StopBus, sim: DexterSim) -> None:
    stop = bus.set_stop(True, reason="set before start")
    sim.watch_stop()
    g = start_gateway(broker_session, sim, root=bus.root)
    try:
        answer = bus.wait_answer(g.node, stop)
        assert [(d["device"], d["error"]) for d in answer["devices"] if d["stopped"]] == [(ARM, "")]
        assert wait_until(lambda: bus.health(g.node).get("state") == "stopped", DEADLINE)
        assert bus.health(g.node)["error_message"] == f"bus stop by alice@lab: set before start; {STOP_NOTE}"
        assert code(g.call("move_all_joints", {"joints_deg": [5, 0, 0, 0, 0]})) == "stopped"
        assert code(g.call("raw", {"command": "a 3600 0 0 0 0"})) == "stopped"
        assert code(g.call("heartbeat")) == "ok"
        assert motion_seen(sim) == 0
    finally:
        stop_gateway(g)


# -- the link's own gate, without a broker --------------------------------------------------------------------

def test_the_link_sends_no_motion_while_stopped_and_drops_the_queued_moves(sim: DexterSim) -> None:
    why = {"stop": ""}
    link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=sim.port, reply_timeout_s=2.0),
                      motion_stopped=lambda: why["stop"]).start()
    try:
        assert wait_for(lambda: link.serving, DEADLINE)
        sim.watch_stop()
        assert link.request("a", [3600, 0, 0, 0, 0]).reply.oplet == "a"  # no stop: it goes
        why["stop"] = "the bus stop is active (tester: drill)"
        for oplet, args in (("a", [0, 0, 0, 0, 0]), ("P", [1, 0, 0, 0, 0]), ("w", [1, 2]), ("S", ["EERoll", 1])):
            with pytest.raises(DexterLinkError) as err:
                link.request(oplet, args)
            assert err.value.code == "stopped" and "nothing was sent" in err.value.message
        assert link.request("g").reply.oplet == "g" and link.request("S", ["MaxSpeed", 1000]).reply.oplet == "S"
        assert motion_seen(sim) == 1 and link.stats.stopped == 4
        # queued behind a sleep: the motion request is answered by the stop action, the heartbeat keeps its turn
        why["stop"] = ""
        out: dict[str, Any] = {}

        def run(name: str, oplet: str, args: list[Any]) -> None:
            try:
                out[name] = link.request(oplet, args).reply.oplet
            except DexterLinkError as exc:
                out[name] = exc.code

        threads = [threading.Thread(target=run, args=("z", "z", [3_000_000]))]
        threads[0].start()
        assert wait_for(lambda: link.busy, DEADLINE)
        for name, oplet, args in (("a", "a", [0, 0, 0, 0, 0]), ("h", "h", [])):
            threads.append(threading.Thread(target=run, args=(name, oplet, args)))
            threads[-1].start()
        assert wait_for(lambda: link.queued == 2, DEADLINE)
        why["stop"] = "the bus stop is active (tester: drill)"
        at = link.stop_motion("the bus stop by tester: drill")
        assert at <= time.time()
        threads[1].join(DEADLINE)
        assert out.get("a") == "stopped" and "z" not in out  # answered at once, the sleep still running
        for t in threads:
            t.join(DEADLINE)
        assert out == {"z": "z", "a": "stopped", "h": "h"}
        assert motion_seen(sim) == 1
    finally:
        link.close()


# -- the simulator's stop watch, as a bench runs it -------------------------------------------------------------

def test_the_simulator_process_reports_its_watch_as_json_lines(tmp_path: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.dexter_gateway.sim", "--port", str(port),
                             "--root", str(tmp_path), "--watch-stop"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "ROBOBUS_LOG_LEVEL": "WARNING"})
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    out = proc.stdout

    def read() -> None:
        for text in out:
            lines.put(text)
    threading.Thread(target=read, daemon=True).start()

    def line() -> dict[str, Any]:
        while True:
            try:
                text = lines.get(timeout=DEADLINE)
            except queue.Empty:
                raise AssertionError(f"no line from the simulator in {DEADLINE} s (exit: {proc.poll()})") from None
            if text.startswith("{"):
                return json.loads(text)  # type: ignore[no-any-return]

    try:
        ev = line()  # armed at the start
        assert ev["event"] == "watching" and ev["stop_bytes"] is None and ev["motion"] == 0
        conn = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
        conn.sendall(b"1 1 1 undefined a 3600 0 0 0 0;")
        ev = line()
        assert ev["event"] == "motion" and ev["request"].endswith("a 3600 0 0 0 0")
        assert len(conn.recv(240)) > 0
        proc.send_signal(signal.SIGHUP)  # re-armed: the move above is forgotten
        ev = line()
        assert ev["event"] == "watching" and ev["motion"] == 0 and ev["first_motion"] is None
        conn.sendall(b"1 2 1 undefined g;")
        assert len(conn.recv(240)) > 0
        t0 = time.time()
        conn.sendall(b"1 3 1 undefined a 0 0 0 0 0;")
        ev = line()
        assert ev["event"] == "motion" and ev["request"].endswith("a 0 0 0 0 0")
        assert t0 - 1 <= ev["unix"] <= time.time() and ev["monotonic"] > 0
        conn.close()
    finally:
        proc.terminate()
        proc.wait(DEADLINE)
