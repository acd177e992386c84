"""Recordings made in-process (no broker): the Recorder fed with PUBLISH packets at chosen times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.mqtt.wire import Publish
from shared.tools.bus_catalog import TopicCatalog, load_document
from shared.tools.recorder import Recorder, RecordOptions

_DOC: dict[str, Any] | None = None


def document() -> dict[str, Any]:
    global _DOC
    if _DOC is None:
        _DOC = load_document()
    return _DOC


def make_recording(path: Path, messages: list[tuple[float, Publish]], **opts: Any) -> Recorder:
    """messages: (seconds since the start, packet); written with log times from a fixed epoch."""
    opts.setdefault("document", document())
    rec = Recorder(RecordOptions(path=path, filters=("robobus/#",), broker="mqtt://test:1883", **opts),
                   TopicCatalog.from_document(document(), "robobus"))
    t0 = 1_700_000_000_000_000_000
    for t, p in messages:
        rec.write(p, t0 + int(t * 1e9))
    rec.close()
    return rec


def pub(topic: str, payload: bytes | str, *, qos: int = 1, retain: bool = False,
        props: dict[str, Any] | None = None) -> Publish:
    data = payload.encode() if isinstance(payload, str) else payload
    return Publish(topic, data, qos, retain, False, 1 if qos else 0, props)
