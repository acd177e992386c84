"""dexter-gateway's MQTT surface: one `DexterArm` (arm.py: the device, its link, its handlers) per configured
arm; `DexterGateway` starts and closes them, `build()` checks the configuration.
"""

from __future__ import annotations

import logging

from services.dexter_gateway.arm import DexterArm
from services.dexter_gateway.settings import DexterSettings
from shared import Node, ServiceUnavailable
from shared.lifecycle import Hooks

log = logging.getLogger("robobus.dexter")


class DexterGateway:
    """The hooks `run_service` drives: start every arm's link and pollers; on shutdown close the links."""

    def __init__(self, node: Node, settings: DexterSettings) -> None:
        self.node = node
        self.settings = settings
        self.arms = [DexterArm(node, cfg, settings) for cfg in settings.dexter_arms]

    def hooks(self) -> Hooks:
        return Hooks(start=self.start, shutdown=self.shutdown)

    def start(self) -> None:
        for arm in self.arms:
            arm.start()
        log.info("serving arms", extra={"arms": [f"{a.cfg.id}@{a.cfg.host}:{a.cfg.port}" for a in self.arms]})

    def shutdown(self) -> None:
        """Fail safe: refuse new commands and drop the queued ones (nothing more reaches the arm); the one in
        flight completes. DexRun has no stop oplet: moves already in its FIFO run to their end."""
        for arm in self.arms:
            arm.close()


def build(node: Node, settings: DexterSettings) -> DexterGateway:
    ids = [a.id for a in settings.dexter_arms]
    if not ids:
        raise ServiceUnavailable("no arms configured (ROBOBUS_DEXTER_ARMS)")
    if len(set(ids)) != len(ids):
        raise ServiceUnavailable(f"arm ids must be unique, got {ids}")
    return DexterGateway(node, settings)


__all__ = ["DexterGateway", "build"]  # the contract is api.py's, the settings settings.py's
