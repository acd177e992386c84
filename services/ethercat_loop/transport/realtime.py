"""Realtime plumbing for the cycle process: SCHED_FIFO, mlockall, CPU affinity, absolute sleeps on
CLOCK_MONOTONIC, and the deadline arithmetic (pure) that skips to the next period boundary on an
overrun instead of bursting to catch up (`next_deadline`).

Every privileged step degrades to a warning: the loop still runs, and the warnings reach logs and
health so nobody mistakes an unprivileged run for a realtime one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_MONOTONIC = 1
TIMER_ABSTIME = 1
MCL_CURRENT = 1
MCL_FUTURE = 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.clock_nanosleep.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Timespec), ctypes.c_void_p]
_libc.clock_nanosleep.restype = ctypes.c_int
_libc.mlockall.argtypes = [ctypes.c_int]
_libc.mlockall.restype = ctypes.c_int


class AbsoluteSleeper:
    """clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME): the wake-up does not drift with the time
    spent between reading the clock and going to sleep (time.sleep is relative)."""

    def __init__(self) -> None:
        self._ts = _Timespec()
        self._ref = ctypes.byref(self._ts)

    def sleep_until(self, deadline_ns: int) -> None:
        self._ts.tv_sec, self._ts.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        while _libc.clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, self._ref, None) == errno.EINTR:
            pass


def next_deadline(release_ns: int, start_ns: int, now_ns: int, period_ns: int) -> tuple[int, int]:
    """The release after `release_ns` to run next, and how many releases are skipped (an overrun).

    A cycle released at `release_ns` started at `start_ns` and has just finished at `now_ns`. The
    cycle is counted the way cyclictest counts its wake-ups (and Xenomai its periodic overruns): a
    release is missed when its cycle could not start within its own period.
    * Normally the next release is `release + period`; if the work ran past it (by less than a
      period), that release starts at once, late, and its latency shows in the wake-up histogram.
    * An overrun: this cycle started a period or more after its release, or the next one could not
      start within its period. Every release already due is skipped and the next one is the first
      period boundary after `now_ns` (integer arithmetic on the `release_ns` grid): never a burst of
      cycles run back to back to catch up.
    """
    nxt = release_ns + period_ns
    if start_ns < nxt and now_ns < nxt + period_ns:
        return nxt, 0
    k = (now_ns - release_ns) // period_ns + 1
    return release_ns + k * period_ns, k - 1


@dataclass
class RtSettings:
    priority: int = 80  # SCHED_FIFO priority (1..99); 0 = do not ask for realtime scheduling
    cpus: tuple[int, ...] = ()  # CPU affinity; empty = leave as is
    lock_memory: bool = True


def apply_realtime(rt: RtSettings) -> list[str]:
    """Ask for SCHED_FIFO, mlockall and affinity; return the warnings for what was refused."""
    warnings: list[str] = []
    if rt.cpus:
        try:
            os.sched_setaffinity(0, set(rt.cpus))
        except (OSError, ValueError) as exc:
            warnings.append(f"CPU affinity {list(rt.cpus)} refused ({exc})")
    if rt.lock_memory and _libc.mlockall(MCL_CURRENT | MCL_FUTURE) != 0:
        err = ctypes.get_errno()
        warnings.append(f"mlockall refused ({os.strerror(err)}): page faults may stall the cycle "
                        "(needs CAP_IPC_LOCK or a memlock ulimit)")
    if rt.priority > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt.priority))
        except OSError as exc:
            warnings.append(f"SCHED_FIFO priority {rt.priority} refused ({exc}): the cycle runs at normal "
                            f"priority, expect jitter ({why_no_fifo(has_cap_sys_nice(), rt_runtime_us())})")
    elif os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
        # normal scheduling asked for, a realtime policy inherited (an MQTT process at SCHED_FIFO starts us)
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return warnings


def process_fifo(priority: int) -> list[str]:
    """SCHED_FIFO `priority` for every thread of this process (a thread started later inherits its starter's
    policy, so the whole process runs at it); 0 leaves the process as it is. Returns the warnings for what was
    refused. For the MQTT process of the wire backends: its receive path (paho's thread -> handler -> control
    pipe) then waits for no ordinary process of a busy host; below the cycle and the virtual hand, it never
    delays either of them. Every thread, not one: a single realtime thread would wait for the GIL held by a
    thread the host's load keeps off the CPU."""
    if priority <= 0:
        return []
    refused: list[str] = []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            if os.sched_getscheduler(tid) == os.SCHED_FIFO and os.sched_getparam(tid).sched_priority > priority:
                continue  # a thread already above it keeps its place (the kit's stop thread: shared/stop.py)
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(priority))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            refused.append(str(exc))
    if refused:
        return [f"SCHED_FIFO priority {priority} for the MQTT process refused ({refused[0]}): its receive path "
                f"runs at normal priority and waits behind a busy host's load "
                f"({why_no_fifo(has_cap_sys_nice(), rt_runtime_us())})"]
    return []


CAP_SYS_NICE = 23


def has_cap_sys_nice(status: str | None = None) -> bool:
    """CAP_SYS_NICE in this process's effective capabilities (/proc/self/status CapEff)."""
    try:
        text = status if status is not None else Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def rt_runtime_us(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The realtime budget of this process's cpu cgroup (RT group scheduling, cgroup v1's cpu.rt_runtime_us), or
    None where there is none to read (no RT group scheduling: only the rtprio limit and the capability count)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                for mount in ("cpu,cpuacct", "cpu"):
                    f = Path(cgroup_root, mount, path.lstrip("/"), "cpu.rt_runtime_us")
                    if f.exists():
                        return int(f.read_text().strip())
    except (OSError, ValueError):
        return None
    return None


def why_no_fifo(cap: bool, budget_us: int | None) -> str:
    """The likely cause of a refused SCHED_FIFO, and its fix: with CAP_SYS_NICE, on a kernel with RT group
    scheduling, it is a cgroup without a realtime budget (a container's cpu_rt_runtime), not a capability."""
    if cap and budget_us == 0:
        return ("the process has CAP_SYS_NICE, but its cgroup has no realtime budget (cpu.rt_runtime_us = 0, RT "
                "group scheduling): give it one, e.g. dockerd --cpu-rt-runtime=950000 and cpu_rt_runtime on the "
                "service (deploy/compose.rt-group.yaml)")
    if cap:
        return "the process has CAP_SYS_NICE; check the kernel's realtime limits (sched_rt_runtime_us, cgroups)"
    return "needs CAP_SYS_NICE or an rtprio ulimit"


def current_policy() -> str:
    pol = os.sched_getscheduler(0)
    names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    return f"{names.get(pol, str(pol))}/{os.sched_getparam(0).sched_priority}"
