"""`make run`'s process supervisor: every process of deploy/Procfile.sim, watched by this one small process.

The Procfile stays the one list of `make run`'s processes (the chaos harness and the dashboard tests read it
too); this script starts each line, through bash (for `${VAR:-default}`), which execs the program, so the pid
watched and signalled is the program's own:

- a process that dies is started again: at once if it had run for `startsecs`, else after a back-off that grows
  by a second a try; after `STARTRETRIES` quick deaths in a row it gives up on it with one line
  ("gave up: NAME entered FATAL state ...") and everything else goes on running;
- a one-shot (the banner) runs once and is never started again;
- the broker is a process like any other: killed, it is started again and the nodes reconnect by themselves;
- Ctrl-C, SIGTERM or SIGHUP stops the nodes first (SIGTERM to each one's process group, SIGKILL after `STOP_WAIT_S`:
  their fail-safe hooks still reach the broker and publish `online: false, reason: shutdown`), then the broker,
  last; then it exits 0;
- every child runs in a process group of its own (a Ctrl-C in the terminal reaches this process alone, which
  stops the nodes before the broker) and writes to this process's stdout itself (no pipe, no copy);
- every child dies with this process, however it dies (`kill -9` included): the kernel's parent-death signal
  (PR_SET_PDEATHSIG, set by util-linux's `setpriv --pdeathsig` before bash starts) sends SIGKILL to each node
  and SIGTERM to the broker (which saves its database on the way out) the moment this process is gone, so no
  orphan keeps 1883 or 8080 and the next `make run` starts;
- `--user NAME=USER` (when this process is root) starts that program as USER: a program that gives up root
  itself (mosquitto becomes the user mosquitto) would lose its parent-death signal (the kernel clears it on a
  change of user), so it is started as that user already and has nothing to give up;
- `--realtime NAME=PRIO` starts that program at SCHED_FIFO PRIO (the broker and the hand's node: the demand
  path on a busy host, services/ethercat_loop/README.md "Priorities on a busy host"); where the host refuses
  it (no root or CAP_SYS_NICE, no RLIMIT_RTPRIO, no realtime budget for the cgroup) it logs why once and starts
  the program at normal priority.

Not supervisord: its XML-RPC server, supervisorctl's machinery and their imports hold ~25 MB resident that
`make run` never uses; this process is the standard library only (~12 MB, run with `python -S`).

Usage: supervise.py [--procfile FILE] [--rundir DIR] [--startretries N] [--realtime NAME=PRIO ...]
                    [--user NAME=USER ...] [NAME ...]
(no NAME: every process of the Procfile)
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import select
import signal
import sys
import time
from types import FrameType

# The standard library's lighter parts only (no subprocess, pathlib or dataclasses: ~3 MB resident between them)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
# `A=1 B=2 cmd`: bash keeps leading assignments in the exec'd command's environment, so the pid watched (and
# signalled) is the program's own, not a shell's
_ASSIGNMENTS = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S+)\s+)*)")
BROKER = "broker"
# processes that print once and exit: never restarted
ONE_SHOT = {"banner"}
# a node must stay up this long for its start to count as good (then a later death restarts it at once)
NODE_STARTSECS = 3.0
BROKER_STARTSECS = 1.0
# quick deaths in a row before the supervisor gives up on a process (back-off 1 s, 2 s, ... between them)
STARTRETRIES = 8
# a process asked to stop (SIGTERM) is killed (SIGKILL) after this
STOP_WAIT_S = 10.0
# Ctrl-C, `kill`, the terminal closed: each stops everything in order
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What a child gets when this process dies without stopping it (kill -9, a crash): the broker SIGTERM, on which
# mosquitto saves its database (the retained bus stop) and exits at once; every other program SIGKILL (a node
# that cannot reach this process's ordered stop must not linger: its broker goes too, its Will says offline)
PDEATHSIG_BROKER = "TERM"
PDEATHSIG_NODE = "KILL"
# bash, started by setpriv, runs the program only if this process is still its parent: had it died between the
# spawn and setpriv's prctl, the death signal would never come (the guard closes that window)
ORPHANED_EXIT = 111


def read_procfile(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        m = _LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def exec_line(command: str) -> str:
    """A Procfile line as bash runs it: its leading assignments, then `exec` the program."""
    return _ASSIGNMENTS.sub(r"\1exec ", command, count=1)


class Program:
    """One line of the Procfile and the state of its process."""

    def __init__(self, name: str, command: str, startsecs: float, one_shot: bool, rt_priority: int = 0,
                 user: str = "") -> None:
        self.name = name
        self.command = command
        self.rt_priority = rt_priority  # SCHED_FIFO priority to start it at (0: normal scheduling)
        self.user = user  # the user to start it as, when this process is root ("": this process's)
        self.startsecs = startsecs
        self.one_shot = one_shot
        self.pid: int | None = None  # the running process (its process group has the same id)
        self.status: int | None = None  # its exit status, once reaped
        self.started = 0.0
        self.quick_deaths = 0
        self.start_at = math.inf  # monotonic time of the next start; inf: none due
        self.fatal = False

    def poll(self) -> bool:
        """Whether the process has ended (then reaped, `status` set)."""
        if self.pid is None or self.status is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return False
        self.status = os.waitstatus_to_exitcode(status)
        return True


def log(message: str) -> None:
    now = time.time()
    try:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))},{int(now * 1000) % 1000:03d} supervise: "
              f"{message}", flush=True)
    except OSError:  # the terminal or pipe is gone: the processes are still to be watched and stopped
        pass


def find_setpriv() -> str | None:
    """util-linux's setpriv, if it knows --pdeathsig (2.33+): tried once on /bin/true."""
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/bin"]:
        path = os.path.join(folder or ".", "setpriv")
        if not os.access(path, os.X_OK):
            continue
        try:
            pid = os.posix_spawn(path, [path, "--pdeathsig", PDEATHSIG_NODE, "--", "/bin/true"], os.environ,
                                 file_actions=[(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)])
            _, status = os.waitpid(pid, 0)
        except OSError:
            continue
        if os.waitstatus_to_exitcode(status) == 0:
            return path
    return None


