"""Profile `prometheus` under `make up` (deploy/compose.sh): the broker, the simulated Dexter and its gateway, the
exporter and Prometheus in containers; from the host, Prometheus's HTTP API on its published port answers a real
series of the simulated device and lists robobus's alert rules, and the exporter's container is healthy."""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import TIMINGS
from tests.deploy.deployfiles import DEPLOY
from tests.deploy.stack import Stack
from tests.fixtures import free_port
from tests.prometheus.stack import fetch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# Prometheus scrapes every 15 s (deploy/prometheus/prometheus.yml): a series needs up to two scrapes to appear
SERIES_WAIT_S = 90.0
# the smallest system with a device: the broker and one simulated service, then the exporter and Prometheus
SERVICES = ("broker", "dexter-sim", "dexter-gateway-sim", "prometheus-exporter", "prometheus")


class Api:
    """Prometheus's HTTP API as published on the host."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/v1"

    def get(self, path: str, **params: str) -> Any:
        body = fetch(f"{self.url}/{path}?{urllib.parse.urlencode(params)}")
        doc = json.loads(body) if body else {}
        return doc.get("data") if doc.get("status") == "success" else None

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list((self.get("query", query=expr) or {}).get("result") or [])


@pytest.fixture(scope="module")
def stack(images: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Api]]:
    port = free_port()
    st = Stack(f"robobus-prom-{os.getpid()}", tmp_path_factory.mktemp("prom-secrets"), profiles="sim,prometheus",
               extra_env={"ROBOBUS_PROMETHEUS_SERVER_PORT": str(port)})
    st.make_secrets()
    st.down()
    try:
        st.up(*SERVICES)
    except Exception:
        print(st.logs())
        st.down()
        raise
    TIMINGS.update({f"prometheus_{k}": v for k, v in st.timings.items()})
    yield st, Api(port)
    st.down()


def test_prometheus_has_the_simulated_devices_connection_series(stack: tuple[Stack, Api]) -> None:
    st, api = stack
    expr = 'robobus_device_connection{node="dexter-gateway", device="dexter1"}'
    found = wait_for(lambda: api.query(expr), SERIES_WAIT_S, interval=1.0)
    assert found, (api.query("robobus_device_connection"), api.query("up"), st.logs())
    assert found[0]["value"][1] == "1", found
    assert api.query('up{job="robobus"} == 1'), api.query("up")


def test_prometheus_loads_robobus_alert_rules(stack: tuple[Stack, Api]) -> None:
    _, api = stack
    shipped = yaml.safe_load((DEPLOY / "prometheus" / "robobus.rules.yml").read_text())["groups"]
    groups = {g["name"]: {r["name"] for r in g["rules"]} for g in (api.get("rules") or {}).get("groups", [])}
    for group in shipped:
        assert groups.get(group["name"]) == {r["alert"] for r in group["rules"]}, groups


def test_the_exporter_and_prometheus_containers_are_healthy(stack: tuple[Stack, Api]) -> None:
    st, _ = stack
    health = {c["Service"]: c.get("Health") for c in st.containers()}
    assert health.get("prometheus-exporter") == "healthy", (health, st.logs())
    assert health.get("prometheus") == "healthy", (health, st.logs())
