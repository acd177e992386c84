"""The MQTT payloads of epuck-gateway (pydantic; names prefixed `Epuck`, one schema namespace)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.epuck_gateway.protocol.wifi import RGB_MAX, SPEED_LIMIT

_REQ = ConfigDict(extra="forbid", strict=True)


# -- state ------------------------------------------------------------------------------------------
class EpuckXYZ(BaseModel):
    x: float | None
    y: float | None
    z: float | None


class EpuckXYZRaw(BaseModel):
    x: int
    y: int
    z: int


class EpuckMicrophones(BaseModel):
    """Volumes 0..4095, in microphone.h's index order 0..3 = right, left, back, front."""

    right: int
    left: int
    back: int
    front: int


class EpuckSteps(BaseModel):
    left: int = Field(description="Wire value: the int32 counter truncated to int16")
    right: int
    left_total: int = Field(description="Continuous count, unwrapped by the gateway since the link came up")
    right_total: int


class EpuckTvRemote(BaseModel):
    toggle: int = Field(description="RC5 toggle / check bit")
    address: int
    data: int


class EpuckSensors(BaseModel):
    """One sensors packet (0x02), decoded with units. Floats the robot sent as NaN/inf are null."""

    seq: int = Field(description="Sensors packets received on this robot since the gateway started")
    ts: float = Field(description="Unix time the packet arrived at the gateway")
    acc_raw: EpuckXYZRaw = Field(description="Accelerometer, ~768 counts per g, gravity included")
    acc_g: EpuckXYZ
    acceleration_raw: float | None = Field(description="Magnitude of the acceleration, acc counts")
    acceleration_g: float | None
    orientation_deg: float | None = Field(description="0..360, forced to 0 when nearly flat or upside down")
    inclination_deg: float | None = Field(description="0 = flat; up to 180 upside down")
    gyro_raw: EpuckXYZRaw
    gyro_dps: EpuckXYZ = Field(description="raw x 250 / 32768")
    magnetometer_ut: EpuckXYZ = Field(description="uT (float32 on the wire, not raw counts)")
    temperature_c: int
    proximity: list[int] = Field(min_length=8, max_length=8, description="prox0..7, 0 far .. 4095 very close")
    ambient: list[int] = Field(min_length=8, max_length=8, description="0 strong light .. 4095 dark")
    tof_mm: int
    microphones: EpuckMicrophones
    steps: EpuckSteps
    battery_raw: int
    battery_v: float = Field(description="raw / 819.2")
    sd_card: bool = Field(description="micro-SD present and readable")
    tv_remote: EpuckTvRemote
    selector: int
    ground_proximity: list[int] = Field(min_length=3, max_length=3, description="0 black/none .. 1023 white")
    ground_ambient: list[int] = Field(min_length=3, max_length=3, description="0 strong light .. 1023 dark")
    button: bool


class EpuckImageInfo(BaseModel):
    """The latest frame published on `state/image` (JPEG)."""

    seq: int = Field(description="Images received on this robot since the gateway started")
    ts: float = Field(description="Unix time the image arrived at the gateway")
    width: int
    height: int
    bytes: int = Field(description="Size of the JPEG")
    quality: int
    content_type: Literal["image/jpeg"] = "image/jpeg"


class EpuckLinkStats(BaseModel):
    """The link to one robot (WiFi TCP or asercom serial), once a second."""

    connected: bool
    transport: Literal["wifi", "serial"]
    address: str = Field(description="host:port on WiFi, device@baud on serial")
    packets_per_s: float
    images_per_s: float
    sensors_per_s: float
    empty_per_s: float
    bytes_per_s: float
    framing_errors: int
    reconnects: int
    images_received: int
    images_published: int
    frames_dropped: int = Field(description="Images replaced by a newer one before they could be encoded")
    sensors_received: int
    sensors_published: int
    commands_sent: int = Field(description="Commands written to the robot (at most one per robot cycle)")
    commands_requested: int = Field(description="State changes asked for by commands; several coalesce into one write")
    reply_timeouts: int = Field(0, description="Serial: polls the robot did not answer in time")
    garbage_bytes: int = Field(0, description="Serial: bytes that were no reply to a poll (banner, late replies)")
    silences: int = Field(description="Times the robot sent nothing for longer than its requested streams allow")
    image_stream: bool
    sensors_stream: bool
    ts: float


class EpuckFault(BaseModel):
    """Something the operator should know: a framing error, a lost link, a motion timeout."""

    kind: Literal["framing_error", "link_lost", "motion_timeout"]
    message: str
    ts: float


