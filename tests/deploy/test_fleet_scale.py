"""The fleet bench at the test's size (bench/fleet.py --quick's shape): the clustered centre (three ejabberd nodes,
fleet-watch, fleet-gate) and 10 sites, each a host mosquitto bridged over TLS with its own credentials and
replaying one `make run` site's recorded uplink (bench/fleet_sample.json.gz) with its sizes and rates. Every bridge
connects; no stamped QoS 1 event is lost in a steady window; the fleet stop from the centre reaches every site's
{root}/_stop/fleet, and its release too; the node that a third of the sites are bridged to is killed: each of those
bridges is on another node within 10 s and no QoS 1 event of any site is lost across the move.
The uplink is replayed with its retain flags cleared: each retained message is a replicated Mnesia write at the
cluster, what the bench measures (docs/fleet-scale.md); 10 sites of them take half a core here, and beside the
suite's other workers on two cores their latency would be the machine's load, not the fleet's behaviour. The
latency is not judged here for the same reason (the bench judges it alone on the machine)."""

from __future__ import annotations

import importlib
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import TIMINGS
from tests.deploy.deployfiles import REPO
from tests.fixtures import free_port, mosquitto_bin

SITES = 10
FAILOVER_WITHIN_S = 10.0  # as tests/deploy/test_cluster.py for one site
STOP_WITHIN_S = 5.0  # the fleet stop's slowest site (measured: 0.01-0.11 s at 10-20 sites)


def bench(name: str) -> Any:
    sys.path.insert(0, str(REPO / "bench"))  # the bench's modules import their neighbours by their names
    return importlib.import_module(name)


def window(sites: int, msgs: float, retained: float, cost: tuple[float, float, float, float]) -> dict[str, Any]:
    """A made-up steady window whose CPU is exactly `cost` (base %, % per site, µs per message, µs per retained)."""
    base, per_site, us_msg, us_ret = cost
    cpu = base + per_site * sites + us_msg / 1e4 * (msgs - retained) + us_ret / 1e4 * retained
    return {"steady": {"sites": sites, "msgs_per_s_in": msgs, "retained_per_s_in": retained, "centre_cpu_pct": cpu,
                       "centre_rss_mb": 180 + 0.5 * sites}}


def test_the_capacity_model_finds_the_costs_it_was_built_from() -> None:
    """bench/fleet.py's model on windows made from known costs: it gives them back, leaves out a step not held,
    and says the retained rates held and not held."""
    fleet = bench("fleet")
    cost = (5.0, 0.3, 400.0, 1200.0)
    idle = [window(n, 1.5 * n, 0.0, cost) for n in (10, 50, 100, 200)]
    unretained = [window(n, 45.0 * n, 0.0, cost) for n in (10, 20, 30)]
    sample = [window(10, 450.0, 390.0, cost), {**window(20, 900.0, 780.0, cost), "broke": "latency"}]
    sample[1]["steady"]["centre_cpu_pct"] = 500.0  # a step not held: its figures must not bend the fit
    runs = {"idle": {"traffic": "idle", "steps": idle}, "sample": {"traffic": "sample", "steps": sample},
            "sample-unretained": {"traffic": "sample-unretained", "steps": unretained}}
    m = fleet.model(runs, {"msgs_per_s": 43.9, "bytes_per_s": 22600.0}, 38.9)
    assert m["fitted_over"] == 8
    assert m["cpu_base_pct"] == pytest.approx(5.0, abs=1e-6)
    assert m["cpu_pct_per_site"] == pytest.approx(0.3, abs=1e-6)
    assert m["cpu_us_per_msg"] == pytest.approx(400.0, abs=0.1)
    assert m["cpu_us_per_retained_msg"] == pytest.approx(1200.0, abs=0.1)
    assert m["rss_mb_per_site"] == pytest.approx(0.5, abs=1e-3)
    assert (m["retained_per_s_held"], m["retained_per_s_broke"]) == (390.0, 780.0)
    # 1,000 sites as recorded: base + 1000 * (per site + 5.5 msg/s unretained + 38.9 retained), in cores
    assert m["sites_1000"]["cores_sample_uplink"] == pytest.approx((5 + 1000 * (0.3 + 0.04 * 5.5 + 0.12 * 38.9)) / 100,
                                                                   abs=0.1)


