"""roi-modules' `udp` transport: the ROI network's two UDP ports on this host (transport.py's `RoiTransport`), and
the one place that builds it.

Registered as the entry point `roi-modules.udp` (pyproject.toml, group `robobus.transports`; docs/kit.md,
"Transports") and chosen by `ROBOBUS_ROI_TRANSPORT=udp` (the default). The service loads this factory by name
(`shared.transports.load_transport`) once, when it is built, and hands it its settings, the octets it serves and
its callbacks; nothing here runs per message. The simulator (sim.py) is a peer on the same wire: it is reached
through this transport at the addresses the settings give.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

from services.roi_modules import protocol as p
from services.roi_modules.settings import RoiSettings
from services.roi_modules.transport import RoiTransport, TransportConfig
from shared import ServiceUnavailable

__all__ = ["check_bindable", "udp_transport"]


def check_bindable(host: str) -> None:
    """Both ROI ports on this host's address, or one clear line: the address is not ours, or the ports are
    taken (only one process can own the ROI network, docs/reference/roi.md §1)."""
    for port in (p.GENERAL_PORT, p.SYSADMIN_PORT):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ServiceUnavailable(f"cannot bind {host}:{port} ({exc.strerror}): roi_network and "
                                         "roi_host_octet must name an address of this host, and no other "
                                         "process may own the ROI ports there") from None


def udp_transport(settings: RoiSettings, octets: Sequence[int], *,
                  live: Callable[[int], bool] | None = None,
                  on_reply: Callable[[int, int, p.GeneralPacket | p.SysAdminPacket], None] | None = None,
                  on_garbage: Callable[[int, str], None] | None = None,
                  on_decode_error: Callable[[str], None] | None = None) -> RoiTransport:
    """The transport on `<roi_network>.<roi_host_octet>` for the modules at `octets`, with the settings' resend
    ladder; the callbacks are `RoiTransport`'s. ServiceUnavailable if this host cannot own both ROI ports there
    (checked now, so that the service stops before it connects, with the reason)."""
    cfg = TransportConfig(settings.roi_network, settings.roi_host_octet, settings.roi_timeout_s,
                          settings.roi_max_retries)
    check_bindable(cfg.host_address)
    return RoiTransport(cfg, sorted(set(octets)), live=live, on_reply=on_reply, on_garbage=on_garbage,
                        on_decode_error=on_decode_error)
