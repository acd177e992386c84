"""What the kit does for every service process: the hooks `build` returns, typed (run_service calls only those
the service names); the process-wide switch interval as a setting; unknown `ROBOBUS_<SECTION>_*` names refused."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field, ValidationError

from shared.lifecycle import Hooks
from shared.registry import service_plugins
from shared.settings import KitSettings, load_settings
from tests.fixtures import REPO, Broker


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_")}
    return {**env, **extra}


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# -- typed hooks ---------------------------------------------------------------------------------------------
_HOOKS_SERVICE = r"""
from shared.contract import ServiceAPI
from shared.lifecycle import Hooks, run_service
from shared.settings import KitSettings

API = ServiceAPI("hooks-test", device_doc="nothing")

class Svc:
    # methods named like hooks that the service does not give run_service: never called
    def start(self):
        print("WRONG start", flush=True)

    async def serve(self):
        print("WRONG serve", flush=True)

    def body(self):
        print("body ran", flush=True)

    def bye(self):
        print("shutdown ran", flush=True)

    def hooks(self):
        return Hooks(run=self.body, shutdown=self.bye)

run_service(API, KitSettings, lambda node, settings: Svc())
"""


def test_run_service_calls_the_hooks_the_service_names_and_no_other_method(broker_session: Broker) -> None:
    r = _python(_HOOKS_SERVICE, _env(ROBOBUS_MQTT_URL=broker_session.url, ROBOBUS_NODE="hooks-test-1"))
    assert r.returncode == 0, r.stderr
    assert "body ran" in r.stdout and "shutdown ran" in r.stdout, r.stdout + r.stderr
    assert "WRONG" not in r.stdout


def test_a_service_has_one_body() -> None:
    async def serve() -> None:
        return None

    with pytest.raises(ValueError, match="one body"):
        Hooks(run=lambda: None, serve=serve)


def _service_classes() -> list[tuple[str, type]]:
    """Each registered service's object that build() returns: the return annotation of services.<pkg>.service.build."""
    out = []
    for p in service_plugins():
        pkg = p.module.rsplit(".", 1)[0]
        build = importlib.import_module(f"{pkg}.service").build
        ret = inspect.signature(build, eval_str=True).return_annotation
        out.append((p.name, ret))
    return out


def test_every_service_gives_its_hooks_typed() -> None:
    for name, cls in _service_classes():
        assert callable(getattr(cls, "hooks", None)), f"{name}: {cls.__name__} has no hooks() (lifecycle.Service)"
        assert inspect.signature(getattr(cls, "hooks"), eval_str=True).return_annotation is Hooks, name  # noqa: B009


# -- the switch interval -------------------------------------------------------------------------------------
_SWITCH_SERVICE = r"""
import sys
from shared.contract import ServiceAPI
from shared.lifecycle import ServiceUnavailable, run_service
from shared.settings import KitSettings

def build(node, settings):
    print(f"switch={sys.getswitchinterval():.6f}", flush=True)
    raise ServiceUnavailable("done")

run_service(ServiceAPI("switch-test", device_doc="nothing"), KitSettings, build)
"""


