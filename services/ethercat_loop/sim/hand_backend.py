"""Transport `ethercat-loop.virtual` (ROBOBUS_ETHERCAT_BACKEND=virtual; entry point `robobus.transports`): the
realtime cycle process (`transport.ProcessBackend`, the same as on a real NIC) against the virtual EtherCAT hand.

With ROBOBUS_ETHERCAT_IFNAME the hand is already running on that interface (`make ethercat-vhand`); without it, the
backend brings up its own namespace + veth pair with the hand on one end at start (root, iproute2) and removes them
at stop. The simulator lives here, beside the transport it drives: the transport never imports it, and neither
does the service's wiring."""

from __future__ import annotations

import os
from collections.abc import Callable

from services.ethercat_loop.backend import BackendHooks, BackendUnavailable, HandBackend
from services.ethercat_loop.settings import EthercatSettings


def virtual_backend(settings: EthercatSettings, hooks: BackendHooks) -> HandBackend:
    """ProcessBackend against the virtual hand: on ROBOBUS_ETHERCAT_IFNAME, or on a namespace of its own."""
    # late: pysoem and the realtime machinery (an ImportError here is the caller's "cannot be imported here")
    from services.ethercat_loop.transport.process_backend import ProcessBackend

    nic = None if settings.ethercat_ifname else virtual_hand_nic(settings)
    return ProcessBackend(settings, hooks.calibration, nic=nic)


def virtual_hand_nic(settings: EthercatSettings) -> Callable[[], tuple[str, str | None, Callable[[], None]]]:
    """A NIC provider: a private namespace + veth pair with the virtual hand on one end (root, iproute2)."""

    def up() -> tuple[str, str | None, Callable[[], None]]:
        from services.ethercat_loop.sim.netns import VethNetns  # late: only this path needs ip/netns

        ns = VethNetns(f"rbec{os.getpid()}")
        try:
            ns.up()
            # the hand answers frames a little below the cycle's priority: it must not starve either
            s = settings
            hand_rt = ["--rt-priority", str(max(1, s.ethercat_rt_priority - 10))] if s.ethercat_rt_priority else []
            ns.start_hand(s.ethercat_protocol, ["--serial", str(s.ethercat_serial), *hand_rt, *s.ethercat_virtual_args])
        except Exception as exc:
            ns.down()
            raise BackendUnavailable(f"cannot start the virtual EtherCAT hand (needs root, iproute2): {exc}") from exc
        return ns.master_if, ns.name, ns.down

    return up
