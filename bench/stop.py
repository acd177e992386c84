"""Benchmark: the bus-wide software stop, from the stop's publish to the last device's stop on its wire.

A system shaped like `make run`, larger: 20 e-pucks (WiFi simulator), 50 ROI modules (17 GPIO, 17 ODrive, 16
actuators), the Shadow hand (ethercat-loop) and 3 Dexters, each service in its own process on its simulators, on a
private broker and free ports. Each simulator stamps the first stop bytes it receives after its watch is armed
(docs/kit.md "Stopping everything"; the simulators' stop watches):

- e-pucks: the first command that sets both wheel speeds to 0, stamped with the kernel's arrival time of its bytes
  (one simulator loop serves all 20 robots) (services/epuck_gateway/sim/, SIGUSR2 arms); the simulator runs one
  SCHED_FIFO step above the nodes, as robots are machines of their own: starved, it read late, and the kernel had
  merged the stop's TCP segment with a later command's, stamped with the later arrival;
- ROI modules: the first stop datagram (ODrive SET_VELOCITY 0, actuator length setter, GPIO SET_OUTPUT; every
  GPIO module has a `stop_outputs` pin here), stamped with the kernel's time of its arrival at the module's socket
  (one simulator thread serves all 51 modules: when it got round to reading each one is its own delay)
  (services/roi_modules/sim.py `--watch-stop`, SIGHUP re-arms; the re-arm is confirmed by a sentinel module that
  only this bench talks to);
- Dexters: DexRun has no stop oplet, so there are no stop bytes: the watch stamps the first request that moves the
  arm, which a stopped gateway must never send. Their time is the node's stop answer (`written_ts` in
  `{root}/{node}/_node/state/stop`: when the gateway closed the link to motion), and the watch proves that no
  motion request arrives after the stop;
- the hand: the virtual EtherCAT hand on a veth pair of its own (services/ethercat_loop/sim/veth_hand.py, root
  only; gone with its process), whose palm stamps the first all-zero demand frame after its control socket's
  `watch_stop`; without root (or with `--hand model`) the palm model backend, in-process with no wire, and its time
  is the node's stop answer.

Each round: every motion device is put in motion (so a "same as last written" shortcut cannot skip the stop),
the watches are armed, the stop is published (retained, QoS 1, as `robobus stop` does), every stamp and every
node's answer is collected; then, with the watches armed again, motion commands are sent to every device while
the stop is active (each pair ends with the command whose bytes a watch stamps: a speed or a velocity then 0, a
pin 1 then 0, an actuator move, a Dexter move): each must be refused `stopped` and none may reach a simulator;
then the stop is released. Before the rounds, the same probes are sent with no stop active and must be seen on
every device's wire (so a probe that got through while stopped would be seen). Reported per service over the
rounds: the time from the publish to the service's last device (p50, p99, max), with the ratio to the target and
met / not met; beside it when the node read the stop (its answer's `received_ts`), its first device, and the times
the node reported (`written_ts`); the motion commands refused and those that reached a wire. Last line: one JSON
object.

    python bench/stop.py               # 25 rounds
    python bench/stop.py --quick       # 5 rounds
    python bench/stop.py --hog         # beside bench/ethercat_cycle.py --hog's mixed load (stress-ng: CPU, memory,
                                       # sockets, disk; installed with apt if missing)
    python bench/stop.py --stall node  # each round: each service's node in turn SIGSTOPped 3 s while a client
                                       # streams setpoints (100 Hz, 100 ms age), the stop published during the
                                       # stall; measured from the SIGCONT (--stall nodes: every node at once, a
                                       # frozen host's; --stall broker: the broker stalled instead)

The broker and the service nodes run as `make run` starts them, at SCHED_FIFO 10 where the host permits it, and
so do this bench's threads (the operator's client: a client starved by the host's load would publish the stop
late whatever the bus does); the simulators and the hog run at ordinary priority. `--priority 0`: everything
ordinary (its own result variant).

Targets (this 2-core machine): p99 <= 20 ms quiet, <= 50 ms beside the hog, <= 50 ms from a stall's resume, for
every service; 0 motion commands executed while stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import paho.mqtt.client as mqtt
from ethercat_cycle import HOG, Hog  # the mixed load of the cycle bench's --hog
from results import Figure, report, variant_name  # notes the machine's load when imported: at the start
from run_priority import chrt, fifo_threads, run_priority, set_fifo

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.ethercat_loop import rig as ethercat_rig  # noqa: E402
from services.ethercat_loop.sim.virtual_hand import HandControl  # noqa: E402
from services.roi_modules import protocol as roi_p  # noqa: E402
from shared.messages import StopAnswer, StopState  # noqa: E402
from shared.rpc import Reply, RpcClient  # noqa: E402
from shared.settings import KitSettings  # noqa: E402
from shared.stop import stop_topic  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

TARGET_P99_QUIET_MS = 20.0
TARGET_P99_HOG_MS = 50.0
TARGET_P99_STALL_MS = 50.0  # from a stalled node's (or broker's) resume to the stop on every wire
ROOT = "robobus"
EPUCK, ROI, DEXTER, HAND = "epuck-gateway", "roi-modules", "dexter-gateway", "ethercat-loop"
# the services measured; a registered service with a motion command that is not here says why in its rig
# (SimRig.stop_unmeasured; tests/kit/test_bench_stop.py fails for one in neither)
SERVICES = (EPUCK, ROI, DEXTER, HAND)
HAND_DEVICE = "rh"
ROI_HOST_OCTET = 200
ROI_BENCH_OCTET = 201  # the bench's own address on the modules' network (the sentinel's traffic)
ROI_SENTINEL = 60  # a simulated GPIO module the service does not know: proves that a re-arm has taken effect
ROI_STOP_PIN = 3
SOURCE = "bench/stop.py"


def _number(x: float) -> float | None:
    """A figure for the report: None where nothing was measured (NaN)."""
    return None if x != x else x


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


class JsonLines:
    """The JSON lines a simulator prints on stdout, as they come (each with its index, for "since the mark")."""

    def __init__(self, name: str, stream: IO[str], log: IO[str]) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self._log = log
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True, name=f"lines-{name}")
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.write(line)
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                with self.cond:
                    self.events.append(data)
                    self.cond.notify_all()

    def mark(self) -> int:
        with self.cond:
            return len(self.events)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self.cond:
            return list(self.events[mark:])

    def wait(self, pred: Callable[[list[dict[str, Any]]], bool], mark: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cond:
            while not pred(self.events[mark:]):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))
            return True


class BusWatch:
    """Every device's health and every node's latest stop answer."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.health: dict[tuple[str, str], dict[str, Any]] = {}
        self.answers: dict[str, StopAnswer] = {}

    def on_health(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) != 4 or not msg.payload:
            return
        with self.cond:
            self.health[(parts[1], parts[2])] = json.loads(msg.payload)
            self.cond.notify_all()

    def on_answer(self, msg: mqtt.MQTTMessage) -> None:
        if not msg.payload:
            return
        a = StopAnswer.model_validate_json(msg.payload)
        with self.cond:
            self.answers[a.node] = a
            self.cond.notify_all()

    def connected(self, node: str, devices: list[str]) -> int:
        with self.cond:
            return sum(1 for d in devices if self.health.get((node, d), {}).get("connection"))

    def wait_answers(self, stop: StopState, nodes: tuple[str, ...], timeout: float,
                     clean_s: float = 0.0) -> dict[str, StopAnswer]:
        """Each node's answer to `stop` once every device in it is settled (not pending), or what came by then;
        with `clean_s`, then up to that long more until no device has an error (a stop a module acknowledged only
        after its resend ladder is written again until it is, and its answer's error clears then)."""
        got = self._settled(stop, nodes, timeout)
        end = time.monotonic() + clean_s
        with self.cond:
            while any(d.error for a in got.values() for d in a.devices) and time.monotonic() < end:
                self.cond.wait(min(end - time.monotonic(), 0.2))
                got = self._settled(stop, nodes, 0.0)
        return got

    def _settled(self, stop: StopState, nodes: tuple[str, ...], timeout: float) -> dict[str, StopAnswer]:
        end = time.monotonic() + timeout

        def mine() -> dict[str, StopAnswer]:
            return {n: a for n in nodes if (a := self.answers.get(n)) is not None and a.stop_ts == stop.ts
                    and a.active == stop.active and a.source == stop.source}

        with self.cond:
            while True:
                got = mine()
                if len(got) == len(nodes) and not any(d.pending for a in got.values() for d in a.devices):
                    return got
                left = end - time.monotonic()
                if left <= 0:
                    return got
                self.cond.wait(min(left, 0.2))


