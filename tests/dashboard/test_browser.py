"""The dashboard end to end in Debian's headless chromium, against `make run`'s stack on free ports
(tests/dashboard/stack.py): what a person sees and does, as the issue lists it. Screenshots of the main
views go to a temporary directory (a test never rewrites tracked files); `make screenshots` runs these tests
with ROBOBUS_DASHBOARD_SHOTS=docs/dashboard to refresh the README's pictures on purpose."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from services.can_bootloader.sim import make_intel_hex
from shared.rpc import RpcClient, wait_for
from shared.tools.localbroker import REPO
from tests.dashboard.stack import DEVICES, NODES, SimStack, browser, browser_missing, fleet_messages, sim_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SHOTS_ENV = "ROBOBUS_DASHBOARD_SHOTS"  # where shoot() writes: a temporary directory unless set (make screenshots)
SHOTS = REPO / "docs" / "dashboard"  # set per module run by the `shots` fixture
SMALL_HEX = make_intel_hex(0x1000, 0x13FF)
T = 45_000  # ms: generous waits for a loaded 2-core machine; the conditions, not the waits, are the test


@pytest.fixture(scope="module", autouse=True)
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    global SHOTS
    chosen = os.environ.get(SHOTS_ENV)
    SHOTS = (REPO / chosen if not Path(chosen).is_absolute() else Path(chosen)) if chosen else \
        tmp_path_factory.mktemp("dashboard-shots")
    return SHOTS


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


TAKEN: list[str] = []


def shoot(page: Any, name: str, target: Any | None = None) -> None:
    """The window as a person sees it, with `target` scrolled to the top, into SHOTS (a temporary directory
    unless ROBOBUS_DASHBOARD_SHOTS says where)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    TAKEN.append(name)
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
    healths = {tuple(t.split("/")[1:3]): json.loads(p)
               for t, p, _ in client.collect_retained("robobus/+/+/health") if p}
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


RED = "rgb(179, 38, 30)"  # style.css --bad


def test_badge_and_health_message_agree(page: Any) -> None:
    """The health's message is coloured as the badge is: the actuator in its blank state is operational without
    error (docs/reference/roi.md §3.7: its firmware never reports itself configured), so its badge is green and its
    message a plain note, never red beside a green badge; a module that is not operational says so in amber."""
    arm = card(page, "roi-modules", "roi_arm")
    page.wait_for_selector("article[data-device='roi_arm'] .error-message:not(:empty)", timeout=T)
    arm.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_selector("article[data-device='roi_arm'][data-health=ok]", timeout=T)
    msg = arm.locator(".error-message")
    assert "Blank state" in msg.inner_text()
    assert msg.evaluate("e => getComputedStyle(e).color") != RED
    assert msg.get_attribute("data-level") == "info"
    io = card(page, "roi-modules", "roi_io")
    page.wait_for_selector("article[data-device='roi_io'][data-health=warn]", timeout=T)
    assert io.locator(".error-message").get_attribute("data-level") == "warn"
    # on every card: a green badge never sits beside a red message
    for c in page.locator("article.device").all():
        if c.get_attribute("data-health") == "ok":
            assert c.locator(".error-message").evaluate("e => getComputedStyle(e).color") != RED, \
                c.get_attribute("data-key")


def _section_shown(c: Any, state: str) -> bool:
    sec = c.locator(f"details.state[data-state='{state}']")
    return sec.count() > 0 and bool(sec.evaluate("e => e.getBoundingClientRect().height > 0"))


