"""bench/footprint.py's copy of `make run`'s Procfile runs beside a `make run`: every port and link variable of the
Procfile is given one of its own, and each e-puck robot the gateway is given is one the simulator serves (its
robots are on consecutive ports from --base-port). The judging: every process counts to the kit or to the one
registered service it serves (its node, the node's children, its simulators), and each part is held to its own
bound, so that a sixth service brings its own budget. No memory or CPU figure of a run is asserted here: that is
the bench's own verdict."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

from shared.tools.simrig import Footprint, procfile_variables
from tests.chaos.stack import expand

REPO = Path(__file__).resolve().parents[2]
# the bench imports its sibling `results` as a top-level module: the bench directory on the path only for that
sys.path.insert(0, str(REPO / "bench"))
try:
    footprint = importlib.import_module("footprint")
finally:
    sys.path.remove(str(REPO / "bench"))


def test_the_gateway_reaches_every_simulated_robot_on_ports_of_its_own(tmp_path: Path) -> None:
    path, env = footprint.procfile(tmp_path)
    lines = dict(ln.split(": ", 1) for ln in path.read_text().splitlines() if ": " in ln)
    assert "homeassistant" not in lines and "recorder" not in lines  # as run-local.sh, unless asked for
    words = {n: expand(c, env) for n, c in lines.items()}
    sim = words["epuck-sim"]
    base = int(sim[sim.index("--base-port") + 1])
    count = int(sim[sim.index("--count") + 1])
    given = next(w for w in words["epuck-gateway"] if w.startswith("ROBOBUS_EPUCK_ROBOTS="))
    robots = json.loads(given.split("=", 1)[1])
    wifi = [r["port"] for r in robots if r.get("transport", "tcp") == "tcp"]
    assert sorted(wifi) == list(range(base, base + count))
    serial = [r["port"] for r in robots if r.get("transport") == "serial"]
    link = sim[sim.index("--serial-link") + 1]
    assert link.startswith(str(tmp_path)) and serial == [f"{link}1"]
    text = " ".join(" ".join(w) for w in words.values())
    for var in procfile_variables(lines.values()).values():
        if var.name in env:  # every port and link: none at its default
            assert not re.search(rf"(?<![\w/]){re.escape(var.default)}(?!\w)", text), var


def _row(pid: int, process: str, part: str, mb: float, core: float = 0.01) -> dict[str, object]:
    return {"pid": pid, "process": process, "part": part, "rss_mb": mb, "cpu_core": core}


def test_every_process_counts_to_the_service_it_serves_or_to_the_kit(monkeypatch) -> None:
    monkeypatch.setattr(footprint, "service_packages", lambda: {"sixth-io": "robobus_sixth", "dexter-gateway":
                                                                "services.dexter_gateway"})
    procs = {"broker": 10, "dashboard": 11, "sixth-io": 12, "sixth-sim": 13, "dexter-gateway": 14, "dexter-sim": 15}
    parents = {10: 1, 11: 1, 12: 1, 13: 1, 14: 1, 15: 1, 20: 12, 21: 20, 1: 0}  # 20, 21: started by sixth-io's node
    parts = footprint.parts(procs, parents)
    assert parts == {10: "kit", 11: "kit", 12: "sixth-io", 13: "sixth-io", 14: "dexter-gateway",
                     15: "dexter-gateway", 20: "sixth-io", 21: "sixth-io", 1: "kit"}


def test_each_service_is_judged_against_its_own_bound_and_the_whole_against_their_sum() -> None:
    rows = [_row(1, "supervise", "kit", 12), _row(2, "mosquitto", "kit", 9), _row(3, "dashboard", "kit", 46),
            _row(4, "epuck_gateway", "epuck-gateway", 45), _row(5, "epuck_gateway.sim", "epuck-gateway", 36),
            _row(6, "robobus_sixth", "sixth-io", 41, 0.02), _row(7, "robobus_sixth.sim", "sixth-io", 60, 0.2)]
    from services.epuck_gateway.rig import RIG as EPUCK_RIG

    assert EPUCK_RIG.footprint is not None  # its own, measured shape (2 WiFi robots + 1 serial)
    bounds = {"epuck-gateway": EPUCK_RIG.footprint, "sixth-io": Footprint(node_mb=40.0, total_mb=80.0, cpu_core=0.1)}
    nodes = {"epuck-gateway": footprint.Node("epuck-gateway", 45), "sixth-io": footprint.Node("sixth-io", 41)}
    figures = {f.name: f for f in footprint.judge(rows, bounds, nodes)}
    whole = next(f for n, f in figures.items() if n.startswith("`make run` idle, 7 processes"))
    assert whole.target == footprint.KIT_MB + EPUCK_RIG.footprint.total_mb + 80.0  # grows with each service
    assert figures["the kit's overhead (supervisor, broker, dashboard): resident memory"].value == 67
    assert figures["the kit's overhead (supervisor, broker, dashboard): resident memory"].met
    assert figures["epuck-gateway: node, its processes and simulators, resident memory"].value == 81
    assert figures["epuck-gateway: node, its processes and simulators, resident memory"].met
    # the sixth service is over its own bounds (node 41 > 40, all 101 > 80, CPU 22 % > 10 %): said by name
    assert not figures["sixth-io: node process resident memory"].met
    assert not figures["sixth-io: node, its processes and simulators, resident memory"].met
    assert not figures["sixth-io: CPU"].met and figures["epuck-gateway: CPU"].met


def test_the_node_process_of_each_service_is_found_by_its_package(monkeypatch) -> None:
    monkeypatch.setattr(footprint, "service_packages", lambda: {"sixth-io": "robobus_sixth", "epuck-gateway":
                                                                "services.epuck_gateway"})
    rows = [_row(4, "epuck_gateway", "epuck-gateway", 45), _row(5, "epuck_gateway.sim", "epuck-gateway", 36),
            _row(6, "robobus_sixth", "sixth-io", 41), _row(7, "robobus_sixth.sim", "sixth-io", 20)]
    assert footprint.spawned_nodes(rows) == [footprint.Node("epuck-gateway", 45), footprint.Node("sixth-io", 41)]
