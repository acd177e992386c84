"""python -m services.dexter_gateway: the kit's one entry point (settings, logging, node, signals, shutdown)."""

from __future__ import annotations

from services.dexter_gateway.api import API
from services.dexter_gateway.service import build
from services.dexter_gateway.settings import DexterSettings
from shared import run_service


def main() -> None:
    run_service(API, DexterSettings, build)


if __name__ == "__main__":
    main()
