"""The dashboard end to end in Debian's headless chromium, against `make run`'s stack on free ports
(tests/dashboard/stack.py): what a person sees and does, as the issue lists it. Screenshots of the main
views go to docs/dashboard/ for the README."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.can_bootloader.sim import make_intel_hex
from shared.localbroker import REPO
from shared.rpc import RpcClient
from tests.dashboard.stack import DEVICES, NODES, SimStack, browser, browser_missing, sim_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SHOTS = REPO / "docs" / "dashboard"
SMALL_HEX = make_intel_hex(0x1000, 0x13FF)
T = 45_000  # ms: generous waits for a loaded 2-core machine; the conditions, not the waits, are the test


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[SimStack, RpcClient]]:
    why = browser_missing()
    if why:
        pytest.skip(why)
    with sim_stack() as s:
        yield s


@pytest.fixture(scope="module")
def page(stack: tuple[SimStack, RpcClient]) -> Iterator[Any]:
    st, _ = stack
    with browser() as ctx:
        pg = ctx.new_page()
        errors: list[str] = []
        console: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        pg.goto(f"{st.dashboard_url}?broker={st.broker.ws_url}")
        try:
            pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        except Exception as exc:
            raise AssertionError(f"page not connected: {pg.inner_text('#conn')!r}; {errors}; {console[-10:]}") from exc
        pg.errors = errors
        yield pg
        assert not errors, errors


def card(page: Any, node: str, device: str) -> Any:
    return page.locator(f"article.device[data-node='{node}'][data-device='{device}']")


def open_command(page: Any, node: str, device: str, command: str) -> Any:
    c = card(page, node, device)
    c.locator("details.commands").evaluate("e => { e.open = true; }")  # a click would toggle it shut again
    cmd = c.locator(f"details.command[data-command='{command}']")
    cmd.evaluate("e => { e.open = true; }")
    cmd.scroll_into_view_if_needed()
    return cmd


def on_screen(page: Any, node: str, device: str) -> None:
    """Scroll a device's card to the top of the view: the page receives and draws the states of the cards on
    screen only."""
    card(page, node, device).wait_for(state="attached", timeout=T)
    card(page, node, device).evaluate("e => e.scrollIntoView({block: 'start'})")


def shoot(page: Any, name: str, target: Any | None = None) -> None:
    """The window as a person sees it, with `target` scrolled to the top."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    if target is not None:
        target.evaluate("e => e.scrollIntoView({block: 'start'})")
    else:
        page.evaluate("() => document.querySelector('main').scrollTo(0, 0)")
    page.wait_for_timeout(300)  # two animation frames of drawing after the scroll
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def expected_health(h: dict[str, Any]) -> str:
    """The page's word for a health message (OK, ERROR / NOT CONNECTED, NOT OPERATIONAL) as a data-health."""
    if h["error"] or not h["connection"]:
        return "error"
    return "ok" if h["operational"] else "warn"


