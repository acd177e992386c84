"""roi-modules' public contract: the `API`, its states, event, commands and move jobs (docs/kit.md, "Declare the
contract"). It imports only the service's models and the kit's contract modules, so that whatever reads the
contract (the schema export, the CLI, the dashboard, the recorder) loads no transport, module or simulator code."""

from __future__ import annotations

from services.roi_modules.models import (
    RoiAck,
    RoiBlacklistReply,
    RoiBlacklistRequest,
    RoiEmpty,
    RoiFault,
    RoiGotoPosition,
    RoiLinkStats,
    RoiMotionState,
    RoiMoveRequest,
    RoiMoveResult,
    RoiOdrivePower,
    RoiOdriveTemperature,
    RoiPinStates,
    RoiPinValues,
    RoiPong,
    RoiQueueGeneral,
    RoiQueueSysAdmin,
    RoiRawReply,
    RoiSetPinMode,
    RoiSetPinOutput,
    RoiSetTorque,
    RoiSetVelocity,
    RoiStatusReport,
)
from shared.contract import BY_REQUEST, ServiceAPI
from shared.errors import ErrorCode

__all__ = ["API", "BLACKLIST", "CLEAR_ERRORS", "FAULT", "GOTO_POSITION", "GOTO_RELATIVE", "GO_TO_POSITION",
           "GO_TO_RELATIVE", "LINK", "PING", "PIN_STATES", "PIN_VALUES", "POWER", "QUEUE_GENERAL",
           "QUEUE_SYSADMIN", "SET_PIN_MODE", "SET_PIN_OUTPUT", "SET_TORQUE", "SET_VELOCITY", "STATE",
           "STATUS_REPORT", "TEMPERATURE"]  # the kinds of module: API.kinds

API = ServiceAPI("roi-modules", device_doc="one ROI module (GPIO, ODrive or actuator) on the ROI UDP network",
                 doc="ROI (Roobot Over IP) modules over UDP: health, state, commands, moves")
# error codes beyond the kit's: the module not answering (unavailable) or refusing (device_error);
# a move job is also refused while another runs (busy) and ends with timeout when never in tolerance
_MODULE = [ErrorCode.UNAVAILABLE, ErrorCode.DEVICE_ERROR]
_MOVE = [*_MODULE, ErrorCode.BUSY, ErrorCode.TIMEOUT]
# a GPIO pin configured in `stop_outputs` drives something that moves: set_pin_output, set_pin_mode and a raw
# SET_OUTPUT / SET_PIN_MODE packet to it move for some requests only (motion=BY_REQUEST: the module's @moves_when
# predicates, device.py), refused with `stopped` during the bus stop
PIN_STATES = API.state("pin_states", RoiPinStates, doc="GPIO: pin modes, on change")
PIN_VALUES = API.state("pin_values", RoiPinValues, doc="GPIO: pin values after each read sweep")
STATE = API.state("state", RoiMotionState, rate_hz=20,
                  doc="ODrive: position/velocity/torque (GET_ALL, every maintain tick); actuator: % (measured "
                      "from GET_CURRENT_LENGTH where the module answers a length, else estimated)")
POWER = API.state("power", RoiOdrivePower, rate_hz=2, doc="ODrive: bus voltage and current")
TEMPERATURE = API.state("temperature", RoiOdriveTemperature, rate_hz=2, doc="ODrive: FET and motor temperature")
LINK = API.state("link", RoiLinkStats, rate_hz=1, doc="The module's UDP link counters")
FAULT = API.event("fault", RoiFault, doc="Disconnection, reconnection, module reset, module error")
SET_PIN_OUTPUT = API.command("set_pin_output", RoiSetPinOutput, RoiAck, errors=_MODULE, motion=BY_REQUEST,
                             doc="GPIO: drive an output pin 0/1; the pin must first be made an output with "
                                 "set_pin_mode (mode output), else the module refuses it (device_error). A pin "
                                 "in the module's stop_outputs: refused while the bus stop is active (stopped)")
