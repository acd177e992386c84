"""docs/fleet-scale.md's figures, rendered from a result of bench/fleet.py's full run (bench/results/fleet.json): the
block between its `fleet-scale:begin` and `fleet-scale:end` markers is replaced; the prose around it is not.
bench/fleet.py calls it when it writes the committed result; by hand:

    python bench/fleet_doc.py [bench/results/fleet.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "fleet-scale.md"
BEGIN, END = "<!-- fleet-scale:begin (bench/fleet_doc.py) -->", "<!-- fleet-scale:end -->"


def num(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    text = (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}") if isinstance(x, float) else f"{x:,}"
    return f"{text}{unit}"


def ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:,.0f} ms" if x < 10 else f"{x:.0f} s"


def steps_table(run: dict[str, Any]) -> list[str]:
    out = ["| sites | centre CPU (3 nodes) | centre memory | messages in (retained) | latency p50 / p99 | "
           "all new bridges up | fleet stop p50 / p99 | QoS 1 lost | machine idle | held |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in run["steps"]:
        st, c = s.get("steady"), s["connect"]
        if st is None:
            out.append(f"| {s['sites']} | - | - | - | - | {c['connected']} of {c['new_sites']} | - | - | - | "
                       f"no: {s.get('broke', '')} |")
            continue
        stop = s["fleet_stop"]["stop"]
        out.append(
            f"| {s['sites']} | {num(st['centre_cpu_pct'], ' %')} ({num(st['nodes_cpu_pct'], ' %')}) | "
            f"{num(st['centre_rss_mb'], ' MB')} | {num(st['msgs_per_s_in'], '/s')} "
            f"({num(st.get('retained_per_s_in'), '/s')}) | "
            f"{ms(st['latency_s']['p50'])} / {ms(st['latency_s']['p99'])} | "
            f"{num(c['all_connected_s'], ' s')} (settled {num(s.get('settle_s'), ' s')}) | "
            f"{ms(stop['p50'])} / {ms(stop['p99'])} | "
            f"{s['qos1_lost']} of {s['qos1_counted']} | {num(st.get('machine_idle_pct'), ' %')} | "
            f"{'no: ' + s['broke'] if 'broke' in s else 'yes'} |")
    return out


def faults_lines(f: dict[str, Any]) -> list[str]:
    if not f:
        return []
    out = [f"Faults, {f['sites']} idle sites bridged:", ""]
    if "node_kill" in f:
        k = f["node_kill"]
        out.append(f"- **One node killed** (`docker kill`; the node {k['sites_on_killed_node']} sites' bridges held): "
                   f"{k['moved']} bridges on another node, failover p50 {num(k['failover_s']['p50'], ' s')}, "
                   f"p99 {num(k['failover_s']['p99'], ' s')}, max {num(k['failover_s']['max'], ' s')}; other sites "
                   f"that dropped: {len(k['other_sites_that_dropped'])}; QoS 1 lost {k['qos1_lost']} of "
                   f"{k['qos1_counted']}; the node back and healthy in {num(k['node_back_s'], ' s')}.")
    if "cut" in f:
        c = f["cut"]
        sites = f"{c['cut']} site{'s' if c['cut'] > 1 else ''}"
        out.append(f"- **{sites} cut 30 s** (their brokers stopped): said unreachable by fleet-watch after "
                   f"p50 {num(c['said_unreachable_s']['p50'], ' s')} (max {num(c['said_unreachable_s']['max'], ' s')});"
                   f" commands to them answered `unavailable`: {c['unavailable']} of {c['cut']} (answers "
                   f"{c['answers']}), in p99 {ms(c['answer_s']['p99'])}; the other sites' latency p50 / p99 "
                   f"{ms(c['others_latency_s']['p50'])} / {ms(c['others_latency_s']['p99'])} (steady window: "
                   f"{ms(c['baseline_latency_s']['p50'])} / {ms(c['baseline_latency_s']['p99'])}); reachable again "
                   f"p99 {num(c['reachable_again_s']['p99'], ' s')} after the link returned; QoS 1 lost "
                   f"{c['qos1_lost']} of {c['qos1_counted']}.")
    if "centre_restart" in f:
        r = f["centre_restart"]
        out.append(f"- **The whole centre restarted** (compose stop: {num(r['stop_s'], ' s')}; up and healthy: "
                   f"{num(r['centre_healthy_s'], ' s')}): every bridge back (all-green) p50 "
                   f"{num(r['all_green_s']['p50'], ' s')}, p99 {num(r['all_green_s']['p99'], ' s')}, max "
                   f"{num(r['all_green_s']['max'], ' s')} from the `up`; not back: {len(r['not_back'])}; the "
                   f"centre's subscribers back at {r['watchers_back_s']} s; QoS 1 lost {r['qos1_lost']} of "
                   f"{r['qos1_counted']}: {r.get('lost_sent_before_up', '-')} of them sent before the `up`, "
                   f"{r.get('lost_sent_after_watchers_back', '-')} after both subscribers were back.")
    return [*out, ""]


def bottleneck(runs: dict[str, Any]) -> str:
    """What stopped the sample's sweep: CPU, or something else while the machine had CPU left (its idle share in
    that step's window), beside the unretained sweep at the same step."""
    if "sample" not in runs:
        return "The sample's sweep was not run."
    broke = next((s for s in runs["sample"]["steps"] if "broke" in s and "steady" in s), None)
    if broke is None:
        return "The sample's sweep was held at every step it ran."
    st, n = broke["steady"], broke["sites"]
    same = next((s for s in runs.get("sample-unretained", {}).get("steps", []) if s["sites"] == n), None)
    beside = "" if same is None else (
        f" The same {n} sites with their retain flags cleared: "
        + ("held" if "broke" not in same else "not held either") + (
            f", {num(same['steady']['centre_cpu_pct'], ' %')} of a core, the machine "
            f"{num(same['steady'].get('machine_idle_pct'), ' %')} idle." if "steady" in same else "."))
    idle = st.get("machine_idle_pct")
    if idle is not None and idle >= 20:
        verdict = (f"At {n} sites the centre was not keeping up with {num(idle, ' %')} of the machine idle: not its "
                   "CPU.")
    else:
        verdict = (f"At {n} sites the centre was not keeping up, and the machine was {num(idle, ' %')} idle: on this "
                   "run CPU and the retained writes cannot be told apart.")
    return verdict + beside


