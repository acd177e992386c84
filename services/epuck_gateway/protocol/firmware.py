"""Firmware update of the e-puck2's main MCU (STM32F407, Cortex-M4) through its onboard programmer.

The programmer (an STM32F413 running a Black Magic Probe derivative) serves GDB's remote protocol
on one of the robot's USB serial ports (docs/reference/epuck2.md §9.1, the wiki's "Robot firmware update": "The onboard
programmer
run a GDB server, so we use GDB commands to upload a new firmware"). GCtronic's program script runs
`target extended-remote PORT`, `monitor swdp_scan`, `attach 1`, `set mem inaccessible-by-default
off`, `load`. Here `gdb-multiarch` (Debian) is driven through its machine interface (MI) so that
every step has a clear result and `load` reports progress; after the load `compare-sections`
verifies the flash against the ELF (the probe answers GDB's CRC requests), then `detach` lets the
new firmware run.

The ELF is checked before anything touches the robot: 32-bit little-endian ARM, every loadable byte
inside the STM32F407's 1 MiB of flash, and a vector table at the boot address (unless forced).

Faults: `load` erases the sectors it needs first, then writes; once it has begun the robot has no valid
firmware until a flash succeeds, and every error says so. A load or verify that makes no progress for
`stall_s` (a lost reply, a hung programmer: gdb itself waits `remoteflashtimeout`, 1000 s, and does not
recover) stops gdb and is retried from the start (erase and write again is idempotent). After a failed
load the MCU is left halted: gdb disconnects without `D` (detach resumes it, running from erased or half
written flash with its peripherals as the old firmware left them).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

FLASH_BASE = 0x0800_0000
FLASH_SIZE = 0x10_0000  # STM32F407xG: 1 MiB
# Boot: with BOOT0 low the STM32F407 maps main flash at 0 and boots from the vector table at its start
# (docs/reference/epuck2.md §9.3; RM0090 §2.4); the table's word 0 is the initial main stack pointer, word 1 the
# reset handler's address
# with bit 0 set (Thumb; ARMv7-M ARM §B1.5.3). docs/reference/epuck2.md §9.2 has the flash map: these are
# the STM32F407's datasheet facts (SRAM1+SRAM2 112+16 KiB at 0x20000000, CCM 64 KiB at 0x10000000).
BOOT_ADDRESS = FLASH_BASE
STACK_RAM = ((0x2000_0000, 0x2_0000, "SRAM"), (0x1000_0000, 0x1_0000, "CCM RAM"))
EM_ARM = 40
PT_LOAD = 1
SHT_NOBITS = 8
SHF_ALLOC = 2
GDB = "gdb-multiarch"
STALL_S = 10.0  # no load/verify progress for this long: the programmer stopped answering


class FirmwareError(Exception):
    """A firmware update that cannot go on; the message says why, in the user's terms. `robot_state` says what
    the update left on the robot ("" when its flash was not touched), `no_valid_firmware` whether it can run."""

    robot_state: str = ""
    no_valid_firmware: bool = False


class BadFirmware(FirmwareError):
    """The ELF is not a firmware for the e-puck2's STM32F407 (nothing was sent to the robot)."""


class NotBootable(BadFirmware):
    """No valid vector table at the boot address: the robot could not start this image (`force` flashes it)."""


class ProgrammerNotFound(FirmwareError):
    """No GDB server at the programmer's port (robot unplugged or off, wrong port)."""


class ProgrammerBusy(FirmwareError):
    """Another process (the gateway's link, another flash) holds the programmer's port."""


class FlashTimeout(FirmwareError):
    """gdb or the programmer did not answer in time (the CLI's exit 4, `timeout` on the bus)."""


