"""`make up` for real: the sim profile in containers (every service on its simulator, behind the
password-protected broker), checked over MQTT from the host, then stopped cleanly."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.rpc import RpcClient
from tests.deploy.conftest import TIMINGS
from tests.deploy.mqttprobe import Probe, creds
from tests.deploy.stack import DOCKER, Stack, compose_services, device_simulators, expected_nodes, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ONLINE_WAIT_S = 120.0


@pytest.fixture(scope="module")
def sim(images: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # the sim profile with the bus recorder (profile record) beside it
    stack = Stack(f"robobus-test-{__import__('os').getpid()}", tmp_path_factory.mktemp("sim-secrets"),
                  profiles="sim,record", extra_env={"ROBOBUS_RECORD_MAX_DURATION_S": "600"})
    stack.make_secrets()
    stack.down()
    try:
        stack.up()
    except Exception:
        print(stack.logs())
        stack.down()
        raise
    TIMINGS.update({f"sim_{k}": v for k, v in stack.timings.items()})
    yield stack
    stack.down()


def statuses(stack: Stack, user: str = "viewer") -> dict[str, dict[str, object]]:
    with RpcClient(stack.settings(user), name="test-deploy") as c:
        want = set(expected_nodes())
        seen: dict[str, dict[str, object]] = {}

        def until(topic: str, payload: bytes) -> bool:
            seen[topic.split("/")[-2]] = json.loads(payload)
            return want <= {n for n, s in seen.items() if s.get("online")}

        c.collect(f"{stack.root}/+/status", ONLINE_WAIT_S, until=until)
    return seen


def test_every_node_online_and_every_container_healthy(sim: Stack):
    seen = statuses(sim)
    for node in expected_nodes():
        assert seen.get(node, {}).get("online") is True, (node, seen.get(node), sim.logs())
    states = {c["Service"]: c for c in sim.containers()}
    assert "foxglove" in states, sorted(states)  # `robobus foxglove` is part of make up's sim profile
    # a device simulator (a service's `<package>.sim`) speaks its device's protocol, not MQTT: the one kind of
    # container without a healthcheck; every other one has one (the recorder's: a recording open in its volume)
    unchecked = {svc for svc, spec in compose_services().items() if "healthcheck" not in spec}
    assert unchecked == device_simulators(), "a container other than a device simulator has no healthcheck"
    for svc, c in states.items():
        assert c["State"] == "running", (svc, c)
        if svc not in unchecked:
            assert c.get("Health") == "healthy", (svc, c)


def test_a_command_round_trip_through_the_containerised_broker(sim: Stack):
    with RpcClient(sim.settings("operator"), name="test-deploy-op") as c:
        rep = c.call("epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0}, timeout=30)
        assert rep.ok, rep
        rep = c.call("ethercat-loop", "rh", "nullify_demands", {}, timeout=30)
        assert rep.ok or rep.error, rep  # answered by the node (the contract's reply, either way)


def test_the_viewer_cannot_command_and_anonymous_is_refused(sim: Stack):
    anon = Probe("127.0.0.1", sim.port)
    assert anon.connect() != 0
    anon.close()
    # the broker drops the viewer's request: no node ever sees it
    with RpcClient(sim.settings("viewer"), name="test-deploy-viewer") as c, pytest.raises(TimeoutError):
        c.call("epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0}, timeout=3)


def test_a_service_cannot_publish_under_another_nodes_topics_in_the_stack(sim: Stack):
    viewer = Probe("127.0.0.1", sim.port, *creds(sim.secrets, "viewer"))
    assert viewer.connect() == 0
    viewer.subscribe(f"{sim.root}/#")
    forger = Probe("127.0.0.1", sim.port, *creds(sim.secrets, "epuck-gateway"))
    assert forger.connect() == 0
    forger.publish(f"{sim.root}/ethercat-loop/rh/state/forged", b"{}")
    forger.publish(f"{sim.root}/epuck-gateway/epuck1/state/sentinel", b"{}")
    assert viewer.wait_for(lambda t, p, r: t.endswith("/sentinel"), 30)
    assert not any(t.endswith("/forged") for t in viewer.topics())
    viewer.close()
    forger.close()


def test_containers_are_locked_down(sim: Stack):
    """Non-root, read-only root file system, every capability dropped, no new privileges."""
    for svc in ("ethercat-loop-sim", "can-bootloader-sim", "epuck-gateway-sim", "broker"):
        cid = sim.container_id(svc)
        info = json.loads(run([DOCKER, "inspect", cid]).stdout)[0]
        hc = info["HostConfig"]
        assert hc["ReadonlyRootfs"] is True, svc
        assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"], (svc, hc["CapAdd"])
        assert "no-new-privileges:true" in hc["SecurityOpt"], svc
        assert hc["Privileged"] is False, svc
        uid = run([DOCKER, "exec", cid, "id", "-u"]).stdout.strip()
        assert uid != "0", svc


def test_image_sizes_are_lean(sim: Stack):
    """Each service image carries only its own extra: no pysoem or numpy in the e-puck gateway, no Pillow
    in the EtherCAT image."""
    def has(image: str, module: str) -> bool:
        code = f"import importlib.util,sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
        return run([DOCKER, "run", "--rm", image, "python3", "-c", code], check=False).returncode == 0
    checks = {("epuck-gateway", "PIL"): True, ("epuck-gateway", "pysoem"): False, ("epuck-gateway", "numpy"): False,
              ("ethercat-loop", "pysoem"): True, ("ethercat-loop", "PIL"): False}
    with ThreadPoolExecutor(len(checks)) as pool:  # one short container each, side by side
        found = dict(zip(checks, pool.map(lambda c: has(f"robobus/{c[0]}:dev", c[1]), checks), strict=True))
    assert found == checks
    sizes = {}
    for img in ("broker", "ethercat-loop", "can-bootloader", "epuck-gateway", "epuck-sim"):
        sizes[img] = int(run([DOCKER, "image", "inspect", "-f", "{{.Size}}", f"robobus/{img}:dev"]).stdout) / 1e6
    TIMINGS.update({f"image_{k}_MB": v for k, v in sizes.items()})


def test_the_recorder_records_the_sim_stack_into_its_volume(sim: Stack, tmp_path: Path):
    """Profile `record`: after a command, stopping the recorder (SIGTERM closes the MCAP file cleanly) leaves
    in its volume a recording of every node's status and the command with its reply."""
    with RpcClient(sim.settings("operator"), name="test-deploy-rec") as c:
        assert c.call("epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0}, timeout=30).ok
    time.sleep(2)  # the recorder flushes every second (ROBOBUS_RECORD_FLUSH_S)
    sim.compose("stop", "-t", "30", "recorder", timeout=120)
    cid = sim.compose("ps", "-aq", "recorder").stdout.strip()
    run([DOCKER, "cp", f"{cid}:/recordings", str(tmp_path)])
    files = sorted((tmp_path / "recordings").glob("*.mcap"))
    assert files, list((tmp_path / "recordings").iterdir())
    from shared.tools.replay import inspect
    topics: set[str] = set()
    for f in files:
        topics |= {ch.topic for ch in inspect(f).channels}
    for node in expected_nodes():
        assert f"{sim.root}/{node}/status" in topics, (node, sorted(topics))
    assert f"{sim.root}/epuck-gateway/epuck1/cmd/set_speed" in topics, sorted(topics)
    assert any(t.startswith(f"{sim.root}/_client/") and t.endswith("/reply") for t in topics), sorted(topics)
    sim.compose("start", "recorder", timeout=120)


def test_stop_is_fail_safe_every_node_says_offline_on_shutdown(sim: Stack, tmp_path: Path):
    """`make down` sends SIGTERM: each node runs its fail-safe hooks and publishes online=false itself
    (reason shutdown), not by its Last Will."""
    # one `compose stop`: the three stop side by side, each with its own SIGTERM and grace period
    sim.compose("stop", "-t", "20", "epuck-gateway-sim", "ethercat-loop-sim", "can-bootloader-sim", timeout=120)
    deadline = time.monotonic() + 30
    seen: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline:
        with RpcClient(sim.settings("viewer"), name="test-deploy-down") as c:
            for topic, payload, _ in c.collect_retained(f"{sim.root}/+/status"):
                seen[topic.split("/")[-2]] = json.loads(payload)
        if all(seen.get(n, {}).get("online") is False for n in ("epuck-gateway", "ethercat-loop", "can-bootloader")):
            break
        time.sleep(0.3)
    for n in ("epuck-gateway", "ethercat-loop", "can-bootloader"):
        assert seen[n]["online"] is False and seen[n].get("reason") == "shutdown", (n, seen[n])


def test_make_down_clears_the_retained_device_data_and_keeps_the_offline_statuses(sim: Stack):
    """deploy/down.sh (`make down`): after it, a broker started again on the same data holds no health or state of
    the stopped nodes' devices (a later profile never shows them as current), but each node's status, offline."""
    from tests.deploy.deployfiles import DEPLOY

    root = sim.root
    with RpcClient(sim.settings("viewer"), name="test-deploy-before-down") as c:
        before = {t for t, _, r in c.collect_retained(f"{root}/#") if r}
    assert any(t.endswith("/health") for t in before) and any("/state/" in t for t in before), sorted(before)
    out = run([str(DEPLOY / "down.sh")], sim.env, timeout=300)
    assert "cleared the retained device data" in out.stdout, out.stdout + out.stderr
    sim.up("broker")  # the same broker data volume (down.sh keeps it)
    with RpcClient(sim.settings("viewer"), name="test-deploy-after-down") as c:
        after = {t: p for t, p, r in c.collect_retained(f"{root}/#") if r}
    devices = [t for t in after if len(t[len(root) + 1:].split("/")) > 2]
    assert not devices, devices
    for node in expected_nodes():
        assert json.loads(after[f"{root}/{node}/status"])["online"] is False, (node, after.get(f"{root}/{node}/status"))
