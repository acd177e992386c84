"""`python -m services.can_bootloader` as its own process (the make-run configuration: simulated boards on
in-process virtual buses): it flashes, and SIGTERM mid-flash cancels the job before the node goes offline."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from services.can_bootloader.sim import make_intel_hex
from shared.rpc import RpcClient, wait_for
from tests.fixtures import Broker

SMALL_HEX = make_intel_hex(0x1000, 0x13FF)


def test_process_flash_and_sigterm(broker_session: Broker, client: RpcClient, spawn: Any) -> None:
    name = f"canboot-proc-{time.monotonic_ns() % 1_000_000}"
    env = {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": name, "ROBOBUS_CAN_SIM": "true",
           "ROBOBUS_CAN_SIM_ERASE_S": "0.05", "ROBOBUS_CAN_SIM_BOARDS": "[4, 14]"}
    proc = spawn(["-m", "services.can_bootloader"], env)
    assert wait_for(lambda: any(json.loads(p).get("online") for _, p, _ in
                                client.collect_retained(f"robobus/{name}/status")), 15), proc.text()
    _rep, result = client.call_job(name, "motors", "flash", {"board": 14, "hex": SMALL_HEX}, lambda e: None,
                                   timeout=60)
    assert result is not None and result["ok"], result
    # a slow flash, then SIGTERM while it runs
    events: list[dict[str, Any]] = []
    client.subscribe_before(f"robobus/{name}/motors/event/#", lambda m: events.append(json.loads(m.payload)))
    started = threading.Event()
    client.subscribe_before(f"robobus/{name}/motors/event/job_progress",
                            lambda m: started.set() if json.loads(m.payload)["phase"] == "write" else None)
    rep = client.call(name, "motors", "flash", {"board": 4, "hex": make_intel_hex(), "window": 1})
    assert rep.ok
    assert started.wait(20), proc.text()
    t0 = time.monotonic()
    assert proc.stop(timeout=15) == 0, proc.text()
    assert time.monotonic() - t0 < 10
    assert wait_for(lambda: any(e.get("cancelled") for e in events if "cancelled" in e), 3), events[-3:]
    def offline() -> bool:
        got = [json.loads(p) for _, p, _ in client.collect_retained(f"robobus/{name}/status")]
        return bool(got) and got[-1]["online"] is False

    assert wait_for(offline, 5, 0.1)


def test_rig_node_and_boards_in_two_processes(broker_session: Broker, client: RpcClient, spawn: Any) -> None:
    """The conformance rig's configuration (services/can_bootloader/rig.py): the node and the simulated boards in
    separate processes on udp_multicast. Reads and a flash cross the processes; with the boards' process gone the
    adapter is still the healthy link (connection stays true, no error) and a read answers `timeout`."""
    from services.can_bootloader.rig import RIG
    from shared.tools.simrig import Ports

    why = RIG.needs() if RIG.needs else None
    assert why is None, why  # python-can[multicast] is in the can extra
    ports = Ports()
    name = f"canboot-rig-{time.monotonic_ns() % 1_000_000}"
    health: list[dict[str, Any]] = []
    client.subscribe_before(f"robobus/{name}/motors/health", lambda m: health.append(json.loads(m.payload)))
    sim = spawn(RIG.sim(ports), {})
    proc = spawn(["-m", RIG.node_module], {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": name,
                                           **RIG.node_env(ports)})
    assert wait_for(lambda: bool(health) and health[-1]["connection"], 20), (health[-1:], proc.text())
    assert health[-1]["details"]["link"]["liveness_s"] == RIG.liveness_s
    # the node's link is its adapter, healthy with or without boards: the boards answer once their process has
    # its bus open (a read before that times out: seen on a loaded host)
    assert wait_for(lambda: "bus open, answering" in sim.text(), 20), sim.text()
    assert RIG.read_command is not None
    rep = client.call(name, RIG.read_command.device, RIG.read_command.name, RIG.read_command.payload)
    assert rep.ok and rep.result["version"] == "40414243", (rep.error, sim.text())
    _rep, result = client.call_job(name, "motors", "flash", {"board": 3, "hex": SMALL_HEX}, lambda e: None,
                                   timeout=60)
    assert result is not None and result["ok"], result
    sim.stop(timeout=10)
    rep = client.call(name, "motors", "read_version", {"board": 3})
    assert not rep.ok and (rep.error or {})["code"] == "timeout", rep.error
    time.sleep(2 * RIG.liveness_s)  # longer than the budget: the adapter keeps proving itself
    assert health[-1]["connection"] and not any(h["error"] for h in health), health[-1]
