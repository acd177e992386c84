"""`robobus new-service NAME`: the rooms of a minimal working service (docs/kit.md, "How to add a service").

The service it writes is small but whole: a tiny line protocol over TCP (pure codec, fuzz targets declared), a
transport that reports to the kit's link supervisor, a device module (`device.py`) whose motion command declares
`motion=True` and binds a stop action, request models that refuse unknown keys, a simulator on the real wire that
can be told to be a device of another kind, a rig for the conformance suite, and a README. The suite generates one in a
temporary folder and holds it to the conformance suite and the layout rules (tests/kit/test_scaffold.py), so the
guide and the kit cannot drift apart.

The device is a positioner: `read` returns its position, `move_to` sets a target it moves towards (it moves: the
bus stop refuses it), the stop action makes it hold where it is.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from pathlib import Path

NAME_RULE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)+$")


@dataclass(frozen=True)
class Names:
    """Everything a service's name decides."""

    service: str   # sixth-io: the entry point, the node, the topic level
    package: str   # services.sixth_io (or an out-of-tree package)
    section: str   # sixth_io: the settings' fields and ROBOBUS_SIXTH_IO_*
    cls: str       # SixthIo: the prefix of the model classes (unique across services)
    device: str    # sixth1: the device the default settings serve
    sim_process: str  # sixth-sim: its simulator's line in deploy/Procfile.sim (`<x>-sim` serves `<x>-...`)
    port: int      # the simulator's default TCP port

    @property
    def port_variable(self) -> str:
        return "ROBOBUS_PORT_" + self.sim_process.upper().replace("-", "_")


def names(service: str, package: str | None = None) -> Names:
    if not NAME_RULE.match(service):
        raise ValueError(f"{service!r}: a service name is lower-case words joined by '-', at least two "
                         "(epuck-gateway, roi-modules): its simulator is named after all but the last")
    section = service.replace("-", "_")
    return Names(service=service, package=package or f"services.{section}", section=section,
                 cls="".join(w.capitalize() for w in service.split("-")), device=f"{service.split('-')[0]}1",
                 sim_process=f"{service.rsplit('-', 1)[0]}-sim", port=21000 + zlib.crc32(service.encode()) % 9000)


def render(text: str, n: Names) -> str:
    for key, value in (("__SERVICE__", n.service), ("__PACKAGE__", n.package), ("__SECTION_UPPER__",
                       n.section.upper()), ("__SECTION__", n.section), ("__CLS__", n.cls), ("__DEVICE__", n.device),
                       ("__PORT__", str(n.port)), ("__SIMPROC__", n.sim_process), ("__PORTVAR__", n.port_variable)):
        text = text.replace(key, value)
    return text


def create(service: str, folder: Path, package: str | None = None) -> list[Path]:
    """Write the service's rooms into `folder` (which must not exist or be empty); the files written."""
    n = names(service, package)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, text in FILES.items():
        path = folder / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(text, n).lstrip("\n"))
        written.append(path)
    return written


def registration(service: str, package: str | None = None) -> str:
    """What the new service adds outside its folder: its entry points, its lines in deploy/Procfile.sim and its
    containers in deploy/compose.yaml."""
    return render(REGISTRATION, names(service, package)).lstrip("\n")


