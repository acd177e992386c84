"""A real Prometheus (Debian's binary, a local process on a free loopback port) scraping `robobus prometheus` beside a
small simulated system: a private mosquitto, a Dexter simulator and its gateway, each a subprocess. The shipped
alert rules are loaded with their `for:` shortened, and Prometheus scrapes and evaluates every second."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.tools.localbroker import REPO, Broker, NodeProcess, free_port

RULES = REPO / "deploy" / "prometheus" / "robobus.rules.yml"


def prometheus_bin() -> str | None:
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)


def promtool_bin() -> str | None:
    return shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """pred()'s first truthy value within `timeout`, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def fetch(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bytes(r.read())
    except OSError:
        return None


class Prometheus:
    """Prometheus on 127.0.0.1:<free port>, scraping `targets` every second with the shipped rules (`for:` -> 1s)."""

    def __init__(self, workdir: Path, targets: list[str], for_s: str = "1s") -> None:
        exe = prometheus_bin()
        assert exe, "prometheus is not installed (deploy/dev/system-deps.sh installs Debian's)"
        self.port = free_port()
        rules = workdir / "robobus.rules.yml"
        rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {for_s}", RULES.read_text()))
        conf = workdir / "prometheus.yml"
        conf.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "robobus", "static_configs": [{"targets": targets}]}],
        }))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen([exe, f"--config.file={conf}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return fetch(f"{self.url}/-/ready") is not None

    def api(self, path: str, **params: str) -> Any:
        body = fetch(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        if body is None:
            return None
        doc = json.loads(body)
        return doc.get("data") if doc.get("status") == "success" else None

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return list(data.get("result") or []) if data else []

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        data = self.api("alerts")
        return [a for a in (data or {}).get("alerts", [])
                if a["labels"].get("alertname") == name and a.get("state") == state]

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class DemoStack:
    """A broker, a Dexter simulator and its gateway, and the exporter (each a subprocess)."""

    def __init__(self, workdir: Path, root: str = "robobus") -> None:
        self.broker = Broker(free_port(), workdir)
        self.root = root
        self.procs: dict[str, NodeProcess] = {}
        self.dexter_port = free_port()
        self.exporter_port = free_port()

    def env(self) -> dict[str, str]:
        return {"ROBOBUS_MQTT_URL": self.broker.url, "ROBOBUS_TOPIC_ROOT": self.root}

    def start(self) -> None:
        self.broker.start()
        self.start_sim()
        self.procs["dexter-gateway"] = NodeProcess(
            ["-m", "services.dexter_gateway"],
            {**self.env(), "ROBOBUS_DEXTER_ARMS": json.dumps([{"id": "dexter1", "host": "127.0.0.1",
                                                               "port": self.dexter_port}])})
        self.procs["prometheus"] = NodeProcess(
            ["-m", "shared.tools.prometheus", "--port", str(self.exporter_port)], self.env())

    def start_sim(self) -> None:
        self.procs["dexter-sim"] = NodeProcess(["-m", "services.dexter_gateway.sim", "--port",
                                                str(self.dexter_port)], {})

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.exporter_port}/metrics"

    def logs(self) -> str:
        return "\n".join(f"--- {n} (alive {p.alive()})\n{p.text()[-1500:]}" for n, p in self.procs.items())

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop(5)
        self.broker.kill()
