"""DexterLink against the simulated DexRun: stop-and-wait, timeouts, keepalive, reconnect, reassembly."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from services.dexter_gateway import protocol as p
from services.dexter_gateway.sim import DexterSim, DexterSimConfig
from services.dexter_gateway.transport import DexterLink, DexterLinkConfig, DexterLinkError

T = TypeVar("T")


@pytest.fixture
def sim() -> Iterator[DexterSim]:
    s = DexterSim(DexterSimConfig(port=0, max_speed_deg_s=200, acceleration_deg_s2=4000)).start()
    yield s
    s.close()


async def wait_for(pred: Callable[[], Any], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())


def run_link(sim: DexterSim, body: Callable[[DexterLink], Awaitable[T]], **cfg: Any) -> T:
    async def main() -> T:
        link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=sim.port, **cfg))
        link.start()
        try:
            assert await wait_for(lambda: link.serving), link.message
            return await body(link)
        finally:
            await link.close()
    return asyncio.run(main())


def test_commands_from_many_callers_are_serialised(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        n0 = sim.stats.commands
        reps = await asyncio.gather(*(link.request("h") for _ in range(40)))
        assert all(r.reply.error == 0 and r.reply.oplet == "h" for r in reps)
        ids = [r.reply.instruction_id for r in reps]
        assert len(set(ids)) == 40
        # strictly one command per recv: the simulator saw every one of them as its own command
        assert sim.stats.commands - n0 >= 40 and sim.stats.crashes == 0
        assert link.stats.rtt_avg_ms > 0
    run_link(sim, body)


def test_queue_limit_answers_busy(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        sim.delay_replies(0.3, 1)
        tasks = [asyncio.ensure_future(link.request("h")) for _ in range(4)]
        res = await asyncio.gather(*tasks, return_exceptions=True)
        busy = [r for r in res if isinstance(r, DexterLinkError) and r.code == "busy"]
        assert busy and link.stats.busy == len(busy)
        assert any(not isinstance(r, Exception) for r in res)
    run_link(sim, body, queue_limit=2)


def test_timeout_resets_the_link_and_it_comes_back(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        sim.drop_replies(1)
        t0 = time.monotonic()
        with pytest.raises(DexterLinkError) as ei:
            await link.request("h")
        assert ei.value.code == "timeout" and time.monotonic() - t0 >= 0.25
        assert link.stats.timeouts == 1
        assert await wait_for(lambda: link.serving and link.stats.reconnects == 1)
        assert (await link.request("h")).reply.error == 0
    run_link(sim, body, reply_timeout_s=0.3, reconnect_min_s=0.05)


def test_longer_allowance_for_z_and_queued_moves(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        rep = await link.request("z", [500000])  # 0.5 s sleep > the 0.3 s reply timeout
        assert rep.reply.error == 0 and rep.rtt_s >= 0.45
        assert link.timeout_for(link.prepare("F")) == link.config.motion_timeout_s
        assert link.timeout_for(link.prepare("a", [0] * 5)) == link.config.fifo_timeout_s
        assert link.timeout_for(link.prepare("S", ["RunFile", "x.make_ins"])) == link.config.motion_timeout_s
    run_link(sim, body, reply_timeout_s=0.3)


def test_keepalive_outlives_dexrun_idle_close() -> None:
    with DexterSim(DexterSimConfig(port=0, idle_close_s=0.5)) as sim:
        async def body(link: DexterLink) -> None:
            await asyncio.sleep(2.0)  # four idle-close periods without a command of ours
            assert sim.stats.idle_closes == 0 and link.stats.reconnects == 0 and link.serving
            assert link.stats.keepalives >= 3
        run_link(sim, body, keepalive_s=0.2)


def test_without_keepalive_the_idle_close_is_survived_by_reconnecting() -> None:
    with DexterSim(DexterSimConfig(port=0, idle_close_s=0.3)) as sim:
        async def body(link: DexterLink) -> None:
            assert await wait_for(lambda: sim.stats.idle_closes >= 1 and link.stats.reconnects >= 1, 10)
            assert await wait_for(lambda: link.serving)
            assert (await link.request("h")).reply.error == 0
        run_link(sim, body, keepalive_s=60, reconnect_min_s=0.05)


def test_split_and_coalesced_replies(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        sim.split_replies(3, pieces=7, gap_s=0.01)
        for _ in range(3):
            assert (await link.request("h")).reply.oplet == "h"
        sim.coalesce_replies(2)
        for _ in range(3):
            assert (await link.request("h")).reply.oplet == "h"
        assert link.stats.stale_replies == 2 and link.stats.reconnects == 0
    run_link(sim, body)


def test_garbage_puts_the_stream_out_of_step_and_the_link_resets(sim: DexterSim) -> None:
    errors: list[str] = []

    async def body(link: DexterLink) -> None:
        link._on_decode_error = errors.append
        sim.garbage(b"\x01\x02\x03")
        with pytest.raises(DexterLinkError) as ei:
            await link.request("h")
        assert ei.value.code in ("device_error", "timeout")
        assert await wait_for(lambda: link.serving and link.stats.reconnects >= 1)
        assert (await link.request("h")).reply.error == 0
    run_link(sim, body, reply_timeout_s=0.5, reconnect_min_s=0.05)
    assert errors


def test_second_client_waits_until_the_arm_is_free(sim: DexterSim) -> None:
    holder = socket.create_connection(("127.0.0.1", sim.port))
    holder.sendall(p.build_request("g").encode())
    assert len(holder.recv(240)) > 0

    async def main() -> None:
        link = DexterLink("arm", DexterLinkConfig(host="127.0.0.1", port=sim.port, reply_timeout_s=0.3,
                                                  reconnect_min_s=0.05, reconnect_max_s=0.2))
        link.start()
        await asyncio.sleep(1.0)
        assert not link.serving and "another client" in link.message
        with pytest.raises(DexterLinkError) as ei:
            await link.request("h")
        assert ei.value.code == "unavailable"
        holder.close()
        assert await wait_for(lambda: link.serving, 10)
        await link.close()
    asyncio.run(main())


def test_invalid_requests_never_reach_the_queue(sim: DexterSim) -> None:
    async def body(link: DexterLink) -> None:
        n0 = sim.stats.commands
        with pytest.raises(p.ProtocolError):
            await link.request("z")
        with pytest.raises(p.ProtocolError):
            await link.request("a", [1, 2, 3])
        assert sim.stats.commands == n0
    run_link(sim, body)
