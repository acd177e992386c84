"""python -m services.epuck_gateway: settings -> one node -> one link per robot -> run until SIGTERM."""

from __future__ import annotations

import sys

from services.epuck_gateway.service import API, EpuckSettings, serve
from shared import Node, load_settings
from shared.logs import setup_logging


def main() -> None:
    settings = load_settings(EpuckSettings)
    setup_logging(settings.log_level, settings.log_json)
    # Cross-thread hand-offs (loop -> paho's network thread) wait for the GIL; a shorter switch
    # interval keeps sensor latency low while the encoder threads are busy.
    sys.setswitchinterval(0.001)
    node = Node(API, settings)

    async def body() -> None:
        await serve(node, settings)

    node.run_async(body)


if __name__ == "__main__":
    main()
