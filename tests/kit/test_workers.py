"""The command pool (shared/workers.py): no command waits behind busy workers while a thread may start."""

from __future__ import annotations

import threading

import pytest

from shared.rpc import wait_for
from shared.workers import CommandPool


def test_a_command_never_waits_behind_busy_workers_below_the_limit() -> None:
    pool = CommandPool(4)
    release = threading.Event()
    started = [threading.Event() for _ in range(4)]
    for i in range(3):
        pool.submit(lambda i=i: (started[i].set(), release.wait(30)))
    for i in range(3):
        assert started[i].wait(10), f"command {i} did not start"
    pool.submit(started[3].set)  # three workers blocked: a fourth thread must take it
    assert started[3].wait(10)
    release.set()
    pool.shutdown()


def test_idle_workers_are_reused_and_the_limit_holds() -> None:
    pool = CommandPool(2)
    done = threading.Semaphore(0)
    names: set[str] = set()
    for _ in range(200):
        pool.submit(lambda: (names.add(threading.current_thread().name), done.release()))
        assert done.acquire(timeout=10)
    assert 1 <= len(names) <= 2 and all(n.startswith("cmd") for n in names), names
    pool.shutdown()


def test_shutdown_drops_queued_work_and_refuses_more() -> None:
    pool = CommandPool(1)
    release = threading.Event()
    ran: list[int] = []
    busy = threading.Event()
    pool.submit(lambda: (busy.set(), release.wait(30), ran.append(0)))
    assert busy.wait(10)
    pool.submit(ran.append, 1)  # queued behind the busy worker
    pool.shutdown()
    release.set()
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, 2)
    assert 1 not in ran and 2 not in ran


def test_handoff_waits_for_a_quick_command_but_never_for_a_slow_one() -> None:
    """The network thread's hand-over: it may wait a moment for the handler, never longer than asked."""
    pool = CommandPool(2)
    release = threading.Event()
    started = threading.Event()
    pool.handoff(lambda: (started.set(), release.wait(30)), wait_s=0.01)  # returns while the handler blocks
    assert started.wait(10) and not release.is_set()
    ran: list[int] = []
    for i in range(50):  # the other worker (or a new one) takes each; every one runs, in order of hand-over
        pool.handoff(ran.append, i, wait_s=0.01)
    assert wait_for(lambda: len(ran) == 50, 10) and ran == list(range(50))
    pool.handoff(ran.append, 50, wait_s=0)  # 0: a plain submit
    assert wait_for(lambda: len(ran) == 51, 10)
    release.set()
    pool.shutdown()
