"""The DexRun socket protocol (Haddington Dynamics Dexter, TCP port 50000): pure codec, no I/O, no clock.

Byte for byte after docs/reference/dexter.md (sections quoted as "§n"). Where DexRun branches
differ, both are supported and the code says which behaviour it follows:

* **stable** = `Stable_2020_02_04_ConeDrive` (the repo's default branch);
* **newest** = `Stable_Conedrive` / `Move_To_Straight` / `XL-430-Support` (status modes, `C`/`D`,
  float directions in `M`/`T`, bit-field errors, ESPIPE at the end of a #keyword, whole-line shell).

Requests: `<job_id> <instruction_id> <start_ms> <end> <oplet> <args…>;` with single spaces, at most
255 bytes, sent as one 256-byte zero-padded write (what DDE sends and DexRun's `recBuff[256]` expects).
Every request is validated before it is encoded: a missing argument crashes DexRun (`atoi(NULL)`, PR #98),
so nothing leaves without all of its arguments.

Replies: always 240 bytes = 60 little-endian int32 (§1), reassembled from any TCP segmentation
(`ReplyAssembler`), decoded into the common header, the standard status (§3.2) or an `r` payload (§3.4).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

DEXRUN_PORT = 50000
REPLY_INTS = 60
REPLY_BYTES = REPLY_INTS * 4  # 240: `write(connfd, sendBuff, 60*4)` (§1)
MAX_INSTRUCTION_ID = 2**31 - 1  # instruction ids are int32 on the robot (echoed through atoi); the link wraps to 1
SEND_BUFFER = 256  # DDE's Buffer.alloc(256), zero-padded (§2)
MAX_REQUEST = 255  # DexRun scans the first 255 bytes for ';' (recBuff[256], CmdString[255])
MAX_CONTENT_CHARS = 62  # MAX_CONTENT_CHARS in DexRun.c line 57, every branch (§7)
PAYLOAD_START = 28  # Socket.PAYLOAD_START = 7*4 (§3.4)
PAYLOAD_MAX = REPLY_BYTES - PAYLOAD_START  # the numeric `r <addr> <end>` dump may use up to 76 of these
ARCSEC_PER_DEG = 3600.0
NBITS_PER_DEG_S = 7754.73550222  # DDE `_nbits_cf`: speeds/accelerations deg/s -> "nbits" (§4.1)
UM_PER_M = 1_000_000.0
XL320_DEG_PER_UNIT = 0.29  # Dynamixel XL-320 position unit (§5)
J6_ZERO_UNITS = 512  # J6 zero in Dynamixel units; J7's is 0 (§3.2)
JUNK_WORD = 2147483647  # what ints 19/29/39/49/59 hold in the wiki's sample (an FPGA descriptor)

_REPLY = struct.Struct(f"<{REPLY_INTS}i")


class Firmware(StrEnum):
    STABLE = "stable"
    NEWEST = "newest"


class ProtocolError(ValueError):
    """A request that must not be sent, or bytes that are not a DexRun reply."""


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------

# Oplets whose arguments we check. (min, max) argument tokens; None = no upper bound checked here
# (the 255-byte limit still applies). Anything not listed is refused by `check_oplet` unless it is in
# HARMLESS_OPLETS (DexRun answers error 1 to unknown oplets; that does no harm).
OPLET_ARGS: dict[str, tuple[int, int | None]] = {
    "a": (5, 7),  # J1..J5 arcsec, optional J6 J7 Dynamixel units (NaN skips one) (§4)
    "P": (5, 7),  # PID offsets, same shape
    "R": (5, 5),  # relative deltas
    "M": (9, 9),  # x y z µm, dir x y z, config 3 booleans
    "T": (9, 13),  # like M; DDE sends 13 (+tool_speed, resolution, J6, J7)
    "C": (9, 9),  # newest only (PID_MOVE_TO)
    "D": (9, 13),  # newest only (PID_MOVE_TO_STRAIGHT)
    "F": (0, 0),
    "g": (0, 1),  # newest: optional status-mode character; stable ignores it
    "h": (0, 0),
    "G": (0, 0),
    "z": (1, 1),  # microseconds; `z` without it crashed DexRun (PR #98)
    "S": (2, 6),  # name|index, value, up to 4 more
    "w": (2, 2),  # virtual address, value
    "W": (2, None),  # f 0 <path> | m|s|e <n> <data>
    "r": (2, None),  # block#, target (a #keyword may carry arguments; a shell line has spaces)
    "B": (10, 10),
}
NEWEST_ONLY_OPLETS = frozenset("CD")
MOTION_OPLETS = frozenset("aRMTCD")  # queued in the 16-deep FIFO: no reply while it is full (§4)
HARMLESS_OPLETS = frozenset("x")  # parsed, answered with error 1 (§4)
# Never sent: `i` (capture_points) reads DexRun's stdin and blocks it for good; `E` crashed DexRun (§4).
REFUSED_OPLETS = {"i": "capture_points reads DexRun's stdin and blocks the robot",
                  "E": "never implemented; DDE notes that sending it crashed DexRun"}

# `S` parameter names, Params[] of DexRun-stable line 1980, in index order (§4.1).
PARAM_NAMES: tuple[str, ...] = (
    "MaxSpeed", "Acceleration",
    "J1Force", "J3Force", "J2Force", "J4Force", "J5Force",
    "J1Friction", "J3Friction", "J2Friction", "J4Friction", "J5Friction",
    "J1BoundryHigh", "J1BoundryLow", "J3BoundryHigh", "J3BoundryLow", "J2BoundryHigh", "J2BoundryLow",
    "J4BoundryHigh", "J4BoundryLow", "J5BoundryHigh", "J5BoundryLow",
    "GripperMotor", "EERoll", "EESpan", "StartSpeed", "EndSpeed",
    "ServoSet2X", "ServoSet", "RebootServo", "RunFile",
    "J1_PID_P", "J2_PID_P", "J3_PID_P", "J4_PID_P", "J5_PID_P",
    "AngularSpeed", "AngularSpeedStartAndEnd", "AngularAcceleration",
    "CartesianSpeed", "CartesianSpeedStart", "CartesianSpeedEnd", "CartesianAcceleration", "CartesianStepSize",
    "CartesianPivotSpeed", "CartesianPivotSpeedStart", "CartesianPivotSpeedEnd", "CartesianPivotAcceleration",
    "CartesianPivotStepSize",
    "EyeNumbers", "CommandedAngles", "LinkLengths", "RawEncoderErrorLimits", "RawVelocityLimits",
)
# Names DDE sends that are newer than both published firmwares (§4.1): accepted, the robot may answer 1.
NEWER_PARAM_NAMES = ("JointDH", "JointSpeed", "JointAcceleration")

# What moves the arm (the bus stop refuses it, services/dexter_gateway/README.md "Stopping everything"): the queued
# moves, `P` (immediate PID offsets), `w` (an FPGA register write: the reference names none that is safe, §4), and
# the `S` parameters that set a position, a force or a servo, or run oplets (§4.1: EERoll/EESpan drive J6/J7,
# GripperMotor, ServoSet/ServoSet2X/RebootServo write the Dynamixels, RunFile runs a file of oplets; CommandedAngles
# and the J*Force terms set what the joints servo to: inference). Speeds, accelerations, boundaries, gains and
# calibration only shape later moves.
MOVING_OPLETS = MOTION_OPLETS | {"P", "w"}
MOTION_PARAMS = frozenset({"GripperMotor", "EERoll", "EESpan", "ServoSet2X", "ServoSet", "RebootServo", "RunFile",
                           "CommandedAngles", "J1Force", "J2Force", "J3Force", "J4Force", "J5Force"})


def moves(oplet: str, args: Sequence[str]) -> bool:
    """The request can make the arm move (`MOVING_OPLETS`, `MOTION_PARAMS`)."""
    if oplet in MOVING_OPLETS:
        return True
    if oplet != "S" or not args:
        return False
    try:
        return resolve_param(args[0]) in MOTION_PARAMS
    except ProtocolError:
        return False


class ParamUnit(StrEnum):
    NBITS = "deg/s -> nbits"  # × 7754.7355
    ARCSEC = "deg -> arcsec"  # × 3600
    MICRONS = "m -> µm"  # × 1e6
    RAW = "raw"


def param_unit(name: str) -> ParamUnit:
    """DDE's `instruction_array_degrees_to_arcseconds_maybe` conversions (§4.1)."""
    speed = name in ("MaxSpeed", "StartSpeed", "Acceleration") or name.startswith(("Angular", "CartesianPivot"))
    if speed and not name.endswith("StepSize"):
        return ParamUnit.NBITS
    if "Boundry" in name or name in ("CommandedAngles", "RawEncoderErrorLimits", "RawVelocityLimits"):
        return ParamUnit.ARCSEC
    if name == "LinkLengths" or name.startswith("Cartesian"):
        return ParamUnit.MICRONS
    return ParamUnit.RAW


