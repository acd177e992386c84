"""One process per serial port: the lock the gateway holds on a robot's port, and that a flasher checks.

An e-puck2 on USB shows two serial ports (the programmer's GDB server and the F407's asercom). Writing
GDB packets into the asercom port leaves the robot waiting for the end of an ASCII line (reference
docs/reference/epuck2.md §6: a positive first byte starts a line that only `\\r` or `\\n` ends), so a port in use by
one program must be refused by every other. The lock is `flock(LOCK_EX | LOCK_NB)` on the device
itself, which is what pyserial's `exclusive=True` takes, so the gateway's links, a `robobus epuck
flash` run on the same host and anything else that asks here agree whichever opened the port first.
On top of it a tty gets `TIOCEXCL`, so that a program that takes no lock (gdb, a terminal emulator)
is refused at `open()` with EBUSY (the kernel lets root through; the flock still stands for root).

    with hold_port("/dev/ttyACM0"):        # PortBusy if the gateway (or anyone) holds it
        flash_firmware("/dev/ttyACM0", elf)  # nobody else opens the port meanwhile

`port_holder(path)` names the holder (`pid 1234 (python3)`) for messages, from /proc/locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import termios
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PortBusy", "exclusive_tty", "hold_port", "lock_fd", "port_holder"]


class PortBusy(OSError):
    """Another process holds the port."""

    def __init__(self, path: str, holder: str | None = None) -> None:
        self.path = path
        self.holder = holder
        super().__init__(errno.EBUSY, f"{path} is in use by another process" + (f" ({holder})" if holder else "")
                         + "; stop it (e.g. pause the robot's gateway link) before using this port")


def _device_key(path: str | os.PathLike[str]) -> str | None:
    """`MAJOR:MINOR:INODE` as /proc/locks writes it (hex major and minor, decimal inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def port_holder(path: str | os.PathLike[str]) -> str | None:
    """Who holds an flock on `path` (`pid 1234 (python3)`), or None if nobody does (Linux /proc/locks)."""
    key = _device_key(path)
    if key is None:
        return None
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:05:17 0 EOF" (a "->" marks a waiter: not the holder)
        if len(f) >= 6 and f[1] == "FLOCK" and "->" not in f[:2] and f[5] == key:
            pid = f[4]
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                return f"pid {pid}"
            return f"pid {pid} ({comm})"
    return None


def lock_fd(fd: int, path: str) -> None:
    """Take the port's lock on an open descriptor (the same lock pyserial's `exclusive=True` takes)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PortBusy(path, port_holder(path)) from None


def exclusive_tty(fd: int) -> None:
    """TIOCEXCL: further open()s of this tty fail with EBUSY until it is closed (root excepted).
    Not a tty (a test's plain file): nothing to do."""
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCEXCL)


@contextlib.contextmanager
def hold_port(path: str) -> Iterator[int]:
    """Hold `path`'s lock for the duration of the block (yields the descriptor; the caller need not use it).

    Raises PortBusy when another process holds it, or when a tty is in exclusive mode (EBUSY), and
    FileNotFoundError / OSError when there is no such port. Opening does not block on a modem line and
    does not make the port a controlling terminal."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise PortBusy(path, port_holder(path)) from None
        raise
    try:
        lock_fd(fd, path)
        yield fd
    finally:
        os.close(fd)  # releases the lock