@dataclass
class Figures:
    """One service's stop times over the rounds (ms from the publish), and what went wrong."""

    how: str
    times_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)  # the service's first device (the spread: last - first)
    missing: int = 0  # devices without a stamp / a written time in a round
    early: int = 0  # a stamp older than the publish (the device had been stopped by something else)
    probes: int = 0  # motion commands sent during the stop
    refused_stopped: int = 0
    not_refused: list[str] = field(default_factory=list)
    reached_wire: int = 0  # of them, bytes a simulator's watch saw while the stop was active
    stop_errors: int = 0  # devices whose stop answer carried an error (e.g. not acknowledged in time)

    def summary(self, target_ms: float) -> dict[str, Any]:
        p50, p99 = percentile(self.times_ms, 50), percentile(self.times_ms, 99)
        mx = max(self.times_ms, default=float("nan"))
        met = bool(self.times_ms) and p99 <= target_ms and not self.missing and not self.early
        return {"how": self.how, "rounds": len(self.times_ms), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
                "max_ms": round(mx, 2), "target_p99_ms": target_ms, "ratio": round(p99 / target_ms, 3),
                "met": met, "missing": self.missing, "early": self.early, "motion_probes": self.probes,
                "refused_stopped": self.refused_stopped, "not_refused": len(self.not_refused),
                "not_refused_examples": self.not_refused[:3], "reached_wire": self.reached_wire,
                "stop_errors": self.stop_errors, "first_device_p50_ms": round(percentile(self.first_ms, 50), 2)}


def ensure_stress_ng() -> str:
    exe = shutil.which("stress-ng")
    if exe:
        return exe
    print("installing stress-ng (the CPU hog), as deploy/dev/prove-suite.sh does", flush=True)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", "stress-ng"]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run([*sudo, "apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    exe = shutil.which("stress-ng")
    if not exe:
        raise SystemExit("stress-ng could not be installed")
    return exe


