"""The dashboard's HTTP side: a few static files, a browser library from npm, and two JSON documents.

The page itself talks MQTT over the broker's websockets listener; this process never touches the bus.
It serves:
    /                       the page (static/index.html)
    /static/<file>          the app's ES modules and style sheet (no build step)
    /vendor/<file>          Ajv's browser bundle from the node_modules `make setup` installs
    /api/asyncapi.json      the contract (shared.asyncapi.build_document()): states, events, command forms
    /api/config.json        the default broker URL and topic root for the connect form
Only names known at start are served (no paths from the request touch the file system)."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("robobus.dashboard")

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
NODE_MODULES = HERE / "node_modules"
# Browser bundles of the npm packages in shared/dashboard/package.json (UMD, used as shipped). The MQTT client
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
    """What the connect form starts with. An empty ws_url means ws://<the page's host>:9001."""

    ws_url: str = ""
    topic_root: str = "robobus"
    username: str = ""
    title: str = "robobus"

    def as_json(self) -> bytes:
        return json.dumps({"ws_url": self.ws_url, "topic_root": self.topic_root, "username": self.username,
                           "title": self.title}).encode()


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


def _handler(app: DashboardApp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "robobus-dashboard"

        def do_GET(self) -> None:
            self._answer(body=True)

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
    """ThreadingHTTPServer on host:port (port 0 picks a free one); `url` once started."""

    def __init__(self, document: dict[str, Any], config: PageConfig, host: str = "127.0.0.1", port: int = 8080,
                 node_modules: Path = NODE_MODULES) -> None:
        self.app = DashboardApp(document, config, node_modules)
        self.httpd = ThreadingHTTPServer((host, port), _handler(self.app))
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
