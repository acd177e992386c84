"""Container healthcheck: healthy when the broker holds this node's retained status with `online: true`,
published by a process of this container (same host name, its pid alive here).

Runs inside the service's container with the service's own settings (ROBOBUS_MQTT_URL, _USERNAME,
_PASSWORD, _TLS_CA, ROBOBUS_TOPIC_ROOT, ROBOBUS_NODE), so it proves the path a user depends on: the broker
is up, the service's credentials are accepted, the node said it is online. paho only (no pydantic): it
runs every few seconds, on the realtime container's own pinned CPU too, and must stay cheap.
    python3 /app/healthcheck.py NODE        # NODE: the service name unless ROBOBUS_NODE overrides it
Exit 0 healthy, 1 not (with one line saying why)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import uuid
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

WAIT_S = float(os.environ.get("ROBOBUS_HEALTHCHECK_WAIT_S", "5"))


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


def fetch_status(env: dict[str, str], topic: str) -> bytes | None:
    url = urlsplit(env.get("ROBOBUS_MQTT_URL", "mqtt://127.0.0.1:1883"))
    tls = url.scheme in ("mqtts", "ssl")
    user = env.get("ROBOBUS_MQTT_USERNAME") or (unquote(url.username) if url.username else None)
    password = env.get("ROBOBUS_MQTT_PASSWORD") or (unquote(url.password) if url.password else None)
    # the broker binds client ids to users (deploy/mosquitto/robobus_auth.c): <user>-...
    cid = f"{user + '-' if user else ''}healthcheck-{uuid.uuid4().hex[:10]}"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    if user is not None:
        client.username_pw_set(user, password)
    if tls:
        client.tls_set(ca_certs=env.get("ROBOBUS_MQTT_TLS_CA") or None)
    got: list[bytes] = []
    done = threading.Event()

    def on_connect(c: mqtt.Client, userdata: object, flags: object, rc: object, props: object = None) -> None:
        if getattr(rc, "is_failure", False):
            done.set()
            return
        c.subscribe(topic, qos=1)

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        got.append(bytes(msg.payload))
        done.set()

    client.on_connect = on_connect
    client.on_message = on_message
    client.connect(url.hostname or "127.0.0.1", url.port or (8883 if tls else 1883), keepalive=10)
    client.loop_start()
    done.wait(WAIT_S)
    client.disconnect()
    client.loop_stop()
    return got[-1] if got else None


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    node = env.get("ROBOBUS_NODE") or (argv[1] if len(argv) > 1 else "")
    if not node:
        print("healthcheck: name the node (argument or ROBOBUS_NODE)")
        return 1
    topic = f"{env.get('ROBOBUS_TOPIC_ROOT', 'robobus')}/{node}/status"
    try:
        payload = fetch_status(env, topic)
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {exc}")
        return 1
    why = verdict(payload, socket.gethostname())
    print(f"healthcheck: {node} {why or 'online'}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
