"""`make run`'s stack on free ports, for the dashboard's browser tests and its benchmark.

A mosquitto with an MQTT and a websockets listener (optionally with a password file), the services on
their simulators exactly as deploy/Procfile.sim starts them (ethercat-loop on the model backend,
can-bootloader with ROBOBUS_CAN_SIM=true, two simulated e-puck2 robots on TCP and one on a serial pty with
epuck-gateway, three simulated ROI modules with roi-modules, a simulated Dexter with dexter-gateway), and
`robobus dashboard` serving the page. Every other registered service is started as `make run` starts it: its
node's and its simulators' lines of deploy/Procfile.sim, on ports and links of the stack's own. Headless Debian
chromium, driven by Python playwright."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from shared.registry import service_names
from shared.rpc import RpcClient, wait_for
from shared.settings import KitSettings
from shared.tools.localbroker import REPO, mosquitto_bin
from shared.tools.simrig import own_procfile_env, procfile_commands, sim_serves

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """n free loopback ports (consecutive ones for the e-puck simulator's --base-port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        ports = [base + i for i in range(n)] if consecutive else [base]
        if not consecutive:
            socks = []
            try:
                for _ in range(n - 1):
                    t = socket.socket()
                    t.bind(("127.0.0.1", 0))
                    socks.append(t)
                ports += [int(t.getsockname()[1]) for t in socks]
            finally:
                for t in socks:
                    t.close()
            return ports
        if all(_port_free(p) for p in ports):
            return ports
    raise RuntimeError("no free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def browser_missing() -> str | None:
    """None when the browser tests can run, else why not (the tests skip with it)."""
    if mosquitto_bin() is None:
        return "mosquitto is not installed (make setup installs it)"
    if not os.path.exists(CHROMIUM):
        return "Debian's chromium is not installed (make setup installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright is not installed (pip install -e '.[dashboard]')"
    from shared.tools.dashboard.server import MissingAssets, vendor_files

    try:
        vendor_files()
    except MissingAssets as exc:
        return str(exc)
    return None


@dataclass
class WsBroker:
    """mosquitto on free loopback ports: MQTT for the services, websockets for the page."""

    workdir: Path
    users: dict[str, str] | None = None
    port: int = 0
    ws_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.port, self.ws_port = free_ports(2)
        auth = "allow_anonymous true\n"
        if self.users:
            pwfile = self.workdir / "passwd"
            pwfile.write_text("")
            for user, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(pwfile), user, password], check=True,
                               capture_output=True)
            # mosquitto started as root reads the file as its own `mosquitto` user
            self.workdir.chmod(0o755)
            pwfile.chmod(0o644)
            auth = f"allow_anonymous false\npassword_file {pwfile}\n"
        conf = self.workdir / "mosquitto.conf"
        conf.write_text("per_listener_settings false\npersistence false\nset_tcp_nodelay true\n"
                        f"max_queued_messages 100000\n{auth}"
                        f"listener {self.port} 127.0.0.1\nprotocol mqtt\n"
                        f"listener {self.ws_port} 127.0.0.1\nprotocol websockets\n")
        exe = mosquitto_bin()
        assert exe
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in (self.port, self.ws_port):
            assert wait_for(partial(_listening, port), 10), f"mosquitto did not listen on {port}"

    def url(self, user: str | None = None) -> str:
        if user and self.users:
            return f"mqtt://{user}:{self.users[user]}@127.0.0.1:{self.port}"
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@dataclass
class SimStack:
    """The services on simulators against one WsBroker, plus `robobus dashboard`."""

    broker: WsBroker
    workdir: Path
    mqtt_url: str
    procs: dict[str, Proc] = field(default_factory=dict)
    dashboard_url: str = ""

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, shell: str = "") -> Proc:
        """`python <args>`, or a Procfile command line (`shell`, run by bash as the supervisor runs it)."""
        log = self.workdir / f"{name}.log"
        full = {**os.environ, "PYTHONUNBUFFERED": "1", "ROBOBUS_MQTT_URL": self.mqtt_url, **(env or {})}
        argv = ["bash", "-c", shell] if shell else [sys.executable, *args]
        with log.open("wb") as out:
            p = subprocess.Popen(argv, cwd=REPO, env=full, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs[name] = Proc(name, p, log)
        return self.procs[name]

    def start_services(self, nodes: list[str]) -> None:
        if nodes == NODES_EARLIER:
            return self._start_earlier()
        base = free_ports(2, consecutive=True)[0]
        robots: list[dict[str, Any]] = [{"id": f"epuck{i + 1}", "host": "127.0.0.1", "port": base + i}
                                        for i in range(2)]
        link = self.workdir / "epuck-serial"
        robots.append({"id": "epuck3", "transport": "serial", "port": f"{link}1"})
        dexter_port = free_ports(1)[0]
        prefix = roi_prefix()
        # The same commands and settings as deploy/Procfile.sim (ports and the ROI network chosen free).
        self.spawn("ethercat-loop", ["-m", "services.ethercat_loop"], {"ROBOBUS_ETHERCAT_BACKEND": "model"})
        self.spawn("epuck-sim", ["-m", "services.epuck_gateway.sim", "--count", "2", "--base-port", str(base)])
        self.spawn("epuck-serial-sim", ["-m", "services.epuck_gateway.sim", "--count", "0", "--serial-count", "1",
                                        "--serial-link", str(link)])
        assert wait_for(lambda: Path(f"{link}1").exists(), 20), self.procs["epuck-serial-sim"].text()
        self.spawn("epuck-gateway", ["-m", "services.epuck_gateway"], {"ROBOBUS_EPUCK_ROBOTS": json.dumps(robots)})
        self.spawn("can-bootloader", ["-m", "services.can_bootloader"],
                   {"ROBOBUS_CAN_SIM": "true", "ROBOBUS_CAN_SIM_ERASE_S": "0.05"})
        self.spawn("roi-sim", ["-m", "services.roi_modules.sim", "--prefix", prefix, "--modules",
                               ",".join(f"{kind}:{octet}" for _, octet, kind in ROI_MODULES)])
        self.spawn("roi-modules", ["-m", "services.roi_modules"], {
            "ROBOBUS_ROI_NETWORK": prefix, "ROBOBUS_ROI_HOST_OCTET": "100",
            "ROBOBUS_ROI_MODULES": json.dumps([{"name": n, "octet": o, "type": k} for n, o, k in ROI_MODULES])})
        self.spawn("dexter-sim", ["-m", "services.dexter_gateway.sim", "--port", str(dexter_port)])
        assert wait_for(lambda: _listening(dexter_port), 20), self.procs["dexter-sim"].text()
        self.spawn("dexter-gateway", ["-m", "services.dexter_gateway"], {
            "ROBOBUS_DEXTER_ARMS": json.dumps([{"id": "dexter1", "host": "127.0.0.1", "port": dexter_port}])})
        self.start_from_procfile([n for n in nodes if n not in STARTED_HERE])

    def start_from_procfile(self, services: list[str]) -> None:
        """Each service as `make run` starts it: its simulators' lines of deploy/Procfile.sim, then its node's, with
        the Procfile's port and link variables given values of this stack's own."""
        lines = procfile_commands()
        serves = sim_serves(lines)
        wanted = [n for n in lines if serves.get(n) in services] + [n for n in services if n in lines]
        missing = [s for s in services if s not in lines]
        assert not missing, f"deploy/Procfile.sim has no line for {missing}"
        env = own_procfile_env([lines[n] for n in wanted], self.workdir)
        path = f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"
        for name in wanted:
            self.spawn(name, [], {**env, "PATH": path}, shell=lines[name])

    def _start_earlier(self) -> None:
        """The three services the dashboard was first measured with (bench/dashboard.py --stack three)."""
        base = free_ports(2, consecutive=True)[0]
        robots = [{"id": f"epuck{i + 1}", "host": "127.0.0.1", "port": base + i} for i in range(2)]
        self.spawn("ethercat-loop", ["-m", "services.ethercat_loop"], {"ROBOBUS_ETHERCAT_BACKEND": "model"})
        self.spawn("epuck-sim", ["-m", "services.epuck_gateway.sim", "--count", "2", "--base-port", str(base)])
        self.spawn("epuck-gateway", ["-m", "services.epuck_gateway"], {"ROBOBUS_EPUCK_ROBOTS": json.dumps(robots)})
        self.spawn("can-bootloader", ["-m", "services.can_bootloader"],
                   {"ROBOBUS_CAN_SIM": "true", "ROBOBUS_CAN_SIM_ERASE_S": "0.05"})

    def start_dashboard(self, port: int | None = None) -> None:
        """`robobus dashboard` as `make run` starts it: the page's default broker is its relay (/mqtt); a page
        goes to the broker's websockets listener with `?broker=` + broker.ws_url. `port`: again on the port of
        an earlier run."""
        port = port or free_ports(1)[0]
        self.spawn("dashboard", ["-m", "shared.tools.cli", "dashboard", "--port", str(port)])
        self.dashboard_url = f"http://127.0.0.1:{port}/"
        assert wait_for(lambda: _listening(port), 20), self.procs["dashboard"].text()

    def wait_online(self, client: RpcClient, nodes: list[str], timeout: float = 60) -> None:
        def online() -> bool:
            seen = {t.split("/")[1]: json.loads(p) for t, p, _ in client.collect_retained("robobus/+/status")}
            if not all(seen.get(n, {}).get("online") for n in nodes):
                return False
            healths = {tuple(t.split("/")[1:3]) for t, p, _ in client.collect_retained("robobus/+/+/health") if p}
            return all((n, d) in healths for n in nodes for d in seen[n].get("devices", []) if d != "_node")

        assert wait_for(online, timeout, 0.5), {n: p.text() for n, p in self.procs.items() if not p.alive()}
        statuses = {t.split("/")[1]: json.loads(p) for t, p, _ in client.collect_retained("robobus/+/status") if p}
        for n in nodes:  # the devices each node says it serves (its status): what the page must show
            DEVICES[n] = sorted(d for d in statuses[n].get("devices", []) if d != "_node")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)


