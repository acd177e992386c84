"""Every command payload of every registered service refuses unknown keys: a typo in an optional key (`j6deg` for
`j6_deg`) is `invalid_request` naming it, never dropped while the device moves without it. Checked over the whole
registry, in the models (every model a request is made of) and in the contract the other languages read
(`additionalProperties: false`)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.registry import service_apis
from shared.tools.asyncapi import build_document


def _models(annotation: Any, out: set[type[BaseModel]]) -> set[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel) and annotation not in out:
        out.add(annotation)
        for f in annotation.model_fields.values():
            _models(f.annotation, out)
    for arg in typing.get_args(annotation):
        _models(arg, out)
    return out


REQUESTS = sorted({(api.service, spec.name, spec.request) for api in service_apis()
                   for spec in [*api.commands.values(), *api.jobs.values()]}, key=lambda t: (t[0], t[1]))


@pytest.mark.parametrize(("service", "command", "request_model"), REQUESTS,
                         ids=[f"{s}/{c}" for s, c, _ in REQUESTS])
def test_every_request_model_forbids_unknown_keys(service: str, command: str,
                                                  request_model: type[BaseModel]) -> None:
    lax = sorted(m.__name__ for m in _models(request_model, set()) if m.model_config.get("extra") != "forbid")
    assert not lax, f"{service} {command}: {lax} accept unknown keys (model_config = ConfigDict(extra='forbid'))"


def test_an_unknown_key_is_named_in_the_error() -> None:
    from services.dexter_gateway.models import DexterMoveAllJoints

    with pytest.raises(ValidationError, match="j6deg"):
        DexterMoveAllJoints.model_validate_json(b'{"joints_deg": [0, 0, 0, 0, 0], "j6deg": 10}')


def test_the_contract_says_so() -> None:
    doc = build_document()
    schemas = doc["components"]["schemas"]
    names = {m.__name__ for _, _, r in REQUESTS for m in _models(r, set())}
    for name in sorted(names):
        schema = schemas.get(name)
        assert schema is not None, name
        if schema.get("type") == "object":
            assert schema.get("additionalProperties") is False, (name, schema)
