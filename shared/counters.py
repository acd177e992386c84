"""The node's counters, published as `_node/state/stats`: commands by outcome, publishes, decode errors."""

from __future__ import annotations

import threading


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.commands_ok = 0
        self.commands_failed: dict[str, int] = {}
        self.published = 0
        self.decode_errors = 0

    def ok(self) -> None:
        with self._lock:
            self.commands_ok += 1

    def failed(self, code: str) -> None:
        with self._lock:
            self.commands_failed[code] = self.commands_failed.get(code, 0) + 1

    def sent(self) -> None:
        with self._lock:
            self.published += 1

    def decode_error(self) -> None:
        with self._lock:
            self.decode_errors += 1

    def failed_by_code(self) -> dict[str, int]:
        with self._lock:
            return dict(self.commands_failed)
