"""dexter-gateway's settings: ROBOBUS_DEXTER_* in the environment (nested values as JSON), or keys of a
ROBOBUS_CONFIG file."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from services.dexter_gateway import protocol as p
from services.dexter_gateway.models import DexterArmConfig
from shared.settings import KitSettings
from shared.transports import check_transport

__all__ = ["DexterSettings"]


class DexterSettings(KitSettings):
    """dexter-gateway configuration. Example: ROBOBUS_DEXTER_ARMS='[{"id": "dexter1", "host": "192.168.1.142"}]'."""

    section: ClassVar[str] = "dexter"  # any other ROBOBUS_DEXTER_* is refused (docs/kit.md, "Settings")

    dexter_transport: str = Field(
        "tcp", description="The transport, by its name in the entry points `robobus.transports` (dexter-gateway."
                           "<name>; docs/kit.md, \"Transports\"): tcp: DexRun's TCP socket at each arm's host:port")
    dexter_arms: list[DexterArmConfig] = Field(
        default_factory=lambda: [DexterArmConfig(id="dexter1", host="127.0.0.1")],
        description="The arms: [{id, host, port, firmware, reply_timeout_s, keepalive_s, ...}]")
    dexter_status_hz: float = Field(10.0, ge=0, le=200, description="Status publish rate; 0 = only with commands")
    dexter_shell_enabled: bool = Field(False, description="Allow the backtick shell target of `r` at all")
    dexter_shell_allowlist: list[str] = Field(default_factory=list,
                                              description="Exact shell command lines that may run when enabled")
    dexter_servo_deg_per_unit: float = Field(p.XL320_DEG_PER_UNIT, gt=0, description="0.29 (XL-320), 360/4096 "
                                             "(XL-430)")
    dexter_j6_zero_units: int = Field(p.J6_ZERO_UNITS, description="J6 zero in Dynamixel units")

    @field_validator("dexter_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        return check_transport("dexter-gateway", v)  # an unknown name lists the registered ones
