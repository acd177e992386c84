"""The deploy/ scripts as the tests use them: make_secrets imported by path (deploy/ is not a package),
and the compose broker's own config turned into one a host mosquitto can run on a free loopback port."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
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


PLUGIN_SRC = DEPLOY / "mosquitto" / "robobus_auth.c"
PLUGIN_IMAGE_PATH = "/usr/lib/robobus/robobus_auth.so"  # where broker.Dockerfile puts it


def broker_plugin() -> Path:
    """deploy/mosquitto/robobus_auth.c built for the host's mosquitto (Debian's mosquitto-dev, libmosquitto-dev and
    gcc: deploy/dev/system-deps.sh installs them), once per source version, as broker.Dockerfile builds it."""
    digest = hashlib.sha256(PLUGIN_SRC.read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"robobus_auth-{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(tmp),
                               str(PLUGIN_SRC), "-lmosquitto"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {PLUGIN_SRC} failed (deploy/dev/system-deps.sh installs gcc, "
                               f"mosquitto-dev, libmosquitto-dev):\n{proc.stderr}")
        tmp.replace(out)
    return out


def host_broker_conf(secrets_dir: Path, port: int, extra: str = "") -> str:
    """deploy/mosquitto/compose.conf with the secrets at `secrets_dir`, the broker plugin built for the host and
    one listener on 127.0.0.1:port."""
    conf = (DEPLOY / "mosquitto" / "compose.conf").read_text()
    conf = conf.replace("/mosquitto/secrets/", f"{secrets_dir}/")
    conf = conf.replace(PLUGIN_IMAGE_PATH, str(broker_plugin()))
    conf = re.sub(r"^listener .*$\n^protocol .*$", "", conf, flags=re.M)
    conf = re.sub(r"^(persistence|persistence_location|autosave_interval|autosave_on_changes|include_dir) .*$", "",
                  conf, flags=re.M)
    return conf + f"\nuser root\npersistence false\nlistener {port} 127.0.0.1\nprotocol mqtt\n{extra}"
