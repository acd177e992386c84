"""Container tests: docker.io, compose v2, dockerd and a base image are installed or started here when
missing (deploy/dev/ensure-docker.sh, as `make up` does), so `make test` needs nothing else. They skip,
saying why, only where docker cannot run (not root, no apt, dockerd refuses to start)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.deployfiles import DEPLOY, REPO

TIMINGS: dict[str, float] = {}
# Docker's setup and the image build, one worker at a time on this machine: the docker modules run in several workers
# at once (tests/conftest.py), and a second worker must neither start dockerd again nor build the same images beside
# the first (it finds them cached once the first is done)
_SETUP_LOCK = Path(tempfile.gettempdir()) / "robobus-tests-docker-setup.lock"
# The run whose images are built (its xdist run id), written by the worker that built them: the run's other workers
# skip their `compose build`, which even when cached hashes the whole build context (15-40 s of CPU on this machine)
_BUILT = Path(tempfile.gettempdir()) / "robobus-tests-images-built"


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    with open(_SETUP_LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def docker_ready() -> Iterator[str]:
    """The base image to build on; skips with the reason docker cannot run here."""
    if os.geteuid() != 0:
        pytest.skip("container tests need root (to install and start dockerd)")
    if os.environ.get("ROBOBUS_SKIP_DOCKER"):
        pytest.skip("ROBOBUS_SKIP_DOCKER is set")
    t0 = time.monotonic()
    try:
        with _one_at_a_time():
            proc = subprocess.run([str(DEPLOY / "dev" / "ensure-docker.sh")], cwd=REPO, capture_output=True,
                                  text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("docker could not be set up within 15 min (deploy/dev/ensure-docker.sh)")
    if proc.returncode != 0:
        pytest.skip(f"docker cannot run here: {proc.stderr.strip()[-600:]}")
    base = proc.stdout.strip().rsplit("=", 1)[-1]
    os.environ["ROBOBUS_BASE_IMAGE"] = base
    TIMINGS["ensure_docker_s"] = time.monotonic() - t0
    yield base


# every profile the container tests bring up; the virtual hand runs in the ethercat-loop image
ALL_PROFILES = "sim,record,hand,central,prometheus"


@pytest.fixture(scope="session")
def images(docker_ready: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every image the container tests use, built once per session (one `compose build`: BuildKit builds them
    side by side; cached layers unless the code changed). Modules bring stacks up without building."""
    from tests.deploy.stack import Stack  # late: imports the kit

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one id for every worker of a run; none without workers
    with _one_at_a_time():
        if run_id and _BUILT.exists() and _BUILT.read_text() == run_id:
            TIMINGS["build_s"] = 0.0  # another worker of this run built them, from this tree
            return docker_ready
        secrets = tmp_path_factory.mktemp("build-secrets")
        stack = Stack("robobus-build", secrets, profiles=ALL_PROFILES, extra_env={"ROBOBUS_VHAND": "1"})
        stack.make_secrets()
        # the centre's users too (fleet-watch's env file), so one config holds every profile
        stack.make_secrets("--central", "--site", "s=s/robobus")
        stack.build()
        if run_id:
            _BUILT.write_text(run_id)
    TIMINGS["build_s"] = stack.timings["build_s"]
    return docker_ready


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.write_line("deploy timings: " + ", ".join(f"{k}={v:.1f}" for k, v in TIMINGS.items()))
