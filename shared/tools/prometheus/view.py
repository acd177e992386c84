"""The bus as the exporter knows it: per node its retained status, counters (`_node/state/stats`), stop answer and
devices (health, the few service states that carry figures), the bus stop's latches, the fleet bridges, and the
events counted as they pass (job results, flash reports). Pure: payloads and times in, no I/O, no clock.

A message is kept as its bytes and parsed once, when a scrape first needs it (states arrive once a second, health
every few seconds, scrapes come every 15 s or so). What is honest about age:
- a node is online only while its retained status says so (its Last Will says offline the moment it dies); a node
  offline, or without a status, exports only `robobus_node_online 0`, its info and when it was last heard from;
- every kept message has the time it was seen: for a retained copy (from before the subscription) the time its
  publisher stamped in it (`ts`), if earlier; a series whose message is older than `stale_s` is not exported as
  live (a device's health then says `connection 0`, `state="stale"`; states and counters are left out), and
  `robobus_last_seen_timestamp_seconds` says how old each source is;
- a site the centre's fleet-watch says is unreachable (`{root}/_bridge/reachable` 0) is exported as stale whatever
  the age of its messages: its devices' health reads `stale`, its states and counters are left out;
- a node that starts again (a new session or pid, seen live) forgets what the previous process published and the
  devices it no longer serves."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from shared.contract import NAME_RE

# (kind, topic filter under a root): everything the exporter subscribes to. Nothing else reaches it: the 50-100 Hz
# states (joints, sensors, images) are not here.
SUBSCRIPTIONS: tuple[tuple[str, str], ...] = (
    ("status", "+/status"),
    ("health", "+/+/health"),
    ("stats", "+/_node/state/stats"),
    ("stop_answer", "+/_node/state/stop"),
    ("latch", "_stop"),
    ("latch", "_stop/fleet"),
    ("job_result", "+/+/event/job_result"),
    ("flash_report", "+/+/event/flash_report"),
    ("state", "+/+/state/loop_stats"),
    ("state", "+/+/state/link"),
    ("bridge", "_bridge/state"),
    ("bridge", "_bridge/reachable"),
)
# The service states whose figures are exported (metrics.py says which figures): service -> state names.
SERVICE_STATES: dict[str, frozenset[str]] = {
    "ethercat-loop": frozenset({"loop_stats"}),
    "epuck-gateway": frozenset({"link"}),
    "roi-modules": frozenset({"link"}),
}
SITE_CHANNEL, FLEET_CHANNEL = "site", "fleet"


@dataclass(frozen=True)
class Root:
    """One topic root watched: `robobus`, `site-a/robobus`, or `+/robobus` (every site of a centre: the `+` level
    is the site). `site` names the site explicitly (SITE=ROOT); otherwise it is the `+` level, or the levels before
    the last (`site-a/robobus` -> site-a), or empty for a one-level root."""

    pattern: str
    site: str | None = None

    @property
    def levels(self) -> list[str]:
        return self.pattern.split("/")

    def site_of(self, parts: list[str]) -> str:
        if self.site is not None:
            return self.site
        levels = self.levels
        if "+" in levels:
            return parts[levels.index("+")]
        return "/".join(levels[:-1])


def parse_roots(text: str) -> list[Root]:
    """'SITE=ROOT ROOT ...' (as ROBOBUS_CENTRAL_SITES, or plain roots); a root's levels are names or `+`."""
    roots: list[Root] = []
    for item in text.split():
        site, eq, pattern = item.partition("=")
        if not eq:
            site, pattern = "", item
        levels = pattern.split("/")
        if not pattern or any(lv != "+" and not NAME_RE.match(lv) for lv in levels):
            raise ValueError(f"bad root {item!r}: SITE=ROOT or ROOT, levels of names or '+' (no '#')")
        if eq and not re.fullmatch(r"[A-Za-z0-9_.-]+", site):
            raise ValueError(f"bad site name in {item!r}")
        roots.append(Root(pattern, site if eq else None))
    if len({r.pattern for r in roots}) != len(roots):
        raise ValueError(f"a root is named twice in {text!r}")
    return roots


_UNPARSED: Any = object()


@dataclass(slots=True)
class Raw:
    """One topic's latest payload, parsed on first use."""

    payload: bytes
    seen: float
    parsed: Any = _UNPARSED

    def value(self) -> dict[str, Any] | None:
        if self.parsed is _UNPARSED:
            self.parsed = loads(self.payload)
        return self.parsed  # type: ignore[no-any-return]


