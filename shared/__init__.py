"""robobus service kit: the MQTT session, contract, health, commands, jobs and schema export
that every robobus service process is built on. The SDK owns the bus; a service owns its device."""

from shared.contract import BinarySpec, CommandSpec, EventSpec, JobSpec, ServiceAPI, StateSpec
from shared.device import Device
from shared.errors import CommandError, ErrorCode
from shared.jobs import JobContext
from shared.lifecycle import ServiceUnavailable, run_service
from shared.node import Node
from shared.settings import KitSettings, load_settings

__version__ = "0.1.0"

__all__ = [
    "BinarySpec",
    "CommandError",
    "CommandSpec",
    "Device",
    "ErrorCode",
    "EventSpec",
    "JobContext",
    "JobSpec",
    "KitSettings",
    "Node",
    "ServiceAPI",
    "ServiceUnavailable",
    "StateSpec",
    "__version__",
    "load_settings",
    "run_service",
]
