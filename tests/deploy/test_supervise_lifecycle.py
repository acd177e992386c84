"""`make run`'s supervisor (deploy/dev/supervise.py) on Procfiles of its own (sleepers and listeners on free
ports, no fixed port of `make run`): every program dies with a supervisor killed -9 (nothing left holding a
port for the next `make run`), a program whose supervisor died before it started does not run, and the
broker and the hand's node start at SCHED_FIFO where the host permits it, at normal priority with one clear log
line where it does not."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from shared.tools.localbroker import REPO, free_port

SUPERVISE = REPO / "deploy" / "dev" / "supervise.py"
DEADLINE_S = 30.0  # for what a busy host may delay (a start); the death bound below is the product's own
GONE_WITHIN_S = 2.0


def _supervise_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("robobus_supervise", SUPERVISE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listener(port: int) -> str:
    """A Procfile command that listens on 127.0.0.1:port until killed (a stand-in for the broker or dashboard)."""
    code = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
            "time.sleep(300)")
    return f"{sys.executable} -S -c {shlex.quote(code)}"


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def _alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped by whoever adopted it) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"not within {deadline_s} s: {what}")


class Supervised:
    def __init__(self, tmp: Path, procfile: str, *args: str, prefix: tuple[str, ...] = ()) -> None:
        (tmp / "Procfile").write_text(procfile)
        self.log = tmp / "supervise.log"
        self.names = [line.split(":", 1)[0] for line in procfile.splitlines() if line.strip()]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-S", str(SUPERVISE), "--procfile",
                                          str(tmp / "Procfile"), "--rundir", str(tmp / "run"), *args], cwd=REPO,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: set[int] = set()

    def text(self) -> str:
        return self.log.read_text()

    def children(self) -> dict[int, str]:
        """pid -> command line of the supervisor's children (once exec'd: not setpriv's or bash's)."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        kids = {int(p): a for p, a in (ln.strip().split(None, 1) for ln in out.splitlines() if ln.strip())}
        self.seen.update(kids)
        return kids

    def running(self) -> dict[str, int]:
        """name -> pid of each program, from the supervisor's own log, once every one of them has exec'd."""
        pids: dict[str, int] = {}
        for line in self.text().splitlines():
            if "spawned: '" in line:
                name = line.split("spawned: '", 1)[1].split("'", 1)[0]
                pids[name] = int(line.split(" with pid ", 1)[1].split()[0])
        # until its exec a program shows the supervisor's command line, then setpriv's, then bash's
        before_exec = ("/usr/bin/setpriv", "/bin/bash", f"{sys.executable} -S {SUPERVISE}")
        kids = self.children()
        if set(pids) != set(self.names) or any(kids.get(p, "").startswith(before_exec) for p in pids.values()):
            return {}
        return pids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.seen:  # whatever a failing test left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


Start = Callable[..., Supervised]


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Start]:
    started: list[Supervised] = []

    def start(procfile: str, *args: str, prefix: tuple[str, ...] = ()) -> Supervised:
        started.append(Supervised(tmp_path, procfile, *args, prefix=prefix))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.close()


def test_every_program_dies_with_a_supervisor_killed_9(supervise: Start) -> None:
    broker_port, dashboard_port = free_port(), free_port()
    s = supervise(f"broker: {_listener(broker_port)}\ndashboard: {_listener(dashboard_port)}\n"
                  "node-a: sleep 300\nnode-b: X=1 sleep 301\n")
    _wait(lambda: s.running() and _accepts(broker_port) and _accepts(dashboard_port), "every program running")
    pids = s.running()
    assert len(pids) == 4, s.text()
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    t0 = time.monotonic()
    while time.monotonic() - t0 < GONE_WITHIN_S and any(_alive(p) for p in pids.values()):
        time.sleep(0.02)
    left = {n: p for n, p in pids.items() if _alive(p)}
    assert not left, f"left running {GONE_WITHIN_S} s after the supervisor's kill -9: {left}\n{s.text()}"
    # nothing holds the ports any more: a next `make run` finds 1883 free
    assert not _accepts(broker_port) and not _accepts(dashboard_port)


