"""The simulated DexRun on a real socket, driven by a raw client the way DDE drives the robot."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.protocol import Firmware
from services.dexter_gateway.sim import DexterSim, DexterSimConfig, move_duration


class RawClient:
    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.asm = p.ReplyAssembler()
        self.instr = 0
        self.pending: list[bytes] = []

    def send(self, oplet: str, args: list[object] | tuple[object, ...] = ()) -> None:
        self.instr += 1
        self.sock.sendall(p.build_request(oplet, args, instruction_id=self.instr).encode())  # type: ignore[arg-type]

    def recv(self, timeout: float = 5.0) -> p.Reply:
        self.sock.settimeout(timeout)
        while not self.pending:
            data = self.sock.recv(4096)
            if not data:
                raise ConnectionError("closed by the robot")
            self.pending += self.asm.feed(data)
        return p.decode_reply(self.pending.pop(0))

    def raw(self, text: str) -> p.Reply:
        self.sock.sendall(text.encode().ljust(256, b"\x00"))
        return self.recv()

    def cmd(self, oplet: str, *args: object, timeout: float = 5.0) -> p.Reply:
        self.send(oplet, args)
        r = self.recv(timeout)
        assert r.instruction_id == self.instr and r.oplet == oplet
        return r

    def read(self, target: str) -> tuple[int, bytes]:
        out = b""
        for block in range(10000):
            r = self.cmd("r", str(block), target)
            blk = p.decode_read(r)
            out += blk.payload
            if blk.error or blk.length < p.MAX_CONTENT_CHARS:
                return blk.error, out
        raise AssertionError("endless read")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sim() -> Iterator[DexterSim]:
    s = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=90, acceleration_deg_s2=900)).start()
    yield s
    s.close()


def test_status_reply_echoes_ids_and_carries_the_robot_clock(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    c.sock.sendall(b"42 7 1 undefined g;".ljust(256, b"\x00"))
    r = c.recv()
    assert (r.job_id, r.instruction_id, r.oplet, r.error) == (42, 7, "g", 0)
    assert abs(r.robot_time - time.time()) < 5
    assert r.ints[19] == p.JUNK_WORD and r.ints[38] == p.J6_ZERO_UNITS
    assert c.cmd("x").error == 1  # unknown in socket mode
    c.close()


def test_no_semicolon_means_no_reply(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    c.sock.sendall(b"1 1 1 undefined g".ljust(256, b"\x00"))
    with pytest.raises(TimeoutError):
        c.recv(timeout=0.3)
    assert sim.stats.no_delim == 1
    assert c.cmd("h").error == 0  # and the link is still served
    c.close()


def test_one_client_at_a_time(sim: DexterSim) -> None:
    a = RawClient(sim.port)
    assert a.cmd("g").error == 0
    b = RawClient(sim.port)  # connects (kernel backlog) but is not served
    b.send("g")
    with pytest.raises(TimeoutError):
        b.recv(timeout=0.3)
    a.close()
    r = b.recv(timeout=5)  # served once the first client has gone
    assert r.oplet == "g"
    b.close()


def test_idle_close() -> None:
    with DexterSim(DexterSimConfig(port=0, idle_close_s=0.3)) as sim:
        c = RawClient(sim.port)
        assert c.cmd("g").error == 0
        time.sleep(0.6)
        c.sock.settimeout(2)
        assert c.sock.recv(10) == b""  # closed by the robot
        assert sim.stats.idle_closes == 1
        c.close()


def test_missing_argument_is_what_crashes_dexrun(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    c.sock.sendall(b"1 1 1 undefined z;".ljust(256, b"\x00"))
    c.sock.settimeout(2)
    assert c.sock.recv(10) == b""
    assert sim.stats.crashes == 1
    c.close()


def test_fifo_full_withholds_the_reply_and_f_waits_for_it_to_drain() -> None:
    # 10 deg at 10 deg/s: ~1 s a move, so that a busy machine's stall between the first two commands cannot let
    # the first move end before the FIFO is seen full
    with DexterSim(DexterSimConfig(port=0, max_speed_deg_s=10, acceleration_deg_s2=10000, fifo_depth=2)) as sim:
        c = RawClient(sim.port)
        t0 = time.monotonic()
        c.cmd("a", 36000, 0, 0, 0, 0)  # 10 deg: ~1 s
        c.cmd("a", 0, 0, 0, 0, 0)
        assert sim.fifo_len() == 2
        c.cmd("a", 36000, 0, 0, 0, 0)  # the FIFO is full: no reply until the first move ends
        dur, _ = move_duration(10, 10, 10000)
        assert time.monotonic() - t0 >= dur * 0.9 and sim.stats.fifo_waits >= 1
        c.cmd("F", timeout=10)
        assert sim.fifo_len() == 0 and time.monotonic() - t0 >= 3 * dur * 0.9
        r = c.cmd("g")
        assert p.decode_status(r).joints[0].angle_arcsec == 36000
        c.close()


def test_z_delays_the_reply(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    t0 = time.monotonic()
    c.cmd("z", 200000)
    assert time.monotonic() - t0 >= 0.19
    c.close()


def test_files_keywords_and_write(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    data = bytes(range(256)) * 2 + b";%\x00end"
    for oplet, args in p.write_requests("/srv/samba/share/t.bin", data):
        assert c.cmd(oplet, *args).error == 0
    assert (sim.cwd / "t.bin").read_bytes() == data
    assert c.read("t.bin") == (0, data)  # relative to the cwd
    assert c.read("/srv/samba/share/t.bin") == (0, data)
    assert c.read("/nope")[0] == p.ENOENT
    assert c.read("/../../etc/passwd")[0] in (p.ENOENT, 13)  # nothing outside the sandbox
    err, pom = c.read("#POM")
    assert err == 0
    m = p.decode_keyword("#POM", pom.decode())
    assert len(m) == 4 and m[2][3] == pytest.approx(165100 + 320675 + 330200 + 50800, abs=1)  # straight up
    assert c.cmd("S", "EERoll", 600).error == 0 and c.raw("1 1 1 0 S Nope 1;").error == 1
    assert p.decode_status(c.cmd("g")).j6.position_units == 600
    c.close()


def test_keyword_end_differs_by_branch() -> None:
    for fw, expect_err in ((Firmware.NEWEST, p.ESPIPE), (Firmware.STABLE, 0)):
        with DexterSim(DexterSimConfig(port=0, firmware=fw)) as sim:
            c = RawClient(sim.port)
            text = sim._keyword_text("#POM")
            assert text is not None
            last = (len(text) + 61) // 62
            blocks = [p.decode_read(c.cmd("r", str(b), "#POM")) for b in range(last + 1)]
            assert b"".join(b.payload for b in blocks[:last]) == text.encode()
            assert blocks[last].error == expect_err
            if fw is Firmware.STABLE:  # stale length and data of the previous reply
                assert blocks[last].payload == blocks[last - 1].payload
            c.close()


def test_shell_trickles_until_echild(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    r0 = p.decode_read(c.cmd("r", "0", "`seq 40"))
    assert r0.error == 0
    assert p.decode_read(c.cmd("r", "0", "`echo busy")).error == p.EBUSY
    shell = p.ShellRead()
    shell.feed(r0)
    deadline = time.monotonic() + 60  # polls until the shell is done: a count of polls ran out on a busy host
    while not shell.done and time.monotonic() < deadline:
        shell.feed(p.decode_read(c.cmd("r", "1", "`")))
    assert shell.done and shell.exit_status == 0
    assert bytes(shell.output) == "".join(f"{i}\n" for i in range(1, 41)).encode()
    assert p.decode_read(c.cmd("r", "1", "`")).error == p.ECHILD
    c.close()


def test_status_mode_on_newest_only() -> None:
    with DexterSim(DexterSimConfig(port=0, firmware=Firmware.NEWEST)) as sim:
        c = RawClient(sim.port)
        r = c.cmd("g", "1")
        assert r.ints[8] == ord("1") and r.ints[6] == p.J6_ZERO_UNITS
        assert c.cmd("g").ints[8] == 0  # g without an argument resets the mode
        c.close()
    with DexterSim(DexterSimConfig(port=0, firmware=Firmware.STABLE)) as sim:
        c = RawClient(sim.port)
        assert c.cmd("g", "1").ints[8] == 0
        c.close()


def test_faults_split_coalesce_garbage_errors(sim: DexterSim) -> None:
    c = RawClient(sim.port)
    sim.split_replies(1, pieces=5)
    assert c.cmd("h").error == 0
    sim.coalesce_replies(1)
    c.send("h")
    first = c.recv()
    assert first.instruction_id == c.instr
    assert c.recv().instruction_id == c.instr  # the unsolicited copy, in the same segment
    sim.error_next(p.ERR_MONITOR | 1)
    e = p.decode_error(c.cmd("h").error)
    assert e.code == 1 and "monitor" in e.flags
    sim.error_next(1, oplet="h")  # aimed at one oplet: other replies pass it by
    assert c.cmd("g").error == 0 and c.cmd("h").error == 1 and c.cmd("h").error == 0
    sim.garbage(b"xyz")
    c.send("h")
    with pytest.raises(p.ProtocolError):
        c.recv()
    c.close()


def test_hang_answers_nothing_until_resume_then_serves_the_backlog_in_order(sim: DexterSim) -> None:
    """As a SIGSTOPped DexRun: the kernel still completes a second client's connect into the backlog; after
    `resume` the client in hand gets its reply, and once it closes, the next one in the backlog is served."""
    first = RawClient(sim.port)
    assert first.cmd("g").oplet == "g"
    sim.hang()
    first.send("h")
    with pytest.raises(TimeoutError):
        first.recv(timeout=0.5)
    second = RawClient(sim.port)  # completes in the backlog, as on the robot
    second.send("g")
    sim.resume()
    assert first.recv().oplet == "h"
    first.close()
    assert second.recv().oplet == "g" and sim.stats.connections == 2
    second.close()
