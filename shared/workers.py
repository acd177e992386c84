"""The command pool: a few threads that run command handlers, handed work from paho's network thread.

A lean ThreadPoolExecutor: no Future per command (nobody waits on one: the handler publishes its own reply),
no Python-level semaphore. Threads start as needed, up to `workers`; an idle worker leaves a token in a C
queue, and a submit takes one, so that a command never waits behind a busy worker while another could start.
`handoff` is the network thread's submit: it keeps out of the handler's way for a moment (see there)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("robobus.node")

_Item = tuple[Callable[..., Any], tuple[Any, ...], "threading.Lock | None"]


class CommandPool:
    def __init__(self, workers: int, name: str = "cmd") -> None:
        self._max = max(1, workers)
        self._name = name
        self._work: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle: queue.SimpleQueue[None] = queue.SimpleQueue()  # one token per worker waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on a worker; RuntimeError once shut down (as ThreadPoolExecutor)."""
        self._submit(fn, args, None)

    def handoff(self, fn: Callable[..., Any], *args: Any, wait_s: float = 0.001) -> None:
        """`submit`, then, when an idle worker takes it, wait (up to `wait_s`) until it is done.

        For the thread that reads the socket (paho's network thread). Were it to go on at once, to its PUBACK
        and its loop, it would hold the GIL when the worker wakes: the worker sleeps again until the GIL is
        dropped (a second wake-up), and when the worker drops the GIL to write the reply, the network thread
        takes it back and the reply's writer waits (~50 us of a command's round trip, bench/rpc_stages.py).
        Blocked here, it leaves the GIL to the handler until the reply is out, and reads on after at most
        `wait_s`, so that a slow handler still never stops the node receiving. With no idle worker (all busy: a
        thread is started, or the command queues) it does not wait; nor with `wait_s` 0."""
        if wait_s <= 0:
            self._submit(fn, args, None)
            return
        done = threading.Lock()
        done.acquire()
        if self._submit(fn, args, done):
            done.acquire(timeout=wait_s)

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...], started: threading.Lock | None) -> bool:
        """Queue the work; True when an idle worker was waiting for it."""
        if self._closed:
            raise RuntimeError("the command pool is shut down")
        self._work.put((fn, args, started))
        try:
            self._idle.get_nowait()  # an idle worker will take it
            return True
        except queue.Empty:
            with self._lock:
                if len(self._threads) < self._max and not self._closed:
                    t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                    self._threads.append(t)
                    t.start()
            return False

    def _run(self) -> None:
        work, idle = self._work, self._idle
        while True:
            item = work.get()
            if item is None:
                return
            fn, args, started = item
            try:
                fn(*args)
            except Exception:  # the dispatcher answers every error itself; this is a bug in it
                log.exception("command worker: unhandled error")
            if started is not None:
                started.release()  # done: the submitting thread may go on (handoff)
            idle.put(None)

    def shutdown(self) -> None:
        """Drop work not yet started and let the workers end (running handlers finish on their own)."""
        with self._lock:
            self._closed = True
            n = len(self._threads)
        try:
            while True:
                self._work.get_nowait()
        except queue.Empty:
            pass
        for _ in range(n):
            self._work.put(None)
