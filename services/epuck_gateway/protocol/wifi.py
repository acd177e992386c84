"""e-puck2 WiFi protocol (selector 15, TCP port 1000), sans-I/O: codecs, stream parser, command state.

Byte layouts follow docs/reference/epuck2.md (read from the ESP32 and F407 firmware) where it is
more precise than the wiki's text (docs/reference/epuck2.md §0). Nothing here touches a socket or a clock:
the gateway's
transport, the simulator and the tests share this one implementation of the format.

Robot -> host: 0x01 + 38400-byte QQVGA RGB565 image (big-endian 565 words), 0x02 + 104-byte sensors
packet (little-endian), 0x03 with no payload. Host -> robot: 0x80 + 20 command bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

# -- packet ids and sizes ---------------------------------------------------------------------
IMAGE_ID = 0x01
SENSORS_ID = 0x02
EMPTY_ID = 0x03
COMMAND_ID = 0x80

IMAGE_WIDTH = 160
IMAGE_HEIGHT = 120
IMAGE_SIZE = IMAGE_WIDTH * IMAGE_HEIGHT * 2  # 38400: RGB565, 2 bytes per pixel
SENSORS_SIZE = 104
COMMAND_SIZE = 21  # id included
PAYLOAD_SIZES = {IMAGE_ID: IMAGE_SIZE, SENSORS_ID: SENSORS_SIZE, EMPTY_ID: 0}
# 0x00 is "reserved" (docs/reference/epuck2.md §4) with no known size, so the parser treats it like any unknown id.

# The ESP32 sends an image as the id byte, then 9 x 4092 bytes and 1 x 1572 bytes (its SPI blocks).
IMAGE_SEGMENTS = (4092,) * 9 + (1572,)

# -- command fields -----------------------------------------------------------------------------
REQ_IMAGE = 0x01
REQ_SENSORS = 0x02

SET_CALIBRATE_IR = 0x01  # one-shot: the firmware re-applies it every cycle until cleared
SET_OBSTACLE_AVOIDANCE = 0x02  # level. The seed says "not implemented yet"; F407 master has it since 2020-05
SET_STEPS = 0x04  # one-shot: left/right are step-counter values, not speeds

# One bit per LED (reference section 3): the seed's "2=toggle" cannot be encoded in a bitfield.
LED1, LED3, LED5, LED7, LED_BODY, LED_FRONT = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
LED_BITS = {"led1": LED1, "led3": LED3, "led5": LED5, "led7": LED7, "body": LED_BODY, "front": LED_FRONT}
RGB_LEDS = ("led2", "led4", "led6", "led8")
RGB_MAX = 100  # intensity in %, RGB_MAX_INTENSITY in the firmware

SOUND_MARIO = 0x01
SOUND_UNDERWORLD = 0x02
SOUND_STAR_WARS = 0x04
SOUND_4KHZ = 0x08
SOUND_10KHZ = 0x10
SOUND_STOP = 0x20
SOUNDS = {"mario": SOUND_MARIO, "underworld": SOUND_UNDERWORLD, "star_wars": SOUND_STAR_WARS,
          "4khz": SOUND_4KHZ, "10khz": SOUND_10KHZ, "stop": SOUND_STOP}

SPEED_LIMIT = 1000  # nominal; the F407 itself clamps at MOTOR_SPEED_LIMIT 1100

# -- sensor scaling (reference section 2) ---------------------------------------------------------
ACC_COUNTS_PER_G = 768.0  # (raw16 >> 4) - (raw16 >> 6) with 16384 raw per g at +-2 g
GYRO_DPS_PER_COUNT = 250.0 / 32768.0  # +-250 dps full scale
BATTERY_COUNTS_PER_VOLT = 819.2  # 4096 * (330 / 550) / 3.0 V
MIC_NAMES = ("right", "left", "back", "front")  # microphone.h index order (the seed gives none)


class ProtocolError(ValueError):
    """Bytes that do not fit the format."""


# =============================================================================================
# Command (host -> robot)
# =============================================================================================
_CMD = struct.Struct("<BBBhhB12BB")
assert _CMD.size == COMMAND_SIZE

RGB = tuple[int, int, int]
OFF: RGB = (0, 0, 0)


@dataclass(frozen=True)
class EpuckCommand:
    """The 20 bytes after 0x80. Bytes 2..20 are the asercom-v2 "set all actuators" payload."""

    request: int = 0
    settings: int = 0
    left: int = 0
    right: int = 0
    leds: int = 0
    rgb: tuple[RGB, RGB, RGB, RGB] = (OFF, OFF, OFF, OFF)  # LED2, LED4, LED6, LED8
    sound: int = 0

    def encode(self) -> bytes:
        flat = [c for led in self.rgb for c in led]
        if len(flat) != 12:
            raise ProtocolError("rgb must be 4 LEDs x 3 channels")
        try:
            return _CMD.pack(COMMAND_ID, self.request, self.settings, self.left, self.right, self.leds,
                             *flat, self.sound)
        except struct.error as exc:
            raise ProtocolError(f"command field out of range: {exc}") from None

    @classmethod
    def decode(cls, data: bytes) -> EpuckCommand:
        if len(data) != COMMAND_SIZE:
            raise ProtocolError(f"a command is {COMMAND_SIZE} bytes, got {len(data)}")
        if data[0] != COMMAND_ID:
            raise ProtocolError(f"a command starts with 0x80, got 0x{data[0]:02x}")
        v = _CMD.unpack(data)
        flat = v[6:18]
        rgb = (tuple(flat[0:3]), tuple(flat[3:6]), tuple(flat[6:9]), tuple(flat[9:12]))
        return cls(request=v[1], settings=v[2], left=v[3], right=v[4], leds=v[5],
                   rgb=rgb, sound=v[18])  # type: ignore[arg-type]


def stop_command() -> EpuckCommand:
    """What a client sends before it closes (reference section 4): speeds 0, LEDs off, stop sound,
    request 0 so the robot answers with 0x03, which tells the client the stop was taken."""
    return EpuckCommand(request=0, settings=0, left=0, right=0, leds=0, rgb=(OFF, OFF, OFF, OFF),
                        sound=SOUND_STOP)


# =============================================================================================
# Sensors (robot -> host)
# =============================================================================================
_SENSORS = struct.Struct("<3h3f3h3fb8H8HH4H2hHBBBBB3H3HBB")
assert _SENSORS.size == SENSORS_SIZE


@dataclass(frozen=True)
class EpuckRawSensors:
    """The 104-byte sensors packet, field by field, in wire units."""

    acc: tuple[int, int, int] = (0, 0, 0)  # offset 0, int16 x3, ~768 counts per g
    acceleration: float = 0.0  # 6, float32 magnitude in acc counts
    orientation: float = 0.0  # 10, float32 degrees
    inclination: float = 0.0  # 14, float32 degrees; reaches 180 upside down (the seed says 0..90)
    gyro: tuple[int, int, int] = (0, 0, 0)  # 18, int16 x3
    # The seed calls these "raw axes values"; the firmware sends float32 uT (reference section 2).
    mag: tuple[float, float, float] = (0.0, 0.0, 0.0)  # 24, float32 x3, uT
    temperature: int = 0  # 36, int8 degC (signed, as getTemperature() returns it)
    proximity: tuple[int, ...] = (0,) * 8  # 37, uint16 x8
    ambient: tuple[int, ...] = (0,) * 8  # 53, uint16 x8
    tof: int = 0  # 69, uint16 mm
    mic: tuple[int, int, int, int] = (0, 0, 0, 0)  # 71, uint16 x4: right, left, back, front
    steps: tuple[int, int] = (0, 0)  # 79, int16 x2 (int32 counters truncated)
    battery: int = 0  # 83, uint16 raw ADC
    sd_state: int = 0  # 85
    tv_toggle: int = 0  # 86
    tv_address: int = 0  # 87
    tv_data: int = 0  # 88
    selector: int = 0  # 89
    ground_proximity: tuple[int, int, int] = (0, 0, 0)  # 90, uint16 x3
    ground_ambient: tuple[int, int, int] = (0, 0, 0)  # 96, uint16 x3
    button: int = 0  # 102, inserted by the ESP32
    reserved: int = 0  # 103

    FIELD_OFFSETS: ClassVar[dict[str, int]] = {
        "acc": 0, "acceleration": 6, "orientation": 10, "inclination": 14, "gyro": 18, "mag": 24,
        "temperature": 36, "proximity": 37, "ambient": 53, "tof": 69, "mic": 71, "steps": 79,
        "battery": 83, "sd_state": 85, "tv_toggle": 86, "tv_address": 87, "tv_data": 88, "selector": 89,
        "ground_proximity": 90, "ground_ambient": 96, "button": 102, "reserved": 103,
    }

    def encode(self) -> bytes:
        try:
            return _SENSORS.pack(*self.acc, self.acceleration, self.orientation, self.inclination, *self.gyro,
                                 *self.mag, self.temperature, *self.proximity, *self.ambient, self.tof,
                                 *self.mic, *self.steps, self.battery, self.sd_state, self.tv_toggle,
                                 self.tv_address, self.tv_data, self.selector, *self.ground_proximity,
                                 *self.ground_ambient, self.button, self.reserved)
        except struct.error as exc:
            raise ProtocolError(f"sensor field out of range: {exc}") from None

    @classmethod
    def decode(cls, data: bytes | memoryview) -> EpuckRawSensors:
        v = unpack_sensors(data)
        return cls(acc=v[0:3], acceleration=v[3], orientation=v[4], inclination=v[5], gyro=v[6:9],
                   mag=v[9:12], temperature=v[12], proximity=v[13:21], ambient=v[21:29], tof=v[29],
                   mic=v[30:34], steps=v[34:36], battery=v[36], sd_state=v[37], tv_toggle=v[38],
                   tv_address=v[39], tv_data=v[40], selector=v[41], ground_proximity=v[42:45],
                   ground_ambient=v[45:48], button=v[48], reserved=v[49])  # type: ignore[arg-type]


def unpack_sensors(data: bytes | memoryview) -> tuple[Any, ...]:
    """The sensors packet's 50 wire values in order (`EpuckRawSensors.decode` names them; the gateway's hot path
    reads them straight from here: robot.sensors_fields_of)."""
    if len(data) != SENSORS_SIZE:
        raise ProtocolError(f"a sensors packet is {SENSORS_SIZE} bytes, got {len(data)}")
    return _SENSORS.unpack(data)


_PROX_AMBIENT = struct.Struct("<16H")  # offsets 37..68: 8 proximity, 8 ambient
_MICS = struct.Struct("<4H")  # offset 71
ADC_MAX = 4095  # proximity, ambient and microphone volumes are 12-bit (docs/reference/epuck2.md §2)


def implausible_sensors(data: bytes | memoryview) -> str:
    """Why a 104-byte sensors packet cannot come from an e-puck2 ('' when it can). The WiFi stream has no
    checksum or identification, and random bytes hold the packet ids 0x01/0x02/0x03 (a device speaking another
    protocol, a stream out of step); a robot's packet keeps these fields in range (docs/reference/epuck2.md §2):
    reserved byte 103 always 0, button 0/1, selector 0..15, SD state 0/1, proximity, ambient and microphone
    volumes 0..4095. Random bytes pass them all with a probability below 1e-20."""
    if len(data) != SENSORS_SIZE:
        return f"sensors packet of {len(data)} bytes, not {SENSORS_SIZE}"
    if data[103] != 0:
        return f"sensors packet with reserved byte 0x{data[103]:02x} (always 0)"
    if data[102] > 1 or data[85] > 1:
        return f"sensors packet with button {data[102]} / SD state {data[85]} (0 or 1)"
    if data[89] > 15:
        return f"sensors packet with selector {data[89]} (0..15)"
    if max(_PROX_AMBIENT.unpack_from(data, 37)) > ADC_MAX or max(_MICS.unpack_from(data, 71)) > ADC_MAX:
        return "sensors packet with proximity, ambient or microphone values above 4095"
    return ""


def finite(x: float) -> float | None:
    """float32 fields come straight from the robot's memory: NaN/inf must not reach JSON."""
    return x if math.isfinite(x) else None


