"""The performance figures are rendered, never copied: bench/results.py writes each bench's result as JSON,
bench/perf_table.py renders docs/performance.md and README.md's Performance table from bench/results/, and the
committed documents are what the committed results render."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import perf_table
from bench.results import Figure, report, results_dir

REPO = Path(__file__).resolve().parents[2]


def test_readme_and_performance_doc_are_what_the_committed_results_render(capsys: pytest.CaptureFixture[str]) -> None:
    assert list((REPO / "bench" / "results").glob("*.json")), "no committed bench result"
    rc = perf_table.main(["--check"])
    assert rc == 0, f"a figure in README.md or docs/performance.md is not the rendered one:\n{capsys.readouterr().out}"


def test_a_figure_is_judged_against_its_target() -> None:
    assert Figure("cpu", 20.0, "%", "<=", 25.0).met is True
    assert Figure("cpu", 30.0, "%", "<=", 25.0).met is False
    assert Figure("cpu", 30.0, "%", "<=", 25.0).ratio == 1.2
    assert Figure("rate", 30_000, "/s", ">=", 20_000).met is True
    assert Figure("rate", 10_000, "/s", ">=", 20_000).met is False
    assert Figure("dropped", 0, "", "<=", 0).met is True and Figure("dropped", 0, "", "<=", 0).ratio is None
    assert Figure("not measured", None, "ms", "<=", 5.0).met is False  # a missing figure never passes
    assert Figure("informative", 3.0, "ms").met is None


def test_report_writes_the_figures_the_command_and_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ROBOBUS_BENCH_RESULTS", str(tmp_path))
    path = report("demo", {"p99_ms": 7.5}, [Figure("round trip p99", 7.5, "ms", "<=", 5.0),
                                            Figure("rate", 30_000, "/s", ">=", 25_000)],
                  variant="quick", argv=[str(REPO / "bench" / "demo.py"), "--quick"])
    assert path == tmp_path / "demo-quick.json"
    doc = json.loads(path.read_text())
    assert doc["command"] == "python bench/demo.py --quick"
    assert doc["machine"]["cores"] == os.cpu_count()
    assert len(doc["machine"]["load_avg_1_5_15_at_start"]) == 3
    assert [(f["name"], f["ratio"], f["met"]) for f in doc["figures"]] == [("round trip p99", 1.5, False),
                                                                          ("rate", 1.2, True)]
    assert doc["all_met"] is False and doc["result"] == {"p99_ms": 7.5}
    out = capsys.readouterr().out.splitlines()
    assert any("round trip p99" in line and "not met" in line and "ratio 1.50" in line for line in out)
    assert json.loads(out[-1]) == {"p99_ms": 7.5}  # the bench's JSON stays its last line


def test_a_bench_run_by_hand_writes_no_tracked_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROBOBUS_BENCH_RESULTS", raising=False)
    d = results_dir()
    assert d == REPO / "build" / "bench"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(d / "epuck-quick.json")], cwd=REPO)
    assert ignored.returncode == 0, "build/bench/ must be ignored by git"


def _result(bench: str, variant: str, cmd: str, figures: list[Figure], load: list[float]) -> dict[str, object]:
    return {"bench": bench, "variant": variant, "command": cmd,
            "machine": {"cores": 2, "cpu": "test cpu", "load_avg_1_5_15_at_start": load},
            "figures": [f.as_dict() for f in figures], "result": {}}


def test_the_table_is_rendered_from_the_results_and_a_hand_edit_is_caught(tmp_path: Path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    (res / "roi-quick.json").write_text(json.dumps(_result(
        "roi", "quick", "python bench/roi.py --quick",
        [Figure("service CPU, 50 modules", 13.8, "% of a core", "<=", 25.0),
         Figure("command round trip p99", 6.2, "ms", "<=", 5.0),
         Figure("commands failed", 0, "", "<=", 0),
         Figure("under loss p99", 9.0, "ms")], [0.5, 0.4, 0.3])))
    (res / "rpc.json").write_text(json.dumps(_result(
        "rpc", "", "python bench/rpc.py", [Figure("validated messages", 33_700, "/s", ">=", 25_000)],
        [1.25, 1.0, 0.75])))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\nintro\n\n{perf_table.BEGIN}\n| old | 1 |\n{perf_table.END}\nafter\n")
    doc = tmp_path / "performance.md"
    args = ["--results", str(res), "--doc", str(doc), "--readme", str(readme)]

    assert perf_table.main([*args, "--check"]) == 1  # the hand-written table is not what the results render
    assert perf_table.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n## Performance\n\nintro\n\n") and text.endswith(f"{perf_table.END}\nafter\n")
    assert "| old |" not in text
    rows = text.split(perf_table.BEGIN)[1].split(perf_table.END)[0].strip().splitlines()
    assert rows[2] == "| `bench/rpc.py` | validated messages | 33,700 /s | ≥ 25,000 /s | 1.35 | met |"
    assert rows[3] == ("| `bench/roi.py --quick` | service CPU, 50 modules; command round trip p99 | "
                       "13.8 % of a core; 6.2 ms | ≤ 25 % of a core; ≤ 5 ms | 0.55; 1.24 | met; not met "
                       "(2 of 3 met) |")
    d = doc.read_text()
    assert "- machine: 2 cores (test cpu)\n" in d and "load" not in d  # the docs carry no load averages
    assert "| under loss p99 | 9 ms | - | - | - |" in d
    assert perf_table.main([*args, "--check"]) == 0

    readme.write_text(text.replace("13.8 % of a core", "12.0 % of a core"))  # a figure copied by hand
    assert perf_table.main([*args, "--check"]) == 1
    doc.write_text(d.replace("6.2 ms", "4.9 ms"))
    readme.write_text(text)
    assert perf_table.main([*args, "--check"]) == 1


def test_a_full_run_supersedes_the_quick_run_of_the_same_variant_in_the_readme() -> None:
    def run(variant: str, cmd: str) -> dict[str, object]:
        return {**_result("epuck", variant, cmd, [Figure("cpu", 20.0, "%", "<=", 30.0)], [1.0, 1.0, 1.0]),
                "_file": f"epuck-{variant}.json"}

    docs = [run("quick", "python bench/epuck.py --quick"), run("", "python bench/epuck.py"),
            run("quick-robots50", "python bench/epuck.py --quick --robots 50")]
    docs[1]["variant"] = ""
    rows = perf_table.readme_table(docs)[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| `bench/epuck.py`", "| `bench/epuck.py --quick --robots 50`"]
    assert "bench/epuck.py --quick`" in perf_table.render_doc(docs)  # the document keeps every run

