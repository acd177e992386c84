"""The bus stop's own path (shared/stop.py): read on a connection of its own, never behind the node's commands; the
gate across the two connections when either reconnects alone; the path's self-check (it lags: health and stats
say so, without flapping); a later successful write clears a failed stop action's error; a latch the broker lost
in a restart is held and said lost."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import shared.stop as stop_mod
from shared import Node
from shared.errors import CommandError, ErrorCode
from shared.messages import StopState
from shared.rpc import wait_for
from shared.stop import LAG_S, RECOVER_S, StopPath, answer_topic, fleet_stop_topic, stop_topic
from tests.fixtures import Broker
from tests.kit.motion_node import API, build
from tests.kit.test_stop import DEADLINE, Bus, start_node

REPO = Path(__file__).resolve().parents[2]
HELD_S = 5.0  # how long a test holds the main connection's network thread


@pytest.fixture
def bus(broker_session: Broker) -> Iterator[Bus]:
    b = Bus(broker_session, f"stoppath{time.monotonic_ns()}")
    yield b
    b.close()


@pytest.fixture
def own_bus(broker: Broker) -> Iterator[Bus]:
    """A root on a broker of the test's own (to stall, restart or kill)."""
    b = Bus(broker, f"stoppath{time.monotonic_ns()}")
    yield b
    b.client.close()


def _kick(broker: Broker, client_id: str) -> None:
    """Take `client_id` over (the broker drops the connection that had it), then let it go."""
    connected = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.on_connect = lambda *a: connected.set()
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        assert connected.wait(DEADLINE)
    finally:
        c.disconnect()
        c.loop_stop()


def test_the_stop_is_read_on_a_connection_of_its_own(bus: Bus) -> None:
    """Its own client id (<main id>-stop), its own network thread, the two stop topics and its own reply topic only;
    and a stop reaches the devices while the main connection's network thread is held (as a flood of commands
    holds it): with one connection the stop waited behind it."""
    node, wheels = start_node(bus, name="own")
    release = threading.Event()
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        latch = node.stop_latch
        assert latch.session is not node.session
        assert latch.session.client_id == f"{node.session.client_id}-stop"
        assert latch.session.client._thread is not node.session.client._thread
        assert set(latch.session._subs) == {stop_topic(bus.root), fleet_stop_topic(bus.root),
                                            f"{bus.root}/_client/{latch.session.client_id}/reply"}
        held = threading.Event()

        def hold(msg: mqtt.MQTTMessage) -> None:  # on the main connection's network thread
            held.set()
            release.wait(HELD_S)

        node.session.subscribe(f"{bus.root}/own/_test/hold", hold, qos=1)
        assert node.session.wait_ready(DEADLINE)
        bus.client.session.publish(f"{bus.root}/own/_test/hold", b"x", qos=1)
        assert held.wait(DEADLINE)
        stop = bus.set_stop(True, reason="behind a held connection")
        assert wait_for(lambda: bool(wheels["wheel1"].stops and wheels["wheel2"].stops), HELD_S - 1.0), \
            "the stop waited for the main connection"
        assert not release.is_set()
        answer = bus.wait_answer(node.name, stop)  # the answer goes on the stop connection too
        assert all(d["stopped"] and not d["pending"] for d in answer["devices"]), answer
    finally:
        release.set()
        node.stop()


