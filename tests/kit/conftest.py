from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shared import Node
from tests.fixtures import Broker
from tests.kit.echo_node import API, build


@pytest.fixture
def echo_node(broker_session: Broker) -> Iterator[Node]:
    """The echo test service in this process, on its own node name."""
    node = Node(API, broker_session.settings(node=f"echo-{time.monotonic_ns()}", health_interval_s=0.5))
    stop = build(node)
    node.start()
    assert node.session.wait_ready(10)
    yield node
    stop.set()
    node.stop()
