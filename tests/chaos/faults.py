"""The faults the chaos run injects into a running SimStack, each with the invariants it checks.

Every fault returns a FaultResult: the checks made, each passed or violated with what was measured. The pytest
module (test_chaos.py) asserts no violation; `python -m tests.chaos` prints the table. Time limits come from
the product's own promises (DESIGN.md, the services' settings): a node is back online within 3 s of the broker
returning (reconnect backoff capped at 2 s), a lost device shows in health within 1 s (e-puck stale timeout
0.8 s), a robot without a fresh set_speed stops after its motion timeout (1 s)."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.contract import CANCEL
from shared.errors import ErrorCode
from shared.mqtt.session import reply_properties
from shared.registry import service_apis
from tests.chaos.stack import SimStack, sim_serves

BROKER_RETURN_S = 3.0  # every node online again this long after the broker is back
DEVICE_LOST_S = 1.0  # a lost device shows in health within this
SLACK_S = 0.5  # scheduling slack on a loaded 2-core machine, added to every product time limit
EPUCK_MOTION_TIMEOUT_S = 1.0  # services/epuck_gateway: EPUCK_MOTION_TIMEOUT_MS default
STABLE_CODES = {c.value for c in ErrorCode}


@dataclass
class Check:
    invariant: str
    ok: bool
    measured: str


@dataclass
class FaultResult:
    fault: str
    checks: list[Check] = field(default_factory=list)

    def check(self, invariant: str, ok: bool, measured: str) -> None:
        self.checks.append(Check(invariant, ok, measured))

    @property
    def violations(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def _fmt(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def processes_alive(stack: SimStack, r: FaultResult) -> None:
    dead = [f"{p.name} (exit {p.popen.returncode if p.popen else '?'})" for p in stack.procs.values()
            if not p.alive() and p.starts]
    r.check("no process crashed", not dead, ", ".join(dead) or "all alive")


def epuck_steps(stack: SimStack, node: str, device: str, timeout: float = 3.0) -> int | None:
    """The robot's continuous left step count, from its next sensors message."""
    assert stack.observer is not None
    msgs = stack.observer.collect(f"{stack.root}/{node}/{device}/state/sensors", 0.4)
    if not any(not retained for *_, retained in msgs):
        msgs = stack.observer.collect(f"{stack.root}/{node}/{device}/state/sensors", timeout)
    for _, payload, retained in reversed(msgs):
        if not retained:
            return int(json.loads(payload)["steps"]["left_total"])
    return None


def epuck_devices(stack: SimStack) -> list[tuple[str, str]]:
    return [(n, d) for n, d in stack.seen.devices() if stack.seen.device_health(n, d).get("service") ==
            "epuck-gateway" and stack.seen.device_health(n, d).get("connection")]


# -- faults -------------------------------------------------------------------------------------------------
def broker_kill9(stack: SimStack, outage_s: float = 2.5) -> FaultResult:
    """kill -9 the broker with a robot moving, restart it: every node back within 3 s, and the robot stopped by
    its deadman while nobody could renew its speed."""
    r = FaultResult("broker kill -9 and restart")
    robots = epuck_devices(stack)
    moving = robots[0] if robots else None
    before = None
    assert stack.observer is not None
    if moving:
        rep = stack.observer.call(moving[0], moving[1], "set_speed", {"left": 300, "right": 300})
        before = epuck_steps(stack, *moving)
        rep = stack.observer.call(moving[0], moving[1], "set_speed", {"left": 300, "right": 300})
        r.check("set_speed accepted before the fault", rep.ok, str(rep.error or "ok"))
    sessions = {n: stack.seen.node_status(n).get("session", 0) for n in stack.expected_nodes}
    t_kill = time.monotonic()
    stack.broker.kill()
    time.sleep(outage_s)
    stack.broker.start()

    def back() -> bool:
        return all(stack.seen.node_status(n).get("online") and stack.seen.node_status(n).get("session", 0) >
                   sessions[n] for n in stack.expected_nodes)
    took = stack.wait(back, 30.0)
    r.check(f"every node online within {BROKER_RETURN_S:g} s of the broker's return",
            took is not None and took <= BROKER_RETURN_S + SLACK_S, f"{_fmt(took)} ({len(sessions)} nodes)")
    if moving and before is not None:
        after = epuck_steps(stack, *moving)
        later = epuck_steps(stack, *moving)
        moved_s = (after - before) / 300.0 if after is not None else None
        limit = EPUCK_MOTION_TIMEOUT_S + SLACK_S + 0.2
        r.check(f"robot stopped by its {EPUCK_MOTION_TIMEOUT_S:g} s deadman while the broker was down",
                moved_s is not None and moved_s <= limit and later == after,
                f"moved {_fmt(moved_s)} of a {outage_s:g} s outage (limit {limit:.1f} s); still moving: "
                f"{later != after}")
    del t_kill
    processes_alive(stack, r)
    return r


