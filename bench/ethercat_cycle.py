"""EtherCAT cycle benchmark: the ethercat-loop node (MQTT process + realtime cycle process, pysoem)
at 1 kHz against the virtual hand on a veth pair in a private namespace, with joints state
published at 100 Hz and a client sending demand commands at 200 Hz; `cyclictest` (rt-tests) runs
in the same window at the same period as the anchor for what this machine allows.

    python bench/ethercat_cycle.py [--seconds 60] [--quick] [--hog] [--runs N] [--priority 80]
                                   [--period-us 1000] [--cpus LAST] [--hand-cpus THE_OTHERS]
                                   [--hand-priority PRIORITY+10] [--mqtt-priority 10] [--path-sched fifo:10]
                                   [--demand-qos 1] [--cyclictest-cpus CYCLE'S] [--cyclictest-priority PRIORITY+1]
                                   [--cyclictest-lead-us 0] [--iface IFNAME [--netns NAME]]

`--hog`: a busy host. `stress-ng --cpu 2 --vm 1 --vm-bytes 512M --sock 1 --hdd 1 --hdd-bytes 256M` at ordinary
priority on every CPU for each whole run (cyclictest, in the same run, sees the same load). `--runs N`: N runs in
a row; each target is judged on its worst run.

`--iface IFNAME` measures an external hand on a real interface (ROBOBUS_ETHERCAT_BACKEND=nic): no namespace
or virtual hand is built; demand-to-wire then ends at the kernel's transmit timestamp of the command frame
on the master's own NIC (a tap on IFNAME, `--netns` if the NIC lives in a namespace), and the hand's answer
times are not known (null).

Placement and priorities, as services/ethercat_loop/README.md "Priorities on a busy host" sets them: the cycle
process SCHED_FIFO 80 on the last CPU; the virtual hand on the others at SCHED_FIFO 90 (it stands for hardware,
which no load of the host delays); the node's MQTT process SCHED_FIFO 10 (ROBOBUS_ETHERCAT_MQTT_RT_PRIORITY, as
the realtime container runs it); the rest of the command path, the user's broker and demand client, SCHED_FIFO 10
(`--path-sched`; '' leaves them at normal priority). cyclictest runs on the cycle's CPU, woken at each of the
cycle's releases (`--secaligned`; the cycle's releases are on the period grid), one priority above the cycle so
that it never waits behind it: this VM stalls its vCPUs one at a time, and only a probe on the same vCPU at the
same instants sees the stalls the cycle sees. The demand client is a bare paho client in its own process, sending
each request at a random phase against the cycle.

Figures: cycle wake-up latency p50/p99/p99.9/max, overruns (releases that could not start within
their period, as cyclictest counts late wake-ups) and late starts, lost/late frames, cycle CPU time,
exchange round trip, submit -> frame inside the node, demand-to-wire latency (the PUBLISH written to
the client's socket -> the kernel's receive time of the command frame carrying that demand at the
hand's port; also from the client's publish() call, which adds paho's packet building), the hand's
answer times, and cyclictest p50/p99/p99.9/max plus its count of wake-ups later than one period.
What the host did in the window (`host`): load, per-CPU interrupts and softirqs per second, stolen vCPU time, page
faults, context switches and locked memory of the cycle, the virtual hand and the MQTT process, and other
realtime threads seen on the machine.
Targets: wake-up p99 <= 1.5 x cyclictest's p99; overruns <= cyclictest's late wake-ups; lost frames <= 0.1 %;
cycle CPU p50 <= 60 us; demand-to-wire p99 <= 3 ms. Needs root (namespaces, raw sockets, SCHED_FIFO).
Last line: one JSON object with the figures (bench/results.py writes it to a file too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from services.ethercat_loop.protocol import PROTOCOLS, PalmCommand, unpack_command  # noqa: E402
from services.ethercat_loop.sim.esc_frames import Cmd, FrameError, parse_datagrams  # noqa: E402
from services.ethercat_loop.sim.netns import VethNetns  # noqa: E402
from services.ethercat_loop.sim.virtual_hand import realtime_minus_monotonic  # noqa: E402
from services.ethercat_loop.transport.netns import enter_netns  # noqa: E402
from shared.mqtt.session import reply_properties  # noqa: E402
from shared.rpc import RpcClient  # noqa: E402
from shared.settings import KitSettings  # noqa: E402
from shared.tools.localbroker import Broker, NodeProcess, can_netns, free_port, mosquitto_bin  # noqa: E402

NODE = "bench-ecat"
CYCLE_PHASE_NS = 1_000_000  # spread of the demand client's send times (the cycle period)
DEV = "rh"
MOTOR_DATA_AT = {"0220": 14, "0230": 22}


def pct(values: list[float] | np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


# cyclictest runs first at every release (one priority above the cycle, on its CPU): the cycle's wake-up is ~15-30 µs
# behind cyclictest's (services/ethercat_loop/README.md, "How the cycle bench measures")
NEAR_PERIOD_US = 50


def parse_cyclictest(text: str, period_us: int) -> dict[str, Any]:
    hist: dict[int, int] = {}
    overflows = 0
    for line in text.splitlines():
        if line.startswith("# Histogram Overflows"):
            overflows = int(line.split(":")[1].split()[0])
        elif line and line[0].isdigit():
            bin_us, n = line.split()[:2]
            hist[int(bin_us)] = int(n)
    total = sum(hist.values()) + overflows
    if not total:
        return {"error": "no cyclictest histogram", "raw": text[-500:]}
    arr = np.zeros(max(hist) + 2, np.int64)
    for us, count in hist.items():
        arr[us] = count
    arr[-1] += overflows
    cum = np.cumsum(arr)

    def q(p: float) -> float:
        return float(np.searchsorted(cum, p * total))

    return {"p50_us": q(0.5), "p99_us": q(0.99), "p99.9_us": q(0.999), "max_us": float(np.nonzero(arr)[0][-1]),
            "samples": int(total), "over_period": int(arr[period_us:].sum()),
            "over_half_period": int(arr[period_us // 2 :].sum()),
            # wake-ups late by less than a period, but by less than NEAR_PERIOD_US: a stall that ends there makes
            # the cycle, which runs after cyclictest at each release, a period late where cyclictest is not
            "near_period": int(arr[max(0, period_us - NEAR_PERIOD_US):period_us].sum())}


def send_demands(url: str, rate_hz: float, qos: int, ready: Connection, go: Event, stop: Event,
                 out: Connection) -> None:
    """The client under test, in its own process (the bench's subscribers and collectors must not share
    its GIL): set_demands at `rate_hz`, motor 0 cycling through 1..1000 so each value is unique for
    5 s, at MQTT QoS `qos` (1 by default; a setpoint stream may choose 0, the node answers at the
    request's QoS). A bare paho MQTT 5
    client, as another language's client would be: the request is written to the socket in this
    thread (paho writes at once when no network thread runs), so the time taken just before
    publish() is the publish, not a hop to a network thread; replies are read between requests and
    matched by correlation data. Sends back [(CLOCK_MONOTONIC ns just before the publish,
    value)], the request -> reply times (ms), the error count and a few error texts."""
    broker = KitSettings(mqtt_url=url).broker()
    cid = f"bench-ecat-demands-{os.getpid()}"
    reply_topic = f"robobus/_client/{cid}/reply"
    topic = f"robobus/{NODE}/{DEV}/cmd/set_demands"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    pending: dict[bytes, int] = {}
    rtt_ms: list[float] = []
    errors: list[str] = []
    subscribed = threading.Event()

    def on_message(_c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        t_sent = pending.pop(bytes(getattr(msg.properties, "CorrelationData", b"") or b""), None)
        if t_sent is None:
            return
        rep = json.loads(msg.payload)
        if rep.get("ok"):
            rtt_ms.append((time.monotonic_ns() - t_sent) / 1e6)
        else:
            errors.append(str(rep.get("error")))

    client.on_message = on_message
    client.on_subscribe = lambda *_a: subscribed.set()
    client.connect(broker.host, broker.port)
    sock = client.socket()
    if isinstance(sock, socket.socket):  # as any latency-minded client does (the kit's session does the same)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.subscribe(reply_topic, qos=1)
    while not subscribed.is_set():
        client.loop(0.1)
    ready.send(True)
    while not go.is_set():
        client.loop(0.05)
    period_ns = int(1e9 / rate_hz)
    sent: list[tuple[int, int, int]] = []
    nxt = time.monotonic_ns()
    v = n = 0
    while not stop.is_set():
        v = v % 1000 + 1
        n += 1
        corr = n.to_bytes(8, "big")
        props = reply_properties(reply_topic, corr, "application/json")
        body = json.dumps({"motors": {"0": v}})
        t_call = time.monotonic_ns()
        pending[corr] = t_call
        client.publish(topic, body, qos=qos, properties=props)
        # paho has written the PUBLISH to the socket when publish() returns (no network thread here)
        sent.append((time.monotonic_ns(), v, t_call))
        # a random phase against the 1 ms cycle for each request: both clocks are CLOCK_MONOTONIC, and a
        # client on an exact 5 ms grid would meet the cycle at the same point of its period all run long
        # (the wait for the next tick, 0-1 ms, would be one fixed value instead of its real spread)
        nxt += period_ns
        at = nxt + random.randrange(CYCLE_PHASE_NS)
        while (left := at - time.monotonic_ns()) > 0:
            client.loop(left / 1e9)
    t_end = time.monotonic() + 2.0
    while pending and time.monotonic() < t_end:
        client.loop(0.05)
    if pending:
        errors.append(f"{len(pending)} requests without a reply within 2 s")
    client.disconnect()
    out.send({"sent": sent, "rtt_ms": rtt_ms, "errors": len(errors), "error_samples": errors[:5]})


class DemandSender:
    """`send_demands` in a spawned process; `result()` after `stop()`."""

    def __init__(self, url: str, rate_hz: float, qos: int) -> None:
        ctx = mp.get_context("spawn")
        ready_r, ready_w = ctx.Pipe(duplex=False)
        self._out_r, out_w = ctx.Pipe(duplex=False)
        self._go, self._stop = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=send_demands, args=(url, rate_hz, qos, ready_w, self._go, self._stop, out_w),
                                daemon=True)
        self.proc.start()
        if not ready_r.poll(30):
            raise RuntimeError("the demand client did not connect within 30 s")
        ready_r.recv()

    def start(self) -> None:
        self._go.set()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if not self._out_r.poll(30):
            self.proc.kill()
            raise RuntimeError("the demand client did not report")
        res: dict[str, Any] = self._out_r.recv()
        self.proc.join(5)
        return res


ETH_P_ALL = 0x0003
ETHERTYPE_ECAT = b"\x88\xa4"
PACKET_OUTGOING = 4
SO_TIMESTAMPNS = 35
ETH_HEADER = 14


class WireTap:
    """The command frames the master sends on IFNAME, as (CLOCK_MONOTONIC ns of the kernel's transmit
    timestamp, frame number, command hex) whenever the command changed: the external-hand twin of the
    virtual hand's change log. The command is the first `command_size` bytes of an LRW (SII mapping: the
    palm's outputs start the process image) or the data of an FPWR to the palm's SM0 (programmed mapping)."""

    def __init__(self, iface: str, netns: str | None, protocol: str) -> None:
        self.iface, self.netns = iface, netns
        self.info = PROTOCOLS[protocol]
        self.changes: list[tuple[int, int, str]] = []
        self.frames = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wire-tap", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"cannot tap {iface}: {self._error}")

    def _run(self) -> None:
        try:
            if self.netns:
                enter_netns(self.netns)  # this thread only
            # outgoing frames reach only ETH_P_ALL sockets (the kernel's taps), not per-protocol ones
            sk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sk.bind((self.iface, ETH_P_ALL))
            sk.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            sk.settimeout(0.2)
        except BaseException as exc:  # reported by the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        offset = realtime_minus_monotonic()
        last = b""
        n = self.info.command_size
        sm0 = self.info.sync_managers[0][0]
        with sk:
            while not self._stop.is_set():
                try:
                    frame, anc, _f, meta = sk.recvmsg(2048, socket.CMSG_SPACE(16))
                except TimeoutError:
                    continue
                if meta[2] != PACKET_OUTGOING or frame[12:14] != ETHERTYPE_ECAT:
                    continue
                t = time.monotonic_ns()
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                        sec, nsec = struct.unpack("qq", data[:16])
                        t = sec * 1_000_000_000 + nsec - offset
                try:
                    dgs = parse_datagrams(frame[ETH_HEADER:])
                except FrameError:
                    continue
                self.frames += 1
                for d in dgs:
                    cmd = bytes(d.data[:n]) if (d.cmd == Cmd.LRW and len(d.data) >= n) or (
                        d.cmd == Cmd.FPWR and d.ado == sm0 and len(d.data) == n) else None
                    if cmd is not None and cmd != last:
                        last = cmd
                        self.changes.append((t, self.frames, cmd.hex()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def collect_changes(ctl: Any, sink: list[tuple[int, int, str]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            sink.extend(ctl.call("changes", max=600)["changes"])
        except OSError:
            pass
        stop.wait(0.1)


def demand_to_wire(sent: list[tuple[int, int, int]], changes: list[tuple[int, int, str]], proto: str
                   ) -> tuple[list[float], list[float]]:
    """For each sent demand, the first command frame after the publish whose motor 0 demand carries it:
    (ms from the PUBLISH written to the client's socket, ms from the client's publish() call)."""
    seen: list[tuple[int, int]] = []
    for t, _frame, hexcmd in changes:
        cmd = unpack_command(bytes.fromhex(hexcmd), proto)
        if isinstance(cmd, PalmCommand):
            seen.append((t, cmd.motor_data[0]))
    seen.sort()
    times = np.array([t for t, _ in seen], np.int64)
    wire: list[float] = []
    call: list[float] = []
    for t_pub, v, t_call in sent:
        i = int(np.searchsorted(times, t_call))
        for j in range(i, min(i + 400, len(seen))):
            if seen[j][1] == v:
                wire.append((seen[j][0] - t_pub) / 1e6)
                call.append((seen[j][0] - t_call) / 1e6)
                break
    return wire, call


# the mixed load of a user's host (CPU, memory, loopback sockets, disk), at ordinary priority on every CPU
HOG = ["--cpu", "2", "--vm", "1", "--vm-bytes", "512M", "--sock", "1", "--hdd", "1", "--hdd-bytes", "256M"]
WAKE_P99_VS_CYCLICTEST = 1.5  # wake-up p99 <= 1.5 x cyclictest's p99
LOST_FRAMES_PCT = 0.1  # lost frames <= 0.1 % of the frames sent in the window
CPU_P50_US = 60.0  # cycle CPU time p50
DEMAND_TO_WIRE_P99_MS = 3.0


class Hog:
    """`stress-ng` with HOG (or `args`) at ordinary priority for as long as it is held; its disk files in `tmp`."""

    def __init__(self, tmp: Path, args: list[str] | None = None) -> None:
        exe = shutil.which("stress-ng")
        if exe is None:
            raise RuntimeError("stress-ng is not installed (apt-get install stress-ng)")
        self.cmd = [exe, *(args or HOG), "--timeout", "0", "--quiet", "--temp-path", str(tmp)]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def set_sched(pid: int | None, spec: str) -> str:
    """Every thread of `pid` to `spec`: 'nice:N' (SCHED_OTHER at nice N) or 'fifo:N' (SCHED_FIFO N); '' leaves
    it. Returns what was applied or why not."""
    if not spec or pid is None:
        return "as started"
    kind, _, val = spec.partition(":")
    try:
        for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
            if kind == "nice":
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, int(val))
            elif kind == "fifo":
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(int(val)))
            else:
                raise ValueError(f"unknown scheduling {spec!r} (nice:N or fifo:N)")
    except OSError as exc:
        return f"{spec} refused ({exc})"
    return spec

class RtWatch:
    """Other user threads at SCHED_FIFO/RR during the window (every `every` s), as 'comm/prio@cpu' -> samples
    seen: on a shared machine, realtime work that is not this run's can preempt the virtual hand or the cycle."""

    def __init__(self, own: set[int], every: float = 1.0) -> None:
        self.own, self.every = own, every
        self.seen: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rt-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            ps = subprocess.run(["ps", "-eLo", "pid=,cls=,rtprio=,psr=,comm=,args="], capture_output=True,
                                text=True).stdout
            self.samples += 1
            for line in ps.splitlines():
                f = line.split(None, 5)
                if len(f) == 6 and f[1] in ("FF", "RR") and not f[5].startswith("[") and int(f[0]) not in self.own:
                    key = f"{f[4]}/{f[2]}@{f[3]}"
                    self.seen[key] = self.seen.get(key, 0) + 1

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        return {"samples": self.samples, "seen": dict(sorted(self.seen.items(), key=lambda kv: -kv[1])[:12])}


def steal_ticks() -> list[int]:
    """Time the hypervisor took from each vCPU so far (USER_HZ ticks, /proc/stat): vCPU stalls."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            out.append(int(line.split()[8]))
    return out

class IrqAffinity:
    """Every device interrupt that can move to `cpus` (e.g. off the cycle's CPU) for as long as it is held, then
    back where it was: what a host that drives the hand sets for good (irqaffinity= on the kernel's command line,
    or irqbalance's IRQBALANCE_BANNED_CPULIST)."""

    def __init__(self, cpus: str) -> None:
        self.saved: dict[Path, str] = {}
        self.refused: list[str] = []
        for f in sorted(Path("/proc/irq").glob("*/smp_affinity_list")):
            try:
                old = f.read_text().strip()
                if old != cpus:
                    f.write_text(cpus)
                    self.saved[f] = old
            except OSError as exc:  # per-CPU and managed interrupts do not move
                self.refused.append(f"{f.parent.name}: {exc.strerror}")

    def restore(self) -> None:
        for f, old in self.saved.items():
            with contextlib.suppress(OSError):
                f.write_text(old)

def child_pid(parent: int, needle: str, timeout: float = 10.0) -> int | None:
    """The pid of `parent`'s child whose command line holds `needle` (the node's cycle process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                if ppid == parent and needle in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    return int(d.name)
            except (OSError, ValueError):
                continue
        time.sleep(0.1)
    return None


def _per_cpu_table(path: str) -> dict[str, list[int]]:
    """/proc/interrupts or /proc/softirqs: name -> count per CPU."""
    out: dict[str, list[int]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    ncpu = len(lines[0].split())
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        counts = [int(f) for f in fields[:ncpu] if f.isdigit()]
        if len(counts) == ncpu:
            label = " ".join(fields[ncpu:]).strip()
            out[f"{name.strip()} {label}".strip()] = counts
    return out


def _proc_counts(pid: int) -> dict[str, int]:
    """Page faults, context switches and CPU ticks of a process (all its threads)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    f = stat[stat.rindex(")") + 2 :].split()
    out = {"minflt": int(f[7]), "majflt": int(f[9]), "utime_ticks": int(f[11]), "stime_ticks": int(f[12])}
    for line in status.splitlines():
        key, _, val = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            out[key] = int(val)
        elif key in ("VmLck", "VmRSS"):
            out[key + "_kB"] = int(val.split()[0])
    return out


def host_sample(procs: dict[str, int | None]) -> dict[str, Any]:
    return {"t": time.monotonic(), "load": os.getloadavg(), "steal": steal_ticks(),
            "interrupts": _per_cpu_table("/proc/interrupts"),
            "softirqs": _per_cpu_table("/proc/softirqs"),
            "procs": {name: _proc_counts(pid) for name, pid in procs.items() if pid is not None}}


def host_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What the host did during the window: per CPU, the interrupts and softirqs per second that moved (the
    busiest first); per process, page faults and context switches over the window, and its locked memory."""
    dt = max(b["t"] - a["t"], 1e-9)

    def rates(x: dict[str, list[int]], y: dict[str, list[int]]) -> dict[str, list[float]]:
        moved = {k: [round((n1 - n0) / dt, 1) for n0, n1 in zip(x[k], y[k], strict=True)]
                 for k in y if k in x and len(x[k]) == len(y[k]) and y[k] != x[k]}
        return dict(sorted(moved.items(), key=lambda kv: -sum(kv[1]))[:12])

    procs: dict[str, dict[str, int]] = {}
    for name, after in b["procs"].items():
        before = a["procs"].get(name, {})
        procs[name] = {k: v - before.get(k, 0) for k, v in after.items() if not k.endswith("_kB")}
        procs[name].update({k: v for k, v in after.items() if k.endswith("_kB")})
    return {"seconds": round(dt, 2), "load_start": [round(x, 2) for x in a["load"]],
            "load_end": [round(x, 2) for x in b["load"]],
            "steal_ms_per_cpu": [round((s1 - s0) * 1000 / os.sysconf("SC_CLK_TCK")) for s0, s1 in
                                 zip(a["steal"], b["steal"], strict=True)],
            "interrupts_per_s": rates(a["interrupts"], b["interrupts"]),
            "softirqs_per_s": rates(a["softirqs"], b["softirqs"]), "procs": procs}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The realtime path's targets (as results.Figure fields): wake-up p99 against cyclictest's, overruns against
    cyclictest's late wake-ups, lost frames, cycle CPU, demand-to-wire."""
    c, ctr, d2w = result["cycle"], result["cyclictest"], result["demand_to_wire_ms"]
    ct_p99, ct_late = ctr.get("p99_us"), ctr.get("over_period")
    lost_pct = round(100.0 * c["lost_frames"] / c["frames"], 4) if c.get("frames") else None
    return [
        {"name": "cycle wake-up p99 / cyclictest's p99", "unit": "x", "op": "<=", "target": WAKE_P99_VS_CYCLICTEST,
         "value": round(c["wake_p99_us"] / ct_p99, 3) if ct_p99 else None},
        {"name": "overruns - cyclictest's late wake-ups", "unit": "", "op": "<=", "target": 0,
         "value": c["overruns"] - ct_late if ct_late is not None else None},
        {"name": "lost frames", "unit": "%", "op": "<=", "target": LOST_FRAMES_PCT, "value": lost_pct},
        {"name": "cycle CPU p50", "unit": "µs", "op": "<=", "target": CPU_P50_US, "value": c["cpu_p50_us"]},
        {"name": "demand-to-wire p99", "unit": "ms", "op": "<=", "target": DEMAND_TO_WIRE_P99_MS,
         "value": round(d2w["p99"], 3) if d2w.get("p99") is not None else None},
    ]


def met(row: dict[str, Any]) -> bool:
    return row["value"] is not None and row["value"] <= row["target"]


def print_run(result: dict[str, Any]) -> None:
    c, ctr, h = result.get("cycle", {}), result.get("cyclictest", {}), result.get("host", {})
    print(f"load {h.get('load_start')} -> {h.get('load_end')}{' (with --hog)' if result.get('hog') else ''}")
    print(f"cycle  wake p50/p99/p99.9/max {c.get('wake_p50_us')}/{c.get('wake_p99_us')}/{c.get('wake_p99.9_us')}/"
          f"{c.get('wake_max_us')} us, overruns {c.get('overruns')}, lost {c.get('lost_frames')} of "
          f"{c.get('frames')}, cpu p50/p99 {c.get('cpu_p50_us')}/{c.get('cpu_p99_us')} us")
    print(f"cyclictest p50/p99/p99.9/max {ctr.get('p50_us')}/{ctr.get('p99_us')}/{ctr.get('p99.9_us')}/"
          f"{ctr.get('max_us')} us, late wake-ups {ctr.get('over_period')} (and {ctr.get('near_period')} within "
          f"{NEAR_PERIOD_US} us of a period: a stall ending there is an overrun for the cycle, which runs after it)")
    answer = (result.get("virtual_hand") or {}).get("answer") or {}
    if answer:
        # the cycle reads a reply at its next release: at 1 kHz, a frame the hand answered 1 ms late is lost
        print(f"virtual hand answers later than 500/1000 us: {answer.get('over_500us')}/{answer.get('over_1000us')}, "
              f"max {answer.get('max_us')} us (lost {c.get('lost_frames')}); stolen vCPU time "
              f"{h.get('steal_ms_per_cpu')} ms per CPU")
    print(f"demand-to-wire ms {result.get('demand_to_wire_ms')}")
    for name, p in h.get("procs", {}).items():
        print(f"{name:13s} {p}")
    for row in result.get("targets", []):
        print(f"  {row['name']:<40} {row['value']!s:>9} {row['unit']:<3} {row['op']} {row['target']:<5} "
              f"{'met' if met(row) else 'not met'}")


@dataclass
class Plan:
    """What one run measures, derived from the command line once."""

    seconds: float
    external: bool
    hand_cpus: str
    ct_cpus: str
    ct_prio: int
    aligned: bool
    ct_offset_us: int
    ct_align: list[str]
    hand_priority: int


def run_once(a: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """One run: broker, namespace + virtual hand (or the external NIC), the node, the demand client and
    cyclictest; returns the result object (the JSON line)."""
    seconds, external, hand_cpus = plan.seconds, plan.external, plan.hand_cpus
    ct_cpus, ct_prio = plan.ct_cpus, plan.ct_prio
    aligned, ct_offset_us, ct_align = plan.aligned, plan.ct_offset_us, plan.ct_align
    result: dict[str, Any] = {"bench": "ethercat_cycle", "seconds": seconds, "period_us": a.period_us,
                              "priority": a.priority, "protocol": a.protocol,
                              "cpus": {"cycle": a.cpus or "any", "virtual_hand": hand_cpus or "any",
                                       "cyclictest": ct_cpus or "any", "of": os.cpu_count()},
                              "cyclictest_priority": ct_prio, "hand_priority": plan.hand_priority,
                              "mqtt_priority": a.mqtt_priority,
                              "cyclictest_lead_us": a.cyclictest_lead_us if aligned else None,
                              "demand_qos": a.demand_qos,
                              "hand": f"external on {a.iface}" if external else "virtual (veth pair)"}
    if external:
        result["cpus"]["virtual_hand"] = None
    with tempfile.TemporaryDirectory(prefix="robobus-bench-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        ns = None if external else VethNetns(f"rbbench{os.getpid()}")
        tap: WireTap | None = None
        ctl: Any = None
        node: NodeProcess | None = None
        sender: DemandSender | None = None
        clients: list[RpcClient] = []
        ct: subprocess.Popen[str] | None = None
        try:
            if ns is not None:
                ns.up()
                at = MOTOR_DATA_AT[a.protocol]
                ctl = ns.start_hand(a.protocol, ["--rt-priority", str(plan.hand_priority), "--watch",
                                                 f"{at}:40", *(["--cpus", hand_cpus] if hand_cpus else [])])
                iface, netns, backend = ns.master_if, ns.name, "virtual"
            else:
                iface, netns, backend = a.iface, a.netns or "", "nic"
            env = {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": NODE, "ROBOBUS_ETHERCAT_BACKEND": backend,
                   "ROBOBUS_ETHERCAT_IFNAME": iface, "ROBOBUS_ETHERCAT_NETNS": netns,
                   "ROBOBUS_ETHERCAT_PROTOCOL": a.protocol, "ROBOBUS_ETHERCAT_RT_PRIORITY": str(a.priority),
                   "ROBOBUS_ETHERCAT_MQTT_RT_PRIORITY": str(a.mqtt_priority),
                   "ROBOBUS_ETHERCAT_PERIOD_US": str(a.period_us), "ROBOBUS_LOG_LEVEL": "WARNING",
                   "ROBOBUS_ETHERCAT_DEMAND_TIMEOUT_MS": "1000"}
            if a.cpus:
                env["ROBOBUS_ETHERCAT_CPUS"] = json.dumps([int(c) for c in a.cpus.split(",")])
            node = NodeProcess(["-m", "services.ethercat_loop"], env)
            client = RpcClient(broker.settings(), name="bench-ecat-client")
            client.connect()
            clients.append(client)
            joints: list[float] = []
            stats_msgs: list[dict[str, Any]] = []
            client.subscribe_before(f"robobus/{NODE}/{DEV}/state/joints", lambda m: joints.append(time.monotonic()))
            client.subscribe_before(f"robobus/{NODE}/{DEV}/state/loop_stats",
                                    lambda m: stats_msgs.append(json.loads(m.payload)))
            deadline = time.monotonic() + 40
            while not any(json.loads(p).get("state") == "running"
                          for _, p, _ in client.collect(f"robobus/{NODE}/{DEV}/health", 0.3)):
                if time.monotonic() > deadline or not node.alive():
                    raise RuntimeError(f"node never ran: {node.text()[-2000:]}")
            # after the wait above (collect() on the same filter would take the subscription over)
            health: list[dict[str, Any]] = []
            client.subscribe_before(f"robobus/{NODE}/{DEV}/health", lambda m: health.append(json.loads(m.payload)))
            sender = DemandSender(broker.url, 200.0, a.demand_qos)
            result["sched"] = {"node_mqtt": set_sched(node.proc.pid, a.node_sched),
                               "broker": set_sched(broker.proc.pid if broker.proc else None, a.path_sched),
                               "demand_client": set_sched(sender.proc.pid, a.path_sched)}
            time.sleep(1.0)  # let the start-up config burst pass
            changes: list[tuple[int, int, str]] = []
            stop = threading.Event()
            if ctl is not None:  # the virtual hand's change log (its kernel receive times)
                ctl.call("changes", max=100_000)
                collector = threading.Thread(target=collect_changes, args=(ctl, changes, stop), daemon=True)
            else:  # an external hand: the frames as they leave the master's NIC
                tap = WireTap(iface, netns or None, a.protocol)
                collector = threading.Thread(target=stop.wait, daemon=True)
            collector.start()
            n_stats = len(stats_msgs)  # the totals at the start: a loop_stats sent after that pull
            wait_until = time.monotonic() + 3.0
            while len(stats_msgs) <= n_stats and time.monotonic() < wait_until:
                time.sleep(0.02)
            start_stats = stats_msgs[-1]["totals"] if stats_msgs and "totals" in stats_msgs[-1] else {}
            if aligned:
                # --secaligned starts at the first full second after cyclictest's thread starts (the second
                # after that past .9 s): launched .2 s past a second, its first wake-up is known exactly
                time.sleep(((200_000_000 - time.monotonic_ns()) % 1_000_000_000) / 1e9)
            procs = {"cycle": child_pid(node.proc.pid, "services.ethercat_loop.transport.cycle"),
                     "virtual_hand": ns.hand_proc.pid if ns is not None and ns.hand_proc is not None else None,
                     "mqtt": node.proc.pid}
            host0 = host_sample(procs)
            own = {pid for pid in procs.values() if pid is not None} | {os.getpid()}
            own |= {sender.proc.pid} if sender.proc.pid is not None else set()
            own |= {broker.proc.pid} if broker.proc is not None else set()
            rt_watch = RtWatch(own)
            t_launch = time.monotonic_ns()
            ct = subprocess.Popen(["cyclictest", "-m", "-q", "-t1", f"-p{ct_prio}", f"-i{a.period_us}",
                                   *([f"-a{ct_cpus}"] if ct_cpus else []), *ct_align,
                                   "-h", "20000", "-D", f"{int(seconds)}s"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            rt_watch.own.add(ct.pid)
            j0 = len(joints)
            t0 = time.monotonic()
            sender.start()
            out, _ = ct.communicate(timeout=seconds + 30)
            t_exit = time.monotonic_ns()
            host1 = host_sample(procs)
            others_rt = rt_watch.stop()
            elapsed = time.monotonic() - t0
            j1 = len(joints)
            sent = sender.stop()
            # the totals at the end of the window: the first loop_stats (1 Hz) after cyclictest ended,
            # taken before the final pull of the hand's change log (a large reply from the single-threaded
            # hand, which delays its frames: not part of the run)
            n_stats = len(stats_msgs)
            wait_until = time.monotonic() + 3.0
            while len(stats_msgs) <= n_stats and time.monotonic() < wait_until:
                time.sleep(0.02)
            end = stats_msgs[-1]["totals"] if stats_msgs else {}
            stop.set()
            collector.join(5)
            if ctl is not None:
                changes.extend(ctl.call("changes", max=100_000)["changes"])
                hand_stats = ctl.call("stats")
            else:
                assert tap is not None
                tap.stop()
                changes.extend(tap.changes)
                hand_stats = {"pd_frames": tap.frames, "palm_cycles": None, "dropped": None, "delayed": None,
                              "answer": None}
            lat, lat_call = demand_to_wire(sent["sent"], changes, a.protocol)
            ctr = parse_cyclictest(out, a.period_us)
            overruns = end.get("overruns", 0) - start_stats.get("overruns", 0)
            window = "node loop_stats around the cyclictest run"
            releases = end.get("overrun_releases_ns", [])
            # the cycle's overruns whose release lies in cyclictest's own sampling window: from its first
            # wake-up to its exit (less two periods), so both count over the same stretch of time
            w0 = (t_launch // 1_000_000_000 + 1) * 1_000_000_000 + (ct_offset_us + a.period_us) * 1000
            w1 = t_exit - 2 * a.period_us * 1000
            ring_complete = len(releases) == end.get("overruns", 0) or (releases and min(releases) < w0)
            if aligned and ring_complete and t_launch % 1_000_000_000 < 800_000_000:
                overruns = sum(1 for r in releases if w0 <= r <= w1)
                window = f"cyclictest's sampling window ({(w1 - w0) / 1e9:.3f} s)"
            result["cycle"] = {
                "wake_p50_us": end["wake_us"]["p50"], "wake_p99_us": end["wake_us"]["p99"],
                "wake_p99.9_us": end["wake_us"]["p99.9"], "wake_max_us": end["wake_us"]["max"],
                "wake_over_period": end.get("wake_over_period", 0) - start_stats.get("wake_over_period", 0),
                "overruns": overruns, "overruns_counted_over": window, "skipped_cycles": end.get("skipped_cycles", 0)
                - start_stats.get("skipped_cycles", 0),
                "lost_frames": end.get("lost", 0) - start_stats.get("lost", 0),
                "late_frames": end.get("late", 0) - start_stats.get("late", 0),
                "wkc_errors": end.get("wkc_errors", 0) - start_stats.get("wkc_errors", 0),
                "cpu_p50_us": end["cpu_us"]["p50"], "cpu_p99_us": end["cpu_us"]["p99"],
                "cpu_mean_us": end["cpu_mean_us"], "cpu_max_us": end["cpu_max_us"],
                "rtt_p50_us": end["rtt_us"]["p50"], "rtt_p99_us": end["rtt_us"]["p99"],
                # the node's own share of demand-to-wire: the handler's submit -> the frame that carried it
                "submit_to_frame_p50_us": end.get("command_us", {}).get("p50"),
                "submit_to_frame_p99_us": end.get("command_us", {}).get("p99"),
                "overrun_causes": {k: end.get(f"overrun_{k}", 0) - start_stats.get(f"overrun_{k}", 0)
                                   for k in ("late_wake", "slow_exchange", "lost_frame", "slack_work")},
                "late_starts": end.get("late_starts", 0) - start_stats.get("late_starts", 0),
                "recent_overruns": end.get("recent_overruns", []),
                "cycles": end.get("cycles", 0), "note": "wake/cpu/rtt percentiles cover the whole node run",
                # an outage (the link lost for seconds while frames still flow): what the recovery did in the
                # window, and its last steps as health reported them
                "link": {**{k: end.get(k, 0) - start_stats.get(k, 0)
                            for k in ("no_status", "stale", "left_op", "recoveries", "escalations", "rescans")},
                         "max_consecutive_no_status": end.get("max_consecutive_no_status", 0),
                         "recovery_steps": (health[-1].get("details", {}).get("recovery") or {}).get("steps", [])[-12:]
                         if health else []},
                "realtime": (stats_msgs[-1].get("realtime") if stats_msgs else None),
            }
            result["cyclictest"] = ctr
            result["demand_to_wire_ms"] = {"p50": pct(lat, 50), "p99": pct(lat, 99), "max": max(lat) if lat else None,
                                           "from_publish_call_p50": pct(lat_call, 50),
                                           "from_publish_call_p99": pct(lat_call, 99),
                                           "matched": len(lat), "sent": len(sent["sent"]), "errors": sent["errors"],
                                           "error_samples": sent["error_samples"],
                                           "reply_p50": pct(sent["rtt_ms"], 50), "reply_p99": pct(sent["rtt_ms"], 99)}
            result["rates_hz"] = {"joints_state": round((j1 - j0) / elapsed, 1),
                                  "demands": round(len(sent["sent"]) / elapsed, 1)}
            result["virtual_hand"] = {k: hand_stats[k]
                                      for k in ("pd_frames", "palm_cycles", "dropped", "delayed", "answer")}
            result["cycle"]["frames"] = end.get("frames", 0) - start_stats.get("frames", 0)
            result["host"] = host_delta(host0, host1)
            result["host"]["other_realtime_threads"] = others_rt
            result["targets"] = targets(result)
            result["targets_met"] = {row["name"]: met(row) for row in result["targets"]}
        finally:
            if ct is not None and ct.poll() is None:
                ct.kill()
            if sender is not None and sender.proc.is_alive():
                sender.proc.kill()
            if node is not None:
                node.stop()
            if tap is not None:
                tap.stop()
            if ns is not None:
                ns.down()
            for cl in clients:
                cl.close()
            broker.kill()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="a 20 s run")
    ap.add_argument("--hog", action="store_true",
                    help="a busy host: stress-ng " + " ".join(HOG) + " at ordinary priority beside each whole run "
                         "(cyclictest, in the same run, sees the same load)")
    ap.add_argument("--runs", type=int, default=1, help="runs in a row; the last line then summarises them")
    ap.add_argument("--irqs-to", default="",
                    help="move every device interrupt to these CPUs for the run (e.g. 0: off the cycle's CPU), then "
                         "back; '' leaves them")
    ap.add_argument("--hand-priority", type=int, default=None,
                    help="the virtual hand's SCHED_FIFO priority (default: the cycle's + 10, at most 99): it stands "
                         "for hardware, which no load of the host delays")
    ap.add_argument("--mqtt-priority", type=int, default=10,
                    help="ROBOBUS_ETHERCAT_MQTT_RT_PRIORITY: the node's MQTT process at SCHED_FIFO N, as the realtime "
                         "container runs it (0: normal scheduling)")
    ap.add_argument("--node-sched", default="",
                    help="override the node's MQTT process scheduling, every thread: nice:N or fifo:N ('': as set)")
    ap.add_argument("--path-sched", default="fifo:10",
                    help="the rest of the command path, the user's: the broker and the demand client (every thread): "
                         "nice:N, fifo:N or '' (as started); default fifo:10, as a host that drives the hand runs "
                         "them")
    ap.add_argument("--priority", type=int, default=80)
    ap.add_argument("--period-us", type=int, default=1000)
    ap.add_argument("--protocol", default="0220", choices=sorted(PROTOCOLS))
    last = str((os.cpu_count() or 1) - 1)
    ap.add_argument("--cpus", default=last if last != "0" else "",
                    help=f"CPU affinity of the cycle process, e.g. 1 or 0,1; '' = any (default: the last CPU, {last})")
    ap.add_argument("--hand-cpus", default=None,
                    help="CPU affinity of the virtual hand (default: the CPUs the cycle does not have); '' = any. "
                         "Not the cycle's CPU: SOEM polls its socket while configuring and checking states, at a "
                         "higher priority than the hand, which then never gets the CPU to answer")
    ap.add_argument("--cyclictest-cpus", default=None,
                    help="CPU affinity of cyclictest (default: the cycle's CPUs: this VM stalls its vCPUs one at a "
                         "time, so only a cyclictest on the cycle's vCPU sees the stalls the cycle sees); '' = any")
    ap.add_argument("--cyclictest-priority", type=int, default=None,
                    help="cyclictest's SCHED_FIFO priority (default: the cycle's + 1, so that on the shared CPU it "
                         "never waits for the cycle, which FIFO at the same priority would make it do)")
    ap.add_argument("--demand-qos", type=int, choices=(0, 1), default=1,
                    help="MQTT QoS of the 200 Hz set_demands requests (and so of their replies); default 1")
    ap.add_argument("--cyclictest-lead-us", type=int, default=0,
                    help="wake cyclictest this many µs before each of the cycle's releases (the cycle's releases "
                         "are on the CLOCK_MONOTONIC period grid; cyclictest --secaligned puts its wake-ups on it "
                         "too), so both sample the vCPU at nearly the same instants; -1: not aligned")
    ap.add_argument("--iface", default=None,
                    help="measure an external hand on this EtherCAT NIC (backend nic): no namespace or virtual "
                         "hand is built")
    ap.add_argument("--netns", default=None, help="with --iface: the network namespace holding the NIC")
    a = ap.parse_args()
    external = a.iface is not None
    ct_cpus = a.cpus if a.cyclictest_cpus is None else a.cyclictest_cpus
    ct_prio = min(99, a.priority + 1) if a.cyclictest_priority is None else a.cyclictest_priority
    # cyclictest --secaligned=OFFSET wakes at (a full second + OFFSET + k x interval)
    aligned = a.cyclictest_lead_us >= 0 and 1_000_000 % a.period_us == 0 and a.cyclictest_lead_us < a.period_us
    ct_offset_us = a.period_us - a.cyclictest_lead_us
    ct_align = [f"--secaligned={ct_offset_us}"] if aligned else []
    hand_cpus = a.hand_cpus
    if hand_cpus is None:
        cycle_cpus = {int(c) for c in a.cpus.split(",")} if a.cpus else set()
        rest = sorted(set(range(os.cpu_count() or 1)) - cycle_cpus) if cycle_cpus else []
        hand_cpus = ",".join(map(str, rest))
    seconds = min(a.seconds, 20.0) if a.quick else a.seconds
    reason = (None if external else can_netns()) or (None if mosquitto_bin() else "mosquitto is not installed")
    if reason is None and shutil.which("cyclictest") is None:
        reason = "cyclictest (rt-tests) is not installed"
    if reason:
        print(f"ethercat_cycle: skipped: {reason}")
        print(json.dumps({"bench": "ethercat_cycle", "skipped": reason}))
        return

    hand_prio = min(99, a.priority + 10) if a.hand_priority is None else a.hand_priority
    plan = Plan(seconds, external, hand_cpus, ct_cpus, ct_prio, aligned, ct_offset_us, ct_align, hand_prio)
    if a.hog and shutil.which("stress-ng") is None:
        print("ethercat_cycle: --hog needs stress-ng (apt-get install stress-ng)")
        print(json.dumps({"bench": "ethercat_cycle", "skipped": "stress-ng is not installed"}))
        return
    runs: list[dict[str, Any]] = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="robobus-hog-") as hog_dir:
            hog = Hog(Path(hog_dir)) if a.hog else None
            irqs = IrqAffinity(a.irqs_to) if a.irqs_to else None
            try:
                if hog is not None:
                    time.sleep(2.0)  # the load at full strength before anything is measured
                result = run_once(a, plan)
            finally:
                if irqs is not None:
                    irqs.restore()
                if hog is not None:
                    hog.stop()
        result["irqs_to"] = {"cpus": a.irqs_to, "moved": len(irqs.saved), "refused": irqs.refused} if irqs else None
        result["hog"] = " ".join(HOG) if a.hog else None
        print(f"--- run {i + 1} of {a.runs}{' with --hog' if a.hog else ''}")
        print_run(result)
        runs.append(result)
    # the figures of the set: each target's worst run (a target is met when every run meets it)
    figures: list[Figure] = []
    for k, row in enumerate(runs[0]["targets"]):
        values = [r["targets"][k]["value"] for r in runs]
        worst = None if any(v is None for v in values) else max(values)
        label = row["name"] + (f", worst of {len(runs)} runs" if len(runs) > 1 else "")
        figures.append(Figure(label, worst, row["unit"], "<=", row["target"]))
    final = runs[-1]
    figures += [Figure("cycle wake-up p99 (last run)", final["cycle"]["wake_p99_us"], "µs"),
                Figure("cyclictest p99 (last run)", final["cyclictest"].get("p99_us"), "µs"),
                Figure("cycle CPU p99 (last run)", final["cycle"]["cpu_p99_us"], "µs"),
                Figure("demand-to-wire p50 (last run)", final["demand_to_wire_ms"]["p50"], "ms")]
    summary = {"bench": "ethercat_cycle", "hog": runs[0]["hog"], "runs": runs,
               "met_in": {row["name"]: sum(1 for r in runs if met(r["targets"][k]))
                          for k, row in enumerate(runs[0]["targets"])}}
    report("ethercat_cycle", summary if len(runs) > 1 else runs[0], figures,
           variant=variant_name("quick" if a.quick else None, "hog" if a.hog else None,
                                f"runs{a.runs}" if a.runs > 1 else None))

if __name__ == "__main__":
    main()
