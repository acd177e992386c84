"""`make run`'s supervisor (deploy/dev/supervise.py) on a Procfile of plain commands: its restart policy (a
process that keeps dying quickly is started again after a growing back-off, then given up on, while the rest
runs on; a process that ran long enough is started again at once; a one-shot runs once), and its shape (one
process of the standard library, the parent of every program, each in a process group of its own)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from shared.tools.localbroker import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SUPERVISE = REPO / "deploy" / "dev" / "supervise.py"
DEADLINE_S = 60.0  # generous for a busy machine: each wait below takes a few seconds on a quiet one
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) supervise: (.*)$")


class Supervised:
    def __init__(self, tmp: Path, procfile: str, *args: str) -> None:
        (tmp / "Procfile").write_text(procfile)
        self.log = tmp / "supervise.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-S", str(SUPERVISE), "--procfile", str(tmp / "Procfile"),
                                          "--rundir", str(tmp / "run"), *args], cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def lines(self) -> list[tuple[float, str]]:
        """(time, message) of each of the supervisor's own lines."""
        out = []
        for line in self.log.read_text().splitlines():
            m = _STAMP.match(line)
            if m:
                out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(2)))
        return out

    def said(self, prefix: str) -> list[float]:
        return [t for t, msg in self.lines() if msg.startswith(prefix)]

    def wait_for(self, what: str, cond: Callable[[], object]) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < DEADLINE_S:
            if cond():
                return
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"not within {DEADLINE_S} s: {what}\n{self.log.read_text()}")

    def children(self) -> dict[int, str]:
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        return {int(p): a for p, a in (ln.strip().split(None, 1) for ln in out.splitlines() if ln.strip())}

    def close(self) -> None:
        children = list(self.children()) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


Start = Callable[..., Supervised]


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Start]:
    started: list[Supervised] = []

    def start(procfile: str, *args: str) -> Supervised:
        started.append(Supervised(tmp_path, procfile, *args))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.close()


def test_quick_deaths_back_off_then_the_supervisor_gives_up_and_the_rest_runs_on(supervise: Start) -> None:
    s = supervise("good: sleep 300\nflaky: false\nbanner: echo where to look\n", "--startretries", "2")
    s.wait_for("flaky given up", lambda: s.said("gave up: flaky entered FATAL state"))
    good = [p for p, a in s.children().items() if a == "sleep 300"]
    spawns = s.said("spawned: 'flaky'")
    assert len(spawns) == 3, s.log.read_text()  # the first start and two retries
    # the back-off grows by a second a try (lower bounds: a busy machine only lengthens them)
    assert spawns[1] - spawns[0] >= 1.0 and spawns[2] - spawns[1] >= 2.0, spawns
    # the one-shot ran once, said so, and was not started again; the good process was never touched
    assert len(s.said("spawned: 'banner'")) == 1 and len(s.said("exited: banner (exit status 0; expected)")) == 1
    assert "where to look" in s.log.read_text()
    assert len(s.said("spawned: 'good'")) == 1 and len(good) == 1
    time.sleep(3.5)  # past flaky's next back-off, were it still retried
    assert len(s.said("spawned: 'flaky'")) == 3 and s.proc.poll() is None
    assert [p for p, a in s.children().items() if a == "sleep 300"] == good


def test_a_process_that_ran_long_enough_is_started_again_at_once(supervise: Start) -> None:
    # a node's start counts as good after 3 s: each death after a good run restarts it, never giving up
    s = supervise("steady: sleep 3.5\n", "--startretries", "0")
    s.wait_for("three starts", lambda: len(s.said("spawned: 'steady'")) >= 3)
    assert not s.said("gave up"), s.log.read_text()


def test_one_process_of_the_standard_library_parent_of_every_program(supervise: Start) -> None:
    s = supervise("a: sleep 300\nb: X=1 sleep 301\n")
    # (a program shows the supervisor's command line for the moment between its spawn and its exec)
    s.wait_for("both running", lambda: sorted(s.children().values()) == ["sleep 300", "sleep 301"])
    # the supervisor is this very process (no exec of another supervisor), its programs its own children,
    # exec'd by bash (the pid is the program's), each in a process group of its own
    argv = Path(f"/proc/{s.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert argv[2].endswith(b"deploy/dev/supervise.py"), argv
    assert sorted(s.children().values()) == ["sleep 300", "sleep 301"]
    for pid in s.children():
        assert os.getpgid(pid) == pid
        # with SIGPIPE at its default, as any shell starts a program (Python itself ignores it)
        ignored = int(next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if ln.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1)), hex(ignored)
    # what it imports: the standard library's lighter parts, nothing of a supervisor package
    probe = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('supervise', {str(SUPERVISE)!r})\n"
             "module = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(module)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "{'supervisor', 'subprocess', 'pathlib', 'dataclasses', 'xmlrpc', 'http'}))\n")
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # Ctrl-C: both stopped, the supervisor exits 0
    pids = list(s.children())
    os.killpg(s.proc.pid, signal.SIGINT)
    assert s.proc.wait(60) == 0, s.log.read_text()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
