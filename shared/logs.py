"""Logging: one line per event, `key=value` text or one JSON object (ROBOBUS_LOG_JSON=1)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={_short(v)}" for k, v in _extras(record).items())
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extra:
            line += " " + extra
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")}


def _short(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (" " in s or not s) else s


def setup_logging(level: str = "INFO", json_format: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("paho").setLevel(logging.WARNING)
