"""`robobus foxglove`: serve the live bus to Foxglove (registered under the `robobus.cli` entry point).

    robobus foxglove                         ws://127.0.0.1:8765 (open it in Foxglove: Open connection ->
                                             Foxglove WebSocket); the broker of ROBOBUS_MQTT_URL
    robobus foxglove --host 0.0.0.0 --port 8766 --root site1/robobus --read-only
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from shared.settings import load_settings

LAYOUT = Path(__file__).resolve().parents[3] / "deploy" / "foxglove" / "robobus-demo.json"


def foxglove(
    host: Annotated[str | None, typer.Option(help="Bind address (ROBOBUS_FOXGLOVE_HOST, default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="WebSocket port (ROBOBUS_FOXGLOVE_PORT, default 8765; 0: any "
                                                  "free one)")] = None,
    root: Annotated[str | None, typer.Option(help="Topic root (ROBOBUS_TOPIC_ROOT)")] = None,
    broker: Annotated[str | None, typer.Option(help="Broker URL (ROBOBUS_MQTT_URL)")] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="Offer no command or stop services "
                                                                "(ROBOBUS_FOXGLOVE_COMMANDS=false)")] = False,
    asyncapi: Annotated[Path | None, typer.Option(help="AsyncAPI document for the schemas (default: built from the "
                                                       "installed services, else docs/asyncapi.yaml)")] = None,
) -> None:
    """Serve the live bus to Foxglove: every node's status, health, states and events as channels with the
    contract's schemas, the cameras as images, every command and the bus stop as services."""
    from shared.logs import setup_logging
    from shared.tools.bus_catalog import load_document
    from shared.tools.foxglove.bridge import FoxgloveBridge, FoxgloveSettings

    overrides: dict[str, Any] = {k: v for k, v in (("foxglove_host", host), ("foxglove_port", port),
                                                   ("topic_root", root), ("mqtt_url", broker)) if v is not None}
    if read_only:
        overrides["foxglove_commands"] = False
    s = load_settings(FoxgloveSettings, **overrides)
    setup_logging(s.log_level, s.log_json)
    bridge = FoxgloveBridge(s, load_document(asyncapi))
    try:
        bridge.start()
    except Exception as exc:  # the SDK raises its own error for a port in use
        print(f"robobus: cannot serve Foxglove on {s.foxglove_host}:{s.foxglove_port}: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    b = s.broker()
    mode = "commands and the stop as services" if s.foxglove_commands else "read-only"
    print(f"robobus foxglove: ws://{s.foxglove_host}:{bridge.port} (broker {b.host}:{b.port} as "
          f"{b.username or 'anonymous'}, root {s.topic_root}, {mode}; layout {LAYOUT})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    bridge.stop()
