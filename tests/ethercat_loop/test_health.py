"""Health and fault events with faults injected into the palm model (node in-process, real broker)."""

import json
import threading
import time

import pytest

from services.ethercat_loop.api import API
from services.ethercat_loop.model_backend import ModelBackend
from services.ethercat_loop.service import build
from services.ethercat_loop.settings import EthercatSettings
from shared import Node
from shared.rpc import wait_for
from shared.tools.asyncapi import ContractValidator, build_document

REFUSED = ("SCHED_FIFO priority 80 refused ([Errno 1] Operation not permitted): the cycle runs at normal "
           "priority, expect jitter (needs CAP_SYS_NICE or an rtprio ulimit)")


class UnprivilegedBackend(ModelBackend):
    """The model backend reporting what ProcessBackend reports when realtime settings were refused."""

    def info(self):
        return {**super().info(), "warnings": [REFUSED], "realtime_policy": "SCHED_OTHER/0"}

    def stats(self):
        return super().stats().model_copy(update={"realtime": {"policy": "SCHED_OTHER/0", "warnings": [REFUSED]}})


@pytest.fixture
def service(broker_session, client, request):
    settings = EthercatSettings(mqtt_url=broker_session.url, node="hand-h", health_interval_s=1.0,
                                ethercat_silent_motor_ms=100,
                                ethercat_overrun_threshold=1_000_000)  # a busy test machine is not under test
    node = Node(API, settings)
    svc = build(node, settings)
    backend = svc.backend
    assert isinstance(backend, ModelBackend)
    if getattr(request, "param", "") == "unprivileged":
        backend.__class__ = UnprivilegedBackend
    health: list[dict] = []
    seen: list[tuple[str, bytes]] = []

    def on(msg):
        seen.append((msg.topic, bytes(msg.payload)))
        if msg.topic.endswith("/health"):
            health.append(json.loads(msg.payload))

    client.subscribe_before("robobus/hand-h/#", on)
    node.start()
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    yield backend, health, seen
    svc.shutdown()
    node.stop()
    t.join(2)


def latest(health):
    return health[-1] if health else {}


def test_health_reports_faults_and_recovers(service):
    backend, health, seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["operational"], 10)
    assert latest(health)["details"]["product"] == 6 and latest(health)["connection"]

    backend.model.overheat_motor(6)
    assert wait_for(lambda: "over_temperature" in latest(health).get("error_message", ""), 5)
    h = latest(health)
    assert h["error"] and not h["operational"] and "motor 6" in h["error_message"]
    faults = [json.loads(p) for t, p in seen if t.endswith("/event/motor_fault")]
    assert faults and faults[0]["motor"] == 6 and "over_temperature" in faults[0]["serious"]
    backend.model.overheat_motor(6, on=False)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    backend.model.silence_motor(11)
    assert wait_for(lambda: "motor 11" in latest(health).get("error_message", ""), 5)
    backend.model.silence_motor(11, silent=False)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    backend.lose_next = 50  # above the threshold (10 per second) and 20 in a row: an error
    assert wait_for(lambda: "frames lost" in latest(health).get("error_message", ""), 5)
    assert "50 frames lost in the last second (threshold 10)" in latest(health)["error_message"]
    assert wait_for(lambda: not latest(health).get("error"), 5)
    backend.model.drop_status(50)
    assert wait_for(lambda: "dropped statuses" in latest(health).get("error_message", ""), 5)
    assert wait_for(lambda: not latest(health).get("error"), 5)

    validator = ContractValidator(build_document())
    for topic, payload in list(seen):
        validator.validate(topic, payload)


def test_no_valid_process_data_is_not_connected(service):
    """While no valid process data flow, the kit's link supervisor says so once the liveness budget has passed:
    `silent`, connection and operational false, no error (docs/kit.md, "Health"); back to running at the first
    valid data again."""
    backend, health, _seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["connection"], 10)
    backend.lose_next = 1500  # 1.5 s without a status
    assert wait_for(lambda: not latest(health).get("connection"), 5)
    h = latest(health)
    assert not h["operational"] and not h["error"] and h["state"] == "silent", h
    assert "no valid data for" in h["error_message"], h
    link = h["details"]["link"]
    assert link["valid_data"] is False and link["liveness_s"] == 0.25 and link["silences"] == 1, link
    assert wait_for(lambda: latest(health).get("connection") and latest(health).get("state") == "running", 10)
    assert latest(health)["details"]["link"]["valid_data"]


