"""can-bootloader's public contract: the `API` and its command, job and event specs (docs/kit.md, "Declare the
contract"). It imports only the service's models and the kit's contract modules, so that whatever reads the
contract (the schema export, the CLI, the dashboard, the recorder) loads no CAN library and no device code."""

from __future__ import annotations

from services.can_bootloader.models import (
    BootBoardRequest,
    BootReadReply,
    BootReadRequest,
    BootResetReply,
    BootVersionReply,
    FlashBoardResult,
    FlashManyRequest,
    FlashManyResult,
    FlashRequest,
)
from shared.contract import ServiceAPI
from shared.errors import ErrorCode

__all__ = ["API", "FLASH", "FLASH_MANY", "FLASH_REPORT", "READ_FLASH", "READ_VERSION", "RESET"]

# error codes beyond the kit's: a bus not configured, not open or failing (unavailable), one exchange per bus
# (busy), no answer (timeout), an answer that is not the bootloader's (device_error); a flash also refuses paths
# outside the firmware folder (forbidden) and ends with device_error when a board fails verification; a flash is
# refused `stopped` while the bus stop is active (`unavailable` until the node has read it), and ends `stopped`
# when the stop held its RESET or kept a board of it from starting
_BUS_ERRORS = [ErrorCode.UNAVAILABLE, ErrorCode.BUSY, ErrorCode.TIMEOUT, ErrorCode.DEVICE_ERROR]
_FLASH_ERRORS = [ErrorCode.UNAVAILABLE, ErrorCode.BUSY, ErrorCode.TIMEOUT, ErrorCode.FORBIDDEN, ErrorCode.DEVICE_ERROR,
                 ErrorCode.STOPPED]
API = ServiceAPI("can-bootloader",
                 device_doc="the motor boards (PIC18F2580 CAN bootloader) of one hand's two CAN buses",
                 doc="Flashes the Shadow hand's motor boards over CAN (a python-can bus or the palm's CAN bridge).")
FLASH = API.job("flash", FlashRequest, FlashBoardResult, errors=_FLASH_ERRORS,
                doc="Flash one board: magic packet, erase, write, read-back verify, reset, bootloader-aware check. "
                    "The bus stop refuses it (stopped); one in progress continues, its RESET held")
FLASH_MANY = API.job("flash_many", FlashManyRequest, FlashManyResult, errors=_FLASH_ERRORS,
                     doc="Flash several boards; boards 0–9 and 10–19 (the two buses) in parallel. The bus stop "
                         "refuses it; the boards in progress continue (their RESET held), the others do not start")
READ_VERSION = API.command("read_version", BootBoardRequest, BootVersionReply, errors=_BUS_ERRORS,
                           doc="The bootloader's version")
READ_FLASH = API.command("read_flash", BootReadRequest, BootReadReply, errors=_BUS_ERRORS,
                         doc="Dump program memory (bootloader mode)")
RESET = API.command("reset", BootBoardRequest, BootResetReply, errors=_BUS_ERRORS, motion=True,
                    doc="RESET: the bootloader marks the application valid (EEPROM[0xFF]=0x42) and starts it (a "
                        "firmware that may drive its motor: refused while the bus stop is active)")
FLASH_REPORT = API.event("flash_report", FlashBoardResult, doc="One board flashed (or not): the full outcome")