class FlashStalled(FlashTimeout):
    """A load or verify made no progress for `stall_s`; gdb was stopped."""


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
    load_bytes: int = 0  # what gdb's `load` writes: the allocated sections with contents (0: the segments)

    @property
    def size(self) -> int:
        """Bytes written to flash: the one total of the progress and the result."""
        return self.load_bytes or sum(s.size for s in self.segments)

    def word(self, address: int) -> int | None:
        """The little-endian word the image puts at `address`, None if it puts nothing there."""
        for s in self.segments:
            if s.address <= address and address + 4 <= s.address + s.size:
                return int.from_bytes(s.data[address - s.address:address - s.address + 4], "little")
        return None

    def loads(self, address: int) -> bool:
        return any(s.address <= address < s.address + s.size for s in self.segments)


def check_elf(path: Path | str, force: bool = False) -> FirmwareImage:
    """Read and check an ELF for the e-puck2's STM32F407; FirmwareError with the reason otherwise."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadFirmware(f"cannot read {p}: {exc.strerror or exc}") from None
    return parse_elf(data, p, force)


def check_boot(image: FirmwareImage) -> None:
    """NotBootable unless the image holds a Cortex-M vector table at the boot address."""
    p = image.path
    sp, reset = image.word(BOOT_ADDRESS), image.word(BOOT_ADDRESS + 4)
    if sp is None or reset is None:
        lo, hi = image.segments[0].address, max(s.address + s.size for s in image.segments)
        raise NotBootable(f"{p} has no vector table at the boot address 0x{BOOT_ADDRESS:08x} (it loads "
                          f"0x{lo:08x}-0x{hi - 1:08x}): the robot could not start it; "
                          "force (--force) flashes it anyway")
    if not any(base < sp <= base + size for base, size, _ in STACK_RAM):
        raise NotBootable(f"{p}: the vector table at 0x{BOOT_ADDRESS:08x} starts with 0x{sp:08x}, not an initial "
                          "stack pointer in the STM32F407's RAM (" + ", ".join(
                              f"{name} 0x{base:08x}-0x{base + size:08x}" for base, size, name in STACK_RAM)
                          + "): not a vector table; force (--force) flashes it anyway")
    if not reset & 1:
        raise NotBootable(f"{p}: the reset vector 0x{reset:08x} has no Thumb bit (bit 0): the Cortex-M4 would "
                          "fault at reset; force (--force) flashes it anyway")
    if not image.loads(reset & ~1):
        raise NotBootable(f"{p}: the reset vector 0x{reset:08x} points outside the image's flash: the robot "
                          "could not start it; force (--force) flashes it anyway")


def _load_bytes(data: bytes) -> int:
    """What gdb's `load` writes: the allocated sections with contents (BFD's SEC_LOAD); 0 without
    section headers (gdb then loads the segments). `.bss` and non-allocated sections count for nothing,
    although gdb's own `total-size` counts them."""
    e_shoff, = struct.unpack_from("<I", data, 32)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 46)
    if not e_shoff or e_shentsize < 40 or e_shoff + e_shnum * e_shentsize > len(data):
        return 0
    total = 0
    for i in range(e_shnum):
        _name, sh_type, sh_flags, _addr, _off, sh_size = struct.unpack_from("<6I", data, e_shoff + i * e_shentsize)
        if sh_flags & SHF_ALLOC and sh_type != SHT_NOBITS:
            total += sh_size
    return total


def parse_elf(data: bytes, path: Path = Path("<memory>"), force: bool = False) -> FirmwareImage:
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
    image = FirmwareImage(path, e_entry, tuple(sorted(segments, key=lambda s: s.address)), _load_bytes(data))
    if not force:
        check_boot(image)
    return image


_MACHINES = {3: "x86", 62: "x86-64", 183: "AArch64", 243: "RISC-V", 8: "MIPS", 94: "Xtensa (the ESP32)"}


# =============================================================================================
# gdb-multiarch over MI
# =============================================================================================
Progress = Callable[[str, int, int], None]  # phase, done, total (bytes for "load" and "verify")


