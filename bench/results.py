"""What every bench does last: print its judged figures (value, target, ratio, met / not met), save its
result as JSON with the command and the machine it ran on, and print that JSON as its last line.

    from results import Figure, report
    report("epuck", result, [Figure("gateway CPU, 20 robots", cpu, "% of a core", "<=", 30.0)], variant="quick")

The file is `<dir>/<bench>[-<variant>].json`, `<dir>` being `$ROBOBUS_BENCH_RESULTS` or, unset, `build/bench/`
(untracked): a bench run by hand or by a test never rewrites a tracked file. `make bench` sets it to
`bench/results/`, the committed results (the last measured run of each bench) that `bench/perf_table.py` renders
into docs/performance.md and README.md's Performance table.

The machine's facts are taken when this module is imported, i.e. when the bench starts: the load average then
says how busy the machine was before the bench added its own load.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
ENV_DIR = "ROBOBUS_BENCH_RESULTS"
DEFAULT_DIR = REPO / "build" / "bench"
COMMITTED_DIR = REPO / "bench" / "results"

Op = Literal["<=", ">=", "=="]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_at_start() -> dict[str, Any]:
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"cores": os.cpu_count() or 0, "cpu": _cpu_model(), "load_avg_1_5_15_at_start": load,
            "kernel": platform.release(), "python": platform.python_version()}


MACHINE_AT_START = _machine_at_start()
STARTED_UTC = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Figure:
    """One measured figure; with `target` and `op` it is judged: `value op target`."""

    name: str
    value: float | None
    unit: str = ""
    op: Op | None = None
    target: float | None = None

    @property
    def ratio(self) -> float | None:
        """value / target (for `>=` too: above 1 is better there, below 1 better for `<=`)."""
        if self.value is None or self.target is None or self.target == 0:
            return None
        return round(self.value / self.target, 3)

    @property
    def met(self) -> bool | None:
        if self.op is None or self.target is None:
            return None
        if self.value is None:
            return False
        if self.op == "<=":
            return self.value <= self.target
        if self.op == ">=":
            return self.value >= self.target
        return self.value == self.target

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def fmt(x: float | None) -> str:
    """A figure as a person reads it: thousands separated, 3 significant digits below 1000."""
    if x is None:
        return "-"
    if x == int(x) and abs(x) >= 1:
        return f"{int(x):,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "not met")


def results_dir() -> Path:
    d = os.environ.get(ENV_DIR)
    return Path(d) if d else DEFAULT_DIR


def variant_name(*parts: str | None) -> str:
    """The variant of a run from its non-default options, e.g. variant_name("quick", "robots50")."""
    return "-".join(p for p in parts if p)


def command_line(argv: list[str] | None = None) -> str:
    """The command that produced the result, as one would type it from the repository's root."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve() if args else Path("?")
    try:
        args[0] = str(script.relative_to(REPO))
    except ValueError:
        pass
    return shlex.join(["python", *args])


def report(bench: str, result: dict[str, Any], figures: list[Figure], *, variant: str = "",
           argv: list[str] | None = None) -> Path:
    """Print the judged figures, write `<dir>/<bench>[-<variant>].json`, print the JSON as the last line.
    The bench's own `result` is kept whole under "result"."""
    judged = [f for f in figures if f.met is not None]
    print(f"{bench}{' (' + variant + ')' if variant else ''}: figures against their targets")
    for f in figures:
        tgt = f"{f.op} {fmt(f.target)}" if f.op else ""
        ratio = f"ratio {f.ratio:.2f}" if f.ratio is not None and f.op else ""
        print(f"  {f.name:<58} {fmt(f.value):>10} {f.unit:<12} {tgt:>10} {ratio:>11} {verdict(f.met)}")
    if judged:
        n_met = sum(1 for f in judged if f.met)
        print(f"  {n_met} of {len(judged)} targets met")
    doc = {"bench": bench, "variant": variant, "command": command_line(argv), "started_utc": STARTED_UTC,
           "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": MACHINE_AT_START,
           "figures": [f.as_dict() for f in figures], "all_met": all(f.met for f in judged) if judged else None,
           "result": result}
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bench}{'-' + variant if variant else ''}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
    print(f"result written to {path}", file=sys.stderr)
    print(json.dumps(result, default=str))
    return path
