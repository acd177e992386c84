"""CLI contributed by epuck-gateway (`robobus epuck ...`, registered through the `robobus.cli` entry point).

    robobus epuck flash epuck3 firmware.elf               through the gateway serving robot epuck3 (a job:
                                                          the gateway pauses the robot's link around it)
    robobus epuck flash /dev/ttyACM0 firmware.elf         a robot on this computer's USB: the programmer's port

Both check the ELF here first (32-bit ARM, loads inside the STM32F407's flash) and show a progress bar.
Exit status: 0 done; 1 failed; 2 bad arguments or not an e-puck2 firmware; 3 programmer not found; 4 timeout.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from services.epuck_gateway.firmware import BadFirmware, FirmwareError, ProgrammerNotFound, check_elf, flash_firmware
from shared.cli import Broker, Root, _client, console, err_console, run_job_with_progress

EXIT_FAILED, EXIT_USAGE, EXIT_NO_PROGRAMMER, EXIT_TIMEOUT = 1, 2, 3, 4

epuck_app = typer.Typer(add_completion=False, no_args_is_help=True, help="e-puck2 robots (epuck-gateway).")


def _fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    err_console.print(f"[red]robobus: {message}[/red]")
    return typer.Exit(code)


def is_local_port(robot: str) -> bool:
    """A serial device path or a GDB server's host:port, rather than a robot's name on the bus."""
    return robot.startswith(("/", ".")) or bool(re.match(r"^(COM\d+|[\w.-]+:\d+)$", robot))


@epuck_app.command("flash")
def flash(
    robot: Annotated[str, typer.Argument(help="The robot's device name on the bus (e.g. epuck3), or its programmer's "
                                              "port on this computer (/dev/ttyACM0)")],
    firmware: Annotated[Path, typer.Argument(help="The firmware ELF")],
    programmer: Annotated[str | None, typer.Option(help="Through the gateway: the programmer's port on the gateway's "
                                                        "host, when the robot's settings name none")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip compare-sections after the load")] = False,
    node: Annotated[str, typer.Option("--node", help="epuck-gateway node name")] = "epuck-gateway",
    broker: Broker = None,
    root: Root = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job to be accepted")] = 30.0,
    job_timeout: Annotated[float, typer.Option(help="Seconds to wait for the result")] = 600.0,
) -> None:
    """Update the firmware of an e-puck2's main MCU through its onboard programmer (gdb-multiarch)."""
    try:
        image = check_elf(firmware)
    except FirmwareError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    console.print(f"{firmware}: {image.size} bytes in {len(image.segments)} segment(s), entry 0x{image.entry:08x}")
    if is_local_port(robot):
        _flash_here(robot, firmware, not no_verify)
        return
    req: dict[str, Any] = {"elf_base64": base64.b64encode(firmware.read_bytes()).decode(), "verify": not no_verify}
    if programmer:
        req["programmer"] = programmer
    c = _client(broker, root)
    try:
        rep, result = run_job_with_progress(c, node, robot, "flash", req, timeout, job_timeout)
    except TimeoutError as exc:
        raise _fail(str(exc), EXIT_TIMEOUT) from None
    finally:
        c.close()
    if not rep.ok:
        err = rep.error or {}
        raise _fail(f"{err.get('code')}: {err.get('message')}", EXIT_USAGE if err.get("code") == "invalid_request"
                    else EXIT_FAILED)
    if result is None:
        raise _fail("the job gave no result")
    if not result.get("ok"):
        err = result.get("error") or {}
        code = EXIT_NO_PROGRAMMER if err.get("code") == "unavailable" else EXIT_FAILED
        raise _fail(f"{'cancelled' if result.get('cancelled') else err.get('code')}: {err.get('message')}", code)
    body = result.get("result") or {}
    console.print(f"[green]{robot}: {body.get('bytes_loaded')} bytes loaded"
                  f"{', verified' if body.get('verified') else ''} in {body.get('duration_s')} s[/green]")


def _flash_here(port: str, firmware: Path, verify: bool) -> None:
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=err_console) as bar:
        task = bar.add_task("connect", total=None)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total or None)

        try:
            res = flash_firmware(port, firmware, progress, verify=verify)
        except ProgrammerNotFound as exc:
            raise _fail(str(exc), EXIT_NO_PROGRAMMER) from None
        except BadFirmware as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        except FirmwareError as exc:
            raise _fail(str(exc)) from None
    console.print(f"[green]{port}: {res.bytes_loaded} bytes loaded{', verified' if res.verified else ''} "
                  f"in {res.duration_s} s[/green]")
