"""CLI contributed by can-bootloader (loaded by `robobus`, see shared/tools/cli.py `_load_plugins`).

    robobus flash firmware.hex --board 8          flash one board, with a progress bar
    robobus flash firmware.hex --boards 0-19      flash several (the two buses in parallel)
    robobus flash firmware.hex --board 8 --interface socketcan --channel can0
                                                  flash through a local CAN adapter (any python-can
                                                  interface), no service and no broker needed
    robobus can send 0x70A 8 55AA55AA55AA55AA     one raw frame through ethercat-loop's send_can
    robobus can version 8 | read 8 0x4C0 64 | reset 8

Exit status: 0 success; 1 failure (the reason is printed; also a board left in its bootloader with the new
image written and verified but not started: `robobus can reset N` starts it, and a board whose bootloader area
changed, in bold red); 2 bad arguments; 3 no broker; 4 timeout (the service did not answer); 5 no answer from a
board after its RESET (the image written and verified; the board may sit in its bootloader with its answers
lost, be absent, or run a firmware that is not bootloader-aware: `robobus can version N` tells the first).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from shared.tools.cli import Broker, Root, _client, console, err_console, run_job_with_progress

NodeOpt = Annotated[str, typer.Option("--node", help="can-bootloader node name")]
DeviceOpt = Annotated[str, typer.Option("--device", help="can-bootloader device name")]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_AWARE = 3
EXIT_TIMEOUT = 4
EXIT_NO_ANSWER = 5


def parse_boards(text: str) -> list[int]:
    """'0-9,12,15-19' -> [0..9, 12, 15..19] (order kept, duplicates dropped)."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo, 0)
            b = int(hi, 0) if sep else a
        except ValueError:
            raise typer.BadParameter(f"{part!r} is not a board id or range (e.g. 0-9,12)") from None
        if a > b or a < 0 or b > 19:
            raise typer.BadParameter(f"{part!r}: board ids are 0–19")
        out.extend(i for i in range(a, b + 1) if i not in out)
    if not out:
        raise typer.BadParameter("no board ids")
    return out


def _fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    err_console.print(f"[red]robobus: {message}[/red]")
    return typer.Exit(code)


def _summary(results: list[dict[str, Any]]) -> int:
    table = Table("board", "bus", "result", "frames", "frames/s", "retries", "time (s)", "bootloader-aware")
    code = 0
    for r in results:
        aware = r.get("bootloader_aware")
        result = "[green]ok[/green]" if r["ok"] else "[yellow]no answer[/yellow]" if r.get("no_answer") else \
            "[red]failed[/red]"
        if r.get("no_answer"):
            aware = "unknown"
        table.add_row(str(r["board"]), str(r["bus"]), result,
                      str(r["frames_sent"]), f"{r['frames_per_s']:.0f}", str(r["retries"]), f"{r['duration_s']:.1f}",
                      {True: "yes", False: "[bold red]NO[/bold red]", None: "not checked", "unknown": "unknown"}[aware])
        if aware is False:
            code = max(code, EXIT_NOT_AWARE)
    failed = [r for r in results if not r["ok"]]
    if failed:  # any other failure is the worse news: exit 1; only boards that gave no answer: exit 5
        code = EXIT_NO_ANSWER if all(r.get("no_answer") for r in failed) else EXIT_FAILED
    console.print(table)
    for r in results:
        if not r["ok"]:
            err_console.print(f"[red]board {r['board']}: {r.get('reason', 'failed')}[/red]")
    for r in results:
        for w in r.get("warnings", []):
            style = "bold red" if "NOT bootloader-aware" in w or "BOOTLOADER AREA CHANGED" in w else "yellow"
            err_console.print(f"[{style}]board {r['board']}: {w}[/{style}]")
    return code


