"""`robobus fleet status`: at a fleet's centre, one line per site from the retained messages the centre holds.

Per site root (deploy/README.md, "A fleet"): its nodes' statuses `{root}/+/status` and devices' health
`{root}/+/+/health` (bridged out by the site), fleet-watch's verdict `{root}/_bridge/reachable` ("1"/"0"), the
bridge's own notification `{root}/_bridge/state`, the centre's stop of the site `{root}/_stop` (which the site's
bridge brings in as its fleet latch, `{root}/_stop/fleet`) and the nodes' stop answers
`{root}/+/_node/state/stop` (through the site's uplink). The site's own stop (`{root}/_stop` at the site) is not
bridged out: the centre knows it only from those answers. The uplink publishes nothing about its own use, so the
table has no uplink figures.

    robobus fleet status                           every site, the unreachable and those with problems first
    robobus fleet status --site site-a             one site's nodes and devices
    robobus fleet status --sites "a=a/robobus b=b/robobus" --json
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from pydantic import Field, field_validator
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shared.messages import StopAnswer, StopState
from shared.rpc import RpcClient
from shared.settings import KitSettings, load_settings
from shared.stop import ANSWER_STATE, FLEET_CHANNEL, SITE_CHANNEL, read_stop

DISCOVER_ROOT = "+/robobus"  # without named sites: every `<site>/robobus` the broker holds a status or verdict of
# under each site root: what the table is made of (all retained)
FILTERS = ("+/status", "+/+/health", "_stop", "_bridge/reachable", "_bridge/state", f"+/_node/state/{ANSWER_STATE}")

console = Console()
err_console = Console(stderr=True)


@dataclass(frozen=True)
class Site:
    name: str
    root: str


def parse_sites(text: str) -> list[Site]:
    """'SITE=ROOT ...' (ROBOBUS_CENTRAL_SITES' form) or plain 'ROOT ...' (named by the root's first level)."""
    sites: list[Site] = []
    for item in text.split():
        name, eq, root = item.partition("=")
        if not eq:
            name, root = item.split("/", 1)[0], item
        if not name or not root or any(ch in root for ch in "+#") or root.startswith("/") or root.endswith("/"):
            raise ValueError(f"bad site {item!r}: SITE=ROOT or ROOT, a topic root without wildcards")
        sites.append(Site(name, root))
    if len({s.root for s in sites}) != len(sites) or len({s.name for s in sites}) != len(sites):
        raise ValueError(f"a site or root is named twice in {text!r}")
    return sites


class FleetStatusSettings(KitSettings):
    central_sites: str = Field("", description="The centre's sites, 'SITE=ROOT ...' (as for fleet-watch)")

    @field_validator("central_sites")
    @classmethod
    def _sites(cls, v: str) -> str:
        parse_sites(v)
        return v


@dataclass
class SiteStatus:
    """What the centre holds of one site."""

    site: Site
    reachable: str | None = None  # fleet-watch's verdict, "1" / "0"; None: none
    bridge: str | None = None  # the bridge's own notification, "1" / "0"
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    health: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    fleet_stop: StopState | None = None  # the centre's {root}/_stop
    answers: dict[str, StopAnswer] = field(default_factory=dict)

    @property
    def online(self) -> set[str]:
        return {n for n, st in self.nodes.items() if st.get("online")}

    @property
    def not_operational(self) -> list[str]:
        return sorted(f"{n}/{d}" for (n, d), h in self.health.items() if h.get("operational") is not True)

    @property
    def stale(self) -> bool:
        """fleet-watch says the site is cut off: its statuses and health are the last known, not live."""
        return self.reachable == "0"

    @property
    def site_stop(self) -> StopState | None:
        """The site's own stop as its nodes last answered it (the newest answer read on the site latch)."""
        site = [a for a in self.answers.values() if a.channel == SITE_CHANNEL]
        if not site:
            return None
        a = max(site, key=lambda a: a.stop_ts)
        return StopState(active=a.active, source=a.source or "?", reason=a.reason, ts=a.stop_ts)

    @property
    def latches(self) -> dict[str, StopState | None]:
        return {SITE_CHANNEL: self.site_stop, FLEET_CHANNEL: self.fleet_stop}

    @property
    def newest_ts(self) -> float | None:
        stamps = [v.get("ts") for v in (*self.nodes.values(), *self.health.values())]
        stamps += [a.ts for a in self.answers.values()]
        stamps += [self.fleet_stop.ts] if self.fleet_stop is not None else []
        nums = [float(t) for t in stamps if isinstance(t, int | float)]
        return max(nums) if nums else None

    def problems(self) -> list[str]:
        out = []
        if self.reachable == "0":
            out.append("unreachable")
        elif self.reachable is None:
            out.append("no verdict from fleet-watch")
        offline = len(self.nodes) - len(self.online)
        if offline:
            out.append(f"{offline} node{'s' * (offline != 1)} offline")
        if self.not_operational:
            out.append(f"not operational: {', '.join(self.not_operational)}")
        for ch, s in self.latches.items():
            if s is not None and s.active:
                out.append(f"{ch} stop active")
        return out

    def rank(self) -> tuple[int, str]:
        """Sort key: the unreachable first, then the sites with problems, then the rest; by name within each."""
        return (0 if self.reachable == "0" else 1 if self.problems() else 2, self.site.name)

    def as_json(self) -> dict[str, Any]:
        return {
            "site": self.site.name, "root": self.site.root,
            "reachable": {"1": True, "0": False}.get(self.reachable or ""),
            "bridge_state": self.bridge, "stale": self.stale,
            "nodes_online": len(self.online), "nodes_known": len(self.nodes),
            "devices_not_operational": self.not_operational,
            "stop": {ch: s.model_dump() if s is not None else None for ch, s in self.latches.items()},
            "newest_ts": self.newest_ts, "problems": self.problems(),
        }