SET_PIN_MODE = API.command("set_pin_mode", RoiSetPinMode, RoiAck, errors=_MODULE, motion=BY_REQUEST,
                           doc="GPIO: input, input_pullup or output. A pin in the module's stop_outputs: refused "
                               "while the bus stop is active (stopped)")
GOTO_POSITION = API.command("goto_position", RoiGotoPosition, RoiAck, errors=_MODULE, motion=True,
                            doc="ODrive (rev, position mode, TRAP_TRAJ) or actuator (%); returns when acknowledged")
GOTO_RELATIVE = API.command("goto_relative_position", RoiGotoPosition, RoiAck, errors=_MODULE, motion=True,
                            doc="Relative to the current position; sent as an absolute set-point (resend-safe)")
SET_VELOCITY = API.command("set_velocity", RoiSetVelocity, RoiAck, errors=_MODULE, motion=True,
                           doc="ODrive: velocity mode (VEL_RAMP); actuator: the velocity of later moves")
SET_TORQUE = API.command("set_torque", RoiSetTorque, RoiAck, errors=_MODULE, motion=True,
                         doc="ODrive: torque mode (TORQUE_RAMP)")
CLEAR_ERRORS = API.command("clear_errors", RoiEmpty, RoiAck, errors=_MODULE, motion=True,
                           doc="ODrive: clear errors, closed loop again (the axis may move to its set-point: "
                               "a motion command)")
QUEUE_GENERAL = API.command("queue_general_packet", RoiQueueGeneral, RoiRawReply,
                            errors=[*_MODULE, ErrorCode.FORBIDDEN], motion=BY_REQUEST,
                            doc="Raw general packet; answered with the module's decoded reply. On an ODrive or "
                                "actuator module only getters: a setter moves the motor (forbidden). On a GPIO "
                                "module, SET_OUTPUT / SET_PIN_MODE to a pin of its stop_outputs is refused while "
                                "the bus stop is active (stopped)")
QUEUE_SYSADMIN = API.command("queue_sysadmin_packet", RoiQueueSysAdmin, RoiRawReply, errors=_MODULE,
                             doc="Raw SysAdmin packet; answered with the module's decoded reply")
PING = API.command("ping", RoiEmpty, RoiPong, errors=_MODULE, doc="SysAdmin PING: operable and module type")
STATUS_REPORT = API.command("status_report", RoiEmpty, RoiStatusReport, errors=_MODULE,
                            doc="SysAdmin STATUS_REPORT, decoded")
BLACKLIST = API.command("blacklist", RoiBlacklistRequest, RoiBlacklistReply, errors=_MODULE,
                        doc="SysAdmin BLACK_LIST add/remove/list (the firmware never answers it)")
GO_TO_POSITION = API.job("go_to_position", RoiMoveRequest, RoiMoveResult, errors=_MOVE, motion=True,
                         doc="Move and follow: progress = position/velocity; done within tolerance; cancel stops")
GO_TO_RELATIVE = API.job("go_to_relative_position", RoiMoveRequest, RoiMoveResult, errors=_MOVE, motion=True,
                         doc="As go_to_position, relative to the position at the start")

# the kinds of module (a module's `type` in the settings): what each answers, every command bound or no start
_COMMON = [QUEUE_GENERAL, QUEUE_SYSADMIN, PING, STATUS_REPORT, BLACKLIST]
_MOVES = [GOTO_POSITION, GOTO_RELATIVE, SET_VELOCITY]
API.kind("gpio", commands=[*_COMMON, SET_PIN_OUTPUT, SET_PIN_MODE], doc="A General GPIO module: pins")
API.kind("odrive", commands=[*_COMMON, *_MOVES, SET_TORQUE, CLEAR_ERRORS], jobs=[GO_TO_POSITION, GO_TO_RELATIVE],
         doc="An ODrive module: one motor axis (rev)")
API.kind("actuator", commands=[*_COMMON, *_MOVES], jobs=[GO_TO_POSITION, GO_TO_RELATIVE],
         doc="A linear actuator module (% of its stroke)")
