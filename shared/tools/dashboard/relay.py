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

import logging
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Event, Ping, Request, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

log = logging.getLogger("robobus.dashboard.relay")

SUBPROTOCOL = "mqtt"
MAX_MESSAGE = 64 * 1024 * 1024  # a page's largest request (an Intel HEX file) is far below
FLUSH_BYTES = 256 * 1024        # a burst this large goes at once (camera frames)
READ_BYTES = 65536


class Readable(Protocol):
    """What the relay reads a page's frames from (the HTTP handler's buffered rfile, which may already hold
    bytes the page sent right after its upgrade request)."""

    def read1(self, n: int, /) -> bytes: ...


class Refused(Exception):
    """The upgrade request is not a websocket offering subprotocol mqtt; the message says why."""


class ProtocolError(Exception):
    """The page broke RFC 6455 (or sent what MQTT over websockets forbids); `code` is the close status."""

    def __init__(self, message: str, code: int = CloseReason.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def handshake(request: bytes) -> WSConnection:
    """A server-side wsproto connection that has read the upgrade `request` (its request line and headers)
    and found a websocket offering subprotocol mqtt, or Refused. Nothing is answered yet: the caller first
    connects to the broker, then sends accept(ws) (or an HTTP error)."""
    ws = WSConnection(ConnectionType.SERVER)
    try:
        ws.receive_data(request)
        requests = [e for e in ws.events() if isinstance(e, Request)]
    except RemoteProtocolError as exc:
        raise Refused(str(exc)) from None
    if not requests:
        raise Refused("an incomplete upgrade request")
    if SUBPROTOCOL not in requests[0].subprotocols:
        raise Refused("a websocket with subprotocol mqtt")
    return ws


def accept(ws: WSConnection) -> bytes:
    """The 101 response to the request handshake() read (no extensions: frames stay as the broker's bytes)."""
    return ws.send(AcceptConnection(subprotocol=SUBPROTOCOL))


@dataclass
class Upstream:
    """The broker the relay connects to: its MQTT TCP listener, TLS when `tls`; with `others` (a clustered centre's
    other nodes, ROBOBUS_FLEET_BROKERS), each page's connection goes to the node the last one reached, else to the
    next in turn that answers. A page whose node fails loses its websocket and reconnects (as it does on any loss of
    the broker): that connection goes on to the next node."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    others: tuple[tuple[str, int], ...] = ()
    _at: int = field(default=0, init=False, repr=False)  # the node the last connection reached

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [(self.host, self.port), *self.others]

    @property
    def current(self) -> tuple[str, int]:
        """The node the last connection reached (the first before any)."""
        return self.nodes[self._at]

    def connect(self, timeout: float = 5.0) -> socket.socket:
        """A connection to the first node that answers, from the one the last connection reached; OSError (the
        last node's) when none does."""
        nodes, start = self.nodes, self._at
        err: OSError | None = None
        for i in range(len(nodes)):
            at = (start + i) % len(nodes)
            try:
                s = self._open(*nodes[at], timeout)
            except OSError as exc:
                err = exc
                if len(nodes) > 1:
                    log.warning("relay: broker %s:%s unreachable (%s), trying the next", *nodes[at], exc)
                continue
            self._at = at
            return s
        assert err is not None
        raise err

    def _open(self, host: str, port: int, timeout: float) -> socket.socket:
        s = socket.create_connection((host, port), timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            s = self.tls.wrap_socket(s, server_hostname=host)
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
    """One page's websocket (accepted: `ws` in state OPEN, `page`/`rfile` its socket) and its broker connection.
    `ws` is used under `send_lock` only: the page's frames are parsed on this thread, the broker's bytes are
    framed on another."""

    def __init__(self, page: socket.socket, rfile: Readable, ws: WSConnection, broker: socket.socket,
                 flush_s: float, stats: RelayStats) -> None:
        self.page, self.rfile, self.ws, self.broker = page, rfile, ws, broker
        self.flush_s = flush_s
        self.stats = stats
        self.send_lock = threading.Lock()
        self.closed = threading.Event()

    def _send_page(self, event: Event) -> None:
        with self.send_lock:
            self.page.sendall(self.ws.send(event))

    def _try_send(self, event: Event) -> None:
        try:
            self._send_page(event)
        except (OSError, LocalProtocolError):  # the page is gone, or the websocket already closing
            pass

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

    def _page_events(self) -> list[Event] | None:
        """The events in the page's next bytes; None once it has gone (end of stream)."""
        data = self.rfile.read1(READ_BYTES)
        if not data:
            return None
        with self.send_lock:
            self.ws.receive_data(data)
            return list(self.ws.events())

    def _page_to_broker(self) -> None:
        message = 0  # bytes of the page's current message so far
        try:
            while not self.closed.is_set() and (events := self._page_events()) is not None:
                for event in events:
                    if isinstance(event, BytesMessage):
                        message += len(event.data)
                        if message > MAX_MESSAGE:
                            raise ProtocolError(f"a message over {MAX_MESSAGE} bytes", CloseReason.MESSAGE_TOO_BIG)
                        if event.message_finished:
                            message = 0
                        if event.frame_finished:
                            self.stats.add(frames_from_page=1)
                        self.broker.sendall(event.data)  # MQTT is a byte stream: frame boundaries do not matter
                    elif isinstance(event, Ping):
                        self._send_page(event.response())
                    elif isinstance(event, TextMessage):
                        raise ProtocolError("MQTT over websockets is binary (MQTT 5.0, 6.0)",
                                            CloseReason.UNSUPPORTED_DATA)
                    elif isinstance(event, CloseConnection):
                        if self.ws.state is ConnectionState.REMOTE_CLOSING:  # the page closes: answer
                            self._send_page(event.response())
                            return
                        if self.ws.state is ConnectionState.CLOSED:  # the page's answer to our close
                            return
                        raise ProtocolError(event.reason or "malformed frame", event.code)  # wsproto's ParseFailed
        except ProtocolError as exc:
            self.stats.add(errors=1)
            log.warning("relay: closing a page's websocket: %s", exc)
            self._try_send(CloseConnection(code=exc.code, reason=str(exc)))
        except (OSError, LocalProtocolError):
            pass

    def _broker_to_page(self) -> None:
        """Everything the broker sends, at most one frame per flush_s (at once after a quiet spell)."""
        buf = bytearray()
        next_send = 0.0  # monotonic time before which a frame waits
        try:
            while not self.closed.is_set():
                now = time.monotonic()
                if buf and (now >= next_send or len(buf) >= FLUSH_BYTES):
                    self._send_page(BytesMessage(data=bytes(buf)))
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
                        self._send_page(BytesMessage(data=bytes(buf)))
                    self._send_page(CloseConnection(code=CloseReason.NORMAL_CLOSURE))
                    break
                buf += data
        except (OSError, ValueError, LocalProtocolError):  # the page or the broker has gone; the page closed
            pass
        finally:
            self.close()