def collect(msgs: list[tuple[str, bytes, bool]], sites: list[Site] | None) -> list[SiteStatus]:
    """The sites' statuses from retained (topic, payload, _) messages. Named `sites` are all listed (a site the
    broker holds nothing of too); without them every `<site>/robobus` with a node status or a verdict is."""
    named = {s.root: SiteStatus(s) for s in sites or []}
    found: dict[str, SiteStatus] = {}
    for topic, payload, _ in msgs:
        if sites is not None:
            root = max((r for r in named if topic.startswith(r + "/")), key=len, default=None)
            if root is None:
                continue
            st = named[root]
        else:
            first, _, rest = topic.partition("/")
            if not rest.startswith("robobus/"):
                continue
            root = f"{first}/robobus"
            st = found.setdefault(root, SiteStatus(Site(first, root)))
        _take(st, topic[len(root) + 1:].split("/"), payload)
    if sites is not None:
        return list(named.values())
    return [s for s in found.values() if s.nodes or s.reachable is not None]


def _take(st: SiteStatus, parts: list[str], payload: bytes) -> None:
    if parts == ["_bridge", "reachable"]:
        st.reachable = payload.decode(errors="replace").strip()
        return
    if parts == ["_bridge", "state"]:
        st.bridge = payload.decode(errors="replace").strip()
        return
    if parts == ["_stop"]:
        st.fleet_stop = read_stop(f"{st.site.root}/_stop", payload)[0]
        return
    if len(parts) == 4 and parts[1:] == ["_node", "state", ANSWER_STATE]:
        try:
            st.answers[parts[0]] = StopAnswer.model_validate_json(payload)
        except ValueError:
            pass  # not an answer: the node shows as not answering
        return
    try:
        data = json.loads(payload)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    if len(parts) == 2 and parts[1] == "status":
        st.nodes[parts[0]] = data
    elif len(parts) == 3 and parts[2] == "health":
        st.health[(parts[0], parts[1])] = data


def gather(c: RpcClient, sites: list[Site] | None, wait: float) -> list[SiteStatus]:
    """Every site's retained messages, in one round: subscribed, then read until the broker has sent them all."""
    roots = [s.root for s in sites] if sites is not None else [DISCOVER_ROOT]
    msgs = c.collect_retained(*(f"{r}/{f}" for r in roots for f in FILTERS), timeout=wait)
    return sorted(collect(msgs, sites), key=SiteStatus.rank)


def summary(sites: list[SiteStatus]) -> dict[str, Any]:
    return {
        "sites": len(sites),
        "reachable": sum(s.reachable == "1" for s in sites),
        "unreachable": sum(s.reachable == "0" for s in sites),
        "no_verdict": sum(s.reachable is None for s in sites),
        "with_problems": sum(bool(s.problems()) for s in sites),
        "devices_not_operational": sum(len(s.not_operational) for s in sites),
        "stopped": sum(any(x is not None and x.active for x in s.latches.values()) for s in sites),
    }


def summary_line(sites: list[SiteStatus]) -> str:
    n = summary(sites)
    return (f"{n['reachable']}/{n['sites']} sites reachable"
            + (f" ([red]{n['unreachable']} unreachable[/])" if n["unreachable"] else "")
            + (f", {n['no_verdict']} without a verdict" if n["no_verdict"] else "")
            + f"; devices not operational in all: {n['devices_not_operational']}"
            + f"; {n['stopped']} stopped; {n['with_problems']} with problems")


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    d = max(0.0, now - ts)
    return f"{d:.0f}s" if d < 120 else f"{d / 60:.0f}min" if d < 7200 else f"{d / 3600:.0f}h"


