"""The e-puck camera (a binary state with an image Content Type) as Foxglove's well-known `foxglove.CompressedImage`,
JSON-encoded (the bytes base64, as Foxglove reads a JSON `bytes` field), so that Foxglove's Image panel draws it.
Pure: no SDK import (a recording tool may use it too)."""

from __future__ import annotations

import base64
import json
from typing import Any

SCHEMA_NAME = "foxglove.CompressedImage"

# Foxglove's own JSON Schema of foxglove.CompressedImage (the fields, names and types Foxglove's panels read).
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA_NAME,
    "description": "A compressed image",
    "type": "object",
    "properties": {
        "timestamp": {
            "type": "object", "title": "time", "description": "Timestamp of image",
            "properties": {"sec": {"type": "integer", "minimum": 0},
                           "nsec": {"type": "integer", "minimum": 0, "maximum": 999_999_999}},
            "required": ["sec", "nsec"],
        },
        "frame_id": {"type": "string", "description": "Frame of reference for the image"},
        "data": {"type": "string", "contentEncoding": "base64", "description": "Compressed image data"},
        "format": {"type": "string", "description": "Image format: jpeg, png, webp or avif"},
    },
    "required": ["timestamp", "frame_id", "data", "format"],
}
SCHEMA_BYTES = json.dumps(SCHEMA, sort_keys=True).encode()


def image_format(content_type: str) -> str | None:
    """`image/jpeg` -> `jpeg`; None for a content type that is no image."""
    kind, _, sub = content_type.partition("/")
    if kind != "image" or not sub:
        return None
    return sub.split(";", 1)[0].strip().lower()


def compressed_image(data: bytes, stamp_ns: int, frame_id: str, fmt: str) -> bytes:
    """One foxglove.CompressedImage message, JSON bytes; `stamp_ns` (ns since the Unix epoch) is its timestamp."""
    sec, nsec = divmod(stamp_ns, 1_000_000_000)
    return json.dumps({"timestamp": {"sec": sec, "nsec": nsec}, "frame_id": frame_id,
                       "data": base64.b64encode(data).decode("ascii"), "format": fmt},
                      separators=(",", ":")).encode()
