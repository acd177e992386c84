"""dexter-gateway's MQTT surface: one `DexterArm` (device.py: the device, its link, its handlers) per configured
arm; `DexterGateway` starts and closes them, `build()` checks the configuration and loads the transport
ROBOBUS_DEXTER_TRANSPORT names (`tcp` by default: transport.py's `tcp_link`), whose factory makes each arm's link.
"""

from __future__ import annotations

import logging
from typing import cast

from services.dexter_gateway.api import API
from services.dexter_gateway.device import DexterArm
from services.dexter_gateway.link import LinkFactory
from services.dexter_gateway.settings import DexterSettings
from shared import Node, ServiceUnavailable
from shared.lifecycle import Hooks
from shared.transports import TransportUnavailable, load_transport

log = logging.getLogger("robobus.dexter")


class DexterGateway:
    """The hooks `run_service` drives: start every arm's link and pollers; on shutdown close the links."""

    def __init__(self, node: Node, settings: DexterSettings, link_factory: LinkFactory) -> None:
        self.node = node
        self.settings = settings
        self.arms = [DexterArm(node, cfg, settings, link_factory) for cfg in settings.dexter_arms]

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
    return DexterGateway(node, settings, link_factory(settings))


def link_factory(settings: DexterSettings) -> LinkFactory:
    """The transport ROBOBUS_DEXTER_TRANSPORT names, through the kit's transport loader (shared/transports.py,
    entry points `dexter-gateway.<name>`; `tcp`: transport.py's `tcp_link`), loaded once; each arm calls it for its
    link with the settings and its `LinkHooks`."""
    try:
        return cast(LinkFactory, load_transport(API.service, settings.dexter_transport))
    except TransportUnavailable as exc:
        raise ServiceUnavailable(str(exc)) from None


__all__ = ["DexterGateway", "build", "link_factory"]  # the contract is api.py's, the settings settings.py's
