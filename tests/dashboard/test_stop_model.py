"""The dashboard's view of the bus stop's two latches (static/stop.js), run in node without a browser: the site's
{root}/_stop and the fleet centre's {root}/_stop/fleet, read from the AsyncAPI document the server serves; the
banner says which latch holds the bus, offers the page's release only for the site's latch (it writes only that
one) and says so while the fleet's stop is active; a node's answer is current for the latch it names."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from shared.tools.asyncapi import build_document
from shared.tools.dashboard.server import STATIC
from tests.kit import motion_node

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (make setup installs it)")

# the scenarios, each run through stop.js; the results come back as one JSON document
SCRIPT = """
import * as m from %(module)s;
const docs = %(docs)s;
const fmt = { hms: (ms) => `T${ms / 1000}`, since: () => "1 s" };
const latch = (state, bad = "") => ({ state, bad, gen: 1 });
const none = latch(null);
const siteStop = latch({ active: true, source: "alice@site", reason: "arm near the door", ts: 100 });
const fleetStop = latch({ active: true, source: "centre-op@hq", reason: "fleet drill", ts: 200 });
const siteRel = latch({ active: false, source: "alice@site", reason: "", ts: 300 });
const fleetRel = latch({ active: false, source: "centre-op@hq", reason: "", ts: 400 });
const opts = { known: true, connected: true, fleetTopic: "robobus/_stop/fleet" };
const L = (site, fleet) => ({ site, fleet });
const answer = (channel, s) => ({ channel, stop_ts: s.state.ts, source: s.state.source, active: s.state.active });
const out = {
  topics: docs.map((d) => m.stopTopics(d)),
  noDoc: m.stopTopics({ channels: {} }),
  fleetOnly: m.banner(L(none, fleetStop), opts, fmt),
  siteOnly: m.banner(L(siteStop, none), opts, fmt),
  both: m.banner(L(siteStop, fleetStop), opts, fmt),
  siteReleasedFleetActive: m.banner(L(siteRel, fleetStop), opts, fmt),
  bothReleased: m.banner(L(siteRel, fleetRel), opts, fmt),
  nothing: m.banner(L(none, none), opts, fmt),
  unknown: m.banner(L(none, none), { ...opts, known: false }, fmt),
  badFleet: m.banner(L(none, latch(m.readStop("{oops", () => []).state, "not JSON")), opts, fmt),
  activeBoth: m.activeChannels(L(siteStop, fleetStop)),
  effectiveFleet: m.effective(L(siteRel, fleetStop))[0],
  deviceHeadFleet: m.deviceHead(L(none, fleetStop), fmt),
  deviceHeadBoth: m.deviceHead(L(siteStop, fleetStop), fmt),
  currentFleet: m.answerCurrent(L(none, fleetStop), answer("fleet", fleetStop)),
  currentWrongLatch: m.answerCurrent(L(fleetStop, none), answer("fleet", fleetStop)),
  currentDefaultSite: m.answerCurrent(L(siteStop, none), { ...answer("site", siteStop), channel: undefined }),
  currentOld: m.answerCurrent(L(none, fleetStop), { ...answer("fleet", fleetStop), stop_ts: 1 }),
  garbage: m.readStop("{oops", () => []),
  invalid: m.readStop('{"active": true}', () => [{ path: "source", message: "is required" }]),
  empty: m.readStop("", () => []),
};
console.log(JSON.stringify(out));
"""


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    docs = [build_document([motion_node.API]), build_document([motion_node.API], root="site1/robobus")]
    script = SCRIPT % {"module": json.dumps((STATIC / "stop.js").as_uri()), "docs": json.dumps(docs)}
    r = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_both_latches_come_from_the_document(model: dict[str, Any]) -> None:
    assert model["topics"] == [{"topic": "_stop", "fleetTopic": "_stop/fleet"}] * 2  # {root}, and a two-level root
    assert model["noDoc"] is None


def test_the_fleets_stop_alone_is_shown_and_the_page_cannot_release_it(model: dict[str, Any]) -> None:
    b = model["fleetOnly"]
    assert b["kind"] == "active" and b["channel"] == "fleet", b
    assert "FLEET BUS STOP ACTIVE since" in b["text"] and "centre-op@hq: fleet drill" in b["text"], b
    assert b["release"] is False  # the page's release writes {root}/_stop: it cannot lift this
    assert "only the centre releases it" in b["note"] and "lifts only the site's stop" in b["note"], b
    assert "robobus/_stop/fleet" in b["note"]
    assert model["deviceHeadFleet"].startswith("FLEET BUS STOP by centre-op@hq: fleet drill")


def test_the_sites_stop_alone_is_as_before(model: dict[str, Any]) -> None:
    b = model["siteOnly"]
    assert b["kind"] == "active" and b["channel"] == "site" and b["release"] is True and b["note"] == "", b
    assert b["text"].startswith("BUS STOP ACTIVE since") and "alice@site: arm near the door" in b["text"], b


def test_both_active_the_release_is_offered_for_the_sites_latch_only(model: dict[str, Any]) -> None:
    b = model["both"]
    assert b["kind"] == "active" and b["channel"] == "both" and b["release"] is True, b
    assert "alice@site" in b["text"] and "centre-op@hq" in b["text"] and "lifts only the site's stop" in b["note"]
    assert model["activeBoth"] == ["fleet", "site"]  # the newest first: the one the nodes name
    assert "(and the site's stop)" in model["deviceHeadBoth"]
    # the site released, the fleet's stop holds: still active, nothing for the page to release
    b = model["siteReleasedFleetActive"]
    assert b["kind"] == "active" and b["channel"] == "fleet" and b["release"] is False and b["note"], b
    assert model["effectiveFleet"] == "fleet"


def test_released_none_unknown_and_unreadable(model: dict[str, Any]) -> None:
    b = model["bothReleased"]
    assert b["kind"] == "released" and b["release"] is False and b["note"] == "", b
    assert "released T300 by alice@site" in b["text"] and "fleet released T400 by centre-op@hq" in b["text"], b
    assert model["nothing"]["kind"] == "none" and model["nothing"]["text"] == "no bus stop"
    assert model["unknown"]["kind"] == "unknown"
    b = model["badFleet"]
    assert b["kind"] == "active" and b["channel"] == "fleet" and "unreadable stop message" in b["text"], b
    assert b["release"] is False
    assert model["garbage"]["state"] == {"active": True, "source": "unknown", "reason": "", "ts": 0}
    assert model["garbage"]["bad"].startswith("not JSON")
    assert model["invalid"]["bad"] == "source is required" and model["invalid"]["state"]["active"] is True
    assert model["empty"] == {"state": None, "bad": ""}


def test_an_answer_is_current_for_the_latch_it_names(model: dict[str, Any]) -> None:
    assert model["currentFleet"] is True
    assert model["currentWrongLatch"] is False  # the same stop on the other latch is not what it answered
    assert model["currentDefaultSite"] is True  # an answer without `channel` answers the site's latch
    assert model["currentOld"] is False
