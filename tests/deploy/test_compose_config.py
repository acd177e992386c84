"""compose.yaml against the code: every ROBOBUS_* variable a service container is given is a setting that
service reads (the compose file once set ROBOBUS_ETHERCAT_IFACE; the service reads ..._IFNAME), every
fleet env file resolves, and roi-modules / dexter-gateway join the sim profile only once their package exists.
`docker compose config` needs the compose plugin, not a running daemon."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from pydantic_settings import BaseSettings

from services.can_bootloader.settings import CanBootSettings
from services.dexter_gateway.settings import DexterSettings
from services.epuck_gateway.service import EpuckSettings
from services.ethercat_loop.settings import EthercatSettings
from services.roi_modules.settings import RoiSettings
from shared.tools.fleet_watch import FleetWatchSettings
from shared.tools.recorder import RecorderSettings
from tests.deploy.deployfiles import DEPLOY, REPO
from tests.deploy.stack import Stack

SETTINGS: dict[str, type[BaseSettings]] = {"ethercat-loop": EthercatSettings, "can-bootloader": CanBootSettings,
                                           "epuck-gateway": EpuckSettings, "roi-modules": RoiSettings,
                                           "dexter-gateway": DexterSettings}
NODE_OF = {"ethercat-loop": "ethercat-loop", "ethercat-loop-sim": "ethercat-loop", "can-bootloader": "can-bootloader",
           "can-bootloader-sim": "can-bootloader", "epuck-gateway": "epuck-gateway",
           "epuck-gateway-sim": "epuck-gateway", "roi-modules-sim": "roi-modules",
           "dexter-gateway": "dexter-gateway", "dexter-gateway-sim": "dexter-gateway"}
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


def config(tmp_path: Path, profiles: str, secrets_args: tuple[str, ...] = (), **env: str) -> dict:
    st = Stack("robobus-config-check", tmp_path, profiles=profiles, extra_env=env)
    st.make_secrets(*secrets_args)
    return yaml.safe_load(st.compose("config").stdout)


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


def test_new_services_join_the_sim_profile_only_when_their_package_exists(compose_ok, tmp_path):
    svcs = set(config(tmp_path, "sim")["services"])
    assert ("roi-modules-sim" in svcs) == (REPO / "services/roi_modules/sim.py").exists()
    assert ("dexter-gateway-sim" in svcs) == (REPO / "services/dexter_gateway/sim.py").exists()
    assert {"broker", "ethercat-loop-sim", "can-bootloader-sim", "epuck-gateway-sim", "epuck-sim"} <= svcs


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
