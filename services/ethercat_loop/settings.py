"""ethercat-loop's settings: ROBOBUS_ETHERCAT_* in the environment (or keys of a ROBOBUS_CONFIG file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, Field, field_validator

from services.ethercat_loop.control import SetPolling
from shared.link import LinkPolicy
from shared.settings import KitSettings
from shared.transports import check_transport


class EthercatSettings(KitSettings):
    """ethercat-loop settings: ROBOBUS_ETHERCAT_* in the environment (or keys of ROBOBUS_CONFIG)."""

    section: ClassVar[str] = "ethercat"  # any other ROBOBUS_ETHERCAT_* is refused (docs/kit.md, "Settings")
    # deploy/compose.yaml's own variables (the container's cpuset, the realtime budget): read by compose, not here
    unchecked_env: ClassVar[frozenset[str]] = frozenset({"ROBOBUS_ETHERCAT_CPUSET", "ROBOBUS_ETHERCAT_RT_RUNTIME_US"})

    backend: str = Field(
        "model", validation_alias=AliasChoices("robobus_ethercat_backend", "ethercat_backend", "backend"),
        description="The transport, by its name in the entry points `robobus.transports` (ethercat-loop.<name>; "
                    "docs/kit.md, \"Transports\"): model: driver + palm model in-process; virtual: pysoem against "
                    "the virtual EtherCAT hand; nic: pysoem on a real NIC (ROBOBUS_ETHERCAT_BACKEND)")
    ethercat_protocol: Literal["0220", "0230"] = Field("0220", description="Palm protocol (model backend; the "
                                                       "wire backends take it from the product code)")
    ethercat_ifname: str = Field("", description="Network interface of the EtherCAT segment (virtual/nic)")
    ethercat_device: str = Field("rh", description="Device name on the bus (topic level 3)")
    ethercat_period_us: int = Field(1000, ge=100, le=100_000, description="Cycle period")
    ethercat_calibration: Path | None = Field(None, description="Calibration YAML (default: the shipped "
                                                                "example right hand)")
    ethercat_polling: dict[str, float] = Field(default_factory=dict, description="motor_data_polling overrides, "
                                               "e.g. {\"temperature\": 0.5}")
    ethercat_demand_timeout_ms: float = Field(100.0, ge=5, le=10_000, description="Deadman: a demand older "
                                              "than this is replaced by zero")
    ethercat_control_mode: Literal["torque", "pwm"] = Field("pwm", description="Control mode at start "
                                                            "(PWM, like sr_edc.launch)")
    ethercat_tactile_data_type: int = Field(0, ge=0, le=0xFFFFFFFF, description="tactile_data_type requested")
    ethercat_push_config_on_start: bool = Field(True, description="Send the default motor config at start")
    ethercat_drop_threshold: int = Field(10, ge=0, description="Dropped statuses (empty palm mailbox) per 1 s "
                                         "window above which health reports an error")
    ethercat_lost_threshold: int = Field(10, ge=0, description="Lost frames (no reply, or a wrong working "
                                         "counter) per 1 s window above which health reports an error; a "
                                         "single lost frame never does")
    ethercat_loss_sustain_s: float = Field(3.0, ge=0, description="Counts over their thresholds (lost frames, "
                                           "overruns, dropped statuses) are a warning until they have lasted this "
                                           "long, then an error (a burst from one scheduling stall never is)")
    ethercat_error_after_lost: int = Field(20, ge=1, description="Consecutive cycles without a valid status "
                                           "after which health reports an error (the motors cut out at 20 ms)")
    ethercat_overrun_threshold: int | None = Field(
        None, ge=0, description="Overruns per 1 s window above which health reports an error (default 10; 250 "
                                "for the model backend, whose thread shares the GIL with MQTT and is no realtime path)")
    ethercat_silent_motor_ms: int = Field(500, ge=10, description="A motor unseen this long is reported")
    ethercat_serial: int = Field(1234, description="Serial the palm model reports")
    ethercat_can_nodes: list[str] = Field(
        default_factory=list, description="Model backend: CAN peers to plug into the palm model's buses, as "
        "'module:factory'; factory(model) returns a CanNode or a list of them (e.g. PIC18F bootloader boards)")

    # -- the wire backends (virtual / nic) --
    ethercat_netns: str = Field("", description="Network namespace holding the NIC (the virtual hand's "
                                "namespace from `make ethercat-vhand`); empty: the host's")
    ethercat_rt_priority: int = Field(80, ge=0, le=99, description="SCHED_FIFO priority of the cycle process "
                                      "(0: normal scheduling)")
    ethercat_cpus: list[int] = Field(default_factory=list, description="CPU affinity of the cycle process")
    ethercat_mqtt_rt_priority: int = Field(0, ge=0, le=99, description="SCHED_FIFO priority of the MQTT process "
                                           "(every thread), below the cycle's: its receive path then waits for "
                                           "no ordinary process on a busy host (0: normal scheduling)")
    ethercat_lock_memory: bool = Field(True, description="mlockall in the cycle process")
    ethercat_recv_timeout_us: int = Field(500, ge=50, le=100_000, description="Receive timeout per frame, "
                                          "well under the period")
    ethercat_late_us: int = Field(300, ge=10, description="A reply later than this counts as a late frame")
    ethercat_program_sms: Literal["auto", "always", "never"] = Field(
        "auto", description="Program the 4 mailbox SMs + 2 FMMUs when the palm's SII lacks them")
    ethercat_snapshot_hz: float = Field(10.0, gt=0, le=1000, description="Full driver snapshots per second "
                                        "(motors, counters); joints and sensors come from every status")
    ethercat_state_check_ms: int = Field(250, ge=1, description="Period of the AL state check (a backstop: a "
                                         "palm leaving OP already shows as a working-counter drop)")
    ethercat_restart_backoff_ms: int = Field(200, ge=0, description="Wait before starting a cycle process again "
                                             "after one died; doubled for each restart without a good run since")
    ethercat_restart_backoff_max_ms: int = Field(10_000, ge=0, description="Cap of that wait")
    ethercat_restart_good_run_s: float = Field(30.0, ge=0, description="A cycle process that ran this long in OP "
                                               "before it died had a good run: the backoff starts over")
    # -- the link supervisor (docs/kit.md, "Health"; README "Liveness budget") --
    ethercat_liveness_s: float = Field(
        0.25, gt=0, le=60, description="Valid process data must reach the service within this, or the palm is "
        "`silent` (link open) / `unreachable` (never heard from): the motors stop 20 ms after their last demand "
        "(reference §1.8) and the cycle counts 20 cycles without a status as an outage; the service reads the "
        "cycle's status count every 10 ms and its process every 50 ms, and this leaves room for a stall of the "
        "(non-realtime) service process")
    ethercat_backoff_min_s: float = Field(0.2, gt=0, description="First wait before bringing the bus up again "
                                          "after a failed attempt or a lost bus; doubled per failure")
    ethercat_backoff_max_s: float = Field(5.0, gt=0, description="Cap of that wait")
    ethercat_probe_period_s: float = Field(5.0, gt=0, description="A palm unreachable for longer than the "
                                           "liveness budget is probed (a cycle process that scans the bus) once "
                                           "per this period")
    ethercat_expect_protocol: Literal["", "0220", "0230"] = Field(
        "", description="Wire backends: the palm protocol this hand must speak (its product code); another is "
                        "the wrong kind of device (health error, not driven). Empty: any Shadow palm")
    ethercat_virtual_args: list[str] = Field(default_factory=list, description="Extra virtual_hand options "
                                             "when the virtual backend starts its own hand")

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return check_transport("ethercat-loop", v)  # an unknown name lists the registered ones

    @field_validator("ethercat_polling")
    @classmethod
    def _polling(cls, v: dict[str, float]) -> dict[str, float]:
        err = SetPolling(v).validate("pwm")
        if err:
            raise ValueError(err)
        return v


def link_policy(settings: EthercatSettings) -> LinkPolicy:
    """The palm's link policy for the kit's supervisor (shared/link.py)."""
    s = settings
    return LinkPolicy(liveness_s=s.ethercat_liveness_s, backoff_min_s=s.ethercat_backoff_min_s,
                      backoff_max_s=max(s.ethercat_backoff_min_s, s.ethercat_backoff_max_s),
                      probe_period_s=s.ethercat_probe_period_s)


def overrun_threshold(settings: EthercatSettings) -> int:
    if settings.ethercat_overrun_threshold is not None:
        return settings.ethercat_overrun_threshold
    return 250 if settings.backend == "model" else 10
