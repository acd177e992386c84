"""The dashboard's HTTP side: a few static files, a browser library from npm, and two JSON documents.

The page itself talks MQTT over websockets: to the broker's websockets listener, or (the default of
`robobus dashboard`) through this process's relay at /mqtt, which carries its bytes unchanged to the broker's
MQTT listener in fewer websocket frames (relay.py). This process never reads or publishes a message.
It serves:
    /                       the page (static/index.html)
    /static/<file>          the app's ES modules and style sheet (no build step)
    /vendor/<file>          Ajv's browser bundle from the node_modules `make setup` installs
    /api/asyncapi.json      the contract (shared.tools.asyncapi.build_document()): states, events, command forms
    /api/config.json        the default broker URL and topic root for the connect form
    /mqtt                   the relay (websocket upgrade, subprotocol mqtt), when a relay upstream is given
Only names known at start are served (no paths from the request touch the file system)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shared.tools.dashboard.relay import Refused, RelayStats, Session, Upstream, accept, handshake

log = logging.getLogger("robobus.dashboard")

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
NODE_MODULES = HERE / "node_modules"
# Browser bundles of the npm packages in shared/tools/dashboard/package.json (UMD, used as shipped). The MQTT client
# is the page's own (static/mqtt5.js): mqtt.js's bundle cost more CPU per message than the page itself.
VENDOR = {
    "ajv2020.min.js": "ajv-dist/dist/ajv2020.min.js",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".json": "application/json", ".png": "image/png",
         ".svg": "image/svg+xml"}


class MissingAssets(RuntimeError):
    """The npm packages are not installed next to the server."""


@dataclass(frozen=True)
class PageConfig:
    """What the connect form starts with. An empty ws_url means the relay (ws://<the page's host:port>/mqtt)
    when `relay`, else ws://<the page's host>:9001."""

    ws_url: str = ""
    topic_root: str = "robobus"
    username: str = ""
    title: str = "robobus"
    relay: bool = False
    sites: str = ""  # a fleet's centre: 'SITE=ROOT ...' (ROBOBUS_CENTRAL_SITES): the page's fleet view

    def as_json(self) -> bytes:
        return json.dumps({"ws_url": self.ws_url, "topic_root": self.topic_root, "username": self.username,
                           "title": self.title, "relay": "/mqtt" if self.relay else "", "sites": self.sites}).encode()


def vendor_files(node_modules: Path = NODE_MODULES) -> dict[str, Path]:
    """The browser bundles, or MissingAssets naming what to run."""
    files = {name: node_modules / rel for name, rel in VENDOR.items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise MissingAssets(f"the dashboard's browser libraries are missing ({', '.join(missing)}): run `make setup` "
                            f"(npm ci in {node_modules.parent})")
    return files


class DashboardApp:
    """The routes, resolved once: every servable path maps to bytes or a file known at start."""

    def __init__(self, document: dict[str, Any], config: PageConfig, node_modules: Path = NODE_MODULES) -> None:
        self.routes: dict[str, tuple[str, Path | bytes]] = {
            "/": (TYPES[".html"], STATIC / "index.html"),
            "/api/asyncapi.json": ("application/json", json.dumps(document).encode()),
            "/api/config.json": ("application/json", config.as_json()),
        }
        for f in sorted(STATIC.iterdir()):
            if f.is_file() and f.suffix in TYPES:
                self.routes[f"/static/{f.name}"] = (TYPES[f.suffix], f)
        for name, path in vendor_files(node_modules).items():
            self.routes[f"/vendor/{name}"] = (TYPES[Path(name).suffix], path)

    def get(self, raw_path: str) -> tuple[str, bytes] | None:
        hit = self.routes.get(urlsplit(raw_path).path)
        if hit is None:
            return None
        ctype, body = hit
        # Files are read per request so an edited page shows on reload; they are small.
        return ctype, body.read_bytes() if isinstance(body, Path) else body


@dataclass
class Relay:
    """Where /mqtt relays to, and how often it may send the page a frame."""

    upstream: Upstream
    flush_s: float = 0.05
    stats: RelayStats | None = None


def _handler(app: DashboardApp, relay: Relay | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "robobus-dashboard"

        def do_GET(self) -> None:
            if relay is not None and urlsplit(self.path).path == "/mqtt":
                self._relay(relay)
                return
            self._answer(body=True)

        def _relay(self, r: Relay) -> None:
            # wsproto reads the upgrade request as it came (the request line and headers the handler parsed)
            head = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            try:
                ws = handshake(f"{self.requestline}\r\n{head}\r\n".encode("latin-1", "replace"))
            except Refused as exc:
                self.send_error(HTTPStatus.BAD_REQUEST, str(exc))
                return
            try:
                broker = r.upstream.connect()
            except OSError as exc:
                log.warning("relay: broker %s unreachable: %s",
                            ", ".join(f"{h}:{p}" for h, p in r.upstream.nodes), exc)
                self.send_error(HTTPStatus.BAD_GATEWAY, "broker unreachable")
                return
            self.close_connection = True
            self.wfile.write(accept(ws))
            self.wfile.flush()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            Session(self.connection, self.rfile, ws, broker, r.flush_s, r.stats or RelayStats()).run()

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            hit = app.get(self.path)
            if hit is None:
                self.send_error(HTTPStatus.NOT_FOUND, "not part of the dashboard")
                return
            ctype, data = hit
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-cache")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


class DashboardServer:
    """ThreadingHTTPServer on host:port (port 0 picks a free one); `url` once started. With `relay`, /mqtt
    relays the page's MQTT to the broker (relay.py)."""

    def __init__(self, document: dict[str, Any], config: PageConfig, host: str = "127.0.0.1", port: int = 8080,
                 node_modules: Path = NODE_MODULES, relay: Relay | None = None) -> None:
        self.app = DashboardApp(document, config, node_modules)
        if relay is not None and relay.stats is None:
            relay.stats = RelayStats()
        self.relay = relay
        self.httpd = ThreadingHTTPServer((host, port), _handler(self.app, relay))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(target=self.serve_forever, name="dashboard-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
