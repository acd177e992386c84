"""The one loader of robobus's plug-ins: services and CLI sub-commands, found through entry points.

python-can finds its interfaces the same way: a distribution declares
`[project.entry-points."robobus.services"] name = "module:API"` (the service's contract) and
`[project.entry-points."robobus.cli"] name = "module:app_or_function"` (a `robobus <name>` sub-command).
In-tree services are declared in this repository's pyproject.toml; out-of-tree ones in their own. The schema
export, the CLI, `make run`'s status check, deploy/make_secrets.py's broker users and the conformance suite
all ask here, so a service registered once is seen everywhere.

Listing the plug-ins needs only the standard library (deploy/make_secrets.py runs on the host before anything is
installed): where robobus itself is not installed in this interpreter, the entry points are those the source
tree's pyproject.toml declares. Loading a service's API needs the kit."""

from __future__ import annotations

import importlib
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.contract import ServiceAPI

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

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


def declared(group: str) -> list[tuple[str, str]]:
    """(name, "module:attr") of every entry point of `group`: the installed distributions'; where robobus is not
    installed in this interpreter (a host's python3 in a checkout), those of the source tree's pyproject.toml."""
    try:
        distribution("robobus")
    except PackageNotFoundError:
        if not PYPROJECT.is_file():
            return []
        table = tomllib.loads(PYPROJECT.read_text()).get("project", {}).get("entry-points", {}).get(group, {})
        return [(str(k), str(v)) for k, v in table.items()]
    return [(ep.name, ep.value) for ep in entry_points(group=group)]


def plugins(group: str, default_attr: str) -> list[Plugin]:
    """The entry points of `group`, sorted by name; a name declared twice keeps its first declaration."""
    found: dict[str, Plugin] = {}
    for name, value in declared(group):
        mod, _, attr = value.partition(":")
        found.setdefault(name, Plugin(name, mod.strip(), attr.strip() or default_attr))
    return [found[n] for n in sorted(found)]


def service_plugins() -> list[Plugin]:
    return plugins(SERVICES_GROUP, "API")


def cli_plugins() -> list[Plugin]:
    return plugins(CLI_GROUP, "app")


def service_apis() -> list[ServiceAPI]:
    """Every registered service's contract, sorted by service name."""
    from shared.contract import ServiceAPI  # here, not above: listing the plug-ins stays standard-library only

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


def service_packages() -> dict[str, str]:
    """service name -> the package its API module is in (`services.epuck_gateway` for `services.epuck_gateway.api`),
    without importing it: where the service's other rooms (rig, protocol, settings, __main__) are found."""
    return {p.name: p.module.rpartition(".")[0] or p.module for p in service_plugins()}
