"""Settings: `ROBOBUS_*` environment variables over an optional config file, validated by pydantic.

A service subclasses `KitSettings` with its own fields. `load_settings` turns a validation error
into one clear line naming the field and exits with status 2, before anything connects."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from shared.contract import NAME_RE
from shared.mqtt.address import BrokerAddress as BrokerAddress
from shared.mqtt.address import bound_client_id as bound_client_id
from shared.mqtt.address import parse_broker_url as parse_broker_url

CONFIG_ENV = "ROBOBUS_CONFIG"


class KitSettings(BaseSettings):
    """What every node needs. Environment: ROBOBUS_<FIELD>; file: ROBOBUS_CONFIG=path (.toml/.yaml/.json).

    A service's settings class names its section (`section = "roi"`: its fields are `roi_*`, its environment
    `ROBOBUS_ROI_*`); the kit then refuses every environment variable and every config or keyword key in that
    section that is not one of its settings, so a misspelt name is an error, never a default silently used.
    `unchecked_env` lists variables in the section that are not settings but are read by something else (a
    compose file's own variables)."""

    model_config = SettingsConfigDict(env_prefix="ROBOBUS_", extra="ignore", validate_default=True)
    section: ClassVar[str] = ""
    unchecked_env: ClassVar[frozenset[str]] = frozenset()

    mqtt_url: str = Field(
        "mqtt://127.0.0.1:1883", description="Broker URL: mqtt://[user:pass@]host[:port] or mqtts://..."
    )
    mqtt_username: str | None = Field(None, description="Overrides the URL's user")
    mqtt_password: str | None = Field(None, description="Overrides the URL's password")
    mqtt_tls_ca: Path | None = Field(None, description="CA bundle for mqtts:// (system CAs when unset)")
    mqtt_tls_cert: Path | None = Field(None, description="Client certificate (mutual TLS)")
    mqtt_tls_key: Path | None = Field(None, description="Client key (mutual TLS)")
    mqtt_tls_insecure: bool = Field(False, description="Skip host name checks (test brokers only)")
    mqtt_keepalive_s: int = Field(15, ge=5, le=3600)
    mqtt_reconnect_min_s: float = Field(0.1, gt=0, le=60)
    mqtt_reconnect_max_s: float = Field(2.0, gt=0, le=600, description="Cap of the reconnect backoff")
    mqtt_max_queued: int = Field(10000, ge=10, description="QoS>0 messages kept while disconnected")
    topic_root: str = Field("robobus", description="First topic level; a fleet may use site/host here")
    node: str | None = Field(None, description="Node name (topic level 2); defaults to the service name")
    health_interval_s: float = Field(5.0, gt=0, le=3600, description="Health heartbeat period")
    health_expiry_beats: int = Field(
        3, ge=0, le=1000,
        description="Retained health expires after this many heartbeats without a new one (MQTT 5 Message Expiry "
                    "Interval): a dead node's device is never read as live; 0: never expires")
    command_workers: int = Field(16, ge=1, le=256, description="Threads running command handlers")
    command_handoff_ms: float = Field(
        1.0, ge=0, le=100,
        description="How long paho's network thread waits for a command it handed to an idle worker to finish "
                    "before it reads on (the GIL stays with the handler; 0: never waits)")
    state_rates: dict[str, float] = Field(
        default_factory=dict, description="Per-state rate caps in Hz, e.g. {\"joints\": 200}"
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR")
    log_json: bool = Field(False, description="One JSON object per log line")
    switch_interval_ms: float | None = Field(
        None, gt=0, le=100,
        description="The interpreter's thread switch interval (sys.setswitchinterval), set by run_service before "
                    "the node starts; unset: Python's own (5 ms). A service whose threads hand work to one another "
                    "at high rates sets a shorter default")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        if cls.section and isinstance(data, dict):
            unknown = unknown_settings(cls, data.keys(), os.environ)
            if unknown:
                known = sorted(n for n in setting_names(cls) if n.startswith(f"{cls.section}_"))
                import difflib  # an error path: not resident in every service for it

                named = []
                for k in unknown:
                    close = difflib.get_close_matches(k.lower().removeprefix("robobus_"), known, n=1)
                    named.append(f"{k} (did you mean {close[0]}?)" if close else k)
                raise ValueError(f"unknown {cls.section} setting(s) {', '.join(named)}; known: {', '.join(known)}")
        return data

    @field_validator("topic_root")
    @classmethod
    def _root(cls, v: str) -> str:
        parts = v.split("/")
        if not v or any(not NAME_RE.match(p) for p in parts):
            raise ValueError("topic_root must be one or more '/'-separated names without wildcards")
        return v

    @field_validator("node")
    @classmethod
    def _node(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError("node must be a single topic level: letters, digits, '_', '-', '.'")
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return v

    @field_validator("mqtt_url")
    @classmethod
    def _url(cls, v: str) -> str:
        parse_broker_url(v)
        return v

    @field_validator("state_rates")
    @classmethod
    def _rates(cls, v: dict[str, float]) -> dict[str, float]:
        for k, hz in v.items():
            if hz <= 0:
                raise ValueError(f"rate for {k!r} must be > 0 Hz")
        return v

    def broker(self) -> BrokerAddress:
        b = parse_broker_url(self.mqtt_url)
        if self.mqtt_username is not None:
            b.username = self.mqtt_username
        if self.mqtt_password is not None:
            b.password = self.mqtt_password
        return b

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(CONFIG_ENV)
        if path:
            p = Path(path)
            if not p.is_file():
                raise ConfigFileError(f"{CONFIG_ENV}={path}: no such file")
            suffix = p.suffix.lower()
            if suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=p))
            elif suffix in (".yaml", ".yml"):
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=p))
            elif suffix == ".json":
                sources.append(JsonConfigSettingsSource(settings_cls, json_file=p))
            else:
                raise ConfigFileError(f"{CONFIG_ENV}={path}: use a .toml, .yaml or .json file")
        return tuple(sources)