# -- commands ---------------------------------------------------------------------------------------
class EpuckSetSpeed(BaseModel):
    """Wheel speeds in steps/s (1000 steps per revolution). The robot stops after ROBOBUS_EPUCK_MOTION_TIMEOUT_MS
    (default 1 s) unless set_speed is sent again."""

    model_config = _REQ
    left: int = Field(ge=-SPEED_LIMIT, le=SPEED_LIMIT)
    right: int = Field(ge=-SPEED_LIMIT, le=SPEED_LIMIT)


class EpuckSetSteps(BaseModel):
    """Overwrite the motor step counters (int16 on the wire)."""

    model_config = _REQ
    left: int = Field(ge=-32768, le=32767)
    right: int = Field(ge=-32768, le=32767)


class EpuckLeds(BaseModel):
    """Red ring LEDs 1/3/5/7, body and front LED; omitted fields stay as they are."""

    model_config = _REQ
    led1: bool | None = None
    led3: bool | None = None
    led5: bool | None = None
    led7: bool | None = None
    body: bool | None = None
    front: bool | None = None


class EpuckColor(BaseModel):
    model_config = _REQ
    red: int = Field(ge=0, le=RGB_MAX)
    green: int = Field(ge=0, le=RGB_MAX)
    blue: int = Field(ge=0, le=RGB_MAX)


class EpuckRgb(BaseModel):
    """RGB LEDs 2/4/6/8, each channel 0..100 %; omitted LEDs stay as they are."""

    model_config = _REQ
    led2: EpuckColor | None = None
    led4: EpuckColor | None = None
    led6: EpuckColor | None = None
    led8: EpuckColor | None = None


class EpuckSound(BaseModel):
    model_config = _REQ
    sound: Literal["mario", "underworld", "star_wars", "4khz", "10khz", "stop"]


class EpuckEmpty(BaseModel):
    model_config = _REQ


class EpuckObstacleAvoidance(BaseModel):
    model_config = _REQ
    enabled: bool


class EpuckStream(BaseModel):
    """Which streams the robot sends; omitted ones stay as they are."""

    model_config = _REQ
    image: bool | None = None
    sensors: bool | None = None


class EpuckSnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout_s: float = Field(2.0, gt=0, le=10, description="How long to wait for a fresh frame")


class EpuckActuators(BaseModel):
    """The actuator state the gateway now holds for the robot (what it last sent)."""

    connected: bool
    left_speed: int
    right_speed: int
    motion_expires_in_ms: int | None = Field(description="null when the robot is not moving")
    leds: dict[str, bool]
    rgb: dict[str, EpuckColor]
    obstacle_avoidance: bool
    image_stream: bool
    sensors_stream: bool


class EpuckSnapshot(BaseModel):
    """One camera frame as PNG, base64 in the JSON reply (a reply is JSON; 160x120 PNG is ~30-50 kB)."""

    png_base64: str
    width: int
    height: int
    seq: int
    ts: float


# -- firmware update ----------------------------------------------------------------------------------
class EpuckFlashRequest(BaseModel):
    """Load a firmware into the robot's STM32F407 through its onboard programmer's GDB server."""

    model_config = ConfigDict(extra="forbid")
    elf_base64: str = Field(min_length=4, description="The firmware ELF file, base64 (robobus epuck flash sends it)")
    programmer: str | None = Field(None, description="The GDB server's serial port (or host:port); default: the "
                                                     "robot's configured `programmer`")
    verify: bool = Field(True, description="compare-sections after the load")
    force: bool = Field(False, description="Flash an image without a vector table at the boot address 0x08000000 "
                                           "(the robot cannot start it on its own)")


class EpuckFlashResult(BaseModel):
    programmer: str
    bytes_loaded: int
    sections: list[str]
    verified: bool
    duration_s: float


# -- asercom ASCII mode (serial robots) ---------------------------------------------------------------
class EpuckAsciiRequest(BaseModel):
    """One line of asercom's ASCII mode, as a person types it (`D,200,200`, `N`, `H`); serial robots only."""

    model_config = _REQ
    line: str = Field(pattern=r"^[A-Za-z](,-?[0-9]{1,6})*$", max_length=64,
                      description="A letter and comma-separated integers, without the CR")
    timeout_s: float = Field(1.0, gt=0, le=10)


class EpuckAsciiReply(BaseModel):
    reply: str = Field(description="The robot's answer, lines joined by LF (e.g. `n,12,0,3,...`)")
