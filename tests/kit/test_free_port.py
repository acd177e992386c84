"""free_port (shared/tools/localbroker.py), which every test broker and simulator port comes from: below the
kernel's ephemeral range, so that no client socket of a parallel test run can take the port between the
choice and the bind; and never a port someone listens on."""

from __future__ import annotations

import socket

import pytest

from shared.tools import localbroker
from shared.tools.localbroker import free_port


def test_the_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    lo, _ = localbroker._ephemeral_range()
    if lo - 1 <= 20000:
        pytest.skip(f"the ephemeral range starts at {lo}: no room below it")
    for _ in range(50):
        port = free_port()
        assert 20000 <= port < lo, (port, lo)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_with_a_listener_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    lo, _ = localbroker._ephemeral_range()
    if lo - 1 <= 20000:
        pytest.skip(f"the ephemeral range starts at {lo}: no room below it")
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))  # a listener on loopback only
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, taken])
        real = localbroker._PICK.randrange
        monkeypatch.setattr(localbroker._PICK, "randrange", lambda a, b: next(picks, None) or real(a, b))
        port = free_port()
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