def loads(payload: bytes) -> dict[str, Any] | None:
    try:
        v = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return v if isinstance(v, dict) else None


@dataclass
class Device:
    health: Raw | None = None
    states: dict[str, Raw] = field(default_factory=dict)


@dataclass
class Node:
    status: dict[str, Any] | None = None
    status_seen: float = 0.0
    stats: Raw | None = None
    stop_answer: Raw | None = None
    devices: dict[str, Device] = field(default_factory=dict)
    last_seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (device or "", source) -> time

    @property
    def online(self) -> bool:
        return bool(self.status and self.status.get("online") is True)

    def forget_life(self, keep_devices: set[str] | None) -> None:
        """What a previous process published: counters, stop answer, health and states."""
        self.stats = None
        self.stop_answer = None
        self.devices = {d: Device() for d in self.devices if keep_devices is None or d in keep_devices}
        self.last_seen = {k: t for k, t in self.last_seen.items() if k == ("", "status")}


def _seen(now: float, retained: bool, payload_ts: Any) -> float:
    """When a message tells of: now, or for a retained copy the time its publisher stamped in it, if earlier."""
    if retained and isinstance(payload_ts, int | float) and not isinstance(payload_ts, bool):
        return min(now, float(payload_ts))
    return now


class BusView:
    """Thread-safe: `on_message` from the MQTT thread, readers under `lock` (metrics.py)."""

    def __init__(self, roots: list[Root], stale_s: float) -> None:
        self.roots = roots
        self.stale_s = stale_s
        self.lock = threading.Lock()
        self.nodes: dict[tuple[str, str], Node] = {}
        self.latches: dict[tuple[str, str], Raw | None] = {}
        self.bridges: dict[tuple[str, str], tuple[str, float]] = {}
        self.sites: set[str] = {r.site for r in roots if r.site is not None}
        self.sites.update(r.site_of(r.levels) for r in roots if r.site is None and "+" not in r.levels)
        # counted as they pass (events are never retained): since this exporter started
        self.job_results: Counter[tuple[str, str, str, str, str, str]] = Counter()
        self.job_last_duration: dict[tuple[str, str, str, str], float] = {}
        self.flash_boards: Counter[tuple[str, str, str, str, str]] = Counter()
        self.flash_retries: Counter[tuple[str, str, str]] = Counter()
        self.messages: Counter[str] = Counter()
        self.bad: Counter[str] = Counter()
        self.connected = False
        self.broker_connects = 0

    # -- input ---------------------------------------------------------------------------------------------------
    def on_message(self, root: Root, kind: str, topic: str, payload: bytes, retained: bool, now: float) -> None:
        parts = topic.split("/")
        n = len(root.levels)
        site, rest = root.site_of(parts), parts[n:]
        with self.lock:
            self.messages[kind] += 1
            self.sites.add(site)
            try:
                ok = getattr(self, f"_on_{kind}")(site, rest, payload, retained, now)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                ok = False
            if not ok:
                self.bad[kind] += 1

    def _node(self, site: str, node: str) -> Node:
        key = (site, node)
        n = self.nodes.get(key)
        if n is None:
            n = self.nodes[key] = Node()
        return n

    def _on_status(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        node = rest[0]
        if not payload:  # the retained status cleared: the node is gone from this bus
            self.nodes.pop((site, node), None)
            return True
        d = loads(payload)
        if d is None or not isinstance(d.get("online"), bool):
            return False
        n = self._node(site, node)
        prev = n.status
        n.status, n.status_seen = d, _seen(now, retained, d.get("ts"))
        n.last_seen[("", "status")] = n.status_seen
        if not d["online"]:
            n.forget_life(set())
        elif not retained and (prev is None or not prev.get("online") or prev.get("session") != d.get("session")
                               or prev.get("pid") != d.get("pid")):
            # a birth seen live: what was kept came from before it (another process, or before a reconnect)
            n.forget_life({str(x) for x in d.get("devices") or []})
        return True

    def _keep(self, site: str, node: str, slot: str, payload: bytes, retained: bool, now: float,
              device: str = "") -> Raw | None:
        n = self._node(site, node)
        if not payload:
            n.last_seen.pop((device, slot), None)
            return None
        raw = Raw(payload, now)
        if retained:  # from before the subscription: as old as its stamp says
            raw.seen = _seen(now, True, (raw.value() or {}).get("ts"))
        n.last_seen[(device, slot)] = raw.seen
        return raw

    def _on_health(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        node, device = rest[0], rest[1]
        raw = self._keep(site, node, "health", payload, retained, now, device)
        n = self._node(site, node)
        if raw is None:
            n.devices.pop(device, None)
        else:
            n.devices.setdefault(device, Device()).health = raw
        return True

    def _on_state(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        node, device, name = rest[0], rest[1], rest[3]
        raw = self._keep(site, node, f"state/{name}", payload, retained, now, device)
        dev = self._node(site, node).devices.setdefault(device, Device())
        if raw is None:
            dev.states.pop(name, None)
        else:
            dev.states[name] = raw
        return True

    def _on_stats(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        self._node(site, rest[0]).stats = self._keep(site, rest[0], "stats", payload, retained, now)
        return True

    def _on_stop_answer(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        self._node(site, rest[0]).stop_answer = self._keep(site, rest[0], "stop_answer", payload, retained, now)
        return True

    def _on_latch(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        channel = FLEET_CHANNEL if rest[-1] == FLEET_CHANNEL else SITE_CHANNEL
        if not payload:
            self.latches[(site, channel)] = None
            return True
        d = loads(payload)
        if d is None or not isinstance(d.get("active"), bool):
            self.latches[(site, channel)] = None  # an unreadable latch is no stop we can show
            return False
        self.latches[(site, channel)] = Raw(payload, now, d)
        return True

    def _on_bridge(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        value = payload.decode(errors="replace").strip()
        if value not in ("0", "1", ""):
            return False
        if value:
            self.bridges[(site, rest[-1])] = (value, now)
        else:
            self.bridges.pop((site, rest[-1]), None)
        return True

    def _on_job_result(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        if retained:  # events are never retained: a retained one is somebody's mistake, not a job that ended now
            return True
        d = loads(payload)
        if d is None or not isinstance(d.get("ok"), bool):
            return False
        node, device = rest[0], rest[1]
        command = str(d.get("command") or "")
        outcome = "ok" if d["ok"] else ("cancelled" if d.get("cancelled") else "failed")
        err = d.get("error")
        code = str(err.get("code") or "") if isinstance(err, dict) else ""
        self.job_results[(site, node, device, command, outcome, code)] += 1
        if isinstance(d.get("duration_s"), int | float):
            self.job_last_duration[(site, node, device, command)] = float(d["duration_s"])
        return True

    def _on_flash_report(self, site: str, rest: list[str], payload: bytes, retained: bool, now: float) -> bool:
        if retained:
            return True
        d = loads(payload)
        if d is None or not isinstance(d.get("ok"), bool):
            return False
        node, device = rest[0], rest[1]
        outcome = "ok" if d["ok"] else ("cancelled" if d.get("cancelled") else "failed")
        self.flash_boards[(site, node, device, outcome, str(d.get("phase") or ""))] += 1
        retries = d.get("retries")
        if isinstance(retries, int) and retries > 0:
            self.flash_retries[(site, node, device)] += retries
        return True

    # -- the exporter's own connection ------------------------------------------------------------------------
    def broker_up(self) -> None:
        """Connected and subscribed: the broker sends every retained message again."""
        with self.lock:
            self.connected = True
            self.broker_connects += 1

    def broker_down(self) -> None:
        """Disconnected: the exporter knows nothing of the bus until it is back (then the broker sends every
        retained message again, and what it no longer has is gone); the event counters stay."""
        with self.lock:
            self.connected = False
            self.nodes.clear()
            self.latches.clear()
            self.bridges.clear()

    # -- reading (callers hold `lock`) ---------------------------------------------------------------------------
    def cut(self, site: str) -> bool:
        """The centre's fleet-watch says the site is unreachable ({root}/_bridge/reachable "0"): what it last sent
        is its last known, not its present."""
        b = self.bridges.get((site, "reachable"))
        return b is not None and b[0] == "0"

    def fresh(self, raw: Raw | None, now: float) -> dict[str, Any] | None:
        """The message's content if it is young enough to be exported as live, else None."""
        if raw is None or now - raw.seen > self.stale_s:
            return None
        return raw.value()
