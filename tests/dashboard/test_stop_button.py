"""The dashboard's bus stop in Debian's headless chromium, under the deployment's broker security: a mosquitto with
the password and ACL files deploy/make_secrets.py writes (the operator alone may write {root}/_stop; the viewer
reads it), a node of tests/kit/motion_node.py (two motion devices, one read-only device) logged in as its service
user, and the dashboard server with that service's AsyncAPI document. The operator's page stops the devices
(their health says stopped, a motion command from the page's form is refused `stopped`) and releases them; the
viewer's page offers the release too and shows the broker's refusal. The fleet centre's stop ({root}/_stop/fleet,
written here by a stand-in for the site's bridge) shows on both pages, named as the fleet's; the page's release
(the site's latch) is not offered for it and, with both active, lifts only the site's."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from shared.messages import StopState
from shared.rpc import RpcClient, wait_for
from shared.settings import KitSettings
from shared.stop import fleet_stop_topic, stop_topic
from shared.tools.asyncapi import build_document
from shared.tools.localbroker import NodeProcess, mosquitto_bin
from tests.dashboard.stack import browser, browser_missing, free_ports
from tests.deploy.deployfiles import host_broker_conf, make_secrets
from tests.deploy.mqttprobe import creds
from tests.kit import motion_node

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
T = 45_000  # ms: generous waits for a loaded 2-core machine; the conditions, not the waits, are the test
NODE = "motion-test"
ROOT = "robobus"
# The one writer of {root}/_stop/fleet at a site is its bridge (the centre's stop, remapped; no client may write it):
# this user stands in for it in the broker's password and ACL files of the test.
FLEET_WRITER = "fleetstand"


@dataclass
class Stack:
    secrets: Path
    port: int
    ws_port: int
    server: Any
    node: NodeProcess
    operator: RpcClient
    fleet: RpcClient | None = None

    def settings(self, user: str) -> KitSettings:
        name, password = creds(self.secrets, user)
        return KitSettings(mqtt_url=f"mqtt://127.0.0.1:{self.port}", mqtt_username=name, mqtt_password=password)

    def retained_stop(self) -> dict[str, Any] | None:
        got = [p for t, p, _ in self.operator.collect_retained(stop_topic(ROOT))]
        return json.loads(got[-1]) if got and got[-1] else None

    def health(self, device: str) -> dict[str, Any]:
        got = [p for _, p, _ in self.operator.collect_retained(f"{ROOT}/{NODE}/{device}/health") if p]
        return dict(json.loads(got[-1]))

    def set_stop(self, active: bool, reason: str = "") -> StopState:
        stop = StopState(active=active, source="operator@test", reason=reason, ts=time.time())
        assert self.operator.session.publish_wait(stop_topic(ROOT), stop.model_dump_json(), qos=1, retain=True)
        return stop

    def set_fleet_stop(self, active: bool, reason: str = "") -> StopState:
        """The fleet centre's stop or release, as the site's bridge brings it in."""
        assert self.fleet is not None
        stop = StopState(active=active, source="centre-op@hq", reason=reason, ts=time.time())
        assert self.fleet.session.publish_wait(fleet_stop_topic(ROOT), stop.model_dump_json(), qos=1, retain=True)
        return stop


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    why = browser_missing()
    if why:
        pytest.skip(why)
    from shared.tools.dashboard.relay import Upstream
    from shared.tools.dashboard.server import DashboardServer, PageConfig, Relay

    exe = mosquitto_bin()
    assert exe
    d = tmp_path_factory.mktemp("stop-secrets")
    assert make_secrets.main(["--dir", str(d), "--root", ROOT, "--node", NODE]) == 0
    with (d / "passwd").open("a") as f:
        f.write(f"{FLEET_WRITER}:{make_secrets.hash_password(FLEET_WRITER + '-password')}\n")
    with (d / "acl").open("a") as f:
        f.write(f"\nuser {FLEET_WRITER}\ntopic readwrite {fleet_stop_topic(ROOT)}\n")
    port, ws_port = free_ports(2)
    conf = d / "mosquitto.conf"
    conf.write_text(host_broker_conf(d, port, f"listener {ws_port} 127.0.0.1\nprotocol websockets\n"))
    log = (d / "mosquitto.log").open("wb")
    broker = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    server = None
    node = None
    operator = None
    fleet = None
    try:
        assert wait_for(lambda: _listening(port) and _listening(ws_port), 20), (d / "mosquitto.log").read_text()
        name, password = creds(d, NODE)
        node = NodeProcess(["-m", "tests.kit.motion_node"], {
            "ROBOBUS_MQTT_URL": f"mqtt://127.0.0.1:{port}", "ROBOBUS_MQTT_USERNAME": name,
            "ROBOBUS_MQTT_PASSWORD": password})
        # the page's default broker is the server's relay, as `robobus dashboard` gives it (the viewer's page
        # uses it: the broker's PUBACK reaches the page through it); the operator's goes to the websockets listener
        server = DashboardServer(build_document([motion_node.API]), PageConfig(relay=True), port=free_ports(1)[0],
                                 relay=Relay(Upstream("127.0.0.1", port))).start()
        st = Stack(d, port, ws_port, server, node, None)  # type: ignore[arg-type]
        operator = RpcClient(st.settings("operator"), name="stop-dash-test")
        operator.connect()
        st.operator = operator
        fleet = RpcClient(KitSettings(mqtt_url=f"mqtt://127.0.0.1:{port}", mqtt_username=FLEET_WRITER,
                                      mqtt_password=FLEET_WRITER + "-password"), name="fleet-stand-in")
        fleet.connect()
        st.fleet = fleet

        def online() -> bool:
            healths = {t.split("/")[2] for t, p, _ in operator.collect_retained(f"{ROOT}/{NODE}/+/health") if p}
            return {"wheel1", "wheel2", "sensor1"} <= healths

        assert wait_for(online, 60, 0.5), node.text()
        yield st
    finally:
        for c in (operator, fleet):
            if c is not None:
                c.close()
        if server is not None:
            server.stop()
        if node is not None:
            node.stop()
        broker.kill()
        broker.wait(5)
        log.close()


def login(ctx: Any, stack: Stack, user: str) -> Any:
    """A page of the dashboard logged in to the broker as `user` (the deployment's password for it): the
    operator's on the broker's websockets listener, the viewer's through the dashboard's relay (/mqtt)."""
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    ws = f"ws://127.0.0.1:{stack.ws_port}" if user == "operator" else stack.server.url.replace("http", "ws") + "mqtt"
    page.goto(f"{stack.server.url}?username={user}&broker={ws}")  # (the pages share one browser's storage)
    page.wait_for_selector("#stop-button", timeout=T)
    from playwright.sync_api import expect

    expect(page.locator("#connect input[name=url]")).to_have_value(ws, timeout=T)
    page.fill("#connect input[name=password]", creds(stack.secrets, user)[1])
    page.click("#connect button[type=submit]")
    try:
        page.wait_for_selector("#conn[data-state=connected]", timeout=T)
    except Exception as exc:
        raise AssertionError(f"{user} not connected: {page.inner_text('#conn')!r}; {errors}") from exc
    return page


@pytest.fixture(scope="module")
def pages(stack: Stack) -> Iterator[dict[str, Any]]:
    with browser() as ctx:
        out = {user: login(ctx, stack, user) for user in ("operator", "viewer")}
        yield out
        for user, page in out.items():
            assert not page.errors, (user, page.errors)


def card(page: Any, device: str) -> Any:
    return page.locator(f"article.device[data-node='{NODE}'][data-device='{device}']")


def send_move(page: Any, device: str, speed: str) -> dict[str, Any]:
    """The `move` command from the device card's form: its reply as the page shows it."""
    c = card(page, device)
    c.locator("details.commands").evaluate("e => { e.open = true; }")
    cmd = c.locator("details.command[data-command='move']")
    cmd.evaluate("e => { e.open = true; }")
    cmd.scroll_into_view_if_needed()
    reply = cmd.locator("pre.reply")
    reply.evaluate("e => { e.textContent = ''; }")  # the previous reply gone: wait for this one's
    cmd.locator("input[name=speed]").fill(speed)
    cmd.locator("button[type=submit]").click()
    page.wait_for_function("e => e.textContent.trim() !== '' && e.dataset.ok !== undefined",
                           arg=reply.element_handle(), timeout=T)
    return dict(json.loads(reply.inner_text()))


def stopped(stack: Stack, device: str) -> bool:
    return bool(stack.health(device)["state"] == "stopped")


def outcome(page: Any) -> tuple[str, str]:
    """What became of the page's stop or release (#stop-result), once it is settled."""
    page.wait_for_selector("#stop-result:not([data-outcome=none]):not([data-outcome=sending])", timeout=T)
    r = page.locator("#stop-result")
    return str(r.get_attribute("data-outcome")), r.inner_text()


def test_the_stop_button_stops_the_motion_devices_and_release_lets_them_move(stack: Stack,
                                                                              pages: dict[str, Any]) -> None:
    page = pages["operator"]
    # always on screen, and the state read: no stop on a fresh broker
    assert page.locator("#stop-button").is_visible()
    page.wait_for_selector("#stop-state[data-state=none]", timeout=T)
    assert page.locator("#release-button").is_hidden()
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=ok]", timeout=T)
    assert send_move(page, "wheel1", "1.5")["ok"] is True

    reason = "hand in the way"
    page.fill("#stop-reason", reason)
    page.click("#stop-button")
    assert outcome(page)[0] == "confirmed", outcome(page)
    # what went on the wire: retained, the dashboard and the user named, the reason
    held = stack.retained_stop()
    assert held is not None and held["active"] is True and held["reason"] == reason, held
    assert held["source"] == f"operator via dashboard {stack.server.url.split('/')[2]}", held
    # the header: active, since when, by whom, why; every online node answered
    state = page.locator("#stop-state[data-state=active]")
    state.wait_for(timeout=T)
    text = state.inner_text()
    assert "BUS STOP ACTIVE since" in text and held["source"] in text and reason in text, text
    assert page.locator("#release-button").is_visible()
    page.wait_for_selector("#stop-answers[data-answered='1'][data-online='1']", timeout=T)
    # each motion device: held stopped by the node (its health), the stop written, shown on its card
    for dev in ("wheel1", "wheel2"):
        assert wait_for(partial(stopped, stack, dev), 20), stack.health(dev)
        c = card(page, dev)
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stopped]", timeout=T)
        assert c.locator("header .badge").inner_text() == "STOPPED"
        line = c.locator(".stop-line[data-stop=stopped]")
        line.wait_for(timeout=T)
        words = line.inner_text()
        assert held["source"] in words and reason in words and "the stop reached the device at" in words, words
    # the read-only device is no motion device: no stop line, its health untouched
    page.wait_for_selector("article.device[data-device='sensor1'][data-motion=false][data-health=ok]", timeout=T)
    assert card(page, "sensor1").locator(".stop-line").is_hidden()
    # the node's answer in the nodes table: which devices, when the stop reached each
    cell = page.locator(f"tr.node[data-node='{NODE}'] td.stop[data-answer=current]")
    cell.wait_for(timeout=T)
    words = cell.inner_text()
    assert "wheel1 at" in words and "wheel2 at" in words, words
    # a motion command from the page's form is refused by the node: `stopped`
    rep = send_move(page, "wheel1", "2")
    assert rep["ok"] is False and rep["error"]["code"] == "stopped", rep
    page.screenshot(path=str(stack.secrets / "stopped.png"))

    page.fill("#stop-reason", "")
    page.click("#release-button")
    assert outcome(page)[0] == "confirmed", outcome(page)
    held = stack.retained_stop()
    assert held is not None and held["active"] is False, held
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    assert "released" in page.inner_text("#stop-state") and page.locator("#release-button").is_hidden()
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=ok]", timeout=T)
        card(page, dev).locator(".stop-line[data-stop=released]").wait_for(timeout=T)
    page.wait_for_selector(f"tr.node[data-node='{NODE}'] td.stop[data-answer=current]", timeout=T)
    assert "released" in page.inner_text(f"tr.node[data-node='{NODE}'] td.stop")
    assert send_move(page, "wheel1", "0")["ok"] is True


