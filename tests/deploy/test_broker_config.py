"""Every broker configuration the project ships (make run's, compose's for one host, a fleet's sites and centre,
the clustered centre's ejabberd) keeps the bus stop: persistence with a short autosave, and per-client limits high
enough that a burst of commands pushes nothing out of a queue; the tests' broker uses the same limits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shared.tools.localbroker import BUS_LIMITS, Broker, free_port, limits_conf, mosquitto_bin
from tests.deploy.deployfiles import DEPLOY, make_secrets

MAKE_RUN_CONF = DEPLOY / "mosquitto" / "mosquitto.conf"
COMPOSE_CONF = DEPLOY / "mosquitto" / "compose.conf"  # one host, every fleet site and a single-broker centre
SHIPPED = (MAKE_RUN_CONF, COMPOSE_CONF)
# what a file included into compose.conf must never set again (a later line wins in mosquitto)
GLOBAL_KEYS = (*BUS_LIMITS, "persistence", "persistence_location", "autosave_interval", "autosave_on_changes")
MOSQUITTO_DEFAULT_QUEUE = 1000  # with it two stops were dropped under a demand flood


def options(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = line.split(None, 1)
        if words and not words[0].startswith("#"):
            out.setdefault(words[0], []).append(words[1].strip() if len(words) > 1 else "")
    return out


@pytest.mark.parametrize("conf", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_mosquitto_conf_sets_the_limits_the_tests_broker_uses(conf: Path) -> None:
    opts = options(conf.read_text())
    for key, value in BUS_LIMITS.items():
        assert opts.get(key) == [str(value)], (conf.name, key, opts.get(key))


def test_the_limits_hold_a_burst_of_commands_and_bound_the_memory() -> None:
    # a node that stalls 60 s under 1 kHz demands keeps every one; a stalled client costs at most 64 MiB
    assert BUS_LIMITS["max_queued_messages"] >= 60_000 > MOSQUITTO_DEFAULT_QUEUE
    assert 0 < BUS_LIMITS["max_queued_bytes"] <= 256 * 1024 * 1024
    # bounded (0 would be unbounded: nothing ever queued, the socket's buffer grows without limit instead), and
    # the window the kit's own client keeps (shared/mqtt/session.py: max_inflight_messages_set(1000))
    assert BUS_LIMITS["max_inflight_messages"] == 1000
    assert 'max_inflight_messages_set(1000)' in (DEPLOY.parent / "shared" / "mqtt" / "session.py").read_text()


@pytest.mark.parametrize("conf", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_mosquitto_conf_keeps_retained_messages_across_a_restart(conf: Path) -> None:
    opts = options(conf.read_text())
    assert opts.get("persistence") == ["true"], conf.name
    assert len(opts.get("persistence_location", [])) == 1, conf.name
    # seconds, not a count of changes (the retained state streams would save on nearly every message)
    assert opts.get("autosave_on_changes") == ["false"], conf.name
    assert 1 <= int(opts["autosave_interval"][0]) <= 2, conf.name


def test_make_runs_database_is_where_make_run_makes_it() -> None:
    location = options(MAKE_RUN_CONF.read_text())["persistence_location"][0]
    assert location == "run/mosquitto/"  # relative to the repository, where the supervisor starts mosquitto
    run_local = (DEPLOY / "dev" / "run-local.sh").read_text()
    assert "mkdir -p run/mosquitto" in run_local
    # as root, the supervisor starts the broker as the user mosquitto (which owns the folder): mosquitto giving up
    # root itself would lose its parent-death signal (tests/deploy/test_broker_persistence.py)
    assert "chown mosquitto: run/mosquitto" in run_local
    assert "as_user=(--user broker=mosquitto)" in run_local
    assert re.search(r"^broker: mosquitto -c \$\{ROBOBUS_MOSQUITTO_CONF:-deploy/mosquitto/mosquitto.conf\}$",
                     (DEPLOY / "Procfile.sim").read_text(), re.M)
    assert "/run/" in (DEPLOY.parent / ".gitignore").read_text().split()


def test_composes_database_is_on_the_broker_data_volume() -> None:
    assert options(COMPOSE_CONF.read_text())["persistence_location"] == ["/var/lib/mosquitto/"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert "broker-data:/var/lib/mosquitto" in compose["services"]["broker"]["volumes"]
    assert "broker-data" in compose["volumes"]


def test_nothing_included_into_the_compose_broker_overrides_them(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    included = {
        "tls.conf": (DEPLOY / "mosquitto" / "tls.conf").read_text(),
        "bridge.conf": make_secrets.bridge_conf("site-a", "site-a/robobus", "central:8883", "bridge-site-a", "pw",
                                                str(ca)),
        "bridge.conf (cluster)": make_secrets.bridge_conf("site-a", "site-a/robobus", "e1:8883,e2:8883",
                                                          "bridge-site-a", "pw", str(ca)),
    }
    for name, text in included.items():
        assert not set(options(text)) & set(GLOBAL_KEYS), name


def test_the_clustered_centres_mod_mqtt_queue_holds_as_much() -> None:
    acl = "user operator\ntopic readwrite site-a/robobus/#\npattern readwrite site-a/robobus/_client/%c/reply\n"
    conf = yaml.safe_load(make_secrets.ejabberd_conf(acl, ["operator"]))
    mqtt = conf["modules"]["mod_mqtt"]
    assert mqtt["max_queue"] >= BUS_LIMITS["max_queued_messages"]
    assert mqtt.get("queue_type", "ram") == "ram"


def test_the_tests_broker_runs_with_the_same_limits(tmp_path: Path) -> None:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    broker = Broker(free_port(), tmp_path)
    broker.start()
    try:
        opts = options((tmp_path / "mosquitto.conf").read_text())
    finally:
        broker.kill()
    for key, value in BUS_LIMITS.items():
        assert opts.get(key) == [str(value)], key
    assert opts.get("persistence") == ["false"]  # unless a test asks for it (the tests' default: nothing kept)
    assert limits_conf().count("\n") == len(BUS_LIMITS)