def test_a_site_broker_whose_port_was_taken_is_told_from_one_that_runs(tmp_path: Path) -> None:
    """The bench's site brokers are started on ports found free, which another process can take first: a broker
    that exited (Address already in use) is told apart from one that runs, though its port answers a connect (the
    process that took it does), so the bench starts it again on another port."""
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    fleet = bench("fleet")
    sites = bench("fleet_sites")
    f = fleet.Fleet(tmp_path, 2)
    f.brokers = sites.SiteBrokers(exe)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ok_port = free_port()
        pair = [sites.Site("site0000", "site0000/robobus", taken.getsockname()[1], 0.0),
                sites.Site("site0001", "site0001/robobus", ok_port, 0.5)]
        try:
            for site in pair:
                folder = tmp_path / "sites" / site.name
                folder.mkdir(parents=True)
                (folder / "mosquitto.conf").write_text(sites.site_conf(site, "", folder))
                f.brokers.start(site, folder / "mosquitto.conf")
            running, exited = f.brokers_running(pair)
        finally:
            f.brokers.stop_all()
    assert [s.name for s in running] == ["site0001"] and [s.name for s in exited] == ["site0000"]
    assert "Address already in use" in " ".join(f.why_not_connected("site0000")["broker_log"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_sites_the_fleet_stop_and_a_node_kill(images: str) -> None:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    fleet = bench("fleet")

    t0 = time.monotonic()
    result = fleet.sweep([SITES], SITES, window_s=10.0, traffic="sample-unretained", kill_only=True,
                         after_kill_s=10.0, latency_limit_s=60.0)
    TIMINGS["fleet_scale_s"] = time.monotonic() - t0
    step = result["steps"][0]
    assert step["connect"]["connected"] == SITES, json.dumps(step["connect"])
    assert "broke" not in step, step.get("broke")
    steady = step["steady"]
    # the sites' uplink reached the centre: about 44 messages a second each (the sample) and every stamp
    assert steady["msgs_per_s_in"] > 30 * SITES, steady
    assert steady["latency_s"]["n"] >= SITES * 5, steady["latency_s"]
    assert step["qos1_lost"] == 0 and step["qos1_counted"] >= SITES * 10, step
    for phase in ("stop", "release"):
        s = step["fleet_stop"][phase]
        assert s["reached"] == SITES, (phase, s)
        assert s["max"] <= STOP_WITHIN_S, (phase, s)
    kill = result["faults"]["node_kill"]
    # the sites on the killed node are those whose bridge it held (their brokers' logs): a bridge's first address is
    # a preference, and a node slow at start-up sends some on to the next node
    assert kill["sites_on_killed_node"] >= 1, json.dumps(kill)
    assert kill["moved"] == kill["sites_on_killed_node"], json.dumps(kill)
    assert kill["failover_s"]["max"] <= FAILOVER_WITHIN_S, kill
    assert kill["qos1_lost"] == 0 and kill["qos1_counted"] > 0, kill
    print(f"fleet scale: {SITES} sites, {steady['msgs_per_s_in']} msg/s into the centre at "
          f"{steady['centre_cpu_pct']} % of a core, latency p99 {steady['latency_s']['p99']} s; fleet stop p99 "
          f"{step['fleet_stop']['stop']['p99']} s; node kill: {kill['moved']} bridges moved, failover max "
          f"{kill['failover_s']['max']} s, {kill['qos1_counted']} QoS 1 events, none lost; "
          f"{TIMINGS['fleet_scale_s']:.0f} s")