def test_roi_cards_show_the_states_the_module_has(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """A state's section shows once the state was received: the GPIO module's card has no empty ODrive sections
    and the ODrive's none of the GPIO's; the pin modes are one table (a row per pin), not a line per value."""
    _, client = stack
    io, wheel = card(page, "roi-modules", "roi_io"), card(page, "roi-modules", "roi_wheel")
    on_screen(page, "roi-modules", "roi_io")
    for state in ("pin_values", "link"):  # drawn: a value or a chart of each
        io.locator(f"details.state[data-state='{state}'] :is(dd, figure.spark)").first.wait_for(state="attached",
                                                                                                 timeout=T)
    # the pin modes are published when they change: make one an output
    rep = client.call("roi-modules", "roi_io", "set_pin_mode", {"pin": 3, "mode": "output"})
    assert rep.ok, rep
    table = io.locator("details.state[data-state='pin_states'] table.list-table")
    table.wait_for(timeout=T)
    assert table.locator("thead th").all_inner_texts() == ["#", "modes", "names"]
    assert table.locator("tbody tr").count() == 18
    try:  # pin 3's row (the header is row 0), its names column
        page.wait_for_function("e => e.rows[4].cells[2].textContent === 'output'", arg=table.element_handle(),
                               timeout=T)
    except Exception as exc:
        raise AssertionError(f"pin 3 not shown as an output: {table.inner_text()!r}") from exc
    assert io.locator("details.state[data-state='pin_states'] dt").all_inner_texts() == ["ts"]
    # the pin values too (nulls for the reserved pins 8 and 9)
    values = io.locator("details.state[data-state='pin_values'] table.list-table")
    assert values.locator("thead th").all_inner_texts() == ["#", "values"]
    assert values.locator("tbody tr").count() == 18
    page.wait_for_function("e => e.rows[9].cells[1].textContent === 'null'", arg=values.element_handle(), timeout=T)
    for state in ("state", "power", "temperature"):  # the ODrive's
        assert not _section_shown(io, state), state
    on_screen(page, "roi-modules", "roi_wheel")
    wheel.locator("details.state[data-state='power'] :is(dd, figure.spark)").first.wait_for(state="attached",
                                                                                             timeout=T)
    time.sleep(1.0)  # retained states arrive with the subscription: nothing more is coming
    for state in ("pin_states", "pin_values"):
        assert not _section_shown(wheel, state), state
    assert _section_shown(wheel, "power")
    shoot(page, "roi", io)


def test_timestamps_ids_and_counters_are_values_not_charts(page: Any) -> None:
    """Dexter's robot clock is shown as a time and its instruction id as a number, neither charted; the e-puck
    link's counters likewise; its measurements are charted."""
    on_screen(page, "dexter-gateway", "dexter1")
    status = card(page, "dexter-gateway", "dexter1").locator("details.state[data-state='status']")
    latest = """() => window.__robobus.nodes.get('dexter-gateway').devices.get('dexter1').states.get('status')
        ?.latest?.instruction_id ?? -1"""
    page.wait_for_function(f"() => ({latest})() >= 0", timeout=T)
    first = int(page.evaluate(latest))
    page.wait_for_function(f"n => ({latest})() > n + 2", arg=first, timeout=T)  # it counts up
    page.wait_for_timeout(1200)  # two drawing passes after it counted
    assert status.locator("figure.spark[data-path='instruction_id']").count() == 0
    ident = status.locator("dd[data-path='instruction_id']")
    assert int(ident.text_content() or "") > first
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", status.locator("dd[data-path='robot_time']").text_content() or "")
    charted = set(status.locator("figure.spark").evaluate_all("els => els.map(e => e.dataset.path)"))
    assert not charted & {"robot_time", "instruction_id", "ts"}, charted
    on_screen(page, "epuck-gateway", "epuck1")
    linkst = card(page, "epuck-gateway", "epuck1").locator("details.state[data-state='link']")
    counter = linkst.locator("dd[data-path='images_received']")
    counter.wait_for(state="attached", timeout=T)
    page.wait_for_function("e => e.textContent !== ''", arg=counter.element_handle(), timeout=T)
    n = int(counter.text_content() or "")
    page.wait_for_function("([e, n]) => +e.textContent > n", arg=[counter.element_handle(), n], timeout=T)
    charted = set(linkst.locator("figure.spark").evaluate_all("els => els.map(e => e.dataset.path)"))
    assert "bytes_per_s" in charted and not charted & {"images_received", "sensors_received", "commands_sent"}, charted


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
    # an integer charts once it has gone up and down (a distance, a light level), a counter never: turn the
    # robot on the spot (set_speed lasts a second unless renewed), so that its distance and ambient light go up
    # and down while one step counter counts up and the other down
    on_screen(page, "epuck-gateway", "epuck1")
    sensors = card(page, "epuck-gateway", "epuck1").locator("details.state[data-state='sensors']")
    measured = sensors.locator("figure.spark[data-path='tof_mm'], figure.spark[data-path^='ambient']").first
    deadline = time.monotonic() + T / 1000
    while measured.count() == 0 and time.monotonic() < deadline:
        assert client.call("epuck-gateway", "epuck1", "set_speed", {"left": 500, "right": -500}).ok
        time.sleep(0.5)
    assert client.call("epuck-gateway", "epuck1", "set_speed", {"left": 0, "right": 0}).ok
    measured.wait_for(state="attached", timeout=T)
    tof = ["epuck-gateway", "epuck1", "sensors", str(measured.get_attribute("data-path"))]
    # the step counters moved (one up, one down) and are not charted
    steps = """() => {
        const sv = window.__robobus.nodes.get('epuck-gateway').devices.get('epuck1').states.get('sensors');
        const l = sv.firstSeen.get('steps.left'), r = sv.firstSeen.get('steps.right');
        return !!(l && r && l.rose && r.fell && !sv.series.has('steps.left') && !sv.series.has('steps.right')); }"""
    page.wait_for_function(steps, timeout=T)
    assert sensors.locator("figure.spark[data-path^='steps']").count() == 0
    for key in (hand, tof):
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


def _doc(service: str, command: str) -> str:
    from shared.registry import service_apis

    api = next(a for a in service_apis() if a.service == service)
    return str(api.commands[command].doc)


def test_forms_say_what_the_command_does_next_to_its_button(page: Any) -> None:
    """Next to a command's button: its doc string from the contract (and its request model's), then the error
    codes it may answer with. set_speed's says that the robot stops unless the command is renewed."""
    cmd = open_command(page, "epuck-gateway", "epuck1", "set_speed")
    help_ = cmd.locator("form.cmd .submit .cmd-help")
    text = help_.inner_text()
    assert _doc("epuck-gateway", "set_speed") in text, text
    assert "moves for" in text and "send it again" in text, text
    assert "May answer: invalid_request" in text, text
    # beside the button, not folded away
    box = cmd.locator("form.cmd .submit button").bounding_box()
    hb = help_.bounding_box()
    assert box and hb and abs(hb["y"] - box["y"]) < 40, (box, hb)
    pin = open_command(page, "roi-modules", "roi_io", "set_pin_output")
    text = pin.locator("form.cmd .submit .cmd-help").inner_text()
    assert _doc("roi-modules", "set_pin_output") in text and "device_error" in text, text


def test_set_pin_output_form_says_to_set_the_mode_first(page: Any) -> None:
    pin = open_command(page, "roi-modules", "roi_io", "set_pin_output")
    # the help is filled from the contract once the page has it: wait for the words, not for the element
    expect(pin.locator("form.cmd .submit .cmd-help")).to_contain_text("set_pin_mode", timeout=T)


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


def test_a_url_parameter_applies_to_that_visit_only(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """The module's page came with `?broker=` (the broker's own websockets listener); a later plain visit uses the
    server's default again, the relay, and says which broker it uses. A broker typed and connected in the bar is
    remembered, shown as not the default, and the default button goes back to the relay."""
    st, _ = stack
    relay = st.dashboard_url.replace("http://", "ws://") + "mqtt"
    pg = page.context.new_page()  # the same browser profile (its localStorage) as the visit with ?broker=
    console: list[str] = []
    pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        pg.goto(st.dashboard_url)
        pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        assert pg.input_value("#connect input[name=url]") == relay
        assert page.locator("#broker-in-use").get_attribute("data-url") == st.broker.ws_url
        assert page.locator("#use-default").is_visible()  # the module's page is not on the default broker
        assert pg.locator("#broker-in-use").inner_text() == relay
        assert pg.locator("#use-default").is_hidden()
        pg.wait_for_selector("tr.node[data-node='ethercat-loop'][data-status=online]", timeout=T)
        # typed and connected: remembered for the next visit, which says it is not the default
        pg.fill("#connect input[name=url]", st.broker.ws_url)
        pg.click("#connect button[type=submit]")
        pg.wait_for_selector("#conn[data-state=connected]", timeout=T)
        pg.reload()
        pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        assert pg.locator("#broker-in-use").get_attribute("data-url") == st.broker.ws_url
        assert pg.locator("#use-default").is_visible()
        pg.click("#use-default")
        pg.wait_for_selector(f"#broker-in-use[data-url='{relay}']", timeout=T)
        pg.wait_for_selector("#conn[data-state=connected]", timeout=T)
        pg.reload()
        try:
            pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        except Exception as exc:  # seen once in a full run (90 s, not reproduced since): say what the page saw
            raise AssertionError(
                f"not connected after the reload: {pg.get_attribute('#conn', 'data-state')!r} "
                f"{pg.inner_text('#conn')!r}, broker {pg.get_attribute('#broker-in-use', 'data-url')!r}; page: "
                f"{console[-15:]}; dashboard: {st.procs['dashboard'].text()[-1500:]}") from exc
        assert pg.locator("#broker-in-use").get_attribute("data-url") == relay
    finally:
        pg.close()


STALE = re.compile(r"stale since \d\d:\d\d:\d\d")
DRAWS_JS = """([node, dev, state]) =>
  window.__robobus.nodes.get(node)?.devices.get(dev)?.states.get(state)?.chartDraws ?? -1"""


def test_losing_the_broker_turns_everything_stale_and_is_logged_once(
        page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """A page on the server's relay: the relay (`robobus dashboard`) is killed under it, so the page loses its
    broker. Every node and device turns "stale since HH:MM:SS" (none stays green), the charts stop, and the event
    log says "disconnected" once however many reconnects fail; the relay back, everything is current again and
    "reconnected" is logged once."""
    st, _ = stack
    port = int(st.dashboard_url.rstrip("/").rsplit(":", 1)[1])
    pg = page.context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        pg.goto(st.dashboard_url)
        pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        for node in NODES:
            pg.wait_for_selector(f"tr.node[data-node='{node}'][data-status=online]", timeout=T)
        pg.wait_for_selector("article[data-device='rh'][data-health=ok]", timeout=T)
        on_screen(pg, "ethercat-loop", "rh")
        joints = ["ethercat-loop", "rh", "joints"]
        pg.wait_for_function(f"() => ({DRAWS_JS})({json.dumps(joints)}) > 2", timeout=T)

        st.kill("dashboard", signal.SIGKILL)
        pg.wait_for_selector("#conn:not([data-state=connected])", timeout=T)
        for node in NODES:
            pg.wait_for_selector(f"tr.node[data-node='{node}'][data-status=stale]", timeout=T)
        for dev in [d for ds in DEVICES.values() for d in ds]:
            pg.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stale]", timeout=T)
        assert pg.locator("article.device[data-health=ok]").count() == 0
        assert pg.locator("tr.node .badge.ok").count() == 0  # no green node, no green chip
        assert STALE.fullmatch(card(pg, "ethercat-loop", "rh").locator("header .badge").inner_text())
        assert STALE.fullmatch(pg.locator("tr.node[data-node='roi-modules'] td.status .badge").inner_text())
        # the charts stop where the data stopped
        draws = pg.evaluate(DRAWS_JS, joints)
        # several reconnects fail meanwhile (one a second): still one line
        pg.wait_for_function("() => window.__robobusPerf.draws > 0", timeout=T)
        time.sleep(3.5)
        assert pg.evaluate(DRAWS_JS, joints) == draws
        assert pg.locator("#event-log li[data-event=disconnected]").count() == 1
        assert "since" in pg.inner_text("#conn")
        shoot(pg, "broker-lost", card(pg, "ethercat-loop", "rh"))

        st.start_dashboard(port)  # the relay back on the same port: the page reconnects by itself
        pg.wait_for_selector("#conn[data-state=connected]", timeout=2 * T)
        for node in NODES:
            pg.wait_for_selector(f"tr.node[data-node='{node}'][data-status=online]", timeout=T)
        pg.wait_for_selector("article[data-device='rh'][data-health=ok]", timeout=T)
        assert pg.locator("article.device[data-health=stale]").count() == 0
        pg.wait_for_function(f"n => ({DRAWS_JS})({json.dumps(joints)}) > n", arg=draws, timeout=T)
        assert pg.locator("#event-log li[data-event=reconnected]").count() == 1
        assert pg.locator("#event-log li[data-event=disconnected]").count() == 1
        assert not errors, errors
    finally:
        pg.close()


def test_a_site_the_centre_cannot_reach_reads_as_last_known(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """At a fleet's centre, fleet-watch's {root}/_bridge/reachable "0": the header says the site is unreachable, every
    node and device turns "stale since" (no green left: their retained messages are the last known), and the log
    says so once; "1" and everything is current again. A page on a site's own broker (no verdict) shows no badge."""
    _, client = stack
    topic = "robobus/_bridge/reachable"
    assert page.locator("#site").is_hidden()
    try:
        client.session.publish(topic, b"0", qos=1, retain=True)
        page.wait_for_selector("#site[data-state=unreachable]", timeout=T)
        assert "SITE UNREACHABLE since" in page.inner_text("#site")
        for node in NODES:
            page.wait_for_selector(f"tr.node[data-node='{node}'][data-status=stale]", timeout=T)
        for dev in [d for ds in DEVICES.values() for d in ds]:
            page.wait_for_selector(f"article.device[data-device='{dev}'][data-health=stale]", timeout=T)
        assert page.locator("article.device[data-health=ok]").count() == 0
        assert "site unreachable from the centre" in card(page, "ethercat-loop", "rh").inner_text()
        assert page.locator("#event-log li[data-event=unreachable]").count() == 1
        client.session.publish(topic, b"1", qos=1, retain=True)
        page.wait_for_selector("#site[data-state=reachable]", timeout=T)
        for node in NODES:
            page.wait_for_selector(f"tr.node[data-node='{node}'][data-status=online]", timeout=T)
        page.wait_for_selector("article[data-device='rh'][data-health=ok]", timeout=T)
        assert page.locator("article.device[data-health=stale]").count() == 0
        assert page.locator("#event-log li[data-event=reachable]").count() == 1
    finally:
        client.session.publish(topic, b"", qos=1, retain=True)
    page.wait_for_selector("#site[data-state=unknown]", state="hidden", timeout=T)


def test_the_fleet_view_at_a_hundred_sites(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """At a fleet's centre (the server names the sites, here ?sites=): one row per site, a summary on top, the
    unreachable site first, then those with a problem (a device not operational, the centre's stop active), the
    rest by name; a site's link opens its own view (the page's root). Read at a hundred sites."""
    st, client = stack
    tag = f"fl{os.getpid() % 10000}s"
    msgs = fleet_messages(100, tag)
    sites = " ".join(f"{tag}{i:03d}={tag}{i:03d}/robobus" for i in range(100))
    pg = page.context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        for t, p in msgs:
            client.session.publish(t, p, qos=1, retain=True)
        t0 = time.monotonic()
        pg.goto(f"{st.dashboard_url}?broker={st.broker.ws_url}&sites={sites.replace(' ', '%20')}")
        pg.wait_for_function("() => document.querySelectorAll('#fleet-sites tbody tr').length === 100", timeout=T)
        pg.wait_for_function("() => document.querySelector('#fleet-summary').textContent.startsWith("
                             "'99 of 100 sites reachable')", timeout=T)
        shown_s = time.monotonic() - t0
        summary = pg.inner_text("#fleet-summary")
        assert "1 UNREACHABLE" in summary and "2 with a problem" in summary and "1 stopped" in summary, summary
        rows = pg.locator("#fleet-sites tbody tr")
        first = [rows.nth(i).get_attribute("data-site") for i in range(4)]
        assert first == [f"{tag}000", f"{tag}001", f"{tag}002", f"{tag}003"], first
        assert "STALE: last known" in rows.nth(0).inner_text()
        assert "1 device(s) not operational" in rows.nth(1).inner_text()
        assert "ACTIVE" in rows.nth(2).inner_text()
        print(f"fleet view: 100 sites ({len(msgs)} retained messages) shown {shown_s:.2f} s after the page opened")
        pg.click(f"#fleet-sites a[data-root='{tag}005/robobus']")  # the site's own view
        pg.wait_for_selector("tr.node[data-node='roi-modules']", timeout=T)
        assert pg.locator("tr.node").count() == 3
        assert pg.locator("#fleet-sites tbody tr").count() == 100  # the fleet stays above it
        assert not errors, errors
    finally:
        pg.close()
        for t, _ in msgs:
            client.session.publish(t, b"", qos=1, retain=True)


def test_the_stop_button_stops_the_stacks_motion_devices(page: Any, stack: tuple[SimStack, RpcClient]) -> None:
    """The header's STOP on `make run`'s stack (no ACL: anyone may stop): every node answers, each motion device
    its answer lists shows STOPPED with the stop written on its card while its health says stopped, an e-puck's
    set_speed from the form is refused `stopped`; the release returns them (tests/dashboard/test_stop_button.py
    has the ACL's refusal)."""
    _, client = stack
    page.wait_for_selector("#stop-state[data-state=none], #stop-state[data-state=released]", timeout=T)
    page.fill("#stop-reason", "robot arm in the way")
    page.click("#stop-button")
    page.wait_for_selector("#stop-result:not([data-outcome=none]):not([data-outcome=sending])", timeout=T)
    assert page.get_attribute("#stop-result", "data-outcome") == "confirmed", page.inner_text("#stop-result")
    stop = json.loads([p for _, p, _ in client.collect_retained("robobus/_stop")][-1])
    assert stop["active"] and stop["source"].startswith("anonymous via dashboard ") and \
        stop["reason"] == "robot arm in the way", stop
    page.wait_for_selector(f"#stop-answers[data-answered='{len(NODES)}']", timeout=T)

    def answers() -> dict[str, dict[str, Any]]:
        got = {t.split("/")[1]: json.loads(p) for t, p, _ in client.collect_retained("robobus/+/_node/state/stop") if p}
        return {n: a for n, a in got.items() if a["stop_ts"] == stop["ts"]}

    # every device's stop action reported (a stop action that failed says why: the ROI actuator's, whose position
    # is unknown after a start, has nothing it can send)
    assert wait_for(lambda: all(not d["pending"] for a in answers().values() for d in a["devices"]), 20), answers()
    failed = {(n, d["device"]) for n, a in answers().items() for d in a["devices"] if d["error"]}
    motion = {(n, d["device"]) for n, a in answers().items() for d in a["devices"]}
    assert ("epuck-gateway", "epuck1") in motion and ("epuck-gateway", "epuck1") not in failed, answers()
    for node, dev in sorted(motion):
        health = "error" if (node, dev) in failed else "stopped"  # STOP FAILED, or STOPPED
        page.wait_for_selector(f"article.device[data-node='{node}'][data-device='{dev}'][data-health={health}]",
                               timeout=T)
        said = "failed" if (node, dev) in failed else "stopped"
        line = card(page, node, dev).locator(f".stop-line[data-stop={said}]")
        line.wait_for(state="attached", timeout=T)
        assert "robot arm in the way" in (line.text_content() or "")  # (a card off screen is not laid out)
    card(page, "epuck-gateway", "epuck1").locator(".stop-line[data-stop=stopped]").wait_for(timeout=T)
    cmd = open_command(page, "epuck-gateway", "epuck1", "set_speed")
    cmd.locator("input[name=left]").fill("100")
    cmd.locator("input[name=right]").fill("100")
    cmd.locator("button[type=submit]").click()
    refused = cmd.locator("pre.reply[data-ok=false]")
    refused.wait_for(timeout=T)
    assert json.loads(refused.inner_text())["error"]["code"] == "stopped", refused.inner_text()
    shoot(page, "bus-stop")

    page.fill("#stop-reason", "")
    page.click("#release-button")
    page.wait_for_selector("#stop-state[data-state=released]", timeout=T)
    for node, dev in sorted(motion):
        page.wait_for_selector(f"article.device[data-node='{node}'][data-device='{dev}']:not([data-health=stopped])",
                               timeout=T)
        card(page, node, dev).locator(".stop-line[data-stop=released]").wait_for(timeout=T)
    cmd.locator("input[name=left]").fill("0")
    cmd.locator("input[name=right]").fill("0")
    cmd.locator("button[type=submit]").click()
    cmd.locator("pre.reply[data-ok=true]").wait_for(timeout=T)


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
    # its devices' health is the dead process's last word: stale since it went, not OK
    page.wait_for_selector("article[data-device='epuck1'][data-health=stale]", timeout=T)
    badge = card(page, "epuck-gateway", "epuck1").locator("header .badge").inner_text()
    assert re.fullmatch(r"stale since \d\d:\d\d:\d\d", badge), badge
    chip = page.locator("tr.node[data-node='epuck-gateway'] .chip[data-device='epuck2']")
    assert chip.get_attribute("data-health") == "stale" and "stale since" in chip.inner_text()
    assert "node offline" in card(page, "epuck-gateway", "epuck1").locator(".error-message").inner_text()
    assert "OFFLINE" in page.locator("tr.node[data-node='epuck-gateway'] td.status").inner_text()
    assert "connection lost" in page.locator("tr.node[data-node='epuck-gateway'] td.status").inner_text()
    page.wait_for_selector("#event-log li[data-event=offline]", timeout=T)
    shoot(page, "node-offline")


def test_screenshots_are_written() -> None:
    """Every screenshot a test took is a PNG in SHOTS, which is not the repository's docs/dashboard unless asked
    for (`make screenshots`): a test run leaves the tracked pictures as they are."""
    if browser_missing():
        pytest.skip(browser_missing() or "")
    if not TAKEN:
        pytest.skip("no test that takes a screenshot ran")
    for name in TAKEN:
        png = SHOTS / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    if not os.environ.get(SHOTS_ENV):
        assert REPO not in SHOTS.resolve().parents, SHOTS
