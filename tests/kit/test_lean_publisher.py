"""shared/mqtt/lean.py's publisher on a real mosquitto: its reader thread ends quietly whenever close() comes, and
its own close() is not reported as the broker's."""

from __future__ import annotations

from shared.mqtt.lean import LeanPublisher
from tests.fixtures import Broker


def test_a_reader_that_starts_after_close_ends_without_an_exception(broker_session: Broker) -> None:
    pub = LeanPublisher(broker_session.settings(), "lean-close-test")
    pub.publish("robobus-test/lean", b"x", qos=1)
    assert pub.drain(10)
    pub.close()
    # the reader as it runs when close() came before its first line: the socket is closed (fd -1)
    pub._read()
    assert pub.closed.is_set() and pub.error == ""
