"""Firmware update without hardware: a Cortex-M4 ELF built here with Debian's binutils-arm-none-eabi,
gdb-multiarch driven against the GDB remote-protocol programmer simulator on a pty, the memory read
back; the CLI; the gateway's job with the robot's link paused and restored. Faults come from the
simulator (`Faults`): a lost reply, a hung programmer, a write refused, the port gone."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.epuck_gateway.port_lock import hold_port
from services.epuck_gateway.protocol.firmware import (
    BadFirmware,
    FirmwareError,
    FlashTimeout,
    GdbMi,
    NotBootable,
    OneBar,
    ProgrammerNotFound,
    check_elf,
    flash_firmware,
    parse_elf,
)
from services.epuck_gateway.sim.gdb import Faults, ProgrammerSim, RspSession, frame, gdb_crc32
from services.epuck_gateway.sim.serial import EpuckSerialSimThread
from shared.rpc import RpcClient
from tests.epuck_gateway.conftest import GATEWAY, BusRecorder, wait_until
from tests.fixtures import Broker

HERE = Path(__file__).parent / "firmware"
needs_gdb = pytest.mark.skipif(shutil.which("gdb-multiarch") is None,
                               reason="gdb-multiarch not installed (Debian package gdb-multiarch)")


def build_elf(out: Path, origin: int = 0x0800_0000, blob_words: int = 4096) -> Path:
    if shutil.which("arm-none-eabi-as") is None:
        pytest.skip("arm-none-eabi-as not installed (Debian package binutils-arm-none-eabi)")
    out.mkdir(parents=True, exist_ok=True)
    script = out / "link.ld"
    script.write_text((HERE / "stm32f407.ld").read_text().replace("0x08000000", f"0x{origin:08x}"))
    obj, elf = out / "blink.o", out / "blink.elf"
    subprocess.run(["arm-none-eabi-as", "--defsym", f"BLOB_WORDS={blob_words}", "-o", str(obj), str(HERE / "blink.s")],
                   check=True)
    subprocess.run(["arm-none-eabi-ld", "-T", str(script), "-o", str(elf), str(obj)], check=True)
    return elf


@pytest.fixture(scope="module")
def elf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_elf(tmp_path_factory.mktemp("fw"))


@pytest.fixture(scope="module")
def big_elf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 100 KB firmware (sectors 0-4), the size of the robot's: gdb sends it in several flash writes."""
    return build_elf(tmp_path_factory.mktemp("fw100k"), blob_words=25_600)


def faulty(tmp_path: Path, **faults: int) -> ProgrammerSim:
    return ProgrammerSim(str(tmp_path / "ttyFAULTY"), faults=Faults(**faults)).start()