ROI_MODULES = [("roi_io", 10, "gpio"), ("roi_wheel", 20, "odrive"), ("roi_arm", 30, "actuator")]
ROI_PORTS = (57344, 57664)


def roi_prefix() -> str:
    """A loopback /24 of this run's own for the ROI simulator (its ports are fixed by the protocol): derived
    from the pid in a range the roi-modules tests do not use (127.200-249), the first whose ports are free."""
    for n in range(64):
        pid = os.getpid() + n
        prefix = f"127.{150 + pid % 50}.{(pid // 50) % 250 + 1}"
        if all(_udp_free(f"{prefix}.{octet}", port) for _, octet, _ in ROI_MODULES for port in ROI_PORTS):
            return prefix
    raise RuntimeError("no free loopback network for the ROI simulator")


def _udp_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# `make run`'s whole stack: every registered service on its simulator (deploy/Procfile.sim)
NODES = sorted(service_names())
# the services start_services starts with the dashboard tests' own settings (a short erase time for the CAN boards,
# the ROI modules blank); every other registered service is started from its Procfile lines
STARTED_HERE = {"can-bootloader", "dexter-gateway", "epuck-gateway", "ethercat-loop", "roi-modules"}
# node -> its devices, as each node's status names them once the stack is up (sim_stack fills it)
DEVICES: dict[str, list[str]] = {}
# the stack of the dashboard's first benchmark figures: the hand, two e-pucks on TCP, the CAN boards
NODES_EARLIER = ["can-bootloader", "epuck-gateway", "ethercat-loop"]


