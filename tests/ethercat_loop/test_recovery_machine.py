"""The EtherCAT recovery ladder as a pure state machine (transport/recovery.py): made-up times, made-up AL states,
made-up answers to its writes. `check` below does what `EthercatMaster.check_states` does with the machine's
answers, with the observations given instead of read from a wire."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from hypothesis import given, settings
from hypothesis import strategies as st

from services.ethercat_loop.transport.recovery import (
    ACK,
    BOOT,
    ERROR,
    INIT,
    LADDER_STATE,
    NONE,
    OP,
    PREOP,
    SAFEOP,
    Action,
    BusView,
    Do,
    Recovery,
    RecoveryPolicy,
)

MS = 1_000_000
Reads = list[tuple[int, int] | None]
BUS = BusView(("bridge", "palm"), palm=1, serial=1234, expected_wkc=3)
ALL_OP: Reads = [(OP, 0), (OP, 0)]
T0 = 1_000_000 * MS  # an arbitrary CLOCK_MONOTONIC


@dataclass
class Counters:
    """The wire counters the machine reads and updates (the master's WireCounters has these and more)."""

    bad_run: int = 0
    valid_ns: int = 0
    back_ns: int = 0
    last_wkc: int = 0
    recoveries: int = 0
    left_op: int = 0
    escalations: int = 0
    escalation_failures: int = 0
    rescans: int = 0
    state_issue: str = ""


def machine(**policy: int) -> tuple[Recovery, Counters]:
    c = Counters()
    return Recovery(RecoveryPolicy(**policy), c), c


def check(r: Recovery, now: int, reads: Reads | None = None, *, acked: bool = True,
          recover_ok: bool = False, serial: int | None = None) -> tuple[str, Action]:
    """One state check as the master runs it: the issue it answers, and the last thing the machine asked for."""
    act = r.check(now)
    if act.do is Do.WRITE_STEP:
        return r.step_written(now, acked), act
    if act.do is Do.READ_STATES:
        act = r.states(now, ALL_OP if reads is None else reads, BUS)
    if act.do is Do.RECOVER:
        return r.recovered(now, recover_ok, serial), act
    return act.issue, act


def texts(r: Recovery) -> list[str]:
    return [t for _, t in r.log]


def escalate(r: Recovery, c: Counters, now: int) -> None:
    """Valid data lost for 100 cycles while every slave claims OP: the ladder starts."""
    c.bad_run, c.valid_ns = 100, now - 100 * MS
    check(r, now)
    assert r.escalation is not None and r.escalation.step == "init"


# ---- confirmation -------------------------------------------------------------------------------------------------
def test_a_slave_seen_out_of_op_once_is_not_acted_on_twice_is() -> None:
    r, c = machine()
    err: Reads = [(OP, 0), (SAFEOP | ERROR, 0x1B)]
    issue, act = check(r, T0, err)
    assert (issue, act.do, c.left_op, c.recoveries, r.seq) == ("", Do.NOTHING, 0, 0, 0)
    check(r, T0 + 10 * MS)  # back in OP: the sighting is forgotten
    issue, act = check(r, T0 + 20 * MS, err)
    assert (issue, act.do) == ("", Do.NOTHING)
    issue, act = check(r, T0 + 30 * MS, err)
    assert issue == "slave 2 palm in SAFE-OP+ERROR (AL code 0x001b)" == c.state_issue
    assert (act.do, act.slave, act.state) == (Do.REQUEST_STATE, 1, SAFEOP | ACK)
    assert (c.left_op, c.recoveries) == (1, 1)
    assert texts(r) == ["slave 2 palm: acknowledge SAFE-OP+ERROR (AL code 0x001b)"]
    _, act = check(r, T0 + 40 * MS, [(OP, 0), (SAFEOP, 0)])  # a new issue, already seen out of OP twice
    assert (act.do, act.slave, act.state) == (Do.REQUEST_STATE, 1, OP)
    assert c.left_op == 2 and texts(r)[-1] == "slave 2 palm: SAFE-OP -> OP"
    check(r, T0 + 50 * MS)  # every slave in OP, the data valid all along: the episode ends, states only
    assert c.state_issue == "" and not r.episode_open
    assert texts(r)[-1] == "every slave in OP again after 20 ms"


def test_the_cheap_steps_are_tried_three_times_then_the_ladder() -> None:
    r, c = machine()
    safeop: Reads = [(OP, 0), (SAFEOP, 0)]
    check(r, T0, safeop)
    acts = [check(r, T0 + k * MS, safeop)[1] for k in range(1, 5)]
    assert [a.do for a in acts] == [Do.REQUEST_STATE] * 3 + [Do.NOTHING]
    assert c.recoveries == 3 and c.escalations == 1 and r.escalation is not None
    assert c.state_issue == "recovering: slave 2 palm in SAFE-OP (AL code 0x0000) after 3 acknowledge/OP requests"


def test_a_slave_in_init_goes_to_the_ladder_at_once() -> None:
    r, c = machine()
    init: Reads = [(INIT, 0), (OP, 0)]
    check(r, T0, init)
    check(r, T0 + MS, init)
    assert c.escalations == 1 and c.recoveries == 0
    assert texts(r) == ["escalating (attempt 1 of 4): slave 1 bridge in INIT (AL code 0x0000); "
                        "INIT -> PRE-OP -> SAFE-OP -> OP"]


def test_a_silent_slave_needs_three_sightings_and_its_silence_to_last() -> None:
    silent: Reads = [(NONE, 0), (OP, 0)]
    r, c = machine(silent_confirm_ns=0)
    c.bad_run = 5
    assert [check(r, T0 + k * MS, silent)[1].do for k in range(3)] == [Do.NOTHING, Do.NOTHING, Do.RECOVER]

    r, c = machine()  # 150 ms of silence
    c.bad_run = 5
    acts = [check(r, T0 + k * 10 * MS, silent)[1] for k in range(15)]
    assert all(a.do is Do.NOTHING for a in acts) and c.recoveries == 0
    issue, act = check(r, T0 + 150 * MS, silent)
    assert (act.do, act.slave, act.check_serial) == (Do.RECOVER, 0, False)
    assert issue == "slave 1 bridge in NONE (AL code 0x0000)" and c.recoveries == 1
    assert texts(r)[-1] == "slave 1 bridge: not answering (try 1; next in 100 ms)"
    assert check(r, T0 + 200 * MS, silent)[1].do is Do.NOTHING  # the recover's backoff
    assert check(r, T0 + 250 * MS, silent)[1].do is Do.RECOVER

    r, c = machine(silent_confirm_ns=0)  # the frames come back whole: a silent read is a slow answer
    assert [check(r, T0 + k * MS, silent) for k in range(6)] == [("", Action(Do.NOTHING))] * 6
    assert c.recoveries == c.left_op == r.seq == 0


def test_a_palm_back_with_another_serial_asks_a_re_scan() -> None:
    r, c = machine(silent_confirm_ns=0)
    c.bad_run = 5
    silent: Reads = [(OP, 0), (NONE, 0)]
    for k in range(2):
        check(r, T0 + k * MS, silent)
    _, act = check(r, T0 + 2 * MS, silent, recover_ok=True, serial=4321)
    assert act.check_serial
    assert texts(r)[-2:] == ["slave 2 palm: answering at its address again",
                             "full re-scan: the palm came back with serial 4321 (was 1234)"]
    assert r.rescan_needed == "the palm came back with serial 4321 (was 1234)"


def test_another_slave_not_answering_is_found_before_the_ladder() -> None:
    r, c = machine(silent_confirm_ns=10**12)
    c.bad_run = 40
    seen: Reads = [(INIT, 0), (NONE, 0)]
    cut_short: Reads = [(INIT, 0), None]  # the palm's read cut short: no news that it answers
    reads = [seen] * 2 + [cut_short] * 3
    issues = [check(r, T0 + k * MS, x)[0] for k, x in enumerate(reads)]
    assert c.escalations == 0 and r.escalation is None and issues[-1].startswith("slave 1 bridge in INIT")


# ---- the ladder ---------------------------------------------------------------------------------------------------
def test_the_ladder_steps_through_init_preop_safeop_op_and_verifies() -> None:
    r, c = machine()
    escalate(r, c, T0)
    assert texts(r) == [
        "outage: no valid process data for 100 ms (100 frames in a row, working counter 0); recovering",
        "escalating (attempt 1 of 4): no valid process data for 100 cycles (working counter 0, expected 3) while "
        "every slave reports OP; INIT -> PRE-OP -> SAFE-OP -> OP"]
    t, writes = T0, []
    for step in ("init", "preop", "safeop", "op"):
        t += MS
        issue, act = check(r, t)
        assert act.do is Do.WRITE_STEP and issue == c.state_issue
        writes.append((act.state, act.sms, act.fmmus))
        t += MS
        assert check(r, t, [(BOOT, 0), (BOOT, 0)])[1].do is Do.NOTHING  # not there yet, nor refused
        assert r.escalation is not None and r.escalation.step == step
        t += MS
        target = LADDER_STATE[step]
        check(r, t, [(target, 0), (target, 0)])
    # INIT with the error acknowledged; SyncManagers before the PRE-OP request, FMMUs before the SAFE-OP request
    assert writes == [(INIT | ACK, False, False), (PREOP, True, False), (SAFEOP, False, True), (OP, False, False)]
    assert texts(r)[2:] == ["step init: INIT requested", "step preop: SyncManagers written, PRE-OP requested",
                            "step safeop: FMMUs written, SAFE-OP requested", "step op: OP requested",
                            "every slave in OP; waiting for valid process data"]
    assert r.escalation is not None and r.escalation.step == "verify"
    assert check(r, t + MS)[1].do is Do.NOTHING and r.escalation is not None  # no valid data yet
    c.bad_run, c.back_ns, c.valid_ns = 0, t + 2 * MS, t + 2 * MS
    assert check(r, t + 3 * MS) == ("", Action(Do.NOTHING))
    assert r.escalation is None and not r.episode_open and c.state_issue == ""
    assert texts(r)[-1] == f"valid process data again after {(t + 2 * MS - (T0 - 100 * MS)) // MS} ms " \
                           "(attempt 1 of the ladder)"
    assert (c.escalations, c.escalation_failures) == (1, 0)


def test_a_refused_step_fails_the_attempt_and_the_next_waits_its_backoff() -> None:
    r, c = machine()
    escalate(r, c, T0)
    check(r, T0 + MS)  # INIT requested
    issue, _ = check(r, T0 + 2 * MS, [(INIT, 0), (SAFEOP | ERROR, 0x1B)])
    assert texts(r)[-1] == ("attempt 1 failed (init: refused: palm: SAFE-OP+ERROR (AL code 0x001b)); "
                            "attempt 2 of 4 in 50 ms")
    assert c.escalation_failures == 1 and issue == c.state_issue
    e = r.escalation
    assert e is not None and (e.attempt, e.step, e.requested) == (2, "init", False)
    assert check(r, T0 + 51 * MS)[1].do is Do.NOTHING  # within the backoff: nothing written
    assert check(r, T0 + 52 * MS)[1].do is Do.WRITE_STEP


def test_a_ladder_write_not_taken_is_written_again_then_abandoned_and_abandons_end_in_a_re_scan() -> None:
    r, c = machine()
    t = T0
    for n in range(1, 5):
        escalate(r, c, t)
        assert check(r, t + MS, acked=False)[1].do is Do.WRITE_STEP
        assert texts(r)[-1] == "step init: a write was not acknowledged; writing again"
        seq = r.seq
        check(r, t + 51 * MS, acked=False)  # within write_retry_ns: written again, said once
        assert r.seq == seq and r.escalation is not None
        check(r, t + 101 * MS, acked=False)
        assert r.escalation is None and r.abandons == n
        assert texts(r)[-1 if n < 4 else -2] == "step init: a slave did not take the write for 100 ms; " \
                                                "looking for it again"
        t += 200 * MS
    assert texts(r)[-1] == "full re-scan: the ladder's writes were not taken 4 times"
    assert r.rescan_needed == "the ladder's writes were not taken 4 times" and c.escalations == 4


def test_a_write_acknowledged_late_goes_on_with_the_ladder() -> None:
    r, c = machine()
    escalate(r, c, T0)
    check(r, T0 + MS, acked=False)
    check(r, T0 + 11 * MS, acked=True)
    e = r.escalation
    assert e is not None and e.requested and e.unacked_since_ns == 0
    assert texts(r)[-2:] == ["step init: a write was not acknowledged; writing again", "step init: INIT requested"]


def test_max_attempts_then_a_re_scan() -> None:
    r, c = machine()
    escalate(r, c, T0)
    t = T0
    for attempt in range(1, 5):
        e = r.escalation
        assert e is not None and e.attempt == attempt
        t = max(t, e.not_before_ns) + MS
        check(r, t)  # INIT requested at t
        check(r, t + 300 * MS, ALL_OP)  # not yet: 300 ms is the limit, not past it
        assert c.escalation_failures == attempt - 1
        t += 301 * MS
        check(r, t, ALL_OP)
        assert c.escalation_failures == attempt
    assert r.escalation is None and c.escalation_failures == 4
    assert [x for x in texts(r) if x.startswith("attempt")] == [
        "attempt 1 failed (init: not reached within 300 ms); attempt 2 of 4 in 50 ms",
        "attempt 2 failed (init: not reached within 300 ms); attempt 3 of 4 in 100 ms",
        "attempt 3 failed (init: not reached within 300 ms); attempt 4 of 4 in 200 ms"]
    assert texts(r)[-1] == "full re-scan: 4 escalations failed (last: init: not reached within 300 ms)"
    why = r.rescan_started()
    assert why == "4 escalations failed (last: init: not reached within 300 ms)" and r.rescan_needed == ""
    assert c.rescans == 1
    c.bad_run = 0
    r.rescan_done(t + 500 * MS, why, "palm", 1234, "0220")
    assert c.state_issue == "" and texts(r)[-1] == f"re-scan done ({why}): palm palm serial 1234, protocol 0220"


# ---- episodes -----------------------------------------------------------------------------------------------------
def test_an_outage_is_named_from_the_last_valid_data_and_its_end_measures_it() -> None:
    r, c = machine(escalate_after=10**9)  # the slaves claim OP all along: no ladder here
    c.valid_ns, c.last_wkc = T0, 1
    c.bad_run = 19
    check(r, T0 + 19 * MS)
    assert not r.episode_open and r.seq == 0  # not an outage yet
    c.bad_run = 20
    check(r, T0 + 30 * MS)  # the check comes later than the 20th lost frame
    assert r.episode_open
    assert r.log[-1] == (T0 + 30 * MS, "outage: no valid process data for 30 ms (20 frames in a row, working "
                                       "counter 1); recovering")
    c.bad_run = 2000
    check(r, T0 + 2000 * MS)
    assert r.seq == 1  # named once
    c.bad_run, c.back_ns, c.valid_ns = 0, T0 + 2345 * MS, T0 + 2350 * MS
    check(r, T0 + 2400 * MS)
    assert not r.episode_open
    assert r.log[-1] == (T0 + 2400 * MS, "valid process data again after 2345 ms")


def test_a_nic_replaced_asks_a_re_scan_at_once() -> None:
    r, c = machine()
    assert not r.nic_check_due  # valid data flow: the NIC is not even looked at
    c.bad_run, c.valid_ns = 3, T0 - 3 * MS
    assert r.nic_check_due
    assert r.nic_lost(T0, "ec0", vanished=False) == "NIC ec0 gone" == c.state_issue
    assert r.rescan_needed == "the NIC ec0 was replaced" and r.episode_open
    assert texts(r) == ["outage: no valid process data for 3 ms (3 frames in a row, working counter 0); recovering",
                        "full re-scan: the NIC ec0 was replaced"]
    assert not r.nic_check_due  # asked once
    why = r.rescan_started()
    r.rescan_found_nothing(T0 + MS, why, "ec0", nic_gone=True, error="no EtherCAT slave answers on ec0")
    assert texts(r)[-1] == "re-scan (the NIC ec0 was replaced) found no palm: the NIC ec0 vanished"
    r, c = machine()
    c.bad_run = 3
    r.nic_lost(T0, "ec0", vanished=True)
    why = r.rescan_started()
    r.rescan_found_nothing(T0 + MS, why, "ec0", nic_gone=True, error="cannot open EtherCAT NIC 'ec0'")
    assert texts(r)[-1] == "re-scan (the NIC ec0 vanished) found no palm: cannot open EtherCAT NIC 'ec0'"


# ---- any sequence of observations -----------------------------------------------------------------------------
STATES = [(OP, 0), (SAFEOP, 0), (SAFEOP | ERROR, 0x1B), (INIT, 0), (PREOP, 0), (NONE, 0), None]
READ = st.one_of(st.just("obey"), st.lists(st.sampled_from(STATES), min_size=2, max_size=2))
STEP = st.tuples(
    st.integers(0, 400),  # ms since the last check
    st.booleans(),  # valid data meanwhile
    READ,  # the AL states read ("obey": where the ladder asked, else OP)
    st.booleans(),  # a ladder write acknowledged
    st.booleans(),  # SOEM's recover found the slave
    st.sampled_from([None, 1234, 4321]),  # the palm's serial read back
    st.booleans(),  # the NIC is gone (seen only while the data are invalid)
    st.booleans(),  # a re-scan finds the palm
)
GROWING = ("recoveries", "left_op", "escalations", "escalation_failures", "rescans")
POLICY = RecoveryPolicy(silent_confirm_ns=30 * MS)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=80))
def test_any_sequence_of_observations_keeps_the_invariants(
        steps: list[tuple[int, bool, str | Reads, bool, bool, int | None, bool, bool]]) -> None:
    c = Counters()
    r = Recovery(POLICY, c)
    now = T0
    for dt, data, read, acked, recover_ok, serial, nic_gone, found in steps:
        now += dt * MS
        if data:
            if c.bad_run:
                c.back_ns = now
            c.bad_run, c.valid_ns = 0, now
        else:
            c.bad_run += max(1, dt)  # a cycle a millisecond
        before = {f.name: getattr(c, f.name) for f in fields(c)}
        rescan_before, seq, abandons = r.rescan_needed, r.seq, r.abandons
        if r.rescan_needed:  # the cycle runs a re-scan before anything else
            why = r.rescan_started()
            if found:
                c.bad_run = 0
                r.rescan_done(now, why, "palm", 1234, "0220")
            else:
                r.rescan_found_nothing(now, why, "ec0", nic_gone, "no EtherCAT slave answers on ec0")
            issue = c.state_issue
            assert r.escalation is None and not r.rescan_needed
        elif nic_gone and r.nic_check_due:
            issue = r.nic_lost(now, "ec0", vanished=True)
        else:
            e = r.escalation
            reads: Reads = read if isinstance(read, list) else (
                [(LADDER_STATE[e.step], 0)] * 2 if e is not None and e.step in LADDER_STATE else ALL_OP)
            act = r.check(now)
            if act.do is Do.WRITE_STEP:
                assert e is not None and act.state & 0x0F == LADDER_STATE[e.step]
                assert act.sms == (e.step == "preop") and act.fmmus == (e.step == "safeop")
                assert bool(act.state & ACK) == (e.step == "init")
                issue = r.step_written(now, acked)
            else:
                if act.do is Do.READ_STATES:
                    act = r.states(now, reads, BUS)
                if act.do in (Do.RECOVER, Do.REQUEST_STATE):
                    # the cheap steps and the ladder never at once; only a slave read out of OP is acted on
                    assert e is None and r.escalation is None and 0 <= act.slave < len(BUS.names)
                    got = reads[act.slave]
                    assert got is not None and got[0] != OP
                    assert (act.do is Do.RECOVER) == (got[0] == NONE)
                issue = r.recovered(now, recover_ok, serial) if act.do is Do.RECOVER else act.issue
        # the answer is what health shows
        assert issue == c.state_issue
        e = r.escalation
        if e is not None:  # a ladder under way is within its attempts, in an episode, and said
            assert 1 <= e.attempt <= POLICY.max_attempts and e.step in (*LADDER_STATE, "verify")
            assert r.episode_open and c.state_issue
        for name in GROWING:
            assert getattr(c, name) >= before[name], name
        assert c.escalation_failures <= c.escalations * POLICY.max_attempts
        # nothing starts, fails or is asked for without a step in the log saying so
        if c.escalations > before["escalations"] or c.escalation_failures > before["escalation_failures"]:
            assert r.seq > seq
        if r.rescan_needed and not rescan_before:
            assert r.seq > seq and r.log[-1][1] == f"full re-scan: {r.rescan_needed}"
        if r.abandons > abandons and r.abandons >= POLICY.max_attempts:
            assert r.rescan_needed  # too many ladders left: a re-scan, at once
        assert r.seq >= len(r.log) and len(r.log) <= 32
        stamps = [t for t, _ in r.log]
        assert stamps == sorted(stamps) and (not stamps or stamps[-1] <= now)
        for _, text in r.log:  # every duration said (an outage, an episode, a backoff) is one
            assert all(int(ms) >= 0 for ms in re.findall(r"(-?\d+) ms", text)), text