def assert_holds(sim: ProgrammerSim, elf: Path) -> None:
    for seg in check_elf(elf, force=True).segments:  # what the programmer holds is the ELF, byte for byte
        assert sim.session.read(seg.address, seg.size) == seg.data


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
    robobus = [sys.executable, "-c", "from shared.tools.cli import main; main()", "epuck", "flash"]
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
                               "ROBOBUS_EPUCK_ROBOTS": json.dumps(robots), "ROBOBUS_EPUCK_RECONNECT_MAX_S": "0.3",
                               "ROBOBUS_EPUCK_FLASH_STALL_S": "1"})
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
        # one bar whose total covers the load and the verify: never back, and full at the end of the verify
        size = check_elf(elf).size
        bytes_reports = [p for p in progress if p["phase"] in ("load", "verify")]
        assert {p["total"] for p in bytes_reports} == {2 * size}, bytes_reports
        dones = [p["done"] for p in bytes_reports]
        assert dones == sorted(dones) and dones[-1] == 2 * size, dones
        assert any(p["phase"] == "load" and p["done"] == size for p in progress)  # the load's end is sent
        img = check_elf(elf)
        assert all(programmer.session.read(s.address, s.size) == s.data for s in img.segments)
        states = [json.loads(m.payload)["state"] for m in bus.since(mark, "/usb1/health")]
        assert "recovering" in states, states  # the link paused for the update (docs/kit.md "Health")
        assert robot.world.speed_left == 0  # stopped before the update
        assert bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", mark, timeout=15)  # link restored
        # a bad ELF is refused before anything touches the robot
        bad = client.call(node, "usb1", "flash", {"elf_base64": base64.b64encode(b"\x7fELF" + bytes(60)).decode()},
                          timeout=10)
        assert not bad.ok and bad.error is not None and bad.error["code"] == "invalid_request"
        high = build_elf(tmp_path / "high", origin=0x0806_0000)  # no vector table at the boot address
        bad = client.call(node, "usb1", "flash", {"elf_base64": base64.b64encode(high.read_bytes()).decode()},
                          timeout=10)
        assert not bad.ok and bad.error is not None and bad.error["code"] == "invalid_request"
        assert "force" in bad.error["message"]
        time.sleep(0.2)
        assert programmer.session.stats.attached == 1
        # a programmer that hangs during the load: `timeout`, within seconds, and the robot's state said
        hung = faulty(tmp_path, hang_at_write=1)
        try:
            req = {"elf_base64": base64.b64encode(elf.read_bytes()).decode(), "programmer": hung.link}
            rep, result = client.call_job(node, "usb1", "flash", req, lambda p: None, timeout=120)
            assert rep.ok and result is not None and not result["ok"], (rep.raw, result)
            assert result["error"]["code"] == "timeout", result
            msg = result["error"]["message"]
            assert "stalled" in msg and "no valid firmware" in msg and "run the same command again" in msg, msg
            assert not hung.session.running and hung.session.stats.detached == 0
            # the robot's health says it until a flash succeeds: an error naming the firmware, in its details too
            h = bus.wait_json("/usb1/health", lambda d: "no valid firmware" in d["error_message"], timeout=15)
            assert h is not None and h["error"] and h["state"] == "error", h
            assert "no valid firmware" in h["details"]["firmware"], h
            time.sleep(1.5)  # still said after the link is back and the heartbeat has gone out
            h = bus.latest_json("/usb1/health")
            assert h is not None and "no valid firmware" in h["error_message"], h
        finally:
            hung.close()
        mark = bus.mark()
        req = {"elf_base64": base64.b64encode(elf.read_bytes()).decode()}
        rep, result = client.call_job(node, "usb1", "flash", req, lambda p: None, timeout=120)
        assert rep.ok and result is not None and result["ok"], (rep.raw, result)
        h = bus.wait_json("/usb1/health", lambda d: d["state"] == "streaming", mark, timeout=15)
        assert h is not None and not h["error"] and "firmware" not in h["details"], h
    finally:
        serial.close()


# -- the boot address ---------------------------------------------------------------------------------
def test_an_image_without_a_vector_table_at_the_boot_address_is_refused(tmp_path: Path) -> None:
    high = build_elf(tmp_path / "high", origin=0x0806_0000)  # linked wholly at sector 7: nothing at 0x08000000
    with pytest.raises(NotBootable, match=r"no vector table at the boot address 0x08000000.*--force"):
        check_elf(high)
    assert check_elf(high, force=True).segments[0].address == 0x0806_0000
    good = build_elf(tmp_path / "good").read_bytes()
    table = good.index(bytes.fromhex("00000220"))  # word 0: the initial SP 0x20020000, in the file
    reset = int.from_bytes(good[table + 4:table + 8], "little")

    def patched(sp: int, pc: int) -> bytes:
        return good[:table] + sp.to_bytes(4, "little") + pc.to_bytes(4, "little") + good[table + 8:]

    parse_elf(patched(0x1001_0000, reset))  # top of the CCM RAM is a stack too
    for data, why in ((patched(0xFFFF_FFFF, 0xFFFF_FFFF), "not an initial stack pointer"),
                      (patched(0x0800_0000, reset), "not an initial stack pointer"),
                      (patched(0x2002_0000, reset & ~1), "no Thumb bit"),
                      (patched(0x2002_0000, 0x0809_0001), "outside the image")):
        with pytest.raises(NotBootable, match=why):
            parse_elf(data)
        parse_elf(data, force=True)


