"""dexter-gateway's `tcp` transport: DexRun's TCP socket (port 50000), transport.py's `DexterLink`, and the one
place that builds it.

Registered as the entry point `dexter-gateway.tcp` (pyproject.toml, group `robobus.transports`; docs/kit.md,
"Transports") and chosen by `ROBOBUS_DEXTER_TRANSPORT=tcp` (the default). The service loads this factory by name
(`shared.transports.load_transport`) once, when it is built, and each arm calls it once for its link; nothing here
runs per message. The simulator (sim.py) is a peer on the same wire: it is reached through this transport at the
host and port an arm's settings give.
"""

from __future__ import annotations

from services.dexter_gateway.transport import DexterLink, LinkFactory

__all__ = ["tcp_link"]

# The arm's link to DexRun at `config.host:config.port` (not started: the arm starts it): DexterLink itself, which
# has the signature the service calls (mypy checks it against LinkFactory).
tcp_link: LinkFactory = DexterLink
