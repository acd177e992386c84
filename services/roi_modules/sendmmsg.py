"""Many UDP datagrams in one system call (Linux `sendmmsg(2)`), for the bus stop written from a thread beside a
busy event loop.

Every `socket.sendto` gives up the GIL, and taking it back waits for whichever thread holds it: beside a loop
working through a backlog (and the other services of a 2-core host), a stop of 50 modules (one to three datagrams
each) waited tens of milliseconds between its own datagrams. One `sendmmsg` call gives the GIL up once for the
whole batch. The standard library has no `sendmmsg`; this binds libc's with ctypes (ctypes releases the GIL for
the call). Where libc has none (not Linux), `send_many` falls back to one `sendto` per datagram.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
from collections.abc import Sequence

__all__ = ["native", "send_many"]

Datagram = tuple[bytes, tuple[str, int]]  # payload, (IPv4 address, port)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _SockaddrIn(ctypes.Structure):  # struct sockaddr_in: port and address in network byte order
    _fields_ = [("sin_family", ctypes.c_ushort), ("sin_port", ctypes.c_ubyte * 2),
                ("sin_addr", ctypes.c_ubyte * 4), ("sin_zero", ctypes.c_ubyte * 8)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t), ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


def _bind() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sendmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]  # the vector's address
    fn.restype = ctypes.c_int
    return fn


_sendmmsg = _bind()


def native() -> bool:
    """libc's sendmmsg is bound (else send_many sends one datagram per call)."""
    return _sendmmsg is not None


def send_many(sock: socket.socket, datagrams: Sequence[Datagram]) -> int:
    """Send `datagrams` in order from the IPv4 UDP socket `sock`, with as few system calls as the kernel allows
    (one, unless it takes fewer than all). Returns how many were sent: all of them, or those before the one whose
    send failed, when a later call fails (OSError when the first does). Never blocks on a non-blocking socket."""
    if not datagrams:
        return 0
    if _sendmmsg is None or sock.family != socket.AF_INET:
        for i, (data, dest) in enumerate(datagrams):
            try:
                sock.sendto(data, dest)
            except OSError:
                if i == 0:
                    raise
                return i
        return len(datagrams)
    n = len(datagrams)
    # every buffer the kernel reads stays referenced here until the call returns
    bufs = [ctypes.create_string_buffer(data, len(data)) for data, _ in datagrams]
    addrs = (_SockaddrIn * n)()
    iovs = (_Iovec * n)()
    msgs = (_Mmsghdr * n)()
    for i, (data, (host, port)) in enumerate(datagrams):
        a = addrs[i]
        a.sin_family = socket.AF_INET
        a.sin_port[:] = port.to_bytes(2, "big")
        a.sin_addr[:] = socket.inet_aton(host)
        iovs[i].iov_base = ctypes.cast(bufs[i], ctypes.c_void_p)
        iovs[i].iov_len = len(data)
        h = msgs[i].msg_hdr
        h.msg_name = ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
        h.msg_namelen = ctypes.sizeof(_SockaddrIn)
        h.msg_iov = ctypes.pointer(iovs[i])
        h.msg_iovlen = 1
    fd = sock.fileno()
    sent = 0
    while sent < n:
        at = ctypes.addressof(msgs) + sent * ctypes.sizeof(_Mmsghdr)
        got = _sendmmsg(fd, at, n - sent, 0)  # type: ignore[operator]
        if got < 0:
            err = ctypes.get_errno()
            if err == 4:  # EINTR: again
                continue
            if sent == 0:
                raise OSError(err, os.strerror(err))
            return sent
        sent += got
    return sent
