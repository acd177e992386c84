"""TLS with a private CA, username/password, and the two log formats."""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import KitSettings, Node
from shared.logs import JsonFormatter, KeyValueFormatter
from shared.rpc import RpcClient
from tests.fixtures import free_port, mosquitto_bin
from tests.kit.echo_node import API, build


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if not (shutil.which("openssl") and shutil.which("mosquitto_passwd") and mosquitto_bin()):
        pytest.skip("needs openssl, mosquitto and mosquitto_passwd (make test installs mosquitto)")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=robobus-test-ca", cwd=tmp_path)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=tmp_path)
    (tmp_path / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=tmp_path)
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(tmp_path / "passwd"), "robot", "s3cret"], check=True,
                   capture_output=True)
    port = free_port()
    (tmp_path / "m.conf").write_text(
        "per_listener_settings false\nallow_anonymous false\n"
        f"user {getpass.getuser()}\n"  # as root, mosquitto would switch to 'mosquitto' and lose our files
        f"password_file {tmp_path}/passwd\nset_tcp_nodelay true\n"
        f"listener {port} 127.0.0.1\n"
        f"cafile {tmp_path}/ca.crt\ncertfile {tmp_path}/server.crt\nkeyfile {tmp_path}/server.key\n")
    (tmp_path / "passwd").chmod(0o600)
    proc = subprocess.Popen([str(mosquitto_bin()), "-c", str(tmp_path / "m.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        time.sleep(0.05)
    yield port, tmp_path
    proc.kill()
    proc.wait(5)


def test_tls_and_password(tls_broker: tuple[int, Path]) -> None:
    port, d = tls_broker
    s = KitSettings(mqtt_url=f"mqtts://robot:s3cret@localhost:{port}", mqtt_tls_ca=d / "ca.crt", node="tls1")
    node = Node(API, s)
    stop = build(node)
    node.start()
    try:
        assert node.session.wait_ready(10), "node did not connect over TLS with a password"
        with RpcClient(s) as c:
            assert c.call("tls1", "dev1", "echo", {"text": "secure"}).result == {"text": "secure", "count": 1}
    finally:
        stop.set()
        node.stop()


def test_wrong_password_is_refused(tls_broker: tuple[int, Path]) -> None:
    port, d = tls_broker
    s = KitSettings(mqtt_url=f"mqtts://robot:wrong@localhost:{port}", mqtt_tls_ca=d / "ca.crt")
    with pytest.raises(ConnectionError, match="refused"):
        RpcClient(s).connect(timeout=2)


def test_untrusted_server_certificate_is_refused(tls_broker: tuple[int, Path]) -> None:
    port, _ = tls_broker
    s = KitSettings(mqtt_url=f"mqtts://robot:s3cret@localhost:{port}")  # system CAs do not know our CA
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        RpcClient(s).connect(timeout=2)


def _record(**extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("robobus.test", logging.WARNING, __file__, 1, "frame lost", None, None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_log_line() -> None:
    line = JsonFormatter().format(_record(device="hand", lost=3))
    data = json.loads(line)
    assert data["msg"] == "frame lost" and data["level"] == "WARNING"
    assert data["device"] == "hand" and data["lost"] == 3
    assert "\n" not in line


def test_key_value_log_line() -> None:
    line = KeyValueFormatter().format(_record(device="hand", reason="no reply"))
    assert "WARNING" in line and "frame lost" in line and "device=hand" in line and 'reason="no reply"' in line
