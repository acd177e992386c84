"""Recorder benchmark: sustained messages/s without loss, and replay timing error at rate 1.

1. Throughput: a fresh mosquitto on loopback; `robobus record` (the real CLI, its own process); a
   publisher process sends 1 KB JSON messages at QoS 1 on 20 topics at a fixed rate for a while.
   The recording must hold every sequence number, in order per topic, and the recorder must have
   caught up within 2 s of the last publish (no growing backlog). Rates are stepped up; the figure is
   the highest rate that passed.
2. Replay timing: the recorder records a mixed stream (10 topics at 100 Hz, 2 at 500 Hz, 2,000 msg/s);
   `robobus replay --rate 1 --root <other>` (the real CLI) republishes it, at normal priority, with
   --realtime, and with --realtime and the broker at SCHED_FIFO; a subscriber in its own process has the
   kernel stamp each arrival at its socket (SO_TIMESTAMPNS, one MQTT packet a read);
   error = |(arrival_i - arrival_0) - (log_time_i - log_time_0)|, every message.

    python bench/record.py [--quick] [--rates 20000,30000,40000] [--seconds 10]

Targets: >= 20,000 msg/s of 1 KB JSON without loss; replay timing error p99 <= 2 ms.
Last line: one JSON object with the figures and the ratios to target.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mcap.reader import make_reader  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from shared.mqtt.wire import (  # noqa: E402
    ConnAck,
    PacketReader,
    PubAck,
    Publish,
    SubAck,
    encode_connect,
    encode_publish,
    encode_subscribe,
)
from shared.tools.localbroker import Broker, free_port  # noqa: E402

TOPICS = 20
PAYLOAD = 1000
TARGET_RATE = 20_000
TARGET_P99_MS = 2.0


# -- the publisher (its own process) --------------------------------------------------------------
def publisher(port: int, rate: int, seconds: float, root: str) -> None:
    """QoS 1 at a fixed rate, in 5 ms batches; PUBACKs read on a thread; prints what it sent."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(encode_connect(f"bench-pub-{os.getpid()}", keepalive=60, props={"receive_maximum": 65535}))
    reader = PacketReader()
    while not any(isinstance(p, ConnAck) for p in reader.feed(sock.recv(4096))):
        pass
    acked = [0]

    def read_acks() -> None:
        r = PacketReader()
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return
            acked[0] += sum(1 for p in r.feed(data) if isinstance(p, PubAck))

    threading.Thread(target=read_acks, daemon=True).start()
    # one packet template per topic; each message patches its packet id and a fixed-width sequence
    # number in place, so the paced loop costs ~1 us a message and the offered rate is what we ask for
    templates = []
    for i in range(TOPICS):
        head = '{"seq":         0,"topic":' + f"{i:2d}" + ',"pad":"'
        body = (head + "x" * (PAYLOAD - len(head) - 2) + '"}').encode()
        tpl = encode_publish(f"{root}/bench/load/state/t{i:02d}", body, qos=1, packet_id=1)
        start = len(tpl) - len(body)  # the payload; before it the packet id (2) and property length (1)
        templates.append((tpl, start - 3, start + len('{"seq":')))
    total = int(rate * seconds)
    t0 = time.monotonic()
    sent = 0
    pid = 0
    while sent < total:
        due = int((time.monotonic() - t0) * rate) + 1
        batch = []
        while sent < min(due, total):
            pid = pid % 65535 + 1
            tpl, pid_at, seq_at = templates[sent % TOPICS]
            pkt = bytearray(tpl)
            struct.pack_into("!H", pkt, pid_at, pid)
            pkt[seq_at:seq_at + 10] = b"%10d" % sent  # space-padded: valid JSON
            batch.append(pkt)
            sent += 1
        if batch:
            sock.sendall(b"".join(batch))
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while acked[0] < total and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps({"sent": total, "acked": acked[0], "elapsed": elapsed, "end_ns": time.time_ns()}), flush=True)