class ConfigFileError(ValueError):
    pass


def setting_names(cls: type[KitSettings]) -> set[str]:
    """Every name a setting of `cls` is read by, lower case, without the ROBOBUS_ prefix: fields and aliases."""
    names: set[str] = set()
    for name, f in cls.model_fields.items():
        names.add(name)
        alias = f.validation_alias
        choices = getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else [])
        names.update(c.lower().removeprefix("robobus_") for c in choices if isinstance(c, str))
    return names


def unknown_settings(cls: type[KitSettings], keys: Any, environ: Any) -> list[str]:
    """The keys (keyword or config-file keys, any case, '-' or '_') and environment variables in `cls`'s section
    that name no setting of it, sorted."""
    section = cls.section.lower()
    known = setting_names(cls)
    unknown = []
    for k in keys:
        if not isinstance(k, str):
            continue
        n = k.lower().replace("-", "_").removeprefix("robobus_")
        if n.startswith(f"{section}_") and n not in known:
            unknown.append(k)
    prefix = f"ROBOBUS_{section.upper()}_"
    skip = {v.upper() for v in cls.unchecked_env}
    for k in environ:
        u = k.upper()
        if u.startswith(prefix) and u not in skip and u.removeprefix("ROBOBUS_").lower() not in known:
            unknown.append(k)
    return sorted(unknown)


S = TypeVar("S", bound=KitSettings)


def format_validation_error(exc: ValidationError, prefix: str = "ROBOBUS_") -> str:
    lines = []
    for err in exc.errors():
        if not err["loc"]:  # a check of the whole settings (unknown names, settings that contradict each other)
            lines.append(f"invalid settings: {err['msg'].removeprefix('Value error, ')}")
            continue
        field = ".".join(str(p) for p in err["loc"])
        first = str(err["loc"][0]).upper()
        # fields with an alias already carry the full variable name
        env = first if first.startswith(prefix) else prefix + first
        got = err.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
        lines.append(f"invalid setting {field} [{env}]: {err['msg']}{shown}")
    return "; ".join(lines)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build settings or stop the process with one clear message naming the field."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        print(f"robobus: {format_validation_error(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ConfigFileError, SettingsError) as exc:
        # SettingsError: a complex field (list/dict) whose environment value is not JSON
        print(f"robobus: invalid setting: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def hostname() -> str:
    return socket.gethostname()