def test_a_viewer_is_offered_the_release_and_shown_the_brokers_refusal(stack: Stack, pages: dict[str, Any]) -> None:
    """The page cannot know the ACL in advance: the viewer's page offers the release, the broker refuses it (MQTT 5
    PUBACK 135 not authorized, through the dashboard's relay) and the page says so; the stop holds. The viewer's
    stop is refused the same way."""
    page = pages["viewer"]
    stop = stack.set_stop(True, "operator's stop")
    page.wait_for_selector("#stop-state[data-state=active]", timeout=T)
    page.wait_for_selector("article.device[data-device='wheel1'][data-health=stopped]", timeout=T)
    card(page, "wheel1").locator(".stop-line[data-stop=stopped]").wait_for(timeout=T)
    release = page.locator("#release-button")
    assert release.is_visible()
    release.click()
    result = page.locator("#stop-result[data-outcome=refused]")
    result.wait_for(timeout=T)
    words = result.inner_text()
    assert "REFUSED" in words and "not authorized" in words and "135" in words and "operator" in words, words
    # nothing changed: the operator's stop is still the broker's, the devices still stopped
    assert stack.retained_stop() == json.loads(stop.model_dump_json())
    assert stack.health("wheel1")["state"] == "stopped"
    assert page.locator("#stop-state[data-state=active]").count() == 1
    assert "operator's stop" in page.inner_text("#stop-state")

    page.evaluate("() => { document.querySelector('#stop-result').dataset.outcome = 'none'; }")
    page.click("#stop-button")
    page.locator("#stop-result[data-outcome=refused]").wait_for(timeout=T)
    assert stack.retained_stop() == json.loads(stop.model_dump_json())

    stack.set_stop(False)
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    page.wait_for_selector("article.device[data-device='wheel1'][data-health=ok]", timeout=T)


