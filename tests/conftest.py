"""The suite's plugin (tests/fixtures.py), one rule for the whole run (tests never write tracked files), and how
the run is split between pytest-xdist workers (`make test PYTEST_WORKERS=4`).

On a clean checkout (CI, `../shared/tools/fresh-clone-check`), `git status` must be as clean after the run as before
it: a test that rewrites a tracked file (a screenshot, a generated document) fails the run, naming the files.
Refresh such files on purpose (`make screenshots`, `make schema`).

Parallel runs: every test module is one unit of work (its module-scoped stacks and its tables of results stay in one
process; a long test that shares none of them is its own, `_OWN_UNIT`); the modules that use docker are units of
their own too, run side by side: their compose projects have names and ports of their own, the image build is done
once per machine at a time (tests/deploy/conftest.py takes a lock around it: the second worker finds it cached), and
the one stack that takes dockerd's realtime budget (the hand profile) holds the realtime lock below. The modules that
run realtime processes on the host are one unit (`_uses_realtime`). xdist's controller hands out whole units
(`unit_of`, a scheduler of our own on xdist's loadscope: it sees only test ids). Each worker has its own session
broker on a free port. Units start longest first (`_LONG_FIRST`, measured), so that no long one is left to the end.
`-n0` runs everything in one
process, in the usual order."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.fixtures"]
REPO = Path(__file__).resolve().parent.parent
_CLEAN_AT_START: list[bool] = []

# Units of work that take longest, longest first (from `--durations=0` of a parallel run): started first so the
# run does not end waiting on one of them. A unit not listed starts after these, in file order. The clustered centre
# is the longest (three ejabberd nodes joining, two sites bridged to them).
_LONG_FIRST = (
    "tests/deploy/test_cluster.py",
    "realtime",
    "tests/chaos/test_chaos.py",
    "tests/deploy/test_fleet.py",
    "tests/deploy/test_compose_sim.py",
    "tests/chaos/test_chaos.py::test_network_partition",
    "tests/dashboard/test_browser.py",
    "tests/contract/test_generic_tools.py",
    "tests/contract/test_codegen.py",
    "tests/dashboard/test_stop_button.py",
)
# Modules whose tests are independent of each other between the values of their first parameter (a module-scoped
# fixture per value, no table shared between values), long enough to be worth spreading: each value is its own unit.
# The value is the test id's part before its last "-" (`test_fault[roi-modules-absent]`: roi-modules).
_SPLIT_BY_PARAM = {"tests/conformance/test_conformance.py"}
# Long tests that use none of their module's module-scoped fixtures (their own stack, brokers, namespaces): each its
# own unit, so that the rest of its module and it can run in two workers at once.
_OWN_UNIT = frozenset({"tests/chaos/test_chaos.py::test_network_partition"})
# The modules that use docker (a test or fixture of theirs takes `docker_ready`, `images` or `compose_ok`): each a
# unit of its own, like tests/deploy's host-only modules (brokers on the host, no container).
_DOCKER_FIXTURE = re.compile(r"def \w+\([^)]*\b(docker_ready|images|compose_ok)\b", re.S)


# The modules that run realtime processes (the virtual hand at SCHED_FIFO 60, the EtherCAT cycle at 80, both
# polling): one unit, so that two of them never run at once. On two cores, one module's busy cycle starves the
# other's hand past SOEM's timeouts (no slave answers at the scan), which no user's host with one hand sees.
_REALTIME = re.compile(
    r"^from tests\.ethercat_loop\.wire_fixtures import|VethNetns\(|start_hand\(|rt_priority|--rt-priority", re.M)


def _source(module: str) -> str:
    try:
        return (REPO / module).read_text()
    except OSError:
        return ""


@functools.cache
def _uses_docker(module: str) -> bool:
    return bool(_DOCKER_FIXTURE.search(_source(module)))


@functools.cache
def _uses_realtime(module: str) -> bool:
    return bool(_REALTIME.search(_source(module)))


def unit_of(nodeid: str) -> str:
    """The unit of work of a test, from its id alone (xdist's controller sees only ids): see the module's
    docstring."""
    if nodeid in _OWN_UNIT:
        return nodeid
    module, _, rest = nodeid.partition("::")
    if _uses_realtime(module):
        return "realtime"
    if module in _SPLIT_BY_PARAM and rest.endswith("]") and "[" in rest:
        value = rest[rest.index("[") + 1:-1].rsplit("-", 1)[0]
        return f"{module}::{value}"
    return module


# The realtime unit and the realtime container (tests/deploy/test_realtime_container.py: the hand profile's cycle
# and virtual hand in a compose stack, with dockerd's realtime budget) run in two workers at once. At SCHED_FIFO on
# two cores they starve each other (frames lost, "no EtherCAT slave answers"). So each such module holds one lock on
# the machine for its whole life: its module-scoped nodes and hands run across its tests, and
# would go on running while another module's test held a lock taken per test. The other tests go on beside them.
_REALTIME_LOCK = Path(tempfile.gettempdir()) / "robobus-tests-realtime.lock"
_REALTIME_CONTAINER = frozenset({"tests/deploy/test_realtime_container.py"})


@contextlib.contextmanager
def _realtime_alone(lock: Path = _REALTIME_LOCK) -> Iterator[None]:
    with open(lock, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _holds_realtime_lock(module: str) -> bool:
    return _uses_realtime(module) or module in _REALTIME_CONTAINER


@pytest.fixture(scope="module", autouse=True)
def _realtime_module_alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that runs realtime processes holds the realtime lock from before its first fixture to after its
    last teardown (an autouse fixture of module scope: set up first, torn down last)."""
    if _holds_realtime_lock(Path(request.path).resolve().relative_to(REPO).as_posix()):
        with _realtime_alone():
            yield
    else:
        yield


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (loadscope's split by module and class)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's loadscope scheduler with our units as its scopes: each unit runs whole in one worker, units are
    handed out in collection order (`--no-loadscope-reorder`), which the workers sort longest first below."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # a serial run (-n0) or xdist's controller: the usual order

    def rank(item: pytest.Item) -> int:
        unit = unit_of(item.nodeid)
        return _LONG_FIRST.index(unit) if unit in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: file order within a rank, so each module keeps its own order


# Test modules whose asserts pytest rewrites (its import hook): every test module, every conftest.py, and the plugin
# modules of `pytest_plugins`. Folders pytest does not collect from are skipped.
_PLUGIN_MODULES = ("tests/fixtures.py",)
_NOT_COLLECTED = {"node_modules", "__pycache__", "build", "dist"}


def _rewritten_sources(args: list[str]) -> list[Path]:
    """The modules whose asserts a run on `args` (its paths and test ids) rewrites."""
    out = {REPO / m for m in _PLUGIN_MODULES}
    for arg in args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path.is_file():
            out.add(path)
            out.update(p / "conftest.py" for p in path.parents
                       if p.is_relative_to(REPO) and (p / "conftest.py").exists())
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _NOT_COLLECTED]
            out.update(Path(folder) / f for f in files if f == "conftest.py" or re.fullmatch(r"test_.*\.py", f))
    return sorted(out)


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or the one process of a serial run) compiles the repository's modules (`_compile_sources`).
    A parallel run also rewrites the asserts of its test modules once, here, before its workers start, into pytest's
    cache of rewritten modules (`__pycache__/*-pytest-*.pyc`, ignored by git), where each worker then finds them:
    otherwise every worker rewrites every module it collects (it collects them all), 7 s of CPU each on this
    machine, since pytest writes no such file under PYTHONDONTWRITEBYTECODE, and workers that start together
    rewrite the same modules side by side anyway. Best effort, through pytest's own functions (private ones): if they
    change, the workers rewrite as before."""
    if hasattr(config, "workerinput"):
        return
    _compile_sources()
    if not getattr(config.option, "numprocesses", None):
        return  # a run in one process: it rewrites each module once anyway
    with contextlib.suppress(Exception):
        _rewrite_once(config)


# The packages every test process and every process a test starts (nodes, simulators, the CLI: hundreds in a run)
# import: compiled once here, before any of them starts. Under PYTHONDONTWRITEBYTECODE (set in this machine's
# sessions) no process writes a .pyc, so each compiled every module it imported, each time it started.
_COMPILED = ("shared", "services", "tests")


def _compile_sources() -> None:
    import compileall

    for top in _COMPILED:
        for folder, dirs, files in os.walk(REPO / top):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _NOT_COLLECTED]
            for f in files:
                if f.endswith(".py"):  # compile_file skips a module whose .pyc is current
                    compileall.compile_file(os.path.join(folder, f), quiet=2)


def _rewrite_once(config: pytest.Config) -> None:
    from _pytest.assertion import rewrite

    if config.getoption("assertmode") != "rewrite":
        return
    state = config.stash[rewrite.assertstate_key]
    for source in _rewritten_sources(config.args):
        pyc = rewrite.get_cache_dir(source) / (source.name[:-3] + rewrite.PYC_TAIL)
        if rewrite._read_pyc(source, pyc) is not None:
            continue  # cached by an earlier run, still current
        if not rewrite.try_makedirs(pyc.parent):
            return  # a read-only checkout: the workers rewrite in memory, as before
        source_hash, code = rewrite._rewrite_test(source, config)
        rewrite._write_pyc(state, code, source_hash, pyc)


def _status() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    _CLEAN_AT_START.append(_status() == "")


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    if not _CLEAN_AT_START or not _CLEAN_AT_START[0] or hasattr(session.config, "workerinput"):
        return  # a working tree with changes of its own: nothing to compare with
    after = _status()
    if after:
        session.config.get_terminal_writer().line(
            "tests rewrote tracked files (a test must write to a temporary directory):\n" + after, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """`make test` sets ROBOBUS_TEST_T0 once its setup is done: its wall time, lint (beside the tests) included."""
    t0 = os.environ.get("ROBOBUS_TEST_T0")
    if not t0 or hasattr(config, "workerinput"):
        return
    try:
        wall = time.time() - float(t0)
    except ValueError:
        return
    workers = getattr(config.option, "numprocesses", None) or 0
    whole = round(wall)  # one rounding for both forms (419.6 s: "420 s (7 min 00 s)", not "6 min 60 s")
    terminalreporter.write_line(f"make test: {whole} s wall ({whole // 60} min {whole % 60:02d} s) after "
                                f"setup, lint beside; pytest in {workers or 'one'} process{'es' if workers else ''}; "
                                f"{suite_verdict(wall)}")


SUITE_TARGET_S = 420.0  # `make test` after setup, on a quiet 2-core machine


def suite_verdict(wall: float) -> str:
    """The wall time against its target, as the benchmarks print theirs."""
    ratio = wall / SUITE_TARGET_S
    return (f"target <= {SUITE_TARGET_S:.0f} s on a quiet 2-core machine: ratio {ratio:.2f}, "
            f"{'met' if ratio <= 1 else 'not met'} (cores here: {os.cpu_count()})")
