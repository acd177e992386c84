"""bench/suite.py reads `make test`'s own wall line and pytest's tally (the run itself is the bench: not here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import suite

from tests.conftest import suite_verdict

GREEN = """\
..........
make test: 389 s wall (6 min 29 s) after setup, lint beside; pytest in 4 processes; """ + suite_verdict(389) + """
================= 1268 passed, 8 skipped in 388.94s (0:06:28) ==================
== make lint (beside the tests)
Success: no issues found in 163 source files
"""

RED = """\
FAILED tests/x.py::test_y - AssertionError
make test: 473 s wall (7 min 53 s) after setup, lint beside; pytest in 4 processes; """ + suite_verdict(473) + """
============ 2 failed, 1263 passed, 8 skipped, 1 error in 473.59s (0:07:53) =============
"""


def test_the_wall_line_and_the_tally_are_read() -> None:
    r = suite.parse(GREEN, 0, 400.0, 60.0, "log")
    assert (r.wall_after_setup_s, r.passed, r.failed, r.skipped, r.errors, r.workers) == (389.0, 1268, 0, 8, 0, "4")
    r = suite.parse(RED, 2, 480.0, 60.0, "log")
    assert (r.wall_after_setup_s, r.passed, r.failed, r.skipped, r.errors) == (473.0, 1263, 2, 8, 1)


def test_a_run_that_never_printed_its_wall_line_has_none() -> None:
    r = suite.parse("make: *** [Makefile:40: setup] Error 2\n", 2, 3.0, 0.0, "log")
    assert r.wall_after_setup_s is None and r.passed == 0

