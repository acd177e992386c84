"""The master's rule for a slave that does not answer at its station address (an outage seen on a busy host: SOEM's
recover sent to a slow, healthy bridge left it without its address). Pure: the AL state reads are
stubbed, no NIC; what is checked is whether the master acts (calls the slave's recover)."""

from __future__ import annotations

import time
from typing import Any

import pysoem

from services.ethercat_loop.protocol import PROTOCOLS
from services.ethercat_loop.transport import master as master_module
from services.ethercat_loop.transport.master import EthercatMaster, HandIdentity, MasterConfig, RecoveryPolicy, _Bus


class _Slave:
    def __init__(self, name: str) -> None:
        self.name = name
        self.recovers = 0

    def recover(self, _timeout_us: int) -> int:
        self.recovers += 1
        return 0  # still not answering


def _master(silent_confirm_ns: int) -> tuple[EthercatMaster, _Slave]:
    m = EthercatMaster(MasterConfig("none", recovery=RecoveryPolicy(silent_confirm_ns=silent_confirm_ns)))
    bridge, palm = _Slave("bridge"), _Slave("palm")
    ident = HandIdentity(0x530, 6, 0, 1, "0220", "palm", 2, 1, "sii", 70, 232, 3, ("bridge", "palm"))
    m._bus = _Bus(master=None, palm=palm, info=PROTOCOLS["0220"], ident=ident, slaves=[bridge, palm])
    # the bridge's AL state read gets no answer in time; the palm answers OP
    m._read_states = lambda _bus, _give_up: [(pysoem.NONE_STATE, 0), (pysoem.OP_STATE, 0)]  # type: ignore[method-assign,assignment]
    return m, bridge


def _checks(m: EthercatMaster, n: int) -> list[str]:
    return [m.check_states() for _ in range(n)]


def test_a_silent_read_while_the_frames_come_back_whole_is_no_evidence() -> None:
    m, bridge = _master(silent_confirm_ns=0)
    m.counters.bad_run = 0  # the last frame had the full working counter: every slave processed it
    assert _checks(m, 6) == [""] * 6
    assert bridge.recovers == 0 and m.counters.recoveries == 0 and m.counters.left_op == 0


def test_a_silent_slave_is_recovered_only_after_the_silence_lasted() -> None:
    m, bridge = _master(silent_confirm_ns=10**12)  # longer than the test: one host stall
    m.counters.bad_run = 5  # frames lost too
    _checks(m, 6)
    assert bridge.recovers == 0
    m, bridge = _master(silent_confirm_ns=0)
    m.counters.bad_run = 5
    issues = _checks(m, 3)
    assert bridge.recovers == 1 and "slave 1 bridge in NONE" in issues[-1]


class _Clock:
    """CLOCK_MONOTONIC for the master, moved by hand: the waits below take their time without sleeping."""

    def __init__(self) -> None:
        self.t = 10**12

    def monotonic_ns(self) -> int:
        return self.t

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class _HungSlave(_Slave):
    """A slave that answers nothing: each read waits its whole timeout, then pysoem raises."""

    def __init__(self, name: str, clock: _Clock) -> None:
        super().__init__(name)
        self.clock = clock
        self.waits: list[int] = []

    def _fprd(self, _register: int, _length: int, wait_us: int) -> bytes:
        self.waits.append(wait_us)
        self.clock.t += wait_us * 1000
        raise pysoem.WkcError


def test_a_hung_hand_is_confirmed_although_its_frame_in_flight_is_never_answered(monkeypatch: Any) -> None:
    """The cycle's state check runs after the period's frame left; on a hung hand that frame is never answered, and
    waiting for it to the check's own limit left the AL state reads too little time to count as evidence (less than
    `late_us`): every check was 'no evidence', the slave never confirmed gone, the ladder never ran and the palm
    stayed `silent` for ever instead of `lost`. While no valid data flow, the reply in flight is waited for only
    until the reads can each still wait `late_us`."""
    clock = _Clock()
    monkeypatch.setattr(master_module, "time", clock)
    m = EthercatMaster(MasterConfig("none", recovery=RecoveryPolicy(silent_confirm_ns=0)))
    bridge, palm = _HungSlave("bridge", clock), _HungSlave("palm", clock)
    ident = HandIdentity(0x530, 6, 0, 1, "0220", "palm", 2, 1, "sii", 70, 232, 3, ("bridge", "palm"))
    m._bus = _Bus(master=None, palm=palm, info=PROTOCOLS["0220"], ident=ident, slaves=[bridge, palm])
    m.counters.bad_run = 50  # the hand stopped answering 50 frames ago

    def frame_never_answered(give_up_ns: int | None = None) -> None:  # the frame in flight: waited for, lost
        assert give_up_ns is not None
        clock.t = max(clock.t, give_up_ns)

    m.settle = frame_never_answered  # type: ignore[method-assign]
    period = 1_000_000
    for _ in range(3):  # the cycle's check: 100 µs into the period, bounded 100 µs before the next release
        clock.t += 100_000
        m.check_states(clock.t + period - 200_000)
    assert bridge.waits and min(bridge.waits) >= m.cfg.late_us, bridge.waits
    assert bridge.recovers == 1 and "slave 1 bridge in NONE" in m.counters.state_issue


def test_the_ladder_waits_for_a_slave_known_not_to_answer_when_its_read_is_cut_short() -> None:
    """After a power cycle the bridge is given its address back first and answers in INIT while the palm still has
    none: the INIT -> OP ladder (written to every slave's address) cannot work before the palm is found. A palm read
    cut short at one check is no news that it answers: the ladder waits for it (it started, its writes were not
    taken by the palm, and the slave was 'looked for' again and again until a re-scan)."""
    m = EthercatMaster(MasterConfig("none", recovery=RecoveryPolicy(silent_confirm_ns=10**12)))
    bridge, palm = _Slave("bridge"), _Slave("palm")
    ident = HandIdentity(0x530, 6, 0, 1, "0220", "palm", 2, 1, "sii", 70, 232, 3, ("bridge", "palm"))
    m._bus = _Bus(master=None, palm=palm, info=PROTOCOLS["0220"], ident=ident, slaves=[bridge, palm])
    m.counters.bad_run = 40
    init: tuple[int, int] | None = (pysoem.INIT_STATE, 0)
    none: tuple[int, int] | None = (pysoem.NONE_STATE, 0)
    reads = iter([[init, none], [init, none], [init, None], [init, None], [init, None]])
    m._read_states = lambda _bus, _give_up: next(reads)  # type: ignore[method-assign,assignment]
    issues = [m.check_states() for _ in range(3)]  # the third: the palm's read cut short
    assert m.counters.escalations == 0 and m.recovery.escalation is None, issues
    assert "slave 1 bridge in INIT" in issues[-1]
