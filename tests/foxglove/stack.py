"""What the Foxglove tests and bench/foxglove_bridge.py run: `make run`'s services on their simulators (as
tests/dashboard/stack.py starts them, from deploy/Procfile.sim, on free ports), `robobus foxglove` as a process of
its own on a free port, and the protocol's own client (tests/foxglove/wsclient/client.js, Node.js) driven over its
standard input and output."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from shared.tools.localbroker import REPO
from tests.dashboard.stack import SimStack, _listening, free_ports

WSCLIENT = REPO / "tests" / "foxglove" / "wsclient"


def client_missing() -> str | None:
    """None when the Node.js client can run, else why not."""
    if shutil.which("node") is None:
        return "Node.js is not installed (make setup installs it: deploy/dev/system-deps.sh)"
    if not (WSCLIENT / "node_modules" / "@foxglove" / "ws-protocol").is_dir():
        return "tests/foxglove/wsclient/node_modules is missing (make setup runs npm ci there)"
    try:
        import foxglove  # noqa: F401
    except ImportError:
        return "the Foxglove SDK is not installed (pip install -e '.[foxglove]'; make setup does)"
    return None


def start_bridge(stack: SimStack, env: dict[str, str] | None = None, name: str = "foxglove",
                 args: list[str] | None = None) -> int:
    """`robobus foxglove` as make run starts it (python -m shared.tools.foxglove), on a free port."""
    port = free_ports(1)[0]
    stack.spawn(name, ["-m", "shared.tools.foxglove", "--port", str(port), *(args or [])], env)
    assert wait_for_true(lambda: _listening(port), 30), stack.procs[name].text()
    return port


def wait_for_true(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class WsClient:
    """tests/foxglove/wsclient/client.js on ws://127.0.0.1:<port>: its events, and the calls it makes."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(["node", str(WSCLIENT / "client.js"), f"ws://127.0.0.1:{port}"], cwd=WSCLIENT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.events: list[dict[str, Any]] = []
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._next = 0
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev.get("event") in ("response", "report"):
                self._answers.put(ev)
            else:
                with self._lock:
                    self.events.append({**ev, "t": time.monotonic()})

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    def _ask(self, op: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._next += 1
        rid = self._next
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**op, "id": rid}) + "\n")
        self.proc.stdin.flush()
        end = time.monotonic() + timeout
        while True:
            try:
                ev = self._answers.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the Foxglove client did not answer {op} within {timeout} s: "
                                   f"{self.stderr[-5:]}") from None
            if ev.get("id") == rid:
                return ev

    def call(self, service: str, request: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        return self._ask({"op": "call", "service": service, "request": request}, timeout)

    def report(self) -> dict[str, Any]:
        return self._ask({"op": "report"}, 30.0)

    def seen(self, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e.get("event") == kind and e["t"] >= since]

    def services(self) -> set[str]:
        """The services advertised now (from the advertise / unadvertise events)."""
        names: set[str] = set()
        for e in self.seen("services"):
            names |= set(e["added"])
            names -= set(e["removed"])
        return names

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@contextlib.contextmanager
def ws_client(port: int) -> Iterator[WsClient]:
    c = WsClient(port)
    try:
        yield c
    finally:
        c.close()