@dataclass
class OneBar:
    """One progress bar for a whole update: its total covers the load and the verify (the image's bytes, twice when
    verified), so it never goes back to 0 between them; the other phases keep its place, a retry starts it over.
    `update(phase, done, total)` -> (done, total) of the bar; `final` whether this report ends a phase's bytes."""

    verify: bool = True
    done: int = 0
    total: int = 0

    def update(self, phase: str, done: int, total: int) -> tuple[int, int]:
        if phase == "retry":
            self.done = 0
        elif phase in ("load", "verify") and total:
            self.total = total * (2 if self.verify else 1)
            self.done = min(self.total, done + (total if phase == "verify" else 0))
        return self.done, self.total

    @staticmethod
    def final(phase: str, done: int, total: int) -> bool:
        return phase in ("load", "verify") and bool(total) and done >= total


@dataclass
class FlashResult:
    bytes_loaded: int
    sections: list[str]
    verified: bool
    duration_s: float
    transfer_rate: str = ""
    attempts: int = 1
    retried: list[str] = field(default_factory=list)  # why each earlier attempt was given up
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
    """One gdb-multiarch process in MI mode: `run(command)` -> (ok, fields, console text).

    One thread reads gdb's output into a queue; `run` waits on it with a deadline for the command and,
    optionally, a shorter one for silence (`idle_s`: no output at all for that long is a stall). Either
    kills gdb (SIGKILL: it sends nothing more, in particular no detach) and raises a FlashTimeout."""

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
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="gdb-mi-reader", daemon=True)
        self._reader.start()
        self._token = 0
        self._read_until_prompt(self.timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.proc.stdout:
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _readline(self, deadline: float, idle_s: float | None = None) -> str:
        wait = deadline - time.monotonic()
        stall = idle_s is not None and idle_s < wait
        try:
            line = self._lines.get(timeout=max(0.0, idle_s if stall and idle_s is not None else wait))
        except queue.Empty:
            self.kill()
            if stall:
                raise FlashStalled(f"no progress for {idle_s:g} s") from None
            raise FlashTimeout("gdb-multiarch did not answer in time") from None
        if line is None:
            raise FirmwareError("gdb-multiarch exited: " + " / ".join(self.log[-5:]))
        return line

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

    def run(self, command: str, timeout: float | None = None,
            idle_s: float | None = None) -> tuple[bool, dict[str, str], str]:
        assert self.proc.stdin is not None
        self._token += 1
        try:
            self.proc.stdin.write(f"{self._token}{command}\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            raise FirmwareError("gdb-multiarch exited: " + " / ".join(self.log[-5:])) from None
        deadline = time.monotonic() + (timeout or self.timeout_s)
        console: list[str] = []
        while True:
            line = self._readline(deadline, idle_s)
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

    def disconnect(self) -> None:
        """Leave the target as it is (halted): `disconnect` sends no packet, unlike `detach` (`D`), which
        resumes the MCU and which gdb sends on exit while attached."""
        if self.alive:
            with contextlib.suppress(FirmwareError):
                self.run("-target-disconnect", 10.0)

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


@dataclass
class _Flash:
    """What one firmware update did to the robot, across attempts."""

    total: int
    load_started: bool = False  # `load` was sent: it erases before it writes
    written: int = 0  # bytes gdb reported written in the last attempt
    loaded: bool = False  # the last attempt's load completed
    verified_bad: bool = False
    left_halted: bool = False  # gdb ended without detaching while the port was there

    @property
    def no_valid_firmware(self) -> bool:
        """The failure left the robot without a firmware that can run (erased, partly written, or not matching)."""
        return self.load_started and (self.verified_bad or not self.loaded)

    def robot_state(self) -> str:
        """The robot's state after a failure, and the way out; "" if its firmware was not touched."""
        if not self.load_started:
            return ""
        if self.verified_bad:
            text = "the robot has no valid firmware (its flash does not match the image)"
        elif self.loaded:
            text = "the robot's new firmware was written but not verified"
        elif self.written:
            text = (f"the robot has no valid firmware (its flash was erased and partly written: gdb reported "
                    f"{self.written} of {self.total} bytes)")
        else:
            text = "the robot has no valid firmware (the load had begun erasing its flash)"
        return text + ("; its MCU is left halted" if self.left_halted else "") + "; run the same command again"


def flash_firmware(programmer: str, elf: Path | str, progress: Progress | None = None, verify: bool = True,
                   gdb: str = GDB, timeout_s: float = 300.0, cancelled: Callable[[], bool] | None = None,
                   stall_s: float = STALL_S, retries: int = 1, force: bool = False,
                   lock: bool = True) -> FlashResult:
    """Load `elf` into the robot's MCU through the programmer's GDB server at `programmer`.

    `programmer` is the GDB server's serial port (/dev/ttyACM0; /dev/serial/by-id/...-if00) or
    host:port for a GDB server on TCP. A load or verify without progress for `stall_s` is given up
    and the whole update retried up to `retries` times. `force` flashes an image without a vector
    table at the boot address. `lock` takes the serial port's lock (port_lock) for the update, and
    refuses a port that another process (the gateway's link) holds. Blocking: run it on a thread.

    Errors after the load has begun say the robot's state (no valid firmware) and the way out."""
    image = check_elf(elf, force)
    tcp = bool(re.match(r"^[\w.-]+:\d+$", programmer))
    if not tcp and not os.path.exists(programmer):
        raise ProgrammerNotFound(f"programmer not found: {programmer} does not exist (is the robot plugged in and on? "
                            "the GDB server is the first of the robot's two USB serial ports)")
    with _port_held(programmer if lock and not tcp else None):
        return _flash(programmer, image, progress, verify, gdb, timeout_s, cancelled, stall_s, retries)


@contextlib.contextmanager
def _port_held(port: str | None) -> Iterator[None]:
    if port is None:
        yield
        return
    from services.epuck_gateway.port_lock import PortBusy, hold_port

    try:
        with hold_port(port):
            yield
    except PortBusy as exc:
        raise ProgrammerBusy(f"{exc.strerror}: nothing was sent to the robot") from None


def _flash(programmer: str, image: FirmwareImage, progress: Progress | None, verify: bool, gdb: str,
           timeout_s: float, cancelled: Callable[[], bool] | None, stall_s: float, retries: int) -> FlashResult:
    report = progress or (lambda phase, done, total: None)
    t0 = time.monotonic()
    state = _Flash(total=image.size)
    retried: list[str] = []
    attempt = 0
    while True:
        attempt += 1
        try:
            res = _flash_once(programmer, image, report, verify, gdb, timeout_s, cancelled, stall_s, state)
        except FlashStalled as exc:
            if attempt <= retries and state.load_started:
                retried.append(str(exc))
                report("retry", 0, 0)
                continue
            raise _with_state(exc, state, retried) from None
        except FirmwareError as exc:
            raise _with_state(exc, state, retried) from None
        res.duration_s = round(time.monotonic() - t0, 3)
        res.attempts, res.retried = attempt, retried
        return res


def _with_state(exc: FirmwareError, state: _Flash, retried: list[str]) -> FirmwareError:
    msg = str(exc)
    if retried:
        msg = f"{'; '.join(retried)}; then, retried: {msg}"
    robot = state.robot_state()
    err = type(exc)(f"{msg}. {robot[0].upper()}{robot[1:]}" if robot else msg)
    err.robot_state = robot
    err.no_valid_firmware = state.no_valid_firmware
    return err


def _flash_once(programmer: str, image: FirmwareImage, report: Progress, verify: bool, gdb: str, timeout_s: float,
                cancelled: Callable[[], bool] | None, stall_s: float, state: _Flash) -> FlashResult:
    total = image.size
    sections: list[str] = []
    phase = ""
    port_gone = False

    def on_record(line: str) -> None:
        line = line.lstrip("0123456789")  # the command's token
        if line.startswith("+download"):
            f = _fields(line)
            if "section" in f and f["section"] not in sections:
                sections.append(f["section"])
            if "total-sent" in f:  # gdb's total-size counts .bss and non-allocated sections: not ours
                state.written = min(int(f["total-sent"]), total)
                report("load", state.written, total)

    mi = GdbMi(image.path, gdb, timeout_s)
    mi.on_record = on_record
    attached = False

    def step(name: str, command: str, what: str, timeout: float = 30.0,
             idle_s: float | None = None) -> tuple[dict[str, str], str]:
        nonlocal phase
        if cancelled is not None and cancelled():
            raise FirmwareError(f"cancelled before {name}")
        phase = name
        report(name, 0, total if name in ("load", "verify") else 0)
        ok, fields, text = mi.run(command, timeout, idle_s)
        if not ok:
            raise FirmwareError(f"{what}: {fields.get('msg') or text.strip() or 'failed'}")
        return fields, text

    try:
        step("connect", "-gdb-set confirm off", "gdb")
        step("connect", "-gdb-set mem inaccessible-by-default off", "gdb")
        try:
            step("connect", f"-target-select extended-remote {programmer}", f"programmer not found at {programmer}",
                 idle_s=stall_s)
        except FlashTimeout:
            raise FlashTimeout(f"the programmer at {programmer} does not answer (is it the programmer's port, the "
                               "first of the robot's two? unplug and replug the robot if it is)") from None
        except FirmwareError as exc:
            raise ProgrammerNotFound(f"{exc} (is the robot plugged in and on?)") from None
        _, scan = step("scan", '-interpreter-exec console "monitor swdp_scan"', "no target found by the programmer")
        if "No targets" in scan or "STM32F4" not in scan:
            raise ProgrammerNotFound(f"the programmer found no STM32F4 (the e-puck2's MCU; is the robot on?): "
                                     f"{scan.strip()!r}")
        step("attach", "-target-attach 1", "cannot attach to the robot's MCU")
        attached = True
        state.load_started = True  # an earlier attempt's state holds until this one loads
        state.written, state.loaded, state.verified_bad, state.left_halted = 0, False, False, False
        fields, _ = step("load", "-target-download", "loading the firmware failed", timeout_s, stall_s)
        state.written, state.loaded = total, True
        report("load", total, total)
        verified = False
        if verify:
            _, text = step("verify", '-interpreter-exec console "compare-sections"', "verification failed",
                           timeout_s, stall_s)
            if "MIS-MATCHED" in text or "matched" not in text:
                state.verified_bad = True
                raise FirmwareError(f"verification failed: {text.strip()}")
            report("verify", total, total)
            verified = True
        state.verified_bad = False
        step("detach", "-target-detach", "cannot detach (the new firmware may not be running)")
        attached = False
        return FlashResult(bytes_loaded=int(fields.get("load-size", total)), sections=sections, verified=verified,
                           duration_s=0.0, transfer_rate=fields.get("transfer-rate", ""), log=mi.log[-50:])
    except FlashStalled as exc:
        done = f" at {state.written} of {total} bytes" if phase == "load" else ""
        raise FlashStalled(f"the {phase} stalled{done}: {exc} (the programmer stopped answering); gdb-multiarch "
                           "was stopped") from None
    except FlashTimeout as exc:
        if phase in ("connect",):
            raise
        raise FlashTimeout(f"the {phase} did not finish in {timeout_s:g} s: {exc}") from None
    except FirmwareError as exc:
        if "Remote connection closed" in str(exc) or "Remote communication error" in str(exc):
            port_gone = True
            raise FirmwareError(f"{exc}: the programmer's port went away during the {phase} (robot unplugged or "
                                "switched off?)") from None
        raise
    finally:
        if attached and state.load_started:
            mi.disconnect()  # no detach: the MCU stays halted rather than run a broken flash
            state.left_halted = not port_gone
        mi.close()