def convert_param(name: str, value: float) -> float:
    unit = param_unit(name)
    if unit is ParamUnit.NBITS:
        return value * NBITS_PER_DEG_S
    if unit is ParamUnit.ARCSEC:
        return value * ARCSEC_PER_DEG
    if unit is ParamUnit.MICRONS:
        return value * UM_PER_M
    return value


def resolve_param(name_or_index: str | int) -> str:
    """A parameter name, or its index in Params[] (DexRun accepts either)."""
    if isinstance(name_or_index, int) or str(name_or_index).isdigit():
        i = int(name_or_index)
        if not 0 <= i < len(PARAM_NAMES):
            raise ProtocolError(f"S parameter index {i} out of range 0..{len(PARAM_NAMES) - 1}")
        return PARAM_NAMES[i]
    if name_or_index in PARAM_NAMES or name_or_index in NEWER_PARAM_NAMES:
        return str(name_or_index)
    raise ProtocolError(f"unknown S parameter {name_or_index!r}")


_TOKEN_BAD = re.compile(r"[\s,;\x00]")


def fmt_number(v: float | int) -> str:
    """A number as DexRun parses it (atoi/atof). NaN is the literal `NaN` (skips J6/J7, §2)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        raise ProtocolError("infinite values cannot be sent")
    if v == int(v) and abs(v) < 2**31:
        return str(int(v))
    return repr(float(v))


def arcsec(deg: float) -> int:
    """Degrees -> integer arcseconds, the wire unit of every J1-J5 angle (§5)."""
    if not math.isfinite(deg):
        raise ProtocolError(f"angle {deg!r} is not finite")
    v = round(deg * ARCSEC_PER_DEG)
    if not -(2**31) <= v < 2**31:
        raise ProtocolError(f"angle {deg} deg does not fit an int32 of arcseconds")
    return v


def check_path(path: str) -> str:
    """A robot path: DexRun strtok()s it on space/comma and stops at ';', so none of those (§3.4, §4.2)."""
    if not path:
        raise ProtocolError("empty path")
    if _TOKEN_BAD.search(path):
        raise ProtocolError(f"path {path!r} contains a space, comma, ';' or NUL: DexRun would cut it there")
    if path.startswith("`"):
        raise ProtocolError("a path starting with a backtick is a shell command")
    return path


def check_oplet(oplet: str, args: Sequence[str], firmware: Firmware = Firmware.NEWEST) -> None:
    """Refuse what DexRun would crash on, ignore, or misparse."""
    if len(oplet) != 1 or not oplet.isprintable() or oplet.isspace() or oplet in ";,":
        raise ProtocolError(f"oplet must be one printable character, got {oplet!r}")
    if oplet in REFUSED_OPLETS:
        raise ProtocolError(f"oplet {oplet!r} is refused: {REFUSED_OPLETS[oplet]}")
    if oplet in NEWEST_ONLY_OPLETS and firmware is Firmware.STABLE:
        raise ProtocolError(f"oplet {oplet!r} exists on the newest DexRun only (this arm runs the stable branch)")
    spec = OPLET_ARGS.get(oplet)
    if spec is None:
        if oplet in HARMLESS_OPLETS:
            return
        raise ProtocolError(f"oplet {oplet!r} is not supported here (calibration/legacy oplets are not sent)")
    lo, hi = spec
    if len(args) < lo or (hi is not None and len(args) > hi):
        want = f"{lo}" if lo == hi else f"{lo}..{hi if hi is not None else 'n'}"
        raise ProtocolError(f"oplet {oplet!r} takes {want} arguments, got {len(args)}")
    if oplet == "W":
        check_write_args(args)
    elif oplet == "r":
        if not args[0].isdigit():
            raise ProtocolError(f"r: block number must be a non-negative integer, got {args[0]!r}")
        if target_kind(args[1]) == "file":
            check_path(args[1])  # only the first word reaches fopen, on every branch
    elif oplet == "z":
        if not args[0].isdigit():
            raise ProtocolError(f"z: microseconds must be a non-negative integer, got {args[0]!r}")
    elif oplet in "aRPBw":
        for i, a in enumerate(args):
            _numeric(oplet, a, allow_nan=oplet in "aP")
            _atoi_range(oplet, a, unsigned=oplet == "w" and i == 1)  # w's value: a 32-bit register word
    elif oplet in "MTCD":
        for a in args:
            _numeric(oplet, a, allow_nan=False)
            _atoi_range(oplet, a)
        if firmware is Firmware.STABLE and any(not is_int(a) for a in args[3:6]):
            # stable parses the direction with atoi: 0.7 would silently become 0
            raise ProtocolError(f"{oplet}: the stable DexRun reads the direction as integers; use -1, 0 or 1")
    elif oplet == "S":
        name = resolve_param(args[0])
        if name == "RunFile":
            check_path(args[1])
            if len(args) != 2:
                raise ProtocolError("S RunFile takes exactly one file name")
        else:
            for a in args[1:]:
                _numeric("S", a, allow_nan=False)
            for a in args[2:]:  # the first value is read with atof, the rest with atoi
                _atoi_range("S", a)


def is_int(tok: str) -> bool:
    return re.fullmatch(r"[+-]?\d+", tok) is not None


def _atoi_range(oplet: str, tok: str, unsigned: bool = False) -> None:
    """An integer DexRun reads with atoi must fit its int: past it atoi's result is undefined (a far goal
    would silently become another one)."""
    if not is_int(tok):
        return
    v = int(tok)
    if not -(2**31) <= v <= (2**32 - 1 if unsigned else 2**31 - 1):
        raise ProtocolError(f"{oplet}: argument {tok} does not fit DexRun's 32-bit integer")


def _numeric(oplet: str, tok: str, allow_nan: bool) -> None:
    if allow_nan and tok == "NaN":
        return
    try:
        v = float(tok)
    except ValueError:
        raise ProtocolError(f"{oplet}: argument {tok!r} is not a number") from None
    if not math.isfinite(v):
        raise ProtocolError(f"{oplet}: argument {tok!r} is not finite")


def check_write_args(args: Sequence[str]) -> None:
    sub = args[0]
    if sub == "f":
        if len(args) != 3 or args[1] != "0":
            raise ProtocolError("W f takes `0 <path>` (make_ins(\"W\", \"f\", 0, file_name))")
        check_path(args[2])
        return
    if sub not in ("m", "s", "e"):
        raise ProtocolError(f"W: sub-command must be f, m, s or e, got {sub!r}")
    if not args[1].isdigit():
        raise ProtocolError(f"W {sub}: length must be a non-negative integer, got {args[1]!r}")
    data = " ".join(args[2:])
    if len(data) != int(args[1]):
        raise ProtocolError(f"W {sub}: length {args[1]} but {len(data)} escaped characters follow")
    try:
        unescape(data.encode("latin-1"))
    except (ProtocolError, UnicodeEncodeError) as exc:
        raise ProtocolError(f"W {sub}: {exc}") from None


class Request(NamedTuple):
    """One DexRun command. `encode()` gives the 256-byte zero-padded buffer that goes in one write. (A named
    tuple, as `Reply`: the link numbers each command it sends with a new one, and a block of a file transfer
    is one.)"""

    oplet: str
    args: tuple[str, ...] = ()
    job_id: int = 1
    instruction_id: int = 1
    start_ms: int = 1  # only used by DexRun to set its clock when > ~1 year ahead (§2); 1 never does
    end: str = "undefined"  # ignored by DexRun; DDE sends the word `undefined`

    def text(self) -> str:
        head = f"{self.job_id} {self.instruction_id} {self.start_ms} {self.end} {self.oplet}"
        return " ".join((head, *self.args)) + ";"

    def encode(self) -> bytes:
        raw = self.text().encode("latin-1")
        if len(raw) > MAX_REQUEST:
            raise ProtocolError(f"request is {len(raw)} bytes; DexRun reads at most {MAX_REQUEST}")
        return raw.ljust(SEND_BUFFER, b"\x00")


def build_request(oplet: str, args: Sequence[Any] = (), *, job_id: int = 1, instruction_id: int = 1,
                  firmware: Firmware = Firmware.NEWEST, start_ms: int = 1) -> Request:
    """Validate and build. Numbers are formatted the way DexRun's atoi/atof read them."""
    tokens = tuple(a if isinstance(a, str) else fmt_number(a) for a in args)
    checked = tokens[:2] if oplet == "W" else tokens[:1] if oplet == "r" else tokens  # W data, r targets: below
    for t in checked:
        if not t or _TOKEN_BAD.search(t):
            raise ProtocolError(f"argument {t!r} is empty or contains a space, comma, ';' or NUL")
    for t in tokens:
        if ";" in t or "\x00" in t:
            raise ProtocolError(f"argument {t!r} contains ';' or NUL: DexRun stops at the first ';'")
    check_oplet(oplet, tokens, firmware)
    req = Request(oplet, tokens, job_id=job_id, instruction_id=instruction_id, start_ms=start_ms)
    # length check with the widest instruction id the link may number it with (they count up to 2**31-1):
    # what fits now must fit whenever it is sent
    req._replace(instruction_id=MAX_INSTRUCTION_ID).encode()
    return req


