"""The full path: MQTT -> can-bootloader -> robobus_bridge (python-can) -> ethercat-loop's leased CAN bridge ->
palm model (1 kHz cycle, CAN direct mode) -> the PIC18F bootloader model."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import can
import pytest

from services.can_bootloader.api import API
from services.can_bootloader.flasher import FlashConfig
from services.can_bootloader.image import load_intel_hex
from services.can_bootloader.service import CanBootService, build
from services.can_bootloader.settings import CanBootSettings
from services.can_bootloader.sim import FLAG_RUN_APP, BootBoardSet, make_boards, make_intel_hex
from services.can_bootloader.transport import CanBusConfig
from shared import Node
from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import ContractValidator, build_document
from tests.fixtures import Broker

palm_loop = pytest.importorskip("services.ethercat_loop.service")
palm_api = pytest.importorskip("services.ethercat_loop.api")
palm_settings = pytest.importorskip("services.ethercat_loop.settings")

HEX = make_intel_hex()
IMAGE = load_intel_hex(HEX)
SMALL_HEX = make_intel_hex(0x2000, 0x23FF)
SMALL = load_intel_hex(SMALL_HEX)
_ids = itertools.count()


class Palm:
    def __init__(self, broker: Broker) -> None:
        n = next(_ids)
        self.name = f"palm{n}-{time.monotonic_ns() % 100000}"
        self.settings = palm_settings.EthercatSettings(mqtt_url=broker.url, node=self.name, backend="model",
                                                       health_interval_s=1.0)
        self.device = self.settings.ethercat_device
        self.node = Node(palm_api.API, self.settings)
        self.svc = palm_loop.build(self.node, self.settings)
        self.backend = self.svc.backend
        self.boards = BootBoardSet(make_boards([3, 8, 13]))
        self.backend.model.add_can_node(self.boards)
        self.node.start()
        assert self.node.session.wait_ready(10)
        self.svc.start()
        self.thread = threading.Thread(target=self.svc.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.svc.shutdown()
        self.node.stop()


def err(rep: Any) -> dict[str, Any]:
    assert rep.error is not None, rep
    return dict(rep.error)


@pytest.fixture
def palm(broker_session: Broker) -> Iterator[Palm]:
    pm = Palm(broker_session)
    yield pm
    pm.stop()


def boot_service(broker: Broker, palm: Palm, **kw: Any) -> tuple[Node, CanBootService]:
    opts = {"node": palm.name, "device": palm.device}
    settings = CanBootSettings(mqtt_url=broker.url, node=f"boot-{palm.name}", health_interval_s=1.0, **kw,
                               can_bus1=CanBusConfig(interface="robobus_bridge", channel="1", options=opts),
                               can_bus2=CanBusConfig(interface="robobus_bridge", channel="2", options=opts))
    node = Node(API, settings)
    svc = build(node, settings)
    node.start()
    assert node.session.wait_ready(10)
    assert node.stop_latch.known_event.wait(10)  # flash and reset need the bus stop's state
    return node, svc


def test_python_can_opens_the_bridge(broker_session: Broker, palm: Palm) -> None:
    bus = can.Bus(interface="robobus_bridge", channel="2", mqtt_url=broker_session.url, node=palm.name,
                  device=palm.device)
    try:
        bus.send(can.Message(arbitration_id=0x604, data=b"", is_extended_id=False))  # READ_VERSION, board 10+0
        bus.send(can.Message(arbitration_id=0x664, data=b"", is_extended_id=False))  # READ_VERSION, board 13
        msg = bus.recv(2.0)
        assert msg is not None and msg.arbitration_id == 0x674 and bytes(msg.data) == bytes.fromhex("40414243")
        assert bus.recv(0.2) is None  # board 10 is not there
    finally:
        bus.shutdown()


def test_garbage_on_can_rx_is_counted_and_dropped(broker_session: Broker, palm: Palm, client: RpcClient) -> None:
    bus = can.Bus(interface="robobus_bridge", channel="1", mqtt_url=broker_session.url, node=palm.name,
                  device=palm.device)
    try:
        bus.send(can.Message(arbitration_id=0x064, data=b"", is_extended_id=False))  # READ_VERSION, board 3
        assert bus.recv(2.0) is not None  # leased, and the path works
        link = bus._link
        lease = link.lease_id
        before = link.garbage
        for payload in (b"not json", b'{"lease_id": 5}', json.dumps(
                {"lease_id": lease, "frames": [{"bus": 1, "sid": 7, "data": "zz", "cycle": 1},
                                               {"bus": 1, "sid": 0x900, "data": "", "cycle": 1}]}).encode()):
            client.session.publish(link.rx_topic, payload, qos=1)
        assert wait_for(lambda: link.garbage >= before + 4, 5), link.garbage
        got = [m.arbitration_id for m in iter(lambda: bus.recv(0.2), None)]
        assert 7 not in got and 0x900 not in got  # nothing of it reached the bus
        bus.send(can.Message(arbitration_id=0x064, data=b"", is_extended_id=False))
        assert bus.recv(2.0) is not None  # and the link still works
    finally:
        bus.shutdown()


def test_full_path_flash(broker_session: Broker, palm: Palm, client: RpcClient) -> None:
    # every frame crosses the broker twice and the palm's loop: a test worker starved 2 s on a busy 2-core host
    # outlasted the default 20 x 100 ms per frame, and 2 x 100 ms for the magic packet; this test is the path's
    # bytes, not its timing (test_power_loss_through_the_bridge keeps the defaults)
    slow = FlashConfig(frame_timeout_s=0.5, magic_timeout_s=0.5, magic_tries=4, check_timeout_s=0.5,
                       reset_timeout_s=3.0, erase_timeout_s=10.0)
    node, _svc = boot_service(broker_session, palm, can_flash=slow)
    validator = ContractValidator(build_document([API]))
    seen: list[tuple[str, bytes]] = []
    client.subscribe_before(f"robobus/{node.name}/#", lambda m: seen.append((m.topic, bytes(m.payload))))
    try:
        t0 = time.monotonic()
        _rep, result = client.call_job(node.name, "motors", "flash", {"board": 8, "hex": HEX}, lambda e: None,
                                       timeout=120)
        elapsed = time.monotonic() - t0
        assert result is not None and result["ok"], result
        res = result["result"]
        assert res["bootloader_aware"] is True
        board = palm.boards.board(8)
        assert board.app_image(IMAGE.base, IMAGE.end) == IMAGE.data
        assert board.eeprom[0xFF] == FLAG_RUN_APP and board.mode == "app"
        print(f"full path: {res['frames_sent']} frames in {elapsed:.1f} s, {res['frames_per_s']} frames/s, "
              f"retries {res['retries']}")
        # both buses, one lease, the palm's single bridge slot shared
        _rep, result = client.call_job(node.name, "motors", "flash_many", {"boards": [3, 13], "hex": SMALL_HEX},
                                       lambda e: None, timeout=60)
        assert result is not None and result["ok"], result
        for b in (3, 13):
            assert palm.boards.board(b).app_image(SMALL.base, SMALL.end) == SMALL.data
        for t, pl in seen:
            validator.validate(t, pl)
    finally:
        node.stop()


def test_can_send_cli(broker_session: Broker, palm: Palm) -> None:
    """`robobus can send SID LEN HEXDATA` through ethercat-loop's send_can (the seed's SendCanMessage)."""
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "COLUMNS": "200"}
    # a window of 500 ms (the default 50): on a loaded host the palm's answer frame may come later than 50 ms
    args = [sys.executable, "-m", "shared.tools.cli", "can", "send", "0x664", "0", "--bus", "2", "--node", palm.name,
            "--device", palm.device, "--window-ms", "500"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0x674 [4] 40 41 42 43" in r.stdout
    r = subprocess.run([*args[:5], "0x70A", "8", "55AA55AA55AA55AA", "--bus", "1", "--node", palm.name,
                        "--device", palm.device, "--window-ms", "500", "--json"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    reply = json.loads(r.stdout)
    assert {"bus": 1, "sid": 0x71A, "data": "55aa55aa55aa55aa"}.items() <= reply["frames"][0].items()


def test_lease_busy_idle_release_and_shutdown(broker_session: Broker, palm: Palm, client: RpcClient) -> None:
    other = client.call(palm.name, palm.device, "bridge_lease", {"holder": "someone-else", "ttl_ms": 5000})
    assert other.ok
    bus = can.Bus(interface="robobus_bridge", channel="1", mqtt_url=broker_session.url, node=palm.name,
                  device=palm.device, idle_release_s=0.5)
    try:
        with pytest.raises(can.CanOperationError, match="busy"):
            bus.send(can.Message(arbitration_id=0x664, data=b"", is_extended_id=False))
        assert client.call(palm.name, palm.device, "bridge_release", {"lease_id": other.result["lease_id"]}).ok
        bus.send(can.Message(arbitration_id=0x664, data=b"", is_extended_id=False))
        msg = bus.recv(2.0)
        assert msg is not None and msg.arbitration_id == 0x674
        # held while in use: someone else is refused
        rep = client.call(palm.name, palm.device, "bridge_lease", {"holder": "someone-else"})
        assert not rep.ok and err(rep)["code"] == "busy"
        # released after idle_release_s without a frame: the hand goes back to normal operation
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            rep = client.call(palm.name, palm.device, "bridge_lease", {"holder": "someone-else", "ttl_ms": 200})
            if rep.ok:
                break
            time.sleep(0.2)
        assert rep.ok, rep.error
    finally:
        bus.shutdown()
    with pytest.raises(can.CanOperationError):
        bus.send(can.Message(arbitration_id=0x664, data=b"", is_extended_id=False))


def test_flash_fails_clearly_when_the_bridge_is_taken(broker_session: Broker, palm: Palm,
                                                      client: RpcClient) -> None:
    assert client.call(palm.name, palm.device, "bridge_lease", {"holder": "someone-else", "ttl_ms": 10000}).ok
    node, _svc = boot_service(broker_session, palm)
    try:
        _rep, result = client.call_job(node.name, "motors", "flash", {"board": 8, "hex": SMALL_HEX},
                                       lambda e: None, timeout=30)
        assert result is not None and not result["ok"]
        msg = result["error"]["message"]
        assert "refused the lease" in msg and "busy" in msg
        assert palm.boards.board(8).frames_in == 0
    finally:
        node.stop()


def test_lost_and_corrupt_answers_through_the_bridge(broker_session: Broker, palm: Palm, client: RpcClient) -> None:
    node, _svc = boot_service(broker_session, palm)
    b = palm.boards.board(3)
    b.faults.drop_acks, b.faults.drop_command, b.faults.drop_after = 3, 0, 20
    b.faults.corrupt_reads, b.faults.corrupt_after = 2, 50
    try:
        _rep, result = client.call_job(node.name, "motors", "flash", {"board": 3, "hex": SMALL_HEX},
                                       lambda e: None, timeout=60)
        assert result is not None and result["ok"], result
        assert result["result"]["retries"] >= 1  # several losses in one window cost one rewind
        assert b.faults.dropped == 3 and b.faults.corrupted == 2
        assert b.app_image(SMALL.base, SMALL.end) == SMALL.data
    finally:
        node.stop()


def test_no_palm_fails_clearly(broker_session: Broker, client: RpcClient) -> None:
    opts = {"node": "no-such-palm", "device": "rh"}
    settings = CanBootSettings(mqtt_url=broker_session.url, node="boot-nopalm", health_interval_s=1.0,
                               can_bus1=CanBusConfig(interface="robobus_bridge", channel="1", options=opts),
                               can_bus2=None)
    node = Node(API, settings)
    build(node, settings)
    node.start()
    assert node.session.wait_ready(10)
    assert node.stop_latch.known_event.wait(10)  # flash and reset need the bus stop's state
    try:
        _rep, result = client.call_job("boot-nopalm", "motors", "flash", {"board": 3, "hex": SMALL_HEX},
                                       lambda e: None, timeout=30)
        assert result is not None and not result["ok"]
        msg = result["error"]["message"]
        assert msg.startswith("board 3: magic failed: ") and "no-such-palm/rh" in msg and "bridge_lease" in msg
        rep = client.call("boot-nopalm", "motors", "flash", {"board": 13, "hex": SMALL_HEX})
        assert not rep.ok and err(rep)["code"] == "unavailable"  # bus 2 is not served
    finally:
        node.stop()


def test_health_follows_the_palm(broker_session: Broker, palm: Palm, client: RpcClient) -> None:
    node, _svc = boot_service(broker_session, palm)
    health: list[dict[str, Any]] = []
    client.subscribe_before(f"robobus/{node.name}/motors/health", lambda m: health.append(json.loads(m.payload)))
    try:
        assert wait_for(lambda: bool(health) and health[-1]["connection"], 5), health[-1:]
        palm.stop()  # ethercat-loop goes offline (its status says so): the link is lost, never an error
        assert wait_for(lambda: not health[-1]["connection"] and health[-1]["state"] == "lost", 5), health[-1:]
        assert "offline" in health[-1]["error_message"] and not any(h["error"] for h in health)
    finally:
        node.stop()


TINY_HEX = make_intel_hex(0x2000, 0x207F)  # four blocks (the smallest with the bootloader-aware marker)
TINY = load_intel_hex(TINY_HEX)


@pytest.mark.parametrize("window", [5, 12])
def test_power_loss_through_the_bridge(broker_session: Broker, palm: Palm, client: RpcClient, window: int) -> None:
    """The real bridge path (MQTT, robobus_bridge, the palm model's 1 kHz cycle): a power loss at every frame of
    the erase, the write and the first reads, the frame it meets lost and the board back at the next one. The
    bootloader's row 0x0000 is never programmed, and a flash that reports ok wrote and verified its image
    (tests/can_bootloader/test_power_loss.py covers every frame of the whole flash on the bridge's timing)."""
    node, _svc = boot_service(broker_session, palm)
    board = palm.boards.board(8)
    boot_area = bytes(board.flash[:0x04C0])
    first = 1 + 2 * (0x04C0 // 8)  # the magic packet, then the bootloader area's baseline, read twice
    try:
        for k in range(first, first + 1 + 10 + 4):  # ERASE, the first two blocks' 10 write frames, 4 more
            with palm.boards._lock:
                board.flash[TINY.base:TINY.end] = b"\x00" * len(TINY.data)  # not the image: it must be rewritten
                board.eeprom[0xFF] = 0xFF
                board.power_on()
                board.faults.power_loss_after, board.faults.power_off_s = k, 0.0
            losses = board.faults.power_losses
            results = []
            for _attempt in range(2):
                _rep, result = client.call_job(node.name, "motors", "flash",
                                               {"board": 8, "hex": TINY_HEX, "window": window}, lambda e: None,
                                               timeout=60)
                assert result is not None
                results.append(result)
                if result["ok"]:
                    break
            assert board.faults.power_losses == losses + 1, (k, results)
            assert board.protected_writes == [] and bytes(board.flash[:0x04C0]) == boot_area, (k, results)
            assert results[-1]["ok"], (k, [r.get("error") for r in results])
            assert board.app_image(TINY.base, TINY.end) == TINY.data and board.eeprom[0xFF] == FLAG_RUN_APP, k
    finally:
        node.stop()