def test_the_stop_connection_reconnects_alone(bus: Bus, broker_session: Broker,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop connection dropped (its id taken over): the state is unknown until its own round trip (a motion
    command waits for it), the main connection is untouched; a stop set while the stop connection was down is
    read when it is back (retained) and refuses the command that waited."""
    monkeypatch.setattr(stop_mod, "ADMIT_WAIT_S", DEADLINE)  # the reconnect may be slow on a busy host
    node = Node(API, broker_session.settings(topic_root=bus.root, node="alone", health_interval_s=0.5,
                                             mqtt_reconnect_min_s=1.0, mqtt_reconnect_max_s=1.0))
    wheels = build(node)
    node.start()
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE) and node.session.wait_ready(DEADLINE)
        main_reconnects, stop_reconnects = node.session.reconnects, latch.session.reconnects
        at_drop: list[tuple[bool, bool, bool]] = []
        dropped = threading.Event()

        def on_drop() -> None:  # after the latch's own hook
            at_drop.append((latch.known, latch.path.connected, latch.path.lagging))
            dropped.set()

        latch.session.on_disconnect(on_drop)
        _kick(broker_session, latch.session.client_id)
        assert dropped.wait(DEADLINE)
        assert at_drop == [(False, False, True)]  # unknown, and the path says it is down
        stop = bus.set_stop(True, reason="set while the stop connection was down")
        rep = call_move(bus, node)  # waits in the gate for the stop connection's round trip, then refused
        assert not rep.ok and rep.error["code"] == "stopped", rep.raw
        assert "set while the stop connection was down" in rep.error["message"]
        assert wait_for(lambda: latch.session.reconnects > stop_reconnects and latch.known, DEADLINE)
        bus.wait_answer(node.name, stop)
        assert all(speed == 0.0 for _, speed in wheels["wheel1"].writes)
        assert node.session.reconnects == main_reconnects  # the main connection never dropped
    finally:
        node.stop()


def call_move(bus: Bus, node: Node, speed: float = 1.0) -> Any:
    return bus.client.call(node.name, "wheel1", "move", {"speed": speed}, timeout=DEADLINE)


def test_the_main_connection_reconnects_alone(bus: Bus, broker_session: Broker) -> None:
    """The main connection dropped: the stop connection is untouched, and the state is known again only once a round
    trip sent on it after the main connection's reconnect is back; the birth waits for that."""
    node = Node(API, broker_session.settings(topic_root=bus.root, node="mainonly", health_interval_s=0.5))
    build(node)
    node.start()
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE) and node.session.wait_ready(DEADLINE)
        main_reconnects, stop_reconnects = node.session.reconnects, latch.session.reconnects
        sent_after: list[int] = []
        probe = latch._probe

        def counted(periodic: bool = False) -> None:
            sent_after.append(latch._main_epoch)
            probe(periodic)

        latch._probe = counted  # type: ignore[method-assign]
        epoch = latch._main_epoch
        _kick(broker_session, node.session.client_id)
        assert wait_for(lambda: node.session.reconnects > main_reconnects and node.session.ready.is_set(), DEADLINE)
        assert wait_for(lambda: latch.known, DEADLINE)
        assert latch._main_epoch == epoch + 1 and epoch + 1 in sent_after
        assert latch.session.reconnects == stop_reconnects
        assert wait_for(lambda: (bus.latest(f"{bus.root}/mainonly/status") or {}).get("online") is True, DEADLINE)
        assert call_move(bus, node).ok
    finally:
        node.stop()


