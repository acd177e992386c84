"""robobus service kit: the MQTT session, contract, health, commands, jobs and schema export
that every robobus service process is built on. The SDK owns the bus; a service owns its device.

The rooms of shared/ (docs/kit.md, "The rooms of shared/"): the kit is shared/*.py, the MQTT layer
shared/mqtt/, the tools shared/tools/. `from shared import Node, run_service, ...` loads the kit module that
holds the name when it is first asked for, so importing the MQTT layer or a tool's leaf module (e.g.
shared.mqtt.wire) does not load the whole kit."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.contract import BinarySpec, CommandSpec, EventSpec, JobSpec, ServiceAPI, StateSpec
    from shared.device import Device
    from shared.errors import CommandError, ErrorCode
    from shared.jobs import JobContext
    from shared.lifecycle import ServiceUnavailable, run_service
    from shared.node import Node
    from shared.settings import KitSettings, load_settings


def _installed_version() -> str:
    """robobus's version: pyproject.toml's `version`, read from the installed package's metadata (the one place
    it is written). A source tree that was never installed says so instead of guessing."""
    try:
        return version("robobus")
    except PackageNotFoundError:
        return "0+not-installed"


__version__ = _installed_version()

_HOME = {
    "BinarySpec": "shared.contract",
    "CommandSpec": "shared.contract",
    "EventSpec": "shared.contract",
    "JobSpec": "shared.contract",
    "ServiceAPI": "shared.contract",
    "StateSpec": "shared.contract",
    "Device": "shared.device",
    "CommandError": "shared.errors",
    "ErrorCode": "shared.errors",
    "JobContext": "shared.jobs",
    "ServiceUnavailable": "shared.lifecycle",
    "run_service": "shared.lifecycle",
    "Node": "shared.node",
    "KitSettings": "shared.settings",
    "load_settings": "shared.settings",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'shared' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


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
