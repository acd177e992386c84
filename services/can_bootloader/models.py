"""can-bootloader's payloads: the flash job requests and results, and the bootloader commands' requests
and replies. Model names are unique across services (the AsyncAPI document holds them all)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.can_bootloader import protocol as p

MAX_HEX_CHARS = 4_000_000


class _Firmware(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hex: str | None = Field(None, max_length=MAX_HEX_CHARS, description="The firmware as Intel HEX text")
    path: str | None = Field(None, max_length=1024, description="A .hex file inside the service's firmware folder "
                                                               "(relative to it); nowhere else is readable")
    window: int | None = Field(None, ge=1, le=64, description="Frames in flight (default from configuration)")
    check_bootloader_aware: bool = Field(True, description="After the reset, send the magic packet once more to "
                                                           "prove the new firmware can be reflashed over CAN")

    @model_validator(mode="after")
    def _one_source(self) -> _Firmware:
        if (self.hex is None) == (self.path is None):
            raise ValueError("give exactly one of `hex` (Intel HEX text) or `path` (a file in the firmware folder)")
        return self


class FlashRequest(_Firmware):
    """Flash one motor board (0–19)."""

    board: int = Field(ge=0, le=p.MAX_BOARD_ID, description="Board id: 0–9 on CAN bus 1, 10–19 on CAN bus 2")


class FlashManyRequest(_Firmware):
    """Flash several boards with one image; the two buses run in parallel."""

    boards: list[int] = Field(min_length=1, max_length=20, description="Board ids 0–19, each at most once")

    @field_validator("boards")
    @classmethod
    def _boards(cls, v: list[int]) -> list[int]:
        bad = [b for b in v if not 0 <= b <= p.MAX_BOARD_ID]
        if bad:
            raise ValueError(f"board ids must be 0–{p.MAX_BOARD_ID}, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError("each board at most once")
        return v


class FlashBoardResult(BaseModel):
    """The outcome of flashing one board (the `flash` job result, and the `flash_report` event)."""

    board: int
    bus: int
    ok: bool
    reason: str
    phase: str = Field(description="Where it ended: 'done', or the failing phase (magic, erase, write, verify, ...)")
    address: int | None = Field(None, description="Program memory address of the failure, when there is one")
    bootloader_aware: bool | None = Field(None, description="True: after its RESET the new firmware went back into "
                                          "the bootloader on the magic packet; None: not checked, or not known")
    no_answer: bool = Field(False, description="After its RESET the board answered nothing (magic packets, "
                            "READ_VERSION): it may sit in its bootloader with its answers lost, be absent, or run a "
                            "firmware that is not bootloader-aware; the image was written and verified")
    boot_area_intact: bool | None = Field(None, description="The bootloader area (0x0000-0x04BF), read before the "
                                          "erase, read back after a write that could have reached it (a reboot, "
                                          "a loss, a restart, a failure): True unchanged; False CHANGED (RESET not "
                                          "sent; the board may need an ICD programmer); None not read back")
    cancelled: bool = False
    image_first: int
    image_last: int
    bytes_written: int
    bytes_verified: int
    frames_sent: int
    frames_received: int
    retries: int
    restarts: int
    duration_s: float
    frames_per_s: float
    warnings: list[str] = Field(default_factory=list)


class FlashManyResult(BaseModel):
    results: list[FlashBoardResult]


class BootBoardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    board: int = Field(ge=0, le=p.MAX_BOARD_ID)


class BootVersionReply(BaseModel):
    board: int
    bus: int
    version: str = Field(description="The bootloader's 4 version bytes as hex (40414243)")


class BootReadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    board: int = Field(ge=0, le=p.MAX_BOARD_ID)
    address: int = Field(ge=0, le=0x3FFFFF, description="First program memory address")
    length: int = Field(ge=1, le=4096, description="Bytes to read (read 8 at a time)")


class BootReadReply(BaseModel):
    board: int
    bus: int
    address: int
    data: str = Field(description="The bytes read, as hex")


class BootResetReply(BaseModel):
    board: int
    bus: int
