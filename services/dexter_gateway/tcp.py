"""dexter-gateway's `tcp` transport: DexRun's TCP socket (port 50000), transport.py's `DexterLink`, and the one
place that builds it.

Registered as the entry point `dexter-gateway.tcp` (pyproject.toml, group `robobus.transports`; docs/kit.md,
"Transports") and chosen by `ROBOBUS_DEXTER_TRANSPORT=tcp` (the default). The service loads this factory by name
(`shared.transports.load_transport`) once, when it is built, and each arm calls it once for its link; nothing here
runs per message. The simulator (sim.py) is a peer on the same wire: it is reached through this transport at the
host and port an arm's settings give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.dexter_gateway.transport import (
    ChangeHandler,
    DecodeErrorHandler,
    DexterLink,
    DexterLinkConfig,
    LinkFactory,
    MotionStopped,
    ReplyHandler,
)
from shared.link import SupervisedLink

__all__ = ["tcp_link"]


def tcp_link(name: str, config: DexterLinkConfig, *, supervisor: SupervisedLink | None = None,
             on_change: ChangeHandler | None = None, on_reply: ReplyHandler | None = None,
             on_decode_error: DecodeErrorHandler | None = None,
             keepalive_args: Callable[[], Sequence[str]] | None = None,
             motion_stopped: MotionStopped | None = None) -> DexterLink:
    """The arm `name`'s link to DexRun at `config.host:config.port` (not started: the arm starts it); the
    arguments are `DexterLink`'s."""
    return DexterLink(name, config, supervisor=supervisor, on_change=on_change, on_reply=on_reply,
                      on_decode_error=on_decode_error, keepalive_args=keepalive_args, motion_stopped=motion_stopped)


_CHECK: LinkFactory = tcp_link  # mypy: the factory has the signature the service calls
