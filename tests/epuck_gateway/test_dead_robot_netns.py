"""A robot that is really gone (WiFi out of range: no FIN, no ACK) between two network namespaces:
the link says `silent` at the allowed silence, the kernel gives up on the unacknowledged probe after
TCP_USER_TIMEOUT, the link says `lost` and reconnects once the robot is reachable again.
Needs root (namespaces, veth); skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures import can_netns

RUNNER = """
import asyncio, json, sys, time
from services.epuck_gateway.protocol.wifi import EpuckController
from services.epuck_gateway.transport.wifi import EpuckLink, EpuckLinkConfig

def state(c, s, m):
    print(json.dumps({"t": time.monotonic(), "connected": c, "state": s, "message": m}), flush=True)

async def main():
    ctl = EpuckController()
    ctl.set_stream(image=False, sensors=True)
    cfg = EpuckLinkConfig(sys.argv[1], 1000, connect_timeout_s=1.0, reconnect_min_s=0.2, reconnect_max_s=0.5,
                          stale_timeout_s=0.5, tcp_user_timeout_s=1.5)
    link = EpuckLink("r1", cfg, ctl, lambda p, t: None, state, lambda e: None)
    link.start()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await link.close()

asyncio.run(main())
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespaces() -> Iterator[dict[str, str]]:
    reason = can_netns()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    net = {"robot": f"epkr{tag}", "gw": f"epkg{tag}", "if_robot": f"epkr{tag}", "if_gw": f"epkg{tag}",
           "robot_ip": f"10.214.{os.getpid() % 250 + 1}.2", "gw_ip": f"10.214.{os.getpid() % 250 + 1}.1"}
    try:
        for ns in (net["robot"], net["gw"]):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", net["if_robot"], "netns", net["robot"], "type", "veth", "peer", "name", net["if_gw"],
           "netns", net["gw"])
        ip("-n", net["robot"], "addr", "add", f"{net['robot_ip']}/30", "dev", net["if_robot"])
        ip("-n", net["gw"], "addr", "add", f"{net['gw_ip']}/30", "dev", net["if_gw"])
        ip("-n", net["robot"], "link", "set", net["if_robot"], "up")
        ip("-n", net["gw"], "link", "set", net["if_gw"], "up")
        yield net
    finally:
        for ns in (net["robot"], net["gw"]):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_robot_gone_without_fin_or_ack_is_silent_then_disconnected_then_back(namespaces: dict[str, str]) -> None:
    net = namespaces
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    robot = subprocess.Popen(["ip", "netns", "exec", net["robot"], sys.executable, "-m", "services.epuck_gateway.sim",
                              "--count", "1", "--host", net["robot_ip"], "--base-port", "1000"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gw = subprocess.Popen(["ip", "netns", "exec", net["gw"], sys.executable, "-c", RUNNER, net["robot_ip"]],
                          env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    states: list[dict[str, Any]] = []

    def until(pred: Any, timeout: float) -> dict[str, Any] | None:
        assert gw.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = gw.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                states.append(json.loads(line))
                if pred(states[-1]):
                    return states[-1]
        return None

    try:
        assert until(lambda s: s["state"] == "streaming", 30), states
        cut = time.monotonic()
        ip("-n", net["robot"], "link", "set", net["if_robot"], "down")  # out of range: nothing passes
        silent = until(lambda s: s["state"] == "silent", 10)
        assert silent is not None and silent["connected"], states
        assert silent["t"] - cut < 0.5 + 1.0  # stale timeout 0.5 s (sensors only), generous slack
        down = until(lambda s: s["state"] == "lost", 15)
        assert down is not None, states
        # the probe went unacknowledged: TCP_USER_TIMEOUT (1.5 s) ended the connection
        assert down["t"] - silent["t"] < 1.5 + 2.0, states
        ip("-n", net["robot"], "link", "set", net["if_robot"], "up")  # back in range
        assert until(lambda s: s["state"] == "streaming", 60), states
    finally:
        if gw.poll() is None:
            assert gw.stdin is not None
            gw.stdin.close()
            try:
                gw.wait(10)
            except subprocess.TimeoutExpired:
                gw.kill()
        robot.kill()
        robot.wait(5)
