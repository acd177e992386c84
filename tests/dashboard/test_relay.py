"""The dashboard server's relay (/mqtt) against a real mosquitto: MQTT bytes pass unchanged both ways, a
burst from the broker reaches the page in fewer websocket frames than packets, and a page breaking the
websocket protocol is closed with the status RFC 6455 names."""

from __future__ import annotations

import base64
import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from wsproto.utilities import generate_accept_token

from shared.rpc import wait_for
from shared.tools.asyncapi import build_document
from shared.tools.dashboard import relay
from shared.tools.dashboard.relay import Upstream
from shared.tools.dashboard.server import DashboardServer, MissingAssets, PageConfig, Relay
from shared.tools.localbroker import mosquitto_bin
from tests.dashboard.stack import WsBroker


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("!H", len(b)) + b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (128 if n else 0))
        if not n:
            return bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def connect_packet(client_id: str) -> bytes:
    return _packet(0x10, _string("MQTT") + bytes([5, 0x02, 0, 60, 0]) + _string(client_id))


def subscribe_packet(topic: str, pid: int = 1) -> bytes:
    return _packet(0x82, struct.pack("!H", pid) + b"\x00" + _string(topic) + b"\x00")


def publish_packet(topic: str, payload: bytes) -> bytes:
    return _packet(0x30, _string(topic) + b"\x00" + payload)


def split_packets(stream: bytes) -> list[tuple[int, bytes]]:
    """Whole MQTT packets in a byte stream: (type, body)."""
    out, o = [], 0
    while o < len(stream):
        first, o = stream[o], o + 1
        n, mul = 0, 1
        while True:
            b, o = stream[o], o + 1
            n += (b & 127) * mul
            mul *= 128
            if not b & 128:
                break
        out.append((first >> 4, stream[o:o + n]))
        o += n
    return out


class WsClient:
    """A minimal RFC 6455 client, as a browser behaves (masked frames), with raw access for bad ones."""

    def __init__(self, port: int, protocol: str = "mqtt") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), 10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                           f"Sec-WebSocket-Protocol: {protocol}\r\n\r\n").encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(4096)
            assert chunk, "closed during the handshake"
            self.buf += chunk
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        self.status = head.split(b"\r\n")[0].decode()
        self.headers = head.decode(errors="replace")
        self.key = key

    def send(self, payload: bytes, opcode: int = 2, masked: bool = True) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode])
        mbit = 0x80 if masked else 0
        head += bytes([mbit | n]) if n < 126 else bytes([mbit | 126]) + struct.pack("!H", n)
        if masked:
            mask = os.urandom(4)
            payload = mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + payload)

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self) -> tuple[int, bytes]:
        b0, b1 = self._exact(2)
        assert not b1 & 0x80, "server frames are not masked"
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._exact(8))[0]
        return b0 & 0x0F, self._exact(n)


@pytest.fixture
def relayed() -> Iterator[tuple[WsBroker, DashboardServer]]:
    if not mosquitto_bin():
        pytest.skip("mosquitto is not installed")
    with tempfile.TemporaryDirectory(prefix="robobus-relay-") as d:
        broker = WsBroker(Path(d))
        broker.start()
        try:
            server = DashboardServer(build_document(), PageConfig(relay=True), port=0,
                                     relay=Relay(Upstream("127.0.0.1", broker.port), flush_s=0.05)).start()
        except MissingAssets as exc:
            broker.stop()
            pytest.skip(str(exc))
        try:
            yield broker, server
        finally:
            server.stop()
            broker.stop()


def _port(server: DashboardServer) -> int:
    return int(server.httpd.server_address[1])


def test_handshake_and_config(relayed: tuple[WsBroker, DashboardServer]) -> None:
    _, server = relayed
    ws = WsClient(_port(server))
    assert ws.status == "HTTP/1.1 101 Switching Protocols", ws.headers
    assert f"Sec-WebSocket-Accept: {generate_accept_token(ws.key.encode()).decode()}" in ws.headers
    assert "Sec-WebSocket-Protocol: mqtt" in ws.headers
    bad = WsClient(_port(server), protocol="chat")
    assert " 400 " in bad.status


