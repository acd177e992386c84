"""epuck-gateway's settings: ROBOBUS_EPUCK_* in the environment (nested values as JSON), or keys of a
ROBOBUS_CONFIG file; the robots' configurations, one per link kind."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from shared.contract import NAME_RE
from shared.node import NODE_DEVICE
from shared.settings import KitSettings
from shared.transports import check_transport

__all__ = ["SERVICE", "EpuckRobotConfig", "EpuckSerialRobot", "EpuckSettings", "EpuckWifiRobot"]

SERVICE = "epuck-gateway"  # its transports: entry points `robobus.transports` epuck-gateway.<transport>


class EpuckWifiRobot(BaseModel):
    """A robot on WiFi (selector 15): the radio module's TCP server."""

    id: str = Field(pattern=NAME_RE.pattern, description="Device name on the bus")
    transport: Literal["wifi"] = "wifi"
    host: str
    port: int = Field(1000, ge=1, le=65535)
    programmer: str | None = Field(None, description="Its programmer's GDB server port on this host, for `flash`")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class EpuckSerialRobot(BaseModel):
    """A robot on Bluetooth SPP (/dev/rfcommN, selector 3) or USB (/dev/ttyACMn, selector 8): asercom v2."""

    id: str = Field(pattern=NAME_RE.pattern, description="Device name on the bus")
    transport: Literal["serial"]
    port: str = Field(min_length=1, description="Serial device, e.g. /dev/ttyACM0 or /dev/serial/by-id/...")
    baud: int = Field(115200, ge=1200, le=4_000_000)
    poll_hz: float = Field(50.0, gt=0, le=1000, description="asercom is request/response: sensor polls per second")
    image_fps: float | None = Field(None, ge=0, le=30,
                                    description="Camera polls per second while the image stream is on; default "
                                                "by baud: 0.5 below 230400 (Bluetooth: a 40x40 image is 278 ms of "
                                                "a 115200 line), else 2")
    programmer: str | None = Field(None, description="Its programmer's GDB server port on this host, for `flash`")

    @property
    def address(self) -> str:
        return f"{self.port}@{self.baud}"


def _transport_of(v: Any) -> str:
    return str(v.get("transport", "wifi") if isinstance(v, dict) else getattr(v, "transport", "wifi"))


EpuckRobotConfig = Annotated[Annotated[EpuckWifiRobot, Tag("wifi")] | Annotated[EpuckSerialRobot, Tag("serial")],
                             Discriminator(_transport_of)]


class EpuckSettings(KitSettings):
    """ROBOBUS_EPUCK_ROBOTS='[{"id":"epuck1","host":"192.168.1.20"}]' and the knobs below (ROBOBUS_<FIELD>)."""

    section: ClassVar[str] = "epuck"  # any other ROBOBUS_EPUCK_* is refused (docs/kit.md, "Settings")
    # the kit's, with this service's default: hand-offs from the loop to paho's network thread wait for the GIL; a
    # shorter switch interval keeps sensor latency low while the encoder threads are busy
    switch_interval_ms: float | None = Field(1.0, gt=0, le=100, description="The interpreter's thread switch "
                                             "interval (docs/kit.md, \"Settings\")")

    epuck_robots: list[EpuckRobotConfig] = Field(
        min_length=1, description='The robots: {"id", "host", "port": 1000} on WiFi, or {"id", "transport": '
                                  '"serial", "port": "/dev/ttyACM0", "baud": 115200} on Bluetooth/USB')
    epuck_sensors_hz: float = Field(50.0, ge=0, le=1000, description="Sensors rate cap per robot; 0 = every packet")
    epuck_image_fps: float = Field(10.0, ge=0, le=100, description="JPEG rate cap per robot; 0 = every frame")
    epuck_jpeg_quality: int = Field(80, ge=1, le=95)
    epuck_stream_image: bool = Field(True, description="Image stream on at start")
    epuck_stream_sensors: bool = Field(True, description="Sensors stream on at start")
    epuck_motion_timeout_ms: int = Field(1000, ge=50, le=60000, description="Stop a robot without a fresh set_speed")
    epuck_connect_timeout_s: float = Field(3.0, gt=0, le=60)
    epuck_flash_stall_s: float = Field(10.0, ge=0.5, le=600,
                                       description="A firmware load or verify without progress for this long is "
                                                   "given up (gdb stopped) and retried once")
    epuck_reconnect_min_s: float = Field(0.2, gt=0, le=60, description="First wait after a failed attempt or a "
                                                                      "lost link (doubling up to the max)")
    epuck_reconnect_max_s: float = Field(2.0, gt=0, le=600)
    epuck_probe_period_s: float = Field(2.0, gt=0, le=600,
                                        description="An unreachable robot (no valid data for longer than its budget): "
                                                    "one connection attempt per period")
    epuck_stale_timeout_s: float = Field(0.8, gt=0, le=60,
                                         description="Liveness budget: silence beyond the expected gap between packets "
                                                     "(the image interval seen while images are requested) that "
                                                     "makes a robot silent; a robot without a link is unreachable "
                                                     "after this")
    epuck_image_gap_max_s: float = Field(6.0, gt=0, le=120,
                                         description="Longest image interval a healthy WiFi link may show (measured "
                                                     "max 5.9 s)")
    epuck_tcp_user_timeout_s: float = Field(10.0, gt=0, le=600,
                                            description="Drop a connection whose robot stopped acknowledging for this "
                                                        "long (TCP_USER_TIMEOUT), then reconnect")
    epuck_encode_workers: int = Field(0, ge=0, le=32,
                                      description="Threads encoding the JPEG stream; 0 = on the event loop (a "
                                                  "160x120 frame is ~0.2 ms, less than the thread hand-offs). "
                                                  "PNG snapshots always use a thread")

    @field_validator("epuck_robots")
    @classmethod
    def _unique(cls, v: list[EpuckRobotConfig]) -> list[EpuckRobotConfig]:
        ids = [r.id for r in v]
        if NODE_DEVICE in ids:
            raise ValueError(f"{NODE_DEVICE!r} is reserved for the node's own state")
        if len(set(ids)) != len(ids):
            raise ValueError(f"robot ids must be unique, got {ids}")
        for r in v:  # each robot's link is the transport of that name (docs/kit.md, "Transports")
            check_transport(SERVICE, r.transport)
        addrs = [r.address.split("@")[0] for r in v]
        if len(set(addrs)) != len(addrs):  # a robot serves one client: two links would fight over it
            raise ValueError(f"each robot address may appear once, got {addrs}")
        return v
