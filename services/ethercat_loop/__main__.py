"""ethercat-loop: python -m services.ethercat_loop (settings: ROBOBUS_* / ROBOBUS_ETHERCAT_*, see README.md)."""

from __future__ import annotations

from services.ethercat_loop.api import API
from services.ethercat_loop.service import build
from services.ethercat_loop.settings import EthercatSettings
from shared import run_service


def main() -> None:
    run_service(API, EthercatSettings, build)


if __name__ == "__main__":
    main()
