"""The chaos stack runs beside a `make run` (or another chaos run) on the same host: every fixed resource of
deploy/Procfile.sim is a named variable with its default (`${ROBOBUS_PORT_<PROCESS>:-N}`, `${ROBOBUS_LINK_...}`,
the ROI network), and the stack gives each one of its own, free when chosen. Which simulator serves which node
follows the Procfile's naming (`<x>-sim` serves `<x>-...`), and every registered service has its node's line."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from shared.registry import service_packages
from shared.tools.simrig import is_link_variable, is_port_variable, procfile_variables
from tests.chaos.stack import ROI_OCTETS, ROI_PORTS, expand, own_resources, procfile_commands, sim_serves

_DEFAULTS = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-[^}]*\}")


def fixed_resources(command: str) -> list[str]:
    """The ports (numbers from 1024) and file-system paths of a command that no variable names."""
    bare = _DEFAULTS.sub(" ", command)
    found = [n for n in re.findall(r"(?<![\w.])(\d{4,5})(?![\w.])", bare) if 1024 <= int(n) <= 65535]
    return found + re.findall(r"(?<![\w./])/(?:tmp|dev|run)/[\w./-]+", bare)


def test_every_fixed_resource_of_the_procfile_is_a_named_variable() -> None:
    bad = {n: f for n, c in procfile_commands().items() if (f := fixed_resources(c))}
    assert not bad, (f"deploy/Procfile.sim: {bad} are fixed in the line; name each as a variable with its default, "
                     "${ROBOBUS_PORT_<PROCESS>:-N} for a port (${ROBOBUS_LINK_<PROCESS>:-/path} for a path), used "
                     "the same in the simulator's line and its node's (docs/kit.md, 'How to add a service')")
    # the rule catches what it is for
    assert fixed_resources("python -m x.sim --port 50000") == ["50000"]
    assert fixed_resources("X='[{\"port\":11001}]' python -m x") == ["11001"]
    assert fixed_resources("python -m x.sim --link /tmp/x-serial") == ["/tmp/x-serial"]
    assert fixed_resources("python -m x.sim --port ${ROBOBUS_PORT_X_SIM:-50000} --modules gpio:10") == []


def test_the_stack_gives_every_port_link_and_network_one_of_its_own(tmp_path: Path) -> None:
    procfile = procfile_commands()
    variables = procfile_variables(procfile.values())
    ports = [v for v in variables.values() if is_port_variable(v.name)]
    links = [v for v in variables.values() if is_link_variable(v.name)]
    assert ports and links, variables  # the e-puck and Dexter simulators' ports, the serial link
    commands, env = own_resources(procfile, tmp_path)
    for var in ports:
        base = int(env[var.name])
        assert base != int(var.default)
        for port in range(base, base + var.span):  # the whole run the lines use, e.g. the e-puck robots
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    for var in links:
        assert env[var.name].startswith(str(tmp_path)), env[var.name]
    for name, command in commands.items():
        words = " ".join(expand(command, env))
        for var in [*ports, *links]:
            assert not re.search(rf"(?<![\w/]){re.escape(var.default)}(?!\w)", words), (name, var, words)
    # the ROI processes take the network from the environment (the Procfile's ${ROBOBUS_ROI_NETWORK:-127.0.2})
    assert all("${ROBOBUS_ROI_NETWORK:-" in c for n, c in commands.items() if n.startswith("roi"))
    prefix = env["ROBOBUS_ROI_NETWORK"]
    assert prefix != variables["ROBOBUS_ROI_NETWORK"].default and prefix.startswith("127.")
    for octet in ROI_OCTETS:
        for port in ROI_PORTS:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((f"{prefix}.{octet}", port))


def test_a_simulator_and_its_node_agree_on_the_port(tmp_path: Path) -> None:
    # each port variable is used by a simulator and by the process it serves: the node reaches the simulator
    commands, env = own_resources(procfile_commands(), tmp_path)
    serves = sim_serves(commands)
    for var in procfile_variables(commands.values()).values():
        if not is_port_variable(var.name):
            continue
        users = {n for n, c in commands.items() if f"${{{var.name}:-" in c}
        sims = {n for n in users if n in serves}
        assert sims and all(serves[s] in users for s in sims), (var.name, users)
        words = {n: " ".join(expand(commands[n], env)) for n in users}
        assert all(env[var.name] in w for w in words.values()), words


def test_every_registered_service_has_its_node_in_the_procfile() -> None:
    procfile = procfile_commands()
    missing = {s: pkg for s, pkg in service_packages().items()
               if not re.search(rf"(^|\s)python -m {re.escape(pkg)}(\s|$)", procfile.get(s, ""))}
    assert not missing, (f"deploy/Procfile.sim has no line `<service>: python -m <package>` for {missing}: add the "
                         "node's line, named as the service (docs/kit.md, 'How to add a service')")


def test_each_simulator_of_the_procfile_is_the_device_side_of_one_registered_service() -> None:
    # the device-vanish fault watches only the devices of the process a simulator serves
    procfile = procfile_commands()
    packages = service_packages()
    serves = sim_serves(procfile)
    assert serves, "no simulator in the Procfile"
    for sim, node in serves.items():
        assert node in packages, f"{sim} serves {node}, which is no registered service ({sorted(packages)})"
        assert f"python -m {packages[node]}." in procfile[sim], (
            f"{sim} serves {node}: it runs a module of {packages[node]} (`python -m {packages[node]}.sim ...`)")
    with pytest.raises(ValueError, match="not one"):
        sim_serves(["x-sim", "x-gateway", "x-bridge"])
    with pytest.raises(ValueError, match="not one"):
        sim_serves(["y-sim", "ethercat-loop"])
