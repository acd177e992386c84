"""The deploy/ scripts as the tests use them: make_secrets imported by path (deploy/ is not a package),
and the compose broker's own config turned into one a host mosquitto can run on a free loopback port."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


make_secrets = load("robobus_make_secrets", DEPLOY / "make_secrets.py")
requirements = load("robobus_requirements", DEPLOY / "docker" / "requirements.py")


def host_broker_conf(secrets_dir: Path, port: int, extra: str = "") -> str:
    """deploy/mosquitto/compose.conf with the secrets at `secrets_dir` and one listener on 127.0.0.1:port."""
    conf = (DEPLOY / "mosquitto" / "compose.conf").read_text()
    conf = conf.replace("/mosquitto/secrets/", f"{secrets_dir}/")
    conf = re.sub(r"^listener .*$\n^protocol .*$", "", conf, flags=re.M)
    conf = re.sub(r"^(persistence|persistence_location|autosave_interval|include_dir) .*$", "", conf, flags=re.M)
    return conf + f"\nuser root\npersistence false\nlistener {port} 127.0.0.1\nprotocol mqtt\n{extra}"
