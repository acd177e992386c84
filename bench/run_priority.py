"""The priority make run gives the broker and the service nodes, for the benches that measure them as make run
runs them: SCHED_FIFO ROBOBUS_RUN_RT_PRIORITY (default 10, deploy/dev/run-local.sh) where this host permits it,
else ordinary scheduling, said why."""

from __future__ import annotations

import os
import shutil
import subprocess


def run_priority(asked: int | None) -> tuple[int, str]:
    """`asked`, else make run's priority; 0 (ordinary) where this host refuses SCHED_FIFO. With what to print."""
    prio = asked if asked is not None else int(os.environ.get("ROBOBUS_RUN_RT_PRIORITY", "10"))
    if prio <= 0:
        return 0, "ordinary scheduling"
    if shutil.which("chrt") is None:
        return 0, "ordinary scheduling (chrt, util-linux, not found)"
    probe = subprocess.run(["chrt", "-f", str(prio), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return 0, f"ordinary scheduling (SCHED_FIFO {prio} refused: {probe.stderr.strip()})"
    return prio, f"SCHED_FIFO {prio}, as make run starts them"


def chrt(priority: int) -> list[str]:
    """The prefix that starts a program with every thread at SCHED_FIFO `priority` from its first instruction (as
    make run's supervisor does); nothing for 0."""
    return ["chrt", "-f", str(priority)] if priority else []


def set_fifo(pid: int, priority: int) -> None:
    """SCHED_FIFO for a running single-threaded program (mosquitto); nothing for 0."""
    if priority:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(priority))


def fifo_threads(priority: int) -> None:
    """SCHED_FIFO for every thread this process runs now (not its children, nor threads it starts later from an
    ordinary one); nothing for 0. The mechanism ethercat-loop's MQTT process uses (`process_fifo`: a thread already
    above the priority keeps its place); what it was refused is printed."""
    from services.ethercat_loop.transport.realtime import process_fifo

    for warning in process_fifo(priority):
        print(f"run_priority: {warning}")
