"""The dashboard server's optional MQTT-over-websockets relay: fewer websocket frames for the browser.

mosquitto's websockets listener sends one websocket frame per MQTT packet, and in the browser every frame
costs the network service, an IPC to the renderer and a task on the page (~0.1 % of a core per frame/s was
measured: the hand's 100 Hz joints beside two e-pucks are ~200 frames/s). This relay carries the page's MQTT
bytes unchanged between one websocket (`/mqtt`, subprotocol `mqtt`) and one TCP (or TLS) connection to the
broker, and writes what the broker sends as at most one websocket frame per `flush_s`: a frame may hold
several MQTT packets, or part of one, which MQTT over websockets allows (MQTT 5.0, 6.0) and the page's
client handles. Data after a quiet spell is sent at once; only a burst waits, at most `flush_s`.

It never reads, changes or originates an MQTT packet: the page's own CONNECT (its user name and password)
reaches the broker as sent, and the broker's CONNACK, authorisation and Last Will apply as they would
directly. The page works against any broker's websockets URL without it."""

from __future__ import annotations

import base64
import hashlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("robobus.dashboard.relay")

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, 1.3
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_FRAME = 64 * 1024 * 1024  # a page's largest request (an Intel HEX file) is far below
FLUSH_BYTES = 256 * 1024      # a burst this large goes at once (camera frames)


class Readable(Protocol):
    """What the relay reads a page's frames from (the HTTP handler's buffered rfile)."""

    def read(self, n: int, /) -> bytes: ...


def accept_key(key: str) -> str:
    """Sec-WebSocket-Accept for a client's Sec-WebSocket-Key (RFC 6455, 4.2.2)."""
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


def frame(opcode: int, payload: bytes = b"") -> bytes:
    """One unmasked, final server frame."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return head + payload


class ProtocolError(Exception):
    """The page broke RFC 6455; `code` is the close status to send."""

    def __init__(self, message: str, code: int = 1002) -> None:
        super().__init__(message)
        self.code = code


def _exact(f: Readable, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise EOFError
    return b


def read_frame(f: Readable) -> tuple[int, bytes]:
    """One client frame: (opcode, unmasked payload). Client frames must be masked (RFC 6455, 5.1)."""
    b0, b1 = _exact(f, 2)
    if b0 & 0x70:
        raise ProtocolError("reserved bits set")
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", _exact(f, 2))[0]
    elif n == 127:
        n = struct.unpack("!Q", _exact(f, 8))[0]
    if not b1 & 0x80:
        raise ProtocolError("client frame not masked")
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes", 1009)
    mask = _exact(f, 4)
    data = _exact(f, n)
    # XOR by the 4-byte mask as one big integer: no per-byte Python loop
    m = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return b0 & 0x0F, (int.from_bytes(data, "big") ^ m).to_bytes(n, "big") if n else b""


@dataclass
class Upstream:
    """The broker the relay connects to: its MQTT TCP listener, TLS when `tls`."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            s = self.tls.wrap_socket(s, server_hostname=self.host)
        s.settimeout(None)
        return s


@dataclass
class RelayStats:
    """Counters over every session (the tests and the benchmark read them)."""

    sessions: int = 0
    frames_to_page: int = 0
    bytes_to_page: int = 0
    frames_from_page: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {"sessions": self.sessions, "frames_to_page": self.frames_to_page,
                    "bytes_to_page": self.bytes_to_page, "frames_from_page": self.frames_from_page,
                    "errors": self.errors}


class Session:
    """One page's websocket (already upgraded: `rfile`/`page`) and its broker connection."""

    def __init__(self, page: socket.socket, rfile: Readable, broker: socket.socket, flush_s: float,
                 stats: RelayStats) -> None:
        self.page, self.rfile, self.broker = page, rfile, broker
        self.flush_s = flush_s
        self.stats = stats
        self.send_lock = threading.Lock()
        self.closed = threading.Event()

    def _send_page(self, data: bytes) -> None:
        with self.send_lock:
            self.page.sendall(data)

    def run(self) -> None:
        self.stats.add(sessions=1)
        down = threading.Thread(target=self._broker_to_page, name="dashboard-relay-down", daemon=True)
        down.start()
        try:
            self._page_to_broker()
        finally:
            self.close()
            down.join(5)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.broker, self.page):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.broker.close()

    def _page_to_broker(self) -> None:
        try:
            while not self.closed.is_set():
                op, data = read_frame(self.rfile)
                if op in (OP_BINARY, OP_CONT):
                    self.stats.add(frames_from_page=1)
                    self.broker.sendall(data)  # MQTT is a byte stream: frame boundaries do not matter
                elif op == OP_PING:
                    self._send_page(frame(OP_PONG, data))
                elif op == OP_CLOSE:
                    self._send_page(frame(OP_CLOSE, data[:2]))
                    return
                elif op == OP_TEXT:
                    raise ProtocolError("MQTT over websockets is binary (MQTT 5.0, 6.0)", 1003)
                elif op != OP_PONG:
                    raise ProtocolError(f"unknown opcode {op}")
        except ProtocolError as exc:
            self.stats.add(errors=1)
            log.warning("relay: closing a page's websocket: %s", exc)
            self._try_send(frame(OP_CLOSE, struct.pack("!H", exc.code) + str(exc).encode()[:120]))
        except (EOFError, OSError):
            pass

    def _try_send(self, data: bytes) -> None:
        try:
            self._send_page(data)
        except OSError:
            pass

    def _broker_to_page(self) -> None:
        """Everything the broker sends, at most one frame per flush_s (at once after a quiet spell)."""
        buf = bytearray()
        next_send = 0.0  # monotonic time before which a frame waits
        try:
            while not self.closed.is_set():
                now = time.monotonic()
                if buf and (now >= next_send or len(buf) >= FLUSH_BYTES):
                    self._send_page(frame(OP_BINARY, bytes(buf)))
                    self.stats.add(frames_to_page=1, bytes_to_page=len(buf))
                    buf.clear()
                    next_send = now + self.flush_s
                    continue
                pending = isinstance(self.broker, ssl.SSLSocket) and self.broker.pending() > 0
                if not pending:
                    wait = max(0.0, next_send - now) if buf else None
                    ready, _, _ = select.select([self.broker], [], [], wait)
                    if not ready:
                        continue
                data = self.broker.recv(65536)
                if not data:  # the broker closed (e.g. refused the CONNECT after its CONNACK)
                    if buf:
                        self._send_page(frame(OP_BINARY, bytes(buf)))
                    self._send_page(frame(OP_CLOSE, struct.pack("!H", 1000)))
                    break
                buf += data
        except (OSError, ValueError):
            pass
        finally:
            self.close()
