"""Container tests: docker.io, compose v2, dockerd and a base image are installed or started here when
missing (deploy/dev/ensure-docker.sh, as `make up` does), so `make test` needs nothing else. They skip,
saying why, only where docker cannot run (not root, no apt, dockerd refuses to start)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.deploy.deployfiles import DEPLOY, REPO

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def docker_ready() -> Iterator[str]:
    """The base image to build on; skips with the reason docker cannot run here."""
    if os.geteuid() != 0:
        pytest.skip("container tests need root (to install and start dockerd)")
    if os.environ.get("ROBOBUS_SKIP_DOCKER"):
        pytest.skip("ROBOBUS_SKIP_DOCKER is set")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(DEPLOY / "dev" / "ensure-docker.sh")], cwd=REPO, capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("docker could not be set up within 15 min (deploy/dev/ensure-docker.sh)")
    if proc.returncode != 0:
        pytest.skip(f"docker cannot run here: {proc.stderr.strip()[-600:]}")
    base = proc.stdout.strip().rsplit("=", 1)[-1]
    os.environ["ROBOBUS_BASE_IMAGE"] = base
    TIMINGS["ensure_docker_s"] = time.monotonic() - t0
    yield base


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.write_line("deploy timings: " + ", ".join(f"{k}={v:.1f}" for k, v in TIMINGS.items()))
