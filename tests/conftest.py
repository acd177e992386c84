"""The suite's plugin (tests/fixtures.py), one rule for the whole run (tests never write tracked files), and how
the run is split between pytest-xdist workers (`make test` runs `-n 3 --dist loadgroup`).

On a clean checkout (CI, `../shared/tools/fresh-clone-check`), `git status` must be as clean after the run as before
it: a test that rewrites a tracked file (a screenshot, a generated document) fails the run, naming the files.
Refresh such files on purpose (`make screenshots`, `make schema`).

Parallel runs: every test module is one unit of work (its module-scoped stacks and its tables of results stay in one
process); the tests that use docker (`docker_ready`: one image build per run, compose projects) are one unit
together; a test may name its own unit with `@pytest.mark.xdist_group("name")`. Each worker has its own
session broker on a free port. Units start longest first (`_LONG_FIRST`, measured), so that no long one is
left to the end. `-n0` runs everything in one process, in the usual order."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.fixtures"]
REPO = Path(__file__).resolve().parent.parent
_CLEAN_AT_START: list[bool] = []

# Units of work that take longest, longest first (from `--durations=0` of a parallel run): started first so the
# run does not end waiting on one of them. A unit not listed starts after these, in file order. The docker unit
# is the longest (image build, compose projects one after the other: every stack with ethercat-loop takes
# a share of dockerd's realtime budget, so two at once do not fit).
_LONG_FIRST = (
    "docker",
    "tests/chaos/test_chaos.py",
    "tests/dashboard/test_browser.py",
    "tests/contract/test_generic_tools.py",
    "tests/contract/test_codegen.py",
    "tests/dashboard/test_stop_button.py",
)
# Modules whose tests are independent of each other (no module-scoped fixture, no shared table), long enough
# to be worth spreading: each parameter of `stack` (or each test) is its own unit.
_SPLIT_BY_PARAM = {"tests/conformance/test_conformance.py": "stack"}


def _unit(item: pytest.Item) -> str:
    """The xdist group of a test: see the module's docstring."""
    if "docker_ready" in getattr(item, "fixturenames", ()):
        return "docker"
    module = item.nodeid.split("::", 1)[0]
    param = _SPLIT_BY_PARAM.get(module)
    callspec = getattr(item, "callspec", None)
    if param and callspec is not None and param in callspec.params:
        return f"{module}::{callspec.params[param]}"
    return module


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # a serial run (-n0) or xdist's controller: nothing to group
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_unit(item)))

    def rank(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = str(mark.args[0] if mark and mark.args else mark.kwargs.get("name", "") if mark else "")
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: file order within a rank, so each module keeps its own order


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
    """`make test` sets ROBOBUS_TEST_T0 as it starts: its wall time, setup and lint included."""
    t0 = os.environ.get("ROBOBUS_TEST_T0")
    if not t0 or hasattr(config, "workerinput"):
        return
    try:
        wall = time.time() - float(t0)
    except ValueError:
        return
    workers = getattr(config.option, "numprocesses", None) or 0
    terminalreporter.write_line(f"make test: {wall:.0f} s wall ({int(wall // 60)} min {wall % 60:02.0f} s), setup and "
                                f"lint included; pytest in {workers or 'one'} process{'es' if workers else ''}")
