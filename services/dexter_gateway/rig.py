"""The dexter-gateway on its DexRun simulator, each in its own process (shared/simrig.py): what the conformance
suite (tests/conformance/) runs every fault against."""

from __future__ import annotations

import json

from shared.simrig import Ports, RigCommand, SimRig


def _arms(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_DEXTER_ARMS": json.dumps([{"id": "dexter1", "host": "127.0.0.1", "port": ports["dexrun"]}])}


RIG = SimRig(
    node_module="services.dexter_gateway",
    devices=("dexter1",),
    liveness_s=3.0,
    sim=lambda ports: ["-m", "services.dexter_gateway.sim", "--port", str(ports["dexrun"])],
    node_env=_arms,
    return_s=8.0,  # the reconnect back-off's cap (5 s) + the first status
    garbage_sim=lambda ports: ["-m", "shared.simrig", "garbage-tcp", "--port", str(ports["dexrun"])],
    read_command=RigCommand("dexter1", "heartbeat"),
    not_applicable={"wrong_kind": "DexRun has no identification: any other device is garbage to it (see garbage)"},
)
