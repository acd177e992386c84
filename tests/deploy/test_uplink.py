"""deploy/uplink.py, a fleet site's budget for its states over the bridge: the budget's logic on a fake clock,
then on host mosquittos (a centre, a site with the generated bridge.conf, ACL and plugin, the uplink under its
own user): a 100 Hz state reaches the centre at <= 2 Hz and ends on the newest value, the camera's frames never,
health at once; the centre's operator asks for full rate and gets it, then the default again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deployfiles import DEPLOY, load
from tests.deploy.mqttprobe import Probe, creds
from tests.deploy.stack import bridged_host_brokers

uplink = load("robobus_uplink", DEPLOY / "uplink.py")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def budget(hz: float = 2.0) -> tuple[Any, Clock, list[tuple[str, bytes]]]:
    clock, sent = Clock(), []
    b = uplink.Budget(hz, {"image"}, lambda t, p, r, props: sent.append((t, p)), clock)
    return b, clock, sent


def test_at_most_hz_per_topic_and_always_ending_on_the_newest_value():
    b, clock, sent = budget(2.0)
    for i in range(100):  # 100 Hz for 1 s
        b.state("r/n/d/state/joints", str(i).encode(), False, None)
        b.state("r/n/d/state/image", b"jpeg", False, None)
        clock.t += 0.01
        b.tick()
    clock.t += 0.5
    b.tick()
    got = [p for t, p in sent]
    assert len(got) <= 3 and got[0] == b"0" and got[-1] == b"99", got  # 2 Hz over 1 s, then the newest
    assert all(t.endswith("/joints") for t, _ in sent) and b.counts["dropped"] == 100
    b.tick()
    assert len(sent) == len(got)  # nothing sent twice


def test_a_large_state_waits_for_its_byte_budget():
    clock, sent = Clock(), []
    b = uplink.Budget(2.0, set(), lambda t, p, r, props: sent.append((t, p)), clock, bytes_s=4096)
    big = b"x" * 12288  # 3 s of a 4 kB/s budget
    for _ in range(1000):  # 100 Hz for 10 s
        b.state("r/n/d/state/motors", big, False, None)
        clock.t += 0.01
        b.tick()
    assert 3 <= len(sent) <= 5, len(sent)  # once every 3 s, not twice a second


def test_full_rate_on_request_then_the_default_again_and_bad_requests_are_counted():
    b, clock, sent = budget(2.0)
    assert b.request(b'{"state_hz": 0, "drop": [], "for_s": 10}') == "ok"
    for i in range(10):
        b.state("r/n/d/state/joints", str(i).encode(), False, None)
    b.state("r/n/d/state/image", b"jpeg", False, None)
    assert len(sent) == 11
    clock.t += 11
    b.tick()
    b.state("r/n/d/state/image", b"jpeg", False, None)
    assert len(sent) == 11 and b.hz == 2.0
    for bad in (b"not json", b"[1]", b'{"state_hz": -1}', b'{"for_s": 99999}', b'{"drop": "image"}'):
        assert b.request(bad).startswith("refused")
    assert b.counts["bad_requests"] == 5 and b.hz == 2.0


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[int, Path, int, Path]]:
    """(centre port, centre secrets, site port, site secrets): stack.bridged_host_brokers."""
    with bridged_host_brokers(tmp_path) as fleet:
        yield fleet


def test_on_real_brokers_the_centre_gets_states_within_the_budget_health_at_once_and_full_rate_on_request(site):
    cport, central, eport, edge = site
    root = "site-a/robobus"
    u, p = creds(edge, "uplink")
    settings = uplink.UplinkSettings(mqtt_url=f"mqtt://127.0.0.1:{eport}", mqtt_username=u, mqtt_password=p,
                                     topic_root=root, uplink_ready_file=edge / "ready")
    stop = threading.Event()
    th = threading.Thread(target=uplink.run, args=(settings, stop), daemon=True)
    th.start()
    centre = Probe("127.0.0.1", cport, *creds(central, "viewer"))
    assert centre.connect() == 0 and centre.subscribe(f"{root}/#") == [1]
    node = Probe("127.0.0.1", eport, *creds(edge, "ethercat-loop"))
    assert node.connect() == 0
    op = Probe("127.0.0.1", cport, *creds(central, "operator"))
    assert op.connect() == 0
    joints, image, health = (f"{root}/ethercat-loop/rh/{t}" for t in ("state/joints", "state/image", "health"))
    try:
        deadline = time.monotonic() + 20
        while not (edge / "ready").exists():  # the uplink subscribed
            assert time.monotonic() < deadline, "the uplink did not subscribe"
            time.sleep(0.05)
        # the bridge is up once a heartbeat arrived at the centre
        assert centre.wait_for(lambda t, p, r: t.endswith("/_bridge/uptime"), 20), centre.topics()

        def burst(seconds: float) -> int:
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                node.client.publish(joints, json.dumps({"seq": n}).encode(), qos=0)
                node.client.publish(image, b"\xff\xd8jpeg", qos=0)
                n += 1
                time.sleep(0.01)
            return n

        mark = centre.mark()
        t_health = time.monotonic()
        node.publish(health, b'{"operational": true}')
        assert centre.wait_for(lambda t, p, r: t == health, 10, mark)
        health_s = time.monotonic() - t_health
        sent = burst(3.0)
        last = json.dumps({"seq": sent - 1}).encode()
        assert centre.wait_for(lambda t, p, r: t == joints and p == last, 10, mark), "the newest value never came"
        got = [p for t, p, _ in centre.received[mark:] if t == joints]
        assert 2 <= len(got) <= 2 * 3 + 3, (len(got), sent)  # ~2 Hz over 3 s (+ slack for the slot edges)
        assert image not in centre.topics(), "camera frames crossed the uplink"
        assert health_s < 2.0, health_s  # health is not held back (generous: a busy machine)
        # full rate on request, from the centre, over the bridge
        op.publish(f"{root}/_uplink/set", b'{"state_hz": 0, "drop": [], "for_s": 30}')
        time.sleep(1.0)  # the request crosses the bridge (no acknowledgement to wait on)
        mark = centre.mark()
        sent = burst(2.0)
        last = json.dumps({"seq": sent - 1}).encode()
        assert centre.wait_for(lambda t, p, r: t == joints and p == last, 10, mark)
        full = [p for t, p, _ in centre.received[mark:] if t == joints]
        assert len(full) > sent // 2, (len(full), sent)  # QoS 0: most, not necessarily all
        assert image in centre.topics()[mark:]
    finally:
        stop.set()
        th.join(10)
        for pr in (centre, node, op):
            pr.close()
