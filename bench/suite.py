"""The test suite's own speed: `make test` on a fresh clone of the committed tree, as CI runs it (no standard input,
`CI=true`), its wall time after setup against the target.

The clone's setup (`make setup`: the venv, node packages, apt packages already present) runs first and is not
timed; then `make test` (setup again, a no-op, then lint beside pytest in four processes), whose own last lines say
its wall time after setup; this bench reads that line and pytest's tally. The clone is removed afterwards; docker's
image cache is shared with the host, as on any machine that ran the suite before.

    python bench/suite.py [--runs 1] [--here] [--keep-log DIR]

`--here` runs `make test` in this working tree instead (uncommitted changes included). Target: <= 420 s after setup
on a quiet 2-core machine (`make test`'s own line says the same), every test green. With several runs the worst is
judged. Prints each run, the figures with their ratio to the targets and met / not met; last line: one JSON object.
Not among `make bench`'s default benches (it is the whole suite): `make bench BENCHES=suite` runs it alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from results import Figure, report, variant_name  # noqa: E402

from tests.conftest import SUITE_TARGET_S  # noqa: E402  (the target make test's own line judges)

WALL = re.compile(r"^make test: (\d+) s wall .* pytest in (\S+) process", re.M)
TALLY = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")


@dataclass
class Run:
    wall_after_setup_s: float | None  # make test's own line (None: it never printed it)
    total_s: float                    # make test, setup included (a no-op after the untimed setup)
    setup_s: float                    # the untimed `make setup` of a fresh clone
    rc: int
    passed: int
    failed: int
    skipped: int
    errors: int
    workers: str
    log: str


def parse(out: str, rc: int, total_s: float, setup_s: float, log: str) -> Run:
    """make test's wall line and pytest's last tally."""
    m = WALL.search(out)
    summary = next((line for line in reversed(out.splitlines()) if TALLY.search(line) and " in " in line), "")
    counts = {k: int(n) for n, k in TALLY.findall(summary)}
    return Run(float(m.group(1)) if m else None, round(total_s, 1), round(setup_s, 1), rc, counts.get("passed", 0),
               counts.get("failed", 0), counts.get("skipped", 0), counts.get("error", 0) + counts.get("errors", 0),
               m.group(2) if m else "?", log)


def _make(args: list[str], cwd: Path, log: Path) -> tuple[int, str, float]:
    env = {**os.environ, "CI": "true"}
    env.pop("ROBOBUS_BENCH_RESULTS", None)  # a bench's own setting, not the suite's
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(["make", "-s", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    return rc, log.read_text(errors="replace"), time.monotonic() - t0


def one_run(here: bool, logs: Path, n: int) -> Run:
    if here:
        rc, out, total = _make(["test"], REPO, logs / f"suite-{n}.log")
        return parse(out, rc, total, 0.0, str(logs / f"suite-{n}.log"))
    work = Path(tempfile.mkdtemp(prefix="robobus-suite-"))
    try:
        clone = work / "robobus"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
        src = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", "--detach", src.strip()], check=True)
        rc, out, setup_s = _make(["setup"], clone, logs / f"suite-{n}-setup.log")
        if rc != 0:
            return parse(out, rc, 0.0, setup_s, str(logs / f"suite-{n}-setup.log"))
        rc, out, total = _make(["test"], clone, logs / f"suite-{n}.log")
        return parse(out, rc, total, setup_s, str(logs / f"suite-{n}.log"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--here", action="store_true", help="run in this working tree, not a fresh clone of HEAD")
    ap.add_argument("--keep-log", type=Path, default=None, help="where the runs' logs go (default: a temp dir)")
    a = ap.parse_args()
    if not a.here and subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True).stdout:
        print("suite: the working tree has uncommitted changes; the clone runs the committed tree (HEAD)")
    logs = a.keep_log or Path(tempfile.mkdtemp(prefix="robobus-suite-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for n in range(1, a.runs + 1):
        r = one_run(a.here, logs, n)
        runs.append(r)
        print(f"run {n}: make test {'green' if r.rc == 0 else 'RED'}, "
              f"{r.wall_after_setup_s if r.wall_after_setup_s is not None else '?'} s after setup "
              f"({r.total_s} s with its setup check; the clone's setup {r.setup_s} s); {r.passed} passed, "
              f"{r.failed} failed, {r.errors} errors, {r.skipped} skipped; pytest in {r.workers} processes; "
              f"log {r.log}", flush=True)
    walls = [r.wall_after_setup_s for r in runs]
    worst = None if any(w is None for w in walls) else max(w for w in walls if w is not None)
    red = sum(1 for r in runs if r.rc != 0)
    figures = [
        Figure(f"`make test` wall after setup{', worst of ' + str(len(runs)) + ' runs' if len(runs) > 1 else ''}",
               worst, "s", "<=", SUITE_TARGET_S),
        Figure("runs not green (a failed test, error or lint)", float(red), "", "==", 0.0),
        Figure("tests passed, fewest of the runs", float(min(r.passed for r in runs)), ""),
        Figure("tests skipped, most of the runs", float(max(r.skipped for r in runs)), ""),
    ]
    result: dict[str, Any] = {"runs": [r.__dict__ for r in runs], "fresh_clone": not a.here}
    report("suite", result, figures, variant=variant_name("here" if a.here else None,
                                                          f"runs{a.runs}" if a.runs > 1 else None))
    return 0 if worst is not None and worst <= SUITE_TARGET_S and not red else 1


if __name__ == "__main__":
    sys.exit(main())
