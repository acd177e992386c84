"""An independent MCAP implementation checks our files: `pymcap-cli doctor` (structure against the MCAP
specification) and `pymcap-cli recover` on a torn file. The official `mcap` CLI is a Go binary that is
not on PyPI or npm (and there is no Go toolchain here to build it); pymcap-cli is a PyPI package with its
own reader (small-mcap). Its dependencies are many, so `make setup` installs it in its own venv,
.venv-mcapcli (pinned in tests/record/mcapcli-requirements.txt); ROBOBUS_MCAP_CLI names another one, and
one on PATH is used otherwise. Without any, these tests skip (run `make setup`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.tools.replay import inspect
from tests.record.helpers import make_recording, pub

REPO = Path(__file__).resolve().parents[2]
VENV_CLI = REPO / ".venv-mcapcli" / "bin" / "pymcap-cli"
CLI = os.environ.get("ROBOBUS_MCAP_CLI") or (str(VENV_CLI) if VENV_CLI.exists() else shutil.which("pymcap-cli"))
pytestmark = pytest.mark.skipif(CLI is None, reason="pymcap-cli not installed: `make setup` puts it in .venv-mcapcli")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert CLI is not None
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def recording(path: Path, n: int = 3000) -> None:
    msgs = [(0.0, pub("robobus/epuck-gateway/status", '{"online": true}', retain=True)),
            (0.0, pub("robobus/epuck-gateway/e1/cmd/leds", "{}", props={"response_topic": "r/1",
                                                                          "correlation_data": b"x"})),
            (0.0, pub("robobus/epuck-gateway/e1/state/image", b"\xff\xd8\xff\xd9",
                      props={"content_type": "image/jpeg"}))]
    msgs += [(i * 0.001, pub("robobus/n/d/state/x", json.dumps({"i": i}))) for i in range(n)]
    make_recording(path, msgs, chunk_bytes=16 * 1024, document=None)


@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_doctor_accepts_our_files(tmp_path: Path, compression: str) -> None:
    path = tmp_path / f"{compression}.mcap"
    msgs = [(i * 0.001, pub("robobus/n/d/state/x", json.dumps({"i": i}))) for i in range(2000)]
    make_recording(path, msgs, compression=compression, chunk_bytes=8 * 1024)
    r = run("doctor", str(path), "--strict-message-order")
    assert r.returncode == 0, r.stdout + r.stderr


def test_doctor_accepts_a_file_with_properties_binary_and_retained(tmp_path: Path) -> None:
    path = tmp_path / "mixed.mcap"
    recording(path)
    r = run("doctor", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_their_recover_repairs_a_torn_file_we_then_read(tmp_path: Path) -> None:
    path = tmp_path / "a.mcap"
    recording(path)
    data = path.read_bytes()
    torn = tmp_path / "torn.mcap"
    torn.write_bytes(data[: len(data) * 2 // 3])
    fixed = tmp_path / "fixed.mcap"
    r = run("recover", str(torn), "-o", str(fixed))
    assert r.returncode in (0, 3) and fixed.exists(), r.stdout + r.stderr  # 3: some data was lost
    s = inspect(fixed)
    xs = next(c for c in s.channels if c.topic == "robobus/n/d/state/x")
    assert 0 < xs.count < 3000
