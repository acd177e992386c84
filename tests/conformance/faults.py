"""The fault script, the same for every service (docs/kit.md, "Health: one meaning in every service").

Each fault brings its stack to the baseline it needs (node up, simulator up, every device operational), applies
the fault, watches the health a subscriber sees, and puts the stack back. Deadlines count from the fault:
- a device never heard from: `unreachable`, `connection: false` within its budget (+ the node's start-up);
- a device that hangs (SIGSTOP: the link stays open, data stops): `connection: false` within budget + 0.5 s,
  and never `connection: true` after that while it hangs;
- a device that vanishes (kill -9): `connection: false` within budget + 0.5 s;
  (the budget is the one the device declares at the fault, `details.link.liveness_s`, when longer than the rig's:
  a budget may follow what the device sends; a baseline device has been operational for 1 s before a fault)
- a device that returns: every device operational within the rig's `return_s`;
- garbage, or a device of the wrong kind, at the device's address: never `connection: true`; the wrong kind
  is an `error` that says so, and does not flap;
- `error` never true during any other fault; the rig's read-only command answered (ok, or a stable error code)
  within its timeout during every fault;
- broker killed and restarted: the node online again within 5 s, its devices operational;
- node killed -9: its Last Will (`online: false`) within 2 s;
- SIGTERM: exit 0, `online: false, reason: shutdown`, and every device's final health `stopped`, `connection:
  false`.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable

from tests.conformance.harness import STARTUP_S, Stack, Verdict

FAULTS = ("absent", "returns", "hang", "vanish", "garbage", "wrong_kind", "broker", "node_kill9", "sigterm")
SLACK_S = 0.5   # on top of a budget: the observer's and the broker's share of the time
SETTLE_S = 1.0  # a baseline device has been operational this long before a fault


def _error_flips(stack: Stack, t0: float) -> dict[str, int]:
    out = {}
    for d in stack.rig.devices:
        errs = [bool(h.get("error")) for _, h in stack.health_since(d, t0)]
        out[d] = sum(1 for a, b in itertools.pairwise(errs) if a != b) + (1 if errs and errs[0] else 0)
    return out


def _states(stack: Stack) -> str:
    return ", ".join(sorted({str(stack.latest(d).get("state")) for d in stack.rig.devices}))


def baseline(stack: Stack, need_sim: bool = True) -> list[str]:
    """Node online, simulator running, every device operational; returns what went wrong getting there."""
    problems = []
    if stack.node is None or not stack.node.alive():
        stack.start_node()
    if need_sim and (stack.sim is None or not stack.sim.alive() or stack.sim.name != "sim"):
        stack.stop_sim()
        stack.start_sim()
    if stack.wait(stack.online, STARTUP_S) is None:
        problems.append("node not online: " + (stack.node.tail(5) if stack.node else ""))
    if need_sim and stack.wait(stack.operational, STARTUP_S + stack.rig.return_s) is None:
        problems.append(f"not operational at baseline (states: {_states(stack)})")
    elif need_sim:
        time.sleep(SETTLE_S)  # not a fault right at the first valid data: a steady device first
    return problems


def budget_now(stack: Stack) -> float:
    """The liveness budget the devices declare now (`details.link.liveness_s`, the kit's supervisor: it may follow
    what a device sends, e.g. an e-puck2's image interval), or the rig's, whichever is longer."""
    out = stack.rig.liveness_s
    for d in stack.rig.devices:
        link = (stack.latest(d).get("details") or {}).get("link") or {}
        declared = link.get("liveness_s") if isinstance(link, dict) else None
        if isinstance(declared, (int, float)) and declared > out:
            out = float(declared)
    return out


def _read_ok(stack: Stack, problems: list[str], when: str) -> None:
    ok, what, dt = stack.call_read()
    if not ok:
        problems.append(f"read command during {when}: {what} after {dt:.1f} s")


def _verdict(stack: Stack, fault: str, seen: str, seconds: float | None, problems: list[str]) -> Verdict:
    return Verdict(stack.service, fault, seen, seconds, not problems, problems)


def absent(stack: Stack) -> Verdict:
    problems: list[str] = []
    stack.stop_sim()
    stack.start_node()
    t0 = time.monotonic()
    if stack.wait(stack.online, STARTUP_S) is None:
        tail = stack.node.tail(5) if stack.node else ""
        return _verdict(stack, "absent", "node never online", None, ["node not online: " + tail])
    t_online = time.monotonic()
    budget = stack.rig.liveness_s
    took = stack.wait(lambda: stack.all_devices(lambda h: h.get("connection") is False
                                                 and h.get("state") == "unreachable"), budget + 2 * SLACK_S + 3.0)
    if took is None:
        problems.append(f"not unreachable within {budget + 2 * SLACK_S + 3.0:.1f} s of the node online "
                        f"(states: {_states(stack)})")
    elif (t_online + took) - t0 > budget + STARTUP_S:
        problems.append("unreachable too late")
    _read_ok(stack, problems, "absence")
    flips = _error_flips(stack, t0)
    if any(flips.values()):
        problems.append(f"error flipped while absent: {flips}")
    return _verdict(stack, "absent", _states(stack), took, problems)


def returns(stack: Stack) -> Verdict:
    problems: list[str] = []
    if stack.node is None:
        problems += baseline(stack, need_sim=False)
    stack.stop_sim()
    stack.start_sim()
    took = stack.wait(stack.operational, STARTUP_S + stack.rig.return_s)
    if took is None:
        problems.append(f"not operational within {STARTUP_S + stack.rig.return_s:.0f} s of the simulator's "
                        f"start (states: {_states(stack)})")
    return _verdict(stack, "returns", _states(stack), took, problems)


def _gone(stack: Stack, fault: str, act: Callable[[], None], restore: Callable[[], None]) -> Verdict:
    problems = baseline(stack)
    if problems:
        return _verdict(stack, fault, "no baseline", None, problems)
    limit = budget_now(stack) + SLACK_S
    t0 = time.monotonic()
    act()
    took = stack.wait(lambda: stack.all_devices(lambda h: h.get("connection") is False), limit + 2.0)
    if took is None:
        problems.append(f"connection still true {limit + 2.0:.1f} s after the fault (states: {_states(stack)})")
    elif took > limit:
        problems.append(f"connection false after {took:.2f} s, allowed {limit:.2f} s")
    seen = _states(stack)
    _read_ok(stack, problems, fault)
    time.sleep(1.0)
    late_true = [d for d in stack.rig.devices for t, h in stack.health_since(d, t0 + limit + 0.2)
                 if h.get("connection")]
    if late_true:
        problems.append(f"connection: true while the device is gone ({sorted(set(late_true))})")
    flips = _error_flips(stack, t0)
    if any(flips.values()):
        problems.append(f"error flipped: {flips}")
    restore()
    back = stack.wait(stack.operational, STARTUP_S + stack.rig.return_s)
    if back is None:
        problems.append(f"not operational again after the device returned (states: {_states(stack)})")
    return _verdict(stack, fault, seen, took, problems)


def hang(stack: Stack) -> Verdict:
    return _gone(stack, "hang", lambda: stack.sim.signal(signal.SIGSTOP) if stack.sim else None,
                 lambda: stack.sim.signal(signal.SIGCONT) if stack.sim else None)


def vanish(stack: Stack) -> Verdict:
    return _gone(stack, "vanish", stack.stop_sim, stack.start_sim)


def _impostor(stack: Stack, fault: str, argv: list[str], expect_error: bool) -> Verdict:
    problems = baseline(stack)
    if problems:
        return _verdict(stack, fault, "no baseline", None, problems)
    t0 = time.monotonic()
    stack.stop_sim()
    stack.start_sim(argv, name=fault)
    limit = stack.rig.liveness_s + SLACK_S
    if expect_error:
        took = stack.wait(lambda: stack.all_devices(lambda h: bool(h.get("error"))), STARTUP_S + limit)
        if took is None:
            problems.append(f"no error for a device of the wrong kind (states: {_states(stack)})")
    else:
        took = stack.wait(lambda: stack.all_devices(lambda h: h.get("connection") is False), STARTUP_S + limit)
        if took is None:
            problems.append(f"connection still true with garbage (states: {_states(stack)})")
    seen = _states(stack)
    _read_ok(stack, problems, fault)
    time.sleep(2.0)
    if stack.node is None or not stack.node.alive():
        problems.append("the node died: " + (stack.node.tail(8) if stack.node else ""))
    t_settled = t0 + (took or 0.0) + 0.5
    for d in stack.rig.devices:
        later = stack.health_since(d, t_settled)
        if any(h.get("connection") for _, h in later):
            problems.append(f"{d}: connection: true from a device that is not it")
        if expect_error and any(not h.get("error") for _, h in later):
            problems.append(f"{d}: error flapped")
    if not expect_error:
        flips = _error_flips(stack, t0)
        if any(flips.values()):
            problems.append(f"error for garbage flipped: {flips}")
    stack.stop_sim()
    stack.start_sim()
    if stack.wait(stack.operational, STARTUP_S + stack.rig.return_s) is None:
        problems.append(f"not operational again after the real device returned (states: {_states(stack)})")
    return _verdict(stack, fault, seen, took, problems)


def garbage(stack: Stack) -> Verdict:
    assert stack.rig.garbage_sim is not None
    return _impostor(stack, "garbage", stack.rig.garbage_sim(stack.ports), expect_error=False)


def wrong_kind(stack: Stack) -> Verdict:
    assert stack.rig.wrong_kind_sim is not None
    return _impostor(stack, "wrong_kind", stack.rig.wrong_kind_sim(stack.ports), expect_error=True)


def broker(stack: Stack) -> Verdict:
    problems = baseline(stack)
    if problems:
        return _verdict(stack, "broker", "no baseline", None, problems)
    stack.broker.kill()
    with stack.seen.lock:
        stack.seen.status.clear()
    time.sleep(1.0)
    stack.broker.start()
    took = stack.wait(stack.online, 5.0 + SLACK_S)
    if took is None:
        problems.append("node not online within 5 s of the broker's return")
    if stack.wait(stack.operational, stack.rig.liveness_s + 5.0) is None:
        problems.append(f"devices not operational after the broker's return (states: {_states(stack)})")
    return _verdict(stack, "broker", "online again", took, problems)


def node_kill9(stack: Stack) -> Verdict:
    problems = baseline(stack)
    if problems:
        return _verdict(stack, "node_kill9", "no baseline", None, problems)
    assert stack.node is not None
    stack.node.kill()
    took = stack.wait(lambda: not stack.online(), 2.0)
    if took is None:
        problems.append("no Last Will (online: false) within 2 s")
    stack.start_node()
    if stack.wait(lambda: stack.online() and stack.operational(), STARTUP_S + stack.rig.return_s) is None:
        problems.append(f"restarted node not operational (states: {_states(stack)})")
    return _verdict(stack, "node_kill9", "Last Will", took, problems)


def sigterm(stack: Stack) -> Verdict:
    problems = baseline(stack)
    if problems:
        return _verdict(stack, "sigterm", "no baseline", None, problems)
    assert stack.node is not None
    t0 = time.monotonic()
    rc = stack.node.stop(15.0)
    took = time.monotonic() - t0
    if rc != 0:
        problems.append(f"exit status {rc}: " + stack.node.tail(8))
    time.sleep(0.3)
    with stack.seen.lock:
        last = stack.seen.status[-1][1] if stack.seen.status else {}
    if last.get("online") is not False or last.get("reason") != "shutdown":
        problems.append(f"last status {last}")
    for d in stack.rig.devices:
        h = stack.latest(d)
        if h.get("state") != "stopped" or h.get("connection") is not False:
            problems.append(f"{d}: final health state={h.get('state')} connection={h.get('connection')}")
        link = (h.get("details") or {}).get("link") or {}
        if isinstance(link, dict) and link.get("valid_data"):
            problems.append(f"{d}: final health claims valid data")
    stack.node = None
    return _verdict(stack, "sigterm", "stopped", took, problems)


SCRIPT: dict[str, Callable[[Stack], Verdict]] = {
    "absent": absent, "returns": returns, "hang": hang, "vanish": vanish, "garbage": garbage,
    "wrong_kind": wrong_kind, "broker": broker, "node_kill9": node_kill9, "sigterm": sigterm,
}
