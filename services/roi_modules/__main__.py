"""python -m services.roi_modules: the kit runs settings, logging, signals and the fail-safe shutdown."""

from __future__ import annotations

from services.roi_modules.api import API
from services.roi_modules.service import build
from services.roi_modules.settings import RoiSettings
from shared import run_service


def main() -> None:
    run_service(API, RoiSettings, build)


if __name__ == "__main__":
    main()