def flash(
    firmware: Annotated[Path, typer.Argument(help="Intel HEX file (read here and sent in the request)")],
    board: Annotated[int | None, typer.Option("--board", help="Board id 0–19")] = None,
    boards: Annotated[str | None, typer.Option("--boards", help="Board ids, e.g. 0-19 or 0-9,12")] = None,
    remote_path: Annotated[bool, typer.Option("--remote-path", help="FIRMWARE is a path inside the service's "
                                                                    "firmware folder, not a local file")] = False,
    window: Annotated[int | None, typer.Option(help="Frames in flight (default: the service's)")] = None,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip the post-reset bootloader-aware check")] = False,
    node: NodeOpt = "can-bootloader",
    device: DeviceOpt = "motors",
    broker: Broker = None,
    root: Root = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job to be accepted")] = 30.0,
    job_timeout: Annotated[float, typer.Option(help="Seconds to wait for the result")] = 1800.0,
    interface: Annotated[str | None, typer.Option(help="Flash here through this python-can interface (socketcan, "
                                                       "pcan, kvaser, slcan, ...) instead of the service")] = None,
    channel: Annotated[str | None, typer.Option(help="With --interface: the adapter's channel (can0, ...)")] = None,
    bitrate: Annotated[int | None, typer.Option(help="With --interface: bit rate, for adapters that set it "
                                                     "(1000000 on the hand)")] = None,
) -> None:
    """Flash motor boards over CAN, with a progress bar; non-zero exit on any failure. Through the can-bootloader
    service by default; with --interface, here, through a local CAN adapter (same flasher, same checks)."""
    if (board is None) == (boards is None):
        raise _fail("give exactly one of --board N or --boards RANGE", EXIT_USAGE)
    if interface is not None:
        if remote_path:
            raise _fail("--remote-path names a file of the service's; with --interface give a local file", EXIT_USAGE)
        try:
            ids = [board] if board is not None else parse_boards(boards or "")
        except typer.BadParameter as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        raise typer.Exit(_summary(flash_local(firmware, ids, interface, channel or "", bitrate, window, not no_check)))
    req: dict[str, Any] = {"check_bootloader_aware": not no_check}
    if window is not None:
        req["window"] = window
    if remote_path:
        req["path"] = str(firmware)
    else:
        try:
            req["hex"] = firmware.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise _fail(f"cannot read {firmware}: {exc}", EXIT_USAGE) from None
    try:
        ids = [board] if board is not None else parse_boards(boards or "")
    except typer.BadParameter as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if not all(0 <= b <= 19 for b in ids):
        raise _fail("board ids are 0–19", EXIT_USAGE)
    if len(ids) == 1:
        command, req["board"] = "flash", ids[0]
    else:
        command, req["boards"] = "flash_many", ids
    c = _client(broker, root)
    try:
        rep, result = run_job_with_progress(c, node, device, command, req, timeout, job_timeout)
    except TimeoutError as exc:
        raise _fail(str(exc), EXIT_TIMEOUT) from None
    finally:
        c.close()
    if not rep.ok:
        err = rep.error or {}
        raise _fail(f"{err.get('code')}: {err.get('message')}")
    if result is None:
        raise _fail("the job gave no result")
    if not result.get("ok"):
        err = result.get("error") or {}
        what = "cancelled" if result.get("cancelled") else str(err.get("code"))
        # `timeout`: the board gave no answer after its RESET (service.py), a state not known, not a failure seen
        raise _fail(f"{what}: {err.get('message')}", EXIT_NO_ANSWER if err.get("code") == "timeout" else EXIT_FAILED)
    body = result.get("result") or {}
    results = body.get("results", [body])
    raise typer.Exit(_summary(results))


def flash_local(firmware: Path, ids: list[int], interface: str, channel: str, bitrate: int | None,
                window: int | None, check: bool) -> list[dict[str, Any]]:
    """Flash boards one after the other through a local python-can adapter, with the service's flasher and
    checks (image validated before anything is sent, bounded retries, verify, bootloader-aware check)."""
    import threading

    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from services.can_bootloader import protocol as p
    from services.can_bootloader.image import ImageError, load_intel_hex
    from services.can_bootloader.service import CanBootService
    from services.can_bootloader.settings import CanBootSettings, default_window
    from services.can_bootloader.transport import CanBusConfig, TransportError

    if not all(0 <= b <= 19 for b in ids):
        raise _fail("board ids are 0–19", EXIT_USAGE)
    buses = sorted({p.board_address(b).bus for b in ids})
    if len(buses) > 1:
        raise _fail("one adapter is one CAN bus: boards 0–9 sit on palm bus 1, 10–19 on bus 2; flash each bus in "
                    "a run of its own", EXIT_USAGE)
    try:
        image = load_intel_hex(firmware.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError, ImageError) as exc:
        raise _fail(f"cannot use {firmware}: {exc}", EXIT_USAGE) from None
    bus = buses[0]
    cfg = CanBusConfig(interface=interface, channel=channel, bitrate=bitrate)
    settings = CanBootSettings(can_bus1=cfg if bus == 1 else None, can_bus2=cfg if bus == 2 else None,
                               can_window=window)
    svc = CanBootService(settings)
    port = svc.ports[bus]
    try:
        port.open()
    except TransportError as exc:
        raise _fail(f"cannot open the CAN adapter: {exc}", EXIT_FAILED) from None
    flash_cfg = settings.can_flash.model_copy(update={"window": window or default_window(cfg),
                                                      "check_bootloader_aware": check})
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console) as bar:
            for b in ids:
                task = bar.add_task(f"board {b}", total=None, info="")

                def report(snap: dict[str, Any], _task: Any = task, _b: int = b) -> None:
                    bar.update(_task, description=f"board {_b} {snap['phase']}", total=snap.get("total") or None,
                               completed=snap.get("done", 0), info=f"frames/s={snap.get('frames_per_s', 0):.0f}")

                res = svc.flash_board(b, image, flash_cfg, None, lock, report)
                if res.ok:
                    bar.update(task, description=f"board {b} done", completed=1, total=1)
                results.append(res.model_dump(mode="json"))
    finally:
        port.close()
    return results