def test_after_a_main_reconnect_a_stop_connection_that_does_not_answer_admits_nothing(
        bus: Bus, broker_session: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop connection gone stale (here: its round trips suppressed) while the main connection reconnected: the
    state is not known on the new main connection, a motion command is answered `unavailable`, never run."""
    monkeypatch.setattr(stop_mod, "ADMIT_WAIT_S", 0.5)
    node = Node(API, broker_session.settings(topic_root=bus.root, node="stale", health_interval_s=0.5))
    wheels = build(node)
    node.start()
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE) and node.session.wait_ready(DEADLINE)
        reconnects = node.session.reconnects
        latch._probe = lambda periodic=False: None  # type: ignore[method-assign]
        _kick(broker_session, node.session.client_id)
        assert wait_for(lambda: node.session.reconnects > reconnects and node.session.ready.is_set(), DEADLINE)
        assert not latch.known
        with pytest.raises(CommandError) as err:
            node.dispatcher.dispatch("wheel1", "move", b'{"speed": 2}')
        assert err.value.code == ErrorCode.UNAVAILABLE
        assert all(speed != 2.0 for _, speed in wheels["wheel1"].writes)
    finally:
        node.stop()


# -- the stop path's self-check ---------------------------------------------------------------------------------
def test_the_lag_rule_without_flapping() -> None:
    """StopPath, with time passed in: a slow round trip or one out too long lags at once and counts once; good
    again only after RECOVER_S of round trips within the bound; a bad one meanwhile starts the wait again."""
    p = StopPath(0.0)
    assert not p.up(0.1) and not p.lagging
    assert not p.returned(0.002, 1.0) and not p.lagging and p.rtt_ms == 2.0
    assert not p.check(2.0, 2.0 - LAG_S / 2)  # out, within the bound
    assert p.check(3.0, 3.0 - LAG_S * 2) and p.lagging and p.lags == 1  # out too long
    assert not p.returned(LAG_S * 2, 3.1)  # the slow one comes back: lags still, counted once
    assert not p.returned(0.001, 4.0)
    assert not p.returned(0.001, 5.0)
    assert not p.returned(LAG_S + 0.1, 6.0) and p.lagging and p.lags == 1  # bad again: the wait starts again
    for t in (7.0, 8.0, 9.0):
        assert not p.returned(0.001, t) and p.lagging
    assert p.returned(0.001, 7.0 + RECOVER_S) and not p.lagging  # RECOVER_S of good round trips
    assert p.down(11.0) and p.lagging and p.lags == 2 and not p.connected
    assert not p.up(11.5) and p.lagging  # connected is not enough: its round trips say
    d = p.details(12.0)
    assert d["ok"] is False and d["connected"] is True and "why" in d
    never = StopPath(0.0)
    assert not never.check(1.0, None) and never.check(stop_mod.START_GRACE_S + 0.1, None) and never.lagging


def test_the_check_does_not_spin_while_the_stop_connection_is_down(broker_session: Broker) -> None:
    """The housekeeping asks the latch when to look again: a period while there is no connection to probe on, not
    at once (the housekeeping thread would spin)."""
    node = Node(API, broker_session.settings(topic_root=f"stoppath{time.monotonic_ns()}", node="down"))
    build(node)
    try:
        assert node.stop_latch.tick() >= stop_mod.PROBE_EVERY_S * 0.9
        assert node.stop_latch.tick() >= stop_mod.PROBE_EVERY_S * 0.9
    finally:
        node.stop()


def test_a_lagging_stop_path_is_noticed_counted_and_good_again_without_flapping(own_bus: Bus,
                                                                                 broker: Broker) -> None:
    """The broker stalled 2 s (SIGSTOP): the stop path lags (its round trip is out past LAG_S), the node's stats
    count one lag, and it is good again only after RECOVER_S of good round trips once the broker is back."""
    node, _ = start_node(own_bus, name="lagger")
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE)
        assert wait_for(lambda: latch.path.rtt_ms is not None, DEADLINE)  # the periodic round trip runs
        assert not latch.path.lagging and latch.path.lags == 0
        assert broker.proc is not None
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: latch.path.lagging, DEADLINE)
            time.sleep(1.0)
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert wait_for(lambda: not latch.path.lagging, DEADLINE), latch.path.details(time.monotonic())
        assert time.monotonic() - resumed >= RECOVER_S * 0.9
        assert latch.path.lags == 1
        stats = f"{own_bus.root}/lagger/_node/state/stats"
        assert wait_for(lambda: (own_bus.latest(stats) or {}).get("stop_path_lags") == 1, DEADLINE), \
            own_bus.latest(stats)
        assert (own_bus.latest(stats) or {}).get("stop_path_rtt_ms") is not None
    finally:
        node.stop()


def test_dress_puts_the_stop_path_in_a_motion_devices_health(bus: Bus) -> None:
    """StopLatch.dress (what a motion device's health is built with): `details.stop_path` always, and while the path
    lags a note in `error_message`, `error` untouched."""
    node, _ = start_node(bus, name="dressed")
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE)
        h: dict[str, Any] = {"connection": True, "operational": True, "state": "running", "error": False,
                             "error_message": "", "details": {"link": {"state": "up"}}}
        latch.dress("wheel1", h)
        assert h["details"]["stop_path"]["ok"] is True and h["details"]["link"] == {"state": "up"}
        assert h["error_message"] == "" and "stop" not in h["details"]
        latch.path.down(time.monotonic())  # as the disconnect hook does
        h = {"connection": True, "operational": True, "state": "running", "error": True, "error_message": "overheat"}
        latch.dress("wheel1", h)
        assert h["details"]["stop_path"]["ok"] is False and h["details"]["stop_path"]["connected"] is False
        assert h["error"] is True and h["error_message"].startswith("overheat; the bus stop's path lags")
        h = {"connection": True, "operational": True, "state": "running", "error": False, "error_message": ""}
        latch.dress("wheel1", h)
        assert h["error"] is False and h["error_message"].startswith("the bus stop's path lags")
    finally:
        node.stop()


def test_a_motion_devices_health_says_the_stop_path_lags(bus: Bus) -> None:
    node, _ = start_node(bus, name="healthy")
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE)
        assert wait_for(lambda: "stop_path" in ((bus.health(node.name, "wheel1") or {}).get("details") or {}), 5.0)
        latch.path.down(time.monotonic())
        latch._path_changed()
        assert wait_for(lambda: (bus.health(node.name, "wheel1") or {}).get("details", {}).get("stop_path", {})
                        .get("ok") is False, 5.0)
        h = bus.health(node.name, "wheel1")
        assert h is not None and h["error"] is False and "the bus stop's path lags" in h["error_message"]
        assert "stop_path" not in (bus.health(node.name, "sensor1") or {}).get("details", {})
    finally:
        node.stop()


# -- a later write clears a failed action's error ----------------------------------------------------------------
def test_a_successful_write_after_a_failed_stop_action_clears_its_error(bus: Bus) -> None:
    """The stop action failed (the device was absent), then the device was stopped after all (its deadman reported
    the write): the answer and the health no longer say the stop failed."""
    node, _ = start_node(bus, name="flaky", devices=("wheel1",), sensors=())
    dev = node.devices["wheel1"]

    def absent(stop: StopState) -> None:
        raise OSError("device absent")

    dev.on_stop(absent)
    try:
        assert node.stop_latch.known_event.wait(DEADLINE)
        stop = bus.set_stop(True, reason="drill")
        failed = {d["device"]: d for d in bus.wait_answer(node.name, stop)["devices"]}["wheel1"]
        assert failed["error"] == "OSError: device absent" and failed["written_ts"] is None, failed
        assert wait_for(lambda: "the stop action failed" in (bus.health(node.name, "wheel1") or {})
                        .get("error_message", ""), DEADLINE)
        written = time.time()
        dev.stop_written(written)
        assert wait_for(lambda: {d["device"]: d for d in (bus.answered(node.name, stop) or {"devices": []})
                                 ["devices"]}.get("wheel1", {}).get("error") == "", DEADLINE), \
            bus.latest(answer_topic(bus.root, node.name))
        entry = {d["device"]: d for d in bus.wait_answer(node.name, stop)["devices"]}["wheel1"]
        assert entry["written_ts"] == pytest.approx(written) and not entry["pending"], entry
        assert wait_for(lambda: "failed" not in (bus.health(node.name, "wheel1") or {}).get("error_message", "x"),
                        DEADLINE), bus.health(node.name, "wheel1")
        h = bus.health(node.name, "wheel1")
        assert h is not None and h["state"] == "stopped" and h["details"]["stop"]["error"] == ""
        # and a failure after a write keeps the write's time: the device was stopped
        dev.stop_written(error="deadman lost")
        assert wait_for(lambda: {d["device"]: d for d in (bus.answered(node.name, stop) or {"devices": []})
                                 ["devices"]}.get("wheel1", {}).get("error") == "deadman lost", DEADLINE)
        entry = {d["device"]: d for d in bus.wait_answer(node.name, stop)["devices"]}["wheel1"]
        assert entry["written_ts"] == pytest.approx(written), entry
    finally:
        node.stop()


# -- a latch the broker lost ------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["restart", "kill"])
def test_a_stop_the_broker_lost_is_held_on_both_connections_and_said_lost(own_bus: Bus, broker: Broker,
                                                                         loss: str) -> None:
    """The broker comes back without the retained stop (no persistence; a kill -9 before its autosave): both of the
    node's connections reconnect, the node keeps its active latch (the absence of a message is no release), answers
    and health say the broker lost it; the operator's stop set again clears that, and only a release lifts it."""
    node = Node(API, broker.settings(topic_root=own_bus.root, node="keeper", health_interval_s=0.5,
                                     mqtt_reconnect_min_s=0.1, mqtt_reconnect_max_s=0.5))
    wheels = build(node, devices=("wheel1",), sensors=())
    node.start()
    latch = node.stop_latch
    try:
        assert latch.known_event.wait(DEADLINE)
        stop = own_bus.set_stop(True, reason="before the loss")
        first = own_bus.wait_answer(node.name, stop)
        assert first["broker_lost"] is False
        main, stop_conn = node.session.reconnects, latch.session.reconnects
        if loss == "restart":
            broker.restart()
        else:
            broker.kill()
            assert wait_for(lambda: not latch.known, DEADLINE)
            broker.start()
        assert wait_for(lambda: node.session.reconnects > main and latch.session.reconnects > stop_conn
                        and latch.known and node.session.ready.is_set(), DEADLINE)
        assert latch.active and latch.state == stop
        assert not [p for t, p, r in own_bus.client.collect_retained(stop_topic(own_bus.root)) if r]
        assert wait_for(lambda: (own_bus.answered(node.name, stop) or {}).get("broker_lost") is True, DEADLINE), \
            own_bus.latest(answer_topic(own_bus.root, node.name))
        assert wait_for(lambda: ((own_bus.health(node.name, "wheel1") or {}).get("details", {}).get("stop", {})
                                 .get("broker_lost")) is True, DEADLINE), own_bus.health(node.name, "wheel1")
        h = own_bus.health(node.name, "wheel1")
        assert h is not None and h["state"] == "stopped" and "the broker lost the retained stop" in h["error_message"]
        rep = call_move(own_bus, node)
        assert not rep.ok and rep.error["code"] == "stopped", rep.raw
        assert all(speed == 0.0 for _, speed in wheels["wheel1"].writes)
        # the operator sets it again (the same stop): no longer lost; still held
        assert own_bus.client.session.publish_wait(stop_topic(own_bus.root), stop.model_dump_json(), qos=1,
                                                   retain=True)
        assert wait_for(lambda: (own_bus.answered(node.name, stop) or {}).get("broker_lost") is False, DEADLINE)
        assert wait_for(lambda: ((own_bus.health(node.name, "wheel1") or {}).get("details", {}).get("stop", {})
                                 .get("broker_lost")) is False, DEADLINE)
        assert latch.active
        release = own_bus.set_stop(False)
        own_bus.wait_answer(node.name, release)
        assert call_move(own_bus, node).ok
    finally:
        node.stop()


def test_no_stop_lost_when_none_was_active(own_bus: Bus, broker: Broker) -> None:
    """A node with no active stop that meets a broker without a retained one says nothing was lost."""
    node, _ = start_node(own_bus, name="free")
    try:
        latch = node.stop_latch
        assert latch.known_event.wait(DEADLINE)
        release = own_bus.set_stop(False)
        own_bus.wait_answer(node.name, release)
        stop_conn = latch.session.reconnects
        broker.restart()
        assert wait_for(lambda: latch.session.reconnects > stop_conn and latch.known, DEADLINE)
        assert not latch.active and not latch._lost
        assert latch.answer() is not None and latch.answer().broker_lost is False  # type: ignore[union-attr]
    finally:
        node.stop()


def _fifo_threads(pid: int) -> dict[str, int]:
    """Thread name/id -> its realtime priority (0: not realtime)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            out[f"{name}/{task.name}"] = os.sched_getparam(int(task.name)).sched_priority
    return out


def test_a_node_at_a_realtime_priority_reads_the_stop_one_above_its_commands(bus: Bus) -> None:
    """Started at SCHED_FIFO 10 (as `make run` starts it), the node's stop connection's thread runs at 11, its
    other threads at 10, and its motion devices' health says so: after a stall, the backlog of commands on the
    main connection never holds a core the stop needs. A node put at 10 once running (every thread, as
    ethercat-loop's MQTT process puts itself) lifts it at the next round trip. At an ordinary priority nothing is
    lifted."""
    if subprocess.run(["chrt", "-f", "10", "true"], capture_output=True).returncode != 0:
        pytest.skip("this host refuses SCHED_FIFO to the tests (no CAP_SYS_NICE)")
    env = {"ROBOBUS_MQTT_URL": bus.broker.url, "ROBOBUS_TOPIC_ROOT": bus.root, "ROBOBUS_HEALTH_INTERVAL_S": "0.5"}
    for how in ("started", "later", "never"):
        name = f"{how}node"
        prefix = ["chrt", "-f", "10"] if how == "started" else []
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "tests.kit.motion_node"],
                                env={**os.environ, **env, "ROBOBUS_NODE": name}, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            topic = f"{bus.root}/{name}/wheel1/health"

            def read_path() -> dict[str, Any]:
                return dict(((bus.latest(topic) or {}).get("details") or {}).get("stop_path") or {})  # noqa: B023

            # a heartbeat after the stop connection is up (its round trip back: rtt_ms)
            assert wait_for(lambda: read_path().get("rtt_ms") is not None, 30), bus.latest(topic)
            if how == "later":
                assert "priority" not in read_path()
                subprocess.run(["chrt", "-f", "-a", "-p", "10", str(proc.pid)], check=True)
                assert wait_for(lambda: "priority" in read_path(), 10), read_path()
            path = read_path()
            threads = _fifo_threads(proc.pid)
            if how == "never":
                assert "priority" not in path, path
                assert set(threads.values()) == {0}, threads
            else:
                assert path["priority"] == 11, path
                lifted = [t for t, p in threads.items() if p == 11]
                assert len(lifted) == 1, threads  # the stop connection's network thread alone
                assert all(p in (10, 11) for p in threads.values()), threads
        finally:
            proc.terminate()
            proc.wait(10)
