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


def test_the_brokers_end_of_stream_after_our_disconnect_is_not_reported(broker_session: Broker) -> None:
    """The broker ends the connection on our DISCONNECT, at times before close() has gone on: the reader's end of
    stream then is still our own close(). The DISCONNECT's send here returns only once the reader has ended, the
    order a fast broker makes."""
    pub = LeanPublisher(broker_session.settings(), "lean-eos-test")
    pub.publish("robobus-test/lean", b"x", qos=1)
    assert pub.drain(10)
    sock, sendall = pub.sock, pub.sock.sendall
    reader = pub._reader

    class SlowToReturn:
        def __getattr__(self, name: str) -> object:
            return getattr(sock, name)

        def sendall(self, data: bytes) -> None:
            sendall(data)
            reader.join(10)  # the broker's end of stream read before close() goes on

    pub.sock = SlowToReturn()  # type: ignore[assignment]
    pub.close()
    assert not reader.is_alive()
    assert pub.closed.is_set() and pub.error == ""