# -- helpers ------------------------------------------------------------------------------------
class RecorderProc:
    def __init__(self, url: str, out: Path, filters: list[str]) -> None:
        # keepalive 300 s: the backlog step stops the recorder (SIGSTOP) longer than the default 15 s x 1.5
        env = {**os.environ, "ROBOBUS_MQTT_URL": url, "PYTHONUNBUFFERED": "1", "ROBOBUS_MQTT_KEEPALIVE_S": "300"}
        self.proc = subprocess.Popen([sys.executable, "-m", "shared.tools.record_cli", "record", "-o", str(out),
                                      *filters], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.subscribed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.subscribed.wait(60):
            raise RuntimeError("recorder did not subscribe: " + "\n".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if "subscribed" in line:
                self.subscribed.set()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def throughput_step(broker: Broker, work: Path, rate: int, seconds: float) -> dict[str, Any]:
    out = work / f"load-{rate}.mcap"
    rec = RecorderProc(broker.url, out, ["robobus/bench/#"])
    cpu0 = cpu_seconds(rec.proc.pid)
    pub = subprocess.run([sys.executable, __file__, "--publisher", str(broker.port), str(rate), str(seconds)],
                         capture_output=True, text=True, timeout=seconds * 5 + 120)
    if pub.returncode != 0:
        raise RuntimeError(pub.stderr)
    sent = json.loads(pub.stdout.strip().splitlines()[-1])
    # give the recorder 2 s past the publisher's end to have everything (no growing backlog)
    time.sleep(max(0.0, 2.0 - (time.time_ns() - sent["end_ns"]) / 1e9))
    cpu = cpu_seconds(rec.proc.pid) - cpu0
    rec.stop()
    seqs: dict[str, list[int]] = {}
    last_log = 0
    with open(out, "rb") as f:
        for _s, ch, msg in make_reader(f).iter_messages(log_time_order=False):
            if ch.topic.startswith("robobus/bench/") and msg.log_time <= sent["end_ns"] + 2_000_000_000:
                seqs.setdefault(ch.topic, []).append(json.loads(msg.data)["seq"])
                last_log = max(last_log, msg.log_time)
    got = sum(len(v) for v in seqs.values())
    in_order = all(v == sorted(v) for v in seqs.values())
    unique = len({s for v in seqs.values() for s in v})
    lag_s = max(0.0, (last_log - sent["end_ns"]) / 1e9)
    ok = unique == sent["sent"] and in_order
    return {"rate": rate, "sent": sent["sent"], "publish_s": round(sent["elapsed"], 2),
            "offered_per_s": round(sent["sent"] / sent["elapsed"]), "recorded": got,
            "recorder_cpu_us_per_msg": round(1e6 * cpu / max(unique, 1), 1),
            "unique": unique, "lost": sent["sent"] - unique, "in_order": in_order, "lag_s": round(lag_s, 3),
            "recorder_cpu_pct": round(100 * cpu / (sent["elapsed"] + 2.0), 1),
            "file_mb": round(out.stat().st_size / 1e6, 2), "ok": ok}


def drain_step(broker: Broker, work: Path, n: int) -> dict[str, Any]:
    """The recorder's own rate, whatever the publisher manages: the recorder is stopped (SIGSTOP) while
    n messages are published and acknowledged by the broker (queued for the recorder's session), then
    resumed; its receive times (the log times) say how fast it took the backlog in. Every sequence number
    must be in the file, in order per topic."""
    out = work / "drain.mcap"
    rec = RecorderProc(broker.url, out, ["robobus/bench/#"])
    rec.proc.send_signal(signal.SIGSTOP)
    try:
        pub = subprocess.run([sys.executable, __file__, "--publisher", str(broker.port), str(n), "1"],
                             capture_output=True, text=True, timeout=600)
        if pub.returncode != 0:
            raise RuntimeError(pub.stderr)
        sent = json.loads(pub.stdout.strip().splitlines()[-1])
        cpu0 = cpu_seconds(rec.proc.pid)
    finally:
        rec.proc.send_signal(signal.SIGCONT)
    seqs: dict[str, list[int]] = {}
    times: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until the file stops growing
        size = out.stat().st_size
        time.sleep(2.0)
        if out.stat().st_size == size:
            break
    cpu = cpu_seconds(rec.proc.pid) - cpu0
    rec.stop()
    with open(out, "rb") as f:
        for _s, ch, msg in make_reader(f).iter_messages(log_time_order=False):
            if ch.topic.startswith("robobus/bench/"):
                seqs.setdefault(ch.topic, []).append(json.loads(msg.data)["seq"])
                times.append(msg.log_time)
    unique = len({s for v in seqs.values() for s in v})
    span = (max(times) - min(times)) / 1e9 if len(times) > 1 else 0.0
    return {"queued": sent["sent"], "acked_by_broker": sent["acked"], "recorded": unique,
            "lost": sent["sent"] - unique, "in_order": all(v == sorted(v) for v in seqs.values()),
            "drain_s": round(span, 3), "drain_msgs_per_s": round(unique / span) if span else 0,
            "recorder_cpu_us_per_msg": round(1e6 * cpu / max(unique, 1), 1)}


def mixed_stream(port: int, seconds: float) -> None:
    """10 topics at 100 Hz and 2 at 500 Hz (2,000 msg/s), QoS 1, ~300 B JSON."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(encode_connect(f"bench-mix-{os.getpid()}", keepalive=60))
    threading.Thread(target=lambda: [None for _ in iter(lambda: sock.recv(65536), b"")], daemon=True).start()
    sched = [(f"robobus/bench/mix/state/slow{i}", 0.01) for i in range(10)] + \
            [(f"robobus/bench/mix/state/fast{i}", 0.002) for i in range(2)]
    nxt = [time.monotonic() + k * 0.0007 for k in range(len(sched))]
    end = time.monotonic() + seconds
    pid = 0
    n = 0
    while time.monotonic() < end:
        k = min(range(len(nxt)), key=nxt.__getitem__)
        delay = nxt[k] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        pid = pid % 65535 + 1
        topic, period = sched[k]
        sock.sendall(encode_publish(topic, json.dumps({"n": n, "v": [n * 0.1] * 20}).encode(), qos=1,
                                    packet_id=pid))
        n += 1
        nxt[k] += period


def record_mixed(broker: Broker, work: Path, seconds: float) -> tuple[Path, list[tuple[str, int, bytes]]]:
    out = work / "mixed.mcap"
    rec = RecorderProc(broker.url, out, ["robobus/bench/mix/#"])
    mixed_stream(broker.port, seconds)
    time.sleep(0.5)
    rec.stop()
    with open(out, "rb") as f:
        return out, [(ch.topic, m.log_time, m.data) for _s, ch, m in make_reader(f).iter_messages()]


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python does not export it everywhere


def subscriber(port: int, expected: int, out: str) -> None:
    """The replay's observer, in its own process: a lean MQTT 5 client on a blocking socket, with kernel
    receive timestamps (SO_TIMESTAMPNS: when the bytes reached the socket, whatever this process was
    doing then). Prints "ready" once subscribed; writes one JSON object with every arrival to `out` once
    `expected` messages came (or nothing came for 10 s)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.sendall(encode_connect(f"bench-sub-{os.getpid()}", keepalive=60))
    sock.sendall(encode_subscribe(1, ["replayed/#"], qos=0))
    reader = PacketReader()
    while not any(isinstance(p, SubAck) for p in reader.feed(sock.recv(4096))):
        pass
    print("ready", flush=True)
    sock.settimeout(10.0)
    topics: list[str] = []
    kernel: list[int] = []  # the kernel's receive time of the read's (last) segment, CLOCK_REALTIME
    user: list[int] = []  # when this process had the bytes (time.time_ns() after recvmsg)
    payloads: list[str] = []
    reads = 0
    while len(topics) < expected:
        # one packet a read (its header peeked first): the kernel stamp is then the arrival of that packet's
        # last byte, not of whatever came after it in a larger read
        try:
            head = sock.recv(5, socket.MSG_PEEK)
        except TimeoutError:
            break
        if not head:
            break
        size = _packet_size(head)
        if size is None:  # the header is not all there yet (a few bytes of a split segment)
            time.sleep(0.0001)
            continue
        try:
            data, anc, _flags, _addr = sock.recvmsg(size, 64, socket.MSG_WAITALL)
        except TimeoutError:
            break
        t_user = time.time_ns()
        if len(data) < size:
            break
        t_kernel = 0
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", raw[:16])
                t_kernel = sec * 1_000_000_000 + nsec
        reads += 1
        for p in reader.feed(data):
            if isinstance(p, Publish):
                topics.append(p.topic)
                kernel.append(t_kernel or t_user)
                user.append(t_user)
                payloads.append(p.payload.hex())
    Path(out).write_text(json.dumps({"topics": topics, "kernel_ns": kernel, "user_ns": user,
                                     "payloads": payloads, "reads": reads,
                                     "kernel_stamped": sum(1 for k, u in zip(kernel, user, strict=True) if k != u)}))


def _packet_size(head: bytes) -> int | None:
    """An MQTT packet's whole size from its first bytes (fixed header), None when they are too few."""
    length, mult = 0, 1
    for i, b in enumerate(head[1:5], start=2):
        length += (b & 0x7F) * mult
        if b < 0x80:
            return i + length
        mult <<= 7
    return None


def _errors_ms(arrivals: list[int], recorded: list[int], n: int) -> list[float]:
    a0, r0 = arrivals[0], recorded[0]
    return sorted(abs((arrivals[i] - a0) - (recorded[i] - r0)) / 1e6 for i in range(n))


def replay_timing(broker: Broker, out: Path, recorded: list[tuple[str, int, bytes]], seconds: float,
                  realtime: bool, broker_fifo: bool = False) -> dict[str, Any]:
    """`robobus replay --rate 1` of the recording (the real CLI, its own process); the subscriber (its own
    process) has the kernel stamp each arrival at its socket. Error per message: |(arrival_i - arrival_0)
    - (log_time_i - log_time_0)|, every message counted. `broker_fifo`: the broker runs SCHED_FIFO for the
    pass too (as `chrt`/systemd's CPUSchedulingPolicy would run it on a host that replays with exact timing):
    a message goes through the broker, and a broker at normal priority waits its turn on a busy host."""
    arrived_file = out.with_suffix(f".arrivals{int(realtime)}{int(broker_fifo)}.json")
    fifo_note = ""
    if broker_fifo and broker.proc is not None:
        try:
            os.sched_setscheduler(broker.proc.pid, os.SCHED_FIFO, os.sched_param(10))
            fifo_note = "SCHED_FIFO 10"
        except OSError as exc:
            fifo_note = f"at normal priority (SCHED_FIFO refused: {exc})"
    try:
        return _replay_timing(broker, out, arrived_file, recorded, seconds, realtime) | {"broker_fifo": fifo_note}
    finally:
        if fifo_note.startswith("SCHED_FIFO") and broker.proc is not None:
            os.sched_setscheduler(broker.proc.pid, os.SCHED_OTHER, os.sched_param(0))


def _replay_timing(broker: Broker, out: Path, arrived_file: Path, recorded: list[tuple[str, int, bytes]],
                   seconds: float, realtime: bool) -> dict[str, Any]:
    sub = subprocess.Popen([sys.executable, __file__, "--subscriber", str(broker.port), str(len(recorded)),
                            str(arrived_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert sub.stdout is not None
        if sub.stdout.readline().strip() != "ready":
            raise RuntimeError("the subscriber did not subscribe")
        env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url}
        rp = subprocess.run([sys.executable, "-m", "shared.tools.record_cli", "replay", str(out), "--root", "replayed",
                             *(["--realtime"] if realtime else [])],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds * 3 + 120)
        if rp.returncode != 0:
            raise RuntimeError(rp.stderr)
        sub.wait(30)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    got = json.loads(arrived_file.read_text())
    n = min(len(got["topics"]), len(recorded))
    same = all(bytes.fromhex(got["payloads"][i]) == recorded[i][2] for i in range(n))
    rec_t = [r[1] for r in recorded]
    errs = _errors_ms(got["kernel_ns"], rec_t, n)
    user = _errors_ms(got["user_ns"], rec_t, n)
    return {"realtime": realtime, "recorded": len(recorded), "arrived": len(got["topics"]),
            "payloads_identical_in_order": same,
            "err_p50_ms": round(errs[n // 2], 3), "err_p99_ms": round(errs[int(n * 0.99)], 3),
            "err_max_ms": round(errs[-1], 3),
            # the same with the subscriber's own (user-space) stamps: what a late reader would add
            "user_stamp_err_p99_ms": round(user[int(n * 0.99)], 3),
            "kernel_stamped": got["kernel_stamped"],
            "replay_cli": rp.stderr.strip().splitlines()[-1]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publisher":
        publisher(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), "robobus")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--subscriber":
        subscriber(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one 5 s step at 22 K/s (10 %% above the target: the "
                    "publisher's pacing falls a few per mille short of what it is asked), 5 s of replay")
    ap.add_argument("--rates", default="20000,30000,40000")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    rates = [TARGET_RATE * 11 // 10] if args.quick else [int(r) for r in args.rates.split(",")]
    seconds = 5.0 if args.quick else args.seconds
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="robobus-bench-record-") as d:
        work = Path(d)
        broker = Broker(free_port(), work)
        broker.start()
        try:
            steps = []
            for rate in rates:
                step = throughput_step(broker, work, rate, seconds)
                steps.append(step)
                print(f"{rate:>6}/s asked, {step['offered_per_s']}/s offered ({step['sent']} in "
                      f"{step['publish_s']} s): recorded {step['unique']} "
                      f"(lost {step['lost']}), in order per topic: {step['in_order']}, lag {step['lag_s']} s, "
                      f"recorder CPU {step['recorder_cpu_pct']} % ({step['recorder_cpu_us_per_msg']} us/msg), "
                      f"file {step['file_mb']} MB -> "
                      f"{'ok' if step['ok'] else 'FAILED'}", flush=True)
                if not step["ok"]:
                    break
            drain = drain_step(broker, work, 50_000 if args.quick else 90_000)
            print(f"backlog: {drain['queued']} queued at the broker while the recorder was stopped, recorded "
                  f"{drain['recorded']} (lost {drain['lost']}, in order: {drain['in_order']}) in {drain['drain_s']} s "
                  f"= {drain['drain_msgs_per_s']} msg/s ({drain['recorder_cpu_us_per_msg']} us CPU/msg)", flush=True)
            mixed, recorded = record_mixed(broker, work, seconds)
            timing = replay_timing(broker, mixed, recorded, seconds, realtime=False)
            timing_rt = replay_timing(broker, mixed, recorded, seconds, realtime=True)
            timing_rtb = replay_timing(broker, mixed, recorded, seconds, realtime=True, broker_fifo=True)
        finally:
            broker.kill()
    # the figure is the rate actually offered (a loaded machine may not let the publisher reach the ask)
    best = max((s["offered_per_s"] for s in steps if s["ok"]), default=0)
    cpu_us = min((s["recorder_cpu_us_per_msg"] for s in steps if s["ok"]), default=0.0)
    print(f"sustained without loss: {best} msg/s of 1 KB JSON offered and recorded (target {TARGET_RATE}, "
          f"ratio {best / TARGET_RATE:.2f}); recorder CPU {cpu_us} us/msg, i.e. one core would record "
          f"{1e6 / cpu_us if cpu_us else 0:.0f} msg/s")
    print(f"recorder rate on a broker backlog (publisher-independent): {drain['drain_msgs_per_s']} msg/s without "
          f"loss: {drain['lost'] == 0 and drain['in_order']} (target {TARGET_RATE}, "
          f"ratio {drain['drain_msgs_per_s'] / TARGET_RATE:.2f})")
    for t in (timing, timing_rt, timing_rtb):
        how = (" --realtime" if t["realtime"] else "") + (f", broker {t['broker_fifo']}" if t["broker_fifo"] else "")
        print(f"replay at rate 1{how}: {t['arrived']}/{t['recorded']} arrived, "
              f"payloads identical and in order: {t['payloads_identical_in_order']}; timing error p50 "
              f"{t['err_p50_ms']} ms, p99 {t['err_p99_ms']} ms, max {t['err_max_ms']} ms "
              f"(target p99 <= {TARGET_P99_MS} ms, ratio {t['err_p99_ms'] / TARGET_P99_MS:.2f}); with the "
              f"subscriber's own stamps p99 {t['user_stamp_err_p99_ms']} ms")
        print(f"  ({t['replay_cli']})")
    result = {
        "bench": "record", "quick": args.quick, "steps": steps, "sustained_msgs_per_s": best,
        "recorder_cpu_us_per_msg": cpu_us, "drain": drain,
        "drain_ratio_to_target": round(drain["drain_msgs_per_s"] / TARGET_RATE, 2),
        "sustained_ratio_to_target": round(best / TARGET_RATE, 2), "replay": timing, "replay_realtime": timing_rt,
        "replay_realtime_broker_fifo": timing_rtb,
        "replay_p99_ratio_to_target": round(timing["err_p99_ms"] / TARGET_P99_MS, 2),
        "replay_realtime_p99_ratio_to_target": round(timing_rt["err_p99_ms"] / TARGET_P99_MS, 2),
        "replay_realtime_broker_fifo_p99_ratio_to_target": round(timing_rtb["err_p99_ms"] / TARGET_P99_MS, 2),
        "loadavg_1m_before": round(load0, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    report("record", result, [
        Figure("recorded without loss, 1 KB JSON, offered rate", best, "msg/s", ">=", TARGET_RATE),
        Figure("recorded from a broker backlog", drain["drain_msgs_per_s"], "msg/s", ">=", TARGET_RATE),
        Figure("replay timing error p99", timing["err_p99_ms"], "ms", "<=", TARGET_P99_MS),
        Figure("replay --realtime timing error p99", timing_rt["err_p99_ms"], "ms", "<=", TARGET_P99_MS),
    ], variant=variant_name("quick" if args.quick else ""))


if __name__ == "__main__":
    main()
