"""Lean MQTT 5 connections on shared.mqtt.wire, for the two paths where paho's per-message cost shows:
the recorder's subscriber (20 K msg/s) and the replayer's publisher (a publish goes out on the
caller's thread, straight to the socket, with no hand-off to a network thread: timing stays exact).

Same settings as every robobus client (ROBOBUS_MQTT_URL, credentials, TLS, keepalive), TCP_NODELAY on.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any

from shared.mqtt.address import ClientSettings, bound_client_id
from shared.mqtt.wire import (
    PINGREQ_PACKET,
    ConnAck,
    Disconnect,
    MqttProtocolError,
    Packet,
    PacketReader,
    PubAck,
    encode_connect,
    encode_disconnect,
    encode_publish,
)


def open_socket(settings: ClientSettings, timeout: float = 5.0) -> socket.socket:
    b = settings.broker()
    sock = socket.create_connection((b.host, b.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if b.tls:
        ctx = ssl.create_default_context(cafile=str(settings.mqtt_tls_ca) if settings.mqtt_tls_ca else None)
        if settings.mqtt_tls_cert:
            ctx.load_cert_chain(str(settings.mqtt_tls_cert),
                                str(settings.mqtt_tls_key) if settings.mqtt_tls_key else None)
        if settings.mqtt_tls_insecure:
            ctx.check_hostname = False
        sock = ctx.wrap_socket(sock, server_hostname=b.host)
    return sock


def handshake(sock: socket.socket, reader: PacketReader, settings: ClientSettings, client_id: str, *,
              clean: bool = True, props: dict[str, Any] | None = None,
              timeout: float = 10.0) -> tuple[ConnAck, list[Packet]]:
    """CONNECT and wait for the CONNACK; returns it and any packets that came in the same read."""
    b = settings.broker()
    cid = bound_client_id(b.username, client_id)  # a broker that binds client ids to users accepts <user>-...
    sock.sendall(encode_connect(cid, keepalive=settings.mqtt_keepalive_s, clean_start=clean,
                                username=b.username, password=b.password, props=props))
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no CONNACK from the broker")
        sock.settimeout(left)
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the broker closed the connection during CONNECT")
        packets = reader.feed(data)
        if packets:
            ack = packets[0]
            if not isinstance(ack, ConnAck):
                raise MqttProtocolError(f"expected CONNACK, got {type(ack).__name__}")
            if ack.reason != 0:
                why = ack.props.get("reason_string", "")
                raise ConnectionRefusedError(f"broker refused the connection: reason 0x{ack.reason:02x} {why}".rstrip())
            return ack, packets[1:]


class LeanPublisher:
    """Publishes from the caller's thread; a reader thread takes PUBACKs and answers keepalive.
    QoS 0 and 1; waits for room when the broker's Receive Maximum of unacknowledged QoS 1 is reached."""

    def __init__(self, settings: ClientSettings, client_id: str) -> None:
        self.settings = settings
        self.sock = open_socket(settings)
        ack, _ = handshake(self.sock, PacketReader(), settings, client_id)
        self.receive_maximum = int(ack.props.get("receive_maximum", 65535))
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._room = threading.Condition()
        self._unacked = 0
        self._pid = 0
        self._last_tx = time.monotonic()
        self.error = ""
        self.closed = threading.Event()
        self._closing = False  # set by close() before its DISCONNECT: the broker's end of stream after it is ours
        self._reader = threading.Thread(target=self._read, name="replay-acks", daemon=True)
        self._reader.start()

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                props: dict[str, Any] | None = None) -> None:
        if self.closed.is_set():
            raise ConnectionError(f"the broker connection is closed: {self.error or 'closed'}")
        pid = 0
        if qos:
            with self._room:
                while self._unacked >= self.receive_maximum and not self.closed.is_set():
                    self._room.wait(0.5)
                self._unacked += 1
                self._pid = self._pid % 65535 + 1
                pid = self._pid
        packet = encode_publish(topic, payload, qos=1 if qos else 0, retain=retain, packet_id=pid, props=props)
        with self._send_lock:
            self.sock.sendall(packet)
            self._last_tx = time.monotonic()

    def _read(self) -> None:
        reader = PacketReader()
        keepalive = float(self.settings.mqtt_keepalive_s)
        try:
            self.sock.settimeout(keepalive / 4)  # in the try: a close() before this thread runs leaves a closed fd
            while True:
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    if time.monotonic() - self._last_tx >= keepalive / 2:
                        with self._send_lock:
                            self.sock.sendall(PINGREQ_PACKET)
                            self._last_tx = time.monotonic()
                    continue
                if not data:
                    if not self._closing:  # not our own close(): the broker may end it before close() returns
                        self.error = "the broker closed the connection"
                    return
                acks = 0
                for p in reader.feed(data):
                    if isinstance(p, PubAck):
                        acks += 1
                    elif isinstance(p, Disconnect):
                        self.error = f"the broker disconnected us: reason 0x{p.reason:02x}"
                        return
                if acks:
                    with self._room:
                        self._unacked -= acks
                        self._room.notify_all()
        except (OSError, MqttProtocolError) as exc:
            if not self._closing:
                self.error = str(exc) or type(exc).__name__
        finally:
            self.closed.set()
            with self._room:
                self._room.notify_all()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until the broker acknowledged every QoS 1 publish."""
        deadline = time.monotonic() + timeout
        with self._room:
            while self._unacked > 0 and not self.closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(min(left, 0.1))
            return self._unacked <= 0

    def close(self) -> None:
        self._closing = True
        if not self.closed.is_set():
            try:
                with self._send_lock:
                    self.sock.sendall(encode_disconnect())
            except OSError:
                pass
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(2)
