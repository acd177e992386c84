"""The kit's own messages: node status, device health, command replies, job events.

Every service publishes these with the same shapes, so a dashboard written for one works for all."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import ErrorCode


class Status(BaseModel):
    """`{root}/{node}/status`, retained. Birth on connect, Last Will (online=false) on death."""

    model_config = ConfigDict(extra="forbid")
    online: bool
    node: str
    service: str
    version: str
    ts: float = Field(description="Unix time (s) when this status was made")
    session: int = Field(description="Counts connections of this process; pairs a birth with its death")
    devices: list[str] = Field(default_factory=list)
    pid: int | None = None
    host: str | None = None
    reason: str | None = Field(default=None, description="Why the node went offline (Will or shutdown)")


class Health(BaseModel):
    """`{root}/{node}/{device}/health`, retained; the ROI Health fields plus identity and time."""

    model_config = ConfigDict(extra="forbid")
    connection: bool = Field(description="The transport reaches the device")
    operational: bool = Field(description="The device can do its job now")
    state: str = Field(description="Short machine-readable state of the device, e.g. 'running'")
    error: bool = Field(description="An error is present (see error_message)")
    error_message: str = Field(default="", description="Human-readable health message (ROI Health MSG)")
    service: str
    node: str
    device: str
    version: str
    ts: float
    details: dict[str, Any] = Field(default_factory=dict, description="Service-specific extras")


class ErrorInfo(BaseModel):
    code: ErrorCode
    message: str


class OkReply(BaseModel):
    ok: Literal[True] = True
    result: dict[str, Any] = Field(default_factory=dict)


class ErrorReply(BaseModel):
    ok: Literal[False] = False
    error: ErrorInfo


class Empty(BaseModel):
    """A request or reply with no fields."""

    model_config = ConfigDict(extra="forbid")


class JobAccepted(BaseModel):
    """The immediate reply to a job command: the work goes on, its events carry this id."""

    job_id: str
    command: str


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str | None = Field(default=None, description="Job to cancel; omit to cancel every job of the device")


class CancelReply(BaseModel):
    cancelled: list[str]


class JobProgress(BaseModel):
    """`event/job_progress`: streamed while a job runs."""

    job_id: str
    command: str
    phase: str
    done: float = 0.0
    total: float = 0.0
    info: dict[str, Any] = Field(default_factory=dict)
    ts: float


class JobResult(BaseModel):
    """`event/job_result`: the one message that ends a job."""

    job_id: str
    command: str
    ok: bool
    cancelled: bool = False
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    duration_s: float
    ts: float


class NodeStats(BaseModel):
    """`{root}/{node}/_node/state/stats`: what the kit itself counts."""

    commands_ok: int
    commands_failed: dict[str, int] = Field(description="Error replies by code")
    jobs_running: int
    published: int
    publish_dropped: int = Field(description="Publishes refused while disconnected or over the queue limit")
    decode_errors: int = Field(description="Bad bytes from devices, counted by services")
    reconnects: int
    uptime_s: float
    stop_path_lags: int = Field(0, description="Times the bus stop's own connection started to lag (down, or a "
                                               "round trip to itself over 0.5 s): shared/stop.py, StopPath")
    stop_path_rtt_ms: float | None = Field(None, description="The stop connection's latest round trip to itself, ms")
    ts: float


class StopState(BaseModel):
    """`{root}/_stop`, retained, QoS 1: the latched bus-wide software stop of one topic root (shared/stop.py).
    Not a hardware emergency stop. Written by the operator role only (`robobus stop`, `robobus stop --release`,
    Home Assistant's button); every node reads it."""

    model_config = ConfigDict(extra="forbid")
    active: bool = Field(description="true: every motion device stops and motion commands are refused; "
                                     "false: released (nothing moves until a new command)")
    source: str = Field(min_length=1, max_length=200, description="Who set or released it, e.g. 'alice@lab-pc'")
    reason: str = Field(default="", max_length=500, description="Why, in the operator's words")
    ts: float = Field(description="Unix time (s) when it was set or released; names this stop in the answers")


class StopDeviceAnswer(BaseModel):
    """What one device of a node did about a stop or release."""

    model_config = ConfigDict(extra="forbid")
    device: str
    stopped: bool = Field(description="The device is held stopped (false after a release that leaves no "
                                      "stop active: a release of one channel leaves the other's)")
    pending: bool = Field(description="The service has not yet reported that the stop reached the device")
    written_ts: float | None = Field(
        default=None, description="Unix time (s) the stop reached the device, as the service reports it (its "
                                  "deadman's write), not when it was decided; null while pending or on release")
    error: str = Field(default="", description="The service's stop action failed: how")
    note: str = Field(default="", description="What the stop cannot do on the device yet, or at all (a pending stop's "
                                           "reason, e.g. a position not known yet): the device's health says it too")


class StopAnswer(BaseModel):
    """`{root}/{node}/_node/state/stop`, retained: a node's answer to the latest stop or release it read,
    published when it read it and again as each device's stop action reports."""

    model_config = ConfigDict(extra="forbid")
    node: str
    service: str
    active: bool = Field(description="The stop (true) or release (false) this answers")
    stop_ts: float = Field(description="The `ts` of the StopState answered")
    source: str
    reason: str
    channel: Literal["site", "fleet"] = Field(
        default="site", description="Where the StopState answered was read: 'site' ({root}/_stop, the site's own "
                                    "stop) or 'fleet' ({root}/_stop/fleet, the fleet centre's stop, brought in by "
                                    "the site's bridge). The node is stopped while either is active")
    received_ts: float = Field(description="Unix time (s) when the node read the StopState")
    devices: list[StopDeviceAnswer] = Field(description="The node's motion devices")
    broker_lost: bool = Field(
        default=False, description="The node holds an active stop that the broker no longer has (its latch's topic "
                                   "was empty when the node reconnected, e.g. after a broker restart without "
                                   "persistence): still held here until a message arrives on that latch; set the "
                                   "stop again (or release it)")
    ts: float
