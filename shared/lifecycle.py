"""The kit's one entry point: every service's `__main__` is `run_service(API, Settings, build)`.

As EdgeX's device SDK bootstraps a device service, the kit owns everything that is the same in every
process: settings (environment + config file, one clear line and exit 2 when invalid), logging, the node
and its MQTT session, signals, and the fail-safe order of shutdown (the service's hooks, then the offline
status, then disconnect). The service owns its device: `build(node, settings)` creates devices, binds
handlers and returns the hooks that drive its transport:

    start()        sync, before the body; if it raises, every device's health shows the error and the
                   node stays up (commands then answer from the service's own state, e.g. `unavailable`)
    run()          a blocking body on its own thread; the process stops when it returns
    async serve()  an asyncio main (node.loop is set for coroutine handlers); cancelled on SIGTERM
    shutdown()     fail safe, before the offline status: zero demands, stop motors (may be async)

`build` returns an object with a `hooks()` method (the `Service` protocol) that says which of them it has, as a
`Hooks`: run_service calls those and no other method, whatever else the object has. A service with nothing to
drive (handlers only) returns None.

Process-wide settings of the kit are applied here, before the node is made: `switch_interval_ms` (the
interpreter's thread switch interval; a service sets its own default in its settings class)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shared.contract import ServiceAPI
from shared.logs import setup_logging
from shared.node import Node, UnboundCommands
from shared.settings import KitSettings, load_settings

log = logging.getLogger("robobus.lifecycle")

S = TypeVar("S", bound=KitSettings)


class ServiceUnavailable(Exception):
    """Raised by `build` for a configuration that cannot run here: one line on stderr, exit 2."""


@dataclass(frozen=True)
class Hooks:
    """What run_service drives in a service, each optional (the module's doc says when each runs). One body at
    most: `run` (blocking, on its own thread) or `serve` (a coroutine on the node's asyncio loop)."""

    start: Callable[[], Any] | None = None
    run: Callable[[], Any] | None = None
    serve: Callable[[], Coroutine[Any, Any, Any]] | None = None
    shutdown: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.run is not None and self.serve is not None:
            raise ValueError("a service has one body: run() on a thread or serve() on asyncio, not both")


class Service(Protocol):
    """What `build(node, settings)` returns (or None, for a service with handlers only)."""

    def hooks(self) -> Hooks: ...


def apply_process_settings(settings: KitSettings) -> None:
    """The kit's process-wide settings, as run_service applies them (in-process test harnesses call it too)."""
    if settings.switch_interval_ms is not None:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)


def run_service(api: ServiceAPI, settings_cls: type[S], build: Callable[[Node, S], Service | None],
                argv: list[str] | None = None) -> None:
    """Load settings, configure logging, build the node and run it until SIGTERM/SIGINT."""
    del argv  # settings come from ROBOBUS_* and ROBOBUS_CONFIG; kept for a future command line
    settings = load_settings(settings_cls)
    setup_logging(settings.log_level, settings.log_json)
    apply_process_settings(settings)
    node = Node(api, settings)
    try:
        service = build(node, settings)
    except ServiceUnavailable as exc:
        print(f"robobus: {api.service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:  # every device answers its kind's commands, before anything is started or published
        node.check_bindings()
    except UnboundCommands as exc:
        print(f"robobus: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    hooks = service.hooks() if service is not None else Hooks()
    if hooks.shutdown is not None:
        node.on_shutdown(hooks.shutdown)  # before the offline status: zero demands, stop motors
    if hooks.start is not None:
        try:
            hooks.start()
        except Exception as exc:  # no device: stay up and say so in health
            log.exception("service did not start", extra={"service": api.service})
            for dev in node.devices.values():
                dev.set_health(connection=False, operational=False, state="error", error=True,
                               error_message=f"{api.service} not started: {exc}")
            node.run()
            return
    if hooks.serve is not None:
        node.run_async(hooks.serve)
        return
    node.run(hooks.run)
