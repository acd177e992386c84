"""Restarts a container whose health check keeps failing: docker 20.10 only reports `unhealthy`, it never restarts
such a container (`restart:` acts on exits alone). A site's mosquitto 2.0.11 can stay up but serve nobody (after its
TLS bridge rejected a centre's certificate it was seen at 90 % CPU in keepalive__check, "running (unhealthy)" for
good); this restarts it without a person.

Every ROBOBUS_WATCHDOG_INTERVAL_S (5) it reads the containers of its compose project (ROBOBUS_WATCHDOG_PROJECT)
whose service is in ROBOBUS_WATCHDOG_SERVICES (space separated, default "broker") from the docker API on its socket
(/var/run/docker.sock, mounted read-write: the API is root's), and restarts one that is `unhealthy` with at least
ROBOBUS_WATCHDOG_FAILURES (3) failed checks in a row, at most once per ROBOBUS_WATCHDOG_COOLDOWN_S (60: the broker's
start period and a few checks). Stdlib only; one log line per restart and per API error (the API unreachable is
logged and retried, never fatal). deploy/README.md, "A fleet": "A site's broker that stops serving"."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("robobus.watchdog")

SOCKET = "/var/run/docker.sock"


class DockerApi(Protocol):
    def containers(self, project: str) -> list[dict[str, Any]]: ...
    def inspect(self, cid: str) -> dict[str, Any]: ...
    def restart(self, cid: str, timeout_s: int) -> None: ...


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


class SocketApi:
    """The docker engine API on its unix socket (the calls docker ps / inspect / restart make)."""

    def __init__(self, path: str = SOCKET, timeout_s: float = 30.0) -> None:
        self.path, self.timeout_s = path, timeout_s

    def _call(self, method: str, url: str) -> Any:
        conn = UnixHTTPConnection(self.path, self.timeout_s)
        try:
            conn.request(method, url)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status >= 300:
            raise OSError(f"docker API {method} {url}: {resp.status} {body[:200]!r}")
        return json.loads(body) if body else None

    def containers(self, project: str) -> list[dict[str, Any]]:
        filters = json.dumps({"label": [f"com.docker.compose.project={project}"]})
        return list(self._call("GET", f"/containers/json?filters={urllib.parse.quote(filters)}"))

    def inspect(self, cid: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/containers/{cid}/json"))

    def restart(self, cid: str, timeout_s: int) -> None:
        self._call("POST", f"/containers/{cid}/restart?t={timeout_s}")


@dataclass
class Watchdog:
    api: DockerApi
    project: str
    services: frozenset[str] = frozenset({"broker"})
    failures: int = 3
    cooldown_s: float = 60.0
    stop_timeout_s: int = 10
    clock: Callable[[], float] = time.monotonic
    last_restart: dict[str, float] = field(default_factory=dict)  # container id -> when
    restarts: int = 0

    def check(self) -> list[str]:
        """One pass: the ids of the containers restarted."""
        done: list[str] = []
        for c in self.api.containers(self.project):
            service = (c.get("Labels") or {}).get("com.docker.compose.service", "")
            if service not in self.services:
                continue
            cid = str(c["Id"])
            health = (self.api.inspect(cid).get("State") or {}).get("Health") or {}
            status, streak = health.get("Status"), int(health.get("FailingStreak") or 0)
            if status != "unhealthy" or streak < self.failures:
                continue
            now = self.clock()
            if now - self.last_restart.get(cid, -1e18) < self.cooldown_s:
                continue
            last = (health.get("Log") or [{}])[-1]
            log.warning("restarting %s (%s): unhealthy, %d failed health checks in a row (last: exit %s, %r)",
                        service, cid[:12], streak, last.get("ExitCode"), str(last.get("Output", ""))[-200:])
            self.api.restart(cid, self.stop_timeout_s)
            self.last_restart[cid] = now
            self.restarts += 1
            done.append(cid)
        return done


def main() -> int:
    logging.basicConfig(level=os.environ.get("ROBOBUS_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    project = os.environ.get("ROBOBUS_WATCHDOG_PROJECT", "")
    if not project:
        log.error("ROBOBUS_WATCHDOG_PROJECT is not set: which compose project to watch")
        return 2
    dog = Watchdog(SocketApi(os.environ.get("ROBOBUS_WATCHDOG_SOCKET", SOCKET)), project,
                   frozenset(os.environ.get("ROBOBUS_WATCHDOG_SERVICES", "broker").split()),
                   int(os.environ.get("ROBOBUS_WATCHDOG_FAILURES", "3")),
                   float(os.environ.get("ROBOBUS_WATCHDOG_COOLDOWN_S", "60")))
    interval = float(os.environ.get("ROBOBUS_WATCHDOG_INTERVAL_S", "5"))
    ready = os.environ.get("ROBOBUS_WATCHDOG_READY_FILE")
    log.info("watching %s of project %s: restart after %d failed health checks (cooldown %.0f s)",
             " ".join(sorted(dog.services)), project, dog.failures, dog.cooldown_s)
    while True:
        try:
            dog.check()
            if ready:
                Path(ready).touch()  # the container's healthcheck
        except (OSError, ValueError, http.client.HTTPException) as e:
            log.warning("docker API: %s (retrying in %.0f s)", e, interval)
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