def parse_command_line(line: str) -> tuple[str, list[str]]:
    """`<oplet> <args…>` as an expert types it (the `raw` command); a trailing ';' is allowed.

    DexRun's own split: the oplet is the first character of its token, arguments separated by space
    or comma. `W` and `r` keep their tail verbatim (escaped data, a shell line)."""
    text = line.strip()
    if text.endswith(";"):
        text = text[:-1].rstrip()
    if ";" in text or "\x00" in text:
        raise ProtocolError("only one command: ';' may appear only as its terminator")
    if not text:
        raise ProtocolError("empty command")
    head, _, tail = text.partition(" ")
    if len(head) != 1:
        raise ProtocolError(f"the oplet is one character, got {head!r}")
    if head == "W":
        parts = tail.split(" ", 2)
        return head, [p for p in parts if p != ""] if len(parts) < 3 else parts
    if head == "r":
        block, _, target = tail.strip().partition(" ")
        return head, [block, target] if target else [block]
    return head, [t for t in re.split(r"[ ,]+", tail) if t]


# --------------------------------------------------------------------------------------------------
# W escaping (§4.2)
# --------------------------------------------------------------------------------------------------

_MUST_ESCAPE = frozenset(b"\x00;%")  # DDE Dexter.socket_encode: NUL, ';' and '%'
_LEADING_ESCAPE = frozenset(b" ,\t\r\n")


