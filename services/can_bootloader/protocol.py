"""The PIC18F CAN bootloader wire format (sans-I/O: frames in, frames out, no bus, no clock).

Source of truth: docs/reference/can_bootloader.md §1 (SID layout) and §4 (the SimpleMotorFlasher
sequence and its ACK rule `can_data_is_ack`), with the bootloader's own documentation ("Bootloading protocole",
docs/reference/can_bootloader.md §2; "the seed" below) for the bootloader side. Where the two disagree §4 wins,
and the spot is marked `reference over seed`.

SID (11 bits) = direction[10:9] | motor id[8:5] | ACK[4] | command[3:0]; the bootloader direction is
3, so every request is `0x600 | (local_id << 5) | command` and every answer sets the ACK bit 0x10.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

BOOT_DIRECTION = 0x600  # bits [10:9] = 3: bootloader protocol
DIRECTION_MASK = 0x600
ACK_BIT = 0x10
ID_SHIFT = 5
ID_MASK = 0x1E0  # bits [8:5]
COMMAND_MASK = 0x0F
SID_MASK = 0x7FF
# `can_data_is_ack` compares (id & 0x1EF): motor id + command bits, not the ACK bit, not the direction bits.
ACK_COMPARE_MASK = 0x1EF

MAGIC_DATA = bytes.fromhex("55AA55AA55AA55AA")
VERSION_DATA = bytes.fromhex("40414243")  # the bootloader's fixed version reply
BOARDS_PER_BUS = 10
MAX_BOARD_ID = 19
ADDRESS_MAX = 0xFFFFFF  # TBLPTR is 22 bits; the frame carries 3 bytes


class BootCommand(IntEnum):
    WRITE_FLASH_DATA = 0x0
    READ_FLASH = 0x1
    ERASE_FLASH = 0x2
    RESET = 0x3
    READ_VERSION = 0x4
    WRITE_FLASH_ADDRESS = 0x5
    MAGIC_PACKET = 0xA


class ProtocolError(ValueError):
    """A value that cannot go on the wire (bad board id, address, data length)."""


@dataclass(frozen=True)
class BootFrame:
    """One classic CAN frame with an 11-bit identifier (no bus number: a flasher owns one bus)."""

    sid: int
    data: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.sid <= SID_MASK:
            raise ProtocolError(f"SID 0x{self.sid:X} is not an 11-bit identifier")
        if len(self.data) > 8:
            raise ProtocolError(f"a classic CAN frame carries at most 8 bytes, got {len(self.data)}")

    def __str__(self) -> str:
        return f"0x{self.sid:03X} [{len(self.data)}] {self.data.hex(' ').upper()}"


@dataclass(frozen=True)
class BoardAddress:
    """Where a board (0–19) lives: palm CAN bus 1 for 0–9, bus 2 for 10–19 (local id = id − 10)."""

    board: int
    bus: int
    local_id: int


def board_address(board: int) -> BoardAddress:
    if not 0 <= board <= MAX_BOARD_ID:
        raise ProtocolError(f"board id {board} is out of range 0–{MAX_BOARD_ID}")
    if board < BOARDS_PER_BUS:
        return BoardAddress(board, 1, board)
    return BoardAddress(board, 2, board - BOARDS_PER_BUS)


def boot_sid(local_id: int, command: int, ack: bool = False) -> int:
    if not 0 <= local_id < 16:
        raise ProtocolError(f"local motor id {local_id} does not fit in 4 bits")
    if not 0 <= command <= COMMAND_MASK:
        raise ProtocolError(f"command 0x{command:X} does not fit in 4 bits")
    return BOOT_DIRECTION | (local_id << ID_SHIFT) | (ACK_BIT if ack else 0) | command


def address_bytes(address: int) -> bytes:
    """TBLPTR as sent by the flasher: LSB, middle byte, upper byte."""
    if not 0 <= address <= ADDRESS_MAX:
        raise ProtocolError(f"address 0x{address:X} does not fit in 3 bytes")
    return bytes((address & 0xFF, (address >> 8) & 0xFF, (address >> 16) & 0xFF))


def parse_address(data: bytes) -> int:
    """Inverse of address_bytes; missing bytes read as 0 (the PIC reads whatever is in its buffer)."""
    b = bytes(data[:3]).ljust(3, b"\x00")
    return b[0] | (b[1] << 8) | (b[2] << 16)


# -- requests (what the flasher sends) ------------------------------------------------------------------
def magic_packet(local_id: int) -> BootFrame:
    return BootFrame(boot_sid(local_id, BootCommand.MAGIC_PACKET), MAGIC_DATA)


def erase_flash(local_id: int) -> BootFrame:
    # Reference over seed: the seed documents ERASE with length 0, but the original flasher sends
    # length 1 with an unused (zero) data byte (docs/reference/can_bootloader.md §4.2 step 2); the bootloader echoes
    # it back.
    return BootFrame(boot_sid(local_id, BootCommand.ERASE_FLASH), b"\x00")


def write_flash_address(local_id: int, address: int) -> BootFrame:
    return BootFrame(boot_sid(local_id, BootCommand.WRITE_FLASH_ADDRESS), address_bytes(address))


def write_flash_data(local_id: int, data: bytes) -> BootFrame:
    if len(data) != 8:
        raise ProtocolError(f"WRITE_FLASH_DATA carries exactly 8 bytes, got {len(data)}")
    return BootFrame(boot_sid(local_id, BootCommand.WRITE_FLASH_DATA), bytes(data))


def read_flash(local_id: int, address: int) -> BootFrame:
    return BootFrame(boot_sid(local_id, BootCommand.READ_FLASH), address_bytes(address))


def reset(local_id: int) -> BootFrame:
    return BootFrame(boot_sid(local_id, BootCommand.RESET), b"")


def read_version(local_id: int) -> BootFrame:
    return BootFrame(boot_sid(local_id, BootCommand.READ_VERSION), b"")


def starts_firmware(frame: BootFrame) -> bool:
    """A bootloader request that starts the board's application (RESET: EEPROM[0xFF] = 0x42, then the firmware
    runs, and may drive its motor): the one request the bus stop holds (reference shadow_ethercat.md §4)."""
    return (frame.sid & (DIRECTION_MASK | ACK_BIT | COMMAND_MASK)) == BOOT_DIRECTION | BootCommand.RESET


# -- answers ---------------------------------------------------------------------------------------------
def ack_for(request: BootFrame) -> BootFrame:
    """The 'usual acknowledgement': same SID with the ACK bit, same length, same data."""
    return BootFrame(request.sid | ACK_BIT, request.data)


def is_ack(sent: BootFrame, reply: BootFrame) -> bool:
    """`can_data_is_ack` of the original (docs/reference/can_bootloader.md §4), without the READ data compare.

    READ_FLASH: the reply SID must be exactly `0x600 | id<<5 | 0x10 | 1` with 8 data bytes (the original
    then compares the bytes with the image inside the ACK check; `read_matches` does that part).
    READ_VERSION: the original never sends it; its answer is 4 bytes, so it cannot pass the echo rule:
    it matches on SID | 0x10 exactly and length 4.
    Every other command: same length, same data, ACK bit set, and (id & 0x1EF) equal to the sent id's
    (motor id and command bits compared, the direction bits ignored, as the original did).
    """
    command = sent.sid & COMMAND_MASK
    if command == BootCommand.READ_FLASH:
        return (reply.sid & SID_MASK) == (sent.sid | ACK_BIT) and len(reply.data) == 8
    if command == BootCommand.READ_VERSION:
        return (reply.sid & SID_MASK) == (sent.sid | ACK_BIT) and len(reply.data) == 4
    return (
        bool(reply.sid & ACK_BIT)
        and len(reply.data) == len(sent.data)
        and reply.data == sent.data
        and (reply.sid & ACK_COMPARE_MASK) == (sent.sid & ACK_COMPARE_MASK)
    )


def is_malformed_answer(sent: BootFrame, reply: BootFrame) -> bool:
    """An answer to `sent` (ACK bit set, the same board and command bits) that `is_ack` refuses: a wrong
    length, other data in an echo, a READ answer in the wrong direction. Garbage from a board: counted, and a
    read that gets only such answers fails with `device_error`, not `timeout`."""
    same = (reply.sid & (ID_MASK | COMMAND_MASK)) == (sent.sid & (ID_MASK | COMMAND_MASK))
    return bool(reply.sid & ACK_BIT) and same and not is_ack(sent, reply)


def read_matches(sent: BootFrame, reply: BootFrame, expected: bytes) -> bool:
    """The full READ ACK of the original: the reply is a READ answer and carries the expected bytes."""
    return is_ack(sent, reply) and reply.data == expected


@dataclass(frozen=True)
class BootMessage:
    """A decoded bootloader-protocol frame (request or answer)."""

    local_id: int
    command: int
    ack: bool
    data: bytes

    @property
    def command_name(self) -> str:
        try:
            return BootCommand(self.command).name
        except ValueError:
            return f"UNKNOWN_0x{self.command:X}"


def decode(frame: BootFrame) -> BootMessage | None:
    """Decode a frame of the bootloader direction; None for anything else (motor data, garbage)."""
    if frame.sid & DIRECTION_MASK != BOOT_DIRECTION:
        return None
    return BootMessage(
        local_id=(frame.sid & ID_MASK) >> ID_SHIFT,
        command=frame.sid & COMMAND_MASK,
        ack=bool(frame.sid & ACK_BIT),
        data=frame.data,
    )


def encode(message: BootMessage) -> BootFrame:
    return BootFrame(boot_sid(message.local_id, message.command, message.ack), message.data)