def test_a_burst_arrives_whole_in_fewer_frames(relayed: tuple[WsBroker, DashboardServer]) -> None:
    broker, server = relayed
    ws = WsClient(_port(server))
    ws.send(connect_packet("relay-page"))
    op, data = ws.frame()
    assert op == 2 and split_packets(data)[0][0] == 2 and split_packets(data)[0][1][1] == 0  # CONNACK, success
    ws.send(subscribe_packet("relay/test/#"))
    op, data = ws.frame()
    assert split_packets(data)[0][0] == 9  # SUBACK
    # a publisher on the broker's MQTT listener sends a burst, as the hand's 100 Hz joints do
    pub = socket.create_connection(("127.0.0.1", broker.port), 10)
    pub.sendall(connect_packet("relay-pub"))
    assert pub.recv(64)[0] >> 4 == 2
    sent = [publish_packet(f"relay/test/{i % 3}", f'{{"seq": {i}}}'.encode()) for i in range(300)]
    pub.sendall(b"".join(sent))
    frames0 = server.relay.stats.frames_to_page if server.relay and server.relay.stats else 0
    stream = b""
    got: list[tuple[int, bytes]] = []
    while len(got) < len(sent):
        op, data = ws.frame()
        assert op == 2
        stream += data
        try:
            got = split_packets(stream)
        except IndexError:  # the stream ends inside a packet: more in the next frame
            continue
    assert b"".join(_packet(0x30, body) for _, body in got) == b"".join(sent)  # unchanged, in order
    assert server.relay and server.relay.stats
    frames = server.relay.stats.frames_to_page - frames0
    assert frames < len(sent) / 2, f"{frames} frames for {len(sent)} packets"
    # the page's DISCONNECT reaches the broker: the session ends without a Will
    ws.send(_packet(0xE0, b""))
    assert wait_for(lambda: server.relay is not None and server.relay.stats is not None
                    and server.relay.stats.frames_from_page >= 3, 10)
    pub.close()


@pytest.mark.parametrize(("opcode", "masked", "code"), [(2, False, 1002), (1, True, 1003)])
def test_a_bad_frame_is_closed_with_its_status(relayed: tuple[WsBroker, DashboardServer], opcode: int,
                                               masked: bool, code: int) -> None:
    _, server = relayed
    ws = WsClient(_port(server))
    ws.send(connect_packet("relay-bad"), opcode=opcode, masked=masked)
    op, data = ws.frame()
    assert op == 8 and struct.unpack("!H", data[:2])[0] == code, data
    assert server.relay and server.relay.stats and server.relay.stats.errors >= 1


def test_an_oversized_message_is_closed_with_1009(relayed: tuple[WsBroker, DashboardServer],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _, server = relayed
    monkeypatch.setattr(relay, "MAX_MESSAGE", 64)  # the real limit (64 MiB) is too much to mask in Python here
    ws = WsClient(_port(server))
    ws.send(b"\x00" * 65)
    op, data = ws.frame()
    assert op == 8 and struct.unpack("!H", data[:2])[0] == 1009, data
    assert server.relay and server.relay.stats and server.relay.stats.errors >= 1


def test_ping_is_answered_and_a_close_is_echoed(relayed: tuple[WsBroker, DashboardServer]) -> None:
    _, server = relayed
    ws = WsClient(_port(server))
    ws.send(b"are you there", opcode=9)
    assert ws.frame() == (10, b"are you there")  # the pong carries the ping's payload (RFC 6455, 5.5.3)
    ws.send(struct.pack("!H", 1000) + b"bye", opcode=8)
    op, data = ws.frame()
    assert op == 8 and struct.unpack("!H", data[:2])[0] == 1000
    with pytest.raises(EOFError):  # and the server ends the connection
        ws.frame()
    assert server.relay and server.relay.stats and server.relay.stats.errors == 0


def test_broker_unreachable_is_a_bad_gateway() -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    try:
        server = DashboardServer(build_document(), PageConfig(relay=True), port=0,
                                 relay=Relay(Upstream("127.0.0.1", port))).start()
    except MissingAssets as exc:
        pytest.skip(str(exc))
    try:
        assert " 502 " in WsClient(_port(server)).status
    finally:
        server.stop()
