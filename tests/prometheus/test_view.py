"""The exporter's view of the bus and the metrics a scrape returns, message by message (no broker, times passed in):
what an offline node, a stale health, a retained copy and a restarted node export; sites from the topic root; the
service figures; events counted; bad payloads counted, never a crash."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.tools.prometheus.cli import PrometheusSettings
from shared.tools.prometheus.metrics import FAMILIES, BusCollector
from shared.tools.prometheus.view import SUBSCRIPTIONS, BusView, Root, parse_roots

T0 = 1_800_000_000.0


class Bus:
    """A view fed as the MQTT thread would, and scraped at a chosen time."""

    def __init__(self, roots: str = "robobus", stale_s: float = 17.0) -> None:
        self.view = BusView(parse_roots(roots), stale_s)
        self.view.broker_up()
        self.now = T0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BusCollector(self.view, clock=lambda: self.now))

    def send(self, topic: str, payload: Any, retained: bool = False, root: Root | None = None) -> None:
        root = root or self.view.roots[0]
        kind = kind_of(root, topic)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.view.on_message(root, kind, topic, data, retained, self.now)

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        out = {}
        for fam in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float | None:
        want = set(labels.items())
        hits = [v for (n, ls), v in self.scrape().items() if n == name and want <= ls]
        assert len(hits) <= 1, (name, labels, hits)
        return hits[0] if hits else None


def kind_of(root: Root, topic: str) -> str:
    rest = topic.split("/")[len(root.levels):]
    for kind, suffix in SUBSCRIPTIONS:
        pattern = suffix.split("/")
        if len(pattern) == len(rest) and all(p in ("+", r) for p, r in zip(pattern, rest, strict=True)):
            return kind
    raise AssertionError(f"no subscription of the exporter matches {topic}")


def status(node: str, online: bool = True, session: int = 1, pid: int = 100, devices: tuple[str, ...] = ("d1",),
           service: str = "dexter-gateway", ts: float = T0) -> dict[str, Any]:
    return {"online": online, "node": node, "service": service, "version": "0.1.0", "ts": ts, "session": session,
            "devices": list(devices), "pid": pid, "host": "h", "reason": None if online else "connection lost"}


def health(connection: bool = True, state: str = "operational", ts: float = T0, attempts: int = 1) -> dict[str, Any]:
    return {"connection": connection, "operational": connection, "state": state, "error": False,
            "error_message": "", "service": "dexter-gateway", "node": "n", "device": "d1", "version": "0.1.0",
            "ts": ts, "details": {"link": {"state": "operational" if connection else "silent", "attempts": attempts,
                                           "failures": attempts - 1, "sessions": 1, "silences": 0, "garbage": 2,
                                           "restarts": 0, "last_data_age_s": 0.1}}}


def test_a_live_node_and_its_device() -> None:
    bus = Bus()
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/d1/health", health(attempts=3))
    bus.send("robobus/n/_node/state/stats", {"commands_ok": 5, "commands_failed": {"busy": 2, "internal": 1},
                                             "decode_errors": 4, "published": 10, "publish_dropped": 0,
                                             "reconnects": 1, "jobs_running": 0, "uptime_s": 3.0,
                                             "stop_path_lags": 0, "stop_path_rtt_ms": 2.0, "ts": T0})
    assert bus.value("robobus_node_online", node="n", site="") == 1
    assert bus.value("robobus_device_connection", node="n", device="d1", service="dexter-gateway") == 1
    assert bus.value("robobus_device_state", device="d1", state="operational") == 1
    assert bus.value("robobus_link_attempts_total", device="d1") == 3
    assert bus.value("robobus_link_failures_total", device="d1") == 2
    assert bus.value("robobus_link_garbage_total", device="d1") == 2
    assert bus.value("robobus_commands_ok_total", node="n") == 5
    assert bus.value("robobus_commands_failed_total", node="n", code="internal") == 1
    assert bus.value("robobus_commands_failed_total", node="n", code="busy") == 2
    assert bus.value("robobus_decode_errors_total", node="n") == 4
    assert bus.value("robobus_stop_path_rtt_seconds", node="n") == pytest.approx(0.002)
    assert bus.value("robobus_last_seen_timestamp_seconds", node="n", device="d1", source="health") == T0


def test_an_offline_node_exports_only_that_it_is_offline() -> None:
    bus = Bus()
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/d1/health", health())
    bus.now += 1
    bus.send("robobus/n/status", status("n", online=False))  # its Last Will
    assert bus.value("robobus_node_online", node="n") == 0
    assert bus.value("robobus_device_connection", device="d1") is None
    assert bus.value("robobus_link_attempts_total", device="d1") is None
    # a retained health of the dead node that arrives after its Will (subscription order) changes nothing
    bus.send("robobus/n/d1/health", health(), retained=True)
    assert bus.value("robobus_device_connection", device="d1") is None
    assert bus.value("robobus_node_info", node="n", service="dexter-gateway") == 1


def test_a_stale_health_is_not_live() -> None:
    bus = Bus(stale_s=10)
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/d1/health", health())
    bus.now += 9
    assert bus.value("robobus_device_connection", device="d1") == 1
    assert bus.value("robobus_device_health_stale", device="d1") == 0
    bus.now += 2  # 11 s without a health while the node says online: a stalled node, or its link cut
    assert bus.value("robobus_device_connection", device="d1") == 0
    assert bus.value("robobus_device_operational", device="d1") == 0
    assert bus.value("robobus_device_state", device="d1", state="stale") == 1
    assert bus.value("robobus_device_state", device="d1", state="operational") is None
    assert bus.value("robobus_device_health_stale", device="d1") == 1
    assert bus.value("robobus_link_attempts_total", device="d1") is None
    assert bus.value("robobus_last_seen_timestamp_seconds", device="d1", source="health") == T0


def test_a_retained_copy_is_as_old_as_its_stamp() -> None:
    bus = Bus(stale_s=10)
    bus.send("robobus/n/status", status("n"), retained=True)
    bus.send("robobus/n/d1/health", health(ts=T0 - 30), retained=True)  # from before the exporter subscribed
    assert bus.value("robobus_device_health_stale", device="d1") == 1
    assert bus.value("robobus_last_seen_timestamp_seconds", device="d1", source="health") == T0 - 30


def test_a_restarted_node_forgets_its_previous_process() -> None:
    bus = Bus()
    bus.send("robobus/n/status", status("n", devices=("d1", "d2")))
    bus.send("robobus/n/d1/health", health())
    bus.send("robobus/n/d2/health", health())
    bus.send("robobus/n/_node/state/stats", {"commands_ok": 50, "ts": T0})
    bus.now += 5
    bus.send("robobus/n/status", status("n", pid=200, devices=("d1",)))  # a new process serving d1 alone
    assert bus.value("robobus_device_connection", device="d2") is None
    assert bus.value("robobus_commands_ok_total", node="n") is None  # the old process's count is not the new one's
    bus.send("robobus/n/d1/health", health())
    bus.send("robobus/n/_node/state/stats", {"commands_ok": 1, "ts": bus.now})
    assert bus.value("robobus_device_connection", device="d1") == 1
    assert bus.value("robobus_commands_ok_total", node="n") == 1


def test_a_cleared_status_forgets_the_node() -> None:
    bus = Bus()
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/status", b"")
    assert bus.value("robobus_node_online", node="n") is None


@pytest.mark.parametrize(("roots", "topic", "site"), [
    ("site-a/robobus", "site-a/robobus/n/status", "site-a"),
    ("+/robobus", "site-b/robobus/n/status", "site-b"),
    ("hall=lab/x/robobus", "lab/x/robobus/n/status", "hall"),
    ("robobus", "robobus/n/status", ""),
])
def test_the_site_label_comes_from_the_topic_root(roots: str, topic: str, site: str) -> None:
    bus = Bus(roots)
    bus.send(topic, status("n"))
    assert bus.value("robobus_node_online", node="n", site=site) == 1


def test_roots_refused() -> None:
    for bad in ("a/#", "a//b", "=robobus", "a=b a=b c", "x y x"):
        with pytest.raises(ValueError):
            parse_roots(bad)
    with pytest.raises(SystemExit):
        from shared.settings import load_settings
        load_settings(PrometheusSettings, prometheus_roots="a/#")


def test_the_stop_latches_and_a_node_s_answer() -> None:
    bus = Bus("site-a/robobus")
    assert bus.value("robobus_stop_active", site="site-a", channel="site") == 0
    bus.send("site-a/robobus/_stop", {"active": True, "reason": "person", "source": "op", "ts": T0 - 1})
    bus.send("site-a/robobus/n/status", status("n"))
    bus.send("site-a/robobus/n/_node/state/stop", {
        "node": "n", "service": "dexter-gateway", "channel": "site", "active": True, "stop_ts": T0 - 1,
        "received_ts": T0 - 0.99, "reason": "person", "source": "op", "ts": T0, "broker_lost": False,
        "devices": [{"device": "d1", "stopped": True, "pending": False, "error": "", "written_ts": T0 - 0.95},
                    {"device": "d2", "stopped": False, "pending": True, "error": "", "written_ts": None}]})
    assert bus.value("robobus_stop_active", site="site-a", channel="site") == 1
    assert bus.value("robobus_stop_active", site="site-a", channel="fleet") == 0
    assert bus.value("robobus_stop_changed_timestamp_seconds", channel="site") == T0 - 1
    assert bus.value("robobus_stop_answer_active", node="n", channel="site") == 1
    assert bus.value("robobus_stop_device_stopped", device="d1") == 1
    assert bus.value("robobus_stop_device_pending", device="d2") == 1
    assert bus.value("robobus_stop_device_reach_seconds", device="d1") == pytest.approx(0.05)
    bus.send("site-a/robobus/_stop/fleet", {"active": True, "reason": "centre", "source": "c", "ts": T0})
    assert bus.value("robobus_stop_active", site="site-a", channel="fleet") == 1
    bus.send("site-a/robobus/_stop", b"not json")  # unreadable: counted, and no stop shown from it
    assert bus.value("robobus_stop_active", site="site-a", channel="site") == 0
    assert bus.value("robobus_exporter_bad_messages_total", kind="latch") == 1


def test_events_are_counted_as_they_pass() -> None:
    bus = Bus()
    topic = "robobus/can/motors/event/job_result"
    bus.send(topic, {"job_id": "1", "command": "flash", "ok": True, "duration_s": 9.5, "ts": T0})
    bus.send(topic, {"job_id": "2", "command": "flash", "ok": False, "duration_s": 1.0, "ts": T0,
                     "error": {"code": "device_error", "message": "verify"}})
    bus.send(topic, {"job_id": "3", "command": "flash", "ok": False, "cancelled": True, "duration_s": 1, "ts": T0})
    bus.send(topic, {"job_id": "4", "command": "flash", "ok": True, "duration_s": 1, "ts": T0}, retained=True)
    assert bus.value("robobus_job_results_total", command="flash", outcome="ok") == 1
    assert bus.value("robobus_job_results_total", command="flash", outcome="failed", code="device_error") == 1
    assert bus.value("robobus_job_results_total", command="flash", outcome="cancelled") == 1
    assert bus.value("robobus_job_last_duration_seconds", command="flash") == 1.0
    report = "robobus/can/motors/event/flash_report"
    bus.send(report, {"board": 1, "bus": 1, "ok": False, "phase": "verify", "retries": 3})
    bus.send(report, {"board": 2, "bus": 1, "ok": True, "phase": "done", "retries": 0})
    assert bus.value("robobus_flash_boards_total", outcome="failed", phase="verify") == 1
    assert bus.value("robobus_flash_boards_total", outcome="ok", phase="done") == 1
    assert bus.value("robobus_flash_retries_total", device="motors") == 3


def test_the_services_figures() -> None:
    bus = Bus()
    bus.send("robobus/ec/status", status("ec", service="ethercat-loop", devices=("rh",)))
    bus.send("robobus/ec/rh/state/loop_stats", {
        "period_us": 1001.0, "jitter_p50_us": 20.0, "jitter_p99_us": 300.0, "jitter_max_us": 900.0, "overruns": 1,
        "frames_lost": 2, "late_frames": 3, "wkc_errors": 0, "no_status": 2, "outages": 0, "total_cycles": 5000,
        "total_overruns": 7, "counters": {"lost": 40, "dropped": 1}, "totals": None, "ts": T0})
    assert bus.value("robobus_ethercat_frames_lost_total", device="rh") == 40  # driver counters (model backend)
    assert bus.value("robobus_ethercat_cycles_total", device="rh") == 5000
    assert bus.value("robobus_ethercat_window_late_frames", device="rh") == 3
    assert bus.value("robobus_ethercat_wakeup_jitter_seconds", device="rh", quantile="0.99") == pytest.approx(3e-4)
    assert bus.value("robobus_ethercat_late_frames_total", device="rh") is None  # wire backends only
    bus.send("robobus/ec/rh/state/loop_stats", {"total_cycles": 6000, "counters": {"lost": 1},
                                                "totals": {"lost": 55, "late": 9, "wkc_errors": 1}, "ts": T0})
    assert bus.value("robobus_ethercat_frames_lost_total", device="rh") == 55  # the wire's own totals first
    assert bus.value("robobus_ethercat_late_frames_total", device="rh") == 9
    bus.send("robobus/ep/status", status("ep", service="epuck-gateway", devices=("e1",)))
    bus.send("robobus/ep/e1/state/link", {"connected": True, "frames_dropped": 4, "images_received": 100, "ts": T0})
    assert bus.value("robobus_epuck_frames_dropped_total", device="e1") == 4
    assert bus.value("robobus_epuck_connected", device="e1") == 1
    bus.send("robobus/roi/status", status("roi", service="roi-modules", devices=("m",)))
    bus.send("robobus/roi/m/state/link", {"connected": True, "sent": 10, "resent": 3, "lost_packets_accumulated": 1,
                                          "ts": T0})
    assert bus.value("robobus_roi_resends_total", device="m") == 3
    assert bus.value("robobus_roi_lost_packets_total", device="m") == 1
    # a service's state/link the exporter has no table for is ignored
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/d1/state/link", {"sent": 1, "ts": T0})
    assert bus.value("robobus_roi_packets_sent_total", device="d1") is None


def test_bridges_and_the_exporter_s_own_connection() -> None:
    bus = Bus("+/robobus")
    bus.send("site-a/robobus/_bridge/state", b"1")
    bus.send("site-b/robobus/_bridge/reachable", b"0")
    assert bus.value("robobus_bridge_connected", site="site-a") == 1
    assert bus.value("robobus_bridge_reachable", site="site-b") == 0
    assert bus.value("robobus_exporter_broker_connected") == 1
    bus.send("site-a/robobus/n/status", status("n"))
    bus.view.broker_down()  # the exporter knows nothing of the bus while it is away from its broker
    assert bus.value("robobus_exporter_broker_connected") == 0
    assert bus.value("robobus_node_online", node="n") is None
    assert bus.value("robobus_bridge_connected", site="site-a") is None
    assert bus.value("robobus_stop_active", site="site-a", channel="site") is None


def test_a_cut_site_s_devices_read_stale_at_once_and_live_again_when_it_is_back() -> None:
    """fleet-watch's verdict, not the age of the messages: a site the centre cannot reach exports its devices'
    last health as stale (its retained copies are young, its node still says online) and leaves out its states;
    the other site is untouched; reachable again, its devices are live again."""
    bus = Bus("+/robobus", stale_s=60)
    for site in ("site-a", "site-b"):
        bus.send(f"{site}/robobus/_bridge/reachable", b"1")
        bus.send(f"{site}/robobus/n/status", status("n"))
        bus.send(f"{site}/robobus/n/d1/health", health())
    assert bus.value("robobus_device_connection", site="site-a", device="d1") == 1
    bus.send("site-a/robobus/_bridge/reachable", b"0")
    bus.now += 1  # well within the stale time
    assert bus.value("robobus_device_health_stale", site="site-a", device="d1") == 1
    assert bus.value("robobus_device_connection", site="site-a", device="d1") == 0
    assert bus.value("robobus_device_state", site="site-a", device="d1", state="stale") == 1
    assert bus.value("robobus_link_attempts_total", site="site-a", device="d1") is None
    assert bus.value("robobus_node_online", site="site-a", node="n") == 1  # its last word, beside reachable 0
    assert bus.value("robobus_bridge_reachable", site="site-a") == 0
    assert bus.value("robobus_device_connection", site="site-b", device="d1") == 1
    bus.send("site-a/robobus/_bridge/reachable", b"1")
    assert bus.value("robobus_device_connection", site="site-a", device="d1") == 1


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", b"[1,2]", b"{\"online\": \"yes\"}", b"null", b"{"])
def test_bad_payloads_are_counted_never_a_crash(payload: bytes) -> None:
    bus = Bus()
    for topic in ("robobus/n/status", "robobus/n/d1/health", "robobus/n/_node/state/stats",
                  "robobus/n/_node/state/stop", "robobus/n/d1/event/job_result", "robobus/n/d1/event/flash_report",
                  "robobus/n/d1/state/link", "robobus/_bridge/state", "robobus/_stop"):
        bus.send(topic, payload)
    bus.send("robobus/n/status", status("n"))
    bus.send("robobus/n/d1/health", payload or b"{}")
    bus.send("robobus/n/d1/state/link", payload or b"{}")
    assert bus.value("robobus_node_online", node="n") == 1
    bus.scrape()  # parses everything kept: nothing raises


def test_every_family_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "prometheus.md").read_text()
    missing = [n + ("_total" if FAMILIES[n][0] == "counter" else "") for n in FAMILIES
               if (n + ("_total" if FAMILIES[n][0] == "counter" else "")) not in doc]
    assert not missing, f"docs/prometheus.md does not list {missing}"
