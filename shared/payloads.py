"""Model <-> bytes for everything the kit publishes: validate once, serialise once, explain errors briefly."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from shared.errors import CommandError, ErrorCode
from shared.messages import ErrorInfo
from shared.mqtt.session import reply_properties

log = logging.getLogger("robobus.node")


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """`field.path: message; ...` for the first `limit` errors: one line a person can act on."""
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{loc}: {err['msg']}")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


class Serialized(bytes):
    """A command handler's result already serialised: exactly the bytes `dump(reply_model, result)` would give.

    For a hot reply built by trusted code straight from decoded device data (dexter-gateway's command replies,
    laid out as the reply model and written by pydantic-core's `to_json`: a third of the cost of validating
    the same dict and dumping the model). The kit publishes it as it is, without validating it again, so the
    handler's own tests must prove the equality with the model's dump (and the contract tests check every
    published message against the schema)."""

    __slots__ = ()


def dump(spec_model: type[BaseModel], value: BaseModel | dict[str, Any]) -> bytes:
    """Validate (dicts) and serialise. A model instance of the right class is already valid.
    Straight to bytes with the model's own serializer (what `model_dump_json` runs, without its str round trip)."""
    if isinstance(value, spec_model):
        return value.__pydantic_serializer__.to_json(value)
    if isinstance(value, dict):
        return spec_model.__pydantic_serializer__.to_json(spec_model.model_validate(value))
    if isinstance(value, BaseModel):
        return spec_model.__pydantic_serializer__.to_json(spec_model.model_validate(value.model_dump()))
    raise TypeError(f"expected {spec_model.__name__} or dict, got {type(value).__name__}")


_CONTENT_PROPS: dict[str, Any] = {}


def content_props(content_type: str) -> Any:
    """One Properties object per content type: paho packs it at publish time and never changes it,
    and building one per message costs a few percent of CPU at 1,000 messages/s."""
    props = _CONTENT_PROPS.get(content_type)
    if props is None:
        props = _CONTENT_PROPS[content_type] = reply_properties(content_type=content_type)
    return props


def error_info(exc: BaseException, where: str) -> ErrorInfo:
    """The reply error for an exception: its own code for CommandError, `internal` (logged) for a bug."""
    if isinstance(exc, CommandError):
        return ErrorInfo(code=exc.code, message=exc.message)
    if isinstance(exc, ValidationError):
        return ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=describe_validation_error(exc))
    if isinstance(exc, TimeoutError):
        return ErrorInfo(code=ErrorCode.TIMEOUT, message=str(exc) or "timed out")
    log.exception("handler raised", extra={"where": where}, exc_info=exc)
    return ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
