"""Shared helpers of the roi-modules tests: a network prefix of the test's own on loopback."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

_counter = itertools.count()


def fresh_prefix() -> str:
    """127.<a>.<b>: one loopback /24 per use, derived from the pid, so parallel runs do not collide."""
    n = next(_counter)
    return f"127.{200 + os.getpid() % 50}.{(os.getpid() // 50 * 7 + n) % 250 + 1}"


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()
