"""Advanced sercom v2 (asercom2), the e-puck2's protocol over Bluetooth (selector 3) and USB (selector 8).

Sans-I/O: request bytes out, reply bytes in, no port and no clock. Followed: docs/reference/epuck2.md §6,
checked against the F407 firmware's `Asercom2.c` where §6 gives no size (noted per command below).

Binary mode: each command is the two's complement of its letter or number (-'N' = 0xB2, -0x08 =
0xF8), some followed by argument bytes; commands may be chained in one write and a 0x00 byte ends
the chain. The robot then answers with every reply concatenated in command order, integers LSB
first, with no framing at all: the host must know the size of each reply (the image carries its
own 3-byte header: mode, width, height). Commands that answer nothing (-0x09, -'D', -'L', -'P',
-0x0A) may sit anywhere in the chain.

ASCII mode: an uppercase letter, comma-separated arguments, `\\r`; the robot answers one line in
lower case (`D,200,200\\r` -> `d\\r\\n`, `N\\r` -> `n,v0,...,v7\\r\\n`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.epuck_gateway.protocol.wifi import SENSORS_SIZE, EpuckCommand, ProtocolError

ALL_SENSORS_SIZE = 103  # -0x08: the WiFi sensors bytes 0..101 plus one reserved byte (no button)
ACTUATORS_SIZE = 19  # -0x09 payload = WiFi command bytes 2..20
RGB_SIZE = 12
IMAGE_HEADER_SIZE = 3  # mode, width, height
CAM_GREY, CAM_RGB565 = 0, 1  # e_poxxxx.h camera modes
DEFAULT_IMAGE = (CAM_RGB565, 40, 40)  # asercom2's camera default: 40x40 RGB565 (zoom 8)
CHAIN_END = 0x00
# The longest argument list the firmware reads after a binary command: -'w' (the RGB-panel extension, 24 + 3 + 8
# bytes, Asercom2.c; the reference's longest, -0x09, has 19). A robot whose chain was cut inside a command's
# arguments takes whatever comes next as the missing bytes: this many zeros complete any such list with
# zeros (speeds 0, LEDs off, sound none) and one more 0x00 ends the chain (`end_pending`).
LONGEST_ARGS = 35


def end_pending() -> bytes:
    """Zeros that end whatever binary command and chain the robot may be in the middle of, harmlessly: they
    complete any partial argument list with zeros, then end the chain; an idle robot ignores a 0x00 (§6)."""
    return bytes(LONGEST_ARGS + 1)


def wire_code(code: int) -> int:
    """The binary form of a command: -code as one byte."""
    return (-code) & 0xFF


def code_of(byte: int) -> int:
    """The command a negative first byte stands for."""
    return (-(byte - 256 if byte >= 128 else byte)) & 0xFF


@dataclass(frozen=True)
class AsercomCommand:
    """One binary command: its code (letter or number), argument bytes, and the size of its reply.

    `reply_size` is None for the image, whose size follows from its header."""

    code: int
    args: bytes = b""
    reply_size: int | None = 0
    name: str = ""

    def encode(self) -> bytes:
        return bytes([wire_code(self.code)]) + self.args


# -- the commands --------------------------------------------------------------------------------
def get_all_sensors() -> AsercomCommand:
    return AsercomCommand(0x08, b"", ALL_SENSORS_SIZE, "all_sensors")


def set_all_actuators(cmd: EpuckCommand) -> AsercomCommand:
    """-0x09 + the 19 bytes of the WiFi command after its id and request byte (docs/reference/epuck2.md §3)."""
    return AsercomCommand(0x09, cmd.encode()[2:], 0, "set_all_actuators")


def set_rgb(colors: Sequence[tuple[int, int, int]]) -> AsercomCommand:
    flat = bytes(c for led in colors for c in led)
    if len(flat) != RGB_SIZE:
        raise ProtocolError("four RGB LEDs x 3 channels")
    return AsercomCommand(0x0A, flat, 0, "rgb")


def get_button() -> AsercomCommand:
    return AsercomCommand(0x0B, b"", 1, "button")


def get_microphones() -> AsercomCommand:
    return AsercomCommand(0x0C, b"", 8, "microphones")  # 4 x uint16


def get_tof() -> AsercomCommand:
    return AsercomCommand(0x0D, b"", 2, "tof")


def get_sd_state() -> AsercomCommand:
    return AsercomCommand(0x0E, b"", 1, "sd_state")


def set_magnetometer(enabled: bool) -> AsercomCommand:
    return AsercomCommand(0x0F, bytes([int(enabled)]), 1, "magnetometer")  # §6: reply 1 byte


def set_proximity_mode(mode: int) -> AsercomCommand:
    """0 = off, 1 = fast, 2 = slow (§6)."""
    if mode not in (0, 1, 2):
        raise ProtocolError("proximity sampling mode is 0 (off), 1 (fast) or 2 (slow)")
    return AsercomCommand(0x10, bytes([mode]), 1, "proximity_mode")


def set_tof(enabled: bool) -> AsercomCommand:
    return AsercomCommand(0x11, bytes([int(enabled)]), 1, "tof_enable")


def get_proximity() -> AsercomCommand:
    return AsercomCommand(ord("N"), b"", 16, "proximity")


def get_ambient() -> AsercomCommand:
    return AsercomCommand(ord("O"), b"", 16, "ambient")


def get_acc() -> AsercomCommand:
    return AsercomCommand(ord("a"), b"", 6, "acc")


def get_gyro() -> AsercomCommand:
    return AsercomCommand(ord("g"), b"", 6, "gyro")


def get_steps() -> AsercomCommand:
    return AsercomCommand(ord("Q"), b"", 4, "steps")


def get_battery() -> AsercomCommand:
    return AsercomCommand(ord("b"), b"", 2, "battery")


def get_mic_volumes() -> AsercomCommand:
    return AsercomCommand(ord("u"), b"", 6, "mic_volumes")  # Asercom2.c: 3 x uint16 (§6 gives no size)


def get_temperature() -> AsercomCommand:
    return AsercomCommand(ord("t"), b"", 1, "temperature")


def set_speed(left: int, right: int) -> AsercomCommand:
    return AsercomCommand(ord("D"), _int16s(left, right), 0, "speed")


def set_steps(left: int, right: int) -> AsercomCommand:
    return AsercomCommand(ord("P"), _int16s(left, right), 0, "set_steps")


def set_led(number: int, state: int) -> AsercomCommand:
    """LED 0..7, 8 = body, 9 = front; state 0 off, 1 on, 2 toggle."""
    if not (0 <= number <= 9 and 0 <= state <= 2):
        raise ProtocolError("LED number 0..9, state 0..2")
    return AsercomCommand(ord("L"), bytes([number, state]), 0, "led")


def get_image() -> AsercomCommand:
    return AsercomCommand(ord("I"), b"", None, "image")


def _int16s(*values: int) -> bytes:
    try:
        return struct.pack(f"<{len(values)}h", *values)
    except struct.error as exc:
        raise ProtocolError(f"int16 out of range: {exc}") from None


def encode_chain(commands: Sequence[AsercomCommand]) -> bytes:
    """One write: every command in order, then the 0x00 that ends the chain."""
    if not commands:
        raise ProtocolError("an empty chain")
    return b"".join(c.encode() for c in commands) + bytes([CHAIN_END])


# -- replies --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AsercomImage:
    mode: int
    width: int
    height: int
    pixels: bytes  # RGB565 big-endian words (as the WiFi image) or 8-bit grey

    @property
    def bytes_per_pixel(self) -> int:
        return 2 if self.mode == CAM_RGB565 else 1


def image_size(mode: int, width: int, height: int) -> int:
    return width * height * (2 if mode == CAM_RGB565 else 1)


def _decode(cmd: AsercomCommand, data: bytes) -> Any:
    n = cmd.name
    if n in ("proximity", "ambient"):
        return struct.unpack("<8H", data)
    if n in ("acc", "gyro"):
        return struct.unpack("<3h", data)
    if n == "steps":
        return struct.unpack("<2h", data)
    if n in ("battery", "tof"):
        return struct.unpack("<H", data)[0]
    if n == "microphones":
        return struct.unpack("<4H", data)
    if n == "mic_volumes":
        return struct.unpack("<3H", data)
    if n == "temperature":
        return struct.unpack("<b", data)[0]
    if cmd.reply_size == 1:
        return data[0]
    return bytes(data)  # all_sensors: the raw block (see `sensors_packet`)


@dataclass
class AsercomReplyReader:
    """Bytes of the reply to one chain, in any segmentation -> one decoded value per answering command.

    `feed` returns None until the whole reply is in; bytes past it are `extra` (garbage: the robot
    answers nothing it was not asked)."""

    commands: Sequence[AsercomCommand]
    _buf: bytearray = field(default_factory=bytearray)
    _index: int = 0
    results: list[tuple[AsercomCommand, Any]] = field(default_factory=list)
    extra: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self._advance()

    def _advance(self) -> None:
        while self._index < len(self.commands) and self.commands[self._index].reply_size == 0:
            self._index += 1
        if self._index >= len(self.commands):
            self.done = True

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[AsercomCommand, Any]] | None:
        if self.done:
            self.extra += len(data)
            return None
        self._buf += data
        while not self.done:
            cmd = self.commands[self._index]
            size = cmd.reply_size
            if size is None:  # image: header first
                if len(self._buf) < IMAGE_HEADER_SIZE:
                    return None
                mode, w, h = self._buf[0], self._buf[1], self._buf[2]
                size = IMAGE_HEADER_SIZE + image_size(mode, w, h)
                if len(self._buf) < size:
                    return None
                value: Any = AsercomImage(mode, w, h, bytes(self._buf[IMAGE_HEADER_SIZE:size]))
            else:
                if len(self._buf) < size:
                    return None
                value = _decode(cmd, bytes(self._buf[:size]))
            del self._buf[:size]
            self.results.append((cmd, value))
            self._index += 1
            self._advance()
        self.extra += len(self._buf)
        self._buf.clear()
        return self.results

    @property
    def pending(self) -> int:
        """Bytes received of a reply not yet complete."""
        return len(self._buf)


def expected_size(commands: Sequence[AsercomCommand], image: tuple[int, int, int] = DEFAULT_IMAGE) -> int:
    """Bytes the robot will answer, with the camera configured as `image` (mode, width, height)."""
    return sum(IMAGE_HEADER_SIZE + image_size(*image) if c.reply_size is None else c.reply_size
               for c in commands)


def sensors_packet(block: bytes, button: int) -> bytes:
    """The 103-byte -0x08 block and the -0x0B button -> the 104-byte WiFi sensors layout (docs/reference/epuck2.md §1:
    the ESP32 puts the button at offset 102 and moves the reserved byte to 103), so one decoder serves
    both transports."""
    if len(block) != ALL_SENSORS_SIZE:
        raise ProtocolError(f"the all-sensors block is {ALL_SENSORS_SIZE} bytes, got {len(block)}")
    out = block[:102] + bytes([button & 0xFF]) + block[102:103]
    assert len(out) == SENSORS_SIZE
    return out


def all_sensors_block(wifi_packet: bytes) -> tuple[bytes, int]:
    """The inverse (simulator): a 104-byte WiFi-layout packet -> the 103-byte block and the button."""
    if len(wifi_packet) != SENSORS_SIZE:
        raise ProtocolError(f"a sensors packet is {SENSORS_SIZE} bytes, got {len(wifi_packet)}")
    return wifi_packet[:102] + wifi_packet[103:104], wifi_packet[102]


# -- the robot's side of a chain (simulator) ------------------------------------------------------------
ARG_SIZES = {0x09: ACTUATORS_SIZE, 0x0A: RGB_SIZE, 0x0F: 1, 0x10: 1, 0x11: 1, ord("D"): 4, ord("P"): 4,
             ord("L"): 2, ord("W"): 3, ord("w"): LONGEST_ARGS}  # -'W' I2C write, -'w' RGB panel (Asercom2.c)


@dataclass
class AsercomChainParser:
    """Host bytes in any segmentation -> complete chains (lists of AsercomCommand, without the 0x00).

    As Asercom2.c reads its input: outside a chain a 0x00 is ignored, and any other positive byte starts
    an ASCII line, returned as `str` once its `\\r`/`\\n` is in; every byte up to that end is part of the
    line, binary ones too (a robot that got half a line waits for its end and swallows the chains that
    follow). A `\\r`/`\\n` outside a line is skipped, and the byte after it starts a line whatever it is
    (the firmware's `while (c == '\\n' || c == '\\r') getchar(&c)` before `buffer[0] = c`).
    Unknown binary codes are kept in the chain with no arguments (the firmware silently ignores them).
    A command whose argument bytes are only partly in waits for the rest, whatever they are and however
    long they take (the firmware's blocking getchar): a chain cut inside a command's arguments takes the host's
    next bytes (a poll, a resynchronisation) as the missing ones (`pending_args`)."""

    _buf: bytearray = field(default_factory=bytearray)
    _chain: list[AsercomCommand] = field(default_factory=list)
    _line_next: bool = False  # a line end was skipped: the next byte starts a line
    ignored: int = 0

    @property
    def in_line(self) -> bool:
        """Bytes of an unfinished ASCII line are waiting for its end (or the next byte will start one)."""
        return self._line_next or (not self._chain and bool(self._buf) and self._buf[0] < 0x80)

    @property
    def pending_args(self) -> int:
        """Argument bytes still owed to a binary command whose first bytes are in (0: none)."""
        if not self._buf or (not self._chain and (self._buf[0] < 0x80 or self._line_next)):
            return 0
        if self._buf[0] == CHAIN_END:
            return 0
        return max(0, 1 + ARG_SIZES.get(code_of(self._buf[0]), 0) - len(self._buf))

    def feed(self, data: bytes) -> list[list[AsercomCommand] | str]:
        self._buf += data
        out: list[list[AsercomCommand] | str] = []
        while self._buf:
            b = self._buf[0]
            if not self._chain and (b < 0x80 or self._line_next):  # ASCII mode
                if b in (0x0A, 0x0D):
                    del self._buf[0]
                    self._line_next = True
                    continue
                if b == 0x00 and not self._line_next:
                    del self._buf[0]
                    continue
                end = next((i for i, c in enumerate(self._buf) if c in (0x0A, 0x0D)), -1)
                if end < 0:
                    return out
                out.append(self._buf[:end].decode("ascii", "replace"))
                del self._buf[:end + 1]
                self._line_next = False
                continue
            if b == CHAIN_END:
                del self._buf[0]
                out.append(self._chain)
                self._chain = []
                continue
            code = code_of(b)
            n = ARG_SIZES.get(code, 0)
            if len(self._buf) < 1 + n:
                return out
            args = bytes(self._buf[1:1 + n])
            del self._buf[:1 + n]
            self._chain.append(AsercomCommand(code, args, _REPLY_SIZES.get(code, 0), _NAMES.get(code, f"0x{code:02x}")))
        return out


_TEMPLATES: tuple[Callable[[], AsercomCommand], ...] = (
    get_all_sensors, get_button, get_microphones, get_tof, get_sd_state, get_proximity, get_ambient, get_acc,
    get_gyro, get_steps, get_battery, get_mic_volumes, get_temperature, get_image)
_REPLY_SIZES: dict[int, int | None] = {t().code: t().reply_size for t in _TEMPLATES} | {0x0F: 1, 0x10: 1, 0x11: 1}
_NAMES: dict[int, str] = {t().code: t().name for t in _TEMPLATES} | {
    0x09: "set_all_actuators", 0x0A: "rgb", 0x0F: "magnetometer", 0x10: "proximity_mode", 0x11: "tof_enable",
    ord("D"): "speed", ord("P"): "set_steps", ord("L"): "led"}


# -- ASCII mode ------------------------------------------------------------------------------------------
def ascii_command(letter: str, *args: int) -> bytes:
    """`ascii_command("D", 200, 200)` -> b"D,200,200\\r". The case is kept: the firmware upper-cases every
    letter but `b` (battery) and `g` (gyro), which differ from `B` (body LED) and `G` (IR receiver)."""
    if len(letter) != 1 or not letter.isascii() or not letter.isalpha():
        raise ProtocolError("an ASCII command is one letter")
    return ",".join([letter, *(str(int(a)) for a in args)]).encode("ascii") + b"\r"


def parse_ascii_reply(line: bytes | str) -> tuple[str, list[int]]:
    """`b"n,1,2,3\\r\\n"` -> ("n", [1, 2, 3]). Fields that are not integers raise ProtocolError."""
    text = line.decode("ascii", "replace") if isinstance(line, bytes) else line
    parts = text.strip().split(",")
    if not parts[0]:
        raise ProtocolError("an empty reply line")
    try:
        return parts[0], [int(p) for p in parts[1:]]
    except ValueError:
        raise ProtocolError(f"not an integer reply: {text.strip()!r}") from None
