"""A service registered once is seen everywhere (docs/kit.md, "How to add a service").

A minimal sixth service, `sixth-demo`, is built in a temporary directory as its own distribution: a package
(its API, a rig for the conformance suite, a CLI sub-command) and a dist-info whose entry_points.txt registers
it (`robobus.services`, `robobus.cli`). Nothing is installed into the project's environment: each check runs in
a subprocess whose PYTHONPATH puts that directory first, so the registry (importlib.metadata) finds the sixth
distribution beside robobus. Then the schema export, the `robobus` CLI (its sub-commands and `status
--expect-all`'s list of services), deploy/make_secrets.py's broker users and ACL, and the conformance harness's
list of services must all name it, and the stop bench's rule names what its rig must declare.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion

from shared import registry
from shared.tools.localbroker import Broker

REPO = Path(__file__).resolve().parents[2]
SIXTH = "sixth-demo"

API_PY = '''
"""sixth-demo: a tank level, the guide's example of a service added from outside the repository."""

from pydantic import BaseModel, Field

from shared.contract import ServiceAPI


class Level(BaseModel):
    percent: float = Field(ge=0, le=100)


class SetLevel(BaseModel):
    percent: float = Field(ge=0, le=100)


class Done(BaseModel):
    ok: bool = True


API = ServiceAPI("sixth-demo", device_doc="a tank", doc="The sixth service of the guide.")
LEVEL = API.state("level", Level, doc="How full the tank is")
SET_LEVEL = API.command("set_level", SetLevel, Done, doc="Fill or drain to a level", motion=True)
'''

RIG_PY = '''
from shared.tools.simrig import RigCommand, SimRig

RIG = SimRig(node_module="robobus_sixth", devices=("tank",), liveness_s=1.0,
             sim=lambda ports: ["-m", "robobus_sixth.sim", "--port", str(ports["tank"])],
             node_env=lambda ports: {"ROBOBUS_SIXTH_PORT": str(ports["tank"])},
             read_command=RigCommand("tank", "set_level", {"percent": 10}))
'''

CLI_PY = '''
import typer

app = typer.Typer(help="sixth-demo's own tools")


@app.command()
def hello() -> None:
    """Say which service this is."""
    print("hello from sixth-demo")


@app.command()
def version() -> None:
    print("0.1.0")