REGISTRATION = '''
# pyproject.toml (each line under its table; in this repository the tables exist already)
[project.entry-points."robobus.services"]
__SERVICE__ = "__PACKAGE__.api:API"
[project.entry-points."robobus.transports"]
"__SERVICE__.tcp" = "__PACKAGE__.transport:tcp_link"

# deploy/Procfile.sim (the simulator's port as a named variable: a stack gives it one of its own)
__SIMPROC__: python -m __PACKAGE__.sim --port ${__PORTVAR__:-__PORT__}
__SERVICE__: ROBOBUS___SECTION_UPPER___PORT=${__PORTVAR__:-__PORT__} python -m __PACKAGE__

# deploy/compose.yaml, under services: (and `make schema`). A service with an extra of its own (pyproject.toml's
# [project.optional-dependencies]) adds `EXTRAS: <extra>` to both containers' build args: the image installs
# `.[<extra>]` only.
  __SIMPROC__:
    <<: *service
    profiles: [sim]
    depends_on: []
    build: {<<: *build, args: {ROBOBUS_BASE_IMAGE: "${ROBOBUS_BASE_IMAGE:-python:3.11-slim-bookworm}"}}
    image: robobus/__SERVICE__:${ROBOBUS_VERSION:-dev}
    command: ["python3", "-m", "__PACKAGE__.sim", "--host", "0.0.0.0", "--port", "__PORT__"]

  __SERVICE__-sim:
    <<: *service
    profiles: [sim]
    depends_on: {broker: {condition: service_healthy}, __SIMPROC__: {condition: service_started}}
    build: {<<: *build, args: {ROBOBUS_BASE_IMAGE: "${ROBOBUS_BASE_IMAGE:-python:3.11-slim-bookworm}"}}
    image: robobus/__SERVICE__:${ROBOBUS_VERSION:-dev}
    command: ["python3", "-m", "__PACKAGE__"]
    environment: {<<: *env, ROBOBUS___SECTION_UPPER___HOST: __SIMPROC__}
    env_file: ["${ROBOBUS_SECRETS_DIR:-./secrets}/__SERVICE__.env"]
    healthcheck: {<<: *healthcheck, test: ["CMD", "python3", "/app/healthcheck.py", "__SERVICE__"]}
'''

FILES: dict[str, str] = {}

FILES["__init__.py"] = '''
"""__SERVICE__: one positioner on a TCP line protocol (made by `robobus new-service`)."""
'''

FILES["protocol.py"] = '''
"""__SERVICE__'s wire format, pure: bytes in, events out, no I/O, no clock.

One line per message, ASCII, ending in "\\\\n", at most MAX_LINE bytes. The device speaks first, on every connection:
    HELLO <kind> <version>      the kind tells a device of another kind at the same address
The host asks, the device answers each request with one line, in order:
    READ            -> POS <position>
    MOVE <target>   -> OK <target>       (the device moves towards it; it moves)
    HOLD            -> OK <position>     (stop where it is)
    anything else   -> ERR <why>
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIND = "__SERVICE__"
VERSION = "1"
MAX_LINE = 128


class ProtocolError(ValueError):
    """Bytes that are no message of this protocol."""


@dataclass(frozen=True)
class Reply:
    word: str                  # HELLO, POS, OK or ERR
    value: float | None = None  # POS's and OK's number
    text: str = ""             # HELLO's kind and version, ERR's reason


class LineBuffer:
    """Cuts a byte stream into lines; a line longer than MAX_LINE is a ProtocolError (the buffer is emptied)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\\n")
        if len(self._buf) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
            self._buf = b""
            raise ProtocolError(f"a line longer than {MAX_LINE} bytes")
        return lines


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ProtocolError(f"not a number: {text[:20]!r}") from None
    if not math.isfinite(value):
        raise ProtocolError(f"not a finite number: {text[:20]!r}")
    return value


def decode_reply(line: bytes) -> Reply:
    """One line from the device (without its newline)."""
    try:
        text = line.decode("ascii").rstrip("\\r")
    except UnicodeDecodeError:
        raise ProtocolError("not ASCII") from None
    word, _, rest = text.partition(" ")
    if word == "HELLO" and rest:
        return Reply("HELLO", text=rest)
    if word in ("POS", "OK"):
        return Reply(word, value=_number(rest))
    if word == "ERR":
        return Reply("ERR", text=rest)
    raise ProtocolError(f"unknown reply {text[:20]!r}")


def encode_request(word: str, value: float | None = None) -> bytes:
    return (f"{word} {value!r}" if value is not None else word).encode("ascii") + b"\\n"


def decode_request(line: bytes) -> tuple[str, float | None]:
    """One line from the host (the simulator's side)."""
    try:
        text = line.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ProtocolError("not ASCII") from None
    word, _, rest = text.partition(" ")
    if word in ("READ", "HOLD") and not rest:
        return word, None
    if word == "MOVE":
        return word, _number(rest)
    raise ProtocolError(f"unknown request {text[:20]!r}")


def encode_reply(reply: Reply) -> bytes:
    if reply.value is not None:
        return f"{reply.word} {reply.value!r}\\n".encode("ascii")
    return f"{reply.word} {reply.text}\\n".encode("ascii")


def hello_kind(reply: Reply) -> str:
    return reply.text.split(" ", 1)[0]


def fuzz_replies(data: bytes) -> list[Reply]:
    """What the transport does with bytes from a device: cut into lines (the first byte chooses the size of each
    read) and decode each."""
    buf, out = LineBuffer(), []
    step = (data[0] if data else 1) or 1
    for i in range(1, len(data), step):
        for line in buf.feed(data[i:i + step]):
            out.append(decode_reply(line))
    return out


def fuzz_requests(data: bytes) -> list[tuple[str, float | None]]:
    """The simulator's side: bytes from a host, decoded."""
    buf, out = LineBuffer(), []
    for line in buf.feed(data):
        out.append(decode_request(line))
    return out


# the decoders of device bytes, fuzzed by tests/fuzz (names unique across services)
FUZZ = {"__SECTION___replies": fuzz_replies, "__SECTION___requests": fuzz_requests}
FUZZ_ALLOWED = (ProtocolError,)
'''

