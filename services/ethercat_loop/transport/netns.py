"""Entering a network namespace (the master's side of a NIC that lives in one, e.g. the virtual hand's)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    pass


def enter_netns(name: str) -> None:
    """Move the CALLING THREAD into namespace `name` (sockets it opens afterwards live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)