def acc_to_g(raw: int | float) -> float:
    return raw / ACC_COUNTS_PER_G


def gyro_to_dps(raw: int) -> float:
    return raw * GYRO_DPS_PER_COUNT


def battery_volts(raw: int) -> float:
    return raw / BATTERY_COUNTS_PER_VOLT


class StepUnwrapper:
    """The robot truncates its int32 step counters to int16: rebuild a continuous count.

    Valid while a wheel moves less than 32767 steps between two packets (~30 s at full speed)."""

    def __init__(self) -> None:
        self._last: int | None = None
        self.total = 0

    def update(self, raw: int) -> int:
        if self._last is None:
            self.total = raw
        else:
            delta = (raw - self._last + 0x8000) % 0x10000 - 0x8000
            self.total += delta
        self._last = raw
        return self.total

    def reset(self) -> None:
        self._last = None
        self.total = 0


# =============================================================================================
# Image
# =============================================================================================
def rgb565_to_rgb888(data: bytes | memoryview) -> bytes:
    """Big-endian RGB565 (RRRRRGGG GGGBBBBB) to packed RGB888 (v * 255 // 31 and // 63, as Pillow does).

    A slow, plain reference; the service converts with Pillow's C unpacker (image.py)."""
    if len(data) % 2:
        raise ProtocolError("RGB565 data has an odd length")
    out = bytearray(len(data) // 2 * 3)
    mv = memoryview(data)
    for i in range(len(data) // 2):
        w = (mv[2 * i] << 8) | mv[2 * i + 1]
        r, g, b = (w >> 11) & 0x1F, (w >> 5) & 0x3F, w & 0x1F
        out[3 * i] = r * 255 // 31
        out[3 * i + 1] = g * 255 // 63
        out[3 * i + 2] = b * 255 // 31
    return bytes(out)


def rgb888_to_rgb565(r: int, g: int, b: int) -> int:
    """One pixel, as the camera would quantise it; returns the 16-bit word (send it big-endian)."""
    return ((r >> 3) << 11) | ((g >> 2) << 5) | (b >> 3)


# =============================================================================================
# Stream parser (robot -> host)
# =============================================================================================
@dataclass(frozen=True)
class ImagePacket:
    data: bytes  # RGB565, big-endian words: 38400 bytes over WiFi
    width: int = IMAGE_WIDTH  # asercom over serial: its camera's size (40x40 by default)
    height: int = IMAGE_HEIGHT


@dataclass(frozen=True)
class SensorsPacket:
    data: bytes  # 104 bytes


@dataclass(frozen=True)
class EmptyPacket:
    pass


@dataclass(frozen=True)
class FramingError:
    """An id byte that is not 0x01/0x02/0x03: the byte stream cannot be resynchronised (payloads may
    hold any byte), so the link must be reset. The parser ignores input until `reset()`."""

    bad_id: int
    offset: int  # bytes of the stream consumed before the bad id
    reason: str = ""  # set when the packet's id was known but its content cannot come from a robot

    def describe(self) -> str:
        return self.reason or f"unknown packet id 0x{self.bad_id:02x} at byte {self.offset}"


Packet = ImagePacket | SensorsPacket | EmptyPacket
ParserEvent = ImagePacket | SensorsPacket | EmptyPacket | FramingError


@dataclass
class EpuckStreamParser:
    """Bytes in any segmentation -> packets. Reads the id, then exactly 38400, 104 or 0 bytes."""

    framing_errors: int = 0
    packets: int = 0
    bytes_in: int = 0
    broken: bool = False
    _buf: bytearray = field(default_factory=bytearray)
    _pos: int = 0  # bytes of the stream before _buf[0]

    @property
    def in_packet(self) -> bool:
        """True while part of a packet has been read (used to tell which packets follow a command)."""
        return bool(self._buf) and not self.broken

    def missing(self) -> int:
        """Bytes still to come before the packet in progress is complete (0 between packets)."""
        if self.broken or not self._buf:
            return 0
        return max(0, 1 + PAYLOAD_SIZES.get(self._buf[0], 0) - len(self._buf))

    def reset(self) -> None:
        """A new link: forget partial input, start at an id byte."""
        self._buf.clear()
        self.broken = False
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[ParserEvent]:
        if self.broken or not data:
            return []
        self.bytes_in += len(data)
        buf = self._buf
        buf += data
        out: list[ParserEvent] = []
        i = 0
        n = len(buf)
        while i < n:
            pid = buf[i]
            size = PAYLOAD_SIZES.get(pid)
            if size is None:
                self.framing_errors += 1
                self.broken = True
                out.append(FramingError(bad_id=pid, offset=self._pos + i))
                buf.clear()
                return out
            if n - i - 1 < size:
                break
            if pid == SENSORS_ID:
                out.append(SensorsPacket(bytes(buf[i + 1:i + 1 + size])))
            elif pid == IMAGE_ID:
                out.append(ImagePacket(bytes(buf[i + 1:i + 1 + size])))
            else:
                out.append(EmptyPacket())
            i += 1 + size
            self.packets += 1
        if i:
            del buf[:i]
            self._pos += i
        return out


# =============================================================================================
# Command state (what the gateway wants the robot to do)
# =============================================================================================
@dataclass
class EpuckController:
    """The desired actuator state and the command bytes that carry it.

    The robot repeats the last command it got on every cycle (reference section 3), so:
    - level state (request, speeds, LEDs, RGB, obstacle avoidance) is sent once, on change;
    - one-shot flags (IR calibration, sound, set-steps) go out once, in a command that asks for no image
      (the robot's cycle that applies it is then short), and are cleared by the next command, sent as soon
      as a whole packet that the robot started after our command has arrived (so the firmware applied the
      flag at least one cycle), as GCtronic's clients do;
    - motion is never restored after a reconnect: the first command of a link has speeds 0.
    """

    request: int = REQ_IMAGE | REQ_SENSORS
    left: int = 0
    right: int = 0
    leds: int = 0
    rgb: tuple[RGB, RGB, RGB, RGB] = (OFF, OFF, OFF, OFF)
    obstacle_avoidance: bool = False
    _oneshot_settings: int = 0
    _oneshot_sound: int = 0
    _steps: tuple[int, int] | None = None
    awaiting_clear: bool = False
    _clear_after: int = 0  # parser packet count after which the clear may go

    def level(self) -> EpuckCommand:
        return EpuckCommand(request=self.request,
                            settings=SET_OBSTACLE_AVOIDANCE if self.obstacle_avoidance else 0,
                            left=self.left, right=self.right, leds=self.leds, rgb=self.rgb, sound=0)

    def build(self) -> EpuckCommand:
        """The next command to send: level state plus pending one-shots (consumed here)."""
        cmd = self.level()
        settings = cmd.settings | self._oneshot_settings
        left, right = cmd.left, cmd.right
        if self._steps is not None:
            settings |= SET_STEPS
            left, right = self._steps
        self.awaiting_clear = bool(self._oneshot_settings or self._oneshot_sound or self._steps is not None)
        # The radio module re-applies the last command it took at every exchange with the F407 until it takes
        # the next, once per cycle of its own; a cycle with the image lasts an image period (2 s at 0.5 fps). A
        # one-shot asks for no image, so the cycle that applies it is short and the clear is taken right after.
        request = cmd.request & ~REQ_IMAGE if self.awaiting_clear else cmd.request
        cmd = replace(cmd, request=request, settings=settings, left=left, right=right, sound=self._oneshot_sound)
        self._oneshot_settings = 0
        self._oneshot_sound = 0
        self._steps = None
        return cmd

    def sent(self, packets_done: int, mid_packet: bool) -> None:
        """Record where the robot's stream was when a command left, for the one-shot clear."""
        self._clear_after = packets_done + (1 if mid_packet else 0)

    def clear_due(self, packets_done: int) -> bool:
        """True when the one-shots just sent should now be cleared (call after each packet)."""
        return self.awaiting_clear and packets_done > self._clear_after

    def on_link_up(self) -> EpuckCommand:
        """First command of a connection: never resume motion or replay one-shots from a past link."""
        self.left = self.right = 0
        self.drop_oneshots()
        return self.build()

    def drop_oneshots(self) -> None:
        self._oneshot_settings = 0
        self._oneshot_sound = 0
        self._steps = None
        self.awaiting_clear = False

    # -- requests ---------------------------------------------------------------------------
    def set_speed(self, left: int, right: int) -> None:
        if not (-SPEED_LIMIT <= left <= SPEED_LIMIT and -SPEED_LIMIT <= right <= SPEED_LIMIT):
            raise ProtocolError(f"speeds must be within +-{SPEED_LIMIT} steps/s")
        self.left, self.right = left, right

    def set_steps(self, left: int, right: int) -> None:
        if not (-0x8000 <= left < 0x8000 and -0x8000 <= right < 0x8000):
            raise ProtocolError("step counters are int16")
        self._steps = (left, right)

    def set_leds(self, **on: bool | None) -> None:
        leds = self.leds
        for name, value in on.items():
            bit = LED_BITS[name]
            if value is not None:
                leds = (leds | bit) if value else (leds & ~bit)
        self.leds = leds

    def set_rgb(self, colors: Sequence[RGB | None]) -> None:
        """colors: LED2, LED4, LED6, LED8; None keeps a LED as it is."""
        if len(colors) != 4:
            raise ProtocolError("four RGB LEDs")
        new = list(self.rgb)
        for i, c in enumerate(colors):
            if c is None:
                continue
            if any(not 0 <= v <= RGB_MAX for v in c):
                raise ProtocolError(f"RGB intensities are 0..{RGB_MAX}")
            new[i] = (c[0], c[1], c[2])
        self.rgb = (new[0], new[1], new[2], new[3])

    def play(self, sound: int) -> None:
        if sound not in SOUNDS.values():
            raise ProtocolError(f"unknown sound 0x{sound:02x}")
        self._oneshot_sound = sound

    def calibrate_ir(self) -> None:
        self._oneshot_settings |= SET_CALIBRATE_IR

    def set_stream(self, image: bool | None, sensors: bool | None) -> None:
        req = self.request
        if image is not None:
            req = (req | REQ_IMAGE) if image else (req & ~REQ_IMAGE)
        if sensors is not None:
            req = (req | REQ_SENSORS) if sensors else (req & ~REQ_SENSORS)
        self.request = req
