"""deploy/fleet/watchdog.py: a site's broker that stays up but fails its health check is restarted without a person
(docker 20.10 never restarts an unhealthy container). The decision on a fake docker API (no docker), and once on the
real one: a container of a throwaway compose project whose health check always fails is restarted by the watchdog
through the docker socket, and a healthy one of the same project is left alone."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tests.deploy.deployfiles import DEPLOY, load

watchdog = load("robobus_watchdog", DEPLOY / "fleet" / "watchdog.py")


@dataclass
class FakeDocker:
    health: dict[str, dict[str, Any]]  # container id -> State.Health
    services: dict[str, str]  # container id -> compose service
    restarted: list[str] = field(default_factory=list)

    def containers(self, project: str) -> list[dict[str, Any]]:
        return [{"Id": c, "Labels": {"com.docker.compose.project": project, "com.docker.compose.service": s}}
                for c, s in self.services.items()]

    def inspect(self, cid: str) -> dict[str, Any]:
        return {"State": {"Health": self.health[cid]}}

    def restart(self, cid: str, timeout_s: int) -> None:
        self.restarted.append(cid)


def unhealthy(streak: int) -> dict[str, Any]:
    return {"Status": "unhealthy", "FailingStreak": streak, "Log": [{"ExitCode": 1, "Output": "timed out"}]}


def test_an_unhealthy_broker_is_restarted_once_per_cooldown_and_nothing_else() -> None:
    now = [0.0]
    api = FakeDocker({"b": unhealthy(2), "u": unhealthy(9), "s": {"Status": "starting", "FailingStreak": 5}},
                     {"b": "broker", "u": "uplink", "s": "broker"})
    dog = watchdog.Watchdog(api, "site-a", failures=3, cooldown_s=60, clock=lambda: now[0])
    assert dog.check() == []  # 2 failures: one late check on a busy host is not a hung broker
    api.health["b"] = unhealthy(3)
    assert dog.check() == ["b"]  # the uplink (not watched) and a broker still starting are left alone
    now[0] = 30.0
    assert dog.check() == []  # restarted 30 s ago: give it its start period
    now[0] = 61.0
    assert dog.check() == ["b"] and api.restarted == ["b", "b"] and dog.restarts == 2
    api.health["b"] = {"Status": "healthy", "FailingStreak": 0}
    now[0] = 200.0
    assert dog.check() == []


def test_the_edge_compose_runs_the_watchdog_on_the_broker() -> None:
    spec = yaml.safe_load((DEPLOY / "compose.edge.yaml").read_text())["services"]["watchdog"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in spec["volumes"]
    assert spec["cap_drop"] == ["ALL"] and spec["read_only"] is True
    assert spec["environment"]["ROBOBUS_WATCHDOG_SERVICES"] == "broker"
    assert spec["environment"]["ROBOBUS_WATCHDOG_PROJECT"] == "${ROBOBUS_PROJECT:-robobus}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_watchdog_restarts_an_unhealthy_container_through_the_docker_socket(docker_ready: str, tmp_path) -> None:
    from tests.deploy.stack import DOCKER, run

    project = f"robobus-wd-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    compose = tmp_path / "compose.yaml"
    sick = {"test": ["CMD", "false"], "interval": "1s", "timeout": "2s", "retries": 1, "start_period": "0s"}
    well = {**sick, "test": ["CMD", "true"]}
    compose.write_text(yaml.safe_dump({"name": project, "services": {
        "broker": {"image": docker_ready, "command": ["sleep", "600"], "init": True, "healthcheck": sick},
        "other": {"image": docker_ready, "command": ["sleep", "600"], "init": True, "healthcheck": sick,
                  "labels": {"x": "not watched"}},
        "fine": {"image": docker_ready, "command": ["sleep", "600"], "init": True, "healthcheck": well}}}))
    dc = [DOCKER, "compose", "-f", str(compose)]
    run([*dc, "up", "-d"], timeout=120)
    try:
        ids = {s: run([*dc, "ps", "-q", s]).stdout.strip() for s in ("broker", "other", "fine")}

        def started(cid: str) -> str:
            return str(json.loads(run([DOCKER, "inspect", cid]).stdout)[0]["State"]["StartedAt"])

        before = {s: started(c) for s, c in ids.items()}
        dog = watchdog.Watchdog(watchdog.SocketApi(), project, frozenset({"broker"}), failures=3, cooldown_s=600)
        deadline = time.monotonic() + 60
        while not dog.restarts and time.monotonic() < deadline:
            dog.check()
            time.sleep(0.5)
        assert dog.restarts == 1, "the unhealthy broker was not restarted within 60 s"
        assert started(ids["broker"]) != before["broker"]
        assert started(ids["other"]) == before["other"] and started(ids["fine"]) == before["fine"]
        t = threading.Thread(target=dog.check)  # within the cooldown: left alone even though unhealthy again
        t.start()
        t.join(30)
        assert dog.restarts == 1
    finally:
        run([*dc, "down", "-t", "1"], check=False, timeout=120)
