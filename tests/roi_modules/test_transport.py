"""The transport against the simulator on loopback: matching, resends, losses, replies and garbage reported,
counters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from services.roi_modules import protocol as p
from services.roi_modules.sim import RoiSim, SimModuleSpec
from services.roi_modules.transport import (
    RequestLost,
    RoiTransport,
    TransportConfig,
    background_traffic,
    module_address,
)
from tests.roi_modules.conftest import fresh_prefix

OCTETS = [10, 20, 30]


@pytest.fixture
def sim() -> Iterator[RoiSim]:
    s = RoiSim(fresh_prefix(), [SimModuleSpec(10, "gpio"), SimModuleSpec(20, "odrive"),
                                SimModuleSpec(30, "actuator")], seed=7).start()
    yield s
    s.close()


# Tests that count sends run with a longer resend interval than the product default (50 ms): on a busy machine
# a loopback reply can come later than 50 ms, and the transport then resends, as it should; that extra send
# would be counted against the test, not the product.
COUNTING_TIMEOUT_S = 0.25


def run(sim: RoiSim, body, live=None, **cfg):  # type: ignore[no-untyped-def]
    """`events`: what the transport reported, (octet, "reply" | "garbage")."""
    events: list[tuple[int, str]] = []

    def on_reply(octet: int, port: int, pkt: object) -> None:
        events.append((octet, "reply"))

    def on_garbage(octet: int, reason: str) -> None:
        events.append((octet, "garbage"))

    async def main():  # type: ignore[no-untyped-def]
        tr = RoiTransport(TransportConfig(sim.prefix, 100, **cfg), OCTETS, live=live, on_reply=on_reply,
                          on_garbage=on_garbage)
        await tr.open()
        try:
            return await body(tr, events)
        finally:
            tr.close()

    return asyncio.run(main())


def test_destination_address_built_from_prefix_not_str_replace() -> None:
    """§5.5: sendToOctet swapped the octet with str.replace; 192.168.2.2 -> octet 5 gave 195.168.5.5."""
    assert module_address("192.168.2", 5) == "192.168.2.5"
    assert module_address("127.0.2", 2) == "127.0.2.2"
    for bad in ("192.168", "192.168.02", "1.2.300", "a.b.c"):
        with pytest.raises(ValueError):
            module_address(bad, 5)
    for bad_octet in (0, 255, 256):
        with pytest.raises(ValueError):
            module_address("192.168.2", bad_octet)


def test_replies_match_requests_by_octet_port_subdevice_action(sim: RoiSim) -> None:
    """§5.5: the original never matched a reply (str vs int) and resent every packet until abandoned."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        rep = await tr.general(10, p.GeneralPacket(12, p.GpioAction.READ))
        assert (rep.sub_device_id, rep.action) == (12, p.GpioAction.READ)
        pong = await tr.sysadmin(20, p.SysAdminPacket(p.SysAdminAction.PING, origin=100))
        assert pong is not None and pong.action == p.SysAdminAction.PONG
        # concurrent requests to three modules and two ports, each gets its own reply
        reps = await asyncio.gather(
            tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL)),
            tr.general(30, p.GeneralPacket(1, p.ActuatorAction.GET_CURRENT_LENGTH)),
            tr.sysadmin(10, p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, origin=100)),
            tr.general(10, p.GeneralPacket(3, p.GpioAction.READ)))
        assert [r.action for r in reps] == [p.OdriveAction.GET_ALL, p.ActuatorAction.GET_CURRENT_LENGTH,
                                            p.SysAdminAction.STATUS_REPORT, p.GpioAction.READ]
        for o in OCTETS:
            assert tr.links[o].resent == 0 and tr.links[o].lost_total == 0
        return events

    events = run(sim, body, timeout_s=COUNTING_TIMEOUT_S)
    assert sorted(events) == [(10, "reply")] * 3 + [(20, "reply")] * 2 + [(30, "reply")]


