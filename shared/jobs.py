"""Jobs: long work that answers at once with a job id, streams progress and ends with one result event.

The job function gets a JobContext; `Device.start_job` runs it on its own thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from shared.contract import JOB_PROGRESS, EventSpec
from shared.messages import JobProgress

Emit = Callable[[EventSpec, Any], None]


class JobCancelled(Exception):
    """Raised by `JobContext.check_cancelled()`; the kit turns it into a cancelled result."""


class JobContext:
    """Handed to a job function: report progress, check for cancellation."""

    def __init__(self, emit: Emit, job_id: str, command: str, progress_hz: float = 10.0) -> None:
        self._emit = emit
        self.job_id = job_id
        self.command = command
        self.started = time.monotonic()
        self._cancel = threading.Event()
        self._progress_interval = 1.0 / progress_hz
        self._last_progress = 0.0
        self._last_phase = ""

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled(f"job {self.job_id} cancelled")

    def wait(self, seconds: float) -> bool:
        """Sleep that a cancel interrupts; True if cancelled."""
        return self._cancel.wait(seconds)

    def progress(self, phase: str, done: float = 0.0, total: float = 0.0, *, force: bool = False,
                 **info: Any) -> None:
        """Publish progress; rate-capped, but a new phase or `force` always goes out."""
        t = time.monotonic()
        if not force and phase == self._last_phase and t - self._last_progress < self._progress_interval:
            return
        self._last_phase = phase
        self._last_progress = t
        self._emit(JOB_PROGRESS, JobProgress(job_id=self.job_id, command=self.command, phase=phase,
                                                   done=done, total=total, info=info, ts=time.time()))
