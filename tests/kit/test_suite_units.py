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
    # dockerd's setup and the image build, one worker at a time
    conf = (REPO / "tests/deploy/conftest.py").read_text()
    assert "with _one_at_a_time():\n            proc = subprocess.run" in conf
    assert "with _one_at_a_time():\n        stack.build()" in conf


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
    """Two workers are two processes: the second waits for the first's lock (flock on one file)."""
    import subprocess
    import sys

    code = ("import time, tests.conftest as c\n"
            "with c._realtime_alone():\n"
            "    print('in', flush=True); time.sleep(1.0)\n")
    first = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None and first.stdout.readline().strip() == "in"
    import time

    from tests.conftest import _realtime_alone

    t0 = time.monotonic()
    with _realtime_alone():
        waited = time.monotonic() - t0
    first.wait(10)
    assert waited > 0.5, waited  # it held the lock for 1 s after saying so


def test_the_wall_line_says_the_ratio_to_the_target_and_met_or_not() -> None:
    from tests.conftest import SUITE_TARGET_S, suite_verdict

    assert SUITE_TARGET_S == 420
    assert "ratio 0.93, met" in suite_verdict(389)
    assert "ratio 1.14, not met" in suite_verdict(480)
