"""`make run`'s process supervisor: every process of deploy/Procfile.sim under supervisord.

The Procfile stays the one list of `make run`'s processes (the chaos harness and the dashboard tests read it
too); this script turns it into a supervisord configuration and runs supervisord in the foreground:

- a process that dies is started again: at once if it had run for `startsecs`, else after a back-off that grows
  by a second a try; after `startretries` quick deaths in a row supervisord gives up on it with one line
  ("gave up: NAME entered FATAL state ...") and everything else goes on running;
- the broker is a process like any other: killed, it is started again and the nodes reconnect by themselves;
- Ctrl-C or SIGTERM stops the nodes first (their fail-safe hooks still reach the broker and publish
  `online: false, reason: shutdown`), then the broker, last;
- one supervisord process watches them all (no wrapper process per child).

Usage: supervise.py [--procfile FILE] [--rundir DIR] [NAME ...]   (no NAME: every process of the Procfile)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
# `A=1 B=2 cmd`: bash keeps leading assignments in the exec'd command's environment, so the pid supervisord
# watches (and signals) is the program's own, not a shell's
_ASSIGNMENTS = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S+)\s+)*)")
BROKER = "broker"
# processes that print once and idle: never restarted
ONE_SHOT = {"banner"}
# a node must stay up this long for its start to count as good (then a later death restarts it at once)
NODE_STARTSECS = 3
# quick deaths in a row before supervisord gives up on a process (back-off 1 s, 2 s, ... between them)
STARTRETRIES = 8


def read_procfile(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _quote(command: str) -> str:
    """A Procfile line as one supervisord `command=`: run by bash (for `${VAR:-default}`), which execs it."""
    line = _ASSIGNMENTS.sub(r"\1exec ", command, count=1)
    # supervisord splits `command` with shlex and expands %(...)s: a double-quoted bash -c argument,
    # with the characters special to either escaped
    escaped = line.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'/bin/bash -c "{escaped}"'


def render(procs: dict[str, str], rundir: Path) -> str:
    common = ("autorestart={restart}\nstartsecs={startsecs}\nstartretries={retries}\n"
              "stopsignal=TERM\nstopwaitsecs=10\nstopasgroup=true\nkillasgroup=true\n"
              f"directory={REPO}\nredirect_stderr=true\n"
              "stdout_logfile=/dev/stdout\nstdout_logfile_maxbytes=0\n")
    # Every writer opens /dev/stdout itself, in append mode (supervisord's own log too, hence `silent`): with
    # `make run > file` a writer through the inherited descriptor would write over the others' lines.
    user = "user=root\n" if os.geteuid() == 0 else ""  # said, so that supervisord does not warn about it
    parts = [
        "[supervisord]\nnodaemon=true\nsilent=true\nlogfile=/dev/stdout\nlogfile_maxbytes=0\nloglevel=info\n"
        f"pidfile={rundir / 'supervisord.pid'}\nchildlogdir={rundir}\n{user}",
    ]
    nodes = []
    for name, command in procs.items():
        one_shot = name in ONE_SHOT
        fields = common.format(restart="false" if one_shot else "true",
                               startsecs=0 if one_shot else (1 if name == BROKER else NODE_STARTSECS),
                               retries=STARTRETRIES)
        # the broker starts first and stops last: lower priority is started earlier and stopped later
        prio = 1 if name == BROKER else 100
        parts.append(f"[program:{name}]\ncommand={_quote(command)}\npriority={prio}\n{fields}")
        if name != BROKER:
            nodes.append(name)
    if nodes:
        # one group: on shutdown supervisord stops a group's processes together, and a group at a time
        parts.append(f"[group:robobus]\nprograms={','.join(nodes)}\npriority=100\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procfile", type=Path, default=REPO / "deploy" / "Procfile.sim")
    ap.add_argument("--rundir", type=Path, default=REPO / "run")
    ap.add_argument("names", nargs="*", help="processes to run (default: all of the Procfile)")
    args = ap.parse_args(argv)
    procs = read_procfile(args.procfile)
    unknown = [n for n in args.names if n not in procs]
    if unknown:
        print(f"supervise: not in {args.procfile}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.names:
        procs = {n: c for n, c in procs.items() if n in args.names}
    args.rundir.mkdir(parents=True, exist_ok=True)
    conf = args.rundir / "supervisord.conf"
    conf.write_text(render(procs, args.rundir.resolve()))
    supervisord = Path(sys.executable).with_name("supervisord")
    os.execv(str(supervisord), [str(supervisord), "-c", str(conf)])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