def test_lost_requests_are_resent_then_abandoned(sim: RoiSim) -> None:
    """The resend ladder while the caller says the module is live; one send while it says not; a probe is one
    datagram whose silence is not a lost request. Liveness itself is the service's link supervisor's."""
    live = {"20": True}

    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
        sim.set_faults(20, drop_next=3)
        await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))  # the 4th send gets through
        link = tr.links[20]
        assert link.resent == 3 and link.lost_total == 0
        sim.set_faults(20, offline=True)
        t0 = time.monotonic()
        with pytest.raises(RequestLost):
            await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
        assert time.monotonic() - t0 >= 10 * COUNTING_TIMEOUT_S * 0.9  # 1 + 10 sends, timeout_s apart
        assert link.lost_total == 1 and link.lost_since_connect == 1
        live["20"] = False
        sent = link.sent
        with pytest.raises(RequestLost):  # not live: one send, not eleven
            await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
        assert link.sent == sent + 1 and link.lost_total == 2
        probe = p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, origin=100)
        assert await tr.probe(20, probe, 0.2) is None  # one datagram, silence not counted as lost
        assert link.sent == sent + 2 and link.lost_total == 2
        sim.set_faults(20, offline=False)
        rep = await tr.probe(20, probe, 2.0)
        assert rep is not None and rep.action == p.SysAdminAction.STATUS_REPORT
        await tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
        assert link.lost_since_connect == 0 and link.lost_total == 2
        return events

    events = run(sim, body, live=lambda octet: live[str(octet)], timeout_s=COUNTING_TIMEOUT_S)
    assert [e for e in events if e[0] == 20] == [(20, "reply")] * 4


def test_the_stops_resends_insist_on_a_module_that_is_not_live(sim: RoiSim) -> None:
    """The bus stop's resends (`insist`): the whole ladder even while the caller says the module is not live (its
    replies held up on a busy host must not make a delivered stop read as failed); other requests: one send."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        link = tr.links[20]
        sim.set_faults(20, drop_next=1)
        with pytest.raises(RequestLost):  # not live: one send, lost
            await tr.general(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0))
        assert link.sent == 1
        sim.set_faults(20, drop_next=2)
        rep = await tr.general(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0), insist=True)
        assert rep.action == p.OdriveAction.SET_VELOCITY  # the third send (or, on a busy host, a later one)
        assert link.resent >= 2
        return events

    run(sim, body, live=lambda octet: False, timeout_s=COUNTING_TIMEOUT_S)


def test_send_now_many_writes_every_modules_first_packet_before_any_second(sim: RoiSim) -> None:
    """The bus stop's write: each module's packets in their order, each module's first before any module's second
    (as they reach the modules' sockets: the simulator's stop_log, kernel times); one reply future per packet,
    each module's time the moment its last packet left."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.watch_stop()
        gpio = [p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x00"),
                p.GeneralPacket(3, p.GpioAction.SET_PIN_MODE, bytes([p.PinMode.OUTPUT])),
                p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x00")]
        odrive = [p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0), p.odrive_request(p.OdriveAction.SET_TORQUE, 0.0),
                  p.odrive_request(p.OdriveAction.SET_VELOCITY, 0.0)]
        t0 = time.time()
        sent = tr.send_now_many([(10, gpio), (20, odrive), (30, [])])
        assert [len(futs) for _, futs in sent] == [3, 3, 0]
        assert t0 <= sent[0][0] and t0 <= sent[1][0]
        for octet, pkts, (_, futs) in ((10, gpio, sent[0]), (20, odrive, sent[1])):
            done, _ = await asyncio.wait(futs, timeout=5.0)
            assert len(done) == len(futs)
            assert [f.result().action for f in futs] == [pkt.action for pkt in pkts]
            tr.forget(octet, pkts, futs)
        return events

    run(sim, body)
    log = [(st.octet, st.action) for st in sim.stop_log()]
    # SET_OUTPUT and SET_VELOCITY 0 are what the simulator logs as stops: GPIO's 1st and 3rd, ODrive's 1st and 3rd
    assert log == [(10, p.GpioAction.SET_OUTPUT), (20, p.OdriveAction.SET_VELOCITY), (10, p.GpioAction.SET_OUTPUT),
                   (20, p.OdriveAction.SET_VELOCITY)], log