def node_kill9(stack: SimStack) -> FaultResult:
    """kill -9 each node's process: its Last Will says offline at once, the others stay online, and a restart
    brings it back."""
    r = FaultResult("kill -9 of each node")
    for node, proc in sorted(stack.node_procs().items()):
        others = stack.expected_nodes - {node}
        proc.kill9()
        will = stack.wait(lambda n=node: stack.seen.node_status(n).get("online") is False, 10.0)
        st = stack.seen.node_status(node)
        r.check(f"{node}: Last Will 'connection lost' delivered", will is not None and
                st.get("reason") == "connection lost", f"{_fmt(will)}, reason {st.get('reason')!r}")
        r.check(f"{node}: the other nodes stayed online", others <= stack.seen.online_nodes(),
                ", ".join(sorted(others - stack.seen.online_nodes())) or "all online")
        proc.start(stack.workdir)
        up = stack.wait(lambda n=node: bool(stack.seen.node_status(n).get("online")), 60.0)
        r.check(f"{node}: back online after a restart", up is not None, _fmt(up))
    processes_alive(stack, r)
    return r


def _budget(stack: SimStack, key: tuple[str, str]) -> float:
    """How soon a lost device must show in health: DEVICE_LOST_S, or the liveness budget the device declares
    (`details.link.liveness_s`, the kit's supervisor: silence can be told only after it) when that is longer."""
    link = (stack.seen.device_health(*key).get("details") or {}).get("link") or {}
    declared = link.get("liveness_s") if isinstance(link, dict) else None
    return max(DEVICE_LOST_S, float(declared)) if isinstance(declared, (int, float)) else DEVICE_LOST_S


def _ready(stack: SimStack, key: tuple[str, str]) -> bool:
    h = stack.seen.device_health(*key)
    return bool(h.get("connection")) and bool(h.get("operational"))


def device_vanish(stack: SimStack) -> FaultResult:
    """kill -9 each simulator process (a device vanishing): the devices it served show the loss in health
    (not connected, or not operational) within 1 s or their declared liveness budget, whichever is longer
    (a device that closes no connection is known lost only by its silence), and are back when it returns.
    Only the devices of the node the simulator is the device side of are watched (stack.sim_serves): a device
    of another service that is not operational for a moment meanwhile (the in-process EtherCAT model on a busy
    host) is not this simulator's loss."""
    r = FaultResult("device (simulator) vanishes and returns")
    serves = sim_serves(stack.procs)
    sims = [p for p in stack.procs.values() if p.name.endswith("-sim") and p.alive()]
    for sim in sims:
        ready = {k for k in stack.devices_of(stack.procs[serves[sim.name]]) if _ready(stack, k)}
        if not ready:
            r.check(f"{sim.name}: {serves[sim.name]} has a device ready before the kill", False, "none ready")
            continue
        budgets = {k: _budget(stack, k) for k in ready}
        t0 = time.monotonic()
        sim.kill9()
        # when each device it served first shows the loss (a device may go on to a later state: lost, silent,
        # then unreachable), watched until the longest budget has passed
        first_lost: dict[tuple[str, str], float] = {}
        until = t0 + max(budgets.values(), default=DEVICE_LOST_S) + SLACK_S + 1.0
        while time.monotonic() < until and len(first_lost) < len(ready):
            for k in ready:
                if k not in first_lost and not _ready(stack, k):
                    first_lost[k] = time.monotonic()
            time.sleep(0.02)
        lost = set(first_lost)
        if not lost:
            r.check(f"{sim.name}: a device shows the loss", False, "every device still connected and operational")
        for k in sorted(lost):
            took = first_lost[k] - t0
            h = stack.seen.device_health(*k)
            r.check(f"{sim.name} -> {k[0]}/{k[1]}: loss in health within {budgets[k]:g} s",
                    took <= budgets[k] + SLACK_S, f"{_fmt(took)} ({h.get('state')})")
        sim.start(stack.workdir)
        back = stack.wait(lambda ks=lost: all(_ready(stack, k) for k in ks), 30.0)
        r.check(f"{sim.name}: its devices are back", back is not None, _fmt(back))
    processes_alive(stack, r)
    return r


