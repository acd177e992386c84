"""epuck-gateway's MQTT surface: one `EpuckRobot` (device.py: the device, its link, its handlers) per configured
robot, all on one asyncio loop; `EpuckGateway` sends the bus stop to them in one pass, `build()` wires it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

from services.epuck_gateway.device import EpuckRobot
from services.epuck_gateway.settings import EpuckSettings
from shared import Node
from shared.lifecycle import Hooks
from shared.stop_pass import StopPass

log = logging.getLogger("robobus.epuck")


async def serve(robots: list[EpuckRobot], pool: ThreadPoolExecutor) -> None:
    """Run every robot until cancelled; then stop each robot (stop command, drain to 0x03), close."""
    stats_tasks = []
    for r in robots:
        r.start()
        stats_tasks.append(asyncio.ensure_future(r.stats_loop()))
    log.info("serving robots", extra={"robots": [f"{r.cfg.id}@{r.cfg.address}" for r in robots]})
    try:
        await asyncio.Event().wait()
    finally:
        for t in stats_tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(r.close() for r in robots), return_exceptions=True), 3.0)
        pool.shutdown(wait=False, cancel_futures=True)
        log.info("all robots stopped")


__all__ = ["EpuckGateway", "build", "serve"]  # the settings are settings.py's


class EpuckGateway:
    """The kit's hooks for the gateway: an asyncio main serving every configured robot."""

    def __init__(self, node: Node, settings: EpuckSettings) -> None:
        self.node = node
        self.settings = settings
        # Every robot's device exists before the node connects, so a node seen online answers for each of them.
        # (Built in serve(), they appeared only once the loop ran it, and a command in between got `not_found`:
        # a busy machine delayed the loop past the online status, CONNACK and SUBACK on paho's thread.)
        self.pool = ThreadPoolExecutor(max_workers=max(1, settings.epuck_encode_workers),
                                       thread_name_prefix="epuck-encode")
        # the first call of an activation writes every WiFi robot's stop from the kit's thread (`_write_early`):
        # the loop's pass may wait behind whatever the loop has queued (after a stalled node or broker: hundreds
        # of commands and packets)
        self.stop_pass = StopPass(node, self._stop_pass, early=self._write_early)
        self.robots = [EpuckRobot(node, cfg, settings, self.pool, self.stop_pass) for cfg in settings.epuck_robots]
        self.by_id = {r.cfg.id: r for r in self.robots}

    def _write_early(self, gen: int, members: list[str]) -> dict[str, float]:
        """On the kit's thread, as it reads a stop: each robot's stop written from there where its link can
        (EpuckLink.write_stop_from_thread: WiFi, nothing half written), and the time it left; the pass writes it
        again, and the rest."""
        written: dict[str, float] = {}
        for name in members:
            r = self.by_id.get(name)
            at = r.link.write_stop_from_thread() if r is not None else None
            if at is not None:
                written[name] = at
        return written

    def _stop_pass(self, due: dict[str, int]) -> None:
        """The bus stop of the robots `due` (name -> the stop's activation count), on the loop: every robot's stop
        written one after another with nothing in between (WiFi robots first: a WiFi write never blocks, a serial
        one can wait for a full line), each stamped as it left; the reports in the loop's next turn."""
        robots = sorted((self.by_id[n] for n in due if n in self.by_id), key=lambda r: r.cfg.transport != "wifi")
        done: list[tuple[EpuckRobot, float | None, str]] = []
        first: list[str] = []  # the robots whose stop left from the kit's thread first (`_write_early`)
        for r in robots:
            early = self.stop_pass.take_early(r.cfg.id)
            thread_at = float(early[1]) if early is not None and early[0] == due[r.cfg.id] else None
            if thread_at is not None:
                first.append(r.cfg.id)
            try:
                at = r.stop_now()
                # the stop left from the kit's thread first: the time it did is this activation's answer
                done.append((r, thread_at if thread_at is not None and at is not None else at, ""))
            except Exception as exc:  # one robot's failure must not keep the stop from the others
                log.exception("bus stop: writing the stop failed", extra={"robot": r.cfg.id})
                done.append((r, None, f"{type(exc).__name__}: {exc}"))
        # the reports (the answer and the health, published per robot) after the pass: its caller waits for the
        # writes only (stop_pass.py)
        asyncio.get_running_loop().call_soon(self._report_pass, due, done, first)

    def _report_pass(self, due: dict[str, int], done: list[tuple[EpuckRobot, float | None, str]],
                     first: list[str]) -> None:
        latch = self.node.stop_latch
        for r, at, error in done:
            if error:
                latch.report(r.cfg.id, due[r.cfg.id], None, error)
            elif at is not None:
                latch.report(r.cfg.id, due[r.cfg.id], at)
            # None: the link is down; its next connection's first command is the stop (`_stop_reached`)
        owed = [r.cfg.id for r, at, error in done if at is None and not error]
        stop = latch.state
        log.warning("bus stop: robots stopped in one pass",
                    extra={"robots": [r.cfg.id for r, at, _ in done if at is not None], "owed": owed,
                           "from_thread": first,
                           "pass": self.stop_pass.passes, "source": stop.source if stop else "",
                           "reason": stop.reason if stop else ""})

    def hooks(self) -> Hooks:
        """One asyncio main: every link, handler and publisher runs on the node's loop."""
        return Hooks(serve=self.serve)

    async def serve(self) -> None:
        await serve(self.robots, self.pool)


def build(node: Node, settings: EpuckSettings) -> EpuckGateway:
    # the switch interval is the kit's setting (switch_interval_ms: 1 ms by default here, settings.py)
    return EpuckGateway(node, settings)