class StarvationWatch:
    """A thread that asks to run every 5 ms and notes when it could not for `gap_s` or more: this process (the node,
    its cycle and publisher threads) starved of CPU or of the interpreter lock. Such a stall is the host's, not the
    device's: the node rightly reports the data it did not get, but not as a loss the test injected."""

    def __init__(self, gap_s: float = 0.1) -> None:
        self.gap_s = gap_s
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StarvationWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        t = time.monotonic()
        while not self._stop.wait(0.005):
            now = time.monotonic()
            if now - t >= self.gap_s:
                self.gaps.append(now - t)
            t = now


def test_a_few_lost_frames_do_not_flicker_health(service):
    """1, then 5 lost frames, three times: below the lost-frame threshold (10 per second) and below the 20 in a row
    that make an outage, so health never reports an error or a loss of data for them. A busy machine may starve
    this process of CPU for longer than the liveness budget (0.25 s): the node then rightly reports `silent`, the
    data it did not get; such a silence is allowed only when the host's starvation was seen (the cycle overran its
    releases, or a thread of this process could not run for 0.1 s), never an error, and never an outage of the
    process data (the cycle ran and got no status: what the injected losses would do if they were too many)."""
    backend, health, _seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["operational"], 10)
    n = len(health)
    outages0, overruns0 = backend._counts["outages"], backend._counts["overruns"]
    with StarvationWatch() as starved:
        for _ in range(3):
            backend.lose_next = 1
            time.sleep(0.4)
            backend.lose_next = 5
            time.sleep(0.4)
        assert wait_for(lambda: backend.stats().frames_lost > 0, 3)
        time.sleep(1.5)  # two health evaluations per window, and the window the losses fell in
    assert backend.driver.c["lost"] >= 18
    after = health[n:]
    # the injected losses never made an error (the lost-frame threshold) nor an outage (20 cycles in a row)
    assert not [h for h in after if h["error"]], after
    assert backend._counts["outages"] == outages0
    # anything else not operational is a silence of the link, of a host that starved the node
    bad = [h for h in after if not h["operational"]]
    assert all(h["state"] == "silent" and not h["connection"] for h in bad), bad
    overran = backend._counts["overruns"] > overruns0
    assert not bad or starved.gaps or overran, (bad, starved.gaps)


@pytest.mark.parametrize("service", ["unprivileged"], indirect=True)
def test_refused_realtime_settings_are_a_warning_in_health(service):
    _backend, health, seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["operational"], 10)
    h = latest(health)
    assert h["operational"] and not h["error"] and h["connection"]
    assert h["error_message"] == f"warning: {REFUSED}"
    assert h["details"]["realtime"] == {"policy": "SCHED_OTHER/0", "warnings": [REFUSED]}
    validator = ContractValidator(build_document())
    for topic, payload in list(seen):
        validator.validate(topic, payload)


def test_sustained_loss_is_not_operational_and_a_burst_only_a_warning(service):
    """One bad second is a warning; losses over the threshold for ETHERCAT_LOSS_SUSTAIN_S (3 s) make the palm not
    operational, the message naming them; `error` stays for faults the palm reports (docs/kit.md)."""
    backend, health, _seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["operational"], 10)
    n = len(health)
    backend.lose_next = 15  # one burst over the threshold (10 a second), under the outage rule (20 in a row)
    assert wait_for(lambda: "warning: " in latest(health).get("error_message", ""), 5), health[n:]
    assert not [h for h in health[n:] if h["error"]], health[n:]
    t_end = time.monotonic() + 6.0  # sustained: a burst of 15 every 0.4 s
    while time.monotonic() < t_end and latest(health).get("operational"):
        backend.lose_next = 15
        time.sleep(0.4)
    h = latest(health)
    assert not h["operational"] and h["connection"] and not h["error"], h
    assert "frames lost" in h["error_message"] and "warning: " not in h["error_message"].split(";")[0], h


