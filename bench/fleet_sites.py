"""The fleet bench's sites: one host mosquitto per site, bridged to the clustered centre as a real site's broker is,
and one replayer process that plays every site's services into its broker.

A site's broker: mosquitto with make_secrets.bridge_conf's bridge (the site's own `bridge-<site>` credentials from
the centre's secrets, TLS with the fleet's CA and the centre's certificate checked against each node's address,
every node listed, the site's main node first in turn), the shipped limits (deploy/mosquitto/compose.conf:
max_inflight_messages, max_queued_messages and bytes) and one local listener for the replayer. The local
listener takes anonymous clients: a site's own access rules are the site's business and nothing of them crosses
the uplink (bench/fleet.py's docstring says why that is faithful for what is measured: the centre).

The replayer (`python bench/fleet_sites.py PLAN LOG`): for every site of the plan, one MQTT 5 connection to the
site's broker on one asyncio loop, which
  - publishes bench/fleet_sample.json.gz (fleet_record.py) over and over with its times, sizes, QoS and retain
    flags, each site from its own point of the sample (sites offset evenly over its length), the states under
    `_uplink/{root}/` as deploy/uplink.py publishes them; the sample's retained set once at the start;
  - publishes one stamped QoS 1 event a second, {root}/fleetbench/probe/event/stamp {"seq", "t"} (wall clock),
    which a subscriber at the centre reads: the site -> centre latency and the messages lost;
  - subscribes to the site's {root}/_bridge/state (the bridge's own notice: "1" connected, "0" not) and
    {root}/_stop/fleet (the centre's stop, as every node of the site reads it) and logs each arrival;
one JSON line per event into LOG, and every second the counts sent so far ({"k": "sent", "stamps": {site: n}}).
A site whose broker is stopped (SIGSTOP) does not hold up the others: writes go to each connection's buffer.
The plan says the traffic too (TRAFFIC): the sample, the sample unretained, or idle sites.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from fleet_record import SAMPLE, Message, load  # noqa: E402

from shared.mqtt.wire import (  # noqa: E402
    ConnAck,
    PacketReader,
    PubAck,
    Publish,
    encode_connect,
    encode_puback,
    encode_publish,
    encode_subscribe,
)

STAMP = "fleetbench/probe/event/stamp"  # under each site's root
STAMP_HZ = 1.0
UPLINK_PREFIX = "_uplink/"  # deploy/uplink.py: the bridge maps _uplink/{root}/... to {root}/... at the centre
SITE_LIMITS = "max_inflight_messages 1000\nmax_queued_messages 100000\nmax_queued_bytes 67108864\n"


@dataclass(frozen=True)
class Site:
    name: str
    root: str
    port: int  # the broker's local listener, 127.0.0.1
    phase: float  # where in the sample this site starts, 0..1


def site_conf(site: Site, bridge: str, folder: Path) -> str:
    """A site broker's config: the shipped limits, one local listener, the generated bridge."""
    user = "user root\n" if os.geteuid() == 0 else ""
    return ("per_listener_settings false\nallow_anonymous true\npersistence false\nset_tcp_nodelay true\n"
            f"{SITE_LIMITS}{user}log_dest file {folder / 'mosquitto.log'}\nlog_type error\nlog_type warning\n"
            f"log_type notice\nconnection_messages false\nlistener {site.port} 127.0.0.1\n{bridge}")


