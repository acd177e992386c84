"""The realtime container: the `hand` profile's ethercat-loop (not privileged; host network; NET_RAW,
NET_ADMIN, SYS_NICE, IPC_LOCK; cpuset; cpu_rt_runtime where the kernel needs it) against the virtual hand
in a second container on a veth pair (deploy/compose.vhand.yaml, deploy/vhand.sh). SCHED_FIFO is proven
inside the container, frames are lost no more than the product tolerates, and a container denied its
realtime budget still starts and says so in its health."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.ethercat_loop.settings import EthercatSettings
from shared.rpc import RpcClient
from shared.tools.localbroker import Broker, NodeProcess
from tests.deploy.conftest import TIMINGS
from tests.deploy.deployfiles import DEPLOY
from tests.deploy.stack import DOCKER, Stack, run
from tests.fixtures import can_netns, free_port

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.timeout(900)]
RT_GROUP = Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").exists()
# What the product itself tolerates: more lost frames than this in 1 s is a health error (backend.py).
LOST_PER_S = EthercatSettings.model_fields["ethercat_lost_threshold"].default
# ... and only when sustained this long (one bad second of a VM's vCPU stall is a warning, not an error)
LOSS_SUSTAIN_S = EthercatSettings.model_fields["ethercat_loss_sustain_s"].default
WINDOW = 8  # loop_stats messages (1 Hz) looked at


def _config(stack: Stack) -> dict:
    return yaml.safe_load(stack.compose("config").stdout)


@pytest.fixture(scope="module")
def vhand(images: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    why = can_netns()
    if why:
        pytest.skip(why)
    stack = Stack(f"robobus-rt-{os.getpid()}", tmp_path_factory.mktemp("rt-secrets"), profiles="hand",
                  extra_env={"ROBOBUS_VHAND": "1", "ROBOBUS_ETHERCAT_IFNAME": f"ecm{os.getpid() % 10000}",
                             "ROBOBUS_VHAND_IFNAME": f"ech{os.getpid() % 10000}",
                             "ROBOBUS_FIRMWARE_DIR": str(tmp_path_factory.mktemp("firmware"))})
    stack.make_secrets()
    try:
        t0 = time.monotonic()
        run([str(DEPLOY / "vhand.sh"), "up", "--wait-timeout", "300"], stack.env, timeout=400)
        TIMINGS["rt_up_to_healthy_s"] = time.monotonic() - t0
    except Exception:
        print(stack.logs())
        stack.down()
        raise
    yield stack
    stack.down()


# services of a vhand stack whose ethercat-loop runs without its realtime budget (set by the fallback test)
WITHOUT_BUDGET: set[str] = set()


@pytest.fixture
def granted(vhand: Stack) -> Stack:
    """The vhand stack with ethercat-loop at its granted realtime budget: recreated only if a test took it
    away (the fallback test runs last and leaves it, the stack goes down after it)."""
    if vhand.name in WITHOUT_BUDGET:
        run([str(DEPLOY / "vhand.sh"), "up", "--no-deps", "--force-recreate", "ethercat-loop"], vhand.env, timeout=300)
        WITHOUT_BUDGET.discard(vhand.name)
    return vhand


def loop_window(stack: Stack, n: int = WINDOW) -> tuple[list[dict], dict]:
    """n loop_stats messages after the first (retained) one, and the latest health."""
    stats: list[dict] = []
    health: dict = {}
    with RpcClient(stack.settings("viewer"), name="test-rt") as c:
        def until(topic: str, payload: bytes) -> bool:
            d = json.loads(payload)
            if topic.endswith("/health"):
                health.update(d)
            elif topic.endswith("/state/loop_stats"):
                stats.append(d)
            return len(stats) > n
        c.collect(f"{stack.root}/ethercat-loop/rh/#", n * 4 + 30, until=until)
    return stats[1:], health


def test_the_hand_profile_is_the_realtime_container_not_privileged(docker_ready: str, tmp_path: Path):
    stack = Stack("robobus-rt-config", tmp_path, profiles="hand")
    stack.make_secrets()
    svc = _config(stack)["services"]["ethercat-loop"]
    assert not svc.get("privileged")
    assert svc["network_mode"] == "host"
    assert sorted(svc["cap_add"]) == ["IPC_LOCK", "NET_ADMIN", "NET_RAW", "SYS_NICE"]
    assert svc["cap_drop"] == ["ALL"]
    assert svc["cpuset"]
    assert svc["environment"]["ROBOBUS_ETHERCAT_IFNAME"]  # what the service reads (not _IFACE)
    # Docker's default seccomp profile: no custom or unconfined profile (it costs no frames: deploy/README.md)
    assert not any(o.startswith("seccomp") for o in svc["security_opt"]), svc["security_opt"]
    assert "no-new-privileges:true" in svc["security_opt"]
    limits = Path(f"/proc/{run(['pgrep', '-xo', 'dockerd']).stdout.strip()}/limits").read_text()
    rtprio_hard = next(line.split()[4] for line in limits.splitlines() if line.startswith("Max realtime priority"))
    if rtprio_hard not in ("unlimited",) and int(rtprio_hard) < 90:  # this host: hard limits cannot be raised
        assert "ulimits" not in svc, "ulimits the daemon cannot grant keep the container from starting"
    if RT_GROUP:
        dockerd = run(["pgrep", "-xo", "dockerd"]).stdout.strip()
        if "--cpu-rt-runtime" in Path(f"/proc/{dockerd}/cmdline").read_text():
            assert int(svc["cpu_rt_runtime"]) > 0


def test_sched_fifo_inside_the_container_and_frames_as_outside(granted: Stack):
    vhand = granted
    stats, health = loop_window(vhand)
    rt = health["details"]["realtime"]
    assert rt["policy"].startswith("SCHED_FIFO/"), rt
    assert rt["warnings"] == [], rt
    # The kernel's view, from the host: a SCHED_FIFO thread among the container's processes.
    cid = vhand.container_id("ethercat-loop")
    top = run([DOCKER, "top", cid, "-eLo", "pid,cls,rtprio,comm"]).stdout
    assert any(line.split()[1] == "FF" for line in top.splitlines()[1:]), top
    lost = [s["frames_lost"] for s in stats]
    cycles = [s["cycles"] for s in stats]
    TIMINGS["rt_lost_per_s_max"] = max(lost)
    TIMINGS["rt_lost_fraction"] = sum(lost) / max(1, sum(cycles))
    broken = loss_rule_broken(lost, cycles)
    if broken:
        # The target is "no more than outside containers": when the machine itself loses frames (minutes of
        # ~200 lost per second on both sides were seen under other sessions' load), the same cycle outside,
        # measured right after with the same settings, breaks the rule as well. The container fails only if
        # it breaks the rule where the cycle outside does not.
        vhand.compose("stop", "-t", "10", "ethercat-loop", timeout=120)  # one cycle on CPU 1 at a time
        try:
            outside = outside_window(len(stats))
        finally:
            vhand.compose("start", "ethercat-loop", timeout=120)
        TIMINGS["rt_outside_lost_per_s_max"] = max(outside[0])
        if not loss_rule_broken(*outside):
            # The host's load moves between the two windows (other work beside a test run comes and goes): the
            # container again, after its bring-up, as the cycle outside was measured. A container that loses where
            # the cycle outside does not breaks the rule in this window too.
            again = loop_window(vhand, WINDOW + 3)[0][3:]
            lost_again = [s["frames_lost"] for s in again]
            assert not loss_rule_broken(lost_again, [s["cycles"] for s in again]), (
                f"container: {broken}; outside right after: within the rule; the container again: "
                f"{loss_rule_broken(lost_again, [s['cycles'] for s in again])}", lost, outside[0], lost_again)
    else:  # (a loss over the rule is a health error: operational says so)
        assert health["operational"] is True, health


def loss_rule_broken(lost: list[int], cycles: list[int]) -> str:
    """The product's own error rule over 1 s windows: over the threshold for LOSS_SUSTAIN_S seconds in a row
    (a single second over it, a burst of 5-12 frames when this VM stalls a vCPU, is not), or systematic loss
    (the 26 % once seen). Empty when neither."""
    longest = run_len = 0
    for n in lost:
        run_len = run_len + 1 if n > LOST_PER_S else 0
        longest = max(longest, run_len)
    if longest >= LOSS_SUSTAIN_S:
        return f"over {LOST_PER_S} lost/s for {longest} s in a row"
    if sum(lost) / max(1, sum(cycles)) >= 0.01:
        return f"{sum(lost)} of {sum(cycles)} frames lost"
    return ""


def outside_window(n: int) -> tuple[list[int], list[int]]:
    """n 1 s windows of the same cycle outside containers: backend `virtual` (its own namespace, veth pair and
    virtual hand), cycle SCHED_FIFO 80 on CPU 1, hand SCHED_FIFO 70 on CPU 0, as in the vhand stack."""
    with tempfile.TemporaryDirectory() as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        node = NodeProcess(["-m", "services.ethercat_loop"], {
            "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_ETHERCAT_BACKEND": "virtual", "ROBOBUS_ETHERCAT_CPUS": "[1]",
            "ROBOBUS_ETHERCAT_RT_PRIORITY": "80", "ROBOBUS_ETHERCAT_VIRTUAL_ARGS": '["--cpus", "0"]'})
        try:
            stats: list[dict] = []
            with RpcClient(broker.settings(), name="test-rt-outside") as c:
                def until(topic: str, payload: bytes) -> bool:
                    d = json.loads(payload)
                    if d.get("cycles"):
                        stats.append(d)
                    return len(stats) > n + 2  # the first windows are the bring-up's
                c.collect("robobus/ethercat-loop/rh/state/loop_stats", n * 4 + 60, until=until)
        finally:
            node.stop()
            broker.kill()
    stats = stats[3:]
    return [s["frames_lost"] for s in stats], [s["cycles"] for s in stats]


def test_without_a_realtime_budget_the_container_starts_and_says_so_in_health(vhand: Stack):
    if not RT_GROUP:
        pytest.skip("kernel without RT group scheduling: a container is never denied a realtime budget here")
    env = {**vhand.env, "ROBOBUS_ETHERCAT_RT_RUNTIME_US": "0"}
    WITHOUT_BUDGET.add(vhand.name)
    run([str(DEPLOY / "compose.sh"), "up", "-d", "--no-deps", "--force-recreate", "ethercat-loop"], env, timeout=300)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _, health = loop_window(vhand, 1)
        warnings = health.get("details", {}).get("realtime", {}).get("warnings", [])
        if any("SCHED_FIFO" in w for w in warnings):
            break
    assert any("SCHED_FIFO" in w and "refused" in w for w in warnings), health
    assert "SCHED_FIFO" in health["error_message"]