@needs_gdb
def test_an_unbootable_image_is_refused_before_any_packet_unless_forced(
        programmer: ProgrammerSim, tmp_path: Path) -> None:
    high = build_elf(tmp_path / "high", origin=0x0806_0000)
    with pytest.raises(NotBootable):
        flash_firmware(programmer.link, high, timeout_s=60)
    assert programmer.session.stats.packets == 0
    robobus = [sys.executable, "-c", "from shared.tools.cli import main; main()", "epuck", "flash"]
    refused = subprocess.run([*robobus, programmer.link, str(high)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--force" in refused.stderr, refused.stderr
    assert programmer.session.stats.packets == 0
    forced = subprocess.run([*robobus, programmer.link, str(high), "--force"], capture_output=True, text=True,
                            timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert_holds(programmer, high)
    assert programmer.session.read(0x0800_0000, 4) == b"\xff" * 4  # sectors 0-6 untouched


# -- progress: one total ------------------------------------------------------------------------------
@needs_gdb
def test_progress_counts_the_bytes_written_to_flash_and_ends_full(big_elf: Path, programmer: ProgrammerSim) -> None:
    phases: list[tuple[str, int, int]] = []
    res = flash_firmware(programmer.link, big_elf, lambda p, d, t: phases.append((p, d, t)), timeout_s=120)
    written = programmer.session.stats.bytes_written  # .bss and .ARM.attributes are not written (gdb counts them)
    assert check_elf(big_elf).size == written == res.bytes_loaded
    totals = {t for p, _, t in phases if p in ("load", "verify")}
    assert totals == {written}, phases
    loads = [d for p, d, _ in phases if p == "load"]
    assert loads[-1] == written and loads == sorted(loads)
    assert phases.index(("load", written, written)) < phases.index(("verify", 0, written))


@needs_gdb
def test_cli_bar_ends_full_at_the_bytes_written(big_elf: Path, programmer: ProgrammerSim) -> None:
    robobus = [sys.executable, "-c", "from shared.tools.cli import main; main()", "epuck", "flash"]
    # wide enough that rich does not wrap the line at a long temporary path (pytest-xdist's popen-gwN/ adds one)
    done = subprocess.run([*robobus, programmer.link, str(big_elf)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    written = programmer.session.stats.bytes_written
    assert f"{written} bytes to write" in done.stdout
    # rich prints the final state of the bar when not on a terminal: full, in the same total
    assert f"{written / 1000:.1f}/{written / 1000:.1f} kB" in done.stderr, done.stderr


# -- faults ---------------------------------------------------------------------------------------------
@needs_gdb
def test_a_lost_reply_during_the_load_is_detected_and_the_flash_retried(big_elf: Path, tmp_path: Path) -> None:
    sim = faulty(tmp_path, lose_reply_at_write=3)
    phases: list[str] = []
    try:
        res = flash_firmware(sim.link, big_elf, lambda p, d, t: phases.append(p), timeout_s=120, stall_s=1.5)
        assert sim.session.stats.lost_replies == 1
        assert res.verified and res.attempts == 2 and "stalled" in res.retried[0], res.retried
        assert "retry" in phases
        assert_holds(sim, big_elf)
        assert sim.session.running and sim.session.stats.detached == 1  # the new firmware runs
    finally:
        sim.close()


@needs_gdb
def test_a_hung_programmer_stops_the_load_says_the_robots_state_and_leaves_it_halted(
        big_elf: Path, tmp_path: Path) -> None:
    sim = faulty(tmp_path, hang_at_write=3)
    try:
        with pytest.raises(FlashTimeout) as err:  # stalled, then not answering the retry
            flash_firmware(sim.link, big_elf, timeout_s=300, stall_s=1.5)
        msg = str(err.value)
        assert "the load stalled" in msg and "no progress for 1.5 s" in msg, msg
        assert "The robot has no valid firmware" in msg and "run the same command again" in msg, msg
        assert sim.session.stats.erases >= 1 and 0 < sim.session.stats.bytes_written < check_elf(big_elf).size
        assert not sim.session.running and sim.session.stats.detached == 0  # halted, not detached
    finally:
        sim.close()


@needs_gdb
def test_a_refused_write_leaves_the_robot_halted_and_says_its_state(big_elf: Path, tmp_path: Path) -> None:
    sim = faulty(tmp_path, error_at_write=2)
    try:
        with pytest.raises(FirmwareError) as err:
            flash_firmware(sim.link, big_elf, timeout_s=120, stall_s=5)
        msg = str(err.value)
        assert "Error writing data to flash" in msg, msg
        assert "The robot has no valid firmware" in msg and "MCU is left halted" in msg, msg
        assert "run the same command again" in msg
        assert not sim.session.running and sim.session.stats.detached == 0
        assert sim.session.read(0x0800_0000, 8) != check_elf(big_elf).segments[0].data[:8] or \
            sim.session.stats.bytes_written < check_elf(big_elf).size
    finally:
        sim.close()
    again = ProgrammerSim(str(tmp_path / "ttyAGAIN")).start()  # the way out: the same command again
    try:
        again.session.flash[:] = sim.session.flash
        assert flash_firmware(again.link, big_elf, timeout_s=120).verified
        assert_holds(again, big_elf)
    finally:
        again.close()


@needs_gdb
def test_the_port_going_away_during_the_load_says_so_and_the_robots_state(big_elf: Path, tmp_path: Path) -> None:
    sim = faulty(tmp_path, disconnect_at_write=2)
    try:
        with pytest.raises(FirmwareError) as err:
            flash_firmware(sim.link, big_elf, timeout_s=120, stall_s=5)
        msg = str(err.value)
        assert "went away during the load" in msg and "The robot has no valid firmware" in msg, msg
    finally:
        sim.close()


@needs_gdb
def test_cli_a_hung_programmer_is_exit_4_with_the_robots_state(big_elf: Path, tmp_path: Path) -> None:
    sim = faulty(tmp_path, hang_at_write=2)
    robobus = [sys.executable, "-c", "from shared.tools.cli import main; main()", "epuck", "flash"]
    try:
        done = subprocess.run([*robobus, sim.link, str(big_elf), "--stall-timeout", "1"], capture_output=True,
                              text=True, timeout=200)
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 4, out
        assert "stalled" in out and "no valid firmware" in out and "run the same command again" in out, out
    finally:
        sim.close()


@needs_gdb
def test_cli_refuses_a_port_another_process_holds(elf: Path, programmer: ProgrammerSim) -> None:
    """The gateway's serial links hold their port's lock (port_lock); a local flash takes the same lock."""
    robobus = [sys.executable, "-c", "from shared.tools.cli import main; main()", "epuck", "flash"]
    with hold_port(programmer.link):  # as the gateway's link to this port does
        done = subprocess.run([*robobus, programmer.link, str(elf)], capture_output=True, text=True, timeout=120)
    out = " ".join(done.stderr.split())
    assert done.returncode == 1 and "in use by another process" in out and "nothing was sent" in out, out
    assert programmer.session.stats.packets == 0


def test_one_bar_covers_the_load_and_the_verify() -> None:
    """The gateway's `flash` job reports one bar: the load fills its first half, the verify its second (never
    back to 0 between them); other phases keep its place; a retry starts it over; each phase's end is final (sent
    past the job's rate cap). It read load 88 %, verify 0 %, done."""
    bar = OneBar(verify=True)
    seen = [bar.update(p, d, t) for p, d, t in [("connect", 0, 0), ("load", 0, 100), ("load", 88, 100),
                                                ("load", 100, 100), ("verify", 0, 100), ("verify", 100, 100),
                                                ("detach", 0, 0)]]
    assert seen == [(0, 0), (0, 200), (88, 200), (100, 200), (100, 200), (200, 200), (200, 200)]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert bar.update("retry", 0, 0) == (0, 200)
    assert OneBar(verify=False).update("load", 100, 100) == (100, 100)
    assert OneBar.final("load", 100, 100) and OneBar.final("verify", 100, 100) and not OneBar.final("load", 88, 100)
