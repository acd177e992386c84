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

A service with nothing to drive (handlers only) returns None."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from shared.contract import ServiceAPI
from shared.logs import setup_logging
from shared.node import Node
from shared.settings import KitSettings, load_settings

log = logging.getLogger("robobus.lifecycle")

S = TypeVar("S", bound=KitSettings)


class ServiceUnavailable(Exception):
    """Raised by `build` for a configuration that cannot run here: one line on stderr, exit 2."""


def run_service(api: ServiceAPI, settings_cls: type[S], build: Callable[[Node, S], Any],
                argv: list[str] | None = None) -> None:
    """Load settings, configure logging, build the node and run it until SIGTERM/SIGINT."""
    del argv  # settings come from ROBOBUS_* and ROBOBUS_CONFIG; kept for a future command line
    settings = load_settings(settings_cls)
    setup_logging(settings.log_level, settings.log_json)
    node = Node(api, settings)
    try:
        hooks = build(node, settings)
    except ServiceUnavailable as exc:
        print(f"robobus: {api.service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    shutdown = getattr(hooks, "shutdown", None)
    if shutdown is not None:
        node.on_shutdown(shutdown)  # before the offline status: zero demands, stop motors
    start = getattr(hooks, "start", None)
    if start is not None:
        try:
            start()
        except Exception as exc:  # no device: stay up and say so in health
            log.exception("service did not start", extra={"service": api.service})
            for dev in node.devices.values():
                dev.set_health(connection=False, operational=False, state="error", error=True,
                               error_message=f"{api.service} not started: {exc}")
            node.run()
            return
    serve = getattr(hooks, "serve", None)
    if serve is not None:
        node.run_async(serve)
        return
    node.run(getattr(hooks, "run", None))