def test_a_program_whose_supervisor_died_before_it_started_does_not_run(tmp_path: Path) -> None:
    """The parent-death signal is armed by setpriv in the child: a supervisor gone before that would never send
    it. The program's bash checks that its parent is still the supervisor that spawned it, else exits."""
    supervise = _supervise_module()
    sup = supervise.Supervisor({"node": f"touch {tmp_path / 'ran'}"}, cwd=str(tmp_path))
    sup.setpriv = supervise.find_setpriv()
    if sup.setpriv is None:
        pytest.skip("no setpriv with --pdeathsig on this host")
    argv = sup.argv(sup.programs[0])
    # started by its supervisor (this process, in whose name argv was built): it runs
    assert subprocess.run(argv, timeout=30).returncode == 0
    assert (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    # started with another parent (a shell in between: as if the supervisor had died and init adopted it)
    out = subprocess.run(["/bin/bash", "-c", f"{shlex.join(argv)} & wait $!; exit $?"], timeout=30)
    assert out.returncode == supervise.ORPHANED_EXIT
    assert not (tmp_path / "ran").exists()


def _fifo_permitted() -> str | None:
    try:
        subprocess.run(["chrt", "-f", "10", "true"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"SCHED_FIFO is not permitted here ({exc})"
    return None


def _policy(pid: int) -> tuple[int, int]:
    return os.sched_getscheduler(pid), os.sched_getparam(pid).sched_priority


REALTIME_PROCFILE = "broker: sleep 300\nethercat-loop: sleep 301\nepuck-gateway: sleep 302\n"
REALTIME_ARGS = ("--realtime", "broker=10", "--realtime", "ethercat-loop=10")


def test_the_broker_and_the_hands_node_start_at_sched_fifo_10(supervise: Start) -> None:
    why = _fifo_permitted()
    if why:
        pytest.skip(why)
    s = supervise(REALTIME_PROCFILE, *REALTIME_ARGS)
    _wait(s.running, "every program running")
    pids = s.running()
    assert _policy(pids["broker"]) == (os.SCHED_FIFO, 10), s.text()
    assert _policy(pids["ethercat-loop"]) == (os.SCHED_FIFO, 10), s.text()
    assert _policy(pids["epuck-gateway"]) == (os.SCHED_OTHER, 0), s.text()
    assert "spawned: 'broker' with pid" in s.text() and "at SCHED_FIFO 10" in s.text()
    # a restarted broker comes back at the same priority
    os.kill(pids["broker"], signal.SIGKILL)
    _wait(lambda: s.running().get("broker", pids["broker"]) != pids["broker"], "the broker started again")
    assert _policy(s.running()["broker"]) == (os.SCHED_FIFO, 10), s.text()


def test_a_host_that_refuses_realtime_is_told_and_every_program_runs(supervise: Start) -> None:
    if os.geteuid() == 0:
        # root without CAP_SYS_NICE and with RLIMIT_RTPRIO 0: what an ordinary user of a desktop has
        prefix: tuple[str, ...] = ("setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--",
                                   "prlimit", "--rtprio=0:0", "--")
    elif _fifo_permitted() is None:
        pytest.skip("SCHED_FIFO is permitted to this user: nothing to refuse")
    else:
        prefix = ()
    s = supervise(REALTIME_PROCFILE, *REALTIME_ARGS, prefix=prefix)
    _wait(s.running, "every program running")
    for name, pid in s.running().items():
        assert _policy(pid) == (os.SCHED_OTHER, 0), (name, s.text())
    refused = [ln for ln in s.text().splitlines() if "realtime refused" in ln]
    assert len(refused) == 1, s.text()
    assert "SCHED_FIFO 10 for 'broker' (Operation not permitted)" in refused[0]
    assert "normal priority" in refused[0]


def test_run_local_gives_every_service_node_the_priority() -> None:
    """make run's realtime list is derived from the tree: every service of services/ (a folder with an api.py)
    that the Procfile starts, and the broker; never a simulator or a tool. A service added later gets it too."""
    repo = Path(__file__).resolve().parents[2]
    services = sorted(p.parent.name.replace("_", "-") for p in (repo / "services").glob("*/api.py"))
    procfile = (repo / "deploy/Procfile.sim").read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("ROBOBUS_MQTT_URL", "ROBOBUS_RUN_RT_PRIORITY")}

    def realtime(**extra: str) -> list[str]:
        out = subprocess.run([str(repo / "deploy/dev/run-local.sh"), "--print-realtime"], env={**env, **extra},
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[-1].split()
        return [a for a in out if a != "--realtime"]

    # a broker named elsewhere (no local mosquitto): nothing is started or checked at 1883
    args = realtime(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1")
    assert sorted(args) == [f"{s}=10" for s in services if f"\n{s}:" in f"\n{procfile}"], args
    assert {"ethercat-loop=10", "roi-modules=10", "epuck-gateway=10", "dexter-gateway=10"} <= set(args)
    assert not any(a.split("=")[0].endswith("-sim") for a in args)
    assert realtime(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1", ROBOBUS_RUN_RT_PRIORITY="0") == []
    assert sorted(realtime(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1", ROBOBUS_RUN_RT_PRIORITY="20")) == sorted(
        a[:-2] + "20" for a in args)
