"""The one loader of robobus's plug-ins: services and CLI sub-commands, found through entry points.

python-can finds its interfaces the same way: a distribution declares
`[project.entry-points."robobus.services"] name = "module:API"` (the service's contract) and
`[project.entry-points."robobus.cli"] name = "module:app_or_function"` (a `robobus <name>` sub-command).
In-tree services are declared in this repository's pyproject.toml; out-of-tree ones in their own. The schema
export, the CLI and `make run`'s status check all ask here, so a service registered once is seen everywhere."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from shared.contract import ServiceAPI

SERVICES_GROUP = "robobus.services"
CLI_GROUP = "robobus.cli"


@dataclass(frozen=True)
class Plugin:
    """One entry point: `name = "module:attr"`."""

    name: str
    module: str
    attr: str

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.attr)


def plugins(group: str, default_attr: str) -> list[Plugin]:
    """The entry points of `group`, sorted by name; a name declared twice keeps its first declaration."""
    found: dict[str, Plugin] = {}
    for ep in entry_points(group=group):
        mod, _, attr = ep.value.partition(":")
        found.setdefault(ep.name, Plugin(ep.name, mod.strip(), attr.strip() or default_attr))
    return [found[n] for n in sorted(found)]


def service_plugins() -> list[Plugin]:
    return plugins(SERVICES_GROUP, "API")


def cli_plugins() -> list[Plugin]:
    return plugins(CLI_GROUP, "app")


def service_apis() -> list[ServiceAPI]:
    """Every registered service's contract, sorted by service name."""
    apis = []
    for p in service_plugins():
        api = p.load()
        if not isinstance(api, ServiceAPI):
            raise TypeError(f"entry point {p.name} = {p.module}:{p.attr} is not a ServiceAPI")
        apis.append(api)
    return sorted(apis, key=lambda a: a.service)


def service_names() -> list[str]:
    """The registered services' names, without importing them (for status checks)."""
    return [p.name for p in service_plugins()]