def _posix_spawn(argv: list[str], rt_priority: int) -> int:
    """A session (and process group) of its own; stdin /dev/null; stderr to this process's stdout; the
    supervisor's own descriptors (the wake-up pipe) are close-on-exec; the signals Python ignores (SIGPIPE,
    SIGXFSZ) back to their defaults, as subprocess does; SCHED_FIFO rt_priority from its first instruction (every
    thread it starts inherits it), or PermissionError. Called from this process's only thread: the parent-death
    signal follows the thread that forked, not the process."""
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 1, 2)]
    sigdef = (signal.SIGPIPE, signal.SIGXFSZ)
    if rt_priority:
        return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsid=True, setsigdef=sigdef,
                              scheduler=(os.SCHED_FIFO, os.sched_param(rt_priority)))
    return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsid=True, setsigdef=sigdef)


class Supervisor:
    def __init__(self, procs: dict[str, str], cwd: str = REPO, startretries: int = STARTRETRIES,
                 realtime: dict[str, int] | None = None, users: dict[str, str] | None = None) -> None:
        self.cwd = cwd
        self.startretries = startretries
        realtime, users = realtime or {}, users or {}
        # the broker first: started before the nodes, stopped after them
        names = sorted(procs, key=lambda n: n != BROKER)
        self.programs = [Program(n, procs[n], BROKER_STARTSECS if n == BROKER else NODE_STARTSECS, n in ONE_SHOT,
                                 realtime.get(n, 0), users.get(n, "")) for n in names]
        self.setpriv: str | None = None  # found in run(): None, the children would outlive a kill -9 of this process
        self.rt_refused = ""  # why SCHED_FIFO was refused, once it was: later starts do not ask again
        self.stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum in STOP_SIGNALS:
            self.stopping = True

    def argv(self, p: Program) -> list[str]:
        """bash running the program (exec'd: the pid is the program's), behind setpriv's parent-death signal."""
        # a program run as another user (the broker) may not be able to enter the checkout (a clone in a 0700
        # folder): it then runs in the folder it inherits, the supervisor's (deploy/dev/run-local.sh starts the
        # supervisor there, and gives such a program absolute paths)
        cd = f"cd {_shell_quote(self.cwd)} 2>/dev/null; " if p.user and os.geteuid() == 0 else \
            f"cd {_shell_quote(self.cwd)} && "
        script = cd + exec_line(p.command)
        if self.setpriv is None:
            return ["/bin/bash", "-c", script]
        sig = PDEATHSIG_BROKER if p.name == BROKER else PDEATHSIG_NODE
        guard = f'[ "$PPID" = {os.getpid()} ] || exit {ORPHANED_EXIT}; '
        # setpriv changes the user first, then arms the signal (which a change of user would clear)
        user = ["--reuid", p.user, "--regid", p.user, "--init-groups"] if p.user and os.geteuid() == 0 else []
        return [self.setpriv, *user, "--pdeathsig", sig, "--", "/bin/bash", "-c", guard + script]

    def spawn(self, p: Program) -> None:
        p.start_at = math.inf
        argv = self.argv(p)
        priority = 0 if self.rt_refused else p.rt_priority
        try:
            try:
                p.pid = _posix_spawn(argv, priority)
            except PermissionError as exc:
                if not priority or exc.errno != errno.EPERM:  # EACCES: the program, not the policy
                    raise
                self.rt_refused = exc.strerror or str(exc)
                log(f"realtime refused: SCHED_FIFO {priority} for {p.name!r} ({self.rt_refused}): it and every "
                    "other program run at normal priority (needs root or CAP_SYS_NICE, or an RLIMIT_RTPRIO of at "
                    "least the priority, and a realtime budget for this cgroup on RT-group kernels)")
                p.pid = _posix_spawn(argv, 0)
        except OSError as exc:  # no bash: counted as a quick death
            log(f"spawnerr: cannot start {p.name!r}: {exc}")
            self._died(p, uptime=0.0)
            return
        p.status = None
        p.started = time.monotonic()
        policy = f" at SCHED_FIFO {p.rt_priority}" if p.rt_priority and not self.rt_refused else ""
        log(f"spawned: {p.name!r} with pid {p.pid}{policy}")

    def _died(self, p: Program, uptime: float) -> None:
        if p.one_shot or self.stopping:
            return
        if uptime >= p.startsecs:
            p.quick_deaths = 0
            p.start_at = time.monotonic()
            return
        p.quick_deaths += 1
        if p.quick_deaths > self.startretries:
            p.fatal = True
            log(f"gave up: {p.name} entered FATAL state, too many start retries too quickly")
            return
        p.start_at = time.monotonic() + p.quick_deaths  # back-off: 1 s, 2 s, ...

    def reap(self) -> None:
        for p in self.programs:
            if p.pid is None or not p.poll():
                continue
            uptime = time.monotonic() - p.started
            p.pid = None
            code = p.status
            expected = p.one_shot and code == 0
            log(f"exited: {p.name} (exit status {code}; {'expected' if expected else 'not expected'})")
            self._died(p, uptime)

    def run(self) -> int:
        self.setpriv = find_setpriv()
        if self.setpriv is None:
            log("no setpriv with --pdeathsig (util-linux 2.33+): the programs will outlive a kill -9 of this "
                "supervisor (stop it with Ctrl-C or kill -TERM)")
        signal.set_wakeup_fd(self._wake_w)
        for sig in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        for p in self.programs:
            self.spawn(p)
        while not self.stopping:
            now = time.monotonic()
            for p in self.programs:
                if p.pid is None and p.start_at <= now:
                    self.spawn(p)
            due = min((p.start_at for p in self.programs), default=math.inf)
            # woken by a signal (a child's death, Ctrl-C) through the wake-up pipe; a minute at most
            timeout = max(0.0, min(due - time.monotonic(), 60.0))
            try:
                select.select([self._wake_r], [], [], timeout)
            except InterruptedError:
                pass
            self._drain()
            self.reap()
        self.stop()
        return 0

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def stop(self) -> None:
        """The nodes first, together; the broker last."""
        nodes = [p for p in self.programs if p.name != BROKER]
        broker = [p for p in self.programs if p.name == BROKER]
        for group in (nodes, broker):
            running = [p for p in group if p.pid is not None]
            for p in running:
                self._signal(p, signal.SIGTERM)
            deadline = time.monotonic() + STOP_WAIT_S
            while not all(p.poll() for p in running) and time.monotonic() < deadline:
                time.sleep(0.05)
            for p in running:
                if not p.poll():
                    log(f"killing: {p.name} (not stopped within {STOP_WAIT_S:g} s)")
                    self._signal(p, signal.SIGKILL)
                    while not p.poll():
                        time.sleep(0.05)
            for p in running:
                log(f"stopped: {p.name} (exit status {p.status})")
                p.pid = None

    @staticmethod
    def _signal(p: Program, sig: signal.Signals) -> None:
        """The program's whole process group (its own children too, e.g. the EtherCAT cycle process)."""
        assert p.pid is not None
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--procfile", default=os.path.join(REPO, "deploy", "Procfile.sim"))
    ap.add_argument("--rundir", default=os.path.join(REPO, "run"), help="where the supervisor's pid file goes")
    ap.add_argument("--startretries", type=int, default=STARTRETRIES,
                    help="quick deaths in a row before giving up on a process (default %(default)s)")
    ap.add_argument("--realtime", action="append", default=[], metavar="NAME=PRIO",
                    help="start NAME at SCHED_FIFO PRIO (1-99) where the host permits it (repeatable)")
    ap.add_argument("--user", action="append", default=[], metavar="NAME=USER",
                    help="when root, start NAME as USER (and group USER), e.g. broker=mosquitto (repeatable)")
    ap.add_argument("names", nargs="*", help="processes to run (default: all of the Procfile)")
    args = ap.parse_args(argv)
    users = dict(item.partition("=")[::2] for item in args.user)
    realtime: dict[str, int] = {}
    for item in args.realtime:
        name, _, prio = item.partition("=")
        if not prio.isdigit() or not 1 <= int(prio) <= 99:
            print(f"supervise: --realtime {item!r}: expected NAME=PRIO with PRIO 1-99", file=sys.stderr)
            return 2
        realtime[name] = int(prio)
    procs = read_procfile(args.procfile)
    unknown = [n for n in args.names if n not in procs]
    if unknown:
        print(f"supervise: not in {args.procfile}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.names:
        procs = {n: c for n, c in procs.items() if n in args.names}
    os.makedirs(args.rundir, exist_ok=True)
    with open(os.path.join(args.rundir, "supervise.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    return Supervisor(procs, startretries=args.startretries, realtime=realtime, users=users).run()


if __name__ == "__main__":
    sys.exit(main())