def escape(data: bytes) -> bytes:
    """URL-escape NUL, ';' and '%' as %00, %3B, %25 (upper-case hex, as DDE writes them)."""
    out = bytearray()
    for b in data:
        if b in _MUST_ESCAPE:
            out += b"%%%02X" % b
        else:
            out.append(b)
    return bytes(out)


def unescape(data: bytes) -> bytes:
    """What DexRun does with W data: %XX -> the byte."""
    out = bytearray()
    i = 0
    while i < len(data):
        b = data[i]
        if b == 0x25:
            hx = data[i + 1:i + 3]
            if len(hx) != 2 or not all(c in b"0123456789abcdefABCDEF" for c in hx):
                raise ProtocolError(f"bad escape at character {i}: {data[i:i + 3]!r}")
            out.append(int(hx, 16))
            i += 3
        else:
            out.append(b)
            i += 1
    return bytes(out)


def write_chunks(data: bytes, limit: int = MAX_CONTENT_CHARS) -> list[bytes]:
    """Escaped chunks of at most `limit` characters, never splitting an escape.

    DDE fills to 62 and may overshoot to 64 when the last character was escaped; we stop at 62 so
    every chunk stays within the firmware's MAX_CONTENT_CHARS. Escaping is done in C (`bytes.replace`) and
    the cutting per chunk, not per byte: this runs inside every write job's time."""
    if limit < 3:
        raise ValueError("limit must leave room for one escape")
    # '%' first, so the escapes added after it stay single; every '%' in `esc` then starts a 3-character escape
    esc = data.replace(b"%", b"%25").replace(b"\x00", b"%00").replace(b";", b"%3B")
    chunks: list[bytes] = []
    i, n = 0, len(esc)
    while i < n:
        c = esc[i]
        if c in _LEADING_ESCAPE:
            # DexRun finds the data after the length token's separator; a chunk starting with a space or
            # comma would depend on how it skips that separator. Any %XX unescapes, so escape it.
            head, i0, room = b"%%%02X" % c, i + 1, limit - 3
        else:
            head, i0, room = b"", i, limit
        end = min(i0 + room, n)
        if end < n:
            cut = esc.rfind(b"%", max(i0, end - 2), end)
            if cut >= 0:  # an escape would straddle the cut: it starts the next chunk
                end = cut
        chunks.append(head + esc[i0:end])
        i = end
    if not chunks:
        chunks.append(b"")
    return chunks


