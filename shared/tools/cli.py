"""`robobus`: look at the bus and talk to it from a terminal.

    robobus status                       every node and device (retained status and health); the bus stop's latches
    robobus fleet status [--site S]      at a fleet's centre: one line per site (shared/tools/fleet_status.py)
    robobus call NODE/DEVICE CMD '{..}'  any command; jobs show a progress bar until their result
    robobus watch 'robobus/#'            live messages
    robobus stop [--reason R]            the bus-wide software stop (not a hardware e-stop); --release lifts it
    robobus schema                       write docs/asyncapi.yaml and docs/schemas/*.json
    robobus schema --root R --out -      print the document for the topic root R
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.registry import cli_plugins, service_names
from shared.rpc import FailoverSettings, RpcClient
from shared.settings import KitSettings, load_settings
from shared.tools.fleet_status import fleet_status

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="robobus: every robot transport on one MQTT 5 bus.")
fleet_app = typer.Typer(no_args_is_help=True, help="A fleet's centre: every site at once.")
fleet_app.command("status")(fleet_status)
app.add_typer(fleet_app, name="fleet")
console = Console()
err_console = Console(stderr=True)

Broker = Annotated[str | None, typer.Option("--broker", "-b", help=(
    "Broker URL (default ROBOBUS_MQTT_URL, and ROBOBUS_FLEET_BROKERS' nodes in turn when set); given, that broker "
    "alone"))]
Root = Annotated[str | None, typer.Option("--root", help="Topic root (default ROBOBUS_TOPIC_ROOT)")]


def _settings(broker: str | None, root: str | None) -> FailoverSettings:
    overrides: dict[str, Any] = {}
    if broker:
        overrides["mqtt_url"] = broker
        overrides["fleet_brokers"] = ""  # a broker named on the command line is that broker alone
    if root:
        overrides["topic_root"] = root
    return load_settings(FailoverSettings, **overrides)


def _client(broker: str | None, root: str | None) -> RpcClient:
    c = RpcClient(_settings(broker, root), name="robobus-cli")
    try:
        c.connect(timeout=5.0)
    except ConnectionError as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(3) from None
    return c


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    d = time.time() - ts
    return f"{d:.1f}s ago" if d < 120 else datetime.fromtimestamp(ts).strftime("%H:%M:%S")


@app.command()
def status(
    broker: Broker = None,
    root: Root = None,
    wait: Annotated[float, typer.Option(
        help="At most this many seconds to gather the retained messages (done once the broker has sent them)")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    expect_all: Annotated[bool, typer.Option(
        "--expect-all", help="Exit 1 unless every registered service has a node online")] = False,
) -> None:
    """Every node and device, from the retained status and health topics; registered services with no
    node online are named below the table. Below it, the bus stop: both latches (the site's {root}/_stop and
    the fleet centre's {root}/_stop/fleet), each with who set it, why and when, and which nodes hold it."""
    from shared.messages import StopAnswer
    from shared.stop import ANSWER_STATE, FLEET_CHANNEL, SITE_CHANNEL, fleet_stop_topic, read_stop, stop_topic

    c = _client(broker, root)
    stop_msgs: dict[str, list[bytes]] = {SITE_CHANNEL: [], FLEET_CHANNEL: []}
    answer_msgs: dict[str, bytes] = {}

    def on_answer(m: Any) -> None:
        answer_msgs[m.topic[len(c.root) + 1:].split("/", 1)[0]] = bytes(m.payload)
    try:
        # retained: in once each subscription is settled
        c.subscribe_before(stop_topic(c.root), lambda m: stop_msgs[SITE_CHANNEL].append(bytes(m.payload)))
        c.subscribe_before(fleet_stop_topic(c.root), lambda m: stop_msgs[FLEET_CHANNEL].append(bytes(m.payload)))
        c.subscribe_before(f"{c.root}/+/_node/state/{ANSWER_STATE}", on_answer)
        msgs = c.collect_retained(f"{c.root}/+/status", f"{c.root}/+/+/health", f"{c.root}/_bridge/reachable",
                                  timeout=wait)
    finally:
        c.close()
    # at a fleet's centre: fleet-watch's verdict on the site (none on a site's own broker)
    verdict = next((p.strip() for t, p, _ in msgs if t == f"{c.root}/_bridge/reachable"), b"")
    reachable = None if verdict not in (b"0", b"1") else verdict == b"1"
    topics = {SITE_CHANNEL: stop_topic(c.root), FLEET_CHANNEL: fleet_stop_topic(c.root)}
    latches = {ch: read_stop(topics[ch], p[-1])[0] if p else None for ch, p in stop_msgs.items()}
    answers: dict[str, StopAnswer] = {}
    for node_name, raw in answer_msgs.items():
        if raw:
            try:
                answers[node_name] = StopAnswer.model_validate_json(raw)
            except ValueError:
                pass  # not an answer: the node is shown as not answering
    nodes: dict[str, dict[str, Any]] = {}
    health: dict[tuple[str, str], dict[str, Any]] = {}
    for topic, payload, _ in msgs:
        try:
            data = json.loads(payload)
        except ValueError:
            continue
        parts = topic[len(c.root) + 1:].split("/")
        if len(parts) == 2 and parts[1] == "status":
            nodes[parts[0]] = data
        elif len(parts) == 3 and parts[2] == "health":
            health[(parts[0], parts[1])] = data
    online = {n for n, st in nodes.items() if st.get("online")}
    view = StopView(c.root, latches, answers, online)
    if as_json:
        print(json.dumps({"nodes": nodes, "health": {f"{n}/{d}": h for (n, d), h in health.items()},
                          "site_reachable": reachable, **view.as_json()}, indent=2))
        return
    if reachable is False:
        console.print(f"[red]the site {c.root} is UNREACHABLE from this centre[/] (fleet-watch: "
                      f"{c.root}/_bridge/reachable = 0): every node and device below is its last known state, "
                      "not its present")
    table = node_table(f"robobus on {c.session.broker.host}:{c.session.broker.port} (root {c.root})", nodes, health,
                       view, stale=reachable is False)
    if not nodes and not health:
        console.print(f"no robobus nodes under '{c.root}/' on this broker")
        for line in view.lines():
            console.print(line)
        raise typer.Exit(1)
    console.print(table)
    for line in view.lines():
        console.print(line)
    missing = sorted(set(service_names()) - {st.get("service") for st in nodes.values() if st.get("online")})
    if missing:
        console.print(f"registered services with no node online: {', '.join(missing)}")
    if expect_all and missing:
        raise typer.Exit(1)


def node_table(title: str, nodes: dict[str, dict[str, Any]], health: dict[tuple[str, str], dict[str, Any]],
               view: StopView, stale: bool = False) -> Table:
    """One row per device (a node without devices: one row), as `robobus status` prints them; `robobus fleet
    status --site` prints a site's so. `stale`: a site the centre cannot reach, its rows its last known."""
    table = Table(title=title)
    for col in ("node", "service", "online", "device", "conn", "oper", "state", "error", "updated", "bus stop"):
        table.add_column(col)
    for name in sorted(set(nodes) | {n for n, _ in health}):
        st = nodes.get(name, {})
        online_ = st.get("online")
        on = "[green]online[/]" if online_ else ("[red]offline[/]" if online_ is False else "?")
        if stale:  # its last word, not its present
            on = f"[yellow]stale[/] (last {'online' if online_ else 'offline' if online_ is False else '?'})"
        devs = sorted(d for n, d in health if n == name) or [""]
        for i, dev in enumerate(devs):
            h = health.get((name, dev), {})
            err = h.get("error_message", "") if h.get("error") else ""
            state = str(h.get("state", ""))
            held = (h.get("details") or {}).get("stop") if isinstance(h.get("details"), dict) else None
            if state == "stopped" and isinstance(held, dict) and held.get("channel"):
                state += f" ({held['channel']})"  # which latch holds it (shared/stop.py's health overlay)
            table.add_row(
                name if i == 0 else "", st.get("service", "") if i == 0 else "", on if i == 0 else "",
                dev, _yn(h.get("connection")), _yn(h.get("operational")), state,
                f"[red]{err}[/]" if err else "", _age(h.get("ts") or st.get("ts")),
                view.node_text(name) if i == 0 else "",
            )
    return table


class StopView:
    """The bus stop as `robobus status` shows it: both latches (shared/stop.py: the site's `{root}/_stop` and
    the fleet centre's `{root}/_stop/fleet`; a node is stopped while either is active) and the nodes' answers
    ({root}/{node}/_node/state/stop), each answer naming the latch it answers (`channel`)."""

    WHAT = {"site": "the site's stop", "fleet": "the fleet's stop"}

    def __init__(self, root: str, latches: dict[str, Any], answers: dict[str, Any], online: set[str]) -> None:
        from shared.stop import FLEET_CHANNEL, SITE_CHANNEL, fleet_stop_topic, stop_topic

        self.root = root
        self.latches = latches  # channel -> StopState | None
        self.topics = {SITE_CHANNEL: stop_topic(root), FLEET_CHANNEL: fleet_stop_topic(root)}
        self.answers = answers  # node -> StopAnswer
        self.online = online

    @property
    def active(self) -> list[str]:
        """The active latches, the newest stop first (the one the nodes name: their effective stop)."""
        act = [ch for ch, s in self.latches.items() if s is not None and s.active]
        return sorted(act, key=lambda ch: -self.latches[ch].ts)

    def current(self, node: str) -> str:
        """The latch whose present state the node's answer answers ("" if it answers none: an earlier one)."""
        a = self.answers.get(node)
        s = self.latches.get(a.channel) if a is not None else None
        if a is None or s is None or (a.stop_ts, a.source, a.active) != (s.ts, s.source, s.active):
            return ""
        return str(a.channel)

    def holds(self, node: str, channel: str) -> bool:
        """The node's answer shows it held by the active latch `channel`: it answered that stop, or its answer to
        the other latch's present state left its devices stopped (a node answers only the latest message)."""
        cur = self.current(node)
        if not cur:
            return False
        if cur == channel:
            return True
        a = self.answers[node]
        return bool(a.active or any(d.stopped for d in a.devices))

    def node_text(self, node: str) -> str:
        a = self.answers.get(node)
        cur = self.current(node)
        if a is None or not cur:
            if self.active and node in self.online:
                return "[red]no answer to this stop[/]"
            return f"answered an earlier {a.channel} {'stop' if a.active else 'release'}" if a is not None else ""
        if any(d.error for d in a.devices):
            mark = " [red](a stop action FAILED)[/]"
        elif any(d.pending for d in a.devices):
            mark = " [yellow](not yet written)[/]"
        else:
            mark = ""
        if a.active:
            return f"[magenta]stopped ({cur})[/]{mark}"
        if any(d.stopped for d in a.devices):
            return f"{cur} released, [magenta]still stopped[/]{mark}"
        return f"released ({cur})"

    def _latch_text(self, channel: str) -> str:
        s = self.latches[channel]
        if s is None:
            return "none"
        who = f"by {s.source}" + (f": {s.reason}" if s.reason else "")
        when = f" at {datetime.fromtimestamp(s.ts).strftime('%Y-%m-%d %H:%M:%S')}" if s.ts else ""
        return f"{'ACTIVE' if s.active else 'released'}{when} {who}"

    def lines(self) -> list[str]:
        from shared.stop import FLEET_CHANNEL, SITE_CHANNEL

        out = []
        site, fleet = self.latches[SITE_CHANNEL], self.latches[FLEET_CHANNEL]
        if site is not None and site.active:
            out.append(f"[red]bus stop ACTIVE[/] (set by {site.source}" + (f": {site.reason}" if site.reason else "")
                       + "): motion commands are refused until `robobus stop --release`")
        if fleet is not None and fleet.active:
            out.append(f"[red]fleet bus stop ACTIVE[/] (set by {fleet.source}"
                       + (f": {fleet.reason}" if fleet.reason else "") + f") on {self.topics[FLEET_CHANNEL]}: motion "
                       "commands are refused until the fleet's centre releases it (`robobus stop --root "
                       f"{self.root} --release` at the centre); `robobus stop --release` here lifts only the site's "
                       "stop")
        for ch in (SITE_CHANNEL, FLEET_CHANNEL):
            line = f"  {ch:5} latch {self.topics[ch]}: {self._latch_text(ch)}"
            if ch in self.active and self.online:
                held = sorted(n for n in self.online if self.holds(n, ch))
                line += f"; held by {len(held)} of {len(self.online)} online nodes" + (
                    f" ({', '.join(held)})" if held else "")
                silent = sorted(self.online - set(held))
                if silent:
                    line += f"; [red]not answered: {', '.join(silent)}[/]"
            out.append(line)
        act = self.active
        if act:
            out.append(f"[red]STOPPED[/] by {' and '.join(self.WHAT[ch] for ch in act)}")
        else:
            out.append("not stopped (neither latch is active)")
        return out

    def as_json(self) -> dict[str, Any]:
        act = self.active
        eff = self.latches[act[0]] if act else next(
            (s for s in self.latches.values() if s is not None), None)
        eff_channel = act[0] if act else next((ch for ch, s in self.latches.items() if s is not None), "")
        return {
            "stopped": bool(act),
            "stopped_by": act,
            # the effective stop: the one the nodes name (the newest active), else the latest release read
            "stop": {**eff.model_dump(), "channel": eff_channel} if eff is not None else None,
            "stop_latches": {ch: {"topic": self.topics[ch], "state": s.model_dump() if s is not None else None,
                                  "held_by": sorted(n for n in self.online if s is not None and s.active
                                                    and self.holds(n, ch))}
                             for ch, s in self.latches.items()},
            "stop_answers": {n: {**a.model_dump(), "answers_current": self.current(n) or None}
                             for n, a in sorted(self.answers.items())},
        }


def _yn(v: Any) -> str:
    return "[green]yes[/]" if v is True else ("[red]no[/]" if v is False else "-")


@app.command()
def call(
    target: Annotated[str, typer.Argument(help="NODE/DEVICE")],
    command: Annotated[str, typer.Argument(help="Command name")],
    payload: Annotated[str, typer.Argument(help="JSON request; '-' reads standard input")] = "{}",
    broker: Broker = None,
    root: Root = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the reply")] = 10.0,
    job_timeout: Annotated[float, typer.Option(help="Seconds to wait for a job's result")] = 3600.0,
    no_follow: Annotated[bool, typer.Option("--no-follow", help="Do not follow a job to its result")] = False,
) -> None:
    """Send any command; print the reply; exit 1 on an error reply. Jobs show a progress bar."""
    if "/" not in target:
        err_console.print("[red]robobus: target must be NODE/DEVICE[/red]")
        raise typer.Exit(2)
    node, device = target.split("/", 1)
    body = sys.stdin.read() if payload == "-" else payload
    try:
        req = json.loads(body) if body.strip() else {}
    except ValueError as exc:
        err_console.print(f"[red]robobus: the request is not JSON: {exc}[/red]")
        raise typer.Exit(2) from None
    c = _client(broker, root)
    try:
        if no_follow:
            rep = c.call(node, device, command, req, timeout=timeout)
            print(json.dumps(json.loads(rep.raw), indent=2))
            raise typer.Exit(0 if rep.ok else 1)
        rep, result = run_job_with_progress(c, node, device, command, req, timeout, job_timeout)
        print(json.dumps(result if result is not None else json.loads(rep.raw), indent=2))
        ok = rep.ok and (result is None or bool(result.get("ok")))
        raise typer.Exit(0 if ok else 1)
    except TimeoutError as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(4) from None
    finally:
        c.close()


def run_job_with_progress(c: RpcClient, node: str, device: str, command: str, req: dict[str, Any],
                          timeout: float, job_timeout: float) -> tuple[Any, dict[str, Any] | None]:
    """Call a command; if it starts a job, show a rich progress bar until its result event."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console,
                  transient=False) as bar:
        task = bar.add_task(f"{device} {command}", total=None, info="")

        def on_progress(ev: dict[str, Any]) -> None:
            total = ev.get("total") or None
            info = ev.get("info") or {}
            text = " ".join(f"{k}={v}" for k, v in list(info.items())[:4])
            bar.update(task, description=f"{device} {ev.get('phase', '')}", total=total,
                       completed=ev.get("done", 0), info=text)

        rep, result = c.call_job(node, device, command, req, on_progress, timeout=job_timeout,
                                 accept_timeout=timeout)
        if result is None:
            bar.remove_task(task)
        elif result.get("ok"):
            t = bar.tasks[0]
            bar.update(task, completed=t.total or 1, total=t.total or 1, description=f"{device} done")
    return rep, result


@app.command()
def watch(
    topic_filter: Annotated[str, typer.Argument(help="MQTT topic filter, e.g. 'robobus/#'")] = "",
    broker: Broker = None,
    root: Root = None,
    count: Annotated[int, typer.Option(help="Stop after this many messages (0 = never)")] = 0,
    seconds: Annotated[float, typer.Option(help="Stop after this many seconds (0 = never)")] = 0.0,
) -> None:
    """Live view of messages under a topic filter."""
    import threading

    c = _client(broker, root)
    filt = topic_filter or f"{c.root}/#"
    seen = 0
    done = threading.Event()

    def on(msg: Any) -> None:
        nonlocal seen
        ctype = getattr(getattr(msg, "properties", None), "ContentType", None)
        if ctype and not ctype.startswith("application/json"):
            text = f"<{len(msg.payload)} bytes {ctype}>"
        else:
            try:
                text = msg.payload.decode()
            except UnicodeDecodeError:
                text = f"<{len(msg.payload)} bytes>"
        stamp = datetime.now().strftime("%H:%M:%S.%f")[:-3]
        console.print(f"[dim]{stamp}[/] [cyan]{msg.topic}[/]{' [dim](retained)[/]' if msg.retain else ''} {text}",
                      markup=True, highlight=False, soft_wrap=True)
        seen += 1
        if count and seen >= count:
            done.set()

    c.session.subscribe(filt, on, qos=0)
    try:
        done.wait(seconds or None)
    except KeyboardInterrupt:
        pass
    finally:
        c.close()


@app.command()
def stop(
    reason: Annotated[str, typer.Option(help="Why (shown in every motion device's health)")] = "",
    source: Annotated[str | None, typer.Option(help="Who (default: user@host)")] = None,
    release: Annotated[bool, typer.Option("--release", help="Release the stop (devices move again only on a "
                                                            "new command)")] = False,
    broker: Broker = None,
    root: Root = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for every online node's answer")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the answers as JSON")] = False,
) -> None:
    """The bus-wide software stop of the topic root: every motion device stops at once and motion commands are
    refused until `robobus stop --release`. It does not replace a hardware emergency stop. Prints what each
    node answered; exit 0 when every online node answered (each device's stop written), 1 otherwise."""
    import getpass

    from shared.messages import StopState
    from shared.settings import hostname
    from shared.stop import send_stop, stop_topic

    who = f"{getpass.getuser()}@{hostname()}" if source is None else source
    try:
        state = StopState(active=not release, source=who, reason=reason, ts=time.time())
    except ValueError as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(2) from None
    c = _client(broker, root)
    try:
        rnd = send_stop(c, state, timeout)
    except ConnectionError as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(3) from None
    finally:
        c.close()
    silent, failed = rnd.silent(), rnd.failed()
    if as_json:
        print(json.dumps({"stop": state.model_dump(), "online": sorted(rnd.online), "silent": silent,
                          "answers": {n: a.model_dump() for n, a in sorted(rnd.answers.items())}}, indent=2))
    else:
        what = "released" if release else "stop set"
        console.print(f"{what} on {stop_topic(c.root)} by {who}" + (f": {reason}" if reason else ""))
        table = Table(title=f"answers of the nodes online under {c.root}/")
        for col in ("node", "device", "answer", "stop reached the device"):
            table.add_column(col)
        for node in sorted(set(rnd.online) | set(rnd.answers)):
            a = rnd.answers.get(node)
            if a is None:
                table.add_row(node, "", f"[red]no answer within {timeout:g} s[/]", "")
                continue
            if not a.devices:
                table.add_row(node, "-", "answered (no motion device)", "")
            for i, d in enumerate(a.devices):
                if d.error:
                    ans = f"[red]stop action failed: {d.error}[/]"
                elif not release and d.pending:
                    ans = f"[yellow]stop sent, not yet confirmed within {timeout:g} s[/]"
                elif release and d.stopped:  # the release lifted this latch only: the other one holds the device
                    ans = "[magenta]released here, still stopped by the other latch[/]"
                else:
                    ans = "[green]stopped[/]" if d.stopped else "released"
                when = (f"+{(d.written_ts - state.ts) * 1000:.0f} ms" if d.written_ts is not None and not release
                        else "")
                table.add_row(node if i == 0 else "", d.device, ans, when)
        console.print(table)
        held = sorted({a.reason.strip() for a in rnd.answers.values()
                       if not a.active and any(d.stopped for d in a.devices)})
        if release and held:
            # shared/stop.py: a release lifts only its own latch ({root}/_stop here); the fleet centre's
            # {root}/_stop/fleet is released at the centre
            console.print("[magenta]still stopped[/]: this release lifts only the site's stop; the nodes answer: "
                          + "; ".join(held))
        if not rnd.online:
            console.print(f"no node online under {c.root}/: the stop is latched and holds each node as it starts")
        elif silent:
            console.print(f"[red]{len(silent)} of {len(rnd.online)} online nodes did not answer in full: "
                          f"{', '.join(silent)}[/]")
            if not rnd.answers:
                console.print(f"no node answered: is this MQTT user allowed to write {stop_topic(c.root)}? "
                              "Only the operator role is (deploy/make_secrets.py)")
    raise typer.Exit(1 if silent or failed else 0)


@app.command()
def schema(
    out: Annotated[Path, typer.Option(help="Output folder; '-' prints the document (YAML) instead")] = Path("docs"),
    check: Annotated[bool, typer.Option(help="Exit 1 if the files on disk are stale; write nothing")] = False,
    root: Annotated[str | None, typer.Option(
        help="Write this topic root (e.g. site1/robobus) into every address, for tools that match topics "
             "against addresses; default: the {root} parameter, one topic level")] = None,
    running_root: Annotated[bool, typer.Option(
        "--running-root", help="Like --root with this machine's ROBOBUS_TOPIC_ROOT (default robobus)")] = False,
) -> None:
    """Write the AsyncAPI 3.0 document and the JSON Schemas of every message."""
    from shared.tools.asyncapi import build_document, render_yaml, write_docs

    if running_root:
        if root is not None:
            err_console.print("[red]robobus: --root and --running-root: give one[/red]")
            raise typer.Exit(2)
        root = load_settings(KitSettings).topic_root
    try:
        doc = build_document(root=root)
    except ValueError as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(2) from None
    if str(out) == "-":
        sys.stdout.write(render_yaml(doc))
        return
    if check:
        current = (out / "asyncapi.yaml").read_text() if (out / "asyncapi.yaml").exists() else ""
        if current != render_yaml(doc):
            err_console.print(f"[red]{out}/asyncapi.yaml is stale: run `make schema`[/red]")
            raise typer.Exit(1)
        console.print(f"{out}/asyncapi.yaml is up to date")
        return
    paths = write_docs(out, root=root)
    console.print(f"wrote {paths[0]} and {len(paths) - 1} JSON Schemas in {out}/schemas/"
                  + (f" for the topic root {root}" if root else ""))


@app.command("new-service")
def new_service(
    name: Annotated[str, typer.Argument(help="The service's name: lower-case words joined by '-' (sixth-io)")],
    package: Annotated[str | None, typer.Option(help="Its Python package; default services.<name_with_underscores>")
                       ] = None,
    folder: Annotated[Path | None, typer.Option("--dir", help="Where to write it; default the package's folder "
                                                              "under this checkout")] = None,
) -> None:
    """Write the rooms of a new, working service (with a simulator and a rig) and print what to add outside it."""
    from shared.tools.scaffold import create, names, registration

    try:
        n = names(name, package)
        target = folder or Path(__file__).resolve().parents[2].joinpath(*n.package.split("."))
        written = create(name, target, n.package)
    except (ValueError, FileExistsError) as exc:
        err_console.print(f"[red]robobus: {exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"wrote {len(written)} files in {target}; now add (docs/kit.md, 'How to add a service'):")
    sys.stdout.write(registration(name, n.package))


def _load_plugins() -> None:
    """Sub-commands contributed through the `robobus.cli` entry points (robobus flash, robobus can, ...)."""
    for plugin in cli_plugins():
        try:
            obj = plugin.load()
        except ImportError as exc:  # a service whose extra is not installed
            err = str(exc)

            def missing(_err: str = err) -> None:
                err_console.print(f"[red]robobus: this command needs a service extra: {_err}[/red]")
                raise typer.Exit(2)
            app.command(name=plugin.name, help=f"(unavailable: {err})")(missing)
            continue
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=plugin.name)
        else:
            app.command(name=plugin.name)(obj)


def main() -> None:
    _load_plugins()
    app()


if __name__ == "__main__":
    main()
