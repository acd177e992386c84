"""The simulated robots' command line: WiFi robots on consecutive TCP ports and serial robots on ptys, in one process.

    python -m services.epuck_gateway.sim --count 2 --base-port 11000                  # WiFi robots only
    python -m services.epuck_gateway.sim --count 0 --serial-count 2 --serial-link /tmp/tty-epuck   # serial only
    python -m services.epuck_gateway.sim --count 2 --serial-count 1 --serial-link /tmp/tty-epuck   # both

Prints `{"ready": true, "robots": {name: port}, "ports": {name: link}}` once every robot is up; SIGUSR1 prints the
WiFi robots' counters (`{"stats": ...}`, again at exit); SIGUSR2 arms every robot's stop watch (stop_watch.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time

from services.epuck_gateway.sim.serial import EpuckSerialSimConfig, EpuckSerialSimulator
from services.epuck_gateway.sim.wifi import EpuckSimConfig, EpuckSimulator

log = logging.getLogger("robobus.epuck.sim")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Simulated e-puck2 robots: WiFi (TCP) and serial (asercom v2 on a pty)")
    p.add_argument("--count", type=int, default=2, help="WiFi robots, on consecutive ports")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=11000, help="port of the first robot (a real one uses 1000)")
    p.add_argument("--sensors-hz", type=float, default=50.0, help="cycle rate; 0 = line rate")
    p.add_argument("--image-fps", type=float, default=10.0, help="image rate cap; 0 = every cycle")
    p.add_argument("--stamp", action="store_true", help="benchmarks: send time in magnetometer X")
    p.add_argument("--free-sensors", action="store_true",
                   help="benchmarks: sensors every cycle and images when due, instead of the firmware's cycle that "
                        "waits for each image (a heavier load profile)")
    p.add_argument("--serial-count", type=int, default=0,
                   help="also this many robots on serial ports (asercom v2 on ptys), in this same process")
    p.add_argument("--serial-link", default="/tmp/robobus-epuck-serial",
                   help="path prefix of the serial robots' port symlinks; robot N is <link>N")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s epuck-sim %(message)s")
    cfg = EpuckSimConfig(sensors_hz=a.sensors_hz, image_fps=a.image_fps, stamp=a.stamp,
                         image_holds_cycle=not a.free_sensors)
    sim = EpuckSimulator(a.count, a.host, a.base_port, cfg)
    # The serial robots beside the WiFi ones (make run's demo): peers of the same gateway that need no process
    # of their own, where a second one would hold ~35 MB more (an interpreter, asyncio, numpy for the camera).
    serial = EpuckSerialSimulator(a.serial_count, a.serial_link, EpuckSerialSimConfig(stamp=a.stamp))
    watched = [*(r.stop_watch for r in sim.robots), *(r.stop_watch for r in serial.robots)]

    def arm_stop_watches() -> None:
        for w in watched:
            w.arm()
        print(json.dumps({"stop_watch_armed": {"ts": time.time(), "monotonic": time.monotonic()}}), flush=True)

    for w in watched:
        w.listener = lambda seen: print(seen.to_json(), flush=True)

    async def run() -> None:
        await sim.start()
        await serial.start()
        where = [f"{r.name}@{a.host}:{r.port}" for r in sim.robots] + [f"{r.name}@{r.link}" for r in serial.robots]
        log.info(f"serving {', '.join(where)}")
        print(json.dumps({"ready": True, "robots": {r.name: r.port for r in sim.robots},
                          "ports": {r.name: r.link for r in serial.robots}}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # SIGUSR1: print the counters and keep running (benchmarks read them mid-run)
        loop.add_signal_handler(signal.SIGUSR1, lambda: print(json.dumps({"stats": sim.summary()}), flush=True))
        # SIGUSR2: time-stamp each robot's first stop from now on (one stop_seen line per robot)
        loop.add_signal_handler(signal.SIGUSR2, arm_stop_watches)
        await stop.wait()
        await serial.stop()
        await sim.stop()
        print(json.dumps({"stats": sim.summary()}), flush=True)

    asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()