def test_an_unreadable_stop_message_is_shown_as_an_active_stop_and_released_from_the_page(
        stack: Stack, pages: dict[str, Any]) -> None:
    """Garbage on {root}/_stop is held as an active stop by every node (shared/stop.py); the page says so, counts
    it, shows the node's answer to it on the cards, and offers the release. A reason longer than the schema's
    500 characters is cut, never a reason not to send."""
    from playwright.sync_api import expect

    page = pages["operator"]
    stack.set_stop(False)
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    bad_before = page.evaluate("() => window.__robobusPerf.bad")
    assert stack.operator.session.publish_wait(stop_topic(ROOT), b"{not json", qos=1, retain=True)
    state = page.locator("#stop-state[data-state=active]")
    expect(state).to_contain_text("unreadable stop message", timeout=T)
    assert page.evaluate("() => window.__robobusPerf.bad") > bad_before
    assert page.locator("#event-log li[data-event=unreadable]").count() >= 1
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stopped]", timeout=T)
        line = card(page, dev).locator(".stop-line[data-stop=stopped]")
        line.wait_for(timeout=T)
        assert "unreadable stop message" in line.inner_text()
    assert page.locator("#release-button").is_visible()
    page.fill("#stop-reason", "x" * 600)
    page.click("#release-button")
    assert outcome(page)[0] == "confirmed", outcome(page)
    held = stack.retained_stop()
    assert held is not None and held["active"] is False and held["reason"] == "x" * 500, held
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=ok]", timeout=T)
    page.fill("#stop-reason", "")


