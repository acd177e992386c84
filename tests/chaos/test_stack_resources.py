"""The chaos stack runs beside a `make run` (or another chaos run) on the same host: every fixed resource of
deploy/Procfile.sim (the e-puck simulator's ports, the serial link, the ROI network, DexRun's port) is
replaced by one of the stack's own, free when chosen."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.chaos.stack import ROI_OCTETS, ROI_PORTS, own_resources, procfile_commands, sim_serves


def test_no_fixed_port_link_or_network_of_the_procfile_is_left(tmp_path: Path) -> None:
    procfile = procfile_commands()
    joined = " ".join(procfile.values())
    fixed = ("11000", "11001", "50000", "/tmp/robobus-epuck-serial", "127.0.2")
    assert all(f in joined for f in fixed), "the Procfile changed: update tests/chaos/stack.py"
    commands, env = own_resources(procfile, tmp_path)
    for name, command in commands.items():
        for f in ("11000", "11001", "50000"):
            assert not re.search(rf"\b{f}\b", command), (name, command)
        assert "/tmp/robobus-epuck-serial" not in command, (name, command)
    # the ROI processes take the network from the environment (the Procfile's ${ROBOBUS_ROI_NETWORK:-127.0.2})
    assert all("${ROBOBUS_ROI_NETWORK:-" in c for n, c in commands.items() if n.startswith("roi"))
    prefix = env["ROBOBUS_ROI_NETWORK"]
    assert prefix != "127.0.2" and prefix.startswith("127.")
    for octet in ROI_OCTETS:
        for port in ROI_PORTS:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((f"{prefix}.{octet}", port))
    # the e-puck ports are consecutive (the simulator's --base-port serves base, base + 1) and free
    sim = commands["epuck-sim"]
    base = int(re.search(r"--base-port (\d+)", sim).group(1))  # type: ignore[union-attr]
    assert f'"port":{base}}}' in commands["epuck-gateway"] and f'"port":{base + 1}}}' in commands["epuck-gateway"]
    for port in (base, base + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_each_simulator_of_the_procfile_is_the_device_side_of_one_process() -> None:
    # the device-vanish fault watches only the devices of the process a simulator serves
    assert sim_serves(procfile_commands()) == {"epuck-sim": "epuck-gateway", "roi-sim": "roi-modules",
                                               "dexter-sim": "dexter-gateway"}
    with pytest.raises(ValueError, match="not one"):
        sim_serves(["x-sim", "x-gateway", "x-bridge"])
    with pytest.raises(ValueError, match="not one"):
        sim_serves(["y-sim", "ethercat-loop"])
