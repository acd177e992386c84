"""Every registered transport, found through the registry: its factory has the kit's one signature,
`factory(settings, hooks)`, and is defined in the module its entry point names (no alias module in between); and
the service.py of every registered service (found through the registry too, so an out-of-tree service is held to
it) imports no module a transport's entry point names (docs/kit.md, "Transports")."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path

from shared.registry import service_packages
from shared.transports import load_transport, transport_plugins
from tests.kit.test_service_layout import package_dir
from tests.kit.test_transports import _transport_modules, forbidden_imports


def _factories() -> dict[str, tuple[str, object]]:
    """{"<service>.<name>": (the entry point's module, the factory)} for every registered transport."""
    return {f"{svc}.{name}": (plugin.module, load_transport(svc, name))
            for svc in service_packages() for name, plugin in transport_plugins(svc).items()}


def shape(factory: Callable[..., object]) -> list[str]:
    """The names of `factory`'s parameters, keyword-only ones marked `*name`, with a default `name=`."""
    out = []
    for p in inspect.signature(factory).parameters.values():
        name = f"*{p.name}" if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL) else p.name
        out.append(name if p.default is p.empty else f"{name}=")
    return out


def test_every_factory_takes_settings_and_hooks() -> None:
    found = _factories()
    assert len(found) >= 8, found
    wrong = {ep: shape(f) for ep, (_, f) in found.items() if shape(f) != ["settings", "hooks"]}  # type: ignore[arg-type]
    assert wrong == {}, f"not factory(settings, hooks): {wrong}"


def test_every_factory_lives_in_the_module_its_entry_point_names() -> None:
    aliased = {ep: getattr(f, "__module__", None) for ep, (module, f) in _factories().items()
               if getattr(f, "__module__", None) != module}
    assert aliased == {}, f"an entry point names an alias of a factory defined elsewhere: {aliased}"


def test_the_signature_rule_catches_a_factory_of_another_shape() -> None:
    def arm(name: str, config: object, *, supervisor: object = None) -> None: ...

    def octets(settings: object, octets: object, *, live: object = None) -> None: ...

    def kit(settings: object, hooks: object, /) -> None: ...

    assert shape(arm) == ["name", "config", "*supervisor="]
    assert shape(octets) == ["settings", "octets", "*live="]
    assert shape(kit) == ["settings", "hooks"]


def _service_py(package: str) -> Path:
    return package_dir(package) / "service.py"


def test_no_registered_service_imports_a_transport_module() -> None:
    modules = _transport_modules()
    bad = []
    for svc, package in service_packages().items():
        path = _service_py(package)
        assert path.exists(), f"{svc}: {package} has no service.py"
        bad += [f"{svc}: {v}" for v in forbidden_imports(path, f"{package}.service", modules)]
    assert bad == [], "\n".join(bad)


def test_the_rule_sees_a_service_py_that_imports_a_transport_module(tmp_path: Path) -> None:
    path = tmp_path / "service.py"
    path.write_text(textwrap.dedent('''
        from services.dexter_gateway.transport import DexterLink
        from services.roi_modules.transport import udp_transport
        from services.dexter_gateway.link import LinkHooks
    '''))
    found = forbidden_imports(path, "services.dexter_gateway.service", _transport_modules())
    assert [f.split(" (")[0] for f in found] == ["2: services.dexter_gateway.transport.DexterLink",
                                                 "3: services.roi_modules.transport.udp_transport"], found
