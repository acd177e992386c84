"""can-bootloader benchmark: flash and verify the ~30 KB SimpleMotor-sized image (0x04C0–0x7D4B)

1. on a python-can virtual bus (CanPort + Flasher against the PIC18F2580 model with its erase and row-write
   stalls, the direct-bus window of 2), and
2. through the full bridge path at 1 kHz: MQTT request -> can-bootloader (its own process) -> robobus_bridge ->
   ethercat-loop's leased CAN bridge (palm model in this process, 1 ms cycle, one frame to the wire per
   cycle) -> the bootloader model. Also reported: palm cycles per frame (the pipeline's own efficiency,
   independent of how close the model's cycle thread got to 1 kHz on a loaded host).

The bridge's cycle-bound limit is frames x 1 ms (one frame per cycle); target: bridge time <= 1.5 x that
limit (the original SimpleMotorFlasher spent two or more cycles plus 1 ms polling per frame: 20–40 s). The
flasher's power-loss rule (services/can_bootloader/README.md) holds each row's programming frame until the row's
address and first data frames are acknowledged: the pipeline drains once a row, which a window alone would not
(1.03 cycles a frame without the rule, ~1.4 with it): the target allows that drain and no more.
Note the palm-path model answers ERASE at once (the palm model has no clock for its CAN peers); the virtual
bus run includes the ~1 s erase.

    python bench/flash.py [--quick] [--windows 1,4,8]     (--quick: ~15 s; full: ~2 min)

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET = 1.5  # bridge time / the cycle-bound limit (frames x 1 ms); see the docstring
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import can  # noqa: E402
from results import Figure, report, variant_name  # noqa: E402

from services.can_bootloader.flasher import FlashConfig, Flasher  # noqa: E402
from services.can_bootloader.image import load_intel_hex  # noqa: E402
from services.can_bootloader.settings import BRIDGE_WINDOW  # noqa: E402
from services.can_bootloader.sim import BootBoardSet, BootBusSim, make_boards, make_intel_hex  # noqa: E402
from services.can_bootloader.transport import CanBusConfig, CanPort  # noqa: E402
from shared import Node  # noqa: E402
from shared.rpc import RpcClient  # noqa: E402
from shared.tools.localbroker import Broker, free_port  # noqa: E402

HEX = make_intel_hex()
IMAGE = load_intel_hex(HEX)
CYCLE_S = 0.001


def bench_virtual(window: int) -> dict[str, Any]:
    sim_bus = can.Bus(interface="virtual", channel="bench-flash")
    sim = BootBusSim(sim_bus, make_boards([8]), row_write_s=0.002, erase_s=0.968).start()
    port = CanPort(1, CanBusConfig(interface="virtual", channel="bench-flash"))
    try:
        f = Flasher(8, IMAGE, FlashConfig(window=window))
        t0 = time.monotonic()
        f.start(t0)
        port.drive(f)
        dt = time.monotonic() - t0
        ok = sim.board(8).app_image(IMAGE.base, IMAGE.end) == IMAGE.data
        return {"seconds": round(dt, 3), "frames": port.frames_sent, "window": window,
                "flash_ok": bool(f.result and f.result.ok), "memory_ok": ok, "retries": f.snapshot().retries,
                "restarts": f.snapshot().restarts, "overflows": sim.overflows}
    finally:
        port.close()
        sim.stop()
        sim_bus.shutdown()


def _start_palm(broker: Broker, name: str) -> tuple[Any, Any, BootBoardSet, threading.Thread]:
    from services.ethercat_loop.api import API as PALM_API
    from services.ethercat_loop.service import build as build_palm
    from services.ethercat_loop.settings import EthercatSettings

    settings = EthercatSettings(mqtt_url=broker.url, node=name, backend="model", health_interval_s=1.0)
    node = Node(PALM_API, settings)
    svc = build_palm(node, settings)
    boards = BootBoardSet(make_boards([8]))
    svc.backend.model.add_can_node(boards)  # type: ignore[attr-defined]  # the model backend (ModelBackend)
    node.start()
    assert node.session.wait_ready(10)
    svc.start()
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    return node, svc, boards, t


def bench_bridge(broker: Broker, windows: list[int]) -> list[dict[str, Any]]:
    palm_name = "bench-palm"
    pnode, psvc, boards, _t = _start_palm(broker, palm_name)
    model = psvc.backend.model  # the palm model (model backend): its cycle counter
    device = psvc.settings.ethercat_device
    # can-bootloader in its own process, as in production: the palm model's cycle thread (no realtime path
    # in the model backend) then shares its GIL only with ethercat-loop's own MQTT work
    bus_cfg = {"interface": "robobus_bridge", "channel": "1", "options": {"node": palm_name, "device": device}}
    env = {**os.environ, "ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": "bench-boot",
           "ROBOBUS_CAN_BUS1": json.dumps(bus_cfg), "ROBOBUS_CAN_BUS2": "null", "ROBOBUS_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "services.can_bootloader"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with RpcClient(broker.settings(), name="bench-wait") as c:
        end = time.monotonic() + 15
        while not c.collect("robobus/bench-boot/status", 0.2, until=lambda t, p: b'"online":true' in p):
            if time.monotonic() > end:
                proc.kill()
                raise RuntimeError("can-bootloader did not come up")
    out = []
    try:
        with RpcClient(broker.settings(), name="bench-flash") as c:
            for w in windows:
                board = boards.board(8)
                with boards._lock:  # back to a blank board in its bootloader, so every run rewrites the image
                    board.flash[IMAGE.base:IMAGE.end] = b"\x00" * len(IMAGE.data)
                    board.eeprom[0xFF] = 0xFF
                    board.power_on()
                c0 = int(model.cycle)
                t0 = time.monotonic()
                rep, result = c.call_job("bench-boot", "motors", "flash", {"board": 8, "hex": HEX, "window": w},
                                         lambda e: None, timeout=300)
                dt = time.monotonic() - t0
                cycles = int(model.cycle) - c0
                if result is None or not result.get("ok"):
                    raise RuntimeError(f"bridge flash failed (window {w}): {rep.error or result}")
                res = result["result"]
                limit = res["frames_sent"] * CYCLE_S
                out.append({"window": w, "seconds": round(dt, 3), "job_seconds": res["duration_s"],
                            "frames": res["frames_sent"], "cycle_bound_s": round(limit, 3),
                            "ratio": round(dt / limit, 3), "cycles_per_frame": round(dt / limit, 2),
                            "palm_cycles": cycles, "palm_cycles_per_frame": round(cycles / res["frames_sent"], 3),
                            "palm_cycle_rate_hz": round(cycles / dt, 1), "retries": res["retries"],
                            "memory_ok": board.app_image(IMAGE.base, IMAGE.end) == IMAGE.data})
                print(f"bridge  window {w:2d}: {dt:6.2f} s for {res['frames_sent']} frames "
                      f"(cycle-bound {limit:.2f} s, ratio {dt / limit:.3f}); {cycles} palm cycles "
                      f"({cycles / res['frames_sent']:.3f} a frame, the palm ran at {cycles / dt:.0f} Hz), "
                      f"retries {res['retries']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
        psvc.shutdown()
        pnode.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run of each path (under 30 s)")
    ap.add_argument("--windows", default="", help="bridge windows to run, e.g. 1,4,8 (default: the service's "
                                                  "bridge window, 12, with --quick; else 1,4,8,12,12,12,16)")
    args = ap.parse_args()
    dw = BRIDGE_WINDOW
    windows = [int(w) for w in args.windows.split(",") if w] or ([dw] if args.quick else [1, 4, 8, dw, dw, dw, 16])
    print(f"image 0x{IMAGE.first:04X}–0x{IMAGE.last:04X}: {IMAGE.size} bytes, "
          f"{len(IMAGE.write_blocks())} blocks written of {len(list(IMAGE.blocks()))}, "
          f"{len(IMAGE.chunks())} chunks verified", flush=True)
    t_all = time.monotonic()
    virt = bench_virtual(2)
    print(f"virtual window 2: {virt['seconds']:.2f} s for {virt['frames']} frames "
          f"(PIC model: 0.968 s erase, 2 ms row writes)", flush=True)
    virt_fast = None
    if not args.quick:
        virt_fast = bench_virtual(8)
        print(f"virtual window 8: {virt_fast['seconds']:.2f} s, receive-buffer overflows {virt_fast['overflows']}, "
              f"retries {virt_fast['retries']}, restarts {virt_fast['restarts']} (why a direct bus keeps window 2)",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="robobus-bench-") as d:
        broker = Broker(free_port(), Path(d))
        broker.start()
        try:
            bridge = bench_bridge(broker, windows)
        finally:
            broker.kill()
    # the figure reported: the median run at the default bridge window, not the best of the sweep
    default = sorted((r for r in bridge if r["window"] == BRIDGE_WINDOW), key=lambda r: r["ratio"]) or bridge
    best = default[len(default) // 2]
    summary = {
        "bench": "flash",
        "image_bytes": IMAGE.size,
        "virtual_s": virt["seconds"],
        "virtual_frames": virt["frames"],
        "virtual_window8_s": virt_fast["seconds"] if virt_fast else None,
        "virtual_window8_overflows": virt_fast["overflows"] if virt_fast else None,
        "bridge_s": best["seconds"],
        "bridge_frames": best["frames"],
        "bridge_window": best["window"],
        "bridge_cycle_bound_s": best["cycle_bound_s"],
        "bridge_ratio": best["ratio"],
        "bridge_palm_cycles_per_frame": best["palm_cycles_per_frame"],
        "bridge_palm_cycle_rate_hz": best["palm_cycle_rate_hz"],
        "bridge_runs": bridge,
        "target_ratio": TARGET,
        "target_met_in_palm_cycles": best["palm_cycles_per_frame"] <= TARGET,
        "target_met": best["ratio"] <= TARGET and all(r["memory_ok"] for r in bridge) and virt["memory_ok"]
        and virt["flash_ok"],
        "original_estimate_s": [20, 40],
        "quick": args.quick,
        "total_s": round(time.monotonic() - t_all, 1),
    }
    report("flash", summary, [
        Figure(f"{IMAGE.size // 1000} KB image over the palm's CAN bridge, flash + verify ÷ the cycle bound",
               best["ratio"], "×", "<=", TARGET),
        Figure("the same through the bridge", best["seconds"], "s"),
        Figure("palm cycles per frame", best["palm_cycles_per_frame"], "", "<=", TARGET),
        Figure("flash + verify on a direct CAN bus (window 2, PIC erase included)", virt["seconds"], "s"),
    ], variant=variant_name("quick" if args.quick else ""))


if __name__ == "__main__":
    main()
