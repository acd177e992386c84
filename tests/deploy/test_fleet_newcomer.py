"""What a newcomer runs first: `make up`'s closing hint works in a fresh clone (no .venv), and the clustered centre's
compose file refuses to start without ROBOBUS_CENTRAL_SITES, saying what it is (without it fleet-watch and
fleet-gate never become healthy and `up --wait` waits for ever). Neither needs a docker daemon."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.deployfiles import DEPLOY

DOCKER = "/usr/bin/docker"


def closing_hint(cwd: Path) -> str:
    """deploy/up.sh's closing lines, run alone in `cwd` (a checkout with or without its venv)."""
    script = (DEPLOY / "up.sh").read_text()
    block = re.search(r"^port=\$\{ROBOBUS_BROKER_PORT.*?^MSG$", script, re.S | re.M)
    assert block, "up.sh's closing lines moved"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_")}
    out = subprocess.run(["bash", "-c", block.group(0)], cwd=cwd, env={**env, "project": "robobus",
                                                                        "COMPOSE_PROFILES": "sim"},
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def test_make_ups_hint_in_a_fresh_clone_names_no_missing_program_as_runnable(tmp_path: Path) -> None:
    text = closing_hint(tmp_path)  # no .venv here
    lines = text.splitlines()
    cli = [i for i, line in enumerate(lines) if ".venv/bin/robobus status" in line]
    assert cli and "make setup" in lines[cli[0] - 1], text  # the CLI is named with what installs it
    assert any(line.strip().startswith("deploy/compose.sh exec broker sh -c 'mosquitto_sub -u viewer") for line in
               lines), text  # and a command that works without it
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "robobus").write_text("#!/bin/sh\n")
    (venv / "robobus").chmod(0o755)
    with_venv = closing_hint(tmp_path)
    assert "make setup" not in with_venv and ".venv/bin/robobus status" in with_venv, with_venv


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "ROBOBUS_CENTRAL_SITES"}
    return subprocess.run([DOCKER, "compose", "-f", str(DEPLOY / "compose.cluster.yaml"), "--profile", "cluster",
                           "config", "--no-path-resolution"], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def test_the_cluster_refuses_to_start_without_its_sites(tmp_path: Path) -> None:
    if not Path(DOCKER).exists() or shutil.which("docker") is None or compose_config({}).returncode == 127:
        pytest.skip("docker compose is not installed (make up / the container tests install it)")
    for f in ("ejabberd.yml", "ejabberd-users", "ejabberd-cookie.env", "fleet-watch.env", "fleet-gate.env"):
        (tmp_path / f).write_text("")
    (tmp_path / "certs").mkdir()
    missing = compose_config({"ROBOBUS_SECRETS_DIR": str(tmp_path)})
    assert missing.returncode != 0
    assert "ROBOBUS_CENTRAL_SITES" in missing.stderr and "site-a=site-a/robobus" in missing.stderr, missing.stderr
    given = compose_config({"ROBOBUS_SECRETS_DIR": str(tmp_path), "ROBOBUS_CENTRAL_SITES": "s=s/robobus"})
    assert given.returncode == 0, given.stderr
    assert "ROBOBUS_FLEET_SITES: s=s/robobus" in given.stdout
    readme = (DEPLOY / "README.md").read_text()
    recipe = readme[readme.index("## A clustered centre"):]
    recipe = recipe[:recipe.index("docker compose -f deploy/compose.cluster.yaml --profile cluster up")]
    assert 'export ROBOBUS_CENTRAL_SITES="site-a=site-a/robobus site-b=site-b/robobus"' in recipe
