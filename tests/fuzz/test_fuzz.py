"""Every binary decoder under atheris (coverage-guided) for a short run: zero uncaught exceptions. The long run
is documented in the README (`python -m tests.fuzz TARGET -max_total_time=600`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.targets import fuzz_names, targets, uncovered_services

REPO = Path(__file__).resolve().parents[2]
RUNS = 20000

try:
    import atheris  # noqa: F401

    MISSING = ""
except ImportError as exc:  # pragma: no cover - make test installs it
    MISSING = f"atheris is not installed ({exc}); `make test` installs it"


@pytest.mark.parametrize("name", sorted(targets()))
def test_decoder_survives_fuzzing(name: str, tmp_path: Path) -> None:
    if MISSING:
        pytest.skip(MISSING)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(targets()[name].seeds()):
        (corpus / f"seed{i}").write_bytes(seed)
    r = subprocess.run([sys.executable, "-m", "tests.fuzz", name, f"-runs={RUNS}", "-max_len=4096", "-seed=1",
                        str(corpus)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"Done {RUNS} runs" in r.stderr, r.stderr[-2000:]


def test_every_registered_service_has_its_decoders_fuzzed() -> None:
    missing = uncovered_services()
    assert not missing, (f"no fuzz target exercises {missing}: declare the decoders of device bytes in the "
                         "service's protocol module, FUZZ = {'<service>_<what>': decoder} and FUZZ_ALLOWED = "
                         "(its own errors,) (tests/fuzz/targets.py)")


def test_a_fuzz_declaration_is_read_from_the_source(tmp_path: Path) -> None:
    src = tmp_path / "protocol.py"
    src.write_text("import x\nFUZZ = {'a_lines': decode, 'a_frames': frames}\nFUZZ_ALLOWED = (Err,)\n")
    assert fuzz_names(src) == ["a_lines", "a_frames"]
    src.write_text("FUZZ: dict = {'b': f}\n")
    assert fuzz_names(src) == ["b"]
    src.write_text("DECODERS = {}\n")
    assert fuzz_names(src) == []
    src.write_text("FUZZ = dict(a=f)\n")
    with pytest.raises(ValueError, match="dict literal"):
        fuzz_names(src)
