"""The suite's plugin (tests/fixtures.py), and one rule for the whole run: tests never write tracked files.

On a clean checkout (CI, `../shared/tools/fresh-clone-check`), `git status` must be as clean after the run as before
it: a test that rewrites a tracked file (a screenshot, a generated document) fails the run, naming the files.
Refresh such files on purpose (`make screenshots`, `make schema`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.fixtures"]
REPO = Path(__file__).resolve().parent.parent
_CLEAN_AT_START: list[bool] = []


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
