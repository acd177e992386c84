"""Where the broker is and who we are to it: the broker URL, the client id a broker that binds ids to users
accepts, and the settings a connection reads (`ClientSettings`: the kit's KitSettings is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel


class BrokerAddress(BaseModel):
    scheme: str
    host: str
    port: int
    username: str | None
    password: str | None

    @property
    def tls(self) -> bool:
        return self.scheme in ("mqtts", "ssl")


def parse_broker_url(url: str) -> BrokerAddress:
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in ("mqtt", "tcp", "mqtts", "ssl"):
        raise ValueError(f"unsupported broker scheme {parts.scheme!r} (use mqtt:// or mqtts://)")
    if not parts.hostname:
        raise ValueError("broker URL has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"broker URL port: {exc}") from None
    tls = parts.scheme in ("mqtts", "ssl")
    return BrokerAddress(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port or (8883 if tls else 1883),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


def bound_client_id(username: str | None, client_id: str) -> str:
    """The client id a broker that binds ids to users accepts (deploy/mosquitto/robobus_auth.c): the user's
    name, or `<user>-...`. An id that is not already so gets the user's name in front; without a user, as is."""
    if not username or client_id == username or client_id.startswith(f"{username}-"):
        return client_id
    return f"{username}-{client_id}"


class ClientSettings(Protocol):
    """What a connection reads of its settings (the kit's KitSettings has all of it)."""

    @property
    def mqtt_tls_ca(self) -> Path | None: ...
    @property
    def mqtt_tls_cert(self) -> Path | None: ...
    @property
    def mqtt_tls_key(self) -> Path | None: ...
    @property
    def mqtt_tls_insecure(self) -> bool: ...
    @property
    def mqtt_keepalive_s(self) -> int: ...
    @property
    def mqtt_reconnect_min_s(self) -> float: ...
    @property
    def mqtt_reconnect_max_s(self) -> float: ...
    @property
    def mqtt_max_queued(self) -> int: ...

    def broker(self) -> BrokerAddress: ...
