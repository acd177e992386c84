"""`robobus dashboard`: serve the browser dashboard (registered under the `robobus.cli` entry point).

    robobus dashboard                                   http://127.0.0.1:8080/, the page's broker: this server's
                                                        relay ws://127.0.0.1:8080/mqtt -> ROBOBUS_MQTT_URL
    robobus dashboard --port 8090 --ws-url ws://broker.lab:9001 --root site1/robobus
                                                        the page goes to that broker's websockets listener
"""

from __future__ import annotations

import signal
import ssl
import sys
import threading
from typing import Annotated, Any

import typer
from pydantic import Field

from shared.rpc import FailoverSettings
from shared.settings import load_settings
from shared.tools.dashboard.relay import Upstream
from shared.tools.dashboard.server import DashboardServer, MissingAssets, PageConfig, Relay

# What the page connects to when no websockets URL is set: server.PageConfig and app.js's main() decide it.
WS_URL_DOC = ("Broker websockets URL the page starts with; empty = this server's relay, "
              "ws://<the page's host:port>/mqtt (to ROBOBUS_MQTT_URL's broker), or ws://<the page's host>:9001 "
              "with ROBOBUS_DASHBOARD_RELAY=false")


class DashboardSettings(FailoverSettings):
    """ROBOBUS_DASHBOARD_* (the kit's topic_root is the page's default root); the relay goes to ROBOBUS_MQTT_URL's
    broker, or to ROBOBUS_FLEET_BROKERS' nodes in turn."""

    dashboard_host: str = Field("127.0.0.1", description="Address the HTTP server binds")
    dashboard_port: int = Field(8080, ge=0, le=65535, description="HTTP port (0 = any free port)")
    dashboard_ws_url: str = Field("", description=WS_URL_DOC)
    dashboard_username: str = Field("", description="User name the connect form starts with (never a password)")
    central_sites: str = Field("", description="At a fleet's centre: the sites, 'SITE=ROOT ...' (as fleet-watch "
                                               "reads them): the page shows a fleet view, one row per site")
    dashboard_relay: bool = Field(True, description="Serve /mqtt, relaying the page's MQTT to ROBOBUS_MQTT_URL's "
                                                    "broker in fewer websocket frames; the page's default broker "
                                                    "when no websockets URL is set")
    dashboard_relay_flush_ms: float = Field(50.0, gt=0, le=1000, description="The relay sends the page at most "
                                                                              "one websocket frame per this")


def _tls_context(s: DashboardSettings) -> ssl.SSLContext:
    """The kit's TLS settings, for the relay's connection to an mqtts:// broker."""
    ctx = ssl.create_default_context(cafile=str(s.mqtt_tls_ca) if s.mqtt_tls_ca else None)
    if s.mqtt_tls_cert:
        ctx.load_cert_chain(str(s.mqtt_tls_cert), str(s.mqtt_tls_key) if s.mqtt_tls_key else None)
    if s.mqtt_tls_insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def dashboard(
    host: Annotated[str | None, typer.Option(help="Bind address (ROBOBUS_DASHBOARD_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (ROBOBUS_DASHBOARD_PORT, default 8080)")] = None,
    ws_url: Annotated[str | None, typer.Option("--ws-url", help="Broker websockets URL for the page "
                                                                 "(ROBOBUS_DASHBOARD_WS_URL); default: the relay "
                                                                 "at /mqtt")] = None,
    root: Annotated[str | None, typer.Option(help="Topic root (ROBOBUS_TOPIC_ROOT)")] = None,
) -> None:
    """Serve the browser dashboard: every node and device, live state, commands, jobs, events."""
    from shared.tools.asyncapi import build_document

    overrides: dict[str, Any] = {k: v for k, v in (("dashboard_host", host), ("dashboard_port", port),
                                                   ("dashboard_ws_url", ws_url), ("topic_root", root))
                                 if v is not None}
    s = load_settings(DashboardSettings, **overrides)
    relay = None
    nodes = s.brokers()
    if s.dashboard_relay:
        (host, port), others = nodes[0], tuple(nodes[1:])
        relay = Relay(Upstream(host, port, _tls_context(s) if s.broker().tls else None, others=others),
                      s.dashboard_relay_flush_ms / 1000)
    try:
        server = DashboardServer(build_document(root=s.topic_root),  # addresses under the running root
                                 PageConfig(ws_url=s.dashboard_ws_url, topic_root=s.topic_root,
                                            username=s.dashboard_username, relay=relay is not None,
                                            sites=s.central_sites),
                                 s.dashboard_host, s.dashboard_port, relay=relay)
    except MissingAssets as exc:
        print(f"robobus: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    except OSError as exc:
        print(f"robobus: cannot serve on {s.dashboard_host}:{s.dashboard_port}: {exc.strerror}", file=sys.stderr)
        raise typer.Exit(2) from None
    default = s.dashboard_ws_url or (f"relay {server.url.replace('http', 'ws', 1)}mqtt -> "
                                     + ", ".join(f"{h}:{p}" for h, p in nodes) if relay
                                     else "ws://<the page's host>:9001")
    print(f"robobus dashboard: {server.url} (broker {default}, root {s.topic_root})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    stop.wait()
    server.stop()
