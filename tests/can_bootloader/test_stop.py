"""The bus-wide software stop (shared/stop.py) in can-bootloader, on a real broker and the simulated boards.

The stop writes nothing to a CAN bus here (the bootloader protocol has no stop, and a board in its bootloader drives
nothing): what it does is on the wire all the same. A flash in progress goes on through write and verify and never
sends its RESET (the board stays in its bootloader); no flash and no reset starts (`stopped`, no frame sent); read
commands answer; a release sends nothing; a node started under the stop comes up stopped. Each test has its own topic
root on the session broker: no other test sees its stop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from services.can_bootloader import protocol as p
from services.can_bootloader.api import API
from services.can_bootloader.flasher import FlashConfig, Flasher, Phase, reset_exchange
from services.can_bootloader.image import load_intel_hex
from services.can_bootloader.sim import FLAG_RUN_APP, FLAG_STAY, BootBoard, make_intel_hex
from shared.contract import command_errors
from shared.errors import ErrorCode
from shared.messages import StopState
from shared.rpc import RpcClient, wait_for
from shared.stop import answer_topic, stop_topic
from tests.fixtures import Broker

from .harness import Wire

SMALL_HEX = make_intel_hex(0x1000, 0x13FF)
SMALL = load_intel_hex(SMALL_HEX)
DEV = "motors"
DEADLINE = 30.0  # generous: the machine is shared


class StopBus:
    """A test's own topic root: a client on it, every message it saw, the stop set and released."""

    def __init__(self, broker: Broker) -> None:
        self.root = f"cbstop{time.monotonic_ns()}"
        self.client = RpcClient(broker.settings(topic_root=self.root), name="cb-stop-test")
        self.client.connect()
        self.messages: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.client.subscribe_before(f"{self.root}/#", self._on)

    def _on(self, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def latest(self, topic: str) -> dict[str, Any] | None:
        with self.lock:
            for t, pl in reversed(self.messages):
                if t == topic:
                    return json.loads(pl) if pl else None
        return None

    def all(self, topic: str) -> list[dict[str, Any]]:
        with self.lock:
            return [json.loads(pl) for t, pl in self.messages if t == topic and pl]

    def set_stop(self, active: bool, reason: str = "cb test") -> StopState:
        stop = StopState(active=active, source="tester", reason=reason, ts=time.time())
        assert self.client.session.publish_wait(stop_topic(self.root), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def health(self, node: str) -> dict[str, Any]:
        return self.latest(f"{self.root}/{node}/{DEV}/health") or {}

    def wait_health(self, node: str, pred: Any) -> dict[str, Any]:
        assert wait_for(lambda: pred(self.health(node)), DEADLINE), self.health(node)
        return self.health(node)

    def wait_answer(self, node: str, stop: StopState) -> dict[str, Any]:
        """The node's stop answer to `stop`, once every device's write is reported."""
        def settled() -> bool:
            a = self.latest(answer_topic(self.root, node))
            return a is not None and a["stop_ts"] == stop.ts and a["active"] == stop.active \
                and not any(d["pending"] for d in a["devices"])
        assert wait_for(settled, DEADLINE), self.latest(answer_topic(self.root, node))
        a = self.latest(answer_topic(self.root, node))
        assert a is not None
        return a

    def close(self) -> None:
        with self.lock:
            topics = {t for t, _ in self.messages}
        for t in topics:  # leave nothing retained on the shared broker
            self.client.session.publish(t, b"", qos=1, retain=True)
        self.client.session.publish_wait(stop_topic(self.root), b"", qos=1, retain=True)
        self.client.close()


@pytest.fixture
def sbus(broker_session: Broker) -> Iterator[StopBus]:
    b = StopBus(broker_session)
    yield b
    b.close()


def code(rep: Any) -> str:
    assert not rep.ok, rep
    return str(rep.error["code"])


def start_job(c: RpcClient, node: str, command: str, req: dict[str, Any], out: dict[str, Any],
              progress: list[dict[str, Any]]) -> threading.Thread:
    def run() -> None:
        out["job"] = c.call_job(node, DEV, command, req, progress.append, timeout=120)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def stopped_as_answered(sbus: StopBus, node: str, stop: StopState) -> None:
    """The node answered the stop for its one motion device, reported written and without error."""
    a = sbus.wait_answer(node, stop)
    assert [d["device"] for d in a["devices"]] == [DEV], a
    d = a["devices"][0]
    assert d["stopped"] and d["written_ts"] is not None and d["written_ts"] >= a["received_ts"] - 1.0, a
    assert d["error"] == "", a


def test_flash_in_progress_goes_on_but_its_reset_is_held(boot_node: Any, sbus: StopBus) -> None:
    """The stop comes during a flash's erase: the write and the verify go on (the image lands whole), the RESET
    never reaches the board (it stays in its bootloader), the job ends `stopped` saying so; the release sends
    nothing, and a new `reset` after it starts the image."""
    bn = boot_node(erase_s=3.0, can_flash=FlashConfig(erase_timeout_s=10.0), topic_root=sbus.root)
    out: dict[str, Any] = {}
    progress: list[dict[str, Any]] = []
    t = start_job(sbus.client, bn.name, "flash", {"board": 8, "hex": SMALL_HEX}, out, progress)
    assert wait_for(lambda: any(e["phase"] == "erase" for e in progress), DEADLINE), progress
    stop = sbus.set_stop(True, "hands off")
    stopped_as_answered(sbus, bn.name, stop)
    h = sbus.wait_health(bn.name, lambda h: h.get("state") == "stopped" and "bus_stop" in h["details"])
    assert "continues through write and verify" in h["details"]["bus_stop"], h
    t.join(DEADLINE * 2)
    rep, result = out["job"]
    assert rep.ok and result is not None and not result["ok"], result
    assert result["error"]["code"] == "stopped", result
    assert "held by the bus stop" in result["error"]["message"] and "hands off" in result["error"]["message"]
    board = bn.board(8)
    assert board.app_image(SMALL.base, SMALL.end) == SMALL.data  # written whole: the stop did not cut the write
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY  # no RESET reached it
    reports = sbus.all(f"{sbus.root}/{bn.name}/{DEV}/event/flash_report")
    assert reports and reports[-1]["board"] == 8 and reports[-1]["phase"] == "reset"
    assert reports[-1]["bytes_verified"] == len(SMALL.data) and not reports[-1]["ok"]
    h = sbus.wait_health(bn.name, lambda h: "8" in h.get("details", {}).get("reset_held", {}))
    assert h["state"] == "stopped"
    # the release moves nothing: no frame goes out, the board stays in its bootloader
    sent = bn.frames_sent()
    sbus.set_stop(False)
    h = sbus.wait_health(bn.name, lambda h: h.get("state") == "idle" and "bus_stop" not in h["details"])
    assert "8" in h["details"]["reset_held"]
    assert bn.frames_sent() == sent and board.mode == "bootloader"
    # a new command after the release starts it
    rep = sbus.client.call(bn.name, DEV, "reset", {"board": 8})
    assert rep.ok, rep.error
    assert board.mode == "app" and board.eeprom[0xFF] == FLAG_RUN_APP
    assert sbus.wait_health(bn.name, lambda h: "reset_held" not in h.get("details", {"reset_held": 1}))


def test_a_stop_released_during_a_flash_still_holds_its_reset(boot_node: Any, sbus: StopBus) -> None:
    """Stop and release both during the erase: the flash was admitted before the stop, so its RESET is not the
    new command after the release that alone may start a board: it is held all the same."""
    bn = boot_node(erase_s=3.0, can_flash=FlashConfig(erase_timeout_s=10.0), topic_root=sbus.root)
    out: dict[str, Any] = {}
    progress: list[dict[str, Any]] = []
    t = start_job(sbus.client, bn.name, "flash", {"board": 8, "hex": SMALL_HEX}, out, progress)
    board = bn.board(8)
    assert wait_for(lambda: board.erases >= 1, DEADLINE)
    stop = sbus.set_stop(True)
    sbus.wait_answer(bn.name, stop)
    release = sbus.set_stop(False)
    sbus.wait_answer(bn.name, release)
    t.join(DEADLINE * 2)
    _rep, result = out["job"]
    assert result is not None and not result["ok"] and result["error"]["code"] == "stopped", result
    assert "came and was released" in result["error"]["message"], result
    assert board.app_image(SMALL.base, SMALL.end) == SMALL.data and board.mode == "bootloader"


def test_flash_many_boards_not_begun_do_not_start(boot_node: Any, sbus: StopBus) -> None:
    """flash_many of two boards on one bus: the stop comes during the first one's erase; it is written and
    verified with its RESET held, the second is never touched (no erase), and the job ends `stopped`."""
    bn = boot_node(boards=(3, 5), erase_s=3.0, can_flash=FlashConfig(erase_timeout_s=10.0), topic_root=sbus.root)
    out: dict[str, Any] = {}
    progress: list[dict[str, Any]] = []
    t = start_job(sbus.client, bn.name, "flash_many", {"boards": [3, 5], "hex": SMALL_HEX}, out, progress)
    first = bn.board(3)
    assert wait_for(lambda: first.erases >= 1 or bool(progress), DEADLINE)
    sbus.set_stop(True)
    t.join(DEADLINE * 2)
    rep, result = out["job"]
    assert rep.ok and result is not None and not result["ok"], result
    msg = result["error"]["message"]
    assert result["error"]["code"] == "stopped" and "board 3: held by the bus stop" in msg, msg
    assert "board 5: not started by the bus stop" in msg, msg
    assert first.app_image(SMALL.base, SMALL.end) == SMALL.data and first.mode == "bootloader"
    second = bn.board(5)
    assert second.erases == 0 and second.mode == "bootloader"
    assert second.app_image(SMALL.base, SMALL.end) == b"\xff" * len(SMALL.data)
    reports = {r["board"]: r for r in sbus.all(f"{sbus.root}/{bn.name}/{DEV}/event/flash_report")}
    assert reports[5]["frames_sent"] == 0 and reports[5]["phase"] == "idle"


def test_stopped_refuses_flash_and_reset_sends_nothing_reads_answer(boot_node: Any, sbus: StopBus) -> None:
    bn = boot_node(topic_root=sbus.root)
    stop = sbus.set_stop(True, "maintenance")
    stopped_as_answered(sbus, bn.name, stop)
    h = sbus.wait_health(bn.name, lambda h: h.get("state") == "stopped" and "bus_stop" in h["details"])
    assert h["details"]["stop"]["reason"] == "maintenance" and h["details"]["stop"]["source"] == "tester"
    assert "no flash and no reset starts" in h["details"]["bus_stop"] and "no flash is in progress" in \
        h["details"]["bus_stop"]
    board = bn.board(3)
    sent, heard = bn.frames_sent(), board.frames_in
    for command, req in (("flash", {"board": 3, "hex": SMALL_HEX}), ("flash_many", {"boards": [3, 13],
                                                                                     "hex": SMALL_HEX}),
                         ("reset", {"board": 3})):
        rep = sbus.client.call(bn.name, DEV, command, req)
        assert code(rep) == "stopped" and rep.error is not None, (command, rep.error)
        # the kit's gate, before the handler (not the RESET held on its way out), naming the stop
        assert "maintenance" in rep.error["message"] and "until it is released" in rep.error["message"], rep.error
    assert bn.frames_sent() == sent and board.frames_in == heard  # nothing went out
    assert board.mode == "bootloader" and board.erases == 0
    # read-only commands answer as always
    rep = sbus.client.call(bn.name, DEV, "read_version", {"board": 13})
    assert rep.ok and rep.result["version"] == "40414243", rep.error
    rep = sbus.client.call(bn.name, DEV, "read_flash", {"board": 3, "address": 0x10, "length": 16})
    assert rep.ok and bytes.fromhex(rep.result["data"]) == bytes(board.flash[0x10:0x20]), rep.error
    # the release sends nothing; commands pass again
    sent = bn.frames_sent()
    sbus.set_stop(False)
    sbus.wait_health(bn.name, lambda h: h.get("state") == "idle" and "bus_stop" not in h["details"])
    assert bn.frames_sent() == sent and board.mode == "bootloader"
    rep = sbus.client.call(bn.name, DEV, "reset", {"board": 3})
    assert rep.ok and board.mode == "app", rep.error


def test_node_started_under_the_stop_comes_up_stopped(boot_node: Any, sbus: StopBus) -> None:
    stop = sbus.set_stop(True, "before start")
    bn = boot_node(topic_root=sbus.root)
    stopped_as_answered(sbus, bn.name, stop)
    h = sbus.wait_health(bn.name, lambda h: h.get("state") == "stopped" and "bus_stop" in h["details"])
    assert h["details"]["stop"]["reason"] == "before start" and not h["operational"]
    rep = sbus.client.call(bn.name, DEV, "flash", {"board": 3, "hex": SMALL_HEX})
    assert code(rep) == "stopped"
    rep = sbus.client.call(bn.name, DEV, "reset", {"board": 3})
    assert code(rep) == "stopped"
    assert bn.frames_sent() == 0 and bn.board(3).mode == "bootloader"


def test_contract_reset_is_motion_flash_is_gated_not_cancelled() -> None:
    """reset is a motion command (the kit refuses it and lists `stopped`); a flash is not one the kit would cancel
    mid-write, yet its result may carry `stopped` (refused at admission, or its RESET held)."""
    assert API.commands["reset"].motion
    assert not API.jobs["flash"].motion and not API.jobs["flash_many"].motion
    assert not API.commands["read_version"].motion and not API.commands["read_flash"].motion
    for spec in (API.commands["reset"], API.jobs["flash"], API.jobs["flash_many"]):
        assert {ErrorCode.STOPPED, ErrorCode.UNAVAILABLE} <= set(command_errors(spec)), spec.name


# -- the held RESET, sans-I/O (the fake-clock wire of test_flasher.py) ------------------------------------------
def test_flasher_holds_every_reset_and_only_resets() -> None:
    """A hold that says no from the RESET on: every other frame went out, no RESET did, the board stays in its
    bootloader with the image verified; a hold that came only at the second RESET (after the bootloader-aware
    check) ends with the firmware known aware, the board back in its bootloader."""
    board = BootBoard(4)
    wire = Wire([board])
    f = Flasher(4, SMALL, FlashConfig(), board_id=4, hold=lambda: "the bus stop is active: tester")
    wire.run(f)
    assert f.result is not None and not f.result.ok and f.result.held and f.result.phase is Phase.RESET
    assert "robobus can reset 4" in f.result.reason
    assert not any(p.starts_firmware(fr) for fr in wire.sent)
    assert board.app_image(SMALL.base, SMALL.end) == SMALL.data and board.mode == "bootloader"
    assert board.eeprom[0xFF] == FLAG_STAY

    board = BootBoard(4)
    wire = Wire([board])
    f = Flasher(4, SMALL, FlashConfig(), board_id=4)
    f.hold = lambda: "the bus stop is active: tester" if f.phase is Phase.CHECK_RESET else None
    wire.run(f)
    assert f.result is not None and f.result.held and f.result.bootloader_aware is True
    assert sum(p.starts_firmware(fr) for fr in wire.sent) == 1  # the first RESET, before the stop
    assert board.mode == "bootloader" and board.eeprom[0xFF] == FLAG_STAY


def test_reset_exchange_held_sends_nothing() -> None:
    board = BootBoard(2)
    wire = Wire([board])
    ex = reset_exchange(2, hold=lambda: "the bus stop is active: tester")
    wire.run(ex)
    assert ex.done and not ex.ok and ex.held and wire.sent == []
    assert board.mode == "bootloader"
    ex = reset_exchange(2, hold=lambda: None)
    wire.run(ex)
    assert ex.ok and board.mode == "app"