class System:
    """The simulators and the four services, each in its own process."""

    def __init__(self, tmp: Path, broker_url: str, robots: int, arms: int, virtual_hand: bool,
                 roi_modules: int = 50, rt_priority: int = 0) -> None:
        self.tmp = tmp
        self.rt_priority = rt_priority  # SCHED_FIFO of the service nodes, as make run starts them (0: ordinary)
        self.virtual_hand = virtual_hand
        self.hand_ctl: HandControl | None = None
        self.broker_url = broker_url
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[IO[str]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROBOBUS_LOG_LEVEL": "WARNING"}
        self.prefix = f"127.{random.randint(100, 199)}.{random.randint(1, 250)}"
        self.n_robots = robots
        self.n_arms = arms
        self.robots: list[str] = []
        self.roi_modules: list[dict[str, Any]] = [
            {"name": f"{('gpio', 'odrive', 'actuator')[(i - 1) % 3]}{i}", "octet": i,
             "type": ("gpio", "odrive", "actuator")[(i - 1) % 3]} for i in range(1, roi_modules + 1)]
        for m in self.roi_modules:
            if m["type"] == "gpio":  # the pin drives something that moves: the stop sets it to 0
                m["pin_modes"] = {str(ROI_STOP_PIN): "output"}
                m["stop_outputs"] = {str(ROI_STOP_PIN): 0}
            elif m["type"] == "odrive":
                m["initial_mode"] = "velocity"
            else:  # the actuators answer their length, as make run's: a node restarted under the stop holds them
                m["length_feedback"] = "on"
        self.arms = [f"dexter{i}" for i in range(1, arms + 1)]
        self.epuck_sim: JsonLines | None = None
        self.roi_sim: JsonLines | None = None
        self.dexter_sims: dict[str, JsonLines] = {}
        self.pids: dict[str, int] = {}
        self.specs: dict[str, tuple[str, dict[str, str]]] = {}  # service node -> (module, env): to restart it

    def _log(self, name: str) -> IO[str]:
        f = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in close())
        self.logs.append(f)
        return f

    def sim(self, name: str, args: list[str], priority: int = 0) -> JsonLines:
        proc = subprocess.Popen([*chrt(priority), sys.executable, *args], cwd=REPO, env=self.env,
                                stdout=subprocess.PIPE, stderr=self._log(f"{name}.err"), text=True)
        self.procs.append(proc)
        self.pids[name] = proc.pid
        assert proc.stdout is not None
        return JsonLines(name, proc.stdout, self._log(name))

    def service(self, name: str, module: str, env: dict[str, str]) -> None:
        self.specs[name] = (module, env)
        log = self._log(name)
        # every thread of the node at the priority from its first instruction, as make run's supervisor starts it
        proc = subprocess.Popen([*chrt(self.rt_priority), sys.executable, "-m", module], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**self.env, "ROBOBUS_MQTT_URL": self.broker_url, "ROBOBUS_NODE": name, **env})
        self.procs.append(proc)
        self.pids[name] = proc.pid

    def start(self) -> None:
        # The robots' side above the nodes' priority, as robots are machines of their own: a simulator starved by
        # the nodes it stands beside reads late, and Linux merges TCP segments waiting unread into one, stamped
        # with the newest's arrival (tcp_try_coalesce): a stop read late together with a command written 50 ms
        # after it was timed by that command (broker stall rounds, the nodes at SCHED_FIFO draining backlogs)
        self.epuck_sim = self.sim("epuck-sim", ["-m", "services.epuck_gateway.sim", "--count", str(self.n_robots),
                                                "--base-port", "0"],
                                  priority=self.rt_priority + 1 if self.rt_priority else 0)
        mods = ",".join(f"{m['type']}:{m['octet']}" for m in self.roi_modules) + f",gpio:{ROI_SENTINEL}"
        self.roi_sim = self.sim("roi-sim", ["-m", "services.roi_modules.sim", "--prefix", self.prefix, "--modules",
                                            mods, "--watch-stop", "--seed", "1", "--actuator-length"])
        ports = {arm: free_port() for arm in self.arms}
        for arm, port in ports.items():
            self.dexter_sims[arm] = self.sim(f"{arm}-sim", ["-m", "services.dexter_gateway.sim", "--port", str(port),
                                                            "--watch-stop"])
        if not self.epuck_sim.wait(lambda ev: any("ready" in e for e in ev), 0, 30):
            raise SystemExit("the e-puck simulator did not start")
        ready = next(e for e in self.epuck_sim.since(0) if "ready" in e)
        self.robots = sorted(ready["robots"])
        self.service(EPUCK, "services.epuck_gateway", {
            "ROBOBUS_EPUCK_ROBOTS": json.dumps([{"id": r, "host": "127.0.0.1", "port": ready["robots"][r]}
                                                for r in self.robots]),
            # the robots keep the bench's speeds through a round: the deadman must not stop them first
            "ROBOBUS_EPUCK_MOTION_TIMEOUT_MS": "60000"})
        self.service(ROI, "services.roi_modules", {
            "ROBOBUS_ROI_NETWORK": self.prefix, "ROBOBUS_ROI_HOST_OCTET": str(ROI_HOST_OCTET),
            "ROBOBUS_ROI_MODULES": json.dumps(self.roi_modules)})
        self.service(DEXTER, "services.dexter_gateway", {
            "ROBOBUS_DEXTER_ARMS": json.dumps([{"id": a, "host": "127.0.0.1", "port": p} for a, p in ports.items()])})
        hand_env = {"ROBOBUS_ETHERCAT_BACKEND": "model", "ROBOBUS_ETHERCAT_DEVICE": HAND_DEVICE,
                    "ROBOBUS_ETHERCAT_DEMAND_TIMEOUT_MS": "10000"}  # demands held through a round (deadman 10 s)
        if self.virtual_hand:
            # the virtual hand on a veth pair that lives as long as its process (services/ethercat_loop/rig.py)
            master_if = f"ecst{os.getpid() % 100000}"
            control = str(self.tmp / "hand.sock")
            self.sim("hand-sim", ["-m", "services.ethercat_loop.sim.veth_hand", "--master-if", master_if, "--",
                                  *ethercat_rig.HAND_OPTS, "--control", control])
            self.hand_ctl = HandControl(control)
            self.hand_ctl.wait_ready(30)
            hand_env.update({"ROBOBUS_ETHERCAT_BACKEND": "virtual", "ROBOBUS_ETHERCAT_IFNAME": master_if,
                             "ROBOBUS_ETHERCAT_EXPECT_PROTOCOL": "0220",
                             # a busy machine loses frames now and then: not what is measured here
                             "ROBOBUS_ETHERCAT_OVERRUN_THRESHOLD": "1000000",
                             "ROBOBUS_ETHERCAT_LOST_THRESHOLD": "1000000",
                             "ROBOBUS_ETHERCAT_SILENT_MOTOR_MS": "600000"})
        self.service(HAND, "services.ethercat_loop", hand_env)

    def kill_node(self, name: str) -> None:
        """kill -9 a service node (its final messages never sent)."""
        proc = next(p for p in self.procs if p.pid == self.pids[name])
        proc.kill()
        proc.wait(10)
        self.procs.remove(proc)

    def restart_node(self, name: str) -> None:
        module, env = self.specs[name]
        self.service(name, module, env)

    def devices(self) -> dict[str, list[str]]:
        return {EPUCK: self.robots, ROI: [str(m["name"]) for m in self.roi_modules], DEXTER: self.arms,
                HAND: [HAND_DEVICE]}

    def dead(self) -> list[str]:
        return [n for n, pid in self.pids.items() if any(p.pid == pid and p.poll() is not None for p in self.procs)]

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for f in self.logs:
            f.close()


Call = tuple[str, str, str, dict[str, Any]]  # node, device, command, payload


