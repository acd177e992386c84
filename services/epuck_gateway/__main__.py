"""python -m services.epuck_gateway: settings -> one node -> one link per robot -> run until SIGTERM."""

from __future__ import annotations

from services.epuck_gateway.api import API
from services.epuck_gateway.service import build
from services.epuck_gateway.settings import EpuckSettings
from shared import run_service


def main() -> None:
    run_service(API, EpuckSettings, build)


if __name__ == "__main__":
    main()