@contextlib.contextmanager
def sim_stack(users: dict[str, str] | None = None, nodes: list[str] | None = None
              ) -> Iterator[tuple[SimStack, RpcClient]]:
    """Broker + every service on its simulator (`nodes`: NODES, or NODES_EARLIER) + the dashboard; yields the
    stack and a connected client once every node is online and every device has published its health."""
    nodes = nodes or NODES
    with tempfile.TemporaryDirectory(prefix="robobus-dash-") as d:
        broker = WsBroker(Path(d), users)
        broker.start()
        user = next(iter(users)) if users else None
        stack = SimStack(broker, Path(d), broker.url(user))
        client = RpcClient(KitSettings(mqtt_url=broker.url(user)), name="dash-test")
        try:
            client.connect()
            stack.start_services(nodes)
            stack.start_dashboard()
            stack.wait_online(client, nodes)
            yield stack, client
        finally:
            client.close()
            stack.stop()
            broker.stop()


@contextlib.contextmanager
def browser(width: int = 1600, height: int = 1000) -> Iterator[Any]:
    """Debian's chromium, headless, with a fresh profile; yields a playwright BrowserContext."""
    from playwright.sync_api import ViewportSize, sync_playwright

    viewport: ViewportSize = {"width": width, "height": height}
    with tempfile.TemporaryDirectory(prefix="robobus-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True,
            viewport=viewport)
        try:
            yield ctx
        finally:
            ctx.close()


# -- browser-side figures ---------------------------------------------------------------------------------
def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def browser_cpu_seconds(ancestor: int | None = None) -> float:
    """CPU time (user + system) of every chromium process descended from this process."""
    return sum(browser_cpu_by_kind(ancestor).values())


