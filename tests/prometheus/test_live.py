"""The real thing end to end: Debian's Prometheus scrapes `robobus prometheus` beside a Dexter simulator and its
gateway (subprocesses, a private broker), answers a query for a real series of the demo, and the shipped alert
rules fire: the device's when its simulator is killed, the node's when the node is killed -9 (its Last Will)."""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import mosquitto_bin
from tests.prometheus.stack import DemoStack, Prometheus, fetch, prometheus_bin, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
# generous for a loaded two-core host: on a quiet one each step takes 1-5 s
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[DemoStack, Prometheus]]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    if prometheus_bin() is None:
        pytest.skip("prometheus is not installed (deploy/dev/system-deps.sh installs Debian's)")
    with tempfile.TemporaryDirectory(prefix="robobus-prometheus-") as d:
        demo = DemoStack(Path(d))
        demo.start()
        prom = Prometheus(Path(d), [f"127.0.0.1:{demo.exporter_port}"])
        try:
            yield demo, prom
        finally:
            prom.stop()
            demo.stop()


def test_prometheus_scrapes_a_real_series_of_the_demo(stack: tuple[DemoStack, Prometheus]) -> None:
    demo, prom = stack
    assert wait_for(prom.ready, DEADLINE_S), prom.text()
    assert wait_for(lambda: fetch(demo.metrics_url), DEADLINE_S), demo.logs()
    expr = 'robobus_device_connection{node="dexter-gateway", device="dexter1", service="dexter-gateway"} == 1'
    found = wait_for(lambda: prom.query(expr), DEADLINE_S)
    assert found, (prom.query("robobus_device_connection"), demo.logs(), prom.text())
    assert "site" not in found[0]["metric"]  # a one-level root names no site (an empty label is no label)
    online = wait_for(lambda: prom.query('robobus_node_online{node="dexter-gateway"} == 1'), DEADLINE_S)
    assert online, demo.logs()
    # the node's counters reach Prometheus too (its _node/state/stats, every 5 s)
    assert wait_for(lambda: prom.query('robobus_node_published_total{node="dexter-gateway"} > 0'), DEADLINE_S)
    assert wait_for(lambda: prom.query('up{job="robobus"} == 1'), DEADLINE_S)
    assert not prom.alerts("RobobusDeviceNotConnected") and not prom.alerts("RobobusNodeOffline")


def test_an_alert_fires_when_the_simulator_is_killed(stack: tuple[DemoStack, Prometheus]) -> None:
    demo, prom = stack
    assert wait_for(lambda: prom.query('robobus_device_connection{device="dexter1"} == 1'), DEADLINE_S), demo.logs()
    demo.procs["dexter-sim"].signal(signal.SIGKILL)
    firing = wait_for(lambda: prom.alerts("RobobusDeviceNotConnected"), DEADLINE_S)
    assert firing, (prom.query("robobus_device_connection"), demo.logs(), prom.text())
    assert firing[0]["labels"]["node"] == "dexter-gateway" and firing[0]["labels"]["device"] == "dexter1"
    # the simulator back: the gateway reconnects, the alert resolves
    demo.start_sim()
    assert wait_for(lambda: not prom.alerts("RobobusDeviceNotConnected") and not prom.alerts(
        "RobobusDeviceNotConnected", "pending"), DEADLINE_S), demo.logs()


def test_the_node_killed_is_offline_and_its_device_series_are_gone(stack: tuple[DemoStack, Prometheus]) -> None:
    demo, prom = stack
    assert wait_for(lambda: prom.query('robobus_device_connection{device="dexter1"} == 1'), DEADLINE_S), demo.logs()
    demo.procs["dexter-gateway"].signal(signal.SIGKILL)  # no clean stop: the broker delivers its Last Will
    firing = wait_for(lambda: prom.alerts("RobobusNodeOffline"), DEADLINE_S)
    assert firing and firing[0]["labels"]["node"] == "dexter-gateway", (prom.query("robobus_node_online"),
                                                                         demo.logs())
    # a dead node's last health is not its present: its device's series are no longer exported (stale in Prometheus)
    assert wait_for(lambda: not prom.query('robobus_device_connection{device="dexter1"}'), DEADLINE_S)
    assert not prom.alerts("RobobusDeviceNotConnected")
