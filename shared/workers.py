"""The command pool: a few threads that run command handlers, handed work from paho's network thread.

A lean ThreadPoolExecutor: no Future per command (nobody waits on one: the handler publishes its own reply),
no Python-level semaphore. Threads start as needed, up to `workers`; an idle worker leaves a token in a C
queue, and a submit takes one, so that a command never waits behind a busy worker while another could start."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("robobus.node")

_Item = tuple[Callable[..., Any], tuple[Any, ...]]


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
        if self._closed:
            raise RuntimeError("the command pool is shut down")
        self._work.put((fn, args))
        try:
            self._idle.get_nowait()  # an idle worker will take it
        except queue.Empty:
            with self._lock:
                if len(self._threads) < self._max and not self._closed:
                    t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                    self._threads.append(t)
                    t.start()

    def _run(self) -> None:
        work, idle = self._work, self._idle
        while True:
            item = work.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # the dispatcher answers every error itself; this is a bug in it
                log.exception("command worker: unhandled error")
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
