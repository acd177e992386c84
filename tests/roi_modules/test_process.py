"""`python -m services.roi_modules` as a process: run_service, fail-safe SIGTERM, clear start-up errors."""

from __future__ import annotations

import json
from typing import Any

from services.roi_modules import protocol as p
from services.roi_modules.sim import RoiSim, SimModuleSpec
from shared.rpc import RpcClient
from tests.fixtures import Broker
from tests.roi_modules.conftest import fresh_prefix, wait_until
from tests.roi_modules.harness import BusRecorder

MAIN = ["-m", "services.roi_modules"]


def env_for(broker: Broker, prefix: str, modules: list[dict[str, Any]], **extra: str) -> dict[str, str]:
    return {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": f"roi-proc-{prefix.replace('.', '-')}",
            "ROBOBUS_ROI_NETWORK": prefix, "ROBOBUS_ROI_MODULES": json.dumps(modules),
            "ROBOBUS_HEALTH_INTERVAL_S": "1", **extra}


def test_sigterm_stops_the_odrive_before_going_offline(broker_session: Broker, spawn: Any) -> None:
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(20, "odrive")]).start()
    env = env_for(broker_session, prefix, [{"name": "wheel", "octet": 20, "type": "odrive"}])
    node = env["ROBOBUS_NODE"]
    client = RpcClient(broker_session.settings(), name="roi-proc-test")
    client.connect()
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{node}/#", bus.on)
    proc = spawn(MAIN, env)
    try:
        assert bus.wait("/wheel/health", lambda d: d["connection"], timeout=20) is not None, proc.text()
        assert client.call(node, "wheel", "set_velocity", {"velocity": 3.0}, timeout=10).ok
        assert wait_until(lambda: sim.call(20, lambda f: f.vel) > 2.0, 10)
        assert proc.stop() == 0, proc.text()
        assert sim.call(20, lambda f: (f.control_mode, f.vel_sp)) == (p.ControlMode.VELOCITY, 0.0)
        status = bus.wait("/status", lambda d: d["online"] is False)
        assert status is not None and status["reason"] == "shutdown"
        health = bus.latest("/wheel/health")
        assert health is not None and health["state"] == "stopped"
    finally:
        client.close()
        sim.close()


def test_an_address_not_on_this_host_is_one_clear_line_and_exit_2(broker_session: Broker, spawn: Any) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this host
    proc = spawn(MAIN, env_for(broker_session, "192.0.2", [{"name": "io", "octet": 5, "type": "gpio"}]))
    assert proc.proc.wait(30) == 2
    proc._reader.join(5)
    assert any("cannot bind 192.0.2.100:57344" in line for line in proc.output), proc.text()


def test_a_misspelt_setting_stops_the_process_at_start(broker_session: Broker, spawn: Any) -> None:
    proc = spawn(MAIN, env_for(broker_session, "127.0.2", [{"name": "io", "module_octet": 5, "type": "gpio"}]))
    assert proc.proc.wait(30) == 2
    proc._reader.join(5)
    assert "module_octet" in proc.text()