def test_the_fleets_stop_is_shown_and_the_pages_release_lifts_only_the_sites(stack: Stack,
                                                                              pages: dict[str, Any]) -> None:
    """A stop on {root}/_stop/fleet (the centre's): the header names it as the fleet's, says that the centre alone
    releases it, and offers no release; the devices show it. With the site's stop on top, the page's release lifts
    the site's latch only: the fleet's stop still holds (the devices stopped, `move` refused) until the centre
    releases it."""
    from playwright.sync_api import expect

    page, viewer = pages["operator"], pages["viewer"]
    stack.set_stop(False)
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    expect(page.locator("#stop-note")).to_be_hidden(timeout=T)
    fleet = stack.set_fleet_stop(True, "fleet drill")
    for p in (page, viewer):  # the viewer reads the fleet's latch too
        state = p.locator("#stop-state[data-state=active][data-channel=fleet]")
        state.wait_for(timeout=T)
        expect(state).to_contain_text("FLEET BUS STOP ACTIVE since", timeout=T)
        expect(state).to_contain_text(f"{fleet.source}: fleet drill", timeout=T)
        note = p.locator("#stop-note")
        expect(note).to_be_visible(timeout=T)
        expect(note).to_contain_text("only the centre releases it", timeout=T)
        expect(note).to_contain_text("This page's release lifts only the site's stop", timeout=T)
        expect(p.locator("#release-button")).to_be_hidden(timeout=T)
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stopped]", timeout=T)
        line = card(page, dev).locator(".stop-line[data-stop=stopped]")
        line.wait_for(timeout=T)
        expect(line).to_contain_text(f"FLEET BUS STOP by {fleet.source}: fleet drill", timeout=T)
    cell = page.locator(f"tr.node[data-node='{NODE}'] td.stop[data-answer=current]")
    expect(cell).to_contain_text("stopped by the fleet's stop", timeout=T)
    page.wait_for_selector("#stop-answers[data-answered='1'][data-online='1']", timeout=T)
    # the page's model: both latches
    view = page.evaluate("() => window.__robobus.stop.view()")
    assert view["active"] == ["fleet"] and view["channel"] == "fleet" and view["release"] is False, view
    assert view["latches"]["fleet"]["state"]["reason"] == "fleet drill", view
    assert view["latches"]["site"]["state"]["active"] is False, view

    # the site's stop on top of it: both latches; the page's release lifts the site's only
    page.fill("#stop-reason", "site too")
    page.click("#stop-button")
    assert outcome(page)[0] == "confirmed", outcome(page)
    page.wait_for_selector("#stop-state[data-state=active][data-channel=both]", timeout=T)
    expect(page.locator("#release-button")).to_be_visible(timeout=T)
    expect(page.locator("#stop-note")).to_be_visible(timeout=T)
    page.fill("#stop-reason", "")
    page.click("#release-button")
    assert outcome(page)[0] == "confirmed", outcome(page)
    held = stack.retained_stop()
    assert held is not None and held["active"] is False, held
    page.wait_for_selector("#stop-state[data-state=active][data-channel=fleet]", timeout=T)
    expect(page.locator("#release-button")).to_be_hidden(timeout=T)
    expect(cell).to_contain_text("still stopped", timeout=T)  # the node's answer to the site's release
    for dev in ("wheel1", "wheel2"):
        assert stopped(stack, dev), stack.health(dev)
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stopped]", timeout=T)
    rep = send_move(page, "wheel1", "1")
    assert rep["ok"] is False and rep["error"]["code"] == "stopped" and "fleet" in rep["error"]["message"], rep

    # the centre releases: nothing holds the bus
    stack.set_fleet_stop(False)
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    expect(page.locator("#stop-note")).to_be_hidden(timeout=T)
    for dev in ("wheel1", "wheel2"):
        page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=ok]", timeout=T)
    assert send_move(page, "wheel1", "0")["ok"] is True
