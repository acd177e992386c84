"""How a parallel run splits the suite (tests/conftest.py's `unit_of`, used by xdist's controller, which sees only
test ids): every module whole in one worker, the docker modules together, the conformance suite per service."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO, _uses_docker, unit_of


def test_a_module_is_one_unit_whatever_its_classes_and_parameters() -> None:
    assert unit_of("tests/roi_modules/test_service.py::test_a") == "tests/roi_modules/test_service.py"
    assert unit_of("tests/roi_modules/test_service.py::TestX::test_b[1-2]") == "tests/roi_modules/test_service.py"


def test_the_conformance_suite_is_one_unit_per_service() -> None:
    m = "tests/conformance/test_conformance.py"
    assert unit_of(f"{m}::test_fault[roi-modules-absent]") == unit_of(f"{m}::test_fault[roi-modules-node_kill9]")
    assert unit_of(f"{m}::test_fault[roi-modules-absent]") != unit_of(f"{m}::test_fault[dexter-gateway-absent]")
    assert unit_of(f"{m}::test_every_registered_service_has_a_rig") == m


def test_a_long_test_that_shares_none_of_its_modules_fixtures_is_a_unit_of_its_own() -> None:
    import ast

    from tests.conftest import _LONG_FIRST, _OWN_UNIT

    for nodeid in _OWN_UNIT:
        module, _, name = nodeid.partition("::")
        assert unit_of(nodeid) == nodeid and unit_of(f"{module}::test_other") == module
        assert nodeid in _LONG_FIRST
        tree = ast.parse((REPO / module).read_text())
        fixtures = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                    and any("fixture" in ast.unparse(d) for d in f.decorator_list)}
        test = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name)
        assert not fixtures & {a.arg for a in test.args.args}, (nodeid, fixtures)


def test_every_module_that_uses_docker_is_a_unit_of_its_own_and_builds_under_one_lock() -> None:
    deploy = sorted(p for p in (REPO / "tests/deploy").glob("test_*.py"))
    docker = {p.name for p in deploy if _uses_docker(str(p.relative_to(REPO)))}
    # the modules that build images or run compose projects (their fixtures take `images` / `docker_ready`)
    assert {"test_compose_sim.py", "test_fleet.py", "test_realtime_container.py"} <= docker, docker
    # brokers on the host only: units of their own, run beside the docker unit
    assert {"test_broker_acl.py", "test_loss_stats.py"}.isdisjoint(docker), docker
    for p in deploy:
        text = p.read_text()
        rel = str(p.relative_to(REPO))
        takes_docker = any(f"{name}:" in text or f"{name})" in text or f"{name}," in text
                           for name in ("docker_ready", "images", "compose_ok"))
        assert _uses_docker(rel) == takes_docker, rel
        if takes_docker:  # side by side with the others: their stacks have names and ports of their own
            assert unit_of(f"{rel}::test_x") == rel, rel
    assert not _uses_docker(str(Path("tests/deploy/no_such_module.py")))
    # dockerd's setup and the image build, one worker at a time; under the same lock, a worker whose run's images
    # another worker built skips its build
    conf = (REPO / "tests/deploy/conftest.py").read_text()
    assert "with _one_at_a_time():\n            proc = subprocess.run" in conf
    images = conf[conf.index("def images("):conf.index("def pytest_terminal_summary")]
    locked = images[images.index("    with _one_at_a_time():\n"):].split("\n    TIMINGS")[0]
    assert "_BUILT.read_text() == run_id" in locked and "        stack.build()\n" in locked, locked
    assert "_BUILT.write_text(run_id)" in locked.split("stack.build()")[1], locked


def test_the_modules_that_run_realtime_processes_are_one_unit() -> None:
    wire = [p for p in (REPO / "tests/ethercat_loop").glob("test_wire_*.py") if "wire_fixtures" in p.read_text()]
    assert len(wire) >= 5, wire
    for p in wire:
        assert unit_of(f"{p.relative_to(REPO)}::test_x") == "realtime", p
    assert unit_of("tests/ethercat_loop/test_protocol.py::test_x") == "tests/ethercat_loop/test_protocol.py"


def test_every_module_with_realtime_processes_holds_the_realtime_lock_for_its_whole_life() -> None:
    """The realtime container's stack must not run beside the realtime unit's processes (two workers at once): the
    container module (in the docker unit: dockerd's realtime budget) and every realtime-unit module hold the
    machine's realtime lock from their first fixture to their last teardown; the others take no lock."""
    import tests.conftest as c

    for m in c._REALTIME_CONTAINER:
        assert (REPO / m).exists(), m
        assert unit_of(f"{m}::test_x") == m and c._holds_realtime_lock(m)
    wire = [str(p.relative_to(REPO)) for p in (REPO / "tests/ethercat_loop").glob("test_wire_*.py")]
    assert wire and all(c._holds_realtime_lock(m) for m in wire if unit_of(f"{m}::test_x") == "realtime")
    assert not c._holds_realtime_lock("tests/ethercat_loop/test_protocol.py")
    # module scope: a lock per test would leave a module's nodes running while another module held it (the
    # fixture as pytest registered it, not its source text)
    marker = c._realtime_module_alone._fixture_function_marker
    assert marker.scope == "module" and marker.autouse, marker


def test_the_realtime_lock_is_exclusive_across_processes(tmp_path: Path) -> None:
    """Two workers are two processes: both name the same lock file, and the second waits for the first's lock (flock
    on one file). Shown on a lock file of its own: the machine's is held by the realtime modules for minutes in a
    parallel run, which this test would wait out."""
    import subprocess
    import sys
    import time

    from tests.conftest import _REALTIME_LOCK, _realtime_alone

    lock = tmp_path / "realtime.lock"
    code = ("import sys, time, pathlib, tests.conftest as c\n"
            "print(c._REALTIME_LOCK, flush=True)\n"
            "with c._realtime_alone(pathlib.Path(sys.argv[1])):\n"
            "    print('in', flush=True); time.sleep(1.0)\n")
    first = subprocess.Popen([sys.executable, "-c", code, str(lock)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None
    assert first.stdout.readline().strip() == str(_REALTIME_LOCK)  # every worker computes the same file
    assert first.stdout.readline().strip() == "in"
    t0 = time.monotonic()
    with _realtime_alone(lock):
        waited = time.monotonic() - t0
    first.wait(10)
    assert waited > 0.5, waited  # it held the lock for 1 s after saying so


def test_the_wall_line_says_the_ratio_to_the_target_and_met_or_not() -> None:
    from tests.conftest import SUITE_TARGET_S, suite_verdict

    assert SUITE_TARGET_S == 420
    assert "ratio 0.93, met" in suite_verdict(389)
    assert "ratio 1.14, not met" in suite_verdict(480)


def test_a_parallel_run_rewrites_every_module_its_workers_import_once_before_they_start() -> None:
    """The controller's list of modules to rewrite (tests/conftest.py `_rewritten_sources`): every test module and
    conftest.py of the paths given, the suite's plugin, nothing under node_modules; a single module brings the
    conftest.py files above it."""
    from tests.conftest import _rewritten_sources

    whole = {p.relative_to(REPO).as_posix() for p in _rewritten_sources([str(REPO / "tests")])}
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("*.py")
               if (p.name.startswith("test_") or p.name == "conftest.py") and "node_modules" not in p.parts}
    assert whole == on_disk | {"tests/fixtures.py"}, whole ^ (on_disk | {"tests/fixtures.py"})
    one = {p.relative_to(REPO).as_posix() for p in _rewritten_sources([f"{REPO}/tests/deploy/test_fleet.py::test_x"])}
    assert one == {"tests/deploy/test_fleet.py", "tests/deploy/conftest.py", "tests/conftest.py", "tests/fixtures.py"}


def test_the_run_compiles_the_repositorys_modules_for_the_processes_it_starts() -> None:
    """Every module of shared/, services/ and tests/ has a current .pyc once the run has started (pytest_configure),
    which every process reads even under PYTHONDONTWRITEBYTECODE."""
    import importlib.util

    from tests.conftest import _compile_sources

    _compile_sources()
    for module in ("shared/rpc.py", "services/ethercat_loop/service.py", "tests/chaos/stack.py"):
        source = REPO / module
        pyc = Path(importlib.util.cache_from_source(str(source)))
        assert pyc.exists() and pyc.stat().st_mtime >= source.stat().st_mtime, module
