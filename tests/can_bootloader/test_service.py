"""The MQTT surface on a real broker: flash jobs, busy buses, cancel, refused images, the contract."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.can_bootloader.api import API
from services.can_bootloader.flasher import FlashConfig
from services.can_bootloader.image import load_intel_hex
from services.can_bootloader.settings import CanBootSettings
from services.can_bootloader.sim import FLAG_RUN_APP, FLAG_STAY, make_intel_hex
from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import ContractValidator, build_document
from tests.fixtures import Broker

HEX = make_intel_hex()
IMAGE = load_intel_hex(HEX)
SMALL_HEX = make_intel_hex(0x1000, 0x13FF)
SMALL = load_intel_hex(SMALL_HEX)
DEV = "motors"


def err(rep: Any) -> dict[str, Any]:
    assert rep.error is not None, rep
    return dict(rep.error)


def memory_equals(board: Any, image: Any) -> bool:
    return bool(board.app_image(image.base, image.end) == image.data)


def test_flash_read_back_and_contract(boot_node: Any, client: RpcClient) -> None:
    validator = ContractValidator(build_document([API]))
    bn = boot_node()
    seen: list[tuple[str, bytes]] = []
    client.subscribe_before(f"robobus/{bn.name}/#", lambda m: seen.append((m.topic, bytes(m.payload))))
    progress: list[dict[str, Any]] = []
    rep, result = client.call_job(bn.name, DEV, "flash", {"board": 8, "hex": HEX}, progress.append, timeout=60)
    assert rep.ok, rep.error
    assert result is not None and result["ok"], result
    res = result["result"]
    assert res["board"] == 8 and res["bus"] == 1 and res["bootloader_aware"] is True and res["phase"] == "done"
    assert res["image_first"] == 0x04C0 and res["image_last"] == 0x7D4B
    assert any("configuration words" in w for w in res["warnings"])
    # The virtual bus loses nothing, but a busy machine can hold the board model's thread past the 100 ms frame
    # timeout; the flasher then rewinds and resends, as it would for a lost ACK (that is its job, tested in
    # test_flasher.py). So: the image is right (below) and retries stay a handful, not zero by luck.
    assert res["frames_sent"] > 8000 and res["retries"] <= 5
    phases = {e["phase"] for e in progress}
    assert {"magic", "erase", "write", "verify"} <= phases
    assert all("frames_per_s" in e["info"] and "retries" in e["info"] for e in progress if e["phase"] == "write")
    board = bn.board(8)
    assert memory_equals(board, IMAGE) and board.eeprom[0xFF] == FLAG_RUN_APP
    # the board runs its application now: READ_VERSION gets no answer
    rep = client.call(bn.name, DEV, "read_version", {"board": 8})
    assert not rep.ok and err(rep)["code"] == "timeout"
    # bootloader commands on a board in its bootloader
    rep = client.call(bn.name, DEV, "read_version", {"board": 13})
    assert rep.ok and rep.result == {"board": 13, "bus": 2, "version": "40414243"}
    rep = client.call(bn.name, DEV, "read_flash", {"board": 3, "address": 0x0005, "length": 21})
    assert rep.ok and bytes.fromhex(rep.result["data"]) == bytes(bn.board(3).flash[5:26])
    rep = client.call(bn.name, DEV, "reset", {"board": 3})
    assert rep.ok and bn.board(3).mode == "app"
    time.sleep(0.7)  # a health heartbeat
    # overlapping subscriptions of one client (ours and call_job's) deliver each event twice: dedupe
    reports = [json.loads(pl) for pl in {pl for t, pl in seen if t.endswith("/event/flash_report")}]
    assert len(reports) == 1 and reports[0]["ok"]
    checked = {validator.validate(t, pl) for t, pl in seen}
    assert len(checked) >= 4  # status, health, job events, flash_report


def test_refused_images_send_no_frame(boot_node: Any, client: RpcClient, tmp_path: Path) -> None:
    bn = boot_node()
    cases = {
        make_intel_hex(0x0400, 0x0600): "bootloader",
        make_intel_hex(0x7000, 0x7E00): "past the application region",
        ":10000000DEADBEEF\n": "malformed",
        "": "empty",
        ":020000040030CA\n:0100010055A9\n:00000001FF\n": "empty",
    }
    for text, why in cases.items():
        rep = client.call(bn.name, DEV, "flash", {"board": 8, "hex": text})
        assert not rep.ok and err(rep)["code"] == "invalid_request" and why in err(rep)["message"], rep.error
    rep = client.call(bn.name, DEV, "flash", {"board": 8, "hex": HEX, "path": "x.hex"})
    assert not rep.ok and err(rep)["code"] == "invalid_request"
    rep = client.call(bn.name, DEV, "flash", {"board": 8, "path": "../../etc/passwd"})
    assert not rep.ok and err(rep)["code"] == "forbidden", rep.error
    (tmp_path / "escape.hex").symlink_to("/etc/hostname")
    rep = client.call(bn.name, DEV, "flash", {"board": 8, "path": "escape.hex"})
    assert not rep.ok and err(rep)["code"] == "forbidden", rep.error
    rep = client.call(bn.name, DEV, "flash", {"board": 8, "path": "missing.hex"})
    assert not rep.ok and err(rep)["code"] == "not_found"
    rep = client.call(bn.name, DEV, "flash", {"board": 20, "hex": HEX})
    assert not rep.ok and err(rep)["code"] == "invalid_request"
    assert bn.frames_sent() == 0
    # a file in the firmware folder is fine
    (tmp_path / "fw.hex").write_text(SMALL_HEX)
    rep, result = client.call_job(bn.name, DEV, "flash", {"board": 3, "path": "fw.hex"}, lambda e: None, timeout=30)
    assert result is not None and result["ok"], result
    assert memory_equals(bn.board(3), SMALL)


def test_busy_bus_and_cancel(boot_node: Any, client: RpcClient, broker_session: Broker) -> None:
    bn = boot_node(erase_s=2.5, can_flash=FlashConfig(erase_timeout_s=8.0))  # a slow erase keeps bus 1 busy
    results: dict[str, Any] = {}
    first_progress = threading.Event()
    other = RpcClient(broker_session.settings(), name="test-other")  # call_job unsubscribes when it ends
    other.connect()

    def first() -> None:
        results["first"] = other.call_job(bn.name, DEV, "flash", {"board": 8, "hex": HEX},
                                           lambda e: first_progress.set(), timeout=60)

    t = threading.Thread(target=first)
    t.start()
    assert first_progress.wait(10)
    rep = client.call(bn.name, DEV, "flash", {"board": 3, "hex": SMALL_HEX})
    assert not rep.ok and err(rep)["code"] == "busy" and "bus 1" in err(rep)["message"]
    rep = client.call(bn.name, DEV, "read_version", {"board": 3})
    assert not rep.ok and err(rep)["code"] == "busy"
    rep = client.call(bn.name, DEV, "flash_many", {"boards": [13, 3], "hex": SMALL_HEX})
    assert not rep.ok and err(rep)["code"] == "busy"
    # bus 2 is free
    _rep2, res2 = client.call_job(bn.name, DEV, "flash", {"board": 13, "hex": SMALL_HEX}, lambda e: None, timeout=30)
    assert res2 is not None and res2["ok"], res2
    rep = client.call(bn.name, DEV, "cancel", {})
    assert rep.ok and len(rep.result["cancelled"]) == 1
    t.join(30)
    other.close()
    _rep1, res1 = results["first"]
    assert res1 is not None and not res1["ok"] and res1["cancelled"]
    board = bn.board(8)
    assert wait_for(lambda: board.mode == "bootloader", 3)
    assert board.eeprom[0xFF] == FLAG_STAY  # left in the bootloader, ready to be flashed again
    rep, res = client.call_job(bn.name, DEV, "flash", {"board": 8, "hex": SMALL_HEX}, lambda e: None, timeout=30)
    assert res is not None and res["ok"], res
    assert memory_equals(board, SMALL)


def test_flash_many_in_parallel(boot_node: Any, client: RpcClient) -> None:
    boards = list(range(20))
    bn = boot_node(boards=tuple(boards))
    progress: list[dict[str, Any]] = []
    _rep, result = client.call_job(bn.name, DEV, "flash_many", {"boards": boards, "hex": SMALL_HEX},
                                   progress.append, timeout=120)
    assert result is not None and result["ok"], result
    rs = result["result"]["results"]
    assert [r["board"] for r in rs] == boards and all(r["ok"] and r["bootloader_aware"] for r in rs)
    assert {r["bus"] for r in rs} == {1, 2}
    for b in boards:
        assert memory_equals(bn.board(b), SMALL)
    assert progress and progress[-1]["total"] == 2000
    # a missing board fails the job with its reason, the others are flashed
    bn = boot_node(boards=(0,))
    _rep, result = client.call_job(bn.name, DEV, "flash_many", {"boards": [0, 5], "hex": SMALL_HEX},
                                   lambda e: None, timeout=60)
    assert result is not None and not result["ok"]
    assert "board 5" in result["error"]["message"] and "magic" in result["error"]["message"]


def test_silent_board_after_the_reset_is_a_timeout_not_a_verdict(boot_node: Any, client: RpcClient) -> None:
    bn = boot_node(app_aware=False)
    health: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    client.subscribe_before(f"robobus/{bn.name}/{DEV}/health", lambda m: health.append(json.loads(m.payload)))
    client.subscribe_before(f"robobus/{bn.name}/{DEV}/event/flash_report",
                            lambda m: reports.append(json.loads(m.payload)))
    _rep, result = client.call_job(bn.name, DEV, "flash", {"board": 13, "hex": SMALL_HEX}, lambda e: None,
                                  timeout=30)
    assert result is not None and not result["ok"] and result["error"]["code"] == "timeout", result
    assert "no answer from board 13 after 13 tries" in result["error"]["message"]
    assert wait_for(lambda: bool(reports), 3)
    rep = reports[-1]
    assert rep["no_answer"] is True and rep["bootloader_aware"] is None and rep["bytes_verified"] > 0
    # not known to be a fault of the device: no health error, the failure is details' last_failure
    assert wait_for(lambda: "no answer from board 13" in str(health[-1]["details"].get("last_failure")), 3)
    assert not any(h["error"] for h in health)
    _rep, result = client.call_job(bn.name, DEV, "flash", {"board": 13, "hex": SMALL_HEX}, lambda e: None,
                                  timeout=30)
    assert result is not None and not result["ok"] and "magic" in result["error"]["message"]


def test_health(boot_node: Any, client: RpcClient) -> None:
    bn = boot_node()
    msgs = client.collect(f"robobus/{bn.name}/{DEV}/health", 1.0)
    h = json.loads(msgs[-1][1])
    assert h["connection"] and h["operational"] and h["state"] == "idle"
    assert h["details"]["bus1"]["interface"] == "virtual"


def test_flash_settings_are_the_flashers_one_config(monkeypatch: Any) -> None:
    monkeypatch.setenv("ROBOBUS_CAN_FLASH", '{"erase_timeout_s": 7.5, "restarts": 0}')
    s = CanBootSettings()
    assert isinstance(s.can_flash, FlashConfig)
    assert (s.can_flash.erase_timeout_s, s.can_flash.restarts, s.can_flash.block_retries) == (7.5, 0, 20)
    for bad in ('{"window": 4}', '{"check_bootloader_aware": false}', '{"erase_tries": 0}', '{"nope": 1}'):
        monkeypatch.setenv("ROBOBUS_CAN_FLASH", bad)
        with pytest.raises(ValueError):
            CanBootSettings()