class SiteBrokers:
    """The sites' mosquitto processes: started, stopped and continued (a cut), killed at the end."""

    def __init__(self, exe: str) -> None:
        self.exe = exe
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, site: Site, conf: Path) -> None:
        self.procs[site.name] = subprocess.Popen([self.exe, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL)

    def listens(self, name: str, port: int) -> bool:
        """The site's broker holds the listening socket on 127.0.0.1:`port` (its own, not one another process
        bound first: /proc/net/tcp's listener on the port, among the broker's open files)."""
        want = f"0100007F:{port:04X}"
        inodes = set()
        with contextlib.suppress(OSError):
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
                f = line.split()
                if f[1] == want and f[3] == "0A":  # local address, state LISTEN
                    inodes.add(f"socket:[{f[9]}]")
        if not inodes:
            return False
        fds = Path(f"/proc/{self.procs[name].pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fds.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return True
        return False

    def signal(self, names: list[str], sig: signal.Signals) -> None:
        for n in names:
            self.procs[n].send_signal(sig)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped one must be able to die
                p.kill()
        for p in self.procs.values():
            p.wait(10)


# What each site replays: the sample as recorded; the sample with every retain flag cleared (what retained
# messages cost the centre, by difference); or none of it (idle: the retained set once, the heartbeat and the
# stamped events only: what a connected site costs by itself)
TRAFFIC = ("sample", "sample-unretained", "idle")


def write_plan(sites: list[Site], path: Path, traffic: str = "sample") -> None:
    path.write_text(json.dumps({"traffic": traffic, "sites": [asdict(s) for s in sites]}))


def read_plan(path: Path) -> tuple[list[Site], str]:
    doc = json.loads(path.read_text())
    return [Site(**s) for s in doc["sites"]], str(doc["traffic"])


# -- the replayer (a child process) ------------------------------------------------------------------------------
class Connection:
    """One site's MQTT 5 client on the loop: publishes without waiting (QoS 1 within the broker's receive maximum,
    the rest queued as a client library would), acknowledges and logs what it subscribed to."""

    def __init__(self, site: Site, log: IO[str]) -> None:
        self.site, self.log = site, log
        self.writer: asyncio.StreamWriter | None = None
        self.receive_max = 65535
        self.unacked = 0
        self.pid = 0
        self.waiting: deque[tuple[str, bytes, bool]] = deque()
        self.sent = 0
        self.retained = 0  # of them with the retain flag (ejabberd stores each in Mnesia)

    async def connect(self) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.site.port)
        self.writer.write(encode_connect(f"fleetbench-{self.site.name}", keepalive=60))
        self.writer.write(encode_subscribe(1, [f"{self.site.root}/_bridge/state", f"{self.site.root}/_stop/fleet"]))
        asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        packets = PacketReader()
        while data := await reader.read(65536):
            now = time.time()
            for p in packets.feed(data):
                if isinstance(p, PubAck):
                    self.unacked -= 1
                    while self.waiting and self.unacked < self.receive_max:
                        self._send(*self.waiting.popleft(), qos=1)
                elif isinstance(p, Publish):
                    if p.qos and self.writer is not None:
                        self.writer.write(encode_puback(p.packet_id))
                    kind = "bridge" if p.topic.endswith("/_bridge/state") else "stop"
                    self.log.write(json.dumps({"k": kind, "t": now, "site": self.site.name, "r": p.retain,
                                               "v": p.payload.decode(errors="replace")}) + "\n")
                elif isinstance(p, ConnAck):
                    self.receive_max = int(p.props.get("receive_maximum", 65535))
        self.log.write(json.dumps({"k": "closed", "t": time.time(), "site": self.site.name}) + "\n")

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        if qos and self.unacked >= self.receive_max:
            self.waiting.append((topic, payload, retain))
            return
        self._send(topic, payload, retain, qos)

    def _send(self, topic: str, payload: bytes, retain: bool, qos: int) -> None:
        assert self.writer is not None
        pid = 0
        if qos:
            self.pid = self.pid % 65535 + 1
            pid = self.pid
            self.unacked += 1
        self.writer.write(encode_publish(topic, payload, qos=qos, retain=retain, packet_id=pid))
        self.sent += 1
        self.retained += retain


def site_topic(root: str, m: Message) -> str:
    return f"{UPLINK_PREFIX}{root}/{m.topic}" if "/state/" in m.topic else f"{root}/{m.topic}"


async def replay(sites: list[Site], log: IO[str], stop: asyncio.Event, traffic: str = "sample") -> None:
    messages, initial, length = load(SAMPLE)
    if traffic == "sample-unretained":
        messages = [Message(m.t, m.topic, m.qos, False, m.payload) for m in messages]
    conns = [Connection(s, log) for s in sites]
    await asyncio.gather(*(c.connect() for c in conns))
    for c in conns:
        for m in initial:
            c.publish(site_topic(c.site.root, m), m.payload, m.qos, True)
    t0 = time.monotonic() + 0.5
    # the next due message of each site: (due, site index, cycle, index in the sample); stamps apart
    heap: list[tuple[float, int, int, int]] = []
    for i, s in enumerate(sites if traffic != "idle" else []):
        start = s.phase * length
        k = next((j for j, m in enumerate(messages) if m.t >= start), 0)
        heap.append((t0 + messages[k].t - start, i, 0, k))
    heapq.heapify(heap)
    stamps = [0] * len(sites)
    stamp_due = [t0 + s.phase / STAMP_HZ for s in sites]
    last_count = 0.0
    while not stop.is_set():
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, i, cycle, k = heapq.heappop(heap)
            m, c = messages[k], conns[i]
            c.publish(site_topic(c.site.root, m), m.payload, m.qos, m.retain)
            k += 1
            if k == len(messages):
                k, cycle = 0, cycle + 1
            start = sites[i].phase * length
            heapq.heappush(heap, (t0 + cycle * length + messages[k].t - start, i, cycle, k))
        wall = time.time()
        for i, c in enumerate(conns):
            if stamp_due[i] <= now:
                c.publish(f"{c.site.root}/{STAMP}", json.dumps({"seq": stamps[i], "t": wall}).encode(), 1, False)
                stamps[i] += 1
                stamp_due[i] += 1.0 / STAMP_HZ
        if now - last_count >= 1.0:
            last_count = now
            log.write(json.dumps({"k": "sent", "t": wall, "msgs": sum(c.sent for c in conns),
                                  "retained": sum(c.retained for c in conns),
                                  "stamps": {c.site.name: stamps[i] for i, c in enumerate(conns)}}) + "\n")
            log.flush()
        nxt = min(heap[0][0] if heap else now + 0.1, min(stamp_due), now + 0.1)
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
    log.write(json.dumps({"k": "sent", "t": time.time(), "msgs": sum(c.sent for c in conns),
                          "retained": sum(c.retained for c in conns),
                          "stamps": {c.site.name: stamps[i] for i, c in enumerate(conns)}, "final": True}) + "\n")
    log.flush()


def replayer_main(plan: Path, log_path: Path) -> None:
    sites, traffic = read_plan(plan)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        with open(log_path, "a", buffering=1) as log:
            await replay(sites, log, stop, traffic)

    asyncio.run(run())


class LogTail:
    """The replayer's log as it grows: each read parses only the lines added since the last (a log of 300 sites
    grows by megabytes; parsing it whole at every poll would cost the machine the centre is measured on). The
    events are kept; of the `sent` lines only the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []
        self.last_sent: dict[str, Any] | None = None

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written is left for the next read
        self.offset += end
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("k") == "sent":
                self.last_sent = e
            else:
                self.events.append(e)


if __name__ == "__main__":
    replayer_main(Path(sys.argv[1]), Path(sys.argv[2]))
