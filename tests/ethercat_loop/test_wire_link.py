"""The palm's link under the kit's link supervisor, on the real wire (root): the node's service in this process
(real broker), its cycle process with pysoem, and the virtual hand on a veth pair of its own
(`sim/veth_hand.py`) that comes and goes as the hand does, as in the conformance rig."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.ethercat_loop.api import API
from services.ethercat_loop.rig import needs
from services.ethercat_loop.service import build
from services.ethercat_loop.settings import EthercatSettings
from shared import Node
from shared.tools.localbroker import REPO
from tests.ethercat_loop.wire_fixtures import wait_for

pytestmark = pytest.mark.root
_n = itertools.count()
_why: list[str | None] = []
PROBE_S = 1.0


def skip_without_rig() -> None:
    if not _why:
        _why.append(needs())
    if _why[0]:
        pytest.skip(f"EtherCAT link tests: {_why[0]}")


def nic_name() -> str:
    return f"ecl{os.getpid() % 100000}x{next(_n)}"


def nic_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


@contextlib.contextmanager
def veth_hand(name: str, *hand_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """The hand on its own veth pair (master end `name`), in a session of its own; killed -9 at the end."""
    p = subprocess.Popen([sys.executable, "-m", "services.ethercat_loop.sim.veth_hand", "--master-if", name, "--",
                          "--rt-priority", "60", *hand_args], cwd=REPO, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: nic_exists(name) or p.poll() is not None, 30, f"the hand's veth pair {name}")
        assert p.poll() is None, f"veth_hand exited with {p.returncode}"
        yield p
    finally:
        kill(p)


def kill(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


@pytest.fixture
def service(broker_session: Any, client: Any) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The node's service on the NIC `name` (no hand yet), with a short probe period."""
    skip_without_rig()
    name = nic_name()
    settings = EthercatSettings(mqtt_url=broker_session.url, node=f"link{os.getpid()}", health_interval_s=1.0,
                                backend="virtual", ethercat_ifname=name, ethercat_expect_protocol="0220",
                                ethercat_probe_period_s=PROBE_S, ethercat_overrun_threshold=1_000_000,
                                ethercat_lost_threshold=1_000_000)
    node = Node(API, settings)
    svc = build(node, settings)
    health: list[dict[str, Any]] = []
    client.subscribe_before(f"robobus/{settings.node}/rh/health", lambda m: health.append(json.loads(m.payload)))
    node.start()
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    try:
        yield name, health
    finally:
        svc.shutdown()
        node.stop()
        t.join(5)


def latest(health: list[dict[str, Any]]) -> dict[str, Any]:
    return health[-1] if health else {}


def link(h: dict[str, Any]) -> dict[str, Any]:
    return dict((h.get("details") or {}).get("link") or {})


def test_the_veth_hand_leaves_nothing_behind_a_kill9_and_comes_back_under_the_same_name() -> None:
    skip_without_rig()
    name = nic_name()
    with veth_hand(name) as p:
        assert nic_exists(name)
        kill(p)  # the wrapper and the hand, as the conformance harness kills a simulator
        wait_for(lambda: not nic_exists(name), 10, f"{name} removed with the hand's namespace")
    with veth_hand(name) as p:  # the name is free again: a restarted simulator takes it
        assert nic_exists(name) and p.poll() is None
    wait_for(lambda: not nic_exists(name), 10, f"{name} removed")


def test_an_absent_palm_is_unreachable_probed_and_found_when_it_comes(service: Any) -> None:
    """No hand on the NIC: not an error; every bring-up attempt is counted; once past the liveness budget the
    palm is `unreachable` and probed once per probe period (not the back-off ladder); a hand that comes is
    running within a probe period and a bring-up."""
    name, health = service
    wait_for(lambda: latest(health).get("state") == "unreachable" and link(latest(health)).get("attempts", 0) >= 2,
             30, "unreachable with attempts counted")
    assert not [h for h in health if h["error"] or h["connection"]], health
    h = latest(health)
    assert "no such interface" in link(h)["last_failure"] or "no EtherCAT slave" in link(h)["last_failure"], h
    t0, n0 = time.monotonic(), link(h)["attempts"]
    # probed: a new attempt comes (a new cycle process: its start takes longer on a loaded host), and never more
    # often than once per probe period (health is published on change and each second)
    wait_for(lambda: link(latest(health))["attempts"] > n0, 10 * PROBE_S + 20, "probed")
    time.sleep(max(0.0, 3 * PROBE_S - (time.monotonic() - t0)))
    n, elapsed = link(latest(health))["attempts"] - n0, time.monotonic() - t0
    assert 1 <= n <= elapsed / PROBE_S + 1, f"{n} attempts in {elapsed:.1f} s (probe period {PROBE_S} s)"
    with veth_hand(name):
        wait_for(lambda: latest(health).get("state") == "running" and latest(health)["connection"], 30,
                 f"running after the hand came (last: {latest(health)})")
        assert not [h for h in health if h["error"]]


