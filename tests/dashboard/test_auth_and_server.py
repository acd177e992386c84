"""The dashboard's HTTP server on its own (routes, nothing outside them, a clear error without its npm
bundles) and the page against a broker that requires a user name and password."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from shared.rpc import wait_for
from shared.tools.asyncapi import build_document
from shared.tools.dashboard.relay import Upstream
from shared.tools.dashboard.server import DashboardServer, MissingAssets, PageConfig, Relay
from shared.tools.localbroker import REPO
from tests.dashboard.stack import WsBroker, browser, browser_missing, free_ports


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


@pytest.fixture
def server() -> Any:
    try:
        s = DashboardServer(build_document(), PageConfig(ws_url="ws://127.0.0.1:1", topic_root="site1/robobus"),
                            port=0).start()
    except MissingAssets as exc:
        pytest.skip(str(exc))
    yield s
    s.stop()


def test_serves_the_page_contract_config_and_bundles(server: DashboardServer) -> None:
    status, ctype, body = _get(server.url)
    assert status == 200 and ctype.startswith("text/html") and b"/static/app.js" in body
    status, ctype, body = _get(server.url + "api/asyncapi.json")
    assert status == 200 and json.loads(body) == json.loads(json.dumps(build_document()))
    assert json.loads(_get(server.url + "api/config.json")[2]) == {
        "ws_url": "ws://127.0.0.1:1", "topic_root": "site1/robobus", "username": "", "title": "robobus",
        "relay": "", "sites": ""}
    for name in ("app.js", "bus.js", "mqtt5.js", "contract.js", "forms.js", "charts.js", "fleet.js", "style.css"):
        status, ctype, _ = _get(server.url + f"static/{name}")
        assert status == 200, name
    status, ctype, body = _get(server.url + "vendor/ajv2020.min.js")
    assert status == 200 and ctype.startswith("text/javascript")
    assert _get(server.url + "vendor/mqtt.esm.js")[0] == 404  # the page's MQTT client is its own (mqtt5.js)


@pytest.mark.parametrize("path", ["static/../server.py", "static/%2e%2e/server.py", "vendor/../package.json",
                                  "node_modules/mqtt/package.json", "etc/passwd", "static/"])
def test_nothing_outside_the_routes(server: DashboardServer, path: str) -> None:
    assert _get(server.url + path)[0] == 404


def test_missing_bundles_name_the_fix() -> None:
    with tempfile.TemporaryDirectory() as d, pytest.raises(MissingAssets, match="make setup"):
        DashboardServer(build_document(), PageConfig(), port=0, node_modules=Path(d))


@pytest.mark.parametrize("via", ["broker", "relay"])
def test_broker_with_user_and_password(spawn: Any, via: str) -> None:
    """The page on the broker's websockets listener, or on the server's relay (its default when the server
    has one and no websockets URL is set): the broker's refusal and the login reach the page either way."""
    why = browser_missing()
    if why:
        pytest.skip(why)
    from playwright.sync_api import expect  # (with the browser: present whenever the test is not skipped)
    with tempfile.TemporaryDirectory(prefix="robobus-auth-") as d:
        broker = WsBroker(Path(d), users={"lab": "s3cret"})
        broker.start()
        if via == "relay":
            relay = Relay(Upstream("127.0.0.1", broker.port))
            server = DashboardServer(build_document(), PageConfig(relay=True), port=free_ports(1)[0],
                                     relay=relay).start()
        else:
            server = DashboardServer(build_document(), PageConfig(ws_url=broker.ws_url),
                                     port=free_ports(1)[0]).start()
        node = spawn(["-m", "services.can_bootloader"],
                     {"ROBOBUS_MQTT_URL": broker.url("lab"), "ROBOBUS_CAN_SIM": "true"})
        try:
            with browser() as ctx:
                page = ctx.new_page()
                page.goto(f"{server.url}?username=lab")
                expected = server.url.replace("http://", "ws://") + "mqtt" if via == "relay" else broker.ws_url
                # the page fills its form once its two fetches (contract, config) are in, after the load event:
                # wait for that, do not read it at once (a busy moment made it '' once)
                expect(page.locator("#connect input[name=url]")).to_have_value(expected, timeout=20_000)
                # with a user name the page waits for the password instead of connecting anonymously (the form
                # is filled and the decision taken in the same turn of the page's event loop)
                expect(page.locator("#conn")).to_have_attribute("data-state", "disconnected")
                page.fill("#connect input[name=password]", "wrong")
                page.click("#connect button")
                page.wait_for_selector("#conn[data-state=error]", timeout=20_000)
                text = page.inner_text("#conn")
                assert "user name or password" in text or "not authorized" in text, text
                page.fill("#connect input[name=password]", "s3cret")
                page.click("#connect button")
                page.wait_for_selector("#conn[data-state=connected]", timeout=20_000)
                page.wait_for_selector("tr.node[data-node='can-bootloader'][data-status=online]", timeout=30_000)
                page.wait_for_selector("article[data-device='motors'][data-health=ok]", timeout=30_000)
                # the password is never stored by the page
                saved = page.evaluate("() => localStorage.getItem('robobus.dashboard')")
                assert "s3cret" not in saved and json.loads(saved)["username"] == "lab"
                if via == "relay":
                    assert relay.stats and relay.stats.sessions >= 2 and relay.stats.frames_to_page > 0
        finally:
            node.stop()
            server.stop()
            broker.stop()