def browser_cpu_by_kind(ancestor: int | None = None) -> dict[str, float]:
    """CPU seconds of the chromium processes descended from this process, by kind (--type=renderer,
    gpu-process, utility (the network service), browser)."""
    ancestor = ancestor or os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    kinds: dict[str, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if "chromium" not in os.readlink(d / "exe"):
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p, hops = int(d.name), 0
        while p > 1 and p != ancestor and hops < 32:
            p, hops = _ppid(p), hops + 1
        if p == ancestor:
            args = (d / "cmdline").read_bytes().replace(b"\0", b" ").split()  # chromium rewrites its title
            kind = next((a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--type=")), "browser")
            if kind == "utility":
                sub = next((a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--utility-sub-type=")), "")
                kind = f"utility {sub.rsplit('.', 1)[-1]}" if sub else kind
            kinds[kind] = kinds.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return kinds


PERF_JS = ("() => ({...window.__robobusPerf, now: performance.now(), "
           "wsFrames: window.__robobus.wsFrames ? window.__robobus.wsFrames() : null})")


def measure_page(page: Any, seconds: float, fps_probe: bool = True) -> dict[str, Any]:
    """Over `seconds` of the live stack: frames per second the page gets (a requestAnimationFrame probe,
    when `fps_probe`), the main thread's time on MQTT messages and on drawing (the page's own counters), the
    renderer main thread's busy time (Chrome's Performance.getMetrics), and the CPU of every chromium
    process. The probe keeps the display ticking at its full rate, which costs CPU of its own: the
    benchmark measures with and without it."""
    page.evaluate("on => window.__robobusProbe(on)", fps_probe)
    time.sleep(0.5)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")

    def metrics() -> dict[str, float]:
        return {m["name"]: float(m["value"]) for m in cdp.send("Performance.getMetrics")["metrics"]}

    a, ma, ka, wa = page.evaluate(PERF_JS), metrics(), browser_cpu_by_kind(), time.monotonic()
    time.sleep(seconds)
    b, mb, kb, wb = page.evaluate(PERF_JS), metrics(), browser_cpu_by_kind(), time.monotonic()
    ca, cb = sum(ka.values()), sum(kb.values())
    dt = (b["now"] - a["now"]) / 1000
    wall = wb - wa
    cdp.detach()
    ta, tb = ma.get("TaskDuration", 0.0), mb.get("TaskDuration", 0.0)
    split = {k: round((mb.get(k, 0.0) - ma.get(k, 0.0)) / wall * 100, 1)
             for k in ("ScriptDuration", "RecalcStyleDuration", "LayoutDuration")}
    return {
        "seconds": round(dt, 2),
        "fps": round((b["frames"] - a["frames"]) / dt, 1) if fps_probe else None,
        "draws_per_s": round((b["draws"] - a["draws"]) / dt, 1),
        "msgs_per_s": round((b["msgs"] - a["msgs"]) / dt, 1),
        # websocket frames the page received (null on a page without the counter)
        "ws_frames_per_s": round((b["wsFrames"] - a["wsFrames"]) / dt, 1) if b.get("wsFrames") is not None else None,
        "handling_pct_of_core": round((b["msgMs"] - a["msgMs"]) / dt / 10, 2),
        "drawing_pct_of_core": round((b["renderMs"] - a["renderMs"]) / dt / 10, 2),
        "renderer_main_thread_pct": round((tb - ta) / wall * 100, 1),
        "renderer_main_thread_split_pct": split,
        "browser_cpu_pct_all_processes": round((cb - ca) / wall * 100, 1),
        "browser_cpu_pct_by_process": {k: round((kb[k] - ka.get(k, 0.0)) / wall * 100, 1) for k in sorted(kb)},
        "bad_messages": b["bad"] - a["bad"],
    }


def fleet_messages(n: int, tag: str, now: float | None = None) -> list[tuple[str, bytes]]:
    """What a centre holds of `n` sites (retained): three nodes and five devices each, fleet-watch's verdict; site
    000 unreachable, site 001 with a device not operational, site 002 stopped by the centre."""
    out: list[tuple[str, bytes]] = []
    for i in range(n):
        r = f"{tag}{i:03d}/robobus"
        out.append((f"{r}/_bridge/reachable", b"0" if i == 0 else b"1"))
        for node in ("epuck-gateway", "roi-modules", "dexter-gateway"):
            out.append((f"{r}/{node}/status", json.dumps({"online": True, "service": node}).encode()))
        for k in range(5):
            ok = not (i == 1 and k == 0)
            out.append((f"{r}/roi-modules/m{k}/health", json.dumps({"state": "running" if ok else "silent",
                                                                     "connection": ok, "operational": ok}).encode()))
        if i == 2:
            out.append((f"{r}/_stop", json.dumps({"active": True, "source": "op", "ts": now or time.time()}).encode()))
    return out
