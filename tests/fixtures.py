"""The pytest plugin every robobus test shares (loaded by tests/conftest.py): a real mosquitto on a free
loopback port (`broker_session` for the session, `broker` a test's own to kill or restart), a connected
`client`, and `spawn` for nodes in subprocesses. The helpers behind them live in shared/tools/localbroker.py and
are re-exported here for the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.rpc import RpcClient
from shared.tools.localbroker import (
    REPO,
    Broker,
    NodeProcess,
    can_netns,
    free_port,
    is_root,
    mosquitto_bin,
)

__all__ = ["REPO", "Broker", "NodeProcess", "broker", "broker_session", "can_netns", "client", "free_port",
           "is_root", "mosquitto_bin", "spawn"]


@pytest.fixture(scope="session")
def broker_session() -> Iterator[Broker]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    with tempfile.TemporaryDirectory(prefix="robobus-broker-") as d:
        b = Broker(free_port(), Path(d))
        b.start()
        yield b
        b.kill()


@pytest.fixture
def broker() -> Iterator[Broker]:
    """A broker of the test's own, for tests that kill or restart it."""
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    with tempfile.TemporaryDirectory(prefix="robobus-broker-") as d:
        b = Broker(free_port(), Path(d))
        b.start()
        yield b
        b.kill()


@pytest.fixture
def client(broker_session: Broker) -> Iterator[RpcClient]:
    c = RpcClient(broker_session.settings(), name="test-client")
    c.connect()
    yield c
    c.close()


@pytest.fixture
def spawn() -> Iterator[Any]:
    """spawn(args, env) -> NodeProcess; every process is stopped at the end of the test."""
    procs: list[NodeProcess] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> NodeProcess:
        p = NodeProcess(args, env or {})
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait(5)