def test_unmatched_and_corrupt_replies_are_counted(sim: RoiSim) -> None:
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.set_faults(10, duplicate=True)
        await tr.general(10, p.GeneralPacket(12, p.GpioAction.READ))
        link = tr.links[10]
        for _ in range(200):
            if link.unmatched:
                break
            await asyncio.sleep(0.01)
        assert link.unmatched == 1 and tr.totals.unmatched == 1
        sim.set_faults(10, duplicate=False, corrupt_rate=1.0)
        with pytest.raises(RequestLost):
            await tr.general(10, p.GeneralPacket(12, p.GpioAction.READ), retries=2)
        assert link.bad_checksum == 3 and tr.totals.by_reason["checksum"] == 3
        return events

    events = run(sim, body, timeout_s=COUNTING_TIMEOUT_S)
    assert events.count((10, "garbage")) == 3 and events.count((10, "reply")) == 1  # the duplicate: neither


def test_sysadmin_reply_with_bad_checksum_is_dropped_and_counted(sim: RoiSim) -> None:
    """§2.4: BaseModule::sysadminResponseCallback had its condition inverted and never dropped anything."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.set_faults(20, corrupt_rate=1.0)
        with pytest.raises(RequestLost):
            await tr.sysadmin(20, p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, origin=100), retries=1)
        assert tr.links[20].bad_checksum == 2 and tr.links[20].replies == 0
        return events

    run(sim, body, timeout_s=COUNTING_TIMEOUT_S)


def test_blacklist_reply_never_sent_does_not_disconnect(sim: RoiSim) -> None:
    """§3.2: BLACK_LIST falls through to default and is never answered; that silence is not a lost request."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        await tr.general(10, p.GeneralPacket(12, p.GpioAction.READ))
        rep = await tr.sysadmin(10, p.SysAdminPacket(p.SysAdminAction.BLACK_LIST,
                                                     p.blacklist_payload(p.BlacklistOp.ADD, 42), origin=100),
                                expect_reply=False)
        assert rep is None
        link = tr.links[10]
        assert link.lost_total == 0 and link.sent == 2
        assert sim.call(10, lambda fw: 42 in fw.blacklist)
        return events

    run(sim, body, timeout_s=COUNTING_TIMEOUT_S)


def test_requests_to_one_module_are_serialised_and_modules_run_concurrently(sim: RoiSim) -> None:
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        for o in OCTETS:
            sim.set_faults(o, delay_s=0.1)  # each reply is held; the resend time below is longer
        work = asyncio.gather(*(tr.general(10, p.GeneralPacket(pin, p.GpioAction.READ)) for pin in range(3)),
                              tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL)),
                              tr.general(30, p.GeneralPacket(0, p.ActuatorAction.GET_CURRENT_LENGTH)))
        per_module, modules = 0, 0
        while not work.done():
            pending = [k[0] for k in tr._pending]
            per_module = max([per_module] + [pending.count(o) for o in OCTETS])
            modules = max(modules, len(set(pending)))
            await asyncio.sleep(0.002)
        reps = await work
        assert [r.sub_device_id for r in reps[:3]] == [0, 1, 2]
        assert per_module == 1  # one request in flight per module and port
        assert modules == 3  # the three modules were served at the same time
        return events

    run(sim, body, timeout_s=1.0)


def _background(make):  # type: ignore[no-untyped-def]
    """Run `make()` as the maintain loop's traffic (its own task, marked background; tasks it makes inherit)."""
    async def run():  # type: ignore[no-untyped-def]
        background_traffic()
        return await make()
    return asyncio.ensure_future(run())