def block(doc: dict[str, Any], source: str = "bench/results/fleet.json") -> str:
    res = doc["result"]
    sample, runs, m = res["sample"], res["runs"], res["model"]
    lines = [BEGIN, "",
             f"Measured {doc['finished_utc']} by `{doc['command']}` on {doc['machine']['cores']} cores "
             f"({doc['machine']['cpu']}); "
             + (f"its model fitted again over the same windows by `python bench/fleet.py --refit` "
                f"({doc['refitted_utc']}); " if doc.get("refitted_utc") else "")
             + f"the whole result: {source}.", "",
             f"**One site's uplink** (bench/fleet_sample.json.gz, recorded from `make run`): "
             f"{num(sample['msgs_per_s'])} messages/s, {num(sample['bytes_per_s'] / 1000)} kB/s, "
             f"{sample['topics']} topics; by kind: "
             + ", ".join(f"{k} {num(v['msgs_per_s'])}/s of {num(v['mean_bytes'])} B" for k, v in
                         sample["by_kind"].items()) + ".", ""]
    names = {"sample": "Sites sending the recorded uplink", "sample-unretained": "The same, every retain flag cleared",
             "idle": "Idle sites (their retained set once, heartbeat and one stamped event a second)"}
    for traffic, run in runs.items():
        lines += [f"**{names.get(traffic, traffic)}** (centre up in {num(run['setup']['centre_up_s'], ' s')} with "
                  f"every site's user):", "", *steps_table(run), ""]
        if run.get("cut_short"):
            lines += [f"*Not run further: {run['cut_short']}.*", ""]
        lines += faults_lines(run["faults"])
    lines += [f"**Retained messages a second** into the cluster (the sample's sites): held at "
              f"{num(m.get('retained_per_s_held'), '/s')}, not held at {num(m.get('retained_per_s_broke'), '/s')}. "
              + bottleneck(runs), ""]
    if "cpu_pct_per_site" in m:
        lines += ["**The model** (least squares, no cost negative, over the "
                  f"{m['fitted_over']} steady windows held): centre CPU (% of a core) = {num(m['cpu_base_pct'])} + "
                  f"{num(m['cpu_pct_per_site'])} per connected site + {num(m['cpu_us_per_msg'], ' µs')} per message "
                  f"not retained + {num(m['cpu_us_per_retained_msg'], ' µs')} per retained message (worst error on "
                  f"a window: {num(m['worst_fit_error_pct'], ' %')}); memory = {num(m['rss_base_mb'], ' MB')} + "
                  f"{num(m['rss_mb_per_site'], ' MB')} per site. A site as recorded sends "
                  f"{num(m['sample_site_msgs_per_s'])} messages/s, {num(m['sample_site_retained_per_s'])} of them "
                  "retained.", "",
                  "| sites | messages/s in (retained) | uplink into the centre | cores, as recorded | "
                  "cores, states not retained | cores, idle sites | memory |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for n in (1000, 10000):
            p = m[f"sites_{n}"]
            lines.append(f"| {n:,} | {num(float(p['msgs_per_s']))} ({num(float(p['retained_per_s']))}) | "
                         f"{num(p['uplink_mb_per_s'], ' MB/s')} | {num(p['cores_sample_uplink'])} | "
                         f"{num(p['cores_states_unretained'])} | {num(p['cores_idle_sites'])} | "
                         f"{num(p['rss_gb'], ' GB')} |")
        lines.append("")
    if res.get("not_run"):
        lines += [f"*Sweeps not run (the run's time was up): {', '.join(res['not_run'])}.*", ""]
    lines.append(END)
    return "\n".join(lines)


def render(result: Path, doc: Path = DOC) -> None:
    text = doc.read_text()
    a, b = text.index(BEGIN), text.index(END) + len(END)
    try:
        source = result.resolve().relative_to(REPO).as_posix()
    except ValueError:
        source = str(result)
    doc.write_text(text[:a] + block(json.loads(result.read_text()), source) + text[b:])
    print(f"fleet: {doc} rendered from {result}", file=sys.stderr)


if __name__ == "__main__":
    render(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "bench" / "results" / "fleet.json")