FILES["models.py"] = '''
"""__SERVICE__'s payloads. Class names are prefixed (one schema namespace for every service); every request
refuses unknown keys (a typo is an error, never a default silently used)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class __CLS__Position(BaseModel):
    """Where the positioner is."""

    position: float = Field(description="The device's position, in its units")


class __CLS__Read(BaseModel):
    """Read the position now (no arguments)."""

    model_config = ConfigDict(extra="forbid")


class __CLS__MoveTo(BaseModel):
    """Move to a position."""

    model_config = ConfigDict(extra="forbid")
    target: float = Field(ge=-1000, le=1000, description="The position to move to")


class __CLS__Ack(BaseModel):
    position: float = Field(description="The target the device took, or where it holds")
'''

FILES["api.py"] = '''
"""__SERVICE__'s contract: what the registry, the schema export and every client read. It imports only
models.py and the kit's contract modules."""

from __future__ import annotations

from __PACKAGE__.models import __CLS__Ack, __CLS__MoveTo, __CLS__Position, __CLS__Read
from shared.contract import ServiceAPI
from shared.errors import ErrorCode

API = ServiceAPI("__SERVICE__", device_doc="one positioner", doc="A positioner on a TCP line protocol.")
POSITION = API.state("position", __CLS__Position, rate_hz=10, doc="Where the positioner is")
READ = API.command("read", __CLS__Read, __CLS__Position, doc="Read the position from the device now",
                   errors=[ErrorCode.UNAVAILABLE])
MOVE_TO = API.command("move_to", __CLS__MoveTo, __CLS__Ack, doc="Move to a position",
                      errors=[ErrorCode.UNAVAILABLE, ErrorCode.DEVICE_ERROR], motion=True)
'''

FILES["settings.py"] = '''
"""__SERVICE__'s settings: ROBOBUS___SECTION_UPPER___* in the environment, or keys of a ROBOBUS_CONFIG file."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from shared.settings import KitSettings
from shared.transports import check_transport


class __CLS__Settings(KitSettings):
    section: ClassVar[str] = "__SECTION__"  # any other ROBOBUS___SECTION_UPPER___* is refused

    __SECTION___transport: str = Field("tcp", description="The transport, by its name in `robobus.transports`")
    __SECTION___device: str = Field("__DEVICE__", description="The device's name on the bus")
    __SECTION___host: str = Field("127.0.0.1", description="The device's address")
    __SECTION___port: int = Field(__PORT__, ge=1, le=65535, description="The device's TCP port")
    __SECTION___liveness_s: float = Field(1.0, gt=0, description="Valid data must arrive within this")
    __SECTION___poll_hz: float = Field(10.0, gt=0, le=100, description="How often the position is read")
    __SECTION___reply_timeout_s: float = Field(0.5, gt=0, description="A request not answered within this fails")

    @field_validator("__SECTION___transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        return check_transport("__SERVICE__", v)
'''

