"""Firmware update without hardware: a Cortex-M4 ELF built here with Debian's binutils-arm-none-eabi,
gdb-multiarch driven against the GDB remote-protocol programmer simulator on a pty, the memory read
back; the CLI; the gateway's job with the robot's link paused and restored."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.epuck_gateway.firmware import (
    BadFirmware,
    GdbMi,
    ProgrammerNotFound,
    check_elf,
    flash_firmware,
    parse_elf,
)
from services.epuck_gateway.sim_gdb import ProgrammerSim, RspSession, frame, gdb_crc32
from services.epuck_gateway.sim_serial import EpuckSerialSimThread
from shared.rpc import RpcClient
from tests.epuck_gateway.conftest import GATEWAY, BusRecorder, wait_until
from tests.fixtures import Broker

HERE = Path(__file__).parent / "firmware"
needs_gdb = pytest.mark.skipif(shutil.which("gdb-multiarch") is None,
                               reason="gdb-multiarch not installed (Debian package gdb-multiarch)")


def build_elf(out: Path, origin: int = 0x0800_0000) -> Path:
    if shutil.which("arm-none-eabi-as") is None:
        pytest.skip("arm-none-eabi-as not installed (Debian package binutils-arm-none-eabi)")
    script = out / "link.ld"
    script.write_text((HERE / "stm32f407.ld").read_text().replace("0x08000000", f"0x{origin:08x}"))
    obj, elf = out / "blink.o", out / "blink.elf"
    subprocess.run(["arm-none-eabi-as", "-o", str(obj), str(HERE / "blink.s")], check=True)
    subprocess.run(["arm-none-eabi-ld", "-T", str(script), "-o", str(elf), str(obj)], check=True)
    return elf


@pytest.fixture(scope="module")
def elf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_elf(tmp_path_factory.mktemp("fw"))


@pytest.fixture
def programmer(tmp_path: Path) -> Iterator[ProgrammerSim]:
    sim = ProgrammerSim(str(tmp_path / "ttyPROG")).start()
    yield sim
    sim.close()


def test_the_elf_check_accepts_an_stm32f407_firmware(elf: Path) -> None:
    img = check_elf(elf)
    assert [hex(s.address) for s in img.segments] == ["0x8000000", "0x8004014"]  # .data's load address in flash
    assert img.size == 8 + 16396 + 4 and img.entry & 1  # Thumb entry point


def test_the_elf_check_rejects_what_is_not_an_e_puck2_firmware(tmp_path: Path) -> None:
    with pytest.raises(BadFirmware, match="64-bit"):
        check_elf(Path(sys.executable).resolve())  # this machine's own x86-64 Python
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(BadFirmware, match="not an ELF"):
        check_elf(tmp_path / "notes.txt")
    with pytest.raises(BadFirmware, match="cannot read"):
        check_elf(tmp_path / "missing.elf")
    elsewhere = build_elf(tmp_path, origin=0x0040_0000)  # an ARM ELF for another MCU's memory
    with pytest.raises(BadFirmware, match="outside the STM32F407's flash"):
        check_elf(elsewhere)
    data = elsewhere.read_bytes()
    with pytest.raises(BadFirmware):
        parse_elf(data[:40])
    x86 = bytearray(data)
    x86[18:20] = (3).to_bytes(2, "little")  # e_machine = x86
    with pytest.raises(BadFirmware, match="not ARM"):
        parse_elf(bytes(x86))


def test_rsp_framing_and_crc() -> None:
    assert frame(b"OK") == b"$OK#9a"
    assert gdb_crc32(b"") == 0xFFFFFFFF and gdb_crc32(b"123456789") == 0x0376E6E7  # CRC-32/MPEG-2 check value
    s = RspSession()
    assert s.feed(b"$?#3f") == b"+" + frame(b"W00")  # no target attached yet
    assert s.feed(b"$m8000000,4#00") == b"-"  # bad checksum: NAK, nothing done
    assert s.stats.bad_checksums == 1


@needs_gdb
def test_flash_through_the_programmer_and_read_the_memory_back(elf: Path, programmer: ProgrammerSim) -> None:
    phases: list[tuple[str, int, int]] = []
    res = flash_firmware(programmer.link, elf, lambda p, d, t: phases.append((p, d, t)), timeout_s=120)
    img = check_elf(elf)
    assert res.verified and res.bytes_loaded == img.size
    assert res.sections == [".isr_vector", ".text", ".data"]
    order = [p for p, _, _ in phases]
    assert order.index("connect") < order.index("scan") < order.index("attach") < order.index("load") < order.index(
        "verify") < order.index("detach")
    assert ("load", img.size, img.size) in phases
    for seg in img.segments:  # what the programmer holds is the ELF, byte for byte
        assert programmer.session.read(seg.address, seg.size) == seg.data
    st = programmer.session.stats
    assert st.monitor == ["swdp_scan"] and st.attached == 1 and st.detached == 1 and st.crcs >= 3
    assert not programmer.session.attached  # detached: the new firmware runs
    # and GDB reads the same bytes back through the remote protocol
    mi = GdbMi(elf, timeout_s=60)
    try:
        assert mi.run(f"-target-select extended-remote {programmer.link}")[0]
        assert mi.run("-target-attach 1")[0]
        ok, fields, _ = mi.run("-data-read-memory-bytes 0x08000000 8")
        assert ok and img.segments[0].data[:8].hex() in json.dumps(fields) + mi.log[-2]
    finally:
        mi.close()


@needs_gdb
def test_no_programmer_or_no_robot_is_a_clear_error(elf: Path, tmp_path: Path) -> None:
    with pytest.raises(ProgrammerNotFound, match="does not exist"):
        flash_firmware(str(tmp_path / "ttyACM9"), elf)
    sim = ProgrammerSim(str(tmp_path / "ttyPROG"), target_present=False).start()  # robot off: nothing on SWD
    try:
        with pytest.raises(ProgrammerNotFound, match="no STM32F4"):
            flash_firmware(sim.link, elf, timeout_s=60)
        assert sim.session.stats.bytes_written == 0
    finally:
        sim.close()


@needs_gdb
def test_cli_flashes_a_robot_on_this_computer(elf: Path, programmer: ProgrammerSim, tmp_path: Path) -> None:
    robobus = [sys.executable, "-c", "from shared.cli import main; main()", "epuck", "flash"]
    done = subprocess.run([*robobus, programmer.link, str(elf)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verified" in done.stdout
    assert programmer.session.stats.bytes_written == check_elf(elf).size
    bad = subprocess.run([*robobus, programmer.link, sys.executable], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "64-bit" in bad.stderr + bad.stdout
    gone = subprocess.run([*robobus, str(tmp_path / "ttyACM9"), str(elf)], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 3 and "programmer not found" in gone.stderr + gone.stdout


@needs_gdb
def test_gateway_flash_job_pauses_and_restores_the_robots_link(
        elf: Path, programmer: ProgrammerSim, broker_session: Broker, spawn: Any, client: RpcClient,
        tmp_path: Path) -> None:
    node = "epuck-flash-gw"
    serial = EpuckSerialSimThread(1, str(tmp_path / "ttyEPUCK")).start()
    robot = serial.robots[0]
    bus = BusRecorder()
    client.subscribe_before(f"robobus/{node}/#", bus.on)
    robots = [{"id": "usb1", "transport": "serial", "port": robot.link, "programmer": programmer.link}]
    try:
        proc = spawn(GATEWAY, {"ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_NODE": node,
                               "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots), "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3"})
        assert bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", timeout=20), proc.text()
        # commands only once the node's birth is out: it follows the SUBACK of its command subscription
        assert bus.wait_json(f"{node}/status", lambda d: d["online"], timeout=20), proc.text()
        assert client.call(node, "usb1", "set_speed", {"left": 200, "right": 200}, timeout=10).ok
        assert wait_until(lambda: robot.world.speed_left == 200, 5)
        mark = bus.mark()
        progress: list[dict[str, Any]] = []
        req = {"elf_base64": base64.b64encode(elf.read_bytes()).decode()}
        rep, result = client.call_job(node, "usb1", "flash", req, progress.append, timeout=120)
        assert rep.ok and result is not None and result["ok"], (rep.raw, result, proc.text())
        body = result["result"]
        assert body["verified"] and body["bytes_loaded"] == check_elf(elf).size
        assert body["programmer"] == programmer.link
        phases = [p["phase"] for p in progress]
        assert "pause" in phases and "load" in phases and "resume" in phases
        img = check_elf(elf)
        assert all(programmer.session.read(s.address, s.size) == s.data for s in img.segments)
        states = [json.loads(m.payload)["state"] for m in bus.since(mark, "/usb1/health")]
        assert "updating" in states, states
        assert robot.world.speed_left == 0  # stopped before the update
        assert bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", mark, timeout=15)  # link restored
        # a bad ELF is refused before anything touches the robot
        bad = client.call(node, "usb1", "flash", {"elf_base64": base64.b64encode(b"\x7fELF" + bytes(60)).decode()},
                          timeout=10)
        assert not bad.ok and bad.error["code"] == "invalid_request"
        time.sleep(0.2)
        assert programmer.session.stats.attached == 1
    finally:
        serial.close()
