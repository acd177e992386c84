"""Helpers for the root-only wire tests: a namespace + veth + virtual hand per test (unique name
with the pid), torn down whatever happens, and a way to run pysoem inside the namespace from a
thread (setns moves only the calling thread)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

from services.ethercat_loop.sim.netns import VethNetns
from services.ethercat_loop.sim.virtual_hand import HandControl
from services.ethercat_loop.transport.netns import enter_netns
from tests.fixtures import can_netns

T = TypeVar("T")
ECHO = ["--model", "tests.ethercat_loop.palm_fixtures:EchoPalm"]
_counter = itertools.count()
_reason: list[str | None] = []


def skip_without_netns() -> None:
    if not _reason:
        _reason.append(can_netns())
    if _reason[0]:
        pytest.skip(f"EtherCAT wire tests: {_reason[0]}")


@contextmanager
def hand(protocol: str = "0220", extra: list[str] | None = None) -> Iterator[tuple[VethNetns, HandControl]]:
    skip_without_netns()
    ns = VethNetns(f"rbw{os.getpid()}x{next(_counter)}")
    ns.up()
    try:
        ctl = ns.start_hand(protocol, [*(extra or []), "--rt-priority", "60"])
        yield ns, ctl
    finally:
        ns.down()


def in_netns(ns: VethNetns, fn: Callable[[], T], timeout: float = 60.0) -> T:
    """Run fn() in a fresh thread that has entered the namespace; re-raise what it raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(ns.name)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{fn!r} still running after {timeout}s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
