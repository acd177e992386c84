"""Container healthcheck: healthy when the broker holds this node's retained status with `online: true`,
published by a process of this container (same host name, its pid alive here).

Runs inside the service's container with the service's own settings (ROBOBUS_* environment: broker URL,
credentials, topic root, node), so it proves the whole path a user depends on: the broker is up, the
service's credentials are accepted, and the node said it is online.
    python3 /app/healthcheck.py NODE        # NODE: the service name unless ROBOBUS_NODE overrides it
Exit 0 healthy, 1 not (with one line saying why)."""

from __future__ import annotations

import json
import os
import socket
import sys

from shared.rpc import RpcClient
from shared.settings import KitSettings

WAIT_S = float(os.environ.get("ROBOBUS_HEALTHCHECK_WAIT_S", "3"))


def verdict(payload: bytes | None, hostname: str) -> str:
    """'' when healthy, else why not."""
    if payload is None:
        return "no retained status on the broker"
    try:
        status = json.loads(payload)
    except ValueError:
        return "status is not JSON"
    if not isinstance(status, dict) or status.get("online") is not True:
        return f"status says offline: {status.get('reason', '') if isinstance(status, dict) else status}"
    if status.get("host") not in (None, hostname):
        return f"status is from host {status.get('host')!r}, not this container ({hostname!r})"
    pid = status.get("pid")
    if isinstance(pid, int) and not os.path.exists(f"/proc/{pid}"):
        return f"status is from pid {pid}, which is not running here (a stale retained message)"
    return ""


def main(argv: list[str]) -> int:
    settings = KitSettings()
    node = settings.node or (argv[1] if len(argv) > 1 else "")
    if not node:
        print("healthcheck: name the node (argument or ROBOBUS_NODE)")
        return 1
    topic = f"{settings.topic_root}/{node}/status"
    try:
        with RpcClient(settings, name=f"healthcheck-{node}") as c:
            msgs = c.collect(topic, WAIT_S, until=lambda t, p: True)
    except (ConnectionError, OSError) as exc:
        print(f"healthcheck: {exc}")
        return 1
    why = verdict(msgs[-1][1] if msgs else None, socket.gethostname())
    print(f"healthcheck: {node} {why or 'online'}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