def test_run_service_sets_the_switch_interval_before_build() -> None:
    default = _python("import sys; print(f'switch={sys.getswitchinterval():.6f}')", _env())
    unset = _python(_SWITCH_SERVICE, _env(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1"))
    assert unset.returncode == 2 and "done" in unset.stderr, unset.stderr
    assert unset.stdout.strip() == default.stdout.strip()  # unset: Python's own
    r = _python(_SWITCH_SERVICE, _env(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1", ROBOBUS_SWITCH_INTERVAL_MS="2"))
    assert r.returncode == 2, r.stderr
    assert r.stdout.strip() == "switch=0.002000"


def test_the_services_that_need_a_short_switch_interval_set_it_by_default() -> None:
    # epuck-gateway and roi-modules hand every packet between asyncio and worker threads
    for name in ("epuck-gateway", "roi-modules"):
        cls = _settings_class(name)
        assert cls.model_fields["switch_interval_ms"].default == 1.0, name


# -- unknown settings ----------------------------------------------------------------------------------------
class _Toy(KitSettings):
    section: ClassVar[str] = "toy"
    unchecked_env: ClassVar[frozenset[str]] = frozenset({"ROBOBUS_TOY_COMPOSE_ONLY"})
    toy_speed: float = Field(1.0)
    toy_mode: str = Field("a")


def test_unknown_names_in_the_section_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in [k for k in os.environ if k.startswith("ROBOBUS_")]:
        monkeypatch.delenv(k)
    assert _Toy().toy_speed == 1.0
    monkeypatch.setenv("ROBOBUS_TOY_SPEED", "2")
    assert _Toy().toy_speed == 2.0
    monkeypatch.setenv("ROBOBUS_TOY_SPED", "3")  # misspelt: an error, not the default silently used
    with pytest.raises(ValidationError, match=r"ROBOBUS_TOY_SPED \(did you mean toy_speed\?\)"):
        _Toy()
    monkeypatch.delenv("ROBOBUS_TOY_SPED")
    monkeypatch.delenv("ROBOBUS_TOY_SPEED")
    with pytest.raises(ValidationError, match="toy_mod"):
        _Toy(toy_mod="b")  # a keyword
    conf = tmp_path / "c.toml"
    conf.write_text('toy_speed = 4.0\ntoy-mdoe = "x"\n')
    monkeypatch.setenv("ROBOBUS_CONFIG", str(conf))
    with pytest.raises(ValidationError, match="toy-mdoe"):
        _Toy()  # a config file's key
    conf.write_text("toy_speed = 4.0\n")
    assert _Toy().toy_speed == 4.0
    monkeypatch.delenv("ROBOBUS_CONFIG")
    # another section's names, the kit's own, and the section's declared non-settings pass
    monkeypatch.setenv("ROBOBUS_OTHER_THING", "1")
    monkeypatch.setenv("ROBOBUS_TOY_COMPOSE_ONLY", "1")
    monkeypatch.setenv("ROBOBUS_LOG_LEVEL", "debug")
    assert _Toy().log_level == "DEBUG"
    # a settings class without a section checks nothing
    monkeypatch.setenv("ROBOBUS_TOY_SPED", "3")
    KitSettings()


def test_load_settings_names_the_unknown_variable_on_one_line(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ROBOBUS_TOY_SPED", "3")
    with pytest.raises(SystemExit) as exc:
        load_settings(_Toy)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("robobus: invalid settings: unknown toy setting(s) ROBOBUS_TOY_SPED"), err


def _settings_class(service: str) -> type[KitSettings]:
    plugin = next(p for p in service_plugins() if p.name == service)
    mod = importlib.import_module(f"{plugin.module.rsplit('.', 1)[0]}.settings")
    found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, KitSettings)
             and c.__module__ == mod.__name__]
    assert len(found) == 1, f"{mod.__name__}: one settings class, found {found}"
    return found[0]


def test_every_service_has_a_settings_module_with_its_section() -> None:
    for p in service_plugins():
        cls = _settings_class(p.name)
        assert cls.section, f"{p.name}: {cls.__name__} names no section"
        own = set(cls.model_fields) - set(KitSettings.model_fields)
        outside = [f for f in own if not f.startswith(f"{cls.section}_")
                   and not any(isinstance(c, str) and c.lower().removeprefix("robobus_").startswith(f"{cls.section}_")
                               for c in getattr(cls.model_fields[f].validation_alias, "choices", []) or [])]
        assert outside == [], f"{p.name}: settings outside the section {cls.section!r}: {outside}"


@pytest.mark.parametrize("service", [p.name for p in service_plugins()])
def test_every_service_refuses_an_unknown_variable_of_its_section(service: str) -> None:
    cls = _settings_class(service)
    var = f"ROBOBUS_{cls.section.upper()}_NO_SUCH_SETTING"
    pkg = next(p for p in service_plugins() if p.name == service).module.rsplit(".", 1)[0]
    r = subprocess.run([sys.executable, "-m", pkg], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=_env(ROBOBUS_MQTT_URL="mqtt://127.0.0.1:1", **{var: "1"}))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"unknown {cls.section} setting(s) {var}" in r.stderr, r.stderr
