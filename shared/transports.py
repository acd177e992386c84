"""The one loader of the services' transports: every way a service reaches its devices, real or simulated, chosen
by name through entry points.

python-can picks `interface="virtual"` by the same setting as `interface="socketcan"`; robobus does the same for a
service's own transports. A distribution declares

    [project.entry-points."robobus.transports"]
    "ethercat-loop.model" = "services.ethercat_loop.model_backend:model_backend"

(`<service>.<name>` = `module:factory`), the service's settings name the transport (`ROBOBUS_ETHERCAT_BACKEND=model`),
and the service asks here for the factory: `load_transport("ethercat-loop", settings.backend)`. Simulators are
registered beside the real transports, so a service's wiring (service.py) imports neither: only the factory's
module does. An out-of-tree package adds a transport to an existing service the same way, in its own pyproject.
What a factory receives is the service's to say (its settings and what the service has built for it: see each
service's README); the kit only finds it.

A name that is not registered is a settings error (`check_transport`, from the settings class's validator: one
line naming the setting and the registered names, exit 2, like any invalid setting); a registered transport whose
module cannot be imported here (a missing optional library) is `TransportUnavailable`, which the service turns into
its own "cannot run here" (`ServiceUnavailable`). Listing the names imports no transport module."""

from __future__ import annotations

from typing import Any

from shared.registry import Plugin, plugins

GROUP = "robobus.transports"

__all__ = ["GROUP", "TransportUnavailable", "UnknownTransport", "check_transport", "load_transport",
           "transport_names", "transport_plugins"]


class UnknownTransport(ValueError):
    """A transport name that no `robobus.transports` entry point declares for the service. A ValueError, so that a
    settings validator that raises it reports an invalid setting."""


class TransportUnavailable(RuntimeError):
    """A registered transport that cannot be loaded here: its module or a library it needs does not import, or
    the entry point names no callable."""


def transport_plugins(service: str) -> dict[str, Plugin]:
    """The transports registered for `service`, by name (the part of the entry point's name after `<service>.`)."""
    prefix = f"{service}."
    return {p.name.removeprefix(prefix): p for p in plugins(GROUP, "") if p.name.startswith(prefix)}


def transport_names(service: str) -> list[str]:
    """The names of the transports registered for `service`, sorted; none loaded."""
    return sorted(transport_plugins(service))


def _unknown(service: str, name: str, known: list[str]) -> str:
    if not known:
        return (f"unknown {service} transport {name!r}: no transport is registered for {service} (entry points "
                f"{GROUP!r} named '{service}.<name>'; is robobus installed? pip install -e .)")
    import difflib  # here: only the error path pays for it (tests/kit/test_make_run_imports.py)

    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {service} transport {name!r}{hint}; registered: {', '.join(known)}"


def check_transport(service: str, name: str) -> str:
    """`name` if a transport of that name is registered for `service`; else UnknownTransport (a ValueError) whose
    message lists the registered names. For settings validators: the check imports no transport module."""
    known = transport_names(service)
    if name not in known:
        raise UnknownTransport(_unknown(service, name, known))
    return name


def load_transport(service: str, name: str) -> Any:
    """The factory registered as `<service>.<name>`: UnknownTransport if there is none, TransportUnavailable if its
    module does not import here or it is not callable."""
    found = transport_plugins(service)
    plugin = found.get(name)
    if plugin is None:
        raise UnknownTransport(_unknown(service, name, sorted(found)))
    where = f"{plugin.module}:{plugin.attr}"
    if not plugin.attr:
        raise TransportUnavailable(f"{service} transport {name!r} = {where!r} names no factory ('module:factory')")
    try:
        factory = plugin.load()
    except ImportError as exc:
        raise TransportUnavailable(f"{service} transport {name!r} cannot be imported here ({where}): {exc}") from exc
    except AttributeError as exc:
        raise TransportUnavailable(f"{service} transport {name!r}: {where} does not exist: {exc}") from exc
    if not callable(factory):
        raise TransportUnavailable(f"{service} transport {name!r}: {where} is not callable")
    return factory
