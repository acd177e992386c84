"""The EtherCAT master's recovery ladder as a pure state machine: no I/O, no clock (every time is passed in,
CLOCK_MONOTONIC ns).

`EthercatMaster` (transport/master.py) does the I/O and feeds this machine what it observed. One state check:

1. `check(now)`: what to do first. `READ_STATES` (read every slave's AL state, then `states(...)`),
   `WRITE_STEP` (the ladder's step: SyncManagers / FMMUs written back, then the AL control word to every slave,
   then `step_written(...)`), or `NOTHING` (waiting: a backoff, valid data awaited).
2. `states(now, reads, bus)` judges the reads: a slave out of OP is acted on only when confirmed (twice in a row;
   three times and `silent_confirm_ns` long when it does not answer, and only while the data are not valid).
   It answers `RECOVER` (SOEM's recover of that slave, then `recovered(...)`), `REQUEST_STATE` (write that AL
   control word to that slave: acknowledge an error, SAFE-OP -> OP), or `NOTHING`.
   `Action.issue` is what is being worked on ("" all well), for health.

Whatever it decides, it says in `log` (the recovery steps health shows) and counts in the wire counters. A full
re-scan it asks for is `rescan_needed` (the cycle runs it: `rescan_started`, then `rescan_done` or
`rescan_found_nothing`). The ladder's own times (a step's start, its timeout, the write retries, the backoff) are
the check's time, given to `check`; a note is stamped with the time given to the call that makes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

# AL states (ETG.1000.6; pysoem's constants have the same values)
NONE, INIT, PREOP, BOOT, SAFEOP, OP = 0x00, 0x01, 0x02, 0x03, 0x04, 0x08
ERROR = 0x10  # AL status: the slave refused or left its state
ACK = 0x10  # AL control: acknowledge that error
LADDER = ("init", "preop", "safeop", "op", "verify")  # the escalation's steps, in order
LADDER_STATE = {"init": INIT, "preop": PREOP, "safeop": SAFEOP, "op": OP}
STATE_NAMES = {NONE: "NONE", INIT: "INIT", PREOP: "PRE-OP", BOOT: "BOOT", SAFEOP: "SAFE-OP", OP: "OP"}


def state_name(state: int) -> str:
    base = STATE_NAMES.get(state & 0x0F, f"{state & 0x0F:#x}")
    return base + ("+ERROR" if state & ERROR else "")


@dataclass(frozen=True)
class RecoveryPolicy:
    """How the master escalates. A slave out of OP first gets the cheap step (acknowledge an
    error, SAFE-OP -> OP); when that is not enough, or the working counter stays wrong while every slave
    claims OP, every slave goes through INIT -> PRE-OP -> SAFE-OP -> OP with its SyncManagers written
    before the PRE-OP request and its FMMUs before the SAFE-OP request (the order a standard ESC expects:
    some activate FMMUs only on that transition). Capped attempts with doubling backoff, then a full
    re-scan of the bus; a re-scan also follows a slave that came back with another identity."""

    escalate_after: int = 100  # cycles in a row without valid process data while every slave reports OP
    quick_tries: int = 3  # cheap steps on one issue before escalating
    step_timeout_ns: int = 300_000_000  # a requested state not reached within this fails the attempt
    max_attempts: int = 4  # escalations before a full re-scan
    backoff_ns: int = 50_000_000  # before attempt n > 1: backoff * 2**(n-2), capped
    backoff_cap_ns: int = 1_000_000_000
    recover_timeout_us: int = 500  # SOEM's recover (station address + identity check) per try
    # a slave not answering at its address is acted on only after this long (and 3 reads): this VM stalls
    # the hand's vCPU for up to tens of ms, and SOEM's recover sent to a slave that is only slow can leave
    # it without its station address
    silent_confirm_ns: int = 150_000_000
    # a step's writes not acknowledged are written again (they are idempotent) for this long before the ladder
    # goes to find the slave: a write whose reply came back late on a stalled host is not a slave gone
    write_retry_ns: int = 100_000_000
    # cycles in a row without valid process data that open a recovery episode at once (the cycle's outage rule,
    # ETHERCAT_ERROR_AFTER_LOST): it is named while the slave is absent, and it counts from the last valid data
    outage_cycles: int = 20


class Counters(Protocol):
    """The wire counters (the master's `WireCounters`): the exchange's the machine reads, and its own it updates."""

    bad_run: int  # consecutive cycles without valid process data
    valid_ns: int  # when the last valid status came back
    back_ns: int  # ... and the first one after a run without
    last_wkc: int
    recoveries: int
    left_op: int
    escalations: int
    escalation_failures: int
    rescans: int
    state_issue: str


@dataclass(frozen=True)
class BusView:
    """What the machine knows of the bus it recovers."""

    names: tuple[str, ...]  # every slave's name, in bus order
    palm: int  # the palm's index in `names`
    serial: int  # the palm's serial when the bus was scanned
    expected_wkc: int


class Do(Enum):
    NOTHING = "nothing"  # this check is over
    READ_STATES = "read_states"  # read every slave's AL state, report them to `states`
    WRITE_STEP = "write_step"  # the ladder's writes to every slave, report to `step_written`
    RECOVER = "recover"  # SOEM's recover of `slave`, report to `recovered`
    REQUEST_STATE = "request_state"  # write AL control `state` to `slave`; this check is over


@dataclass(frozen=True)
class Action:
    do: Do
    issue: str = ""  # what is being worked on ("" all well): the check's answer once it is over
    slave: int = -1  # RECOVER, REQUEST_STATE: the slave's index
    state: int = 0  # REQUEST_STATE, WRITE_STEP: the AL control word
    sms: bool = False  # WRITE_STEP: each slave's SyncManagers first (before the PRE-OP request)
    fmmus: bool = False  # WRITE_STEP: each slave's FMMUs first (before the SAFE-OP request)
    check_serial: bool = False  # RECOVER: the slave is the palm; read its serial back when it answers


READ = Action(Do.READ_STATES)


@dataclass
class Escalation:
    """One INIT -> PRE-OP -> SAFE-OP -> OP ladder under way."""

    reason: str
    started_ns: int
    attempt: int = 1
    step: str = "init"
    requested: bool = False  # the step's writes are done; now waiting for the state
    step_ns: int = 0  # when the step's request went out
    not_before_ns: int = 0  # backoff
    unacked_since_ns: int = 0  # the step's writes have not been acknowledged since then (0: they were)


class Recovery:
    """The recovery's decisions and memory: sightings of slaves out of OP, the cheap steps, the ladder, the
    episode, the re-scan asked for, and the log of what it did."""

    def __init__(self, policy: RecoveryPolicy, counters: Counters, log_size: int = 32) -> None:
        self.policy = policy
        self.counters = counters
        # what recovery did, newest last: (CLOCK_MONOTONIC ns, text); the cycle publishes it, the MQTT side
        # logs each entry (no logging in the realtime process)
        self.log: deque[tuple[int, str]] = deque(maxlen=log_size)
        self.seq = 0
        self.rescan_needed = ""  # why a full re-scan is due ("" none): the cycle runs it
        self._sightings: dict[int, int] = {}  # slave index -> consecutive checks found out of OP
        self._silent_since: dict[int, int] = {}  # slave index -> first of its consecutive "not answering" reads
        self._quick: tuple[str, int] = ("", 0)  # the issue the cheap steps work on, and how many were sent
        self._esc: Escalation | None = None
        self._recover_after_ns = 0  # backoff of SOEM's recover() for a slave that does not answer
        # a recovery episode: from the first thing recovery does until every slave is in OP with valid process
        # data, whatever path brought them back (the ladder, the cheap steps, a re-scan); its end is noted
        self._episode_ns: int | None = None
        self._episode_no_data = False  # the episode saw process data invalid (else: states only)
        self._abandons = 0  # ladders left to find a slave that did not take their writes, this episode
        self._check_ns = 0  # when the state check under way began: the ladder's clock
        self._recovering: tuple[int, int, BusView] | None = None  # the RECOVER handed out: slave, when, bus

    # ---- what the master and the cycle read ---------------------------------------------------------------
    @property
    def escalation(self) -> Escalation | None:
        return self._esc

    @property
    def episode_open(self) -> bool:
        """A recovery episode has not seen its end yet (the cycle checks the states every 10 cycles meanwhile)."""
        return self._episode_ns is not None

    @property
    def abandons(self) -> int:
        return self._abandons

    @property
    def nic_check_due(self) -> bool:
        """Whether the master should look at its NIC (one ioctl): only while no valid data flow."""
        return bool(self.counters.bad_run) and not self.rescan_needed

    def note(self, now: int, text: str) -> None:
        self.log.append((now, text))
        self.seq += 1

    # ---- one state check ------------------------------------------------------------------------------------
    def nic_lost(self, now: int, iface: str, vanished: bool) -> str:
        """No valid data and the NIC is not the one opened (gone, or gone and back): SOEM's socket is bound to the
        old one, where no slave can ever answer; only a re-scan opens the NIC by name again."""
        self._want_rescan(now, f"the NIC {iface} vanished" if vanished else f"the NIC {iface} was replaced")
        self.counters.state_issue = f"NIC {iface} gone"
        return self.counters.state_issue

    def check(self, now: int) -> Action:
        """A state check begins at `now`: the outage's episode opens, and the ladder under way advances (its next
        writes, a read of the states it waits for, or its end), else the states are read."""
        c = self.counters
        self._check_ns = now
        if c.bad_run >= self.policy.outage_cycles:
            self._begin_episode(now)  # an outage: named now, from the moment the data stopped
        e = self._esc
        if e is None:
            return READ
        if now < e.not_before_ns:
            return Action(Do.NOTHING, c.state_issue)
        if e.step == "verify":
            if c.bad_run == 0:
                self._episode_no_data = True  # the ladder took every slave out of OP: no data meanwhile
                self._end_episode(now, f" (attempt {e.attempt} of the ladder)")
                self._esc = None
                self._quick = ("", 0)
                self._sightings.clear()
                self._silent_since.clear()
                c.state_issue = ""
                return Action(Do.NOTHING, "")
            return Action(Do.NOTHING, self._timed_out(e, now, now))
        if not e.requested:
            return Action(Do.WRITE_STEP, c.state_issue, state=LADDER_STATE[e.step] | (ACK if e.step == "init" else 0),
                          sms=e.step == "preop", fmmus=e.step == "safeop")
        return READ

    def states(self, now: int, reads: Sequence[tuple[int, int] | None], bus: BusView) -> Action:
        """The AL (state, status code) of every slave, read at `now`; None for a read cut short (no evidence)."""
        if self._esc is not None:
            return Action(Do.NOTHING, self._ladder_read(self._esc, now, reads, bus))
        return self._judge(now, reads, bus)

    def step_written(self, now: int, acked: bool) -> str:
        """The ladder's writes are done (`acked`: every one acknowledged). Not acknowledged: a reply late on a
        stalled host (the write taken all the same), or a slave that stopped answering (power lost again?). They
        are written again at the next check for `write_retry_ns`, then the ladder goes to find the slave; one
        that never takes them brings a full re-scan."""
        e = self._esc
        assert e is not None, "step_written without a ladder"
        c, t = self.counters, self._check_ns
        if acked:
            e.requested, e.step_ns, e.unacked_since_ns = True, t, 0
            self.note(now, f"step {e.step}: " + ("SyncManagers written, " if e.step == "preop" else
                                                 "FMMUs written, " if e.step == "safeop" else "")
                      + f"{state_name(LADDER_STATE[e.step])} requested")
            return c.state_issue
        if not e.unacked_since_ns:
            e.unacked_since_ns = t
            self.note(now, f"step {e.step}: a write was not acknowledged; writing again")
        if t - e.unacked_since_ns < self.policy.write_retry_ns:
            return c.state_issue
        self._esc = None
        self._sightings.clear()
        self._silent_since.clear()
        self._abandons += 1
        self.note(now, f"step {e.step}: a slave did not take the write for "
                       f"{(t - e.unacked_since_ns) / 1e6:.0f} ms; looking for it again")
        if self._abandons >= self.policy.max_attempts:
            self._want_rescan(now, f"the ladder's writes were not taken {self._abandons} times")
        return c.state_issue

    def recovered(self, now: int, ok: bool, serial: int | None = None) -> str:
        """SOEM's recover of the slave handed out ran: `ok` it answers at its address again; `serial` the palm's
        serial read back (None: not the palm, or unreadable). A slave that answers at its position with another
        identity is never given the address: after the capped tries, a full re-scan takes the bus as it now is."""
        assert self._recovering is not None, "recovered without a RECOVER"
        (i, t, bus), self._recovering = self._recovering, None
        name = bus.names[i]
        if ok:
            self._recover_after_ns = 0
            self.note(now, f"slave {i + 1} {name}: answering at its address again")
            if i == bus.palm and serial is not None and serial != bus.serial:
                self._want_rescan(now, f"the palm came back with serial {serial} (was {bus.serial})")
            return self.counters.state_issue
        tries = self._quick[1] + 1 if self._quick[0] == f"recover {i}" else 1
        self._quick = (f"recover {i}", tries)
        delay = min(self.policy.backoff_cap_ns, self.policy.backoff_ns << min(tries, 16))
        self._recover_after_ns = t + delay
        if tries == 1 or tries % 10 == 0:
            self.note(now, f"slave {i + 1} {name}: not answering (try {tries}; next in {delay / 1e6:.0f} ms)")
        if tries > 3 * self.policy.max_attempts:
            self._want_rescan(now, f"slave {i + 1} {name} does not take its address back after {tries} tries "
                                   "(gone, or another device at its position)")
        return self.counters.state_issue

    # ---- the re-scan ------------------------------------------------------------------------------------------
    def rescan_started(self) -> str:
        """The cycle runs the re-scan asked for: counted, the ladder and the sightings forgotten. Returns why."""
        why, self.rescan_needed = self.rescan_needed, ""
        self.counters.rescans += 1
        self._esc, self._quick, self._recover_after_ns, self._recovering = None, ("", 0), 0, None
        self._sightings.clear()
        self._silent_since.clear()
        return why

    def rescan_found_nothing(self, now: int, why: str, iface: str, nic_gone: bool, error: str) -> None:
        """The re-scan found no palm. The NIC may go only after the slave fell silent (a namespace torn down, a USB
        adapter unplugged): the re-scan asked for another reason then, and its failure is where the NIC's loss
        shows."""
        self.note(now, f"re-scan ({why or 'requested'}) found no palm: "
                       + (f"the NIC {iface} vanished" if nic_gone and "vanished" not in why else error))

    def rescan_done(self, now: int, why: str, palm_name: str, serial: int, protocol: str) -> None:
        self.counters.state_issue = ""
        self.note(now, f"re-scan done ({why or 'requested'}): palm {palm_name} serial {serial}, protocol {protocol}")

    # ---- the rules --------------------------------------------------------------------------------------------
    def _judge(self, now: int, reads: Sequence[tuple[int, int] | None], bus: BusView) -> Action:
        """Act on the first slave confirmed out of OP (or on process data that stay invalid while all claim OP)."""
        c = self.counters
        confirmed: tuple[int, int, int] | None = None
        silent = False  # a slave did not answer at its address: find it (recover) before anything else
        for i, got in enumerate(reads):
            if got is None:  # not read this time: no evidence either way
                continue
            st, code = got
            if st == OP:
                self._sightings.pop(i, None)
                self._silent_since.pop(i, None)
                continue
            if st == NONE and c.bad_run == 0:
                # the last frame came back with the full working counter: every slave processed it, so
                # a read at its address that got no answer in time is a slow answer (a stalled host: the
                # hand's answers reach 20 ms on this VM), not a slave gone. Counting it sent SOEM's recover
                # (temporary station address, identity check) to a healthy slave, which, cut short by the
                # same stall, left it without its address: seconds of "not in OP" (a 4 s outage)
                continue
            n = self._sightings[i] = self._sightings.get(i, 0) + 1
            silent = silent or st == NONE
            if st == NONE:
                # and silent for silent_confirm_ns: three reads 10 cycles apart fit in one host stall
                since = self._silent_since.setdefault(i, now)
                if now - since < self.policy.silent_confirm_ns:
                    continue
            else:
                self._silent_since.pop(i, None)
            if n >= (3 if st == NONE else 2) and (confirmed is None or (st == NONE and confirmed[1] != NONE)):
                confirmed = (i, st, code)
        if confirmed is None:
            all_op = not self._sightings and all(x is not None for x in reads)
            if all_op and c.bad_run >= self.policy.escalate_after:
                self._start_escalation(now, f"no valid process data for {c.bad_run} cycles (working counter "
                                            f"{c.last_wkc}, expected {bus.expected_wkc}) while every slave "
                                            f"reports OP")
                return Action(Do.NOTHING, c.state_issue)
            if not self._sightings and c.bad_run == 0:
                c.state_issue = ""
                self._quick = ("", 0)
                self._end_episode(now)
            return Action(Do.NOTHING, c.state_issue)
        i, st, code = confirmed
        name = bus.names[i]
        issue = f"slave {i + 1} {name} in {state_name(st)} (AL code {code:#06x})"
        if c.state_issue != issue:
            c.left_op += 1
        c.state_issue = issue
        if st == NONE:  # not answering at its address: gone, or back with the address cleared
            if now < self._recover_after_ns:
                return Action(Do.NOTHING, issue)
            c.recoveries += 1
            self._begin_episode(now)
            self._recovering = (i, now, bus)
            return Action(Do.RECOVER, issue, slave=i, check_serial=i == bus.palm)
        if silent or any(j != i for j in self._silent_since):
            # another slave is not answering yet (seen so, and not seen answering since: a read cut short this time
            # is no news): the ladder needs every one of them, so that one is found first (recover)
            return Action(Do.NOTHING, issue)
        tries = self._quick[1] + 1 if self._quick[0] == issue else 1
        if tries > self.policy.quick_tries or st & 0x0F in (INIT, PREOP, BOOT):
            self._start_escalation(now, issue if tries <= self.policy.quick_tries
                                   else f"{issue} after {tries - 1} acknowledge/OP requests")
            return Action(Do.NOTHING, c.state_issue)
        self._quick = (issue, tries)
        c.recoveries += 1
        self._begin_episode(now)
        if st & ERROR:
            self.note(now, f"slave {i + 1} {name}: acknowledge {state_name(st)} (AL code {code:#06x})")
            return Action(Do.REQUEST_STATE, issue, slave=i, state=(st & 0x0F) | ACK)
        if st == SAFEOP:
            self.note(now, f"slave {i + 1} {name}: SAFE-OP -> OP")
            return Action(Do.REQUEST_STATE, issue, slave=i, state=OP)
        return Action(Do.NOTHING, issue)

    def _ladder_read(self, e: Escalation, now: int, reads: Sequence[tuple[int, int] | None], bus: BusView) -> str:
        """The states the ladder's step waits for: reached (the next step), refused (the attempt failed), or not yet
        (the step's timeout)."""
        t = self._check_ns
        target = LADDER_STATE[e.step]
        if all(x is not None and x[0] & 0x0F == target and not x[0] & ERROR for x in reads):
            e.step = LADDER[LADDER.index(e.step) + 1]
            e.requested, e.step_ns = False, t
            if e.step == "verify":
                self.note(now, "every slave in OP; waiting for valid process data")
            return self.counters.state_issue
        bad = [f"{bus.names[i]}: {state_name(x[0])} (AL code {x[1]:#06x})" for i, x in enumerate(reads)
               if x is not None and x[0] & 0x0F != target]
        if any(x is not None and x[0] & ERROR for x in reads):
            return self._step_failed(e, t, now, f"{e.step}: refused: {', '.join(bad)}")
        return self._timed_out(e, t, now)

    def _timed_out(self, e: Escalation, t: int, now: int) -> str:
        if t - e.step_ns > self.policy.step_timeout_ns:
            timeout_ms = self.policy.step_timeout_ns / 1e6
            return self._step_failed(e, t, now, f"{e.step}: not reached within {timeout_ms:.0f} ms")
        return self.counters.state_issue

    def _step_failed(self, e: Escalation, t: int, now: int, why: str) -> str:
        c = self.counters
        c.escalation_failures += 1
        if e.attempt >= self.policy.max_attempts:
            self._esc = None
            self._want_rescan(now, f"{e.attempt} escalations failed (last: {why})")
            return c.state_issue
        delay = min(self.policy.backoff_cap_ns, self.policy.backoff_ns << (e.attempt - 1))
        e.attempt += 1
        e.step, e.requested, e.step_ns, e.not_before_ns = "init", False, t + delay, t + delay
        self.note(now, f"attempt {e.attempt - 1} failed ({why}); attempt {e.attempt} of {self.policy.max_attempts} "
                       f"in {delay / 1e6:.0f} ms")
        return c.state_issue

    def _start_escalation(self, now: int, reason: str) -> None:
        self._begin_episode(now)
        self._esc = Escalation(reason, now, step_ns=now)
        self.counters.escalations += 1
        self.counters.state_issue = f"recovering: {reason}"
        self.note(now, f"escalating (attempt 1 of {self.policy.max_attempts}): {reason}; "
                       "INIT -> PRE-OP -> SAFE-OP -> OP")

    def _want_rescan(self, now: int, why: str) -> None:
        self._begin_episode(now)
        if not self.rescan_needed:
            self.rescan_needed = why
            self.note(now, f"full re-scan: {why}")

    def _begin_episode(self, now: int) -> None:
        """A recovery episode opens (once): at the last valid data when the data have stopped (an outage counts from
        there, not from the first step recovery takes, which waits for a silent slave to be confirmed), else now."""
        c = self.counters
        if self._episode_ns is None:
            start = c.valid_ns if c.bad_run and 0 < c.valid_ns <= now else now
            self._episode_ns, self._episode_no_data, self._abandons = start, bool(c.bad_run), 0
            if c.bad_run:
                self.note(now, f"outage: no valid process data for {(now - start) / 1e6:.0f} ms ({c.bad_run} frames "
                               f"in a row, working counter {c.last_wkc}); recovering")
        if c.bad_run:
            self._episode_no_data = True

    def _end_episode(self, now: int, attempt: str = "") -> None:
        """Every slave in OP with valid process data: the episode's last step, however it got there, and how long
        it took: an outage from its last valid data to the first valid data again, else from the first step."""
        if self._episode_ns is None:
            return
        c = self.counters
        end = c.back_ns if self._episode_no_data and c.back_ns >= self._episode_ns else now
        self.note(now, f"{'valid process data again' if self._episode_no_data else 'every slave in OP again'} "
                       f"after {(end - self._episode_ns) / 1e6:.0f} ms{attempt}")
        self._episode_ns, self._abandons = None, 0


__all__ = ["ACK", "ERROR", "LADDER", "Action", "BusView", "Counters", "Do", "Escalation", "Recovery",
           "RecoveryPolicy", "state_name"]
