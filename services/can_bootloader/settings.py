"""can-bootloader's settings: ROBOBUS_CAN_* in the environment (nested values as JSON), or keys of a
ROBOBUS_CONFIG file."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from services.can_bootloader.flasher import FlashConfig
from services.can_bootloader.transport import CanBusConfig
from shared import KitSettings
from shared.transports import check_transport

BRIDGE_INTERFACE = "robobus_bridge"
SIM_TRANSPORT = "sim"  # the in-process demo boards: entry point `robobus.transports` can-bootloader.sim


def _default_bus(n: int) -> CanBusConfig:
    return CanBusConfig(interface="virtual", channel=f"robobus-can{n}")


class CanBootSettings(KitSettings):
    """can-bootloader configuration: ROBOBUS_CAN_* in the environment (nested values as JSON), or keys of a
    ROBOBUS_CONFIG file. Example: ROBOBUS_CAN_BUS1='{"interface": "socketcan", "channel": "can0"}'."""

    section: ClassVar[str] = "can"  # any other ROBOBUS_CAN_* is refused (docs/kit.md, "Settings")

    can_device: str = Field("motors", description="Device name on MQTT")
    can_bus1: CanBusConfig | None = Field(default_factory=lambda: _default_bus(1),
                                          description="Palm CAN bus 1 (boards 0–9); null: not served")
    can_bus2: CanBusConfig | None = Field(default_factory=lambda: _default_bus(2),
                                          description="Palm CAN bus 2 (boards 10–19); null: not served")
    can_firmware_dir: Path | None = Field(None, description="The only folder `path` requests may read from")
    can_window: int | None = Field(None, ge=1, le=64, description="Frames in flight; default 12 through the palm "
                                                                  "bridge (it paces 1 frame/ms), 2 on a direct bus "
                                                                  "(the PIC's two receive buffers)")
    can_flash: FlashConfig = Field(default_factory=FlashConfig, description="Flasher timeouts and retries (the "
                                   "window comes from can_window, check_bootloader_aware from each request)")
    # the link (docs/kit.md, "Health"): the adapter is the link, boards answer only in their bootloader and only
    # when asked. Budget: the bootloader's longest single answer is RESET's (1000 ms, docs/reference/can_bootloader.md
    # §4.2; a frame's is 100 ms); the adapter is checked every budget/4 between exchanges and on every receive
    # turn (<= 20 ms) during one, so 1 s tells a dead adapter no later than the protocol would tell a dead board.
    can_liveness_s: float = Field(1.0, gt=0, description="Liveness budget: the adapter must prove healthy "
                                  "(a clean read, no error state; through the palm: ethercat-loop online) within "
                                  "this, or the device is silent / lost / unreachable")
    can_backoff_min_s: float = Field(0.2, gt=0, description="First wait before reopening a bus that failed")
    can_backoff_max_s: float = Field(5.0, gt=0, description="Cap of the doubling waits between reopen attempts")
    can_probe_period_s: float = Field(5.0, gt=0, description="An unreachable bus (never opened within the "
                                      "budget): one open attempt per period")
    can_sim: bool = Field(False, description="Run simulated boards on in-process virtual buses (make run, demos): "
                          "the transport can-bootloader.sim (docs/kit.md, \"Transports\")")
    can_sim_boards: list[int] = Field(default_factory=lambda: list(range(20)))
    can_sim_erase_s: float = Field(0.968, ge=0, description="Simulated erase time (484 rows x 2 ms)")
    can_sim_row_write_s: float = Field(0.002, ge=0)

    @model_validator(mode="after")
    def _sim_registered(self) -> CanBootSettings:
        if self.can_sim:
            check_transport("can-bootloader", SIM_TRANSPORT)
        return self

    @model_validator(mode="after")
    def _one_place_each(self) -> CanBootSettings:
        # FlashConfig is the flasher's one definition; these two of its fields have their own settings
        twice = sorted({"window", "check_bootloader_aware"} & self.can_flash.model_fields_set)
        if twice:
            raise ValueError(f"can_flash: {', '.join(twice)} is not set here (the window is can_window; "
                             "check_bootloader_aware is a field of each flash request)")
        return self


BRIDGE_WINDOW = 12  # the bridge round trip is ~4 palm cycles on a quiet host, more on a loaded one
DIRECT_WINDOW = 2  # the PIC's two receive buffers


def default_window(bus: CanBusConfig) -> int:
    return BRIDGE_WINDOW if bus.interface == BRIDGE_INTERFACE else DIRECT_WINDOW
