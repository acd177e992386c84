"""bench/footprint.py's copy of `make run`'s Procfile runs beside a `make run`: every fixed port and the serial
link are its own, and each e-puck robot the gateway is given is one the simulator serves (its robots are on
consecutive ports from --base-port). No memory or CPU figure is asserted here: that is the bench's own verdict."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the bench imports its sibling `results` as a top-level module: the bench directory on the path only for that
sys.path.insert(0, str(REPO / "bench"))
try:
    footprint = importlib.import_module("footprint")
finally:
    sys.path.remove(str(REPO / "bench"))


def test_the_gateway_reaches_every_simulated_robot_on_ports_of_its_own(tmp_path: Path) -> None:
    lines = dict(ln.split(":", 1) for ln in footprint.procfile(tmp_path).read_text().splitlines() if ":" in ln)
    sim = lines["epuck-sim"]
    base = int(re.search(r"--base-port (\d+)", sim).group(1))  # type: ignore[union-attr]
    count = int(re.search(r"--count (\d+)", sim).group(1))  # type: ignore[union-attr]
    robots = json.loads(re.search(r"ROBOBUS_EPUCK_ROBOTS='([^']*)'", lines["epuck-gateway"]).group(1))  # type: ignore[union-attr]
    wifi = [r["port"] for r in robots if r.get("transport", "tcp") == "tcp"]
    assert sorted(wifi) == list(range(base, base + count))
    assert base not in (11000, 11001)
    serial = [r["port"] for r in robots if r.get("transport") == "serial"]
    link = re.search(r"--serial-link (\S+)", sim).group(1)  # type: ignore[union-attr]
    assert link.startswith(str(tmp_path)) and serial == [f"{link}1"]
    text = " ".join(lines.values())
    for fixed in ("11000", "11001", "50000", "8080"):
        assert not re.search(rf"\b{fixed}\b", text), fixed
    assert "/tmp/robobus-epuck-serial" not in text
