"""The MQTT session's stop while a handler answers on paho's network thread (a node stopped under a stream of
commands): the DISCONNECT that stop() queues is never written from inside the callback, where paho's on_disconnect
would wait for the callback lock that very thread holds (the node hung at SIGTERM)."""

from __future__ import annotations

import threading
import time
from typing import Any

from paho.mqtt.client import DISCONNECT

from shared.mqtt.session import MqttSession, unique_client_id
from shared.tools.localbroker import Broker


def _disconnect_queued(s: MqttSession) -> bool:
    return any(p["command"] & 0xF0 == DISCONNECT for p in list(s.client._out_packet))


def test_stop_while_a_handler_answers_on_the_network_thread_does_not_hang(broker_session: Broker) -> None:
    s = MqttSession(broker_session.settings(), unique_client_id("stop-answer"))
    assert s.direct_writes, "the path under test: a handler's answer written on the network thread"
    topic = f"robobus-test/stop-answer/{time.monotonic_ns()}"
    in_handler, answered = threading.Event(), threading.Event()

    def handler(_msg: Any) -> None:  # on paho's network thread, inside its message callback
        in_handler.set()
        end = time.monotonic() + 5
        while not _disconnect_queued(s) and time.monotonic() < end:  # stop() has run its disconnect()
            time.sleep(0.001)
        s.publish(f"{topic}/reply", b"{}", qos=0, now=True)  # the answer, written at once
        answered.set()

    s.subscribe(topic, handler, qos=0)
    s.start()
    assert s.wait_ready(10)
    assert s.publish(topic, b"go", qos=0, now=True)
    assert in_handler.wait(10)
    stopper = threading.Thread(target=s.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    assert answered.is_set()
    assert not stopper.is_alive(), "stop() hung: the DISCONNECT was written inside the message callback"
