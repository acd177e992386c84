"""epuck-gateway's public contract: the `API`, its states, image, event, commands and job (docs/kit.md, "Declare
the contract"). It imports only the service's models and the kit's contract modules, so that whatever reads the
contract (the schema export, the CLI, the dashboard, the recorder) loads no Pillow, pyserial, link or simulator."""

from __future__ import annotations

from services.epuck_gateway.models import (
    EpuckActuators,
    EpuckAsciiReply,
    EpuckAsciiRequest,
    EpuckEmpty,
    EpuckFault,
    EpuckFlashRequest,
    EpuckFlashResult,
    EpuckImageInfo,
    EpuckLeds,
    EpuckLinkStats,
    EpuckObstacleAvoidance,
    EpuckRgb,
    EpuckSensors,
    EpuckSetSpeed,
    EpuckSetSteps,
    EpuckSnapshot,
    EpuckSnapshotRequest,
    EpuckSound,
    EpuckStream,
)
from shared.contract import BY_REQUEST, ServiceAPI
from shared.errors import ErrorCode

__all__ = ["API", "ASCII", "CALIBRATE_IR", "FAULT", "FLASH", "IMAGE", "IMAGE_INFO", "LEDS", "LINK", "OBSTACLE",
           "RGB_CMD", "SENSORS", "SET_SPEED", "SET_STEPS", "SNAPSHOT", "SOUND", "STREAM"]

API = ServiceAPI("epuck-gateway", device_doc="one e-puck2 robot on WiFi (TCP port 1000, selector 15)",
                 doc="e-puck2 robots over WiFi: sensors, camera, motors, LEDs, sound")
SENSORS = API.state("sensors", EpuckSensors,
                    doc="Decoded sensors packet; rate cap ROBOBUS_EPUCK_SENSORS_HZ (default 50)")
IMAGE = API.binary("image", "image/jpeg", doc="Camera, 160x120 JPEG; fps cap ROBOBUS_EPUCK_IMAGE_FPS (default 10), "
                                              "quality ROBOBUS_EPUCK_JPEG_QUALITY")
IMAGE_INFO = API.state("image_info", EpuckImageInfo, doc="Sequence, time and size of the latest image")
LINK = API.state("link", EpuckLinkStats, doc="TCP link statistics, once a second and on change")
FAULT = API.event("fault", EpuckFault)
# every command needs the robot's TCP link (unavailable without it); the kit adds its own codes
_LINK = [ErrorCode.UNAVAILABLE]
SET_SPEED = API.command("set_speed", EpuckSetSpeed, EpuckActuators, errors=_LINK, motion=True,
                        doc="Wheel speeds, +-1000 steps/s; the robot moves for ROBOBUS_EPUCK_MOTION_TIMEOUT_MS "
                            "(default 1 s) after each set_speed: send it again within that time to keep it moving")
SET_STEPS = API.command("set_steps", EpuckSetSteps, EpuckActuators, errors=_LINK,
                        doc="Overwrite the motor step counters")
LEDS = API.command("leds", EpuckLeds, EpuckActuators, errors=_LINK, doc="LED1/3/5/7, body and front LED on/off")
RGB_CMD = API.command("rgb", EpuckRgb, EpuckActuators, errors=_LINK, doc="RGB LEDs 2/4/6/8, red/green/blue 0..100")
SOUND = API.command("sound", EpuckSound, EpuckActuators, errors=_LINK,
                    doc="Play mario, underworld, star_wars, 4khz, 10khz, or stop")
CALIBRATE_IR = API.command("calibrate_ir", EpuckEmpty, EpuckActuators, errors=_LINK,
                           doc="Calibrate the IR proximity sensors (keep objects away)")
# the on-board behaviour drives the wheels itself (docs/reference/epuck2.md §3, settings bit1): motion; the bus stop
# turns it off
OBSTACLE = API.command("obstacle_avoidance", EpuckObstacleAvoidance, EpuckActuators, errors=_LINK, motion=True,
                       doc="Enable or disable the on-board obstacle avoidance (it drives the wheels: a motion "
                           "command, and the bus stop turns it off)")
STREAM = API.command("stream", EpuckStream, EpuckActuators, errors=_LINK, doc="Image and sensors streams on/off")
# moves for some requests only (motion=BY_REQUEST): a `D` line (the robot's @moves_when predicate, device.py)
ASCII = API.command("ascii", EpuckAsciiRequest, EpuckAsciiReply, errors=[*_LINK, ErrorCode.TIMEOUT],
                    motion=BY_REQUEST,
                    doc="asercom ASCII mode, one typed line (`D,200,200`, `N`); robots on a serial port only. A `D` "
                        "line moves the robot: refused with `stopped` while the bus stop is active")
FLASH = API.job("flash", EpuckFlashRequest, EpuckFlashResult,
                errors=[*_LINK, ErrorCode.BUSY, ErrorCode.DEVICE_ERROR],
                doc="Firmware update of the robot's main MCU through its onboard programmer (gdb-multiarch on the "
                    "gateway's host); the robot's link is paused and restored around it")
SNAPSHOT = API.command("snapshot", EpuckSnapshotRequest, EpuckSnapshot, errors=[*_LINK, ErrorCode.TIMEOUT],
                       doc="One fresh camera frame as PNG, base64 in the reply (png_base64)")