FILES["transport.py"] = '''
"""__SERVICE__'s `tcp` transport: the one owner of the device's socket, a `shared.transport.Transport`. The kit's
reconnect loop opens it (and opens it again, at the link supervisor's rhythm); a session checks the device's HELLO
and reads the position at the poll rate; commands are requests on the same socket, one at a time. Every event goes
to the kit's link supervisor, which decides health.

Registered as the entry point `__SERVICE__.tcp` (group `robobus.transports`); the service loads `tcp_link` by name.
"""

from __future__ import annotations

import socket
import threading
import time

from __PACKAGE__ import protocol as p
from __PACKAGE__.device import LinkHooks
from __PACKAGE__.settings import __CLS__Settings
from shared.errors import CommandError, ErrorCode
from shared.transport import OpenFailed, ReconnectLoop, Transport


class Unavailable(CommandError):
    """No device to ask: not connected, or it did not answer in time (a command's `unavailable`)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


class TcpLink(Transport):
    def __init__(self, settings: __CLS__Settings, hooks: LinkHooks) -> None:
        self.s = settings
        self.link = hooks.link
        self.on_position = hooks.on_position
        self._opening: socket.socket | None = None  # opened, its HELLO not read yet
        self._sock: socket.socket | None = None     # the session's socket, once the device said what it is
        self._why = ""                              # why the session's socket was dropped
        self._buf = p.LineBuffer()
        self._io = threading.Lock()  # one request on the wire at a time
        self._loop = ReconnectLoop(self, hooks.link, name="__SERVICE__-link")

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        self._loop.stop()
        self._drop("shutdown")
        self._loop.join(2.0)
        self.link.stop("shutdown")

    # -- requests (any thread) ------------------------------------------------------------------------------
    def request(self, word: str, value: float | None = None) -> p.Reply:
        with self._io:
            sock = self._sock
            if sock is None:
                raise Unavailable("not connected to the device")
            try:
                sock.sendall(p.encode_request(word, value))
                return self._reply(sock)
            except (OSError, p.ProtocolError) as exc:
                self._drop(f"{word}: {exc}")
                raise Unavailable(f"{word}: {exc}") from None

    def _reply(self, sock: socket.socket) -> p.Reply:
        deadline = time.monotonic() + self.s.__SECTION___reply_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no reply in time")
            sock.settimeout(remaining)
            data = sock.recv(4096)
            if not data:
                raise ConnectionError("closed by the device")
            for line in self._buf.feed(data):
                try:
                    reply = p.decode_reply(line)
                except p.ProtocolError as exc:
                    self.link.garbage(str(exc))
                    continue
                if reply.word == "POS" and reply.value is not None:
                    self.link.data()
                    self.on_position(reply.value)
                return reply

    # -- the kit's reconnect loop: open, one session ---------------------------------------------------------
    def open(self) -> None:
        try:
            sock = socket.create_connection((self.s.__SECTION___host, self.s.__SECTION___port),
                                            timeout=self.s.__SECTION___reply_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise OpenFailed(str(exc)) from None
        self.link.opened()
        self._buf = p.LineBuffer()
        self._opening = sock

    def run_session(self) -> str:
        sock, self._opening = self._opening, None
        assert sock is not None
        try:
            hello = self._reply(sock)
        except (OSError, p.ProtocolError) as exc:
            sock.close()
            return f"no HELLO: {exc}"
        kind = p.hello_kind(hello) if hello.word == "HELLO" else ""
        if kind != p.KIND:
            sock.close()
            self.link.fault(f"not a {p.KIND}: the device at {self.s.__SECTION___host}:{self.s.__SECTION___port} "
                            f"says {hello.word} {hello.text!r}")
            return "wrong kind"
        self.link.clear_fault()
        with self._io:
            self._sock = sock
        while self._sock is not None:
            try:
                self.request("READ")
            except Unavailable:
                pass
            if self._loop.wait(1.0 / self.s.__SECTION___poll_hz):
                break
        return self._why or "closed"

    def _drop(self, reason: str) -> None:
        """The session's socket is gone: the kit's loop tells the supervisor at once (not while closing)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._why = reason
            sock.close()
            self._loop.lost(reason)


def tcp_link(settings: __CLS__Settings, hooks: LinkHooks) -> TcpLink:
    """The factory the service loads by name (`factory(settings, hooks)`): the device's link, not started."""
    return TcpLink(settings, hooks)
'''

