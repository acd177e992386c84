"""dexter-gateway's public contract: the `API`, its status state and its command and job specs (docs/kit.md,
"Declare the contract"). It imports only the service's models and the kit's contract modules, so that whatever
reads the contract (the schema export, the CLI, the dashboard, the recorder) loads no link or device code."""

from __future__ import annotations

from services.dexter_gateway.models import (
    DexterCommandReply,
    DexterEmpty,
    DexterFileContent,
    DexterFileWritten,
    DexterMotionDone,
    DexterMoveAllJoints,
    DexterMoveRelative,
    DexterMoveTo,
    DexterMoveToStraight,
    DexterPidMove,
    DexterRawCommand,
    DexterReadFile,
    DexterRunFile,
    DexterRunFileResult,
    DexterSetBoundaries,
    DexterSetParameter,
    DexterSleep,
    DexterStatus,
    DexterStatusModeRequest,
    DexterWaitMotionDone,
    DexterWriteFile,
    DexterWriteFpga,
)
from shared.contract import BY_REQUEST, ServiceAPI
from shared.errors import ErrorCode

__all__ = ["API", "HEARTBEAT", "MOVE_ALL", "MOVE_REL", "MOVE_STRAIGHT", "MOVE_TO", "PID_MOVE", "RAW", "READ_FILE",
           "RUN_FILE", "SET_BOUNDS", "SET_PARAM", "SLEEP", "STATUS", "STATUS_MODE", "WAIT_MOTION", "WRITE_FILE",
           "WRITE_FPGA"]

API = ServiceAPI("dexter-gateway", device_doc="one Haddington Dynamics Dexter arm (DexRun, TCP port 50000)",
                 doc="Dexter arms over the DexRun socket protocol: status, moves, parameters, robot files")
STATUS = API.state("status", DexterStatus, doc="Decoded standard status (polled with `g` when the link is idle); "
                   "rate ROBOBUS_DEXTER_STATUS_HZ")
# error codes beyond the kit's: every command goes through the arm's link (unavailable, timeout, busy,
# device_error); shell and file access can also be refused (forbidden: allowlist, errno 13)
_LINK = [ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.BUSY, ErrorCode.DEVICE_ERROR]
_FILES = [*_LINK, ErrorCode.FORBIDDEN]
# the bus stop (README, "Stopping everything"): the commands that move are `motion` (refused by the kit while the stop
# is active); set_parameter and raw move for some requests only (motion=BY_REQUEST: the arm's @moves_when predicates,
# protocol.moves), refused `stopped` then
MOVE_ALL = API.command("move_all_joints", DexterMoveAllJoints, DexterCommandReply, errors=_LINK, motion=True,
                       doc="`a`: queued coordinated move, J1..J5 degrees (sent as arcseconds), optional J6/J7")
MOVE_REL = API.command("move_all_joints_relative", DexterMoveRelative, DexterCommandReply, errors=_LINK,
                       motion=True, doc="`R`: queued relative move, degrees")
PID_MOVE = API.command("pid_move_all_joints", DexterPidMove, DexterCommandReply, errors=_LINK, motion=True,
                       doc="`P`: immediate PID offsets added to the `a` position (closed-loop mode)")
MOVE_TO = API.command("move_to", DexterMoveTo, DexterCommandReply, errors=_LINK, motion=True,
                      doc="`M`: Cartesian move (onboard IK), metres or microns, direction and arm configuration")
MOVE_STRAIGHT = API.command("move_to_straight", DexterMoveToStraight, DexterCommandReply, errors=_LINK,
                            motion=True, doc="`T`: straight-line Cartesian move")
SET_PARAM = API.command("set_parameter", DexterSetParameter, DexterCommandReply, errors=_LINK, motion=BY_REQUEST,
                        doc="`S` by name or index, with DDE's unit conversions (deg/s -> nbits, deg -> arcsec, "
                        "m -> µm) unless units='wire'. RunFile is the run_file job. The parameters that move "
                        "(EERoll, EESpan, GripperMotor, ServoSet, ServoSet2X, RebootServo, CommandedAngles, "
                        "J*Force) are refused `stopped` while the bus stop is active")
SET_BOUNDS = API.command("set_boundaries", DexterSetBoundaries, DexterCommandReply, errors=_LINK,
                         doc="`B`: J1..J5 high/low boundaries, degrees")
SLEEP = API.command("sleep", DexterSleep, DexterCommandReply, errors=_LINK, doc="`z`: DexRun sleeps before replying")
HEARTBEAT = API.command("heartbeat", DexterEmpty, DexterCommandReply, errors=_LINK,
                        doc="`h`: no-op, returns the status")
WRITE_FPGA = API.command("write_fpga", DexterWriteFpga, DexterCommandReply, errors=_LINK, motion=True,
                         doc="`w`: waits for the motion FIFO to drain, then writes a virtual FPGA register")
STATUS_MODE = API.command("status_mode", DexterStatusModeRequest, DexterCommandReply, errors=_LINK,
                          doc="`g <mode>` (newest DexRun only): '0' is the standard layout; others are "
                          "firmware-specific and published as raw ints")
RAW = API.command("raw", DexterRawCommand, DexterCommandReply, errors=_FILES, motion=BY_REQUEST,
                  doc="Any oplet for experts, `<oplet> <args…>`: checked for arguments, length and terminator; "
                  "the shell target of `r` is refused unless enabled and allowlisted; an oplet that moves "
                  "(a R M T C D P w, and the `S` parameters set_parameter refuses) is refused `stopped` while "
                  "the bus stop is active")
WAIT_MOTION = API.job("wait_motion_done", DexterWaitMotionDone, DexterMotionDone, errors=_LINK,
                      doc="`F`: returns when the motion FIFO has drained")
READ_FILE = API.job("read_file", DexterReadFile, DexterFileContent, errors=_FILES,
                    doc="`r` block by block: a robot file, a #keyword (decoded), or an allowlisted shell command")
WRITE_FILE = API.job("write_file", DexterWriteFile, DexterFileWritten, errors=_FILES,
                     doc="`W f/m/e`: escaped, 62 characters a block; optional read-back verification")
RUN_FILE = API.job("run_file", DexterRunFile, DexterRunFileResult, errors=_FILES, motion=True,
                   doc="`S RunFile <path>`: run a file of oplets")
