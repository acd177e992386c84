"""python -m services.can_bootloader: settings -> CAN buses (or the palm bridge) -> the MQTT node."""

from __future__ import annotations

from services.can_bootloader.service import API, CanBootSettings, build
from shared import Node, load_settings
from shared.logs import setup_logging


def main() -> None:
    settings = load_settings(CanBootSettings)
    setup_logging(settings.log_level, settings.log_json)
    node = Node(API, settings)
    build(node, settings)
    node.run()


if __name__ == "__main__":
    main()