FILES["device.py"] = '''
"""__SERVICE__'s device: its handlers and its stop action, given a narrow context (the node, the settings, the
link the service made), never the service."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from __PACKAGE__ import protocol as p
from __PACKAGE__.api import MOVE_TO, POSITION, READ
from __PACKAGE__.models import __CLS__Ack, __CLS__MoveTo, __CLS__Position, __CLS__Read
from __PACKAGE__.settings import __CLS__Settings
from shared import CommandError, ErrorCode, Node
from shared.device import Device, handles
from shared.link import LinkPolicy, SupervisedLink
from shared.messages import StopState


@dataclass(frozen=True)
class LinkHooks:
    """What the device gives its transport (the factory's `hooks`): the link it reports to, and where positions go."""

    link: SupervisedLink
    on_position: Callable[[float], None]


class Link(Protocol):
    """What the device needs of its transport."""

    def request(self, word: str, value: float | None = None) -> p.Reply: ...
    def start(self) -> None: ...
    def close(self) -> None: ...


class Positioner:
    def __init__(self, node: Node, settings: __CLS__Settings) -> None:
        self.dev: Device = node.device(settings.__SECTION___device)
        self.supervised: SupervisedLink = self.dev.supervise_link(LinkPolicy(
            liveness_s=settings.__SECTION___liveness_s, backoff_min_s=0.2, backoff_max_s=1.0, probe_period_s=1.0))
        self.link: Link | None = None
        self.dev.bind_all(self)
        self.dev.on_stop(self.stop_now)

    def attach(self, link: Link) -> None:
        self.link = link

    def on_position(self, position: float) -> None:
        self.dev.publish(POSITION, __CLS__Position(position=position))

    def _ask(self, word: str, value: float | None = None) -> p.Reply:
        """One request; the transport answers a missing device with CommandError(UNAVAILABLE)."""
        if self.link is None:
            raise CommandError(ErrorCode.UNAVAILABLE, "the device's link is not started")
        reply = self.link.request(word, value)
        if reply.word == "ERR" or reply.value is None:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"the device answered {reply.word} {reply.text}")
        return reply

    @handles(READ)
    def read(self, req: __CLS__Read) -> __CLS__Position:
        return __CLS__Position(position=float(self._ask("READ").value or 0.0))

    @handles(MOVE_TO)
    def move_to(self, req: __CLS__MoveTo) -> __CLS__Ack:
        return __CLS__Ack(position=float(self._ask("MOVE", req.target).value or 0.0))

    def stop_now(self, stop: StopState) -> float:
        """The bus stop: the device holds where it is; the time it confirmed."""
        self._ask("HOLD")
        return time.time()
'''

FILES["service.py"] = '''
"""__SERVICE__'s wiring: the device (device.py) and the transport the settings name, loaded by name."""

from __future__ import annotations

from typing import Any

from __PACKAGE__.api import API
from __PACKAGE__.device import LinkHooks, Positioner
from __PACKAGE__.settings import __CLS__Settings
from shared import Node, ServiceUnavailable
from shared.lifecycle import Hooks
from shared.transports import TransportUnavailable, load_transport


class __CLS__Service:
    def __init__(self, positioner: Positioner, link: Any) -> None:
        self.positioner = positioner
        self.link = link

    def hooks(self) -> Hooks:
        return Hooks(start=self.link.start, shutdown=self.link.close)


def build(node: Node, settings: __CLS__Settings) -> __CLS__Service:
    try:
        factory = load_transport(API.service, settings.__SECTION___transport)
    except TransportUnavailable as exc:
        raise ServiceUnavailable(str(exc)) from None
    positioner = Positioner(node, settings)
    link = factory(settings, LinkHooks(positioner.supervised, positioner.on_position))
    positioner.attach(link)
    return __CLS__Service(positioner, link)


__all__ = ["build"]
'''

