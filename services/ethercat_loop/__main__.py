"""ethercat-loop: python -m services.ethercat_loop (settings: ROBOBUS_* / ROBOBUS_ETHERCAT_*, see README.md)."""

from __future__ import annotations

import logging
import sys

from services.ethercat_loop.backend import BackendUnavailable
from services.ethercat_loop.service import API, build
from services.ethercat_loop.settings import EthercatSettings
from shared import Node, load_settings
from shared.logs import setup_logging


def main() -> None:
    settings = load_settings(EthercatSettings)
    setup_logging(settings.log_level, settings.log_json)
    node = Node(API, settings)
    try:
        svc = build(node, settings)
    except BackendUnavailable as exc:
        print(f"robobus: ethercat-loop: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    node.on_shutdown(svc.shutdown)  # before the offline status: zero demands, leave OP
    try:
        svc.start()
    except Exception as exc:  # no palm: stay up and say so in health, answer `unavailable`
        logging.getLogger("robobus.ethercat").exception("palm did not start")
        svc.dev.set_health(connection=False, operational=False, state="error", error=True,
                           error_message=f"palm not started: {exc}")
        node.run()
        return
    node.run(svc.run)


if __name__ == "__main__":
    main()