async def _until_in_flight(tr: RoiTransport, n: int = 1) -> None:
    while len(tr._pending) < n:
        await asyncio.sleep(0.002)


def test_commands_go_before_queued_maintain_traffic(sim: RoiSim) -> None:
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.set_faults(10, delay_s=0.1)  # the first request stays in flight while the others queue
        done: list[str] = []

        async def read(pin: int, tag: str) -> None:
            await tr.general(10, p.GeneralPacket(pin, p.GpioAction.READ))
            done.append(tag)

        maint = _background(lambda: asyncio.gather(read(0, "maintain 0"), read(1, "maintain 1"),
                                                   read(2, "maintain 2")))
        await _until_in_flight(tr)
        await read(5, "command")
        await maint
        assert done == ["maintain 0", "command", "maintain 1", "maintain 2"]
        assert tr.links[10].resent == 0
        return events

    run(sim, body, timeout_s=1.0)


def test_command_does_not_wait_out_a_maintain_resend(sim: RoiSim) -> None:
    """A maintain request whose reply is overdue lets a waiting command go before it resends."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.set_faults(20, drop_next=1)  # the maintain GET_ALL is lost: it would be resent after timeout_s
        maint = _background(lambda: tr.general(20, p.odrive_request(p.OdriveAction.GET_ALL)))
        await _until_in_flight(tr)
        await tr.general(20, p.odrive_request(p.OdriveAction.GET_CONTROL_MODE))
        assert not maint.done() and tr.links[20].resent == 0  # the command went before the resend
        rep = await maint
        assert rep.action == p.OdriveAction.GET_ALL and tr.links[20].resent == 1
        assert tr.links[20].lost_total == 0
        return events

    run(sim, body, timeout_s=0.3)


def test_command_with_the_same_key_but_other_bytes_waits_for_the_maintain_request(sim: RoiSim) -> None:
    """A late reply to the unanswered maintain send would match it: it waits (identical bytes would not)."""
    async def body(tr: RoiTransport, events):  # type: ignore[no-untyped-def]
        sim.set_faults(20, drop_next=1)
        done: list[str] = []

        async def setpos(value: float, tag: str) -> None:
            await tr.general(20, p.odrive_request(p.OdriveAction.SET_POSITION, value))
            done.append(tag)

        maint = _background(lambda: setpos(1.0, "maintain"))
        await _until_in_flight(tr)
        await setpos(2.0, "command")
        await maint
        assert done == ["maintain", "command"]
        assert sim.call(20, lambda fw: fw.pos_sp) == 2.0  # the command, sent last, is what the module holds
        return events

    run(sim, body, timeout_s=0.3)


def test_a_waiter_cancelled_as_the_slot_is_released_leaves_with_cancelled_error() -> None:
    """A command cancelled while it waits for its module (shutdown, a caller's timeout) must end as cancelled
    and leave the slot free: a release() that comes between the cancellation and the waiter's resumption pops
    the cancelled entry itself, and the waiter's clean-up then found nothing to remove (ValueError)."""
    from services.roi_modules.transport import _Slot

    key = (20, p.GENERAL_PORT, 0, p.OdriveAction.SET_VELOCITY)

    async def main() -> tuple[BaseException | None, bool]:
        slot = _Slot()
        await slot.acquire(True, key, b"a")  # held by a request in flight
        waiter = asyncio.ensure_future(slot.acquire(True, key, b"b"))
        await asyncio.sleep(0)  # queued behind it
        waiter.cancel()
        slot.release()  # the request in flight ends before the waiter runs again
        try:
            await waiter
        except BaseException as exc:  # what it raises is the point
            return exc, slot.busy
        return None, slot.busy

    exc, busy = asyncio.run(main())
    assert isinstance(exc, asyncio.CancelledError), repr(exc)
    assert not busy
