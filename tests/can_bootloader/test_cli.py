"""`robobus flash` and `robobus can ...` in a subprocess against a can-bootloader node on a real broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from services.can_bootloader.cli import parse_boards
from services.can_bootloader.image import load_intel_hex
from services.can_bootloader.sim import make_intel_hex
from tests.fixtures import Broker

REPO = Path(__file__).resolve().parents[2]
SMALL_HEX = make_intel_hex(0x1000, 0x13FF)


def robobus(broker: Broker, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "shared.tools.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=90)


def test_parse_boards() -> None:
    assert parse_boards("0-19") == list(range(20))
    assert parse_boards("0-2, 12,15-16,1") == [0, 1, 2, 12, 15, 16]
    for bad in ("", "5-3", "20", "x", "0-20"):
        with pytest.raises(typer.BadParameter):
            parse_boards(bad)


def test_flash_cli(broker_session: Broker, boot_node: Any, tmp_path: Path) -> None:
    bn = boot_node(boards=(3, 8, 13))
    fw = tmp_path / "fw.hex"
    fw.write_text(SMALL_HEX)
    common = ("--node", bn.name)
    r = robobus(broker_session, "flash", str(fw), "--board", "8", *common)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout and "yes" in r.stdout
    img = load_intel_hex(SMALL_HEX)
    assert bn.board(8).app_image(img.base, img.end) == img.data
    r = robobus(broker_session, "flash", str(fw), "--boards", "3,13", *common)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok ") >= 2 or r.stdout.count("ok") >= 2
    bad = tmp_path / "bad.hex"
    bad.write_text(make_intel_hex(0x0000, 0x0600))
    r = robobus(broker_session, "flash", str(bad), "--board", "8", *common)
    assert r.returncode == 1 and "refused" in r.stderr and "bootloader" in r.stderr
    r = robobus(broker_session, "flash", str(fw), "--board", "5", *common)  # no such board: magic fails
    assert r.returncode == 1 and "None of the magic packets were ACKed" in r.stderr
    r = robobus(broker_session, "flash", str(fw), *common)
    assert r.returncode == 2
    r = robobus(broker_session, "flash", "fw.hex", "--remote-path", "--board", "3", *common)
    assert r.returncode == 0, r.stdout + r.stderr


def test_flash_cli_no_answer_after_the_reset(broker_session: Broker, boot_node: Any, tmp_path: Path) -> None:
    """A board silent after its RESET (here: firmware that ignores the magic packet) gets exit 5 and what is
    known, not exit 3 and a verdict: the same silence comes from a board in its bootloader whose answers are lost."""
    bn = boot_node(boards=(8,), app_aware=False)
    fw = tmp_path / "fw.hex"
    fw.write_text(SMALL_HEX)
    r = robobus(broker_session, "flash", str(fw), "--board", "8", "--node", bn.name)
    assert r.returncode == 5, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert "no answer from board 8 after 13 tries" in err and "robobus can version 8" in err, err


def test_flash_cli_lost_acks_of_the_post_reset_magic(broker_session: Broker, boot_node: Any, tmp_path: Path) -> None:
    """Two lost ACKs in a row on the post-reset magic packet: retried, exit 0 (it used to exit 3, "can no longer be
    flashed over CAN", with the board sitting in its bootloader). With every later ACK of the magic packet and
    of RESET lost: exit 1 and the truth (in its bootloader, written and verified, not started, how to recover)."""
    bn = boot_node(boards=(8,))
    fw = tmp_path / "fw.hex"
    fw.write_text(SMALL_HEX)
    board = bn.board(8)
    board.faults.drop_magic_acks, board.faults.drop_magic_after = 2, 1
    r = robobus(broker_session, "flash", str(fw), "--board", "8", "--node", bn.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "yes" in r.stdout and "NOT bootloader-aware" not in r.stderr and board.faults.dropped == 2
    img = load_intel_hex(SMALL_HEX)
    assert board.mode == "app" and board.app_image(img.base, img.end) == img.data

    board.faults.drop_magic_acks, board.faults.drop_magic_after = 1000, 1
    board.faults.drop_acks, board.faults.drop_command, board.faults.drop_after = 1000, 0x3, 1  # RESET
    r = robobus(broker_session, "flash", str(fw), "--board", "8", "--node", bn.name)
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert r.returncode == 1, r.stdout + r.stderr
    assert "device_error" in err and "in its bootloader" in err and "NOT started" in err, err
    assert "robobus can reset 8" in err and "NOT bootloader-aware" not in err, err
    assert board.mode == "bootloader" and board.eeprom[0xFF] == 0xFF
    board.faults.drop_acks = 0
    r = robobus(broker_session, "can", "reset", "8", "--node", bn.name)  # the way back the message names
    assert r.returncode == 0, r.stdout + r.stderr
    assert board.mode == "app" and board.app_image(img.base, img.end) == img.data


def test_can_commands(broker_session: Broker, boot_node: Any) -> None:
    bn = boot_node(boards=(3, 13))
    r = robobus(broker_session, "can", "version", "13", "--node", bn.name)
    assert r.returncode == 0 and "40414243" in r.stdout, r.stderr
    r = robobus(broker_session, "can", "read", "3", "0x0", "16", "--node", bn.name)
    assert r.returncode == 0, r.stderr
    assert bytes(bn.board(3).flash[0:16]).hex(" ").upper() in r.stdout
    r = robobus(broker_session, "can", "version", "4", "--node", bn.name)
    assert r.returncode == 1 and "timeout" in r.stderr
    r = robobus(broker_session, "can", "send", "0x900", "0")
    assert r.returncode == 2


def test_flash_through_a_local_adapter_without_service_or_broker(tmp_path: Path) -> None:
    """`robobus flash --interface virtual --channel X`: the service's flasher on a python-can bus of this
    process, against the PIC18F bootloader model (python-can's virtual bus works inside one process only)."""
    import can
    from typer.testing import CliRunner

    from services.can_bootloader import cli
    from services.can_bootloader.sim import BootBusSim, make_boards

    channel = f"robobus-local-{os.getpid()}"
    sim = BootBusSim(can.Bus(interface="virtual", channel=channel), make_boards([8, 9])).start()
    fw = tmp_path / "fw.hex"
    fw.write_text(SMALL_HEX)
    app = typer.Typer()
    app.command()(cli.flash)
    app.command("noop")(lambda: None)  # two commands: typer keeps `flash` as a sub-command name
    runner = CliRunner()
    try:
        ok = runner.invoke(app, ["flash", str(fw), "--board", "8", "--interface", "virtual", "--channel", channel])
        assert ok.exit_code == 0, ok.output
        assert sim.board(8).app_image(0x1000, 0x1400) == load_intel_hex(SMALL_HEX).data
        both_buses = runner.invoke(app, ["flash", str(fw), "--boards", "8,12", "--interface", "virtual",
                                         "--channel", channel])
        assert both_buses.exit_code == 2 and "one CAN bus" in both_buses.output
        absent = runner.invoke(app, ["flash", str(fw), "--board", "5", "--interface", "virtual", "--channel", channel])
        assert absent.exit_code == 1 and "magic" in absent.output.lower(), absent.output
    finally:
        sim.stop()
