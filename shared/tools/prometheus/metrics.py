"""The metric families of one scrape, built from the BusView (prometheus_client's custom collector: nothing is
kept between scrapes but the view itself). docs/prometheus.md lists every metric; `FAMILIES` here is that list."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.tools.prometheus.view import FLEET_CHANNEL, SERVICE_STATES, SITE_CHANNEL, BusView, Node, Raw

Metric = GaugeMetricFamily | CounterMetricFamily
N = ("site", "node")
D = ("site", "node", "device")
H = ("site", "node", "device", "service")

# name -> (type, help, labels). Counters are named without their `_total` (prometheus_client adds it).
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # nodes: the retained status (birth, Last Will)
    "robobus_node_online": ("gauge", "1 while the node's retained status says online (its Last Will says 0 when it "
                                     "dies)", N),
    "robobus_node_info": ("gauge", "The node's service, version and host (value 1)",
                          ("site", "node", "service", "version", "host")),
    "robobus_node_session": ("gauge", "The node's connection counter (its status's session)", N),
    "robobus_node_status_timestamp_seconds": ("gauge", "When the node's current status was made (birth or death), "
                                                       "Unix time", N),
    "robobus_last_seen_timestamp_seconds": (
        "gauge", "When the exporter last heard from this source of the node (status, stats, stop_answer; per device: "
                 "health, state/<name>), Unix time; a retained copy counts from its own stamp",
        ("site", "node", "device", "source")),
    # the kit's counters ({root}/{node}/_node/state/stats)
    "robobus_commands_ok": ("counter", "Commands answered ok", N),
    "robobus_commands_failed": ("counter", "Commands answered with an error, by code", ("site", "node", "code")),
    "robobus_decode_errors": ("counter", "Bad bytes from devices, counted by the service", N),
    "robobus_node_published": ("counter", "Messages the node published", N),
    "robobus_node_publish_dropped": ("counter", "Publishes refused while disconnected or over the queue limit", N),
    "robobus_node_mqtt_reconnects": ("counter", "The node's reconnects to its broker", N),
    "robobus_node_jobs_running": ("gauge", "Jobs running on the node", N),
    "robobus_node_uptime_seconds": ("gauge", "Seconds since the node started", N),
    "robobus_stop_path_lags": ("counter", "Times the node's bus-stop connection started to lag", N),
    "robobus_stop_path_rtt_seconds": ("gauge", "The stop connection's latest round trip to itself", N),
    # devices: health
    "robobus_device_connection": ("gauge", "Health `connection`: valid data arrived within the device's liveness "
                                           "budget (0 too when the health is stale)", H),
    "robobus_device_operational": ("gauge", "Health `operational`: the device can do its job now (0 when stale)", H),
    "robobus_device_error": ("gauge", "Health `error`: the device or its configuration is wrong", H),
    "robobus_device_state": ("gauge", "Health `state` (value 1; `stale`: no health for the stale time)",
                             (*H, "state")),
    "robobus_device_health_stale": ("gauge", "1 when the device's health is older than the stale time (its node "
                                             "online but silent)", D),
    "robobus_device_health_timestamp_seconds": ("gauge", "The `ts` of the device's latest health, Unix time", D),
    "robobus_link_attempts": ("counter", "Link attempts (details.link.attempts)", D),
    "robobus_link_failures": ("counter", "Failed attempts and ended sessions (details.link.failures)", D),
    "robobus_link_sessions": ("counter", "Times the link opened (details.link.sessions)", D),
    "robobus_link_silences": ("counter", "Times the device went silent with the link open", D),
    "robobus_link_garbage": ("counter", "Invalid data received on the link", D),
    "robobus_link_restarts": ("counter", "Helper process restarts", D),
    "robobus_link_last_data_age_seconds": ("gauge", "Age of the last valid data when the health was made", D),
    "robobus_link_state": ("gauge", "The link supervisor's state (value 1)", (*D, "state")),
    # the bus stop
    "robobus_stop_active": ("gauge", "1 while the latch is set: {root}/_stop (channel site) or {root}/_stop/fleet "
                                     "(channel fleet)", ("site", "channel")),
    "robobus_stop_changed_timestamp_seconds": ("gauge", "When the latch was last set or released, Unix time",
                                               ("site", "channel")),
    "robobus_stop_answer_active": ("gauge", "The stop (1) or release (0) the node's latest answer is to",
                                   ("site", "node", "channel")),
    "robobus_stop_answer_stop_timestamp_seconds": ("gauge", "The `ts` of the stop or release the node answered",
                                                   ("site", "node", "channel")),
    "robobus_stop_answer_broker_lost": ("gauge", "1: the node holds an active stop its broker no longer has", N),
    "robobus_stop_device_stopped": ("gauge", "The node's answer: the device is held stopped", D),
    "robobus_stop_device_pending": ("gauge", "The node's answer: the stop has not yet reached the device", D),
    "robobus_stop_device_failed": ("gauge", "The node's answer: the device's stop action failed", D),
    "robobus_stop_device_reach_seconds": ("gauge", "From the stop's `ts` to when it reached the device", D),
    # a fleet's bridges
    "robobus_bridge_connected": ("gauge", "The site's bridge ({root}/_bridge/state, the bridge's own notification "
                                          "and Will)", ("site",)),
    "robobus_bridge_reachable": ("gauge", "The site's heartbeat seen at the centre ({root}/_bridge/reachable, "
                                          "robobus fleet-watch)", ("site",)),
    # events, counted as they pass (since the exporter started)
    "robobus_job_results": ("counter", "Job results (event/job_result) by command and outcome (ok, failed, "
                                       "cancelled) and error code", ("site", "node", "device", "command", "outcome",
                                                                     "code")),
    "robobus_job_last_duration_seconds": ("gauge", "The duration of the latest job result of the command",
                                          ("site", "node", "device", "command")),
    "robobus_flash_boards": ("counter", "Boards flashed (can-bootloader event/flash_report) by outcome and the "
                                        "phase it ended in", ("site", "node", "device", "outcome", "phase")),
    "robobus_flash_retries": ("counter", "Retries during flashes (flash_report.retries)", D),
    # ethercat-loop: state/loop_stats
    "robobus_ethercat_cycles": ("counter", "Cycles run since the node started", D),
    "robobus_ethercat_overruns": ("counter", "Releases missed since the node started", D),
    "robobus_ethercat_frames_lost": ("counter", "Frames (statuses) lost since the node started", D),
    "robobus_ethercat_late_frames": ("counter", "Replies later than ETHERCAT_LATE_US (wire backends)", D),
    "robobus_ethercat_wkc_errors": ("counter", "Replies with a wrong working counter (wire backends)", D),
    "robobus_ethercat_statuses_dropped": ("counter", "Statuses dropped before the service read them", D),
    "robobus_ethercat_recoveries": ("counter", "Bus recoveries (wire backends)", D),
    "robobus_ethercat_window_frames_lost": ("gauge", "Frames lost in the latest 1 s window", D),
    "robobus_ethercat_window_late_frames": ("gauge", "Late frames in the latest 1 s window", D),
    "robobus_ethercat_window_wkc_errors": ("gauge", "Working counter errors in the latest 1 s window", D),
    "robobus_ethercat_window_no_status": ("gauge", "Cycles without a valid status in the latest 1 s window", D),
    "robobus_ethercat_window_outages": ("gauge", "Outages (20 cycles in a row without a status: the motors cut out) "
                                                 "begun in the latest 1 s window", D),
    "robobus_ethercat_window_overruns": ("gauge", "Releases missed in the latest 1 s window", D),
    "robobus_ethercat_wakeup_jitter_seconds": ("gauge", "The cycle's wake-up lateness in the latest 1 s window "
                                                        "(quantile 1: the maximum)", (*D, "quantile")),
    "robobus_ethercat_cycle_period_seconds": ("gauge", "The mean cycle period in the latest 1 s window", D),
    # epuck-gateway: state/link
    "robobus_epuck_connected": ("gauge", "The robot's link is up", D),
    "robobus_epuck_frames_dropped": ("counter", "Camera images replaced by a newer one before they could be "
                                                "encoded", D),
    "robobus_epuck_images_received": ("counter", "Camera images received from the robot", D),
    "robobus_epuck_images_published": ("counter", "Camera images published", D),
    "robobus_epuck_sensors_received": ("counter", "Sensor packets received from the robot", D),
    "robobus_epuck_framing_errors": ("counter", "Framing errors on the robot's link", D),
    "robobus_epuck_reply_timeouts": ("counter", "Serial polls the robot did not answer in time", D),
    "robobus_epuck_silences": ("counter", "Times the robot sent nothing for longer than its streams allow", D),
    "robobus_epuck_garbage_bytes": ("counter", "Serial bytes that were no reply to a poll", D),
    "robobus_epuck_link_reconnects": ("counter", "Reconnects of the robot's link", D),
    "robobus_epuck_link_bytes_per_second": ("gauge", "Bytes per second received from the robot", D),
    # roi-modules: state/link
    "robobus_roi_connected": ("gauge", "The module answers (health's connection)", D),
    "robobus_roi_packets_sent": ("counter", "Requests sent to the module", D),
    "robobus_roi_resends": ("counter", "Requests sent again after no reply in time", D),
    "robobus_roi_replies": ("counter", "Replies matched to a request", D),
    "robobus_roi_lost_packets": ("counter", "Requests abandoned after every resend (lost_packets_accumulated)", D),
    "robobus_roi_unmatched": ("counter", "Replies that matched no request", D),
    "robobus_roi_bad_checksum": ("counter", "Datagrams with a bad checksum", D),
    "robobus_roi_lost_packets_since_connect": ("gauge", "Requests lost since the module's last reply", D),
    # the exporter itself
    "robobus_exporter_broker_connected": ("gauge", "1 while the exporter is connected to the broker", ()),
    "robobus_exporter_broker_connects": ("counter", "The exporter's (re)connections to the broker", ()),
    "robobus_exporter_messages": ("counter", "Messages received, by kind", ("kind",)),
    "robobus_exporter_bad_messages": ("counter", "Messages that could not be read, by kind", ("kind",)),
}

# per service state: (metric, path in the payload, fallback path); the first number found is exported
StateFigures = tuple[tuple[str, tuple[str, ...], tuple[str, ...] | None], ...]
ETHERCAT: StateFigures = (
    ("robobus_ethercat_cycles", ("total_cycles",), None),
    ("robobus_ethercat_overruns", ("total_overruns",), None),
    ("robobus_ethercat_frames_lost", ("totals", "lost"), ("counters", "lost")),
    ("robobus_ethercat_late_frames", ("totals", "late"), None),
    ("robobus_ethercat_wkc_errors", ("totals", "wkc_errors"), None),
    ("robobus_ethercat_statuses_dropped", ("totals", "dropped"), ("counters", "dropped")),
    ("robobus_ethercat_recoveries", ("totals", "recoveries"), None),
    ("robobus_ethercat_window_frames_lost", ("frames_lost",), None),
    ("robobus_ethercat_window_late_frames", ("late_frames",), None),
    ("robobus_ethercat_window_wkc_errors", ("wkc_errors",), None),
    ("robobus_ethercat_window_no_status", ("no_status",), None),
    ("robobus_ethercat_window_outages", ("outages",), None),
    ("robobus_ethercat_window_overruns", ("overruns",), None),
)
EPUCK: StateFigures = (
    ("robobus_epuck_connected", ("connected",), None),
    ("robobus_epuck_frames_dropped", ("frames_dropped",), None),
    ("robobus_epuck_images_received", ("images_received",), None),
    ("robobus_epuck_images_published", ("images_published",), None),
    ("robobus_epuck_sensors_received", ("sensors_received",), None),
    ("robobus_epuck_framing_errors", ("framing_errors",), None),
    ("robobus_epuck_reply_timeouts", ("reply_timeouts",), None),
    ("robobus_epuck_silences", ("silences",), None),
    ("robobus_epuck_garbage_bytes", ("garbage_bytes",), None),
    ("robobus_epuck_link_reconnects", ("reconnects",), None),
    ("robobus_epuck_link_bytes_per_second", ("bytes_per_s",), None),
)
ROI: StateFigures = (
    ("robobus_roi_connected", ("connected",), None),
    ("robobus_roi_packets_sent", ("sent",), None),
    ("robobus_roi_resends", ("resent",), None),
    ("robobus_roi_replies", ("replies",), None),
    ("robobus_roi_lost_packets", ("lost_packets_accumulated",), None),
    ("robobus_roi_unmatched", ("unmatched",), None),
    ("robobus_roi_bad_checksum", ("bad_checksum",), None),
    ("robobus_roi_lost_packets_since_connect", ("lost_packets_since_connect",), None),
)
FIGURES: dict[tuple[str, str], StateFigures] = {
    ("ethercat-loop", "loop_stats"): ETHERCAT, ("epuck-gateway", "link"): EPUCK, ("roi-modules", "link"): ROI}
assert all(k[1] in SERVICE_STATES[k[0]] for k in FIGURES)
LINK_COUNTERS = ("attempts", "failures", "sessions", "silences", "garbage", "restarts")
JITTER = (("0.5", "jitter_p50_us"), ("0.99", "jitter_p99_us"), ("1", "jitter_max_us"))


def number(v: Any) -> float | None:
    """A JSON number (a bool is a number to JSON's readers too: true is 1); None for anything else."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float):
        return float(v)
    return None


def dig(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = d
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


class Scrape:
    """The families of one scrape, created on first use in FAMILIES' order."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def add(self, name: str, labels: tuple[str, ...], value: Any) -> None:
        v = number(value)
        if v is None:
            return
        fam = self.families.get(name)
        if fam is None:
            kind, doc, names = FAMILIES[name]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = self.families[name] = cls(name, doc, labels=list(names))
        fam.add_metric(list(labels), v)

    def all(self) -> Iterator[Metric]:
        for name in FAMILIES:
            if name in self.families:
                yield self.families[name]


class BusCollector(Collector):
    """Registered in the exporter's registry: every scrape reads the view once, under its lock."""

    def __init__(self, view: BusView, clock: Callable[[], float] = time.time) -> None:
        self.view = view
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        s = Scrape()
        view = self.view
        with view.lock:
            now = self.clock()
            for (site, node), n in sorted(view.nodes.items()):
                self._node(s, site, node, n, now)
            self._latches(s, now)
            for (site, name), (value, _) in sorted(view.bridges.items()):
                s.add("robobus_bridge_connected" if name == "state" else "robobus_bridge_reachable", (site,),
                      value == "1")
            for (site, node, dev, cmd, outcome, code), count in sorted(view.job_results.items()):
                s.add("robobus_job_results", (site, node, dev, cmd, outcome, code), count)
            for (site, node, dev, cmd), dur in sorted(view.job_last_duration.items()):
                s.add("robobus_job_last_duration_seconds", (site, node, dev, cmd), dur)
            for key5, count in sorted(view.flash_boards.items()):
                s.add("robobus_flash_boards", key5, count)
            for key3, count in sorted(view.flash_retries.items()):
                s.add("robobus_flash_retries", key3, count)
            s.add("robobus_exporter_broker_connected", (), view.connected)
            s.add("robobus_exporter_broker_connects", (), view.broker_connects)
            for kind, count in sorted(view.messages.items()):
                s.add("robobus_exporter_messages", (kind,), count)
            for kind, count in sorted(view.bad.items()):
                s.add("robobus_exporter_bad_messages", (kind,), count)
        return s.all()

    def _node(self, s: Scrape, site: str, node: str, n: Node, now: float) -> None:
        st = n.status or {}
        s.add("robobus_node_online", (site, node), n.online)
        if n.status is not None:
            s.add("robobus_node_info", (site, node, str(st.get("service") or ""), str(st.get("version") or ""),
                                        str(st.get("host") or "")), 1)
            s.add("robobus_node_session", (site, node), st.get("session"))
            s.add("robobus_node_status_timestamp_seconds", (site, node), st.get("ts"))
        for (device, source), t in sorted(n.last_seen.items()):
            s.add("robobus_last_seen_timestamp_seconds", (site, node, device, source), t)
        if not n.online:  # a dead node's last words are not its present: only the above
            return
        service = str(st.get("service") or "")
        cut = self.view.cut(site)  # its last messages are the last known, not live: all stale

        def fresh(raw: Raw | None) -> dict[str, Any] | None:
            return None if cut else self.view.fresh(raw, now)

        self._stats(s, site, node, fresh(n.stats))
        self._answer(s, site, node, fresh(n.stop_answer))
        for device, dev in sorted(n.devices.items()):
            if dev.health is not None:
                self._health(s, (site, node, device), service, fresh(dev.health), dev.health.value())
            for name, raw in sorted(dev.states.items()):
                figures = FIGURES.get((service, name))
                d = fresh(raw)
                if figures is None or d is None:
                    continue
                self._figures(s, (site, node, device), figures, d)
                if name == "loop_stats":
                    for q, key in JITTER:
                        us = number(d.get(key))
                        if us is not None:
                            s.add("robobus_ethercat_wakeup_jitter_seconds", (site, node, device, q), us / 1e6)
                    period = number(d.get("period_us"))
                    if period is not None:
                        s.add("robobus_ethercat_cycle_period_seconds", (site, node, device), period / 1e6)

    @staticmethod
    def _stats(s: Scrape, site: str, node: str, d: dict[str, Any] | None) -> None:
        if d is None:
            return
        k = (site, node)
        s.add("robobus_commands_ok", k, d.get("commands_ok"))
        failed = d.get("commands_failed")
        if isinstance(failed, dict):
            for code, count in sorted(failed.items()):
                s.add("robobus_commands_failed", (site, node, str(code)), count)
        s.add("robobus_decode_errors", k, d.get("decode_errors"))
        s.add("robobus_node_published", k, d.get("published"))
        s.add("robobus_node_publish_dropped", k, d.get("publish_dropped"))
        s.add("robobus_node_mqtt_reconnects", k, d.get("reconnects"))
        s.add("robobus_node_jobs_running", k, d.get("jobs_running"))
        s.add("robobus_node_uptime_seconds", k, d.get("uptime_s"))
        s.add("robobus_stop_path_lags", k, d.get("stop_path_lags"))
        rtt = number(d.get("stop_path_rtt_ms"))
        if rtt is not None:
            s.add("robobus_stop_path_rtt_seconds", k, rtt / 1000)

    @staticmethod
    def _answer(s: Scrape, site: str, node: str, d: dict[str, Any] | None) -> None:
        if d is None:
            return
        channel = str(d.get("channel") or SITE_CHANNEL)
        s.add("robobus_stop_answer_active", (site, node, channel), d.get("active"))
        s.add("robobus_stop_answer_stop_timestamp_seconds", (site, node, channel), d.get("stop_ts"))
        s.add("robobus_stop_answer_broker_lost", (site, node), bool(d.get("broker_lost")))
        stop_ts = number(d.get("stop_ts"))
        for dev in d.get("devices") or []:
            if not isinstance(dev, dict) or not dev.get("device"):
                continue
            k = (site, node, str(dev["device"]))
            s.add("robobus_stop_device_stopped", k, dev.get("stopped"))
            s.add("robobus_stop_device_pending", k, dev.get("pending"))
            s.add("robobus_stop_device_failed", k, bool(dev.get("error")))
            written = number(dev.get("written_ts"))
            if written is not None and stop_ts is not None and d.get("active"):
                s.add("robobus_stop_device_reach_seconds", k, max(0.0, written - stop_ts))

    @staticmethod
    def _health(s: Scrape, k: tuple[str, str, str], service: str, fresh: dict[str, Any] | None,
                last: dict[str, Any] | None) -> None:
        h = (*k, service)
        s.add("robobus_device_health_stale", k, fresh is None)
        if last is not None:
            s.add("robobus_device_health_timestamp_seconds", k, last.get("ts"))
        if fresh is None:  # its node online but silent: not live
            s.add("robobus_device_connection", h, 0)
            s.add("robobus_device_operational", h, 0)
            s.add("robobus_device_state", (*h, "stale"), 1)
            return
        s.add("robobus_device_connection", h, fresh.get("connection"))
        s.add("robobus_device_operational", h, fresh.get("operational"))
        s.add("robobus_device_error", h, fresh.get("error"))
        s.add("robobus_device_state", (*h, str(fresh.get("state") or "")), 1)
        link = dig(fresh, ("details", "link"))
        if not isinstance(link, dict):
            return
        for c in LINK_COUNTERS:
            s.add(f"robobus_link_{c}", k, link.get(c))
        s.add("robobus_link_last_data_age_seconds", k, link.get("last_data_age_s"))
        if link.get("state"):
            s.add("robobus_link_state", (*k, str(link["state"])), 1)

    @staticmethod
    def _figures(s: Scrape, k: tuple[str, str, str], figures: StateFigures, d: dict[str, Any]) -> None:
        for metric, path, fallback in figures:
            v = dig(d, path)
            if v is None and fallback is not None:
                v = dig(d, fallback)
            s.add(metric, k, v)

    def _latches(self, s: Scrape, now: float) -> None:
        view = self.view
        for site in sorted(view.sites):
            for channel in (SITE_CHANNEL, FLEET_CHANNEL):
                raw = view.latches.get((site, channel))
                if raw is None and not view.connected:  # not known, rather than not set
                    continue
                d = raw.value() if raw is not None else None
                s.add("robobus_stop_active", (site, channel), bool(d and d.get("active") is True))
                if d is not None:
                    s.add("robobus_stop_changed_timestamp_seconds", (site, channel), d.get("ts"))
