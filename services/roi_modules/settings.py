"""roi-modules' settings: ROBOBUS_ROI_* in the environment (nested values as JSON), or keys of a ROBOBUS_CONFIG
file."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from services.roi_modules.link import check_prefix
from services.roi_modules.models import RoiModuleConfig
from shared.node import NODE_DEVICE
from shared.settings import KitSettings
from shared.transports import check_transport

__all__ = ["RoiSettings"]


class RoiSettings(KitSettings):
    """ROBOBUS_ROI_* (see the service README)."""

    # §5.5: the launch file set `network-address`/`octet`, the code read other names, nobody noticed: the kit refuses
    # every ROBOBUS_ROI_* variable and roi_* key that is not a setting (docs/kit.md, "Settings")
    section: ClassVar[str] = "roi"
    # the kit's, with this service's default: a command hops paho's thread -> the command pool -> the loop and back;
    # each hop waits for the GIL, which a busy thread keeps up to the switch interval (5 ms by default)
    switch_interval_ms: float | None = Field(1.0, gt=0, le=100, description="The interpreter's thread switch "
                                             "interval (docs/kit.md, \"Settings\")")

    roi_transport: str = Field(
        "udp", description="The transport, by its name in the entry points `robobus.transports` (roi-modules.<name>; "
                           "docs/kit.md, \"Transports\"): udp: the ROI network's UDP ports on this host")
    roi_network: str = Field("192.168.2", description="First three octets of the ROI network (firmware: 192.168.2)")
    roi_host_octet: int = Field(100, ge=1, le=254, description="This host's octet; both ports are bound there")
    roi_modules: list[RoiModuleConfig] = Field(min_length=1, description="The modules: name, octet, type, options")
    roi_timeout_s: float = Field(0.05, gt=0, le=10, description="Resend a request unanswered for this long")
    roi_max_retries: int = Field(10, ge=0, le=100, description="Resends before a request is abandoned (lost)")
    roi_maintain_period_s: float = Field(0.1, gt=0, le=0.4,
                                         description="Poll period; under the modules' 500 ms watchdog")
    roi_liveness_s: float | None = Field(
        None, gt=0, le=60, description="Liveness budget: a module with no valid reply for this long is silent or "
                                       "unreachable (connection false). Default: 1 s (two module watchdog periods, "
                                       "ten polls), or one whole resend ladder plus a poll period if that is longer")
    roi_probe_period_s: float = Field(1.0, gt=0, le=60,
                                      description="A module that does not answer: one STATUS_REPORT probe per period")
    roi_status_every: int = Field(128, ge=1, le=100000, description="STATUS_REPORT every n maintain ticks")
    roi_gpio_reads_per_tick: int = Field(4, ge=1, le=16, description="GPIO pins read per tick (round robin)")
    roi_odrive_tolerance: float = Field(0.05, gt=0, description="Jobs: ODrive done within this many rev")
    roi_actuator_tolerance: float = Field(0.5, gt=0, description="Jobs: actuator done within this many %")

    @field_validator("roi_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        return check_transport("roi-modules", v)  # an unknown name lists the registered ones

    @field_validator("roi_network")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return check_prefix(v)

    @property
    def ladder_s(self) -> float:
        """How long one request may go unanswered before it is abandoned: every send, timeout_s apart."""
        return self.roi_timeout_s * (self.roi_max_retries + 1)

    def liveness_s(self, module: RoiModuleConfig) -> float:
        """The module's liveness budget (README, "Health"). Reference docs/reference/roi.md §3.8/§4.4/§5.4: a module
        answers a
        poll every 100 ms; its own watchdog gives up on the host after 500 ms; one request is abandoned after
        11 sends 50 ms apart (0.55 s). 1 s is two module watchdog periods (ten polls) and holds one fully lost
        request plus the next poll; the 12.8 s status period is no liveness signal (the polls are)."""
        if module.liveness_s is not None:
            return module.liveness_s
        if self.roi_liveness_s is not None:
            return self.roi_liveness_s
        return max(1.0, self.ladder_s + self.roi_maintain_period_s)

    @model_validator(mode="after")
    def _modules(self) -> RoiSettings:
        names = [m.name for m in self.roi_modules]
        if NODE_DEVICE in names:
            raise ValueError(f"{NODE_DEVICE!r} is reserved for the node's own state")
        if len(set(names)) != len(names):
            raise ValueError(f"module names must be unique, got {names}")
        seen: dict[int, list[RoiModuleConfig]] = {}
        for m in self.roi_modules:
            budget = self.liveness_s(m)
            if budget < self.ladder_s + self.roi_maintain_period_s:
                raise ValueError(f"module {m.name!r}: liveness budget {budget:g} s is shorter than one request's "
                                 f"resend ladder ({self.roi_max_retries + 1} x {self.roi_timeout_s:g} s) plus a "
                                 f"maintain period ({self.roi_maintain_period_s:g} s): one lost request would "
                                 "make an answering module silent")
            if m.octet == self.roi_host_octet:
                raise ValueError(f"module {m.name!r} has octet {m.octet}, this host's own (roi_host_octet)")
            if m.type == "odrive" and m.channel != 0:
                raise ValueError(f"module {m.name!r}: an ODrive module has one ODrive, channel 0")
            seen.setdefault(m.octet, []).append(m)
        for octet, ms in seen.items():
            # one module per octet; only the two channels of one actuator module may share it
            if len(ms) > 1 and not (all(m.type == "actuator" for m in ms) and len({m.channel for m in ms}) == len(ms)):
                raise ValueError(f"octet {octet} is given to {[m.name for m in ms]}")
        return self