def _latch(s: StopState | None) -> str:
    if s is None:
        return "-"
    if not s.active:
        return "released"
    return f"[magenta]ACTIVE[/] by {escape(s.source)}" + (f": {escape(s.reason)}" if s.reason else "")


def site_table(sites: list[SiteStatus], now: float) -> Table:
    """One line per site (cells cut short, never wrapped); the root column only where a root is not
    `<site>/robobus`."""
    roots = any(s.site.root != f"{s.site.name}/robobus" for s in sites)
    table = Table(box=None, pad_edge=False)
    table.add_column("site", no_wrap=True, min_width=max((len(s.site.name) for s in sites), default=4))
    if roots:
        table.add_column("root", no_wrap=True, overflow="ellipsis", max_width=32)
    for col in ("reach", "nodes", "not oper", "site stop", "fleet stop", "newest", "note"):
        table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=28 if "stop" in col else None)
    for s in sites:
        reach = {"1": "[green]yes[/]", "0": "[red]NO[/]"}.get(s.reachable or "", "?")
        nodes = f"{len(s.online)}/{len(s.nodes)}"
        bad = str(len(s.not_operational))
        if s.stale:
            nodes, bad = f"[dim]{nodes}[/]", f"[dim]{bad}[/]"
        elif s.not_operational:
            bad = f"[red]{bad}[/]"
        note = "STALE: last known" if s.stale else ""
        if s.bridge == "0" and not s.stale:
            note = "bridge Will: down"
        table.add_row(escape(s.site.name), *([escape(s.site.root)] if roots else []), reach, nodes, bad,
                      _latch(s.site_stop), _latch(s.fleet_stop), _ago(s.newest_ts, now), note)
    return table


def print_site(s: SiteStatus, now: float) -> None:
    """One site in full: its line, then its nodes and devices as `robobus status` prints them."""
    from shared.tools.cli import StopView, node_table

    console.print(summary_line([s]))
    console.print(site_table([s], now))
    if s.stale:
        console.print("[red]fleet-watch says this site is unreachable: what follows is its last known state[/]")
    view = StopView(s.site.root, s.latches, s.answers, s.online)
    console.print(node_table(f"{s.site.name} ({s.site.root}) at the centre", s.nodes, s.health, view))
    console.print(f"  site  stop (the site's {s.site.root}/_stop, from its nodes' answers): {_latch(s.site_stop)}")
    console.print(f"  fleet stop (the centre's {s.site.root}/_stop): {_latch(s.fleet_stop)}")


def fleet_status(
    broker: Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (default ROBOBUS_MQTT_URL)")]
    = None,
    sites_text: Annotated[str | None, typer.Option(
        "--sites", help="The sites, 'SITE=ROOT ...'; default ROBOBUS_CENTRAL_SITES; without either, every "
                        "<site>/robobus with a retained node status or fleet-watch verdict on the broker")] = None,
    site: Annotated[str | None, typer.Option("--site", help="One site (its name or root): its nodes and devices")]
    = None,
    wait: Annotated[float, typer.Option(
        help="At most this many seconds to gather the retained messages (done once the broker has sent them)")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
) -> None:
    """Every site of a fleet's centre on one line: reachable (fleet-watch's verdict), nodes online, devices not
    operational, the site's and the fleet's stop, the newest message's age; the unreachable sites and those with
    problems first. An unreachable site's figures are its last known ones."""
    from shared.tools.cli import _client

    overrides: dict[str, Any] = {"mqtt_url": broker} if broker else {}
    if sites_text is not None:
        overrides["central_sites"] = sites_text
    settings = load_settings(FleetStatusSettings, **overrides)
    named = parse_sites(settings.central_sites) or None
    c = _client(broker, None)
    try:
        sites = gather(c, named, wait)
    finally:
        c.close()
    now = time.time()
    if site is not None:
        one = next((s for s in sites if site in (s.site.name, s.site.root)), None)
        if one is None:
            err_console.print(f"[red]robobus: no site {site!r} (sites: {', '.join(s.site.name for s in sites)})[/]")
            raise typer.Exit(1)
        if as_json:
            print(json.dumps({**one.as_json(), "nodes": one.nodes,
                              "health": {f"{n}/{d}": h for (n, d), h in sorted(one.health.items())},
                              "stop_answers": {n: a.model_dump() for n, a in sorted(one.answers.items())}}, indent=2))
        else:
            print_site(one, now)
        return
    if as_json:
        print(json.dumps({"summary": summary(sites), "sites": [s.as_json() for s in sites]}, indent=2))
    elif sites:
        console.print(summary_line(sites))
        console.print(site_table(sites, now))
    if not sites:
        err_console.print("no site found: name them (--sites or ROBOBUS_CENTRAL_SITES) or check the broker")
        raise typer.Exit(1)