FILES["__main__.py"] = '''
"""python -m __PACKAGE__: the kit's one entry point (settings, logging, node, signals, shutdown)."""

from __future__ import annotations

from __PACKAGE__.api import API
from __PACKAGE__.service import build
from __PACKAGE__.settings import __CLS__Settings
from shared import run_service


def main() -> None:
    run_service(API, __CLS__Settings, build)


if __name__ == "__main__":
    main()
'''

FILES["sim.py"] = '''
"""__SERVICE__'s simulator: the device side of the same line protocol on a real TCP socket.

    python -m __PACKAGE__.sim [--host 127.0.0.1] [--port __PORT__] [--speed 50] [--kind __SERVICE__]

The positioner moves towards its target at --speed units per second; `--kind other` makes it a device of another
kind (its HELLO says so), for the conformance suite's wrong-kind fault.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

from __PACKAGE__ import protocol as p


class Positioner:
    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.position = 0.0
        self.target = 0.0
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def now(self) -> float:
        with self.lock:
            t = time.monotonic()
            step = self.speed * (t - self.t)
            self.t = t
            self.position += max(-step, min(step, self.target - self.position))
            return self.position

    def answer(self, word: str, value: float | None) -> p.Reply:
        position = self.now()
        with self.lock:
            if word == "MOVE" and value is not None:
                self.target = value
                return p.Reply("OK", value=value)
            if word == "HOLD":
                self.target = position
                return p.Reply("OK", value=position)
        return p.Reply("POS", value=position)


def serve(conn: socket.socket, device: Positioner, kind: str) -> None:
    buf = p.LineBuffer()
    with conn:
        conn.sendall(f"HELLO {kind} {p.VERSION}\\n".encode("ascii"))
        while True:
            try:
                data = conn.recv(4096)
            except OSError:
                return
            if not data:
                return
            try:
                lines = buf.feed(data)
            except p.ProtocolError as exc:
                conn.sendall(p.encode_reply(p.Reply("ERR", text=str(exc))))
                continue
            for line in lines:
                try:
                    reply = device.answer(*p.decode_request(line))
                except p.ProtocolError as exc:
                    reply = p.Reply("ERR", text=str(exc))
                try:
                    conn.sendall(p.encode_reply(reply))
                except OSError:
                    return


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m __PACKAGE__.sim", description=__doc__.split("\\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=__PORT__)
    ap.add_argument("--speed", type=float, default=50.0)
    ap.add_argument("--kind", default=p.KIND, help="what its HELLO says it is")
    a = ap.parse_args(argv)
    device = Positioner(a.speed)
    srv = socket.create_server((a.host, a.port))
    print(f"__SIMPROC__: serving a {a.kind} on {a.host}:{a.port}", flush=True)
    try:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn, device, a.kind), daemon=True).start()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
'''

