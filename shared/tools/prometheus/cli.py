"""`robobus prometheus`: serve the bus's health and counters as Prometheus metrics.

    robobus prometheus                                      http://127.0.0.1:9880/metrics, root ROBOBUS_TOPIC_ROOT
    robobus prometheus --bind 0.0.0.0 --roots '+/robobus'   a fleet's centre: every site (the `+` level is the site)
    ROBOBUS_PROMETHEUS_ROOTS="site-a=site-a/robobus site-b=site-b/robobus" robobus prometheus

One exporter per bus (a site's broker, or a centre's that sees every site): it subscribes with one MQTT session
to status, health, `_node/state/stats`, the stop latches and answers, job results, flash reports and the few
service states with figures (ethercat-loop's loop_stats, the e-puck and ROI links), and asks nothing of the
nodes. docs/prometheus.md: the metrics, the alert rules (deploy/prometheus/), pointing a Prometheus at it."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import paho.mqtt.client as mqtt
import typer
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from pydantic import Field, field_validator

from shared.logs import setup_logging
from shared.mqtt.session import MqttSession, unique_client_id
from shared.settings import KitSettings, load_settings
from shared.tools.prometheus.metrics import BusCollector
from shared.tools.prometheus.view import SUBSCRIPTIONS, BusView, Root, parse_roots

log = logging.getLogger("robobus.prometheus")

DEFAULT_PORT = 9880
# periodic messages: a lost one is replaced by the next (QoS 0, no acknowledgement); the rest at QoS 1
QOS0_KINDS = frozenset({"health", "stats", "state"})


class PrometheusSettings(KitSettings):
    """ROBOBUS_PROMETHEUS_* (the kit's MQTT settings: the broker, its user, TLS)."""

    section: ClassVar[str] = "prometheus"
    # compose's own variables (deploy/compose.prometheus.yaml), not the exporter's
    unchecked_env: ClassVar[frozenset[str]] = frozenset({"ROBOBUS_PROMETHEUS_SERVER_PORT",
                                                         "ROBOBUS_PROMETHEUS_SERVER_BIND",
                                                         "ROBOBUS_PROMETHEUS_RETENTION"})

    prometheus_bind: str = Field("127.0.0.1", description="Address the metrics HTTP server binds")
    prometheus_port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="Port of /metrics (0: any free port)")
    prometheus_roots: str = Field("", description="Topic roots watched: 'SITE=ROOT ...' or 'ROOT ...', a level may "
                                                  "be '+' (the site: '+/robobus' at a fleet's centre); empty: "
                                                  "ROBOBUS_TOPIC_ROOT")
    prometheus_stale_s: float = Field(17.0, ge=1, le=3600,
                                      description="A message older than this is not exported as live (a device's "
                                                  "health then says connection 0, state 'stale')")

    @field_validator("prometheus_roots")
    @classmethod
    def _roots(cls, v: str) -> str:
        parse_roots(v)
        return v

    def roots(self) -> list[Root]:
        return parse_roots(self.prometheus_roots or self.topic_root)


def subscribe(session: MqttSession, view: BusView, clock: Callable[[], float] = time.time) -> None:
    for root in view.roots:
        for kind, suffix in SUBSCRIPTIONS:
            def on(msg: mqtt.MQTTMessage, root: Root = root, kind: str = kind) -> None:
                view.on_message(root, kind, msg.topic, bytes(msg.payload), bool(msg.retain), clock())

            session.subscribe(f"{root.pattern}/{suffix}", on, qos=0 if kind in QOS0_KINDS else 1)


class Exporter:
    """The MQTT session and the HTTP server of one exporter; `start()` then `stop()`."""

    def __init__(self, settings: PrometheusSettings) -> None:
        self.settings = settings
        self.view = BusView(settings.roots(), settings.prometheus_stale_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BusCollector(self.view))
        ProcessCollector(registry=self.registry)  # the exporter's own CPU and memory (process_*)
        self.session = MqttSession(settings, unique_client_id("prometheus"))
        self.session.on_connect(self.view.broker_up)
        self.session.on_disconnect(self.view.broker_down)
        subscribe(self.session, self.view)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = settings.prometheus_port

    def start(self) -> None:
        s = self.settings
        self._server, self._thread = start_http_server(s.prometheus_port, s.prometheus_bind, registry=self.registry)
        self.port = int(self._server.server_port)
        self.session.start()
        log.info("prometheus: http://%s:%d/metrics, roots %s, broker %s:%d", s.prometheus_bind, self.port,
                 " ".join(r.pattern if r.site is None else f"{r.site}={r.pattern}" for r in self.view.roots),
                 self.session.broker.host, self.session.broker.port)

    def stop(self) -> None:
        self.session.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def run(settings: PrometheusSettings, stop: threading.Event) -> None:
    exporter = Exporter(settings)
    try:
        exporter.start()
    except OSError as exc:  # the port is taken, the address is not this host's
        raise SystemExit(f"robobus prometheus: cannot serve on {settings.prometheus_bind}:{settings.prometheus_port}:"
                         f" {exc} (ROBOBUS_PROMETHEUS_PORT / --port)") from None
    try:
        stop.wait()
    finally:
        exporter.stop()
        log.info("prometheus: stopped")


def prometheus(
    port: Annotated[int | None, typer.Option(help=f"HTTP port of /metrics (ROBOBUS_PROMETHEUS_PORT, default "
                                                  f"{DEFAULT_PORT})")] = None,
    bind: Annotated[str | None, typer.Option(help="Bind address (ROBOBUS_PROMETHEUS_BIND, default 127.0.0.1)")] = None,
    roots: Annotated[str | None, typer.Option(help="'SITE=ROOT ...' or 'ROOT ...', a level may be '+' "
                                                   "(ROBOBUS_PROMETHEUS_ROOTS; default ROBOBUS_TOPIC_ROOT)")] = None,
    broker: Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (ROBOBUS_MQTT_URL)")] = None,
    stale: Annotated[float | None, typer.Option(help="Seconds after which a message is stale "
                                                     "(ROBOBUS_PROMETHEUS_STALE_S, default 17)")] = None,
) -> None:
    """Serve the bus's health and counters as Prometheus metrics (one exporter for a whole bus)."""
    overrides: dict[str, Any] = {}
    for key, value in (("prometheus_port", port), ("prometheus_bind", bind), ("prometheus_roots", roots),
                       ("mqtt_url", broker), ("prometheus_stale_s", stale)):
        if value is not None:
            overrides[key] = value
    settings = load_settings(PrometheusSettings, **overrides)
    setup_logging(settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(settings, stop)