def test_lists_every_online_node_and_device(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """Every node of `make run` online, every device of each with the health its service reports (ROI modules
    start in their blank state, NOT OPERATIONAL until configured: the page says so)."""
    _, client = stack
    healths = {tuple(t.split("/")[1:3]): json.loads(p) for t, p, _ in client.collect("robobus/+/+/health", 1.0) if p}
    for node in NODES:
        page.wait_for_selector(f"tr.node[data-node='{node}'][data-status=online]", timeout=T)
        for dev in DEVICES[node]:
            want = expected_health(healths[(node, dev)])
            page.wait_for_selector(f"tr.node[data-node='{node}'] .chip[data-device='{dev}'][data-health={want}]",
                                   timeout=T)
            page.wait_for_selector(f"article.device[data-node='{node}'][data-device='{dev}'][data-health={want}]",
                                   timeout=T)
    assert page.locator("article.device").count() == sum(len(d) for d in DEVICES.values())
    assert page.locator("tr.node").count() == len(NODES)
    # status words, not colour alone
    assert "online" in page.locator("tr.node[data-node='ethercat-loop'] td.status").inner_text()
    assert "OK" in card(page, "epuck-gateway", "epuck1").locator("header .badge").inner_text()
    shoot(page, "overview")


def test_a_form_for_every_command_of_the_document(page: Any) -> None:
    """The forms come from the AsyncAPI document, not from code per service: every command and job of every
    service (with the kit's `cancel` for services that have jobs) has its form on each of its devices."""
    from shared.registry import service_apis

    apis = {a.service: a for a in service_apis()}
    for node, devices in DEVICES.items():
        api = apis[node]
        expected = set(api.commands) | set(api.jobs) | ({"cancel"} if api.jobs else set())
        for dev in devices:
            c = card(page, node, dev)
            c.locator("details.command").first.wait_for(state="attached", timeout=T)
            shown = set(c.locator("details.command").evaluate_all("els => els.map(e => e.dataset.command)"))
            assert shown == expected, (node, dev, shown ^ expected)
            assert c.locator("form.cmd").count() == len(expected)


SAMPLES_JS = """([node, dev, state, path]) => {
  const s = window.__robobus.nodes.get(node)?.devices.get(dev)?.states.get(state)?.series.get(path);
  return s ? s.count : -1;
}"""


def _samples(page: Any, key: list[str]) -> int:
    return int(page.evaluate(SAMPLES_JS, key))


def test_charts_receive_values(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    _, client = stack
    hand = ["ethercat-loop", "rh", "joints", "joints.FFJ3.position"]
    on_screen(page, "ethercat-loop", "rh")
    page.wait_for_selector("article.device[data-device='rh'] details.state[data-state='joints'] "
                           "figure.spark[data-path='joints.FFJ3.position']", state="attached", timeout=T)
    # integer fields chart once they change: drive the robot so its step counters move
    assert client.call("epuck-gateway", "epuck1", "set_speed", {"left": 400, "right": 300}).ok
    on_screen(page, "epuck-gateway", "epuck1")
    steps_fig = page.locator("article.device[data-device='epuck1'] details.state[data-state='sensors'] "
                             "figure.spark[data-path^='steps']").first
    steps_fig.wait_for(state="attached", timeout=T)
    steps = ["epuck-gateway", "epuck1", "sensors", str(steps_fig.get_attribute("data-path"))]
    for key in (hand, steps):
        on_screen(page, key[0], key[1])
        first = _samples(page, key)
        assert first >= 0, key
        page.wait_for_function(f"n => ({SAMPLES_JS})({json.dumps(key)}) > n + 10", arg=first, timeout=T)
    # the value beside the chart is a number, drawn once the card is on screen
    fig = page.locator("article.device[data-device='rh'] figure.spark[data-path='joints.FFJ3.position']")
    fig.scroll_into_view_if_needed()
    page.wait_for_function("e => e.textContent.trim() !== ''", arg=fig.locator("figcaption b").element_handle(),
                           timeout=T)
    float(fig.locator("figcaption b").inner_text())
    shoot(page, "hand-joints", card(page, "ethercat-loop", "rh"))


def test_states_off_screen_are_unsubscribed(page: Any) -> None:
    """A card out of view has its state topics unsubscribed (its samples stop), and subscribed again when it
    scrolls back in (they resume); a folded state is unsubscribed too: the browser does not receive what it
    does not show."""
    hand = ["ethercat-loop", "rh", "joints", "joints.FFJ3.position"]
    on_screen(page, "ethercat-loop", "rh")
    page.wait_for_function(f"() => ({SAMPLES_JS})({json.dumps(hand)}) > 0", timeout=T)
    # the last card in the page's order: the hand's card is then far out of view
    last = page.locator("article.device").last
    last.evaluate("e => e.scrollIntoView({block: 'end'})")
    watched = "k => window.__robobus.watched().some(f => f.startsWith(`robobus/${k}/state/`))"
    page.wait_for_function(f"() => !({watched})('ethercat-loop/rh')", timeout=T)
    # nothing in flight any more: two reads a parse tick apart agree (what was sent before the UNSUBACK
    # has arrived once the samples stand still)
    page.wait_for_function(f"""() => new Promise(r => {{ const a = ({SAMPLES_JS})({json.dumps(hand)});
        setTimeout(() => r(({SAMPLES_JS})({json.dumps(hand)}) === a), 600); }})""", timeout=T)
    stopped = _samples(page, hand)
    page.wait_for_timeout(1500)  # at 100 Hz, a state still subscribed would add 10+ samples here
    assert _samples(page, hand) == stopped
    on_screen(page, "ethercat-loop", "rh")
    page.wait_for_function(f"() => ({watched})('ethercat-loop/rh')", timeout=T)
    page.wait_for_function(f"n => ({SAMPLES_JS})({json.dumps(hand)}) > n + 5", arg=stopped, timeout=T)
    # each state of the document its own subscription: folding the joints drops theirs, unfolding takes it again
    joints = card(page, "ethercat-loop", "rh").locator("details.state[data-state='joints']")
    has = "f => window.__robobus.watched().includes(f)"
    topic = "robobus/ethercat-loop/rh/state/joints"
    joints.evaluate("e => { e.open = false; }")
    page.wait_for_function(f"f => !({has})(f)", arg=topic, timeout=T)
    joints.evaluate("e => { e.open = true; }")
    page.wait_for_function(f"f => ({has})(f)", arg=topic, timeout=T)


def test_camera_image_updates(page: Any) -> None:
    on_screen(page, "epuck-gateway", "epuck2")
    img = card(page, "epuck-gateway", "epuck2").locator("details.state[data-state='image'] canvas.image")
    img.wait_for(timeout=T)
    img.scroll_into_view_if_needed()
    first = int(img.get_attribute("data-frames") or 0)
    page.wait_for_function(
        "n => +document.querySelector(\"article[data-device='epuck2'] details[data-state='image'] canvas\")"
        ".dataset.frames >= n + 5", arg=first, timeout=T)
    # the gateway's 160x120 JPEG, decoded
    assert (img.get_attribute("data-width"), img.get_attribute("data-height")) == ("160", "120")
    shoot(page, "epuck", card(page, "epuck-gateway", "epuck2"))


def test_set_speed_form_sends_and_shows_the_reply(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    _, client = stack
    seen: list[Any] = []
    client.subscribe_before("robobus/epuck-gateway/epuck1/cmd/set_speed", seen.append)
    cmd = open_command(page, "epuck-gateway", "epuck1", "set_speed")
    cmd.locator("input[name=left]").fill("200")
    cmd.locator("input[name=right]").fill("-150")
    cmd.locator("button[type=submit]").click()
    reply = cmd.locator("pre.reply[data-ok=true]")
    reply.wait_for(timeout=T)
    body = json.loads(reply.inner_text())
    assert body["ok"] is True, body
    # MQTT 5 request/response as the contract says: a Response Topic and Correlation Data on the request
    assert seen, "the request never reached the broker"
    props = seen[-1].properties
    assert props.ResponseTopic.startswith("robobus/_client/") and props.CorrelationData
    assert json.loads(seen[-1].payload) == {"left": 200, "right": -150}
    shoot(page, "command-form", cmd)


def test_invalid_value_is_refused_with_the_schema_message(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    _, client = stack
    seen: list[Any] = []
    client.subscribe_before("robobus/epuck-gateway/epuck2/cmd/set_speed", seen.append)
    cmd = open_command(page, "epuck-gateway", "epuck2", "set_speed")
    cmd.locator("input[name=left]").fill("5000")
    cmd.locator("input[name=right]").fill("")
    cmd.locator("button[type=submit]").click()
    page.wait_for_selector("article[data-device='epuck2'] form[data-command='set_speed'][data-result=refused]",
                           timeout=T)
    # Ajv's words for the schema's `maximum: 1000` and `required`, next to each field
    assert cmd.locator(".field[data-field='left'] .err").inner_text() == "must be <= 1000"
    assert cmd.locator(".field[data-field='right'] .err").inner_text() == "is required"
    time.sleep(0.5)  # nothing may arrive: the page refused before sending
    assert seen == []
    shoot(page, "command-refused", cmd)


def test_service_side_validation_error_is_shown(page: Any) -> None:
    # FlashRequest needs exactly one of hex / path: a rule of the service, not of the JSON Schema
    cmd = open_command(page, "can-bootloader", "motors", "flash")
    cmd.locator("input[name=board]").fill("3")
    cmd.locator("button[type=submit]").click()
    reply = cmd.locator("pre.reply[data-ok=false]")
    reply.wait_for(timeout=T)
    body = json.loads(reply.inner_text())
    assert body["error"]["code"] == "invalid_request" and "hex" in body["error"]["message"], body


def test_flash_job_shows_progress_and_completes(page: Any) -> None:
    cmd = open_command(page, "can-bootloader", "motors", "flash")
    cmd.locator("input[name=board]").fill("8")
    cmd.locator("textarea[name=hex]").evaluate("(e, v) => { e.value = v; }", SMALL_HEX)
    cmd.locator("button[type=submit]").click()
    cmd.locator("pre.reply[data-ok=true]").wait_for(timeout=T)
    job_id = json.loads(cmd.locator("pre.reply").inner_text())["result"]["job_id"]
    job = card(page, "can-bootloader", "motors").locator(f".job[data-job-id='{job_id}']")
    # progress was drawn (a phase from event/job_progress), then the result
    page.wait_for_selector(f".job[data-job-id='{job_id}'][data-phase]", state="attached", timeout=T)
    page.wait_for_selector(f".job[data-job-id='{job_id}'][data-state=ok]", timeout=60_000)
    assert job.locator("progress").get_attribute("value") == "1"
    assert "done in" in job.locator(".result").inner_text()
    assert page.locator("#event-log li[data-event=job_result]").count() >= 1
    shoot(page, "job", card(page, "can-bootloader", "motors"))


def test_cancel_button_cancels_a_running_job(page: Any) -> None:
    cmd = open_command(page, "can-bootloader", "motors", "flash")
    cmd.locator("input[name=board]").fill("9")
    # the full image, one frame in flight: slow enough to cancel (set as a paste would, not typed)
    cmd.locator("textarea[name=hex]").evaluate("(e, v) => { e.value = v; }", make_intel_hex())
    cmd.locator("input[name=window]").fill("1")
    cmd.locator("button[type=submit]").click()
    cmd.locator("pre.reply[data-ok=true]").wait_for(timeout=T)
    job_id = json.loads(cmd.locator("pre.reply").inner_text())["result"]["job_id"]
    page.wait_for_selector(f".job[data-job-id='{job_id}'][data-phase]", state="attached", timeout=T)
    job = page.locator(f".job[data-job-id='{job_id}']")
    job.locator("button").dispatch_event("click")
    try:
        page.wait_for_selector(f".job[data-job-id='{job_id}'][data-state=cancelled]", timeout=T)
    except Exception as exc:
        raise AssertionError(f"{job.get_attribute('data-state')}: {job.inner_text()}") from exc


def test_garbage_on_the_bus_is_counted_not_fatal(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    _, client = stack
    before = int(page.evaluate("() => window.__robobusPerf.bad"))
    on_screen(page, "epuck-gateway", "epuck1")  # its states are subscribed while they are on screen
    page.wait_for_function("() => window.__robobus.watched().includes('robobus/epuck-gateway/epuck1/state/link')",
                           timeout=T)
    # `link` comes once a second: garbage there is the newest message of the page's 100 ms parse tick (the
    # newest wins) at least once in three tries
    for _ in range(3):
        client.session.publish("robobus/epuck-gateway/epuck1/state/link", b"\xff{not json", qos=1)
        time.sleep(0.3)
    client.session.publish("robobus/epuck-gateway/epuck1/event/fault", b"[1, 2", qos=1)
    page.wait_for_function("n => window.__robobusPerf.bad >= n + 2", arg=before, timeout=T)
    page.wait_for_selector("#event-log li.fault:has-text('bad message')", state="attached", timeout=T)
    assert "bad messages" in page.inner_text("#perf") or page.evaluate("() => window.__robobusPerf.bad") >= 2
    # the page goes on: the device's next real link stats still arrive
    key = ["epuck-gateway", "epuck1", "link", "packets_per_s"]
    n = _samples(page, key)
    page.wait_for_function(f"n => ({SAMPLES_JS})({json.dumps(key)}) > n", arg=n, timeout=T)


def test_browser_side_load_figures(page: Any) -> None:
    """The page's own counters under the full simulated stack (the benchmark, bench/dashboard.py, runs
    longer and compares with the targets); here: the figures exist and the page keeps drawing."""
    from tests.dashboard.stack import measure_page

    fig = measure_page(page, 5.0)
    assert fig["fps"] > 0 and fig["msgs_per_s"] > 0 and fig["handling_pct_of_core"] > 0, fig
    assert fig["browser_cpu_pct_all_processes"] > 0 and fig["bad_messages"] == 0, fig


def test_the_page_through_the_dashboards_relay(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """The same page on the dashboard server's relay (/mqtt, what `robobus dashboard` gives it by default):
    every node online, the hand's joints charted, the camera drawn, a command's reply shown, and the messages
    arriving in fewer websocket frames than messages (several MQTT packets per frame)."""
    st, _ = stack
    relay = st.dashboard_url.replace("http://", "ws://") + "mqtt"
    pg = page.context.new_page()  # a second tab of the same browser
    try:
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(f"{st.dashboard_url}?broker={relay}")
        pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        for node in NODES:
            pg.wait_for_selector(f"tr.node[data-node='{node}'][data-status=online]", timeout=T)
        hand = ["ethercat-loop", "rh", "joints", "joints.FFJ3.position"]
        on_screen(pg, "ethercat-loop", "rh")
        pg.wait_for_function(f"() => ({SAMPLES_JS})({json.dumps(hand)}) > 0", timeout=T)
        perf = "() => ({msgs: window.__robobusPerf.msgs, frames: window.__robobus.wsFrames()})"
        a = pg.evaluate(perf)
        first = _samples(pg, hand)
        pg.wait_for_function(f"n => ({SAMPLES_JS})({json.dumps(hand)}) > n + 20", arg=first, timeout=T)
        b = pg.evaluate(perf)
        msgs, frames = b["msgs"] - a["msgs"], b["frames"] - a["frames"]
        assert msgs > 0 and frames < msgs, (msgs, frames)
        on_screen(pg, "epuck-gateway", "epuck2")
        img = "article[data-device='epuck2'] details[data-state='image'] canvas"
        pg.wait_for_function(f"() => +document.querySelector(\"{img}\").dataset.frames >= 5", timeout=T)
        cmd = open_command(pg, "epuck-gateway", "epuck1", "set_speed")
        cmd.locator("input[name=left]").fill("100")
        cmd.locator("input[name=right]").fill("100")
        cmd.locator("button[type=submit]").click()
        cmd.locator("pre.reply[data-ok=true]").wait_for(timeout=T)
        assert not errors, errors
    finally:
        pg.close()


def test_killing_a_node_turns_it_offline_within_3_s(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    st, _ = stack
    page.wait_for_selector("tr.node[data-node='epuck-gateway'][data-status=online]", timeout=T)
    t_kill = time.time()
    st.kill("epuck-gateway", signal.SIGKILL)  # no clean shutdown: the broker's Last Will tells
    # The page stamps when it learned (Date.now() on the status message); drawing follows on its next tick.
    # Measured on the page's side so that a starved browser on a busy machine draws late, but the test still
    # holds the page to the 3 s from the kill to knowing.
    page.wait_for_selector("tr.node[data-node='epuck-gateway'][data-status=offline]", timeout=T)
    learned = page.locator("tr.node[data-node='epuck-gateway']").get_attribute("data-changed-at")
    elapsed = float(learned or "inf") / 1000 - t_kill
    assert 0 <= elapsed < 3.0, elapsed
    page.wait_for_selector("article[data-device='epuck1'][data-health=offline]", timeout=T)
    assert "OFFLINE" in page.locator("tr.node[data-node='epuck-gateway'] td.status").inner_text()
    assert "connection lost" in page.locator("tr.node[data-node='epuck-gateway'] td.status").inner_text()
    page.wait_for_selector("#event-log li[data-event=offline]", timeout=T)
    shoot(page, "node-offline")


def test_screenshots_are_written() -> None:
    if browser_missing():
        pytest.skip(browser_missing() or "")
    names = {p.stem for p in Path(SHOTS).glob("*.png")}
    assert {"overview", "hand-joints", "epuck", "command-form", "job", "node-offline"} <= names, names
