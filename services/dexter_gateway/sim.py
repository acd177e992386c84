"""A simulated Dexter: a DexRun TCP server that behaves like the firmware on the wire (docs/reference/dexter.md
§1-§7, §11.5).

Built the way DexRun's `StartServerSocketDDE` is: one server thread, `listen` → `accept` → a blocking
`recv` loop → `close` → `accept` again. So, as on the robot:

* one client at a time: a second connection completes in the kernel backlog and waits, unserved;
* every `recv` of up to 256 bytes is one command (no framing); no `;` in it → no reply at all (error 2
  is set and lost, §1);
* a connection that sends nothing for `idle_close_s` (DexRun: 30 s `SO_RCVTIMEO`) is closed; time spent
  executing a command does not count;
* every reply is 240 bytes: the job / instruction ids echoed, the robot clock in ints 2-3, the oplet,
  the error, then the standard status (§3.2) or an `r` payload over the stale bytes of the previous reply;
* a 16-deep motion FIFO with trapezoidal timing from the `S` MaxSpeed / Acceleration parameters: a
  move that finds it full gets no reply until a slot frees; `F` replies when it has drained; `z` delays
  the reply (usleep in the socket thread);
* `r` reads files below a sandbox folder (the robot's `/`, cwd `/srv/samba/share`), the #keywords and a
  *simulated* shell (a few built-in commands; nothing runs on the host); `W` writes into the sandbox;
* `S` parameters are stored (unknown → error 1), `S RunFile` executes a file of oplets.

Both firmware branches: `firmware="stable"` or `"newest"` switches status modes, `C`/`D`, ESPIPE at
the end of a #keyword (stable serves stale bytes instead), and whole-line vs first-word shell commands.
Faults are injectable from tests (`drop_replies`, `delay_replies`, `split_replies`, `coalesce_replies`,
`garbage`, `error_next`, `disconnect`, and `hang` / `resume`: the firmware stuck, its sockets open, as a
SIGSTOPped DexRun). A request DexRun would crash on (a missing argument) is
counted in `stats.crashes` and the connection is dropped, as the real process would die.

The bus stop (bench/stop.py): DexRun has no stop oplet, so there are no stop bytes to stamp. Once asked to watch
(`watch_stop()`, or `--watch-stop` on the command line, re-armed by SIGHUP), the simulator stamps instead the first
request that moves the arm (`protocol.moves`) it receives, which a stopped gateway must never send, and counts what
arrives; `--watch-stop` prints each as one JSON line on stdout (`{"event": "watching" | "motion", ...}`).

    python -m services.dexter_gateway.sim --port 50000 --root /tmp/dexter-fs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.dexter_gateway import protocol as p
from services.dexter_gateway.protocol import Firmware

log = logging.getLogger("robobus.dexter.sim")

YEAR_S = 60 * 60 * 24 * 7 * 52  # DexRun's "about 1 year" for setting its clock from a request (§2)
HOME_CWD = "srv/samba/share"
DEFAULT_LINKS_UM = (165100, 320675, 330200, 50800, 82550)  # L1..L5 (DDE's defaults, metres × 1e6)


class _Crash(Exception):
    """What would kill DexRun (atoi(NULL) on a missing argument)."""


@dataclass
class DexterSimConfig:
    port: int = p.DEXRUN_PORT
    host: str = "127.0.0.1"
    firmware: Firmware = Firmware.NEWEST
    root: Path | None = None  # the robot's "/"; a temporary folder when None
    idle_close_s: float = 30.0
    max_speed_deg_s: float = 30.0
    acceleration_deg_s2: float = 100.0
    fifo_depth: int = 16
    shell_trickle_s: float = 0.01  # the simulated shell's output arrives 16 bytes per this interval
    firmware_mismatch: bool = False  # OR bit 10 into every reply (§6)


@dataclass
class DexterSimStats:
    connections: int = 0
    commands: int = 0
    replies: int = 0
    idle_closes: int = 0
    no_delim: int = 0
    crashes: int = 0
    write_without_open: int = 0
    fifo_waits: int = 0
    log: deque[str] = field(default_factory=lambda: deque(maxlen=200))


STOP_BYTES_NOTE = "DexRun has no stop oplet: no stop bytes; a motion request after the stop is what must not come"


@dataclass
class StopWatch:
    """What the simulator received since it was asked to watch for the bus stop (`DexterSim.watch_stop`)."""
    armed_unix: float
    armed_monotonic: float
    commands: int = 0  # requests received since
    motion: int = 0  # of them, requests that move the arm
    first_motion: dict[str, Any] | None = None  # the first: {"unix", "monotonic", "request"}

    def report(self) -> dict[str, Any]:
        return {"armed_unix": self.armed_unix, "armed_monotonic": self.armed_monotonic, "stop_bytes": None,
                "note": STOP_BYTES_NOTE, "commands": self.commands, "motion": self.motion,
                "first_motion": self.first_motion}


@dataclass
class _Move:
    t0: float
    t1: float
    start: list[float]  # arcsec
    goal: list[float]
    accel_frac: float  # fraction of the duration spent accelerating (trapezoid)

    def at(self, t: float) -> list[float]:
        if t >= self.t1 or self.t1 <= self.t0:
            return list(self.goal)
        u = (t - self.t0) / (self.t1 - self.t0)
        s = _trapezoid(u, self.accel_frac)
        return [a + (b - a) * s for a, b in zip(self.start, self.goal, strict=True)]


def _trapezoid(u: float, f: float) -> float:
    """Normalised position of a trapezoidal velocity profile (f = accel share of the time, ≤ 0.5)."""
    u = min(max(u, 0.0), 1.0)
    if f <= 0:
        return u
    vmax = 1.0 / (1.0 - f)
    if u < f:
        return 0.5 * vmax / f * u * u
    if u <= 1 - f:
        return 0.5 * vmax * f + vmax * (u - f)
    r = 1 - u
    return 1.0 - 0.5 * vmax / f * r * r


def move_duration(dist_deg: float, vmax: float, accel: float) -> tuple[float, float]:
    """(duration s, accel fraction) of a trapezoid over the largest joint distance."""
    if dist_deg <= 0:
        return 0.0, 0.0
    if dist_deg <= vmax * vmax / accel:  # triangle: never reaches vmax
        t = 2 * math.sqrt(dist_deg / accel)
        return t, 0.5
    t = dist_deg / vmax + vmax / accel
    return t, (vmax / accel) / t


def atoi(tok: str | None) -> int:
    """C atoi: leading sign and digits, 0 otherwise. None is what strtok gives for a missing argument."""
    if tok is None:
        raise _Crash("atoi(NULL)")
    s = tok.strip()
    i = 1 if s[:1] in "+-" else 0
    while i < len(s) and s[i].isdigit():
        i += 1
    try:
        return int(s[:i])
    except ValueError:
        return 0


def atof(tok: str | None) -> float:
    if tok is None:
        raise _Crash("atof(NULL)")
    try:
        return float(tok)
    except ValueError:
        return float("nan") if tok.lower().startswith("nan") else float(atoi(tok))


@dataclass
class _Shell:
    output: bytes
    t0: float
    trickle_s: float
    status: int
    pos: int = 0

    def available(self, now: float) -> int:
        if self.trickle_s <= 0:
            return len(self.output)
        return min(len(self.output), int((now - self.t0) / self.trickle_s) * 16)


class DexterSim:
    """One simulated arm on one TCP port. `start()`, `close()`; faults and state for tests."""

    def __init__(self, config: DexterSimConfig | None = None) -> None:
        self.config = config or DexterSimConfig()
        self.firmware = Firmware(self.config.firmware)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.config.root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dexter-sim-")
            self.root = Path(self._tmp.name)
        else:
            self.root = Path(self.config.root)
        (self.root / HOME_CWD).mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        self.stats = DexterSimStats()
        self.lock = threading.RLock()
        self.params: dict[str, list[float]] = {
            "MaxSpeed": [self.config.max_speed_deg_s * p.NBITS_PER_DEG_S],
            "Acceleration": [self.config.acceleration_deg_s2 * p.NBITS_PER_DEG_S],
            "LinkLengths": [float(v) for v in reversed(DEFAULT_LINKS_UM)],  # Link 5 first (§4)
        }
        self.boundaries = [(648000.0, -648000.0)] * 5  # ±180 deg in arcsec
        self.registers: dict[int, int] = {}
        self.status_mode = "0"
        self.io_in = 0
        self.pid = [0.0] * 5
        self.servo = {"j6": p.J6_ZERO_UNITS, "j7": 0}
        self.queue: deque[_Move] = deque()
        self._pos = [0.0] * 5  # arcsec where the last queued move ends
        self._clock_offset = 0.0
        self._write_fh: Any = None
        self._keyword: tuple[str, bytes] | None = None
        self._shell: _Shell | None = None
        self._shell_finished = False
        self._last = bytearray(p.REPLY_BYTES)
        # faults
        self._drop = 0
        self._delay: tuple[float, int] = (0.0, 0)
        self._drop_oplet = self._delay_oplet = 0  # aimed at one oplet's code, 0 for any command (error_next)
        self._split: tuple[int, int, float] = (0, 0, 0.0)
        self._coalesce = 0
        self._garbage = b""
        self._errors: deque[tuple[int, int]] = deque()  # (error bits, oplet's code or 0 for any reply)
        self._running = threading.Event()  # cleared: hung (nothing accepted, read or answered)
        self._watch: StopWatch | None = None
        self.on_watch: Any = None  # called with each watch event's dict (the CLI prints it)
        self._running.set()
        # sockets
        self._lsock: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.port = self.config.port

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> DexterSim:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.config.host, self.config.port))
        s.listen(10)  # DexRun: listen(fd, 10)
        s.settimeout(0.2)
        self._lsock = s
        self.port = s.getsockname()[1]
        self._thread = threading.Thread(target=self._serve_forever, name=f"dexter-sim-{self.port}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self.disconnect()
        if self._thread is not None:
            self._thread.join(5)
        if self._lsock is not None:
            self._lsock.close()
        if self._write_fh is not None:
            self._write_fh.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> DexterSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults ------------------------------------------------------------------------------------
    def drop_replies(self, n: int = 1, oplet: str | None = None) -> None:
        """The next n commands (to `oplet` only, if given) get no reply (as DexRun without a ';', or a lost
        robot)."""
        with self.lock:
            self._drop, self._drop_oplet = n, ord(oplet) if oplet else 0

    def delay_replies(self, seconds: float, n: int = 1, oplet: str | None = None) -> None:
        """The next n replies (to `oplet` only, if given) leave `seconds` late."""
        with self.lock:
            self._delay, self._delay_oplet = (seconds, n), ord(oplet) if oplet else 0

    def split_replies(self, n: int = 1, pieces: int = 3, gap_s: float = 0.005) -> None:
        """The next n replies leave in `pieces` TCP segments with gaps between them."""
        with self.lock:
            self._split = (n, pieces, gap_s)

    def coalesce_replies(self, n: int = 1) -> None:
        """The next n replies leave in one segment together with an unsolicited copy."""
        with self.lock:
            self._coalesce = n

    def garbage(self, data: bytes) -> None:
        """Bytes sent in front of the next reply: the stream is out of step from then on."""
        with self.lock:
            self._garbage = data

    def error_next(self, value: int, n: int = 1, oplet: str | None = None) -> None:
        """OR `value` into the error word of the next `n` replies, or, with `oplet`, of the next `n` replies to
        that oplet (a client that polls `g` in the background would otherwise take the injection meant for a
        command); injections apply in the order given."""
        with self.lock:
            self._errors.extend([(value, ord(oplet) if oplet else 0)] * n)

    def hang(self) -> None:
        """DexRun stops (a hung process, SIGSTOP): its sockets stay open, the kernel still completes new
        connections into the listen backlog and buffers what arrives, but nothing is accepted, read or answered
        until `resume()`; then it goes on where it stopped (the command in hand, then the backlog in order)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def _wait_running(self) -> bool:
        """While hung: wait. False when the simulator closes meanwhile."""
        while not self._running.wait(0.1):
            if self._closed.is_set():
                return False
        return not self._closed.is_set()

    def disconnect(self) -> None:
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # -- the bus stop's watch (bench/stop.py) --------------------------------------------------------
    def watch_stop(self) -> dict[str, Any]:
        """Start (or restart) watching: from now on the first request that moves the arm is stamped."""
        with self.lock:
            self._watch = StopWatch(time.time(), time.monotonic())
            event = {"event": "watching", **self._watch.report()}
        if self.on_watch is not None:
            self.on_watch(event)
        return event

    def stop_watch(self) -> dict[str, Any] | None:
        """What the watch saw so far (None: not watching)."""
        with self.lock:
            return None if self._watch is None else self._watch.report()

    def _watched(self, text: str, oplet: str, cmd: str, unix: float, mono: float) -> None:
        toks = [t for t in cmd[1:].replace(",", " ").split(" ") if t]
        event = None
        with self.lock:
            w = self._watch
            if w is None:
                return
            w.commands += 1
            if not p.moves(oplet, toks):
                return
            w.motion += 1
            if w.first_motion is None:
                w.first_motion = {"unix": unix, "monotonic": mono, "request": text}
                event = {"event": "motion", **w.first_motion}
        if event is not None and self.on_watch is not None:
            self.on_watch(event)

    # -- state for tests -------------------------------------------------------------------------
    def angles_arcsec(self, now: float | None = None) -> list[float]:
        with self.lock:
            t = time.monotonic() if now is None else now
            self._prune(t)
            return self.queue[0].at(t) if self.queue else list(self._pos)

    def fifo_len(self) -> int:
        with self.lock:
            self._prune(time.monotonic())
            return len(self.queue)

    @property
    def cwd(self) -> Path:
        return self.root / HOME_CWD

    # -- server --------------------------------------------------------------------------------
    def _serve_forever(self) -> None:
        assert self._lsock is not None
        while self._wait_running():
            try:
                conn, _ = self._lsock.accept()
            except (TimeoutError, OSError):
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.config.idle_close_s)  # SO_RCVTIMEO, cloned from the listener
            self._conn = conn
            self.stats.connections += 1
            try:
                self._serve(conn)
            finally:
                self._conn = None
                with contextlib.suppress(OSError):
                    conn.close()

    def _serve(self, conn: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                data = conn.recv(256)
            except TimeoutError:
                self.stats.idle_closes += 1  # recv = -1 (EAGAIN) ends the loop; DexRun closes
                log.info("idle close", extra={"after_s": self.config.idle_close_s})
                return
            except OSError:
                return
            if not data or not self._wait_running():
                return
            try:
                reply = self.handle(data)
            except _Crash as exc:
                self.stats.crashes += 1
                log.warning("DexRun would crash here", extra={"why": str(exc)})
                return
            if reply is None:
                continue
            if not self._send(conn, reply):
                return

    def _send(self, conn: socket.socket, reply: bytes) -> bool:
        with self.lock:
            delay = 0.0
            if self._delay[1] > 0 and self._delay_oplet in (0, reply[16]):  # int 4: the oplet
                delay = self._delay[0]
                self._delay = (self._delay[0], self._delay[1] - 1)
            split = 0
            gap = 0.0
            if self._split[0] > 0:
                split, gap = self._split[1], self._split[2]
                self._split = (self._split[0] - 1, self._split[1], self._split[2])
            extra = b""
            if self._coalesce > 0:
                self._coalesce -= 1
                extra = reply
            junk, self._garbage = self._garbage, b""
        if delay:
            time.sleep(delay)
        out = junk + reply + extra
        try:
            if split > 1:
                step = max(1, len(out) // split)
                for i in range(0, len(out), step):
                    conn.sendall(out[i:i + step])
                    time.sleep(gap)
            else:
                conn.sendall(out)
        except OSError:
            return False
        self.stats.replies += 1
        return True

    # -- one command (the recv buffer) -------------------------------------------------------------
    def handle(self, data: bytes) -> bytes | None:
        """One recv buffer -> the reply bytes, or None when DexRun sends none."""
        unix, mono = time.time(), time.monotonic()
        self.stats.commands += 1
        head = data[:255]
        end = head.find(b";")
        if end < 0:
            self.stats.no_delim += 1  # "No delim": DexError = 2, and no reply at all
            return None
        text = head[:end].split(b"\x00", 1)[0].decode("latin-1")
        self.stats.log.append(text)
        parts = text.split(" ", 4)  # the header counts literal spaces only
        while len(parts) < 5:
            parts.append("")
        job, instr, start, _end, cmd = parts
        if self._watch is not None:
            self._watched(text, cmd[:1], cmd, unix, mono)
        with self.lock:
            if self._drop > 0 and self._drop_oplet in (0, ord(cmd[:1] or "\x00")):
                self._drop -= 1
                return None
        self._maybe_set_clock(start)
        oplet = cmd[:1] or "\x00"
        base = [atoi(job) if job else 0, atoi(instr) if instr else 0, 0, 0, ord(oplet) if oplet != "\x00" else 0, 0]
        if oplet == "r":
            err, payload = self._read(cmd)
            if err is None:  # `r 0 \`reboot`: no reply, the robot goes away
                raise _Crash("reboot")
            return self._finish_read(base, err, payload)
        error = self._execute(oplet, cmd)
        return self._finish_status(base, error)

    def _maybe_set_clock(self, start: str) -> None:
        with contextlib.suppress(ValueError):
            s = float(start) / 1000.0
            if s > time.time() + self._clock_offset + YEAR_S:
                self._clock_offset = s - time.time()

    def _clock(self) -> tuple[int, int]:
        t = time.time() + self._clock_offset
        return int(t), int((t % 1) * 1e6)

    def _stamp(self, base: list[int], error: int) -> None:
        base[2], base[3] = self._clock()
        with self.lock:
            if self._errors and self._errors[0][1] in (0, base[4]):
                error |= self._errors.popleft()[0]
        if self.config.firmware_mismatch:
            error |= p.ERR_FIRMWARE_MISMATCH
        base[5] = error

    def _finish_status(self, base: list[int], error: int) -> bytes:
        self._stamp(base, error)
        ints = base + self._status_ints()
        data = p.encode_reply(ints)
        self._last = bytearray(data)
        return data

    def _finish_read(self, base: list[int], error: int, payload: bytes | None) -> bytes:
        self._stamp(base, error)
        buf = self._last
        if payload is None:  # stable: stale length and data from the previous reply
            stale_len = int.from_bytes(buf[24:28], "little", signed=True)
            payload = bytes(buf[p.PAYLOAD_START:p.PAYLOAD_START + max(0, min(stale_len, p.MAX_CONTENT_CHARS))])
        data = bytearray(buf)
        data[0:24] = p.encode_reply(base + [0] * 54)[0:24]
        data[24:28] = len(payload).to_bytes(4, "little", signed=True)
        data[p.PAYLOAD_START:p.PAYLOAD_START + len(payload)] = payload
        self._last = data
        return bytes(data)

    def _status_ints(self) -> list[int]:
        """ints 6..59 of the standard status (§3.2), or the newest branch's g≠0 variant (§3.3)."""
        now = time.monotonic()
        at = self.angles_arcsec(now)
        v = [0] * 54  # index i here is int i+6

        def put(i: int, val: float) -> None:
            v[i - 6] = round(val)

        put(6, 0)
        put(7, 0)
        put(8, 0)
        put(9, self.io_in)
        mode = self.status_mode if self.firmware is Firmware.NEWEST else "0"
        for j, b in enumerate(p.JOINT_BASE):
            scale = p.DELTA_SCALE[j]
            put(b, at[j])
            put(b + 1, 0)
            put(b + 2, self.pid[j] * scale)
            put(b + 3, 0)
            put(b + 4, 2048 + 1000 * math.sin(math.radians(at[j] / 3600)))
            put(b + 5, 2048 + 1000 * math.cos(math.radians(at[j] / 3600)))
            put(b + 6, at[j] + self.pid[j])
            put(b + 7, at[j] if mode != "0" else at[j] / 3.2)  # raw steps in g0; step angles (arcsec) in g≠0
            put(b + 9, p.JUNK_WORD)
        if mode == "0":
            put(18, self.servo["j7"])  # servo ID 1 present position
            put(28, 0)
            put(38, self.servo["j6"])  # servo ID 3 present position
            put(48, 0)
            put(58, 0)
        else:
            put(6, self.servo["j6"])  # (load << 16) + position, load 0
            put(7, self.servo["j7"])
            put(8, ord(mode))
        return v

    # -- oplets ------------------------------------------------------------------------------------
    def _execute(self, oplet: str, cmd: str) -> int:
        toks = [t for t in cmd[1:].replace(",", " ").split(" ") if t]  # strtok(" ,") after the oplet

        def arg(i: int) -> str | None:
            return toks[i] if i < len(toks) else None

        if oplet in "aR":
            goal = [float(atoi(arg(i))) for i in range(5)]
            if oplet == "R":
                goal = [a + b for a, b in zip(self._pos, goal, strict=True)]
            self._servo_args(toks[5:7])
            self._queue_move(goal)
            return 0
        if oplet == "P":
            self.pid = [float(atoi(arg(i))) for i in range(5)]
            self._servo_args(toks[5:7])
            return 0
        if oplet in "MTCD":
            if oplet in "CD" and self.firmware is Firmware.STABLE:
                return 1
            vals = [atof(arg(i)) for i in range(9)]
            joints = self._ik(vals[0:3])
            if joints is None:
                return 1  # unreachable (the sim's simplification of DexRun's IK failure)
            self._queue_move(joints)
            return 0
        if oplet == "F":
            self._wait_fifo_flush()
            return 0
        if oplet == "g":
            if self.firmware is Firmware.NEWEST:
                self.status_mode = toks[0][0] if toks else "0"
            return 0
        if oplet in "hG":
            return 0
        if oplet == "z":
            us = atoi(arg(0))
            time.sleep(max(us, 0) / 1e6)
            return 0
        if oplet == "S":
            return self._set_param(toks)
        if oplet == "w":
            addr, value = atoi(arg(0)), atoi(arg(1))
            self._wait_fifo_flush()
            self.registers[addr] = value
            return 0
        if oplet == "W":
            self._write(cmd)
            return 0
        if oplet == "B":
            vals = [float(atoi(arg(i))) for i in range(10)]
            self.boundaries = [(vals[2 * j], vals[2 * j + 1]) for j in range(5)]
            return 0
        return 1  # unknown oplet, `x`, empty command

    def _servo_args(self, toks: list[str]) -> None:
        for name, tok in zip(("j6", "j7"), toks, strict=False):
            if not tok.lower().startswith("n"):  # NaN skips it
                self.servo[name] = atoi(tok)

    def _prune(self, t: float) -> None:
        while self.queue and self.queue[0].t1 <= t:
            self.queue.popleft()

    def _queue_move(self, goal: list[float]) -> None:
        goal = [min(max(g, lo), hi) for g, (hi, lo) in zip(goal, self.boundaries, strict=True)]  # CheckBoundry
        while True:
            with self.lock:
                now = time.monotonic()
                self._prune(now)
                if len(self.queue) < self.config.fifo_depth:
                    break
                wait = self.queue[0].t1 - now
            self.stats.fifo_waits += 1
            time.sleep(max(wait, 0.0005))  # DexRun busy-waits on CMD_FIFO_STATE: no reply meanwhile
        with self.lock:
            vmax = self.params.get("MaxSpeed", [0.0])[0] / p.NBITS_PER_DEG_S or self.config.max_speed_deg_s
            acc = self.params.get("Acceleration", [0.0])[0] / p.NBITS_PER_DEG_S or self.config.acceleration_deg_s2
            dist = max(abs(a - b) for a, b in zip(goal, self._pos, strict=True)) / 3600.0
            dur, frac = move_duration(dist, vmax, acc)
            t0 = max(now, self.queue[-1].t1 if self.queue else now)
            self.queue.append(_Move(t0, t0 + dur, list(self._pos), goal, frac))
            self._pos = goal

    def _wait_fifo_flush(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self._prune(now)
                if not self.queue:
                    return
                wait = self.queue[-1].t1 - now
            time.sleep(max(wait, 0.0005))

    def _links_um(self) -> list[float]:
        return list(reversed(self.params.get("LinkLengths", [float(v) for v in reversed(DEFAULT_LINKS_UM)])))

    def pom(self, at: list[float], tip: bool = False) -> list[list[float]]:
        """Forward kinematics of a simple Dexter model: J1 about z; J2, J3, J4 pitch in the arm's plane
        (0 = straight up); point 4 (above J5), or point 5 (the Link-5 tip) for `#POM 5`."""
        l1, l2, l3, l4, l5 = self._links_um()
        j1, j2, j3, j4, j5 = (math.radians(a / 3600.0) for a in at)
        a2, a3, a4 = j2, j2 + j3, j2 + j3 + j4
        r = l2 * math.sin(a2) + l3 * math.sin(a3) + l4 * math.sin(a4)
        z = l1 + l2 * math.cos(a2) + l3 * math.cos(a3) + l4 * math.cos(a4)
        if tip:
            r += l5 * math.sin(a4 + math.pi / 2)
            z += l5 * math.cos(a4 + math.pi / 2)
        x, y = -r * math.sin(j1), r * math.cos(j1)
        # orientation: z axis along link 4, rotated by J5 about it (a direction cosine matrix)
        zx, zy, zz = -math.sin(a4) * math.sin(j1), math.sin(a4) * math.cos(j1), math.cos(a4)
        xx, xy, xz = math.cos(j1) * math.cos(j5), math.sin(j1) * math.cos(j5), math.sin(j5)
        yx, yy, yz = zy * xz - zz * xy, zz * xx - zx * xz, zx * xy - zy * xx
        return [[xx, yx, zx, x], [xy, yy, zy, y], [xz, yz, zz, z], [0.0, 0.0, 0.0, 1.0]]

    def _ik(self, xyz: list[float]) -> list[float] | None:
        """Inverse of `pom` for a wrist pointing straight down (the sim ignores M's direction and config)."""
        l1, l2, l3, l4, _ = self._links_um()
        x, y, z = xyz
        j1 = math.atan2(-x, y) if (x or y) else 0.0
        r = math.hypot(x, y)
        h = z + l4 - l1  # the wrist point is L4 above the target
        d2 = r * r + h * h
        c3 = (d2 - l2 * l2 - l3 * l3) / (2 * l2 * l3)
        if not -1.0 <= c3 <= 1.0:
            return None
        j3 = math.acos(c3)
        j2 = math.atan2(r, h) - math.atan2(l3 * math.sin(j3), l2 + l3 * math.cos(j3))
        j4 = math.pi - j2 - j3
        return [math.degrees(a) * 3600.0 for a in (j1, j2, j3, j4, 0.0)]

    def _set_param(self, toks: list[str]) -> int:
        if not toks:
            raise _Crash("S without a name")
        name = toks[0]
        if name.isdigit():
            i = int(name)
            if i >= len(p.PARAM_NAMES):
                return 1
            name = p.PARAM_NAMES[i]
        if name not in p.PARAM_NAMES:
            return 1
        if name == "RunFile":
            return self._run_file(toks[1] if len(toks) > 1 else "")
        if len(toks) < 2:
            raise _Crash("S without a value")
        self.params[name] = [atof(t) for t in toks[1:6]]
        if name == "EERoll":
            self.servo["j6"] = atoi(toks[1])
        elif name == "EESpan":
            self.servo["j7"] = atoi(toks[1])
        return 0

    def _run_file(self, path: str) -> int:
        f = self.resolve(path)
        if f is None:
            return 13
        try:
            text = f.read_text(encoding="latin-1")
        except FileNotFoundError:
            return p.ENOENT
        except OSError as exc:
            return exc.errno or 5
        for stmt in text.split(";"):
            stmt = stmt.strip()
            if not stmt or stmt.startswith("//"):
                continue
            if stmt[0] == "r":
                continue  # a file of oplets reads nothing back
            self._execute(stmt[0], stmt)
        return 0

    # -- files ---------------------------------------------------------------------------------------
    def resolve(self, path: str) -> Path | None:
        """A robot path inside the sandbox (absolute from the robot's /, relative from its cwd)."""
        base = self.root if path.startswith("/") else self.cwd
        f = (base / path.lstrip("/")).resolve()
        if f != self.root and self.root not in f.parents:
            return None
        return f

    def _write(self, cmd: str) -> None:
        parts = cmd.split(" ", 3)  # W <sub> <n|0> <data|path>
        sub = parts[1] if len(parts) > 1 else ""
        if sub == "f":
            if self._write_fh is not None:
                self._write_fh.close()
            f = self.resolve(parts[3].split(" ")[0].split(",")[0] if len(parts) > 3 else "")
            self._write_fh = None
            if f is not None:
                with contextlib.suppress(OSError):  # fopen errors are not reported (§4.2)
                    f.parent.mkdir(parents=True, exist_ok=True)
                    self._write_fh = open(f, "wb")  # noqa: SIM115 - held across commands, like DexRun
            return
        if sub not in ("m", "s", "e"):
            return
        n = atoi(parts[2] if len(parts) > 2 else None)
        data = (parts[3] if len(parts) > 3 else "")[:n]
        try:
            raw = p.unescape(data.encode("latin-1"))
        except p.ProtocolError:
            raw = data.encode("latin-1")
        if self._write_fh is None:
            self.stats.write_without_open += 1  # DexRun would fwrite to a NULL handle
            return
        self._write_fh.write(raw)
        if sub == "e":
            self._write_fh.close()
            self._write_fh = None

    def _read(self, cmd: str) -> tuple[int | None, bytes | None]:
        """(error, payload) of an `r`; payload None = stale (stable); error None = no reply at all."""
        parts = cmd.split(" ", 2)
        block = atoi(parts[1] if len(parts) > 1 else None)
        if len(parts) < 3:
            raise _Crash("r without a target")
        target = parts[2]
        if target.startswith("`"):
            return self._shell_read(block, target[1:])
        if target.startswith("#"):
            return self._keyword_read(block, target)
        path = target.replace(",", " ").split(" ")[0]  # only the first word, on every branch
        f = self.resolve(path)
        if f is None:
            return 13, b""
        try:
            with open(f, "rb") as fh:  # stateless: reopen, seek, fread
                fh.seek(block * p.MAX_CONTENT_CHARS)
                return 0, fh.read(p.MAX_CONTENT_CHARS)
        except FileNotFoundError:
            return p.ENOENT, b""
        except IsADirectoryError:
            return 21, b""
        except OSError as exc:
            return exc.errno or 5, b""

    def _keyword_text(self, target: str) -> str | None:
        words = target.split()
        word = words[0]
        at = self.angles_arcsec()
        if word in ("#POM", "#XYZ"):
            tip = self.firmware is Firmware.NEWEST and len(words) > 1 and words[1] == "5"
            return "[" + ",".join("[" + ", ".join(f"{v:f}" for v in row) + "]" for row in self.pom(at, tip)) + "]"
        if word == "#measured_angles":
            return json.dumps([round(a + q) for a, q in zip(at, self.pid, strict=True)]).replace(",", ", ")
        if word == "#StepAngles":
            return json.dumps([round(a) for a in at])
        if word == "#Steps":
            return json.dumps([round(a / 3.2) for a in at])
        if word == "#EyeNumbers":
            return ", ".join(str(255 + int(a // 3600)) for a in at)
        if word == "#RawEncoders":
            return json.dumps([int(a * 100) for a in at])
        if word == "#Servo" and self.firmware is Firmware.NEWEST:
            return "FF FF FD 00 " + " ".join(f"{b:02X}" for b in self.servo["j6"].to_bytes(2, "little"))
        return None

    def _keyword_read(self, block: int, target: str) -> tuple[int, bytes | None]:
        if block == 0:
            text = self._keyword_text(target)
            if text is None:
                self._keyword = None
                # stable only logs it: stale length/data; newest: ESPIPE with 0 bytes (§3.4)
                return (0, None) if self.firmware is Firmware.STABLE else (p.ESPIPE, b"")
            self._keyword = (target, text.encode())
        if self._keyword is None:
            return (0, None) if self.firmware is Firmware.STABLE else (p.ESPIPE, b"")
        data = self._keyword[1]
        off = block * p.MAX_CONTENT_CHARS
        if off >= len(data):
            return (0, None) if self.firmware is Firmware.STABLE else (p.ESPIPE, b"")
        return 0, data[off:off + p.MAX_CONTENT_CHARS]

    def _shell_read(self, block: int, line: str) -> tuple[int | None, bytes]:
        now = time.monotonic()
        cmdline = line.strip()
        if self.firmware is Firmware.STABLE:
            cmdline = cmdline.split(" ")[0]  # stable hands only the first word to popen
        if block == 0 and cmdline:
            if self._shell is not None:
                return p.EBUSY, b""
            if cmdline.split()[0] == "reboot":
                return None, b""
            out, status = self._run_shell(cmdline)
            self._shell = _Shell(out, now, self.config.shell_trickle_s, status)
            self._shell_finished = False
        sh = self._shell
        if sh is None:
            return p.ECHILD, b""
        avail = sh.available(now)
        if sh.pos < avail:
            chunk = sh.output[sh.pos:min(avail, sh.pos + p.MAX_CONTENT_CHARS)]
            sh.pos += len(chunk)
            return 0, chunk
        if sh.pos >= len(sh.output):
            self._shell = None  # pclose: the wait status, then ECHILD for every later request
            return sh.status, b""
        return 0, b""  # still running: nothing new yet

    def _run_shell(self, cmdline: str) -> tuple[bytes, int]:
        """A few built-ins over the sandbox; nothing is executed on the host."""
        words = cmdline.split()
        cmd, args = words[0], words[1:]
        if cmd == "echo":
            return (" ".join(args) + "\n").encode(), 0
        if cmd == "pwd":
            return b"/" + HOME_CWD.encode() + b"\n", 0
        if cmd == "ls":
            d = self.resolve(args[-1]) if args and not args[-1].startswith("-") else self.cwd
            if d is None or not d.is_dir():
                return f"ls: cannot access '{args[-1] if args else ''}': No such file or directory\n".encode(), 2 << 8
            return "".join(f"{e.name}\n" for e in sorted(d.iterdir())).encode(), 0
        if cmd == "cat":
            out = b""
            for a in args:
                f = self.resolve(a)
                if f is None or not f.is_file():
                    return out + f"cat: {a}: No such file or directory\n".encode(), 1 << 8
                out += f.read_bytes()
            return out, 0
        if cmd == "uname":
            return b"Linux dexter 4.4.0-xilinx armv7l GNU/Linux\n", 0
        if cmd == "seq":
            n = atoi(args[0]) if args else 1
            return "".join(f"{i}\n" for i in range(1, n + 1)).encode(), 0
        return f"sh: 1: {cmd}: not found\n".encode(), 127 << 8


class DexterSimThread:
    """Several simulated arms in this process (tests): each on its own free port."""

    def __init__(self, count: int = 1, **kw: Any) -> None:
        self.arms = [DexterSim(DexterSimConfig(port=0, **kw)).start() for _ in range(count)]

    def close(self) -> None:
        for a in self.arms:
            a.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A simulated Dexter arm: DexRun's TCP protocol on one port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=p.DEXRUN_PORT)
    ap.add_argument("--root", type=Path, default=None, help="the robot's filesystem (a temporary folder if unset)")
    ap.add_argument("--firmware", choices=[f.value for f in Firmware], default=Firmware.NEWEST.value)
    ap.add_argument("--idle-close-s", type=float, default=30.0)
    ap.add_argument("--max-speed", type=float, default=30.0, help="deg/s")
    ap.add_argument("--watch-stop", action="store_true",
                    help="watch for the bus stop: JSON lines on stdout ({\"event\": \"watching\", ...} when armed, "
                    "then {\"event\": \"motion\", \"unix\", \"monotonic\", \"request\"} at the first request that "
                    "moves the arm: DexRun has no stop bytes); SIGHUP re-arms the watch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ROBOBUS_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    sim = DexterSim(DexterSimConfig(host=args.host, port=args.port, root=args.root, firmware=Firmware(args.firmware),
                                    idle_close_s=args.idle_close_s, max_speed_deg_s=args.max_speed)).start()
    log.info("simulated Dexter listening", extra={"port": sim.port, "root": str(sim.root)})
    print(f"dexter-sim: DexRun ({sim.firmware}) on {args.host}:{sim.port}, files in {sim.root}", flush=True)
    if args.watch_stop:
        sim.on_watch = lambda event: print(json.dumps(event), flush=True)
        # the handler before the first "watching" line: a reader may send SIGHUP as soon as it has read it (SIGHUP's
        # default action ends the process)
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=sim.watch_stop, daemon=True).start())
        sim.watch_stop()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Python runs signal handlers in the main thread only, when it runs: woken twice a second, it runs them even
    # when the kernel handed the signal to another of our threads and an untimed wait was never interrupted
    while not stop.wait(0.5):
        pass
    sim.close()


if __name__ == "__main__":
    main()