'''

ENTRY_POINTS = f"""\
[robobus.services]
{SIXTH} = robobus_sixth.api:API

[robobus.cli]
sixth = robobus_sixth.cli:app
"""


@pytest.fixture(scope="module")
def sixth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sixth service's distribution, unpacked as a wheel would be: a folder to put on PYTHONPATH."""
    site = tmp_path_factory.mktemp("sixth-site")
    pkg = site / "robobus_sixth"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text(textwrap.dedent(API_PY))
    (pkg / "rig.py").write_text(textwrap.dedent(RIG_PY))
    (pkg / "cli.py").write_text(textwrap.dedent(CLI_PY))
    dist = site / "robobus_sixth-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: robobus-sixth\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def run(site: Path | None, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python <argv>` from the repository, with the sixth distribution on the path (or not: site None)."""
    path = [str(site)] if site is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)]), "COLUMNS": "200"}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_registry_lists_it(sixth: Path) -> None:
    r = run(sixth, "-c", "from shared.registry import service_names, service_apis\n"
                         "print(service_names()); print([a.service for a in service_apis()])")
    assert r.returncode == 0, r.stderr
    names, apis = r.stdout.splitlines()
    assert SIXTH in names and SIXTH in apis
    bare = run(None, "-c", "from shared.registry import service_names; print(service_names())")
    assert SIXTH not in bare.stdout  # the temporary distribution, and only it, brings the sixth service


def test_the_schema_export_documents_it(sixth: Path) -> None:
    r = run(sixth, "-m", "shared.tools.cli", "schema", "--out", "-")
    assert r.returncode == 0, r.stderr
    channels = yaml.safe_load(r.stdout)["channels"]
    assert channels[f"{SIXTH}_state_level"]["address"] == "{root}/{node}/{device}/state/level"
    assert channels[f"{SIXTH}_cmd_set_level"]["address"] == "{root}/{node}/{device}/cmd/set_level"
    assert f"{SIXTH}_cmd_set_level_reply" in channels


def test_the_cli_has_its_sub_command(sixth: Path) -> None:
    r = run(sixth, "-m", "shared.tools.cli", "--help")
    assert r.returncode == 0, r.stderr
    assert "sixth" in r.stdout
    hello = run(sixth, "-m", "shared.tools.cli", "sixth", "hello")
    assert hello.returncode == 0, hello.stderr
    assert "hello from sixth-demo" in hello.stdout


@pytest.fixture
def one_node_online(broker_session: Broker) -> Iterator[tuple[Broker, str]]:
    """A topic root of this test's own where one node (of roi-modules) is online: its retained status."""
    root = f"sixth{os.getpid()}x{time.monotonic_ns()}"
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sixth-status-{time.monotonic_ns()}",
                    protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", broker_session.port)
    c.loop_start()
    try:
        status = '{"online": true, "node": "roi-modules", "service": "roi-modules", "version": "0", "ts": 0}'
        info = c.publish(f"{root}/roi-modules/status", status, qos=1, retain=True)
        info.wait_for_publish(timeout=30)
        assert info.is_published()
        yield broker_session, root
        c.publish(f"{root}/roi-modules/status", b"", qos=1, retain=True).wait_for_publish(timeout=30)
    finally:
        c.disconnect()  # first: loop_stop alone waits out the loop's 1 s select
        c.loop_stop()


def test_status_expects_a_node_of_it(sixth: Path, one_node_online: tuple[Broker, str]) -> None:
    broker, root = one_node_online
    r = run(sixth, "-m", "shared.tools.cli", "status", "--expect-all", "--broker", broker.url, "--root", root,
            "--wait", "3")
    out = " ".join(r.stdout.split())
    assert "roi-modules" in out, r.stdout + r.stderr
    assert r.returncode == 1, r.stdout + r.stderr
    missing = out.split("registered services with no node online:", 1)[1]
    assert SIXTH in missing and "roi-modules" not in missing, out


def test_make_secrets_gives_it_a_broker_user(sixth: Path, tmp_path: Path) -> None:
    r = run(sixth, "deploy/make_secrets.py", "--dir", str(tmp_path), "--root", "robobus")
    assert r.returncode == 0, r.stderr
    users = [line.split(":", 1)[0] for line in (tmp_path / "passwd").read_text().splitlines()]
    assert SIXTH in users, users
    assert (tmp_path / f"{SIXTH}.env").is_file()
    acl = (tmp_path / "acl").read_text()
    block = acl.split(f"user {SIXTH}\n", 1)[1].split("\nuser ", 1)[0]
    assert f"topic readwrite robobus/{SIXTH}/#" in block, block


def test_the_conformance_suite_holds_it_to_the_fault_script(sixth: Path) -> None:
    r = run(sixth, "-c", "from tests.conformance.harness import rigs\n"
                         f"rig = rigs()[{SIXTH!r}]\nprint(type(rig).__name__, rig.node_module, rig.devices)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["SimRig", "robobus_sixth", "('tank',)"], r.stdout


def test_the_stop_bench_rule_names_it_and_what_its_rig_must_declare(sixth: Path) -> None:
    """set_level is a motion command that bench/stop.py does not measure, and the rig gives no reason: the rule
    names the service and the declaration its own folder lacks (no other file to edit)."""
    r = run(sixth, "-c", "from tests.kit.test_bench_stop import unexcused_motion_services\n"
                         "print('\\n'.join(unexcused_motion_services()))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{SIXTH}: a motion service bench/stop.py does not measure: say why in "
                                     'robobus_sixth.rig (SimRig(..., stop_unmeasured="<why>")), or measure it in '
                                     "bench/stop.py"], r.stdout


def test_a_host_without_robobus_installed_reads_the_checkout(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """deploy/make_secrets.py runs on the host's python3 before anything is installed: the registry then reads
    the checkout's pyproject.toml (standard library only)."""
    def absent(name: str) -> None:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(registry, "distribution", absent)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.entry-points."robobus.services"]\n'
                         f'{SIXTH} = "robobus_sixth.api:API"\nroi-modules = "services.roi_modules.api:API"\n')
    monkeypatch.setattr(registry, "PYPROJECT", pyproject)
    assert registry.service_names() == ["roi-modules", SIXTH]
    monkeypatch.setattr(registry, "PYPROJECT", REPO / "pyproject.toml")
    assert set(registry.service_names()) >= {"can-bootloader", "dexter-gateway", "epuck-gateway", "ethercat-loop",
                                             "roi-modules"}
