"""python -m services.can_bootloader: settings -> CAN buses (or the palm bridge) -> the MQTT node."""

from __future__ import annotations

from services.can_bootloader.api import API
from services.can_bootloader.service import build
from services.can_bootloader.settings import CanBootSettings
from shared import run_service


def main() -> None:
    run_service(API, CanBootSettings, build)


if __name__ == "__main__":
    main()
