"""Firmware update of the e-puck2's main MCU (STM32F407, Cortex-M4) through its onboard programmer.

The programmer (an STM32F413 running a Black Magic Probe derivative) serves GDB's remote protocol
on one of the robot's USB serial ports (seed 003 "Robot firmware update": "The onboard programmer
run a GDB server, so we use GDB commands to upload a new firmware"). GCtronic's program script runs
`target extended-remote PORT`, `monitor swdp_scan`, `attach 1`, `set mem inaccessible-by-default
off`, `load`. Here `gdb-multiarch` (Debian) is driven through its machine interface (MI) so that
every step has a clear result and `load` reports progress; after the load `compare-sections`
verifies the flash against the ELF (the probe answers GDB's CRC requests), then `detach` lets the
new firmware run.

The ELF is checked before anything touches the robot: 32-bit little-endian ARM, and every loadable
byte inside the STM32F407's 1 MiB of flash.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FLASH_BASE = 0x0800_0000
FLASH_SIZE = 0x10_0000  # STM32F407xG: 1 MiB
EM_ARM = 40
PT_LOAD = 1
GDB = "gdb-multiarch"


class FirmwareError(Exception):
    """A firmware update that cannot go on; the message says why, in the user's terms."""


class BadFirmware(FirmwareError):
    """The ELF is not a firmware for the e-puck2's STM32F407 (nothing was sent to the robot)."""


class ProgrammerNotFound(FirmwareError):
    """No GDB server at the programmer's port (robot unplugged or off, wrong port)."""


@dataclass(frozen=True)
class LoadSegment:
    address: int  # load (physical) address
    size: int  # bytes in the file
    data: bytes


@dataclass(frozen=True)
class FirmwareImage:
    path: Path
    entry: int
    segments: tuple[LoadSegment, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)


def check_elf(path: Path | str) -> FirmwareImage:
    """Read and check an ELF for the e-puck2's STM32F407; FirmwareError with the reason otherwise."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadFirmware(f"cannot read {p}: {exc.strerror or exc}") from None
    return parse_elf(data, p)


def parse_elf(data: bytes, path: Path = Path("<memory>")) -> FirmwareImage:
    if len(data) < 52 or data[:4] != b"\x7fELF":
        raise BadFirmware(f"{path} is not an ELF file")
    if data[4] != 1:
        raise BadFirmware(f"{path} is a 64-bit ELF; the e-puck2's STM32F407 (Cortex-M4) needs a 32-bit ARM ELF")
    if data[5] != 1:
        raise BadFirmware(f"{path} is big-endian; the STM32F407 is little-endian")
    e_type, e_machine, _ver, e_entry, e_phoff, _shoff, _flags, _ehsize, e_phentsize, e_phnum = struct.unpack_from(
        "<HHIIIIIHHH", data, 16)
    if e_machine != EM_ARM:
        raise BadFirmware(f"{path} is for machine {e_machine} ({_MACHINES.get(e_machine, 'unknown')}), not ARM: "
                            "not a firmware for the e-puck2's STM32F407 (Cortex-M4)")
    if e_type != 2:
        raise BadFirmware(f"{path} is not an executable (ELF type {e_type}): link it first")
    segments: list[LoadSegment] = []
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        if off + 32 > len(data):
            raise BadFirmware(f"{path} is truncated (program header {i})")
        p_type, p_offset, _vaddr, p_paddr, p_filesz, _memsz, _pflags, _align = struct.unpack_from("<8I", data, off)
        if p_type != PT_LOAD or p_filesz == 0:
            continue
        if p_offset + p_filesz > len(data):
            raise BadFirmware(f"{path} is truncated (segment at 0x{p_paddr:08x})")
        if not (p_paddr >= FLASH_BASE and p_paddr + p_filesz <= FLASH_BASE + FLASH_SIZE):
            raise BadFirmware(f"{path} loads {p_filesz} bytes at 0x{p_paddr:08x}, outside the STM32F407's flash "
                                f"(0x{FLASH_BASE:08x}-0x{FLASH_BASE + FLASH_SIZE - 1:08x}): not an e-puck2 firmware")
        segments.append(LoadSegment(p_paddr, p_filesz, data[p_offset:p_offset + p_filesz]))
    if not segments:
        raise BadFirmware(f"{path} has nothing to load")
    return FirmwareImage(path, e_entry, tuple(sorted(segments, key=lambda s: s.address)))


_MACHINES = {3: "x86", 62: "x86-64", 183: "AArch64", 243: "RISC-V", 8: "MIPS", 94: "Xtensa (the ESP32)"}


# =============================================================================================
# gdb-multiarch over MI
# =============================================================================================
Progress = Callable[[str, int, int], None]  # phase, done, total (bytes for "load")


@dataclass
class FlashResult:
    bytes_loaded: int
    sections: list[str]
    verified: bool
    duration_s: float
    transfer_rate: str = ""
    log: list[str] = field(default_factory=list)


_RESULT = re.compile(r"^(?:\d+)?\^(done|error|running|connected|exit)(?:,(.*))?$")
_FIELD = re.compile(r'(\w[\w-]*)="((?:[^"\\]|\\.)*)"')


def _fields(text: str) -> dict[str, str]:
    return {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _FIELD.findall(text or "")}


def _cstring(line: str) -> str:
    """An MI stream record's C string -> text."""
    body = line[2:-1] if line.endswith('"') else line[2:]
    return bytes(body, "utf-8").decode("unicode_escape")