GARBAGE: list[bytes] = [
    b"\xff\xfe\x00garbage", b"{", b'{"a":', b"[]", b"[1,2,3]", b"42", b'"text"', b"null", b"true",
    b"[" * 64 + b"]" * 64, b"\x00" * 16, "{\"ünïcode\": \"\ud83d\"}".encode("utf-8", "surrogatepass"),
    b"\x80" * 300, b'{"left": 1' + b"0" * 4000,
]  # never a well-formed object: a garbage request must not move anything


def garbage(stack: SimStack, per_topic: int = 1000) -> FaultResult:
    """`per_topic` garbage payloads on every command topic of every device: each answered with a stable
    error code, nothing crashes."""
    r = FaultResult(f"{per_topic} garbage payloads on every command topic")
    apis = {a.service: a for a in service_apis()}
    client = stack.client(f"chaos-garbage-{os.getpid()}")
    replies: list[dict[str, Any]] = []
    client.session.subscribe(client.reply_topic + "/g", lambda m: replies.append(json.loads(m.payload)), qos=1)
    client._settle()
    topics = []
    for node, device in stack.seen.devices():
        api = apis.get(stack.seen.device_health(node, device).get("service", ""))
        if api is None:
            continue
        names = list(api.commands) + list(api.jobs) + ([CANCEL.name] if api.jobs else [])
        topics += [f"{stack.root}/{node}/{device}/cmd/{c}" for c in names]
    props = reply_properties(client.reply_topic + "/g", uuid.uuid4().bytes, "application/json")
    sent = 0
    for i in range(per_topic):
        body = GARBAGE[i % len(GARBAGE)]
        for t in topics:
            # QoS 1 both ways (the reply goes at the request's QoS): every request and every answer is
            # delivered, so an answer missing is the service's fault, not the broker shedding QoS 0 load
            client.session.publish(t, body, qos=1, properties=props)
            sent += 1
        if i % 20 == 19:
            stack.wait(lambda n=sent: len(replies) >= n - 2000, 60.0, interval=0.05)  # keep the backlog bounded
    stack.wait(lambda: len(replies) >= sent, 120.0, interval=0.2)
    bad = [x for x in replies if x.get("ok") or x.get("error", {}).get("code") not in STABLE_CODES]
    r.check("every garbage request answered", len(replies) >= sent, f"{len(replies)} of {sent} answered "
            f"({len(topics)} command topics)")
    r.check("every answer a stable error code", not bad, f"{len(bad)} not an error with a stable code" +
            (f", e.g. {bad[0]}" if bad else ""))
    codes = sorted({x.get("error", {}).get("code") for x in replies})
    r.check("nodes still online", stack.all_online(), f"codes seen: {codes}")
    client.close()
    processes_alive(stack, r)
    return r


