"""`robobus new-service NAME` (shared/tools/scaffold.py) writes a service that works and that the kit's rules
hold: generated in a temporary folder as a distribution of its own (as tests/kit/test_add_a_service.py builds its
sixth service: a dist-info whose entry points register it), and checked in subprocesses whose PYTHONPATH puts that
folder first. Its request models refuse unknown keys, its motion command declares motion=True and its device binds
a stop action, the layout, contract and fuzz rules see it through the registry, and the conformance suite runs its
whole fault script against it on its simulator, so the guide (docs/kit.md, "How to add a service") cannot drift
from the kit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.tools import scaffold
from shared.tools.simrig import procfile_variables, sim_serves

REPO = Path(__file__).resolve().parents[2]
NAME = "sixth-io"
PACKAGE = "robobus_sixth_io"
ROOMS = ("__init__.py", "api.py", "models.py", "settings.py", "protocol.py", "transport.py", "device.py",
         "service.py", "__main__.py", "sim.py", "rig.py", "README.md", "tests/__init__.py", "tests/test_end_to_end.py")


def run(site: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("ROBOBUS_")}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated service as an installed distribution would be: its package and a dist-info with the entry
    points the scaffold says to add."""
    site = tmp_path_factory.mktemp("scaffold-site")
    r = run(site, "-m", "shared.tools.cli", "new-service", NAME, "--package", PACKAGE, "--dir", str(site / PACKAGE))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f'{NAME} = "{PACKAGE}.api:API"' in r.stdout and f'"{NAME}.tcp" = "{PACKAGE}.transport:tcp_link"' in r.stdout
    dist = site / "robobus_sixth_io-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: robobus-sixth-io\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[robobus.services]\n{NAME} = {PACKAGE}.api:API\n\n"
                                           f"[robobus.transports]\n{NAME}.tcp = {PACKAGE}.transport:tcp_link\n")
    return site


def test_it_writes_every_room(site: Path) -> None:
    written = sorted(str(p.relative_to(site / PACKAGE)) for p in (site / PACKAGE).rglob("*") if p.is_file()
                     and "__pycache__" not in p.parts)
    assert written == sorted(ROOMS)
    with pytest.raises(FileExistsError):
        scaffold.create(NAME, site / PACKAGE, PACKAGE)  # never over a service's own work


def test_requests_refuse_unknown_keys_and_the_motion_command_binds_a_stop(site: Path) -> None:
    probe = textwrap.dedent(f"""
        from {PACKAGE}.api import API
        from {PACKAGE}.service import build
        from {PACKAGE}.settings import SixthIoSettings
        from shared import Node
        for name, spec in sorted(API.commands.items()):
            print(name, spec.request.model_config.get("extra"), spec.motion)
        s = SixthIoSettings()
        node = Node(API, s)
        svc = build(node, s)
        dev = svc.positioner.dev
        print("device", dev.name, dev.motion, dev.stop_action is not None, dev.unbound())
    """)
    r = run(site, "-c", probe)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "move_to forbid True" in lines and "read forbid False" in lines, lines
    assert "device sixth1 True True ([], [])" in lines, lines


def test_the_registry_based_rules_hold_it(site: Path) -> None:
    """The layout rules (its device module), the transport factories' rules (the kit's one signature, no alias),
    the unknown-keys contract test, the fuzz coverage, the stop bench's coverage (its rig says why it is not
    measured) and the api-imports rule, each run with the generated service registered."""
    r = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
            "tests/kit/test_service_layout.py", "tests/kit/test_transport_factories.py",
            "tests/contract/test_unknown_keys.py", "tests/kit/test_api_imports.py",
            "tests/fuzz/test_fuzz.py::test_every_registered_service_has_its_decoders_fuzzed",
            "tests/kit/test_bench_stop.py::test_every_registered_motion_service_is_measured_or_says_why",
            "tests/kit/test_bind_once.py::test_the_contract_and_settings_are_imported_from_api_and_settings_not_from_"
            "service", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    listed = run(site, "-m", "tests.fuzz", "--list")
    if listed.returncode == 0:  # atheris installed: its decoders are targets, and survive a short run
        assert "sixth_io_replies" in listed.stdout.split() and "sixth_io_requests" in listed.stdout.split()
        fuzz = run(site, "-m", "tests.fuzz", "sixth_io_replies", "-runs=3000", "-seed=1")
        assert fuzz.returncode == 0, fuzz.stderr[-3000:]


def test_its_own_tests_pass_with_the_suite_s_fixtures(site: Path) -> None:
    """The service's own tests (services/<package>/tests/, which `make test` collects): its simulator and its node
    end to end on the session's broker, with the suite's fixtures (tests/fixtures.py)."""
    tests = site / PACKAGE / "tests"
    assert (tests / "test_end_to_end.py").is_file()
    r = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.fixtures", str(tests), timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout, r.stdout[-2000:]


def test_its_procfile_lines_follow_the_naming_and_variable_rules() -> None:
    text = scaffold.registration(NAME, PACKAGE)
    lines = dict(ln.split(": ", 1) for ln in text.splitlines() if ln.startswith(("sixth-sim:", "sixth-io:")))
    assert sim_serves([*lines, "epuck-gateway", "epuck-sim"]) == {"sixth-sim": NAME, "epuck-sim": "epuck-gateway"}
    variables = procfile_variables(lines.values())
    assert list(variables) == ["ROBOBUS_PORT_SIXTH_SIM"], variables
    with pytest.raises(ValueError, match="at least two"):
        scaffold.names("tank")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_conformance_suite_passes_it(site: Path) -> None:
    from tests.conformance.faults import FAULTS

    r = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/test_conformance.py",
            "-k", f"{NAME} or zz_table", "-s", timeout=880)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert f"{len(FAULTS) + 1} passed" in r.stdout, r.stdout[-3000:]  # every fault ran (none skipped), and the table
    assert sum(1 for line in r.stdout.splitlines() if NAME in line and "ok" in line.lower()) >= len(FAULTS), (
        r.stdout[-3000:])
