"""A network partition between a node and its broker: two network namespaces of the test's own, the broker in
one, an e-puck gateway and its simulated robot in the other, joined by a veth pair that the fault takes down.

Invariants: the robot, moving when the link is cut, is stopped by the gateway's own deadman (nobody can renew its
speed); the broker declares the node offline by its Last Will once the keepalive lapses; the node is online
again within 3 s of the link's return. Needs root (namespaces); traffic stays inside the two namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from shared.tools.localbroker import REPO, mosquitto_bin
from tests.chaos.faults import BROKER_RETURN_S, EPUCK_MOTION_TIMEOUT_S, SLACK_S, FaultResult, _fmt

KEEPALIVE_S = 5  # the partitioned node's MQTT keepalive: the broker gives up after 1.5 x this


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Rig:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns_broker, self.ns_node = f"rbpb{tag}", f"rbpn{tag}"
        self.if_broker, self.if_node = f"rbpb{tag}", f"rbpn{tag}"
        octet = os.getpid() % 250 + 1
        self.addr_broker, self.addr_node = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.port = 18830
        self.workdir = Path(tempfile.mkdtemp(prefix="robobus-partition-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lines: list[tuple[float, str, str]] = []

    def up(self) -> None:
        for ns in (self.ns_broker, self.ns_node):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", self.if_broker, "netns", self.ns_broker, "type", "veth", "peer", "name", self.if_node,
            "netns", self.ns_node)
        _ip("-n", self.ns_broker, "addr", "add", f"{self.addr_broker}/30", "dev", self.if_broker)
        _ip("-n", self.ns_node, "addr", "add", f"{self.addr_node}/30", "dev", self.if_node)
        _ip("-n", self.ns_broker, "link", "set", self.if_broker, "up")
        _ip("-n", self.ns_node, "link", "set", self.if_node, "up")

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for ns in (self.ns_broker, self.ns_node):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def cut(self, cut: bool) -> None:
        _ip("-n", self.ns_node, "link", "set", self.if_node, "down" if cut else "up")

    def spawn(self, ns: str, args: list[str], env: dict[str, str] | None = None,
              stdout: int | None = None) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{len(self.procs)}.log").open("wb")
        p = subprocess.Popen(["ip", "netns", "exec", ns, *args], cwd=REPO, env={**os.environ, **(env or {})},
                             stdout=stdout if stdout is not None else log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(f"allow_anonymous true\npersistence false\nset_tcp_nodelay true\n"
                        f"listener {self.port} {self.addr_broker}\n")
        self.spawn(self.ns_broker, [mosquitto_bin() or "mosquitto", "-c", str(conf)])
        time.sleep(0.5)
        sub = self.spawn(self.ns_broker, ["mosquitto_sub", "-V", "mqttv5", "-h", self.addr_broker, "-p",
                                          str(self.port), "-v", "-t", "part/+/status", "-t",
                                          "part/+/+/state/sensors"], stdout=subprocess.PIPE)
        threading.Thread(target=self._read, args=(sub,), daemon=True).start()
        self.spawn(self.ns_node, [sys.executable, "-m", "services.epuck_gateway.sim", "--count", "1",
                                  "--base-port", "11500"])
        robots = json.dumps([{"id": "robot", "host": "127.0.0.1", "port": 11500}])
        self.spawn(self.ns_node, [sys.executable, "-m", "services.epuck_gateway"], {
            "ROBOBUS_MQTT_URL": f"mqtt://{self.addr_broker}:{self.port}", "ROBOBUS_TOPIC_ROOT": "part",
            "ROBOBUS_NODE": "gw", "ROBOBUS_EPUCK_ROBOTS": robots, "ROBOBUS_MQTT_KEEPALIVE_S": str(KEEPALIVE_S)})

    def _read(self, p: subprocess.Popen[bytes]) -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            topic, _, payload = raw.decode(errors="replace").rstrip("\n").partition(" ")
            self.lines.append((time.monotonic(), topic, payload))

    def publish(self, topic: str, payload: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns_broker, "mosquitto_pub", "-V", "mqttv5", "-h",
                        self.addr_broker, "-p", str(self.port), "-t", topic, "-m", payload], check=True)

    def status(self, since: float = 0.0) -> list[tuple[float, dict[str, object]]]:
        return [(t, json.loads(p)) for t, topic, p in list(self.lines) if topic == "part/gw/status" and t >= since]

    def steps(self, since: float) -> int | None:
        """The robot's continuous left step count from the first sensors message after `since`."""
        end = time.monotonic() + 5
        while time.monotonic() < end:
            for t, topic, p in list(self.lines):
                if t > since and topic.endswith("/state/sensors"):
                    return int(json.loads(p)["steps"]["left_total"])
            time.sleep(0.05)
        return None


@contextlib.contextmanager
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        r.up()
        r.start()
        yield r
    finally:
        r.down()


def wait(pred: object, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def partition(outage_s: float = 16.0) -> FaultResult:
    res = FaultResult(f"network partition node <-> broker ({outage_s:g} s)")
    with rig() as r:
        online = wait(lambda: any(s.get("online") for _, s in r.status()), 30)
        res.check("node online before the fault", online is not None, _fmt(online))
        if online is None:
            return res
        wait(lambda: r.steps(0) is not None, 10)
        r.publish("part/gw/robot/cmd/set_speed", '{"left": 300, "right": 300}')
        time.sleep(0.3)
        t_cut = time.monotonic()
        before = r.steps(t_cut - 0.1)
        r.cut(True)
        offline = wait(lambda: any(s.get("online") is False for _, s in r.status(t_cut)), outage_s)
        # MQTT: the broker may drop a client silent for 1.5 x its keepalive; mosquitto 2.0 sweeps keepalives
        # coarsely (measured here: 10-11 s for 5 s), so the bound is 3 x the keepalive
        res.check(f"broker declares the node offline (Last Will) within 3 x its {KEEPALIVE_S} s keepalive",
                  offline is not None and offline <= 3 * KEEPALIVE_S, _fmt(offline))
        time.sleep(max(0.0, outage_s - (time.monotonic() - t_cut)))
        t_heal = time.monotonic()
        r.cut(False)
        back = wait(lambda: any(s.get("online") for _, s in r.status(t_heal)), 30)
        res.check(f"node online within {BROKER_RETURN_S:g} s of the link's return",
                  back is not None and back <= BROKER_RETURN_S + SLACK_S, _fmt(back))
        after = r.steps(time.monotonic() + 0.3)
        moved = (after - before) / 300.0 if after is not None and before is not None else None
        limit = EPUCK_MOTION_TIMEOUT_S + SLACK_S + 0.3
        res.check(f"robot stopped by its {EPUCK_MOTION_TIMEOUT_S:g} s deadman during the partition",
                  moved is not None and moved <= limit, f"moved {_fmt(moved)} (limit {limit:.1f} s)")
        dead = [p.args for p in r.procs if p.poll() is not None]
        res.check("no process crashed", not dead, str(dead) if dead else "all alive")
    return res
