"""The optional TLS listener (deploy/mosquitto/tls.conf) on a real mosquitto, with the compose broker's own
config and a throwaway CA: a client that trusts the CA connects over TLS with its password; without the CA
(system trust store only) the handshake is refused; TLS does not replace the password."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.certs import make_certs
from tests.deploy.deployfiles import DEPLOY, host_broker_conf, make_secrets
from tests.deploy.mqttprobe import Probe, creds, start_host_broker
from tests.fixtures import free_port, mosquitto_bin


def tls_listener_conf(certs: Path, port: int) -> str:
    """deploy/mosquitto/tls.conf as shipped, with the certificate folder and a free loopback port."""
    conf = (DEPLOY / "mosquitto" / "tls.conf").read_text().replace("/mosquitto/certs/", f"{certs}/")
    assert "listener 8883 0.0.0.0" in conf
    return conf.replace("listener 8883 0.0.0.0", f"listener {port} 127.0.0.1")


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    d = tmp_path_factory.mktemp("tls-secrets")
    assert make_secrets.main(["--dir", str(d), "--root", "robobus"]) == 0
    certs = make_certs(d / "certs")
    plain, tls = free_port(), free_port()
    conf = d / "mosquitto.conf"
    conf.write_text(host_broker_conf(d, plain, "\n" + tls_listener_conf(certs, tls)))
    proc = start_host_broker(exe, conf, plain, d)
    yield tls, d
    proc.terminate()
    proc.wait(5)


def tls_probe(port: int, d: Path, user: str | None, ca: Path | None) -> Probe:
    p = Probe("localhost", port, *(creds(d, user) if user else (None, None)))
    p.client.tls_set(ca_certs=str(ca) if ca else None)  # None: the system trust store only
    return p


def test_a_client_trusting_the_ca_connects_over_tls_with_its_password(tls_broker):
    port, d = tls_broker
    p = tls_probe(port, d, "operator", d / "certs" / "ca.crt")
    assert p.connect() == 0
    # it is a TLS session, and the ACL still applies: the operator reads a node's status over it
    assert isinstance(p.client.socket(), ssl.SSLSocket)
    assert p.subscribe("robobus/+/status") == [1]
    p.close()


def test_a_client_without_the_ca_is_refused(tls_broker):
    port, d = tls_broker
    p = tls_probe(port, d, "operator", None)
    with pytest.raises(ssl.SSLCertVerificationError):
        p.connect()


def test_tls_does_not_replace_the_password(tls_broker):
    port, d = tls_broker
    anon = tls_probe(port, d, None, d / "certs" / "ca.crt")
    assert anon.connect() != 0  # not authorized
    anon.close()
    bad = Probe("localhost", port, "operator", "wrong")
    bad.client.tls_set(ca_certs=str(d / "certs" / "ca.crt"))
    assert bad.connect() != 0
    bad.close()


def test_a_plain_client_on_the_tls_port_gets_no_session(tls_broker):
    port, d = tls_broker
    p = Probe("127.0.0.1", port, *creds(d, "operator"))
    dropped = threading.Event()
    p.client.on_disconnect = lambda *a: dropped.set()
    try:
        p.client.connect("127.0.0.1", port, keepalive=30)
    except OSError:
        return  # refused outright: no session either
    p.client.loop_start()
    # the broker expects a TLS ClientHello: it drops the connection, and no CONNACK ever came
    assert dropped.wait(15), "the broker kept a plain connection on its TLS port"
    assert p.connack_rc is None
    p.client.loop_stop()