def test_the_docs_name_the_relay_as_the_pages_default_broker() -> None:
    """`robobus dashboard` gives the page its relay (/mqtt) unless a websockets URL is set: its start line, its
    --help, the setting's description and the README say so, not a broker's :9001 listener (the page's fallback
    only with ROBOBUS_DASHBOARD_RELAY=false)."""
    from shared.tools.dashboard.cli import DashboardSettings

    def relay_first(text: str) -> bool:
        """The relay named as the default; :9001, if at all, only as the case without the relay."""
        before, _, after = text.partition(":9001")
        return "/mqtt" in before and (not after or "ROBOBUS_DASHBOARD_RELAY=false" in after[:60])

    desc = DashboardSettings.model_fields["dashboard_ws_url"].description or ""
    assert "relay" in desc and relay_first(desc), desc
    readme = (REPO / "shared" / "tools" / "dashboard" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `ROBOBUS_DASHBOARD_WS_URL`"))
    assert relay_first(row), row
    running = readme.split("## Running it")[1].split("### Settings")[0]
    assert "ws://127.0.0.1:8080/mqtt" in running and "broker: the relay" in running, running
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBOBUS_DASHBOARD_")}
    env["ROBOBUS_MQTT_URL"] = "mqtt://127.0.0.1:1"  # the relay dials the broker per page: none needed here
    helptext = subprocess.run([sys.executable, "-m", "shared.tools.cli", "dashboard", "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60, check=True).stdout
    words = " ".join("".join(" " if c in "│╭╮╰╯─" else c for c in helptext).split())  # rich's box, unwrapped
    assert "default: the relay at /mqtt" in words, helptext
    port = free_ports(1)[0]
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen([sys.executable, "-m", "shared.tools.cli", "dashboard", "--port", str(port)], cwd=REPO,
                             env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            def started() -> bool:
                out.seek(0)
                return b"robobus dashboard:" in out.read()

            assert wait_for(started, 60, 0.2)
            out.seek(0)
            line = out.read().decode()
            config = json.loads(_get(f"http://127.0.0.1:{port}/api/config.json")[2])
        finally:
            p.terminate()
            p.wait(10)
    assert f"broker relay ws://127.0.0.1:{port}/mqtt" in line and "9001" not in line, line
    assert config["relay"] == "/mqtt" and config["ws_url"] == "", config
