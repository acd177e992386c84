"""services/roi_modules/sendmmsg.py: many datagrams in one system call, in order, to their own destinations; the
fallback (one sendto each) behaves the same; a socket that cannot send says so."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.roi_modules import sendmmsg
from services.roi_modules.sendmmsg import send_many


@pytest.fixture
def receivers() -> Iterator[list[socket.socket]]:
    socks = []
    for _ in range(3):
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        r.bind(("127.0.0.1", 0))
        r.settimeout(2.0)
        socks.append(r)
    yield socks
    for r in socks:
        r.close()


def _received(r: socket.socket, n: int) -> list[bytes]:
    return [r.recv(2048) for _ in range(n)]


@pytest.mark.parametrize("native", [True, False])
def test_every_datagram_reaches_its_own_destination_in_order(receivers: list[socket.socket], native: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not sendmmsg.native():
        pytest.skip("libc has no sendmmsg here (not Linux)")
    if not native:
        monkeypatch.setattr(sendmmsg, "_sendmmsg", None)
    grams = [(f"{i}:{j}".encode() * (1 + i), r.getsockname()) for i in range(20) for j, r in enumerate(receivers)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        assert send_many(s, grams) == len(grams)
    for j, r in enumerate(receivers):
        assert _received(r, 20) == [f"{i}:{j}".encode() * (1 + i) for i in range(20)]


def test_nothing_to_send_sends_nothing() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert send_many(s, []) == 0


def test_a_socket_that_cannot_send_raises_oserror(receivers: list[socket.socket]) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dest = receivers[0].getsockname()
    s.close()
    with pytest.raises(OSError):
        send_many(s, [(b"x", dest)])
    too_big = b"x" * 70000  # over a UDP datagram's maximum: the first send fails, nothing was sent
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s2, pytest.raises(OSError):
        send_many(s2, [(too_big, dest), (b"y", dest)])


def test_a_failure_after_the_first_datagram_returns_how_many_left(receivers: list[socket.socket]) -> None:
    dest = receivers[0].getsockname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert send_many(s, [(b"a", dest), (b"b", dest), (b"x" * 70000, dest), (b"c", dest)]) == 2
    assert _received(receivers[0], 2) == [b"a", b"b"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=512), min_size=1, max_size=40))
def test_any_payloads_arrive_as_sent(payloads: list[bytes]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as r, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        r.bind(("127.0.0.1", 0))
        r.settimeout(2.0)
        assert send_many(s, [(b, r.getsockname()) for b in payloads]) == len(payloads)
        assert [r.recv(1024) for _ in payloads] == payloads


def test_bound_on_linux() -> None:
    assert sendmmsg.native() == sys.platform.startswith("linux")
