"""The dexter-gateway on its DexRun simulator, each in its own process (shared/tools/simrig.py): what the conformance
suite (tests/conformance/) runs every fault against. The arm runs on the service's default budget and rhythm."""

from __future__ import annotations

import json

from services.dexter_gateway.models import DexterArmConfig
from shared.tools.simrig import Footprint, Ports, RigCommand, SimRig

_DEFAULTS = DexterArmConfig(id="dexter1", host="127.0.0.1")


def _arms(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_DEXTER_ARMS": json.dumps([{"id": "dexter1", "host": "127.0.0.1", "port": ports["dexrun"]}])}


RIG = SimRig(
    node_module="services.dexter_gateway",
    devices=("dexter1",),
    liveness_s=_DEFAULTS.liveness_s,  # 3 s: the status poll's `g` (10 Hz) and its 2 s reply timeout fit in it
    sim=lambda ports: ["-m", "services.dexter_gateway.sim", "--port", str(ports["dexrun"])],
    node_env=_arms,
    # once unreachable the arm is probed once per probe period; the probe's connect and `g` answer in ms
    return_s=_DEFAULTS.probe_period_s + _DEFAULTS.reply_timeout_s,
    garbage_sim=lambda ports: ["-m", "shared.tools.simrig", "garbage-tcp", "--port", str(ports["dexrun"])],
    read_command=RigCommand("dexter1", "heartbeat"),
    not_applicable={"wrong_kind": "DexRun has no identification (no version or kind in any reply): another "
                                  "device at its port is garbage to the gateway (the garbage fault)"},
    footprint=Footprint(node_mb=45.0, total_mb=65.0, cpu_core=0.015),  # one arm's 10 Hz status poll
)
