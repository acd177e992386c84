"""Small paho MQTT 5 probes for the deployment tests: connect with given credentials, publish, collect."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode


@dataclass
class Probe:
    """One MQTT 5 client; `connect()` returns the CONNACK reason code (0 = accepted)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    client_id: str = ""  # default: <username>-probe-<random> (the broker binds client ids to users)
    received: list[tuple[str, bytes, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.client_id:
            self.client_id = f"{self.username + '-' if self.username else ''}probe-{uuid.uuid4().hex[:10]}"
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        if self.username is not None:
            self.client.username_pw_set(self.username, self.password)
        self._connack = threading.Event()
        self.connack_rc: int | None = None
        self._lock = threading.Lock()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, rc: ReasonCode,
                    props: object = None) -> None:
        self.connack_rc = rc.value
        self._connack.set()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

    def connect(self, timeout: float = 15.0) -> int:
        self.client.connect(self.host, self.port, keepalive=30)
        self.client.loop_start()
        assert self._connack.wait(timeout), f"no CONNACK from {self.host}:{self.port} within {timeout} s"
        assert self.connack_rc is not None
        return self.connack_rc

    def subscribe(self, topic: str, qos: int = 1, timeout: float = 10.0) -> list[int]:
        """Subscribe and wait for the SUBACK: its reason codes (0-2 granted QoS, >= 0x80 refused)."""
        done = threading.Event()
        codes: list[int] = []

        def on_sub(client: mqtt.Client, userdata: object, mid: int, rcs: list[ReasonCode], props: object) -> None:
            codes.extend(rc.value for rc in rcs)
            done.set()

        self.client.on_subscribe = on_sub
        self.client.subscribe(topic, qos=qos)
        assert done.wait(timeout), f"no SUBACK for {topic}"
        return codes

    def publish(self, topic: str, payload: bytes, qos: int = 1, props: Properties | None = None,
                timeout: float = 10.0) -> None:
        info = self.client.publish(topic, payload, qos=qos, properties=props)
        info.wait_for_publish(timeout)

    def mark(self) -> int:
        """How many messages so far: `wait_for(..., since=mark)` looks only at later ones."""
        with self._lock:
            return len(self.received)

    def wait_for(self, pred, timeout: float, since: int = 0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if any(pred(t, p, r) for t, p, r in self.received[since:]):
                    return True
            time.sleep(0.05)
        return False

    def topics(self) -> list[str]:
        with self._lock:
            return [t for t, _, _ in self.received]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def read_env(path) -> dict[str, str]:
    text = Path(path).read_text()
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def creds(secrets_dir, user: str) -> tuple[str, str]:
    env = read_env(f"{secrets_dir}/{user}.env")
    return env["ROBOBUS_MQTT_USERNAME"], env["ROBOBUS_MQTT_PASSWORD"]


def start_host_broker(exe: str, conf: Path, port: int, secrets_dir: Path) -> subprocess.Popen[bytes]:
    """A host mosquitto on `conf`, returned once its plain listener on `port` accepts the viewer."""
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            p = Probe("127.0.0.1", port, *creds(secrets_dir, "viewer"))
            if p.connect() == 0:
                p.close()
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"mosquitto did not start: {proc.stdout.read().decode(errors='replace') if proc.stdout else ''}")
