"""The optional TLS listener (deploy/mosquitto/tls.conf) on a real mosquitto, with the compose broker's own
config and a throwaway CA: a client that trusts the CA connects over TLS with its password; without the CA
(system trust store only) the handshake is refused; TLS does not replace the password."""

from __future__ import annotations

import ssl
import subprocess
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


def _edge(exe: str, tmp: Path, name: str, cport: int, central: Path,
          *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A site's broker (a host mosquitto) with the bridge.conf that `make_secrets.py --bridge-to` writes for it,
    the in-container path of the fleet's CA pointed at the site's copy."""
    d = tmp / name
    assert make_secrets.main(["--dir", str(d), "--root", "site-a/robobus", "--site", "site-a", "--bridge-to",
                              f"localhost:{cport}", "--bridge-credentials", str(central / "bridge-site-a.env"),
                              *extra]) == 0
    bridge = (d / "bridge.conf").read_text()
    port = free_port()
    conf = d / "edge.conf"
    conf.write_text(f"user root\nallow_anonymous true\npersistence false\nlistener {port} 127.0.0.1\n"
                    + bridge.replace(make_secrets.BRIDGE_CA_IN_BROKER, str(d / make_secrets.FLEET_CA)))
    return subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), bridge


@pytest.fixture
def tls_centre(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """A fleet centre as make_secrets --central makes it: its CA and certificate, TLS listener (tls.conf)."""
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    central = tmp_path / "central"
    assert make_secrets.main(["--dir", str(central), "--central", "--site", "site-a=site-a/robobus"]) == 0
    plain, tls = free_port(), free_port()
    conf = central / "mosquitto.conf"
    conf.write_text(host_broker_conf(central, plain, "\n" + tls_listener_conf(central / "certs", tls)))
    proc = start_host_broker(exe, conf, plain, central)
    yield exe, tls, central
    proc.terminate()
    proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def heartbeat_seen(central: Path, plain_port_conf: Path, within_s: float) -> bool:
    port = int(next(line.split()[1] for line in plain_port_conf.read_text().splitlines()
                    if line.startswith("listener ") and "127.0.0.1" in line and "websockets" not in line))
    viewer = Probe("127.0.0.1", port, *creds(central, "viewer"))
    assert viewer.connect() == 0 and viewer.subscribe("site-a/robobus/_bridge/uptime") == [1]
    try:
        return viewer.wait_for(lambda t, p, r: not r, within_s)  # a live heartbeat, not a retained one
    finally:
        viewer.close()


def test_a_site_bridges_to_the_centre_over_tls_with_the_fleets_ca(tls_centre, tmp_path):
    """The default bridge: TLS 1.2+ to the centre's TLS listener, the centre's certificate checked against the
    fleet's CA (make_secrets --central made both); the site's heartbeat arrives at the centre through it."""
    exe, tls, central = tls_centre
    assert (central / make_secrets.FLEET_CA).read_bytes() == (central / "certs" / "ca.crt").read_bytes()
    edge, bridge = _edge(exe, tmp_path, "edge", tls, central, "--bridge-ca", str(central / make_secrets.FLEET_CA))
    try:
        assert f"bridge_cafile {make_secrets.BRIDGE_CA_IN_BROKER}" in bridge and "bridge_insecure false" in bridge
        assert heartbeat_seen(central, central / "mosquitto.conf", 20.0), "no heartbeat over the TLS bridge"
    finally:
        edge.kill()  # a bridge retrying a refused handshake may sit out SIGTERM
        edge.wait(5)


def test_a_bridge_that_trusts_another_ca_does_not_connect_and_tls_is_the_default(tls_centre, tmp_path):
    """A centre whose certificate the site's CA did not sign (a man in the middle) gets no bridge; and an edge
    without the fleet's CA is refused by make_secrets unless plain MQTT is asked for by name."""
    exe, tls, central = tls_centre
    other = make_certs(tmp_path / "other-ca")
    edge, _ = _edge(exe, tmp_path, "edge", tls, central, "--bridge-ca", str(other / "ca.crt"))
    try:
        assert not heartbeat_seen(central, central / "mosquitto.conf", 8.0)
    finally:
        edge.kill()  # a bridge retrying a refused handshake may sit out SIGTERM
        edge.wait(5)
    with pytest.raises(SystemExit, match="--bridge-ca"):
        make_secrets.main(["--dir", str(tmp_path / "e2"), "--root", "site-a/robobus", "--site", "site-a",
                           "--bridge-to", f"localhost:{tls}",
                           "--bridge-credentials", str(central / "bridge-site-a.env")])
    plain = make_secrets.bridge_conf("site-a", "site-a/robobus", "c:1883", "u", "p")
    assert "bridge_cafile" not in plain and "PLAIN MQTT" in plain


def _port(edge_dir: Path) -> int:
    return int(next(ln.split()[1] for ln in (edge_dir / "edge.conf").read_text().splitlines()
                    if ln.startswith("listener ")))


def _serves(port: int) -> bool:
    """The broker at `port` takes a client and echoes its message back (it is not frozen)."""
    local = Probe("127.0.0.1", port)
    try:
        if local.connect(10) != 0 or local.subscribe("site-a/robobus/x/status") != [1]:
            return False
        mark = local.mark()
        local.client.publish("site-a/robobus/x/status", b"{}", qos=1)
        return local.wait_for(lambda t, p, r: t.endswith("/x/status"), 10, mark)
    finally:
        local.close()


def test_a_ca_rotation_never_shows_a_site_a_certificate_it_does_not_trust(tmp_path):
    """make_secrets --rotate-ca: the centre keeps its certificate while fleet-ca.crt carries the old and the new
    CA, so a site not yet given the new file keeps its bridge, and one given it bridges too; --rotate-ca-finish
    (the centre restarted on the new CA's certificate): the site with the two-CA file bridges at once. A refused
    TLS bridge is what leaves mosquitto 2.0.11 serving nobody (deploy/README.md): no step of the rotation makes
    one for a site that followed it, and the sites' brokers keep serving their clients throughout."""
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    central = tmp_path / "central"
    secrets = ["--dir", str(central), "--central", "--site", "site-a=site-a/robobus"]
    assert make_secrets.main(secrets) == 0
    old_ca = (central / make_secrets.FLEET_CA).read_bytes()
    plain, tls = free_port(), free_port()
    conf = central / "mosquitto.conf"
    conf.write_text(host_broker_conf(central, plain, "\n" + tls_listener_conf(central / "certs", tls)))
    centre = start_host_broker(exe, conf, plain, central)
    edges: list[subprocess.Popen[bytes]] = []
    try:
        (tmp_path / "old-ca.crt").write_bytes(old_ca)
        slow, _ = _edge(exe, tmp_path, "slow", tls, central, "--bridge-ca", str(tmp_path / "old-ca.crt"))
        edges.append(slow)
        assert heartbeat_seen(central, conf, 20.0), "no bridge before the rotation"
        server = (central / "certs" / "server.crt").read_bytes()
        assert make_secrets.main([*secrets, "--rotate-ca"]) == 0
        assert (central / "certs" / "server.crt").read_bytes() == server  # the centre still shows the old one
        bundle = (central / make_secrets.FLEET_CA).read_bytes()
        assert bundle.startswith(old_ca) and bundle.count(b"BEGIN CERTIFICATE") == 2
        centre.kill()  # the centre restarted meanwhile, for whatever reason: the site not yet updated bridges
        centre.wait(5)
        centre = start_host_broker(exe, conf, plain, central)
        assert heartbeat_seen(central, conf, 20.0), "a site with the old CA lost its bridge once the rotation began"
        assert _serves(_port(tmp_path / "slow"))
        slow.kill()  # the site gets the two-CA file (one bridge per site: its client id is the site's)
        slow.wait(5)
        (tmp_path / "both-ca.crt").write_bytes(bundle)
        fresh, _ = _edge(exe, tmp_path, "fresh", tls, central, "--bridge-ca", str(tmp_path / "both-ca.crt"))
        edges.append(fresh)
        assert heartbeat_seen(central, conf, 20.0), "the site with both CAs did not bridge"
        assert make_secrets.main([*secrets, "--rotate-ca-finish"]) == 0
        assert (central / "certs" / "server.crt").read_bytes() != server
        assert not (central / "certs" / "next").exists()
        assert (central / make_secrets.FLEET_CA).read_bytes() == bundle[len(old_ca):]  # the new CA alone
        centre.kill()
        centre.wait(5)
        centre = start_host_broker(exe, conf, plain, central)
        assert heartbeat_seen(central, conf, 20.0), "the site with both CAs did not bridge to the new certificate"
        assert _serves(_port(tmp_path / "fresh"))
        with pytest.raises(SystemExit, match="no rotation begun"):
            make_secrets.main([*secrets, "--rotate-ca-finish"])
    finally:
        for e in edges:
            e.kill()
            e.wait(5)
        centre.kill()
        centre.wait(5)