class GdbMi:
    """One gdb-multiarch process in MI mode: `run(command)` -> (ok, fields, console text)."""

    def __init__(self, elf: Path, gdb: str = GDB, timeout_s: float = 120.0) -> None:
        exe = shutil.which(gdb)
        if exe is None:
            raise FirmwareError(f"{gdb} not found: install it (Debian: apt-get install gdb-multiarch)")
        self.timeout_s = timeout_s
        self.log: list[str] = []
        self.on_record: Callable[[str], None] | None = None
        self.proc = subprocess.Popen(
            [exe, "--nx", "--quiet", "--interpreter=mi2", str(elf)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, env={**os.environ, "LC_ALL": "C"})
        self._token = 0
        self._read_until_prompt(self.timeout_s)

    def _readline(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        line: list[str] = []
        done = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            line.append(self.proc.stdout.readline())
            done.set()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            self.kill()
            raise FirmwareError("gdb-multiarch did not answer in time (is the programmer's port right?)")
        if not line[0]:
            raise FirmwareError("gdb-multiarch exited: " + " / ".join(self.log[-5:]))
        return line[0].rstrip("\n")

    def _read_until_prompt(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while True:
            line = self._readline(deadline)
            if line.strip() == "(gdb)":
                return out
            out.append(line)
            self.log.append(line)
            if self.on_record is not None:
                self.on_record(line)

    def run(self, command: str, timeout: float | None = None) -> tuple[bool, dict[str, str], str]:
        assert self.proc.stdin is not None
        self._token += 1
        self.proc.stdin.write(f"{self._token}{command}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + (timeout or self.timeout_s)
        console: list[str] = []
        while True:
            line = self._readline(deadline)
            self.log.append(line)
            if self.on_record is not None:
                self.on_record(line)
            if line.startswith(("~", "@", "&")):
                console.append(_cstring(line))
                continue
            m = _RESULT.match(line)
            if m and line.startswith(str(self._token)):
                kind, rest = m.group(1), m.group(2) or ""
                with contextlib.suppress(FirmwareError):
                    self._read_until_prompt(5.0)
                return kind in ("done", "connected", "running"), _fields(rest), "".join(console)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("-gdb-exit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait(5)


def flash_firmware(programmer: str, elf: Path | str, progress: Progress | None = None, verify: bool = True,
                   gdb: str = GDB, timeout_s: float = 300.0,
                   cancelled: Callable[[], bool] | None = None) -> FlashResult:
    """Load `elf` into the robot's MCU through the programmer's GDB server at `programmer`.

    `programmer` is the GDB server's serial port (/dev/ttyACM0; /dev/serial/by-id/...-if00) or
    host:port for a GDB server on TCP. Blocking: run it on a thread."""
    image = check_elf(elf)
    if not re.match(r"^[\w.-]+:\d+$", programmer) and not os.path.exists(programmer):
        raise ProgrammerNotFound(f"programmer not found: {programmer} does not exist (is the robot plugged in and on? "
                            "the GDB server is the first of the robot's two USB serial ports)")
    report = progress or (lambda phase, done, total: None)
    t0 = time.monotonic()
    total = image.size
    sections: list[str] = []

    def on_record(line: str) -> None:
        line = line.lstrip("0123456789")  # the command's token
        if line.startswith("+download"):
            f = _fields(line)
            if "section" in f and f["section"] not in sections:
                sections.append(f["section"])
            if "total-sent" in f:
                report("load", int(f["total-sent"]), int(f.get("total-size", total)))

    mi = GdbMi(Path(elf), gdb, timeout_s)
    mi.on_record = on_record

    def step(phase: str, command: str, what: str, timeout: float | None = None) -> tuple[dict[str, str], str]:
        if cancelled is not None and cancelled():
            raise FirmwareError(f"cancelled before {phase}")
        report(phase, 0, 0)
        ok, fields, text = mi.run(command, timeout)
        if not ok:
            raise FirmwareError(f"{what}: {fields.get('msg') or text.strip() or 'failed'}")
        return fields, text

    try:
        step("connect", "-gdb-set confirm off", "gdb")
        step("connect", "-gdb-set mem inaccessible-by-default off", "gdb")
        try:
            step("connect", f"-target-select extended-remote {programmer}", f"programmer not found at {programmer}",
                 30.0)
        except FirmwareError as exc:
            raise ProgrammerNotFound(f"{exc} (is the robot plugged in and on?)") from None
        _, scan = step("scan", '-interpreter-exec console "monitor swdp_scan"', "no target found by the programmer")
        if "No targets" in scan or "STM32F4" not in scan:
            raise ProgrammerNotFound(f"the programmer found no STM32F4 (the e-puck2's MCU; is the robot on?): "
                                     f"{scan.strip()!r}")
        step("attach", "-target-attach 1", "cannot attach to the robot's MCU")
        fields, _ = step("load", "-target-download", "loading the firmware failed", timeout_s)
        report("load", total, total)
        verified = False
        if verify:
            _, text = step("verify", '-interpreter-exec console "compare-sections"', "verification failed")
            if "MIS-MATCHED" in text or "matched" not in text:
                raise FirmwareError(f"verification failed: {text.strip()}")
            verified = True
        step("detach", "-target-detach", "cannot detach (the new firmware may not be running)")
        return FlashResult(bytes_loaded=int(fields.get("load-size", total)), sections=sections, verified=verified,
                           duration_s=round(time.monotonic() - t0, 3),
                           transfer_rate=fields.get("transfer-rate", ""), log=mi.log[-50:])
    finally:
        mi.close()
