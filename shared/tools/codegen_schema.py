"""Component schemas that code generators for other languages turn into clean, named types.

Model generators for other languages (the AsyncAPI project's Modelina, quicktype, ...) name a type
after its schema's `title`; a schema without one becomes `AnonymousSchema_<n>`, numbered by where it
falls in the document, so the name changes whenever the document grows. pydantic titles each model
after its class, but gives inline enums, unions and objects only the field's name ("Mode", "Error"),
which is neither unique across models nor stable as a type name.

`name_inline_schemas` rewrites the hoisted component schemas in place so that:
- every component is titled with its component key;
- every inline schema that becomes a type of its own (an enum, an object with properties, a union)
  is titled `<Model><Field>` (`<...>Item` for array items, `<...>Value` for map values,
  `<...>Option<i>` for union branches), derived only from model and field names, so it is stable;
- `X | None` fields (pydantic's `anyOf: [X, {type: null}]`) with an inline X become
  `{type: [x, "null"], ...}`, the nullable form generators map to `Integer` / `number | null` /
  `*int`; a union of a primitive and null would otherwise be a nameless union type in Java and Go.
  The accepted values are the same, so validation of published messages does not change.
- a `number` field whose default is a whole number other than 0 (`timeout_s: float = 2.0`) gives its default
  in its description instead (`Default: 2.`): JSON has no 2.0 apart from 2, and Modelina's default Java output writes
  `Double timeoutS = 2;`, which javac rejects. The service applies the default to a request without it.
- an object with no properties that says nothing of others (`class Empty(BaseModel): pass`) gets
  `additionalProperties: false`: "send {}". Modelina's Java makes a map of it otherwise, which is no type of
  its own (and then the message payload has no name).
Primitive fields keep pydantic's title: generators inline them, and form builders use it as a label.
"""

from __future__ import annotations

import re
from typing import Any

_NULL = {"type": "null"}
_UNIONS = ("anyOf", "oneOf", "allOf")


def pascal(name: str) -> str:
    """`set_speed` -> `SetSpeed`, `epuck-gateway` -> `EpuckGateway`, `imageInfo` -> `ImageInfo`."""
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"[^A-Za-z0-9]+", name) if p)


def name_inline_schemas(schemas: dict[str, Any]) -> dict[str, Any]:
    """Title every component and every inline schema that a generator makes a type of; see the module
    docstring. Raises ValueError when two different schemas would get the same name."""
    owners: dict[str, str] = {name: name for name in schemas}  # name -> where it is used
    for name, schema in schemas.items():
        schema["title"] = name
        _walk(schema, name, f"{name}", owners, top=True)
    return schemas


def _makes_a_type(node: dict[str, Any]) -> bool:
    """Whether generators emit a type of its own for this inline schema (rather than inlining it)."""
    if "$ref" in node:
        return False
    if "enum" in node or any(k in node for k in _UNIONS):
        return True
    return bool(node.get("properties"))


def _merge_nullable(node: dict[str, Any]) -> None:
    """`anyOf: [X, {type: null}]` with an inline, single-typed X -> X with `type: [x, "null"]`."""
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or len(branches) != 2 or _NULL not in branches:
            continue
        other = branches[0] if branches[1] == _NULL else branches[1]
        if "$ref" in other or not isinstance(other.get("type"), str) or other["type"] == "null":
            return
        if "enum" in other or "const" in other:
            return  # null would have to join the enum; keep the (named) union
        del node[key]
        for k, v in other.items():
            if k != "title":
                node.setdefault(k, v)
        node["type"] = [other["type"], "null"]
        return


def _claim(title: str, where: str, owners: dict[str, str]) -> None:
    prev = owners.get(title)
    if prev is not None and prev != where:
        raise ValueError(f"schema name {title!r} would be used twice ({prev} and {where}); rename a model or field")
    owners[title] = where


def _whole_number_default(node: dict[str, Any]) -> None:
    """A `number` schema's whole-number default -> its description (see the module docstring)."""
    types = node.get("type")
    if "number" not in (types if isinstance(types, list) else [types]):
        return
    dflt = node.get("default")
    if isinstance(dflt, bool) or not isinstance(dflt, int | float) or dflt != int(dflt) or dflt == 0:
        return  # a fraction is written as one; Modelina writes no default of 0 (it tests the default's truth)
    del node["default"]
    text = f"Default: {int(dflt)}."
    node["description"] = f"{node['description'].rstrip('.')}. {text}" if node.get("description") else text


def _empty_object(node: dict[str, Any]) -> None:
    if node.get("type") == "object" and not node.get("properties") and "additionalProperties" not in node \
            and "patternProperties" not in node:
        node["additionalProperties"] = False


def _walk(node: Any, base: str, path: str, owners: dict[str, str], *, top: bool = False) -> None:
    """`base` is the name this schema gets if it makes a type; `path` where it is (for errors)."""
    if not isinstance(node, dict):
        return
    _merge_nullable(node)
    _whole_number_default(node)
    _empty_object(node)
    if not top and _makes_a_type(node):
        _claim(base, path, owners)
        node["title"] = base
    for field, sub in (node.get("properties") or {}).items():
        _walk(sub, base + pascal(field), f"{path}.{field}", owners)
    for key in _UNIONS:
        branches = node.get(key)
        if isinstance(branches, list):
            for i, sub in enumerate(branches):
                _walk(sub, f"{base}Option{i}", f"{path}.{key}[{i}]", owners)
    items = node.get("items")
    if isinstance(items, dict):
        _walk(items, base + "Item", f"{path}[]", owners)
    for i, sub in enumerate(node.get("prefixItems") or []):
        _walk(sub, f"{base}Item{i}", f"{path}[{i}]", owners)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        _walk(extra, base + "Value", f"{path}{{}}", owners)
