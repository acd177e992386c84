"""The master's rule for a slave that does not answer at its station address (an outage seen on a busy host: SOEM's
recover sent to a slow, healthy bridge left it without its address). Pure: the AL state reads are
stubbed, no NIC; what is checked is whether the master acts (calls the slave's recover)."""

from __future__ import annotations

import pysoem

from services.ethercat_loop.protocol import PROTOCOLS
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