def write_requests(path: str, data: bytes) -> list[tuple[str, list[str]]]:
    """The `W f 0 <path>`, `W m <n> <data>`…, `W e <n> <data>` sequence for one file (§4.2).

    The data goes in as latin-1 text so every byte survives as one character."""
    check_path(path)
    seq: list[tuple[str, list[str]]] = [("W", ["f", "0", path])]
    chunks = write_chunks(data)
    for i, c in enumerate(chunks):
        sub = "e" if i == len(chunks) - 1 else "m"
        text = c.decode("latin-1")
        seq.append(("W", [sub, str(len(text)), text] if text else [sub, "0"]))
    return seq


# --------------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------------


class ReplyAssembler:
    """Cuts a TCP byte stream into 240-byte replies, whatever the segmentation (one read may hold
    part of a reply, exactly one, or several; DDE assumes one read is one reply, §8)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buf and len(data) == REPLY_BYTES:  # the usual case: one read, one whole reply
            return [bytes(data)]  # (no copy when it is bytes already)
        self._buf += data
        n = len(self._buf) // REPLY_BYTES
        if not n:
            return []
        out = [bytes(self._buf[i * REPLY_BYTES:(i + 1) * REPLY_BYTES]) for i in range(n)]
        del self._buf[:n * REPLY_BYTES]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)

    def reset(self) -> None:
        self._buf.clear()


class Reply(NamedTuple):
    """One 240-byte reply: the common header (§3.1) and the raw 60 ints / bytes. (A named tuple: immutable, and
    built in a fraction of a frozen dataclass's time; every command's reply is decoded on the round trip.)"""

    job_id: int
    instruction_id: int
    robot_time_s: int  # int 2: robot clock tv_sec at reply time (not the echoed start)
    robot_time_us: int  # int 3: tv_nsec / 1000
    oplet_code: int
    error: int
    ints: tuple[int, ...]
    data: bytes

    @property
    def oplet(self) -> str:
        c = self.oplet_code & 0xFF
        return chr(c) if 32 < c < 127 else "?"

    @property
    def robot_time(self) -> float:
        return self.robot_time_s + self.robot_time_us / 1e6


def decode_reply(data: bytes) -> Reply:
    if len(data) != REPLY_BYTES:
        raise ProtocolError(f"a DexRun reply is {REPLY_BYTES} bytes, got {len(data)}")
    ints = _REPLY.unpack(data)
    if not 0 <= ints[3] < 1_000_000:
        raise ProtocolError(f"int 3 (robot clock µs) is {ints[3]}: not a DexRun reply (out of step?)")
    if not 0 < ints[4] < 128:
        raise ProtocolError(f"int 4 (oplet) is {ints[4]}: not a DexRun reply (out of step?)")
    return Reply(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints, bytes(data))


def encode_reply(ints: Sequence[int]) -> bytes:
    """For the simulator: 60 ints, little-endian (DexRun writes its int[] raw on an LE ARM)."""
    if len(ints) != REPLY_INTS:
        raise ValueError(f"need {REPLY_INTS} ints")
    return _REPLY.pack(*(int(v) for v in ints))


# -- errors (§6) ------------------------------------------------------------------------------------

ERR_FIRMWARE_MISMATCH = 1 << 10
ERR_SPAN_SERVO = 1 << 27  # J7, Dynamixel ID 1 (newest)
ERR_ROLL_SERVO = 1 << 28  # J6, Dynamixel ID 3 (newest)
ERR_BOUNDARY = 1 << 29  # newest (reporting disabled in code, decoded all the same)
ERR_MONITOR = 1 << 30  # newest: raw encoder position/velocity over limit
FLAG_NAMES = {
    ERR_FIRMWARE_MISMATCH: "firmware_mismatch",
    ERR_SPAN_SERVO: "span_servo_j7",
    ERR_ROLL_SERVO: "roll_servo_j6",
    ERR_BOUNDARY: "boundary",
    ERR_MONITOR: "monitor",
}
FLAG_TEXT = {
    "firmware_mismatch": "firmware/gateware mismatch (DexRun runs on a fake memory map: the arm will not move)",
    "span_servo_j7": "J7 (span, servo ID 1) servo error",
    "roll_servo_j6": "J6 (roll, servo ID 3) servo error",
    "boundary": "joint boundary error",
    "monitor": "monitor: raw encoder position/velocity over limit (velocity errors switch to open loop)",
    "stable_boundary": "boundary error (stable DexRun code 665)",
    "stable_monitor": "monitor error (stable DexRun code 666)",
}
BASIC_TEXT = {0: "ok", 1: "unknown oplet or S parameter", 2: "bad request: no ';'"}
ERRNO_TEXT = {0: "ok", 2: "ENOENT: no such file or directory", 10: "ECHILD: shell stream finished",
              13: "EACCES: permission denied", 16: "EBUSY: a previous shell command is still open",
              29: "ESPIPE: keyword data exhausted", 21: "EISDIR: is a directory"}
ECHILD = 10
EBUSY = 16
ESPIPE = 29
ENOENT = 2


@dataclass(frozen=True)
class DecodedError:
    value: int
    code: int  # the basic code (error & 255), or the errno for r / W / RunFile
    flags: tuple[str, ...]
    message: str

    @property
    def failed(self) -> bool:
        """The command itself failed (flags alone describe the arm, not this command)."""
        return self.code != 0


def decode_error(value: int, *, errno_reply: bool = False) -> DecodedError:
    """int 5 of a reply. For `r` / `W` / `S RunFile` it is a Linux errno (§6); else the basic code
    (`error & 255`, the wiki's advice) plus bit flags. The stable branch's 665/666 are whole values."""
    flags: list[str] = [name for bit, name in FLAG_NAMES.items() if value & bit]
    rest = value & ~sum(FLAG_NAMES)
    if rest in (665, 666):  # stable: MoveRobot's boundary / monitor errors (rarely visible, §6)
        flags.append("stable_boundary" if rest == 665 else "stable_monitor")
        code = 0
    elif errno_reply:
        code = rest
    else:
        code = value & 0xFF
    text = ERRNO_TEXT.get(code, f"errno {code}") if errno_reply else BASIC_TEXT.get(code, f"error {code}")
    parts = [] if code == 0 and flags else [text]
    parts += [FLAG_TEXT[f] for f in flags]
    return DecodedError(value, code, tuple(flags), "; ".join(parts))


# -- the standard status (§3.2) ---------------------------------------------------------------------

JOINT_BASE = (10, 20, 30, 40, 50)  # J1 BASE, J2 PIVOT, J3 END, J4 ANGLE, J5 ROT (code + wiki + Scratch ext)
# J4/J5 DELTA and PID_DELTA: interpolated ×16 in the FPGA; we follow DDE's robot.js, which scales them by
# 1/57600 (= 1/16 arcsec) rather than 1/3600 (§3.2).
DELTA_SCALE = (1.0, 1.0, 1.0, 16.0, 16.0)


@dataclass(frozen=True)
class JointStatus:
    angle_arcsec: int  # *_POSITION_AT: the current stepped goal
    delta_raw: int
    pid_delta_raw: int
    force_delta_arcsec: int
    sin_raw: int
    cos_raw: int
    measured_arcsec: int  # needs calibration
    sent_raw: int  # raw FPGA steps (sign-extended, not divided by JointsCal; DDE's /3600 is wrong)
    index: int

    @property
    def angle_deg(self) -> float:
        return self.angle_arcsec / ARCSEC_PER_DEG

    @property
    def delta_deg(self) -> float:
        return self.delta_raw / (ARCSEC_PER_DEG * DELTA_SCALE[self.index])

    @property
    def pid_delta_deg(self) -> float:
        return self.pid_delta_raw / (ARCSEC_PER_DEG * DELTA_SCALE[self.index])

    @property
    def force_delta_deg(self) -> float:
        return self.force_delta_arcsec / ARCSEC_PER_DEG

    @property
    def measured_deg(self) -> float:
        return self.measured_arcsec / ARCSEC_PER_DEG


@dataclass(frozen=True)
class ServoStatus:
    """A Dynamixel servo (J6 = ID 3, J7 = ID 1). Position and load in Dynamixel units."""

    position_units: int
    load_units: int
    error_flags: int
    angle_deg: float


@dataclass(frozen=True)
class StandardStatus:
    """The g0 layout (§3.2): every reply but `r` in status mode '0' (and every reply on stable)."""

    dma_read_data: int
    status_mode_raw: int  # int 8: RECORD_BLOCK_SIZE in g0 (typically 0); the mode char code in g≠0
    end_effector_io: int
    joints: tuple[JointStatus, ...]
    j6: ServoStatus
    j7: ServoStatus

    @property
    def phui_button(self) -> bool:
        return bool(self.end_effector_io & 1)


def decode_status(reply: Reply, deg_per_unit: float = XL320_DEG_PER_UNIT,
                  j6_zero: int = J6_ZERO_UNITS) -> StandardStatus:
    """The standard g0 status. Servo mapping follows the code + DDE (18/28 = ID 1 = J7, 38/48 = ID 3 = J6),
    not the wiki/Scratch ext, which swap them (§3.2, "Trust the code")."""
    v = reply.ints
    joints = tuple(JointStatus(v[b], v[b + 1], v[b + 2], v[b + 3], v[b + 4], v[b + 5], v[b + 6], v[b + 7], i)
                   for i, b in enumerate(JOINT_BASE))
    servo_err = v[58]
    j7 = ServoStatus(v[18], v[28], (servo_err >> 8) & 0xFF, v[18] * deg_per_unit)
    j6 = ServoStatus(v[38], v[48], servo_err & 0xFF, (v[38] - j6_zero) * deg_per_unit)
    return StandardStatus(dma_read_data=v[6], status_mode_raw=v[8], end_effector_io=v[9], joints=joints, j6=j6,
                          j7=j7)


# -- `r` replies (§3.4) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadBlock:
    error: int
    payload: bytes

    @property
    def length(self) -> int:
        return len(self.payload)


def decode_read(reply: Reply) -> ReadBlock:
    """PAYLOAD_LENGTH at int 6, payload from byte 28; bytes after it are stale (ignored)."""
    n = reply.ints[6]
    if not 0 <= n <= PAYLOAD_MAX:
        raise ProtocolError(f"r reply: payload length {n} outside 0..{PAYLOAD_MAX}")
    return ReadBlock(reply.error, reply.data[PAYLOAD_START:PAYLOAD_START + n])


def read_reply_ints(base: Sequence[int], payload: bytes, error: int) -> bytes:
    """For the simulator: an `r` reply = header ints + length + payload, over a (stale) 240-byte buffer."""
    buf = bytearray(encode_reply(base))
    struct.pack_into("<ii", buf, 20, error, len(payload))
    buf[PAYLOAD_START:PAYLOAD_START + len(payload)] = payload
    return bytes(buf)


KEYWORDS = ("#POM", "#XYZ", "#EyeNumbers", "#RawEncoders", "#measured_angles", "#Steps", "#StepAngles", "#Servo")


def target_kind(target: str) -> str:
    if target.startswith("`"):
        return "shell"
    if target.startswith("#"):
        return "keyword"
    return "file"


def decode_keyword(target: str, text: str) -> Any:
    """#POM is a JSON 4×4 matrix; the others a JSON array of 5 ints, except #EyeNumbers, which the wiki
    shows as comma-separated integers without brackets: both forms are read."""
    word = target.split()[0]
    body = text.strip().rstrip("\x00")
    if word == "#Servo":
        return body
    try:
        return json.loads(body)
    except ValueError:
        parts = [p for p in re.split(r"[\s,\[\]]+", body) if p]
        try:
            return [int(p) for p in parts]
        except ValueError:
            raise ProtocolError(f"{word}: cannot decode {body[:40]!r}") from None


@dataclass
class ShellRead:
    """The shell target's reader state (§3.4 / wiki): keep sending `r <n> \\`` until error 10 (ECHILD),
    never stopping on a short block (output trickles). The reply before ECHILD carries the wait status."""

    output: bytearray = field(default_factory=bytearray)
    exit_status: int | None = None
    done: bool = False

    def feed(self, block: ReadBlock) -> None:
        if block.error == ECHILD:
            self.done = True
            return
        self.output += block.payload
        if not block.payload:
            self.exit_status = block.error  # pclose's wait status at EOF (0 = success)
