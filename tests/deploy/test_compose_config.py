"""compose.yaml against the code: every ROBOBUS_* variable a service container is given is a setting that
service reads (the compose file once set ROBOBUS_ETHERCAT_IFACE; the service reads ..._IFNAME), every
fleet env file resolves, and every registered service has its node in the sim profiles. Which container runs
which service's node and which settings class it reads are derived (its command's `-m <package>`, the class its
`__main__.py` gives run_service), so a new service is checked as soon as it has its container.
`docker compose config` needs the compose plugin, not a running daemon; the checks of compose.yaml as written
need neither."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from shared.registry import service_packages
from shared.settings import KitSettings
from shared.tools.fleet_watch import FleetWatchSettings
from shared.tools.recorder import RecorderSettings
from tests.deploy.deployfiles import DEPLOY
from tests.deploy.stack import Stack, compose_nodes, compose_services, expected_nodes, run, sim_profile


def settings_class(service: str) -> type[KitSettings]:
    """The settings class a service's node reads: the one its `__main__.py` gives `run_service(API, Settings,
    build)`, imported from where __main__.py imports it."""
    package = service_packages()[service]
    spec = importlib.util.find_spec(f"{package}.__main__")
    assert spec is not None and spec.origin, f"{service}: no {package}/__main__.py"
    tree = ast.parse(Path(spec.origin).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_service"]
    assert len(calls) == 1 and len(calls[0].args) >= 2 and isinstance(calls[0].args[1], ast.Name), (
        f"{service}: {package}/__main__.py must call run_service(API, <its settings class>, build) once")
    name = calls[0].args[1].id
    source = next((n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                   and any((a.asname or a.name) == name for a in n.names)), f"{package}.__main__")
    cls = getattr(importlib.import_module(source), name)
    assert isinstance(cls, type) and issubclass(cls, KitSettings), f"{service}: {name} is no KitSettings subclass"
    return cls


SETTINGS: dict[str, type[BaseSettings]] = {s: settings_class(s) for s in service_packages()}
NODE_OF = compose_nodes()
# Read by the container around the service, not by its settings: the healthcheck and logging knobs.
NOT_SETTINGS = {"ROBOBUS_HEALTHCHECK_WAIT_S"}


@pytest.fixture(scope="module")
def compose_ok(docker_ready: str) -> None:
    """docker's client and compose, installed when missing (`docker_ready`, as for every container test: on a
    fresh machine these tests run first, before any other container test has installed them)."""
    if not (Path("/usr/bin/docker").exists() and (shutil.which("docker") or True)):
        pytest.skip("no docker client: deploy/dev/ensure-docker.sh installs it")
    if not any(Path(p, "docker-compose").exists() for p in
               ("/usr/local/lib/docker/cli-plugins", "/usr/lib/docker/cli-plugins", "/usr/libexec/docker/cli-plugins",
                str(Path.home() / ".docker/cli-plugins"))):
        pytest.skip("no compose plugin: deploy/dev/install-compose.sh installs it")


def env_names(cls: type[BaseSettings]) -> set[str]:
    names: set[str] = set()
    for name, f in cls.model_fields.items():
        names.add(f"ROBOBUS_{name}".upper())
        alias = f.validation_alias
        for choice in getattr(alias, "choices", []) or ([alias] if isinstance(alias, str) else []):
            if isinstance(choice, str) and choice.lower().startswith("robobus_"):
                names.add(choice.upper())
    return names


def config(tmp_path: Path, profiles: str, secrets_args: tuple[str, ...] = (), **env: str) -> dict[str, Any]:
    st = Stack("robobus-config-check", tmp_path, profiles=profiles, extra_env=env)
    st.make_secrets(*secrets_args)
    return dict(yaml.safe_load(st.compose("config").stdout))


@pytest.mark.parametrize("profiles", ["sim", "hand", "epuck", "dexter"])
def test_every_variable_a_service_is_given_is_a_setting_it_reads(compose_ok, tmp_path, profiles):
    cfg = config(tmp_path, profiles, ROBOBUS_EPUCK_ROBOTS='[{"id":"e1","host":"10.0.0.1"}]')
    checked = 0
    for svc, spec in cfg["services"].items():
        node = NODE_OF.get(svc)
        if node is None:
            continue
        given = {k for k in (spec.get("environment") or {}) if k.startswith("ROBOBUS_")}
        unknown = given - env_names(SETTINGS[node]) - NOT_SETTINGS
        assert not unknown, f"{svc}: {sorted(unknown)} are not settings of {SETTINGS[node].__name__}"
        checked += 1
    assert checked


@pytest.mark.parametrize("env_file", sorted((DEPLOY / "fleet").glob("*.env")), ids=lambda p: p.name)
def test_fleet_env_files_resolve(compose_ok, tmp_path, env_file):
    env: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v.strip("'\"")
    profiles = env.pop("COMPOSE_PROFILES")
    for k in ("ROBOBUS_SITE", "ROBOBUS_CENTRAL_ADDRESS", "ROBOBUS_BRIDGE_CREDENTIALS", "ROBOBUS_BRIDGE_CA",
              "ROBOBUS_CENTRAL_TLS_NAMES"):
        env.pop(k, None)  # up.sh's, not compose's
    for k in ("ROBOBUS_SECRETS_DIR", "ROBOBUS_PROJECT", "ROBOBUS_WAN_NETWORK"):
        env.pop(k, None)  # the test's own (a temporary folder, a project of its own; no shared network made)
    sites = env.get("ROBOBUS_CENTRAL_SITES", "").split()
    central = ("--central", *[a for s in sites for a in ("--site", s)]) if sites else ()
    cfg = config(tmp_path, profiles, central, **env)
    assert "broker" in cfg["services"]
    if profiles == "central":  # the watcher reads every variable it is given, and watches every site
        given = cfg["services"]["fleet-watch"]["environment"]
        assert {k for k in given if k.startswith("ROBOBUS_")} <= env_names(FleetWatchSettings)
        assert FleetWatchSettings(fleet_sites=given["ROBOBUS_FLEET_SITES"]).roots() == \
            sorted(s.split("=", 1)[1] for s in sites)
        # the sites reach the centre over TLS only: 8883 on every address, plain MQTT and websockets on loopback
        ports = {int(p["target"]): p.get("host_ip", "0.0.0.0") for p in cfg["services"]["broker"]["ports"]}
        assert ports == {1883: "127.0.0.1", 9001: "127.0.0.1", 8883: "0.0.0.0"}, ports
    if profiles == "hand":
        given = cfg["services"]["ethercat-loop"]["environment"]
        assert given["ROBOBUS_ETHERCAT_IFNAME"] == env["ROBOBUS_ETHERCAT_IFNAME"]


def test_every_registered_service_joins_the_sim_profile(compose_ok, tmp_path):
    svcs = set(config(tmp_path, "sim")["services"])
    written = compose_services()
    wanted = {c for c, s in NODE_OF.items() if sim_profile(written[c].get("profiles"))}
    assert {"broker", "epuck-sim"} | wanted <= svcs, sorted(wanted - svcs)


def test_every_registered_service_has_its_node_container_in_the_sim_profiles() -> None:
    missing = sorted(set(service_packages()) - set(expected_nodes()))
    assert not missing, (f"deploy/compose.yaml has no node container for {missing} in the profile `sim` (or a "
                         "`sim-<name>` one): add `<service>-sim` with `command: [\"python3\", \"-m\", \"<package>\"]` "
                         "(docs/kit.md, 'How to add a service')")
    assert set(SETTINGS) == set(service_packages())  # every registered service's settings class is found