def flood(stack: SimStack, messages: int = 20000) -> FaultResult:
    """A client floods one command topic (QoS 0, as fast as it can): the node survives and answers a QoS 1
    command to another device right after."""
    r = FaultResult(f"a client floods one command topic ({messages} requests)")
    robots = epuck_devices(stack)
    target = robots[0] if robots else (next(iter(stack.seen.devices())))
    client = stack.client(f"chaos-flood-{os.getpid()}")
    topic = f"{stack.root}/{target[0]}/{target[1]}/cmd/set_speed"
    t0 = time.monotonic()
    for i in range(messages):
        client.session.publish(topic, b'{"left": 0, "right": %d}' % (i % 100), qos=0)
    flood_s = time.monotonic() - t0
    other = next(((n, d) for n, d in stack.seen.devices() if n == target[0] and d != target[1]), target)
    t1 = time.monotonic()
    try:
        rep = client.call(other[0], other[1], "set_speed" if other in robots else "cancel", {"left": 0, "right": 0}
                          if other in robots else {}, timeout=30.0)
        answered: float | None = time.monotonic() - t1
        ok = rep.ok or (rep.error or {}).get("code") in STABLE_CODES
    except TimeoutError:
        answered, ok = None, False
    r.check("a command right after the flood is answered", answered is not None and ok,
            f"{_fmt(answered)} after {messages} requests sent in {flood_s:.2f} s")
    r.check("nodes still online", stack.all_online(), ", ".join(sorted(stack.seen.online_nodes())))
    client.close()
    processes_alive(stack, r)
    return r


def soak(stack: SimStack, duration_s: float, sample_every_s: float, warmup_s: float) -> FaultResult:
    """The whole stack under light command load: RSS growth <= 5 % after warm-up, threads not growing."""
    from tests.chaos.stack import sample

    r = FaultResult(f"soak {duration_s:.0f} s")
    client = stack.client(f"chaos-soak-{os.getpid()}")
    robots = epuck_devices(stack)
    pids = {p.name: p.pid for p in stack.procs.values() if p.alive() and p.pid}
    series: dict[str, list[Any]] = {n: [] for n in pids}
    t0 = time.monotonic()
    next_sample = t0
    calls = failures = 0
    while time.monotonic() - t0 < duration_s:
        now = time.monotonic()
        if now >= next_sample:
            for n, pid in pids.items():
                s = sample(pid)  # type: ignore[arg-type]
                if s is not None:
                    series[n].append(s)
            next_sample += sample_every_s
        for node, dev in robots:
            calls += 1
            try:
                if not client.call(node, dev, "set_speed", {"left": 50, "right": -50}, timeout=10).ok:
                    failures += 1
            except TimeoutError:
                failures += 1
        time.sleep(0.1)
    for n, pid in pids.items():
        s = sample(pid)  # type: ignore[arg-type]
        if s is not None:
            series[n].append(s)
    client.close()
    r.check("every command answered ok", failures == 0, f"{calls - failures} of {calls}")
    for n, ss in sorted(series.items()):
        warm = [s for s in ss if s.t - t0 >= warmup_s]
        if len(warm) < 2:
            r.check(f"{n}: samples after warm-up", False, f"{len(warm)} samples")
            continue
        growth = (warm[-1].rss_kb - warm[0].rss_kb) / warm[0].rss_kb
        cpu = (ss[-1].cpu_s - ss[0].cpu_s) / max(ss[-1].t - ss[0].t, 1e-9)
        r.check(f"{n}: RSS growth <= 5 % after warm-up", growth <= 0.05,
                f"{warm[0].rss_kb / 1024:.1f} -> {warm[-1].rss_kb / 1024:.1f} MiB ({growth:+.1%}); "
                f"CPU {cpu:.0%} of a core")
        r.check(f"{n}: threads not growing", warm[-1].threads <= warm[0].threads,
                f"{warm[0].threads} -> {warm[-1].threads}")
    processes_alive(stack, r)
    return r


def table(results: list[FaultResult]) -> str:
    rows = [("fault", "invariant", "result", "measured")]
    for res in results:
        for c in res.checks:
            rows.append((res.fault, c.invariant, "ok" if c.ok else "VIOLATED", c.measured))
    widths = [min(max(len(row[i]) for row in rows), 60) for i in range(3)]
    lines = []
    for row in rows:
        lines.append("  ".join(col[:60].ljust(w) for col, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    n = sum(len(x.checks) for x in results)
    v = sum(len(x.violations) for x in results)
    lines.append(f"{len(results)} faults injected, {n} invariants checked, {v} violations")
    return "\n".join(lines)
