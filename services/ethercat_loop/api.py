"""ethercat-loop's public contract: the `API`, its states, events, commands and CAN-bridge streams (docs/kit.md,
"Declare the contract"). It imports only the service's models and the kit's contract modules, so that whatever
reads the contract (the schema export, the CLI, the dashboard, the recorder) loads no pysoem, numpy or cycle
code."""

from __future__ import annotations

from services.ethercat_loop.models import (
    EthercatLoopStats,
    PalmAck,
    PalmAdcTestReply,
    PalmAdcTestRequest,
    PalmBridgeLease,
    PalmBridgeLeaseRequest,
    PalmBridgeReleaseRequest,
    PalmCanRx,
    PalmCanTx,
    PalmControlModeRequest,
    PalmDemandsReply,
    PalmDemandsRequest,
    PalmEmpty,
    PalmExtras,
    PalmJoints,
    PalmMotorConfigReply,
    PalmMotorConfigRequest,
    PalmMotorFault,
    PalmMotors,
    PalmNullifyRequest,
    PalmSendCanReply,
    PalmSendCanRequest,
    PalmStopped,
    PalmSystemControlsReply,
    PalmSystemControlsRequest,
    PalmTactile,
)
from shared.contract import BY_REQUEST, ServiceAPI
from shared.errors import ErrorCode

__all__ = ["API", "CAN_RX", "CAN_TX", "EXTRAS", "JOINTS", "LEASE", "LOOP", "MOTORS", "MOTOR_FAULT", "NULLIFY",
           "RELEASE", "SEND_CAN", "SET_CONFIG", "SET_DEMANDS", "SET_MODE", "STOPPED", "SYSTEM", "TACTILE", "TEST_ADC"]

API = ServiceAPI("ethercat-loop", device_doc="one Shadow Dexterous Hand palm (EtherCAT, protocol 0220/0230)",
                 doc="Drives a Shadow hand palm at 1 kHz over EtherCAT; leases its CAN bridge to can-bootloader.")
JOINTS = API.state("joints", PalmJoints, rate_hz=100,
                   doc="Calibrated joint positions (rad) and the raw sensor words")
MOTORS = API.state("motors", PalmMotors, rate_hz=10,
                   doc="The 20 motors: torque, demands, flags, temperature, current, voltage, slow data")
TACTILE = API.state("tactile", PalmTactile, rate_hz=25, doc="Fingertip tactile sensors")
EXTRAS = API.state("palm_extras", PalmExtras, rate_hz=10, doc="IMU, auxiliary analog inputs, palm idle time")
LOOP = API.state("loop_stats", EthercatLoopStats, rate_hz=1,
                 doc="Cycle period, jitter p50/p99/max, overruns, drops and lost frames per 1 s window")
MOTOR_FAULT = API.event("motor_fault", PalmMotorFault)
STOPPED = API.event("stopped", PalmStopped)
# error codes beyond the kit's: the palm not in OP (unavailable), the CAN bridge leased (busy)
_NORMAL = [ErrorCode.UNAVAILABLE, ErrorCode.BUSY]
SET_MODE = API.command("set_control_mode", PalmControlModeRequest, PalmAck, errors=_NORMAL,
                       doc="Torque or PWM control; switching zeroes every demand")
SET_DEMANDS = API.command("set_demands", PalmDemandsRequest, PalmDemandsReply, errors=_NORMAL, motion=True,
                          doc="Demands by joint or motor id, range-checked for the mode; they expire after "
                              "demand_timeout_ms (default 100) unless renewed; refused while the bus stop is "
                              "active")
NULLIFY = API.command("nullify_demands", PalmNullifyRequest, PalmAck,
                      doc="Zero every demand now and, while enabled, keep them zero")
# a config moves a motor held at a zero torque demand (new strain gauge references, sign, deadband): motion
SET_CONFIG = API.command("set_motor_config", PalmMotorConfigRequest, PalmMotorConfigReply, errors=_NORMAL,
                         motion=True, doc="Push an FPID config (one type per cycle, then the CRC); refused while "
                                          "the bus stop is active")
# moves for some requests only (the device's @moves_when predicate, service.py): a jiggle; a TO_MOTOR frame
SYSTEM = API.command("system_controls", PalmSystemControlsRequest, PalmSystemControlsReply, errors=_NORMAL,
                     motion=BY_REQUEST,
                     doc="Reset motors, backlash compensation, gauge tracking, jiggle, write EEPROM; a jiggle "
                         "moves the motors: refused with `stopped` while the bus stop is active")
TEST_ADC = API.command("test_adc_channels", PalmAdcTestRequest, PalmAdcTestReply,
                       errors=[*_NORMAL, ErrorCode.TIMEOUT],
                       doc="The seed's TestADCChannelNumbers: read every sensor's ADC/channel id in "
                           "SENSOR_CHANNEL_NUMBERS mode and compare with the expected wiring")
SEND_CAN = API.command("send_can", PalmSendCanRequest, PalmSendCanReply, errors=_NORMAL, motion=BY_REQUEST,
                       doc="The seed's SendCanMessage: send one frame in CAN direct mode and return the frames "
                           "received within window_ms; a TO_MOTOR frame (SID bits 10:9 = 1: a demand, a control) "
                           "is refused with `stopped` while the bus stop is active")
LEASE = API.command("bridge_lease", PalmBridgeLeaseRequest, PalmBridgeLease, errors=_NORMAL,
                    doc="Take (or renew) the exclusive CAN bridge: CAN direct mode, demands zero, until released "
                        "or the holder is quiet for ttl_ms; `busy` if another holder has it")
RELEASE = API.command("bridge_release", PalmBridgeReleaseRequest, PalmEmpty,
                      doc="Give the CAN bridge back; the hand returns to normal operation")
CAN_TX = API.stream("can_tx", PalmCanTx, "in",
                    doc="Frames for the leased CAN bridge (one per cycle to the wire); renews the lease; while the "
                        "bus stop is active, TO_MOTOR frames (SID bits 10:9 = 1) are dropped and counted")
CAN_RX = API.stream("can_rx", PalmCanRx, "out", doc="Frames received through the leased CAN bridge")
