"""Jobs: long work that answers at once with a job id, streams progress and ends with one result event."""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from shared.contract import JOB_PROGRESS, JOB_RESULT, JobSpec
from shared.errors import ErrorCode
from shared.messages import ErrorInfo, JobAccepted, JobProgress, JobResult
from shared.payloads import dump, error_info

if TYPE_CHECKING:
    from shared.device import Device

log = logging.getLogger("robobus.jobs")


class JobCancelled(Exception):
    """Raised by `JobContext.check_cancelled()`; the kit turns it into a cancelled result."""


class JobContext:
    """Handed to a job function: report progress, check for cancellation."""

    def __init__(self, device: Device, job_id: str, command: str, progress_hz: float = 10.0) -> None:
        self.device = device
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
        self.device.emit(JOB_PROGRESS, JobProgress(job_id=self.job_id, command=self.command, phase=phase,
                                                   done=done, total=total, info=info, ts=time.time()))


def start_job(device: Device, spec: JobSpec, run: Callable[..., Any], req: BaseModel) -> JobAccepted:
    """Run `run(req, ctx)` on its own thread; emit exactly one `job_result` when it ends."""
    job_id = uuid.uuid4().hex[:12]
    ctx = JobContext(device, job_id, spec.name)
    device.running[job_id] = ctx
    node = device.node

    def body() -> None:
        t0 = time.monotonic()
        try:
            result = run(req, ctx)
            if inspect.iscoroutine(result):
                result = node.run_coro(result, None)
            ctx.check_cancelled()
            payload = json.loads(dump(spec.result, result))
            res = JobResult(job_id=job_id, command=spec.name, ok=True, result=payload,
                            duration_s=time.monotonic() - t0, ts=time.time())
        except JobCancelled:
            res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=True,
                            error=ErrorInfo(code=ErrorCode.BUSY, message="cancelled by request"),
                            duration_s=time.monotonic() - t0, ts=time.time())
        except Exception as exc:
            res = JobResult(job_id=job_id, command=spec.name, ok=False, cancelled=ctx.cancelled,
                            error=error_info(exc, f"job {spec.name}"), duration_s=time.monotonic() - t0,
                            ts=time.time())
        finally:
            device.running.pop(job_id, None)
        if not res.ok:
            node.counters.failed(res.error.code.value if res.error else "internal")
        device.emit(JOB_RESULT, res)
        log.info("job finished", extra={"device": device.name, "job": spec.name, "job_id": job_id,
                                        "ok": res.ok, "duration_s": round(res.duration_s, 3)})

    threading.Thread(target=body, name=f"job-{spec.name}-{job_id}", daemon=True).start()
    return JobAccepted(job_id=job_id, command=spec.name)
