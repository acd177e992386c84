"""Stable error codes for command replies (the MQTT contract in DESIGN.md)."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"  # undecodable, not JSON, wrong types, out of range
    NOT_FOUND = "not_found"  # unknown device, command or job
    UNAVAILABLE = "unavailable"  # device not connected / not operational
    BUSY = "busy"  # the resource is held by another request or job
    TIMEOUT = "timeout"  # the device did not answer in time
    DEVICE_ERROR = "device_error"  # the device answered with an error
    FORBIDDEN = "forbidden"  # the request is not allowed (path outside a sandbox, lease held by another)
    INTERNAL = "internal"  # a bug in the service: the handler raised something unexpected
    STOPPED = "stopped"  # a motion command refused (or a motion job ended) by the bus-wide stop (shared/stop.py)
    EXPIRED = "expired"  # the request's age passed before the node could run it: not executed (shared/dispatch.py)
    CANCELLED = "cancelled"  # a job cancelled by request (its job_result)


class CommandError(Exception):
    """Raise from a command handler to answer with a stable error code and a clear message."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message

    def __repr__(self) -> str:
        return f"CommandError({self.code.value!r}, {self.message!r})"
