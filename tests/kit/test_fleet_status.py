"""`robobus fleet status` against the session broker: four made-up sites' retained messages, as a centre holds them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from rich.console import Console
from typer.testing import CliRunner

from shared.messages import StopAnswer, StopState
from shared.rpc import RpcClient
from shared.tools import fleet_status
from shared.tools.cli import app
from shared.tools.fleet_status import Site, gather, parse_sites, summary
from tests.fixtures import REPO, Broker

P = f"fs{os.getpid()}"
OK, DOWN, BAD, STOP = (f"{P}{x}" for x in ("a-ok", "b-down", "c-bad", "d-stop"))  # by name: the healthy one first
SITES = " ".join(f"{s}={s}/robobus" for s in (OK, DOWN, BAD, STOP))


def _health(node: str, dev: str, operational: bool, ts: float) -> str:
    return json.dumps({"connection": True, "operational": operational, "state": "running" if operational else "fault",
                       "error": not operational, "error_message": "" if operational else "motor overheated",
                       "service": "x", "node": node, "device": dev, "version": "1", "ts": ts, "details": {}})


def _answer(node: str, channel: str, active: bool, source: str, ts: float) -> str:
    return StopAnswer(node=node, service="x", active=active, stop_ts=ts, source=source, reason="", channel=channel,
                      received_ts=ts, devices=[], ts=ts).model_dump_json()


@pytest.fixture(scope="module")
def fleet(broker_session: Broker) -> Iterator[RpcClient]:
    """The four sites' retained messages; removed at the end."""
    now = time.time()
    msgs: dict[str, str] = {}
    for s in (OK, DOWN, BAD, STOP):
        r = f"{s}/robobus"
        msgs[f"{r}/n1/status"] = json.dumps({"online": True, "service": "x", "ts": now - 5})
        msgs[f"{r}/n1/d1/health"] = _health("n1", "d1", s != BAD, now - 3)
        msgs[f"{r}/_bridge/state"] = "1"
        msgs[f"{r}/_bridge/reachable"] = "0" if s == DOWN else "1"
    msgs[f"{BAD}/robobus/n1/d2/health"] = _health("n1", "d2", True, now - 1)
    msgs[f"{BAD}/robobus/n2/status"] = json.dumps({"online": False, "service": "x", "ts": now - 60})
    msgs[f"{BAD}/robobus/n1/_node/state/stop"] = _answer("n1", "site", False, "bob@site", now - 100)
    msgs[f"{DOWN}/robobus/_bridge/state"] = "0"
    msgs[f"{STOP}/robobus/_stop"] = StopState(active=True, source="alice@centre", reason="door open",
                                               ts=now - 2).model_dump_json()
    msgs[f"{STOP}/robobus/n1/_node/state/stop"] = _answer("n1", "fleet", True, "alice@centre", now - 2)
    c = RpcClient(broker_session.settings(), name="fleet-status-test")
    c.connect()
    for topic, payload in msgs.items():
        assert c.session.publish_wait(topic, payload, qos=1, retain=True)
    yield c
    for topic in msgs:
        c.session.publish_wait(topic, b"", qos=1, retain=True)
    c.close()


def test_rows_unreachable_then_problems_then_the_rest(fleet: RpcClient) -> None:
    sites = gather(fleet, parse_sites(SITES), wait=5)
    assert [s.site.name for s in sites] == [DOWN, BAD, STOP, OK]
    down, bad, stop, ok = sites
    assert down.stale and down.problems() == ["unreachable"] and len(down.online) == 1  # the last known
    assert bad.reachable == "1" and bad.not_operational == ["n1/d1"] and (len(bad.online), len(bad.nodes)) == (1, 2)
    assert bad.site_stop is not None and not bad.site_stop.active and bad.site_stop.source == "bob@site"
    assert stop.fleet_stop is not None and stop.fleet_stop.active and stop.fleet_stop.source == "alice@centre"
    assert stop.problems() == ["fleet stop active"] and stop.site_stop is None
    assert ok.problems() == [] and not ok.stale and ok.newest_ts is not None and time.time() - ok.newest_ts < 60
    assert summary(sites) == {"sites": 4, "reachable": 3, "unreachable": 1, "no_verdict": 0, "with_problems": 3,
                              "devices_not_operational": 1, "stopped": 1}