def test_compose_sh_brings_every_sim_profile_along(compose_ok, tmp_path):
    """`sim` brings along every `sim-<name>` profile compose.yaml has, one no file names included: a copy of deploy/
    whose compose.yaml has a container in a profile of its own needs no line in compose.sh."""
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy, ignore=shutil.ignore_patterns("secrets"))
    compose = deploy / "compose.yaml"
    text = compose.read_text()
    assert "\nservices:\n" in text
    compose.write_text(text.replace("\nservices:\n", "\nservices:\n  zz-sim:\n    image: busybox\n"
                                                     "    profiles: [sim-zz]\n\n", 1))
    st = Stack("robobus-profiles-check", tmp_path / "secrets")
    st.make_secrets()
    listed = set(run([str(deploy / "compose.sh"), "config", "--services"], st.env, 120).stdout.split())
    wanted = {c for c, spec in compose_services().items() if sim_profile(spec.get("profiles"))} | {"zz-sim"}
    assert wanted <= listed, f"deploy/compose.sh does not bring {sorted(wanted - listed)} along with `sim`"


def test_the_recorder_has_its_own_user_a_volume_and_rotation_from_the_environment(compose_ok, tmp_path):
    cfg = config(tmp_path, "sim,record", ROBOBUS_RECORD_MAX_DURATION_S="600", ROBOBUS_RECORD_MAX_BYTES="50000000")
    rec = cfg["services"]["recorder"]
    env = rec["environment"]
    assert env["ROBOBUS_MQTT_USERNAME"] == "recorder"  # its env_file: not another service's credentials
    assert (env["ROBOBUS_RECORD_MAX_DURATION_S"], env["ROBOBUS_RECORD_MAX_BYTES"]) == ("600", "50000000")
    assert env["ROBOBUS_RECORD_PATH"].startswith("/recordings/")
    unknown = {k for k in env if k.startswith("ROBOBUS_")} - env_names(RecorderSettings) - {"ROBOBUS_LOG_JSON"}
    assert not unknown, f"recorder: {sorted(unknown)} are not RecorderSettings"
    assert any(v["target"] == "/recordings" for v in rec["volumes"])
    assert rec["read_only"] and rec["user"] == "65534:65534"
    assert "recorder" not in config(tmp_path, "sim")["services"]  # only with the profile


def test_the_one_host_fleet_site_fits_the_centre(tmp_path):
    """deploy/fleet/site-sim.env is a site deploy/fleet/central.env knows, on ports of its own, in a project and a
    secrets folder of its own, bridged over TLS to the centre's alias on the shared network."""
    def env(name: str) -> dict[str, str]:
        pairs = (line.split("=", 1) for line in (DEPLOY / "fleet" / name).read_text().splitlines()
                 if "=" in line and not line.startswith("#"))
        return {k: v.strip("'\"") for k, v in pairs}

    site, centre = env("site-sim.env"), env("central.env")
    assert f"{site['ROBOBUS_SITE']}={site['ROBOBUS_TOPIC_ROOT']}" in centre["ROBOBUS_CENTRAL_SITES"].split()
    ports = ("ROBOBUS_BROKER_PORT", "ROBOBUS_BROKER_WS_PORT", "ROBOBUS_BROKER_TLS_PORT")
    assert not {site[p] for p in ports} & {"1883", "9001", "8883"}  # the centre's (defaults)
    assert site["ROBOBUS_PROJECT"] != "robobus" and site["ROBOBUS_SECRETS_DIR"] != "deploy/secrets"
    assert site["ROBOBUS_CENTRAL_ADDRESS"].endswith(":8883") and site["ROBOBUS_BRIDGE_CA"].endswith("fleet-ca.crt")
    assert site["ROBOBUS_CENTRAL_ADDRESS"].split(":")[0] == "central"  # the README's ROBOBUS_WAN_ALIAS for the centre