def test_garbage_on_the_nic_is_counted_and_never_connected(service: Any) -> None:
    name, health = service
    with veth_hand(name, "--garbage"):
        wait_for(lambda: link(latest(health)).get("garbage", 0) >= 1, 30, f"garbage counted ({latest(health)})")
        h = latest(health)
        assert "frames arrived during the scan, none a slave's answer" in link(h)["last_failure"], h
    assert not [h for h in health if h["error"] or h["connection"]], health


def test_a_palm_of_the_wrong_kind_is_an_error_that_says_so_until_the_right_one_comes(service: Any) -> None:
    name, health = service
    with veth_hand(name, "--protocol", "0230"):
        wait_for(lambda: latest(health).get("error"), 30, f"error for the wrong kind ({latest(health)})")
        t0 = len(health)
        time.sleep(2.5 * PROBE_S)  # probed again: the same error, no flapping
        h = latest(health)
        assert h["state"] == "error" and not h["connection"] and "not the palm configured" in h["error_message"], h
        assert "protocol 0230, but protocol 0220 is configured" in h["error_message"], h
        assert all(x["error"] for x in health[t0:]), health[t0:]
    with veth_hand(name):
        wait_for(lambda: latest(health).get("state") == "running" and not latest(health)["error"], 30,
                 f"running with the right palm ({latest(health)})")


def test_a_vanished_nic_is_rescanned_then_reconnected_on_the_link_rhythm(service: Any) -> None:
    """The hand killed with its NIC: the master sees that the NIC is not the one it opened and re-scans at once
    (not after the recover ladder), finds nothing, and its cycle process ends: the link is `lost`, then
    `unreachable` and probed by new cycle processes; the hand back under the same name is running again."""
    name, health = service
    with veth_hand(name) as p:
        wait_for(lambda: latest(health).get("state") == "running", 30, f"running ({latest(health)})")
        n0 = len(health)
        kill(p)
        wait_for(lambda: latest(health).get("state") == "unreachable", 15, f"unreachable ({latest(health)})")
    states = [h["state"] for h in health[n0:]]
    assert "lost" in states and not [h for h in health[n0:] if h["error"]], states
    steps = {s["step"] for h in health[n0:] for s in (h["details"].get("recovery") or {}).get("steps", [])}
    assert any(f"the NIC {name} vanished" in s for s in steps), steps
    with veth_hand(name):
        wait_for(lambda: latest(health).get("state") == "running", 30, f"running again ({latest(health)})")


def test_a_palm_hung_past_the_recover_ladder_is_lost_then_probed_and_back_when_it_answers(service: Any) -> None:
    """SIGSTOP of the hand (the NIC stays, frames go unanswered): `silent` within the budget, never an error; once
    the master's recover ladder has given up, its re-scan finds no slave and the cycle process ends (`lost`, then
    `unreachable`, probed by new cycle processes); the hand continued is running again."""
    name, health = service
    with veth_hand(name) as p:
        wait_for(lambda: latest(health).get("state") == "running", 30, f"running ({latest(health)})")
        n0 = len(health)
        os.killpg(p.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: latest(health).get("state") == "silent", 5, f"silent ({latest(health)})")
            wait_for(lambda: latest(health).get("state") == "unreachable", 40, f"unreachable ({latest(health)})")
            attempts = link(latest(health))["attempts"]
            # an attempt is a new cycle process that scans a hung slave (its retries): seconds, more on a loaded host
            wait_for(lambda: link(latest(health))["attempts"] > attempts, 3 * PROBE_S + 30, "probed again")
        finally:
            os.killpg(p.pid, signal.SIGCONT)
        wait_for(lambda: latest(health).get("state") == "running", 30, f"running again ({latest(health)})")
    states = [h["state"] for h in health[n0:]]
    errors = [(h["state"], h["error_message"]) for h in health[n0:] if h["error"]]
    assert "lost" in states and not errors, (states, errors)