def test_a_named_site_the_broker_holds_nothing_of_has_no_verdict(fleet: RpcClient) -> None:
    sites = gather(fleet, [Site(OK, f"{OK}/robobus"), Site("ghost", f"{P}ghost/robobus")], wait=5)
    assert [(s.site.name, s.reachable) for s in sites] == [("ghost", None), (OK, "1")]
    assert sites[0].problems() == ["no verdict from fleet-watch"]


def test_without_names_the_sites_are_found_from_their_statuses_and_verdicts(fleet: RpcClient) -> None:
    found = {s.site.name: s for s in gather(fleet, None, wait=5)}
    assert {OK, DOWN, BAD, STOP} <= set(found)
    assert found[BAD].site.root == f"{BAD}/robobus" and found[BAD].not_operational == ["n1/d1"]


def test_the_table_and_one_site_through_the_cli(fleet: RpcClient, broker_session: Broker,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    env = {"ROBOBUS_MQTT_URL": broker_session.url}
    monkeypatch.setattr(fleet_status, "console", Console(width=200))  # a terminal's width, whatever runs the test
    r = runner.invoke(app, ["fleet", "status", "--sites", SITES, "--wait", "5"], env=env)
    assert r.exit_code == 0, r.output
    assert ("3/4 sites reachable (1 unreachable); devices not operational in all: 1; 1 stopped; 3 with problems"
            in " ".join(r.output.split()))
    lines = r.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("site "))
    rows = lines[head + 1:]
    assert [line.split()[0] for line in rows] == [DOWN, BAD, STOP, OK]  # one line each, in this order
    assert "STALE: last known" in rows[0] and "NO" in rows[0]
    assert "1/2" in rows[1] and "ACTIVE by alice@centre" in rows[2]
    monkeypatch.setattr(fleet_status, "console", Console(width=80))
    narrow = runner.invoke(app, ["fleet", "status", "--sites", SITES], env=env)
    narrow_lines = narrow.output.splitlines()
    head = next(i for i, line in enumerate(narrow_lines) if line.startswith("site "))
    assert len(narrow_lines) - head - 1 == 4  # cut short, never wrapped
    monkeypatch.setattr(fleet_status, "console", Console(width=200))
    one = runner.invoke(app, ["fleet", "status", "--sites", SITES, "--site", BAD], env=env)
    assert one.exit_code == 0, one.output
    assert "motor overheated" in one.output and "offline" in one.output and "d2" in one.output
    assert OK not in one.output and "NO" not in one.output
    none = runner.invoke(app, ["fleet", "status", "--sites", SITES, "--site", "nowhere"], env=env)
    assert none.exit_code == 1


def test_json_from_the_sites_setting(fleet: RpcClient, broker_session: Broker) -> None:
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker_session.url, "ROBOBUS_CENTRAL_SITES": SITES}
    r = subprocess.run([sys.executable, "-m", "shared.tools.cli", "fleet", "status", "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["summary"]["reachable"] == 3 and data["summary"]["devices_not_operational"] == 1
    assert [s["site"] for s in data["sites"]] == [DOWN, BAD, STOP, OK]
    down, bad, stop, _ = data["sites"]
    assert down["reachable"] is False and down["stale"] and down["bridge_state"] == "0"
    assert bad["devices_not_operational"] == ["n1/d1"] and (bad["nodes_online"], bad["nodes_known"]) == (1, 2)
    assert stop["stop"]["fleet"]["active"] and stop["stop"]["fleet"]["source"] == "alice@centre"
    assert stop["stop"]["site"] is None