can_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="Raw CAN through the palm (ethercat-loop) and bootloader commands (can-bootloader).")


def _call(node: str, device: str, command: str, req: dict[str, Any], broker: str | None, root: str | None,
          timeout: float) -> dict[str, Any]:
    c = _client(broker, root)
    try:
        rep = c.call(node, device, command, req, timeout=timeout)
    except TimeoutError as exc:
        raise _fail(str(exc), EXIT_TIMEOUT) from None
    finally:
        c.close()
    if not rep.ok:
        err = rep.error or {}
        raise _fail(f"{err.get('code')}: {err.get('message')}")
    return rep.result


@can_app.command("send")
def send(
    sid: Annotated[str, typer.Argument(help="11-bit SID, e.g. 0x70A")],
    length: Annotated[int, typer.Argument(help="Data length 0–8")],
    data: Annotated[str, typer.Argument(help="Data bytes as hex, e.g. 55AA55AA55AA55AA")] = "",
    bus: Annotated[int, typer.Option(help="Palm CAN bus 1 or 2")] = 1,
    window_ms: Annotated[int, typer.Option(help="How long to collect the frames received")] = 50,
    node: Annotated[str, typer.Option("--node", help="ethercat-loop node name")] = "ethercat-loop",
    device: Annotated[str, typer.Option("--device", help="ethercat-loop device name")] = "rh",
    broker: Broker = None,
    root: Root = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reply as JSON")] = False,
) -> None:
    """Send one frame through the palm (the seed's SendCanMessage) and print the frames received."""
    try:
        sid_v = int(sid, 0)
        raw = bytes.fromhex(data.replace(" ", "").replace(":", ""))
    except ValueError as exc:
        raise _fail(f"bad SID or data: {exc}", EXIT_USAGE) from None
    if not 0 <= sid_v <= 0x7FF:
        raise _fail(f"SID 0x{sid_v:X} is not 11 bits", EXIT_USAGE)
    if not 0 <= length <= 8 or length > len(raw):
        raise _fail(f"length {length} but {len(raw)} data byte(s) given (at most 8)", EXIT_USAGE)
    if bus not in (1, 2):
        raise _fail("bus is 1 or 2", EXIT_USAGE)
    res = _call(node, device, "send_can", {"bus": bus, "sid": sid_v, "length": length, "data": raw[:length].hex(),
                                           "window_ms": window_ms}, broker, root, 10.0 + window_ms / 1000)
    if as_json:
        print(json.dumps(res, indent=2))
        return
    frames = res.get("frames", [])
    console.print(f"sent bus {bus} 0x{sid_v:03X} [{length}] {raw[:length].hex(' ').upper()}; "
                  f"{len(frames)} frame(s) received in {window_ms} ms")
    for f in frames:
        d = bytes.fromhex(f.get("data", ""))
        console.print(f"  bus {f.get('bus')} 0x{int(f.get('sid', 0)):03X} [{len(d)}] {d.hex(' ').upper()}"
                      f"  (cycle {f.get('cycle')})")


@can_app.command("version")
def version(
    board: Annotated[int, typer.Argument(help="Board id 0–19")],
    node: NodeOpt = "can-bootloader", device: DeviceOpt = "motors", broker: Broker = None, root: Root = None,
) -> None:
    """READ_VERSION of a board's bootloader (the board must be in its bootloader)."""
    res = _call(node, device, "read_version", {"board": board}, broker, root, 10.0)
    console.print(f"board {board} (bus {res['bus']}): bootloader version {res['version']}")


@can_app.command("read")
def read(
    board: Annotated[int, typer.Argument(help="Board id 0–19")],
    address: Annotated[str, typer.Argument(help="Start address, e.g. 0x4C0")],
    length: Annotated[int, typer.Argument(help="Bytes (1–4096)")] = 64,
    node: NodeOpt = "can-bootloader", device: DeviceOpt = "motors", broker: Broker = None, root: Root = None,
) -> None:
    """Dump program memory (READ_FLASH, 8 bytes a frame)."""
    try:
        addr = int(address, 0)
    except ValueError:
        raise _fail(f"bad address {address!r}", EXIT_USAGE) from None
    res = _call(node, device, "read_flash", {"board": board, "address": addr, "length": length}, broker, root, 60.0)
    blob = bytes.fromhex(res["data"])
    for off in range(0, len(blob), 16):
        console.print(f"{addr + off:06X}  {blob[off:off + 16].hex(' ').upper()}", highlight=False)


@can_app.command("reset")
def reset(
    board: Annotated[int, typer.Argument(help="Board id 0–19")],
    node: NodeOpt = "can-bootloader", device: DeviceOpt = "motors", broker: Broker = None, root: Root = None,
) -> None:
    """RESET: the bootloader marks the application valid and starts it."""
    res = _call(node, device, "reset", {"board": board}, broker, root, 10.0)
    console.print(f"board {board} (bus {res['bus']}) reset")