def test_the_stopped_health_claims_no_valid_data(broker_session, client):
    """After shutdown, health says `stopped` with connection false, and its link details agree: no claim of
    valid process data once the cycle has stopped (nor in any health message before it)."""
    settings = EthercatSettings(mqtt_url=broker_session.url, node="hand-s", health_interval_s=1.0,
                                ethercat_overrun_threshold=1_000_000)
    node = Node(API, settings)
    svc = build(node, settings)
    health: list[dict] = []
    client.subscribe_before("robobus/hand-s/+/health", lambda m: health.append(json.loads(m.payload)))
    node.start()
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: health and health[-1]["details"].get("link", {}).get("valid_data"), 10), health[-3:]
    finally:
        svc.shutdown()
        node.stop()
        t.join(2)
    assert wait_for(lambda: any(h["state"] == "stopped" for h in health), 5), health[-3:]
    stopped = [h for h in health if h["state"] == "stopped"]
    assert all(h["connection"] is False and h["details"]["link"]["valid_data"] is False for h in stopped), stopped
    assert all(h["details"]["link"]["valid_data"] == h["connection"] for h in health if "link" in h["details"])


def test_slow_state_rates_do_not_starve_the_link(broker_session, client):
    """The publisher feeds the link supervisor: with every state at 1 Hz it still looks at the cycle's count of
    valid statuses often enough (a fifth of the liveness budget) that a palm exchanging data is never `silent`."""
    rates = {"joints": 1.0, "motors": 1.0, "tactile": 1.0, "palm_extras": 1.0, "loop_stats": 1.0}
    settings = EthercatSettings(mqtt_url=broker_session.url, node="hand-r", health_interval_s=1.0,
                                state_rates=rates, ethercat_overrun_threshold=1_000_000,
                                # shorter than the states' 1 s period (what would feed the link without the
                                # fix), long enough that a busy machine's stall of the publisher is not silence
                                ethercat_liveness_s=0.6)
    node = Node(API, settings)
    svc = build(node, settings)
    health: list[dict] = []
    client.subscribe_before("robobus/hand-r/+/health", lambda m: health.append(json.loads(m.payload)))
    node.start()
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: latest(health).get("state") == "running", 10), health[-3:]
        n = len(health)
        time.sleep(3.0)
        assert not [h for h in health[n:] if not h["connection"]], [h["state"] for h in health[n:]]
        assert latest(health)["details"]["link"]["silences"] == 0, latest(health)["details"]["link"]
    finally:
        svc.shutdown()
        node.stop()
        t.join(2)


def _hold_publisher(backend, *steps):
    """The next snapshot the publisher takes runs `steps` first (callables, or seconds to sleep): the publisher held
    up, as a loaded host holds it, while the cycle goes on."""
    original = backend.snapshot

    def held(*args, **kwargs):
        del backend.snapshot  # once
        for step in steps:
            step() if callable(step) else time.sleep(step)
        return original(*args, **kwargs)

    backend.snapshot = held


def test_a_publisher_held_up_while_the_data_flow_is_no_silence(service):
    """Liveness is judged on when the newest valid status arrived (the cycle's stamp), which the node's deadline
    thread reads itself before it judges: the service's publisher held up for more than the budget (0.25 s) while
    the palm answers every cycle makes no `silent` (a loaded host flipped health to silent while the wire was clean,
    when the budget counted from the publisher's last look)."""
    backend, health, _seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["connection"], 10)
    n = len(health)
    with StarvationWatch() as starved:
        _hold_publisher(backend, 0.7)
        time.sleep(1.5)
    bad = [(h["state"], h["error_message"]) for h in health[n:] if not h["connection"]]
    assert not bad or [g for g in starved.gaps if g > 0.2], (bad, starved.gaps)


def test_data_reported_late_are_as_old_as_they_are(service):
    """The publisher held up across the moment the data stopped sees, when it looks again, that valid statuses came
    since its last look: they arrived 0.5 s ago, so the palm is `silent`, never `connection: true` on them (it said
    so, with data older than the budget, when the data counted from the look)."""
    backend, health, _seen = service
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["connection"], 10)
    lost_at: list[float] = []

    def lose():  # 3 s without a status, from now
        backend.lose_next = 3000
        lost_at.append(time.time())

    n = len(health)
    _hold_publisher(backend, 0.1, lose, 0.6)
    assert wait_for(lambda: lost_at and time.time() > lost_at[0] + 2.0, 10)
    window = [h for h in health[n:] if lost_at[0] + 0.3 < h["ts"] < lost_at[0] + 2.0]
    assert window and not [h for h in window if h["connection"]], [(h["state"], h["details"]["link"]) for h in window]
    silent = [h for h in window if h["state"] == "silent"]
    assert silent and silent[0]["details"]["link"]["last_data_age_s"] >= 0.25, silent[:1]
    assert wait_for(lambda: latest(health).get("state") == "running" and latest(health)["connection"], 10)
