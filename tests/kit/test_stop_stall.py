"""Nothing outruns the stop, at the kit's level, with the faults that break it: a minimal node with one motion device,
in a process of its own, while a client streams motion commands to it at 100 Hz on its main connection.

- the node stalled (SIGSTOP) 3 s, the stop published during the stall: once the node resumes (SIGCONT), its stop
  action runs within 50 ms, before the ~300 demands queued meanwhile are worked through (the stop is read on the
  node's own stop connection, never behind them);
- the broker stalled 3 s instead, the stop sent to it during the stall: the stop action runs within 50 ms of the
  broker resuming; with the stop from an operator's connection of its own, and on the stream's own connection
  behind the ~100 demands sent before it (as a site's bridge brings the fleet centre's commands and stop).

Measured on the clock every process shares (CLOCK_MONOTONIC): the child stamps its stop action's start, the test
stamps the SIGCONT; no sleep is asserted on. The quickest of up to three rounds is kept (a busy host may keep the
processes off the CPU in one round; a stop queued behind the demands is late in every round), and a round whose
own SIGCONT took long to send (the test's process preempted between its stamp and the signal) measures nothing."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared.messages import StopState
from shared.rpc import wait_for
from shared.stop import stop_topic
from tests.fixtures import Broker, NodeProcess

STALL_S = 3.0
BOUND_S = 0.050  # from the resume to the stop action's start
RATE_HZ = 100.0
DEADLINE = 30.0
NODE = "stall"
HANDLER_S = 0.001  # a demand's work on the node's network thread
SIGNAL_SLACK_S = 0.005  # a SIGCONT that took longer to send than this measured nothing: taken again
TRIES = 3


def child_main() -> None:
    """The node under test (python -c 'from tests.kit.test_stop_stall import child_main; child_main()'): one motion
    device whose `move` is handled as a realtime service handles its demands, inline on the network thread (it
    validates and hands the demand on: HANDLER_S of work), and whose stop action prints when it started, on
    CLOCK_MONOTONIC, and how many demands were handled before it."""
    from shared import Node
    from shared.settings import KitSettings
    from tests.kit.motion_node import API, MOVE, MOVER, MotionMove, MotionSpeed

    settings = KitSettings(mqtt_url=os.environ["ROBOBUS_MQTT_URL"], topic_root=os.environ["ROBOBUS_TOPIC_ROOT"],
                           node=NODE)
    node = Node(API, settings)
    dev = node.device("wheel1", kind=MOVER.name)
    handled = [0]
    speed = [0.0]

    def move(r: MotionMove) -> MotionSpeed:
        end = time.perf_counter() + HANDLER_S
        while time.perf_counter() < end:  # the demand's own work (checks, conversion, the hand-off)
            pass
        speed[0] = r.speed
        handled[0] += 1
        return MotionSpeed(speed=r.speed)

    def stop_now(stop: StopState) -> None:
        at = time.monotonic()
        speed[0] = 0.0
        print(f"STOP-ACTION {at:.6f} handled={handled[0]}", flush=True)

    dev.bind(MOVE, move, inline=True)
    dev.on_stop(stop_now)
    dev.set_health(connection=True, operational=True, state="running")
    node.start()
    if not node.stop_latch.known_event.wait(DEADLINE):
        print("NEVER-KNOWN", flush=True)
    print("READY", flush=True)
    while not node.stop_requested.wait(0.5):
        pass
    node.stop()


class Streamer:
    """A teleoperation client: `move` demands at RATE_HZ on the node's main connection, QoS 1, no deadline (the
    worst case: every one of them is run), from a connection of its own; it counts the node's answers."""

    def __init__(self, broker: Broker, root: str) -> None:
        self.topic = f"{root}/{NODE}/wheel1/cmd/move"
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"streamer-{time.monotonic_ns()}",
                                  protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(0)  # no cap: a stalled peer fills the socket, as a real client does
        self.sent = 0
        self.answered = 0
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.on_message = self._on_answer
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        self.client.subscribe(f"{self.topic}/reply", qos=1)  # where the node answers a request with no reply topic
        assert subscribed.wait(DEADLINE)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _on_answer(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self.answered += 1  # paho's network thread only

    def _run(self) -> None:
        period = 1.0 / RATE_HZ
        nxt = time.monotonic()
        while not self.done.is_set():
            self.client.publish(self.topic, b'{"speed": 1.0}', qos=1)
            self.sent += 1
            nxt += period
            self.done.wait(max(nxt - time.monotonic(), 0.0))

    def close(self) -> None:
        """Stop streaming, and wait until the node answered every demand: the next round starts from a node that
        has caught up (on a busy host it may not keep up with the backlog a stall leaves)."""
        self.done.set()
        self.thread.join(5)
        wait_for(lambda: self.answered >= self.sent, DEADLINE)
        self.client.disconnect()
        self.client.loop_stop()


def _line(proc: NodeProcess, prefix: str, start: int = 0, timeout: float = DEADLINE) -> str:
    found: list[str] = []

    def seen() -> bool:
        found.extend(x for x in proc.output[start:] if x.startswith(prefix))
        return bool(found) or not proc.alive()

    wait_for(seen, timeout)
    assert found, f"no {prefix!r} line from the node; its output:\n" + proc.text()[-4000:]
    return found[0]


def _resume(pid: int) -> tuple[float, float]:
    """SIGCONT `pid`; the monotonic times just before and just after the signal was sent."""
    t0 = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    return t0, time.monotonic()


@pytest.fixture
def node(broker: Broker, spawn: Any) -> Iterator[tuple[NodeProcess, str]]:
    root = f"stall{time.monotonic_ns()}"
    proc = spawn(["-c", "from tests.kit.test_stop_stall import child_main; child_main()"],
                 {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_TOPIC_ROOT": root})
    _line(proc, "READY")
    yield proc, root
    proc.signal(signal.SIGCONT)  # never leave it stopped
    proc.stop()


def _operator(broker: Broker) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"operator-{time.monotonic_ns()}", protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    return c


def _stop_message(active: bool) -> bytes:
    return StopState(active=active, source="stall-test", reason="stall", ts=time.time()).model_dump_json().encode()


def _round(broker: Broker, proc: NodeProcess, root: str, stalled_pid: int, who: str,
           sender: str) -> tuple[float, float, str]:
    """One stall of `stalled_pid` with the stream on and the stop sent during it, by an operator's connection or
    the stream's own (`sender`): (from the resume to the stop action's start, the SIGCONT's own duration, the
    child's line)."""
    op = _operator(broker)
    streamer = Streamer(broker, root)
    by = op if sender == "operator" else streamer.client
    try:
        time.sleep(0.5)  # the stream runs
        mark = len(proc.output)
        os.kill(stalled_pid, signal.SIGSTOP)
        try:
            stalled_at = time.monotonic()
            time.sleep(1.0)
            info = by.publish(stop_topic(root), _stop_message(True), qos=1, retain=True)
            if who == "node":
                info.wait_for_publish(DEADLINE)  # the broker has it: it is in the node's stop connection now
            time.sleep(max(STALL_S - (time.monotonic() - stalled_at), 0.0))
        finally:
            t0, t1 = _resume(stalled_pid)
        line = _line(proc, "STOP-ACTION", mark)
        at = float(line.split()[1])
        return at - t0, t1 - t0, line
    finally:
        streamer.close()
        # released, retained, for the next round
        op.publish(stop_topic(root), _stop_message(False), qos=1, retain=True).wait_for_publish(DEADLINE)
        op.disconnect()
        op.loop_stop()


def _measure(broker: Broker, proc: NodeProcess, root: str, who: str, sender: str = "operator") -> None:
    """Up to TRIES rounds, the quickest kept: a busy host may hold one round's processes off the CPU past the bound
    (the broker, the node's network thread and its stop thread each wait for a core), while a stop queued behind
    the stream's demands is late in every round (~100 demands of HANDLER_S: 100 ms and more)."""
    pid = proc.proc.pid if who == "node" else broker.proc.pid  # type: ignore[union-attr]
    rounds: list[tuple[float, float, str]] = []
    for _ in range(TRIES):
        took, signal_s, line = _round(broker, proc, root, pid, who, sender)
        rounds.append((took, signal_s, line))
        if signal_s <= SIGNAL_SLACK_S and took <= BOUND_S:
            break
        time.sleep(0.5)
    summary = ", ".join(f"{t * 1000:.1f} ms (SIGCONT sent in {s * 1000:.2f} ms; {x})" for t, s, x in rounds)
    print(f"{who} stalled {STALL_S} s, stop from the {sender}: stop action after SIGCONT: {summary}", file=sys.stderr)
    measured = [t for t, s, _ in rounds if s <= SIGNAL_SLACK_S]
    assert measured, f"every SIGCONT took longer than {SIGNAL_SLACK_S * 1000:.0f} ms to send: {summary}"
    assert min(measured) <= BOUND_S, (f"the stop action ran {min(measured) * 1000:.1f} ms after the {who} resumed "
                                      f"at best (bound {BOUND_S * 1000:.0f} ms): {summary}")


def test_a_stalled_node_runs_its_stop_action_within_50_ms_of_resuming(broker: Broker, node: Any) -> None:
    proc, root = node
    _measure(broker, proc, root, "node")


@pytest.mark.parametrize("sender", ["operator", "stream"])
def test_a_stalled_broker_gets_the_stop_to_the_node_within_50_ms_of_resuming(broker: Broker, node: Any,
                                                                             sender: str) -> None:
    proc, root = node
    _measure(broker, proc, root, "broker", sender)