class Bench:
    def __init__(self, system: System, client: RpcClient, bus: BusWatch) -> None:
        self.sys = system
        self.c = client
        self.bus = bus
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="bench-call")
        self.roi_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.roi_sock.bind((f"{system.prefix}.{ROI_BENCH_OCTET}", roi_p.GENERAL_PORT))
        self.octet_name = {int(m["octet"]): str(m["name"]) for m in system.roi_modules}
        self.fig = {EPUCK: Figures("wire: the first 0-speed command each robot received"),
                    ROI: Figures("wire: the first stop datagram each module received"),
                    DEXTER: Figures("node's stop answer written_ts (DexRun has no stop bytes); the wire watch "
                                    "checks no motion request arrives"),
                    HAND: Figures("wire: the first all-zero demand frame at the virtual hand" if system.hand_ctl else
                                  "node's stop answer written_ts (palm model backend: no wire)")}
        self.reported: dict[str, list[float]] = {s: [] for s in SERVICES}  # the answers' written_ts, every service
        self.read: dict[str, list[float]] = {s: [] for s in SERVICES}  # when each node read the stop (received_ts)
        self.move_failures: list[str] = []
        self.watch_check_ok = False
        self.errors: list[str] = []

    # -- calls -------------------------------------------------------------------------------------------
    def calls(self, batch: list[Call]) -> list[Reply | None]:
        def one(item: Call) -> Reply | None:
            node, dev, cmd, payload = item
            try:
                return self.c.call(node, dev, cmd, payload, timeout=10)
            except TimeoutError:
                return None
        return list(self.pool.map(one, batch))

    def sequences(self, rnd: int, stopped: bool) -> list[list[Call]]:
        """Per device, the commands that put it in motion (stopped=False), or the probes sent during the stop: the
        last of each sequence is one whose bytes the device's watch would stamp, had it got through."""
        sign = 1 if rnd % 2 else -1
        seqs: list[list[Call]] = []
        speed = 200 + rnd
        s: list[Call]
        for r in self.sys.robots:
            s = [(EPUCK, r, "set_speed", {"left": speed, "right": -speed})]
            if stopped:
                s.append((EPUCK, r, "set_speed", {"left": 0, "right": 0}))
            seqs.append(s)
        for m in self.sys.roi_modules:
            name = str(m["name"])
            if m["type"] == "odrive":
                s = [(ROI, name, "set_velocity", {"velocity": sign * (0.5 + 0.01 * rnd)})]
                if stopped:
                    s.append((ROI, name, "set_velocity", {"velocity": 0.0}))
            elif m["type"] == "actuator":
                s = [(ROI, name, "goto_position", {"position": 40.0 if sign > 0 else 60.0})]
            else:
                s = [(ROI, name, "set_pin_output", {"pin": ROI_STOP_PIN, "value": 1})]
                if stopped:
                    s.append((ROI, name, "set_pin_output", {"pin": ROI_STOP_PIN, "value": 0}))
            seqs.append(s)
        for a in self.sys.arms:
            seqs.append([(DEXTER, a, "move_all_joints_relative", {"joints_deg": [sign * 2.0, 0, 0, 0, 0]})])
        seqs.append([(HAND, HAND_DEVICE, "set_demands", {"motors": {str(i): sign * (100 + rnd) for i in range(20)}})])
        return seqs

    def run_sequences(self, seqs: list[list[Call]]) -> list[tuple[Call, Reply | None]]:
        out: list[tuple[Call, Reply | None]] = []
        for step in range(max(len(s) for s in seqs)):
            batch = [s[step] for s in seqs if len(s) > step]
            out.extend(zip(batch, self.calls(batch), strict=True))
        return out

    def put_in_motion(self, rnd: int) -> None:
        todo = self.sequences(rnd, stopped=False)
        for _attempt in range(20):  # `unavailable` while a node has not read the stop state yet: try again
            results = self.run_sequences(todo)
            retry = [[item] for item, rep in results
                     if rep is None or (not rep.ok and (rep.error or {}).get("code") in ("unavailable", "busy"))]
            for item, rep in results:
                if rep is not None and not rep.ok and [item] not in retry:
                    self.move_failures.append(f"{item[0]}/{item[1]} {item[2]}: {rep.error}")
            if not retry:
                return
            todo = retry
            time.sleep(0.2)
        self.move_failures.extend(f"{s[0][0]}/{s[0][1]} {s[0][2]}: never accepted" for s in todo)

    # -- the watches -------------------------------------------------------------------------------------
    def arm_epucks(self) -> int:
        sim = self.sys.epuck_sim
        assert sim is not None
        mark = sim.mark()
        os.kill(self.sys.pids["epuck-sim"], signal.SIGUSR2)
        if not sim.wait(lambda ev: any("stop_watch_armed" in e for e in ev), mark, 10):
            raise RuntimeError("the e-puck simulator did not arm its stop watches")
        return mark

    def arm_roi(self) -> int:
        """SIGHUP re-arms the ROI simulator's watch; its sentinel module's stamp proves it has."""
        sim = self.sys.roi_sim
        assert sim is not None
        mark = sim.mark()
        os.kill(self.sys.pids["roi-sim"], signal.SIGHUP)
        pkt = roi_p.GeneralPacket(0, int(roi_p.GpioAction.SET_OUTPUT), b"\x00").encode()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            self.roi_sock.sendto(pkt, (f"{self.sys.prefix}.{ROI_SENTINEL}", roi_p.GENERAL_PORT))
            if sim.wait(lambda ev: any(e.get("octet") == ROI_SENTINEL for e in ev), mark, 0.05):
                return mark
        raise RuntimeError("the ROI simulator did not re-arm its stop watch")

    def arm_dexters(self) -> dict[str, int]:
        marks = {}
        for arm, sim in self.sys.dexter_sims.items():
            marks[arm] = sim.mark()
            os.kill(self.sys.pids[f"{arm}-sim"], signal.SIGHUP)
        for arm, sim in self.sys.dexter_sims.items():
            if not sim.wait(lambda ev: any(e.get("event") == "watching" for e in ev), marks[arm], 10):
                raise RuntimeError(f"{arm}'s simulator did not arm its watch")
        return marks

    def arm_hand(self) -> None:
        if self.sys.hand_ctl is not None and not self.sys.hand_ctl.call("watch_stop").get("ok"):
            raise RuntimeError("the virtual hand did not arm its stop watch")

    def hand_stamp(self, timeout: float) -> dict[str, Any] | None:
        """The virtual hand's first all-zero demand frame since its watch was armed (None: none by `timeout`)."""
        assert self.sys.hand_ctl is not None
        end = time.monotonic() + timeout
        while True:
            stamp: dict[str, Any] | None = self.sys.hand_ctl.call("stop_stamp").get("stamp")
            if stamp is not None or time.monotonic() > end:
                return stamp
            time.sleep(0.005)

    def epuck_stamps(self, mark: int) -> dict[str, float]:
        assert self.sys.epuck_sim is not None
        out: dict[str, float] = {}
        for e in self.sys.epuck_sim.since(mark):
            seen = e.get("stop_seen")
            if isinstance(seen, dict):
                out.setdefault(str(seen["robot"]), float(seen["ts"]))
        return out

    def roi_stamps(self, mark: int) -> dict[str, float]:
        assert self.sys.roi_sim is not None
        out: dict[str, float] = {}
        for e in self.sys.roi_sim.since(mark):
            if e.get("event") == "stop_bytes" and int(e["octet"]) in self.octet_name:
                out.setdefault(self.octet_name[int(e["octet"])], float(e["unix"]))
        return out

    def dexter_motion(self, marks: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        return {arm: [e for e in self.sys.dexter_sims[arm].since(marks[arm]) if e.get("event") == "motion"]
                for arm in self.sys.arms}

    def probe(self, rnd: int, dx_marks: dict[str, int] | None,
              since: float) -> tuple[list[tuple[Call, Reply | None]], dict[str, int]]:
        """Every device's probe sequence (`sequences(stopped=True)`) with the watches armed: the replies, and per
        service the devices whose watch saw bytes of it (Dexters: a motion request at or after `since`)."""
        if rnd:
            # the stop's own resends (ROI: a stop acknowledged late is sent again, every second past its ladder,
            # until acknowledged) may still be in flight on a busy machine after the answer: let them land before the
            # watches are armed again (the answers clean: wait_answers(clean_s) in round())
            time.sleep(0.3)
        ep_mark, roi_mark = self.arm_epucks(), self.arm_roi()
        if dx_marks is None:
            dx_marks = self.arm_dexters()
        armed = time.time()
        results = self.run_sequences(self.sequences(rnd, stopped=True))
        time.sleep(0.5)  # bytes that got through would be stamped by now
        if rnd:
            assert self.sys.roi_sim is not None and self.sys.epuck_sim is not None
            for e in self.sys.roi_sim.since(roi_mark) + self.sys.epuck_sim.since(ep_mark):
                if "stop_seen" in e or (e.get("event") == "stop_bytes" and e.get("octet") != ROI_SENTINEL):
                    t = float(e["stop_seen"]["ts"] if "stop_seen" in e else e["unix"])
                    self.errors.append(f"round {rnd}: on a wire while stopped: {json.dumps(e)} "
                                       f"({1000 * (t - since):.0f} ms after the stop, {1000 * (t - armed):.0f} ms "
                                       "after the watch was armed)")
        seen = {EPUCK: len(self.epuck_stamps(ep_mark)), ROI: len(self.roi_stamps(roi_mark)),
                DEXTER: sum(1 for moves in self.dexter_motion(dx_marks).values()
                            if any(float(m["unix"]) >= since for m in moves)), HAND: 0}
        if self.sys.hand_ctl is not None:
            # while stopped every demand frame on the wire is zero: armed now, the watch stamps the next one with
            # none moving before it; a demand that got through stays on the wire for its 10 s deadman
            self.arm_hand()
            stamp = self.hand_stamp(2)
            seen[HAND] = int(stamp is None or bool(stamp["moving_frames_before"]))
        return results, seen

    def check_watches(self) -> dict[str, str]:
        """The probes sent with no stop active: each must be accepted and seen on every device's wire, or the
        bench could not tell a motion command that got through while stopped. Per service "seen/devices"."""
        results, seen = self.probe(0, None, time.time())
        for (svc, dev, cmd, _payload), rep in results:
            if rep is None or not rep.ok:
                self.errors.append(f"watch check: {svc}/{dev} {cmd} not accepted: {rep.error if rep else 'no reply'}")
        expect = {svc: len(devs) for svc, devs in self.sys.devices().items()}
        if self.sys.hand_ctl is None:
            expect[HAND] = 0  # the model backend has no wire
        self.watch_check_ok = all(seen[s] == expect[s] for s in SERVICES)
        return {s: f"{seen[s]}/{expect[s]}" for s in SERVICES}

    # -- one round ---------------------------------------------------------------------------------------
    def round(self, rnd: int) -> dict[str, float]:
        self.put_in_motion(rnd)
        time.sleep(0.2)  # the last motion bytes are on their wires before the watches are armed
        ep_mark, roi_mark, dx_marks = self.arm_epucks(), self.arm_roi(), self.arm_dexters()
        self.arm_hand()
        n_ep, n_roi = len(self.sys.robots), len(self.sys.roi_modules)

        stop = StopState(active=True, source=SOURCE, reason=f"round {rnd}", ts=time.time())
        t_pub = stop.ts
        self.c.session.publish(stop_topic(ROOT), stop.model_dump_json(), qos=1, retain=True)
        assert self.sys.epuck_sim is not None and self.sys.roi_sim is not None
        self.sys.epuck_sim.wait(lambda ev: sum(1 for e in ev if "stop_seen" in e) >= n_ep, ep_mark, 10)
        self.sys.roi_sim.wait(lambda ev: len({e.get("octet") for e in ev if e.get("event") == "stop_bytes"}
                                             - {ROI_SENTINEL}) >= n_roi, roi_mark, 10)
        answers = self.bus.wait_answers(stop, SERVICES, 10, clean_s=5.0)
        wire_hand = self.sys.hand_ctl is not None
        if wire_hand:
            stamp = self.hand_stamp(10)
            f = self.fig[HAND]
            if stamp is None:
                f.missing += 1
            elif float(stamp["unix"]) < t_pub or not stamp["moving_frames_before"]:
                f.early += 1  # an all-zero frame before the stop, or the motors were not moving when armed
            else:
                f.times_ms.append(1000 * (float(stamp["unix"]) - t_pub))
                f.first_ms.append(f.times_ms[-1])  # one device
        ep, roi = self.epuck_stamps(ep_mark), self.roi_stamps(roi_mark)
        worst: dict[str, float] = {}
        for svc, stamps, n in ((EPUCK, ep, n_ep), (ROI, roi, n_roi)):
            f = self.fig[svc]
            f.missing += n - len(stamps)
            f.early += sum(1 for t in stamps.values() if t < t_pub)
            if len(stamps) == n:
                worst[svc] = 1000 * (max(stamps.values()) - t_pub)
                f.times_ms.append(worst[svc])
                f.first_ms.append(1000 * (min(stamps.values()) - t_pub))
        for svc in SERVICES:
            a = answers.get(svc)
            written = [d.written_ts for d in a.devices] if a is not None else []
            if a is None or len(a.devices) != len(self.sys.devices()[svc]) or any(w is None for w in written):
                self.errors.append(f"round {rnd}: {svc} answered {a.model_dump() if a else None}")
                if svc == DEXTER or (svc == HAND and not wire_hand):
                    self.fig[svc].missing += 1
                continue
            self.read[svc].append(1000 * (a.received_ts - t_pub))
            errs = [f"{d.device}: {d.error}" for d in a.devices if d.error]
            self.fig[svc].stop_errors += len(errs)
            if errs:
                self.errors.append(f"round {rnd}: {svc} stop errors {errs[:3]}")
            ms = 1000 * (max(w for w in written if w is not None) - t_pub)
            if svc == DEXTER or (svc == HAND and not wire_hand):
                self.fig[svc].first_ms.append(1000 * (min(w for w in written if w is not None) - t_pub))
            self.reported[svc].append(ms)
            if svc == DEXTER or (svc == HAND and not wire_hand):
                self.fig[svc].times_ms.append(ms)
        for svc in SERVICES:
            if self.fig[svc].times_ms and len(self.fig[svc].times_ms) == rnd:
                worst[svc] = self.fig[svc].times_ms[-1]

        # motion commands while stopped: refused `stopped`, nothing on a wire (watches armed again)
        results, seen = self.probe(rnd, dx_marks, t_pub)
        for svc, n in seen.items():
            self.fig[svc].reached_wire += n
        for (svc, dev, cmd, _payload), rep in results:
            f = self.fig[svc]
            f.probes += 1
            if rep is not None and not rep.ok and (rep.error or {}).get("code") == "stopped":
                f.refused_stopped += 1
            else:
                f.not_refused.append(f"round {rnd} {dev} {cmd}: " + ("no reply" if rep is None else
                                     json.dumps(rep.error) if rep.error else "accepted"))
        for arm, moves in self.dexter_motion(dx_marks).items():
            if any(float(m["unix"]) < t_pub for m in moves):
                self.errors.append(f"round {rnd}: {arm} got a motion request after the watch was armed and before "
                                   "the stop (the bench's own move, late)")

        self.release(f"round {rnd}", 10)
        return worst

    def release(self, what: str, timeout: float) -> None:
        """Release the stop (retained, as `robobus stop --release`) and note every node that does not answer."""
        release = StopState(active=False, source=SOURCE, reason=f"{what} released", ts=time.time())
        self.c.session.publish(stop_topic(ROOT), release.model_dump_json(), qos=1, retain=True)
        got = self.bus.wait_answers(release, SERVICES, timeout)
        if len(got) != len(SERVICES):
            self.errors.append(f"{what}: release not answered by {sorted(set(SERVICES) - set(got))}")

    # -- a stall: the nodes (or the broker) stopped while a client streams, the stop sent meanwhile -------------
    def stream_targets(self) -> list[Call]:
        """One device of each service that a teleoperating client would stream to, with its command: an e-puck's
        speeds, an ODrive's velocity, the hand's demands (DexRun moves are not setpoints: no stream)."""
        out: list[Call] = []
        if self.sys.robots:
            out.append((EPUCK, self.sys.robots[0], "set_speed", {"left": 300, "right": -300}))
        odrive = next((str(m["name"]) for m in self.sys.roi_modules if m["type"] == "odrive"), None)
        if odrive is not None:
            out.append((ROI, odrive, "set_velocity", {"velocity": 0.8}))
        out.append((HAND, HAND_DEVICE, "set_demands", {"motors": {str(i): 150 for i in range(20)}}))
        return out

    def stall_round(self, rnd: int, what: str, stall_s: float, pids: dict[str, int]) -> dict[str, float]:
        """Put everything in motion, stream at 100 Hz to one device per service (RpcClient.send: each setpoint
        lives 100 ms), stop `pids` (SIGSTOP) for `stall_s`, publish the stop a third of the way in, resume them
        (SIGCONT) and measure, per service, from the resume to its last device's stop on the wire (Dexters and a
        model hand: to the node's stop answer's written_ts). A stalled node's round measures that node's service
        only (the others read the stop as it came); a stalled broker's, every service."""
        measured = [svc for svc in SERVICES if svc in pids] if what == "node" else list(SERVICES)
        self.put_in_motion(rnd)
        time.sleep(0.2)
        ep_mark, roi_mark, dx_marks = self.arm_epucks(), self.arm_roi(), self.arm_dexters()
        self.arm_hand()
        n_ep, n_roi = len(self.sys.robots), len(self.sys.roi_modules)
        streaming = threading.Event()
        streaming.set()
        targets = self.stream_targets()
        # the operator's stop and the teleoperation are two clients, as on a real site: one connection's messages
        # reach the broker in order, so a stop sent on the streaming connection would queue behind its setpoints
        teleop = RpcClient(KitSettings(mqtt_url=self.sys.broker_url), name="bench-teleop")
        teleop.connect()

        def stream() -> None:
            nxt = time.monotonic()
            while streaming.is_set():
                for node, dev, cmd, payload in targets:
                    teleop.send(node, dev, cmd, payload, max_age_s=0.1)
                nxt += 0.01
                time.sleep(max(0.0, nxt - time.monotonic()))

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        time.sleep(0.3)
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stall_s / 3)
            stop = StopState(active=True, source=SOURCE, reason=f"stall {what} round {rnd}", ts=time.time())
            self.c.session.publish(stop_topic(ROOT), stop.model_dump_json(), qos=1, retain=True)
            time.sleep(stall_s * 2 / 3)
        finally:
            t_cont = time.time()
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
        assert self.sys.epuck_sim is not None and self.sys.roi_sim is not None
        self.sys.epuck_sim.wait(lambda ev: sum(1 for e in ev if "stop_seen" in e) >= n_ep, ep_mark, 10)
        self.sys.roi_sim.wait(lambda ev: len({e.get("octet") for e in ev if e.get("event") == "stop_bytes"}
                                             - {ROI_SENTINEL}) >= n_roi, roi_mark, 10)
        answers = self.bus.wait_answers(stop, SERVICES, 15)
        streaming.clear()
        streamer.join(5)
        teleop.close()
        worst: dict[str, float] = {}
        stamps: dict[str, dict[str, float]] = {EPUCK: self.epuck_stamps(ep_mark), ROI: self.roi_stamps(roi_mark)}
        if self.sys.hand_ctl is not None:
            st = self.hand_stamp(10)
            stamps[HAND] = {HAND_DEVICE: float(st["unix"])} if st is not None else {}
        for svc in measured:
            a = answers.get(svc)
            if svc not in stamps:  # no stop bytes on this wire: the node's answer says when it wrote the stop
                written = [d.written_ts for d in a.devices] if a is not None else []
                stamps[svc] = {d.device: float(d.written_ts) for d in (a.devices if a else []) if d.written_ts}
                if a is None or None in written:
                    self.errors.append(f"stall round {rnd}: {svc} answered {a.model_dump() if a else None}")
            f = self.fig[svc]
            n = len(self.sys.devices()[svc])
            got = stamps[svc]
            f.missing += n - len(got)
            # a stop on the wire before the resume is a device already stopped when its node ran again: the
            # streamed setpoints' age ran out where the device side keeps a deadline (the hand's cycle): 0 ms
            early = [t for t in got.values() if t < t_cont]
            if early:
                self.errors.append(f"stall round {rnd}: {svc}: {len(early)} device(s) stopped before the resume "
                                   "(their setpoints expired), counted 0 ms")
            if len(got) == n and n:
                worst[svc] = max(0.0, 1000 * (max(got.values()) - t_cont))
                f.times_ms.append(worst[svc])
                f.first_ms.append(max(0.0, 1000 * (min(got.values()) - t_cont)))
            if a is not None:
                self.read[svc].append(1000 * (a.received_ts - t_cont))
        moved = {arm: [m for m in moves if float(m["unix"]) >= stop.ts]
                 for arm, moves in self.dexter_motion(dx_marks).items()}
        for arm, moves in moved.items():
            if moves:
                self.fig[DEXTER].reached_wire += 1
                self.errors.append(f"stall round {rnd}: {arm} got a motion request after the stop: {moves[:2]}")
        self.release(f"stall round {rnd}", 15)
        return worst

    # -- a restart under the stop: nodes killed while their devices move, the stop set, the nodes started again -----
    def restart_round(self, rnd: int) -> dict[str, float]:
        """Put everything in motion, kill -9 every service node (the devices keep what they were last told), publish
        the stop while no node runs, start the nodes again: per service, from the restart to its last device's stop
        on the wire (Dexters and a model hand: the node's stop answer). A node that starts under the stop must hold
        every device it can, as soon as it can."""
        self.put_in_motion(rnd)
        time.sleep(0.2)
        for svc in SERVICES:
            self.sys.kill_node(svc)
        ep_mark, roi_mark, dx_marks = self.arm_epucks(), self.arm_roi(), self.arm_dexters()
        self.arm_hand()
        stop = StopState(active=True, source=SOURCE, reason=f"restart round {rnd}", ts=time.time())
        self.c.session.publish(stop_topic(ROOT), stop.model_dump_json(), qos=1, retain=True)
        time.sleep(0.3)
        t_start = time.time()
        for svc in SERVICES:
            self.sys.restart_node(svc)
        n_ep, n_roi = len(self.sys.robots), len(self.sys.roi_modules)
        assert self.sys.epuck_sim is not None and self.sys.roi_sim is not None
        self.sys.epuck_sim.wait(lambda ev: sum(1 for e in ev if "stop_seen" in e) >= n_ep, ep_mark, 30)
        self.sys.roi_sim.wait(lambda ev: len({e.get("octet") for e in ev if e.get("event") == "stop_bytes"}
                                             - {ROI_SENTINEL}) >= n_roi, roi_mark, 30)
        answers = self.bus.wait_answers(stop, SERVICES, 30)
        stamps: dict[str, dict[str, float]] = {EPUCK: self.epuck_stamps(ep_mark), ROI: self.roi_stamps(roi_mark)}
        if self.sys.hand_ctl is not None:
            st = self.hand_stamp(30)
            stamps[HAND] = {HAND_DEVICE: float(st["unix"])} if st is not None else {}
        worst: dict[str, float] = {}
        for svc in SERVICES:
            a = answers.get(svc)
            if svc not in stamps:
                stamps[svc] = {d.device: float(d.written_ts) for d in (a.devices if a else []) if d.written_ts}
            if a is None:
                self.errors.append(f"restart round {rnd}: {svc} did not answer the stop it started under")
            else:
                errs = [f"{d.device}: {d.error}" for d in a.devices if d.error]
                self.fig[svc].stop_errors += len(errs)
                if errs:
                    self.errors.append(f"restart round {rnd}: {svc} stop errors {errs[:3]}")
                self.read[svc].append(1000 * (a.received_ts - t_start))
            f = self.fig[svc]
            n = len(self.sys.devices()[svc])
            # the watches were armed after the kill: a stop on a wire before the restart is the device side's own
            # fail-safe (the hand's cycle process zeroes its demands when its node dies): already stopped, 0 ms
            got = stamps[svc]
            early = [t for t in got.values() if t < t_start]
            if early:
                self.errors.append(f"restart round {rnd}: {svc}: {len(early)} device(s) stopped by their own "
                                   "fail-safe before the restart, counted 0 ms")
            f.missing += n - len(got)
            if len(got) == n and n:
                worst[svc] = max(0.0, 1000 * (max(got.values()) - t_start))
                f.times_ms.append(worst[svc])
                f.first_ms.append(max(0.0, 1000 * (min(got.values()) - t_start)))
        for arm, moves in self.dexter_motion(dx_marks).items():
            if [m for m in moves if float(m["unix"]) >= t_start]:
                self.fig[DEXTER].reached_wire += 1
                self.errors.append(f"restart round {rnd}: {arm} got a motion request after its node restarted "
                                   "under the stop")
        # every node back up (each device's health read again) before the release and the next round
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(self.bus.connected(n, d) == len(d)
                                                 for n, d in self.sys.devices().items()):
            time.sleep(0.1)
        self.release(f"restart round {rnd}", 15)
        return worst

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.roi_sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="stops measured (default 25, --quick 5)")
    ap.add_argument("--hog", action="store_true",
                    help="beside the mixed load of bench/ethercat_cycle.py --hog (stress-ng " + " ".join(HOG) + ")")
    ap.add_argument("--stall", choices=("node", "nodes", "broker"), default=None,
                    help="each round stops each service node's process in turn (nodes: every node at once; broker: "
                         "the broker) with SIGSTOP while a client streams, publishes the stop during the stall, and "
                         "measures from the SIGCONT")
    ap.add_argument("--restart", action="store_true",
                    help="each round kills -9 every service node while its devices move, sets the stop, starts the "
                         "nodes again, and measures from the restart to each device's stop (no target: a start)")
    ap.add_argument("--stall-s", type=float, default=3.0, help="how long each stall lasts (default 3 s)")
    ap.add_argument("--roi-modules", type=int, default=50, help="simulated ROI modules (default 50)")
    ap.add_argument("--robots", type=int, default=20)
    ap.add_argument("--arms", type=int, default=3)
    ap.add_argument("--priority", type=int, default=None,
                    help="SCHED_FIFO priority of the broker and the service nodes, as make run starts them "
                         "(ROBOBUS_RUN_RT_PRIORITY, default 10 where this host permits it; 0: ordinary scheduling)")
    ap.add_argument("--hand", choices=("auto", "virtual", "model"), default="auto",
                    help="virtual: the virtual EtherCAT hand on a veth pair (root); model: the palm model backend, no "
                         "wire; auto: virtual where this machine can (default)")
    a = ap.parse_args()
    why_not = ethercat_rig.needs() if a.hand != "model" else "--hand model"
    if a.hand == "virtual" and why_not:
        raise SystemExit(f"--hand virtual: {why_not}")
    virtual_hand = why_not is None
    rounds = a.rounds or (5 if a.quick else 25)
    priority, priority_note = run_priority(a.priority)
    target = TARGET_P99_STALL_MS if a.stall else TARGET_P99_HOG_MS if a.hog else TARGET_P99_QUIET_MS
    if a.hog:
        ensure_stress_ng()
    result: dict[str, Any] = {"bench": "stop", "rounds": rounds, "hog": " ".join(HOG) if a.hog else None,
                              "stall": a.stall, "stall_s": a.stall_s if a.stall else None, "robots": a.robots,
                              "roi_modules": a.roi_modules, "dexters": a.arms,
                              "hand": "virtual hand on a veth pair" if virtual_hand else f"model backend ({why_not})",
                              "rt_priority": priority, "priority": priority_note}
    hog: Hog | None = None
    with tempfile.TemporaryDirectory(prefix="robobus-bench-stop-") as tmpdir:
        tmp = Path(tmpdir)
        broker = Broker(free_port(), tmp)
        broker.start()
        if broker.proc is not None:
            set_fifo(broker.proc.pid, priority)
        print(f"broker, service nodes and this bench's client: {priority_note}", flush=True)
        system = System(tmp, broker.url, a.robots, a.arms, virtual_hand, a.roi_modules, priority)
        client = RpcClient(KitSettings(mqtt_url=broker.url), name="bench-stop")
        bench: Bench | None = None
        try:
            system.start()
            client.connect()
            bus = BusWatch()
            client.subscribe_before(f"{ROOT}/+/+/health", bus.on_health)
            client.subscribe_before(f"{ROOT}/+/_node/state/stop", bus.on_answer)
            devices = system.devices()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 90:
                if all(bus.connected(n, d) == len(d) for n, d in devices.items()):
                    break
                if system.dead():
                    raise SystemExit(f"exited early: {system.dead()} (logs in {tmp})")
                time.sleep(0.2)
            up = {n: f"{bus.connected(n, d)}/{len(d)}" for n, d in devices.items()}
            print(f"system up in {time.monotonic() - t0:.1f} s: connected {up}", flush=True)
            if not all(bus.connected(n, d) == len(d) for n, d in devices.items()):
                raise SystemExit(f"not every device connected: {up}")
            bench = Bench(system, client, bus)
            if a.hog:
                hog = Hog(tmp)
                time.sleep(1.0)
            # the operator's client (this process's threads: its stop publishes, the watches' readers) at the same
            # priority, as services/ethercat_loop/README.md has the client that drives the hand: the time measured
            # starts at the publish, and a client the host's load keeps off the CPU would publish late whatever the
            # bus does. Its threads only, once every child (simulators, the hog) runs: they keep their own.
            fifo_threads(priority)
            result["watch_check"] = bench.check_watches()
            print(f"the watches see the motion probes when no stop is active: {result['watch_check']} "
                  f"({'every device' if bench.watch_check_ok else 'NOT every device: a leak could go unseen'})",
                  flush=True)
            stalled = ({n: system.pids[n] for n in SERVICES} if a.stall == "nodes" else
                       {"broker": broker.proc.pid} if a.stall == "broker" and broker.proc is not None else {})
            for rnd in range(1, rounds + 1):
                if a.stall == "node":  # each node on its own, in turn: the stall the stop path must outrun
                    worst = {}
                    for svc in SERVICES:
                        worst.update(bench.stall_round(rnd, "node", a.stall_s, {svc: system.pids[svc]}))
                else:
                    worst = (bench.stall_round(rnd, a.stall, a.stall_s, stalled) if a.stall else
                             bench.restart_round(rnd) if a.restart else bench.round(rnd))
                print(f"stop {rnd:2d}: " + ", ".join(f"{s} {worst[s]:.1f} ms" if s in worst else f"{s} -"
                                                     for s in SERVICES), flush=True)
            result["load_1m"] = round(os.getloadavg()[0], 2)
        finally:
            if hog is not None:
                hog.stop()
            if bench is not None:
                bench.close()
            # leave no stop retained on the (private) broker, then stop everything
            client.close()
            system.close()
            broker.kill()
    assert bench is not None
    services = {s: bench.fig[s].summary(target) for s in SERVICES}
    for s in SERVICES:
        r = bench.reported[s]
        services[s]["answer_written_p50_ms"] = round(percentile(r, 50), 2)
        services[s]["answer_written_p99_ms"] = round(percentile(r, 99), 2)
        services[s]["node_read_p50_ms"] = round(percentile(bench.read[s], 50), 2)
        services[s]["node_read_p99_ms"] = round(percentile(bench.read[s], 99), 2)
    probes = sum(f.probes for f in bench.fig.values())
    executed = sum(len(f.not_refused) + f.reached_wire for f in bench.fig.values())
    start = "the nodes' restart under the stop (killed -9 while moving)" if a.restart else (
             f"the {'nodes' if a.stall in ('node', 'nodes') else 'broker'}' resume (SIGCONT after a {a.stall_s:g} s "
             "SIGSTOP, "
             "the stop published during it, a client streaming)" if a.stall else "the stop's publish")
    print(f"\nfrom {start} to each service's last device, {rounds} stops"
          f"{' beside the mixed hog' if a.hog else ' (no hog)'}"
          + ("; no target (a node's start):" if a.restart else f"; target p99 <= {target:.0f} ms:"))
    print(f"{'service':<16} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'ratio':>6}  {'':<8} {'read p50/p99':>13}  how")
    for s, f in services.items():
        read = f"{f['node_read_p50_ms']:.1f}/{f['node_read_p99_ms']:.1f}"
        print(f"{s:<16} {f['p50_ms']:>8.2f} {f['p99_ms']:>8.2f} {f['max_ms']:>8.2f} {f['ratio']:>6.2f}  "
              f"{'met' if f['met'] else 'NOT MET':<8} {read:>13}  {f['how']}"
              + (f" ({f['missing']} missing, {f['early']} early)" if f["missing"] or f["early"] else "")
              + (f" ({f['stop_errors']} devices answered the stop with an error)" if f["stop_errors"] else ""))
    print(f"motion commands sent while stopped: {probes}; refused 'stopped': "
          f"{sum(f.refused_stopped for f in bench.fig.values())}; not refused: "
          f"{sum(len(f.not_refused) for f in bench.fig.values())}; reached a simulator's wire: "
          f"{sum(f.reached_wire for f in bench.fig.values())} (target 0): {'met' if executed == 0 else 'NOT MET'}")
    print("read: from the publish to the node reading the stop (its answer's received_ts), ms; first device p50: "
          + ", ".join(f"{s} {f['first_device_p50_ms']:.1f} ms" for s, f in services.items()))
    print(f"hand: {result['hand']}; Dexters: DexRun has no stop bytes (the node's stop answer; the watch checks that "
          "no motion request arrives)")
    if bench.move_failures:
        print(f"motion commands refused while not stopped ({len(bench.move_failures)}): {bench.move_failures[:3]}")
    for e in sorted(bench.errors, key=lambda e: "on a wire" not in e)[:12]:  # what reached a wire first
        print(f"note: {e}")
    result.update(services=services, target_p99_ms=target, motion_probes=probes, motion_executed_while_stopped=executed,
                  move_failures=len(bench.move_failures), errors=len(bench.errors))
    result["watch_check_ok"] = bench.watch_check_ok
    special = bool(a.stall or a.restart)  # no motion probes in these rounds: a stall or a restart is measured
    complete = all(f["missing"] == 0 for f in services.values())
    result["met"] = bool((a.restart or all(f["met"] for f in services.values())) and executed == 0
                         and (special or probes > 0) and complete and not bench.move_failures
                         and bench.watch_check_ok)
    origin = "the nodes' restart" if a.restart else f"the {a.stall}'s resume" if a.stall else "the bus stop's publish"
    report("stop", result, [
        *(Figure(f"{origin} to the last device, {s}, p99", _number(services[s]["p99_ms"]), "ms",
                 None if a.restart else "<=", None if a.restart else target)
          for s in SERVICES),
        Figure("motion commands executed while stopped", executed, "", "<=", 0),
    ], variant=variant_name("quick" if a.quick else "", "hog" if a.hog else "",
                            f"stall-{a.stall}" if a.stall else "", "restart" if a.restart else "",
                            f"roi{a.roi_modules}" if a.roi_modules != 50 else "",
                            f"robots{a.robots}" if a.robots != 20 else "", f"arms{a.arms}" if a.arms != 3 else "",
                            "model-hand" if not virtual_hand else "",
                            "" if priority else "ordinary-priority"))


if __name__ == "__main__":
    main()
