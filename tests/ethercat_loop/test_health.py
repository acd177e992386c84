"""Health and fault events with faults injected into the palm model (node in-process, real broker)."""

import json
import threading

import pytest

from services.ethercat_loop.backend import EthercatSettings, InProcessBackend, make_backend
from services.ethercat_loop.service import API, PalmService
from shared import Node
from shared.asyncapi import ContractValidator, build_document
from shared.rpc import wait_for


@pytest.fixture
def service(broker_session, client):
    settings = EthercatSettings(mqtt_url=broker_session.url, node="hand-h", health_interval_s=1.0,
                                ethercat_silent_motor_ms=100,
                                ethercat_overrun_threshold=1_000_000)  # a busy test machine is not under test
    backend = make_backend(settings)
    assert isinstance(backend, InProcessBackend)
    node = Node(API, settings)
    svc = PalmService(node, backend, settings)
    health: list[dict] = []
    seen: list[tuple[str, bytes]] = []

    def on(msg):
        seen.append((msg.topic, bytes(msg.payload)))
        if msg.topic.endswith("/health"):
            health.append(json.loads(msg.payload))

    client.subscribe_before("robobus/hand-h/#", on)
    node.start()
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    yield backend, health, seen
    svc.shutdown()
    node.stop()
    t.join(2)


def latest(health):
    return health[-1] if health else {}


def test_health_reports_faults_and_recovers(service):
    backend, health, seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["operational"], 10)
    assert latest(health)["details"]["product"] == 6 and latest(health)["connection"]

    backend.model.overheat_motor(6)
    assert wait_for(lambda: "over_temperature" in latest(health).get("error_message", ""), 5)
    h = latest(health)
    assert h["error"] and not h["operational"] and "motor 6" in h["error_message"]
    faults = [json.loads(p) for t, p in seen if t.endswith("/event/motor_fault")]
    assert faults and faults[0]["motor"] == 6 and "over_temperature" in faults[0]["serious"]
    backend.model.overheat_motor(6, on=False)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    backend.model.silence_motor(11)
    assert wait_for(lambda: "motor 11" in latest(health).get("error_message", ""), 5)
    backend.model.silence_motor(11, silent=False)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    backend.lose_next = 5
    assert wait_for(lambda: "frames lost" in latest(health).get("error_message", ""), 5)
    backend.model.drop_status(50)
    assert wait_for(lambda: "dropped statuses" in latest(health).get("error_message", ""), 5)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    validator = ContractValidator(build_document())
    for topic, payload in list(seen):
        validator.validate(topic, payload)