FILES["rig.py"] = '''
"""__SERVICE__ on its simulator, each in its own process: what the conformance suite (tests/conformance/) runs
every fault against."""

from __future__ import annotations

from shared.tools.simrig import RigCommand, SimRig


def _sim(port: int, *extra: str) -> list[str]:
    return ["-m", "__PACKAGE__.sim", "--port", str(port), *extra]


RIG = SimRig(
    node_module="__PACKAGE__",
    devices=("__DEVICE__",),
    liveness_s=1.0,  # the default __SECTION___liveness_s
    sim=lambda ports: _sim(ports["__SECTION__"]),
    node_env=lambda ports: {"ROBOBUS___SECTION_UPPER___PORT": str(ports["__SECTION__"])},
    return_s=5.0,  # the probe period (1 s) + the budget, with room for a busy machine
    garbage_sim=lambda ports: ["-m", "shared.tools.simrig", "garbage-tcp", "--port", str(ports["__SECTION__"])],
    wrong_kind_sim=lambda ports: _sim(ports["__SECTION__"], "--kind", "not-a-__SERVICE__"),
    read_command=RigCommand("__DEVICE__", "read"),
    # move_to is a motion command: bench/stop.py measures the bus stop on each service's wire, or the rig says why
    # it does not (tests/kit/test_bench_stop.py). Measure it there once the simulator stamps its stop, or say why.
    stop_unmeasured="not measured yet: its simulator stamps no stop on its wire for bench/stop.py; its device binds "
                    "a stop action that holds where it is",
)
'''

FILES["tests/__init__.py"] = '''
'''

FILES["tests/test_end_to_end.py"] = '''
"""__SERVICE__ end to end: its simulator and its node, each in its own process, run as its rig declares (rig.py), on
the session's broker. `make test` collects a service's own tests (services/<package>/tests/) with the suite's
fixtures (tests/fixtures.py)."""

from __future__ import annotations

import os
import time

from shared.rpc import RpcClient, wait_for
from shared.tools.localbroker import NodeProcess
from shared.tools.simrig import Ports
from tests.fixtures import Broker

from ..rig import RIG


def test_the_node_reads_and_moves_its_simulator(broker_session: Broker) -> None:
    ports = Ports()
    root = f"__SECTION__{os.getpid()}{time.monotonic_ns() % 100000}"
    sim = NodeProcess(RIG.sim(ports), {})
    node = NodeProcess(["-m", RIG.node_module], {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_TOPIC_ROOT": root,
                                                 **RIG.node_env(ports)})
    assert RIG.read_command is not None
    read = RIG.read_command
    try:
        with RpcClient(broker_session.settings(topic_root=root), name="__SECTION__-test") as client:

            def read_ok() -> bool:  # the node answers once it is up, ok once its link to the simulator is
                try:
                    return client.call("__SERVICE__", read.device, read.name, read.payload, timeout=5).ok
                except TimeoutError:
                    return False

            assert wait_for(read_ok, 30), node.text()[-2000:]
            moved = client.call("__SERVICE__", read.device, "move_to", {"target": 10}, timeout=5)
            assert moved.ok, moved
    finally:
        node.stop()
        sim.stop()
'''

FILES["README.md"] = '''
# __SERVICE__

One positioner on a TCP line protocol (protocol.py): `read` its position, `move_to` a target (a motion command:
the bus stop refuses it, and the stop makes the device hold where it is).

## Run it
```sh
python -m __PACKAGE__.sim --port __PORT__ &          # the device side, on the real wire
ROBOBUS___SECTION_UPPER___PORT=__PORT__ python -m __PACKAGE__
robobus call __SERVICE__/__DEVICE__ move_to '{"target": 10}'
```

## Settings
| setting | default | what |
|---|---|---|
| `ROBOBUS___SECTION_UPPER___HOST`, `_PORT` | 127.0.0.1, __PORT__ | the device's address |
| `ROBOBUS___SECTION_UPPER___DEVICE` | __DEVICE__ | its name on the bus |
| `ROBOBUS___SECTION_UPPER___LIVENESS_S` | 1.0 | valid data must arrive within this |
| `ROBOBUS___SECTION_UPPER___POLL_HZ` | 10 | how often the position is read |
| `ROBOBUS___SECTION_UPPER___REPLY_TIMEOUT_S` | 0.5 | a request not answered within this fails (`unavailable`) |
| `ROBOBUS___SECTION_UPPER___TRANSPORT` | tcp | the transport, by name |

## Topics
`{root}/__SERVICE__/__DEVICE__/state/position` (10 Hz), `cmd/read`, `cmd/move_to`, and the kit's health.

## Health
The kit's link supervisor: operational while valid positions arrive within the budget; a device that says it is
of another kind is an `error` that says so.
'''
