"""CLI contributed by epuck-gateway (`robobus epuck ...`, registered through the `robobus.cli` entry point).

    robobus epuck flash epuck3 firmware.elf               through the gateway serving robot epuck3 (a job:
                                                          the gateway pauses the robot's link around it)
    robobus epuck flash /dev/ttyACM0 firmware.elf         a robot on this computer's USB: the programmer's port

Both check the ELF here first (32-bit ARM, loads inside the STM32F407's flash, a vector table at the boot
address unless --force) and show a progress bar of the bytes written to flash.
Exit status: 0 done; 1 failed (the message says the robot's state when its flash was touched); 2 bad
arguments or not an e-puck2 firmware; 3 programmer not found; 4 timeout (the programmer stopped answering).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from services.epuck_gateway.protocol.firmware import (
    STALL_S,
    BadFirmware,
    FirmwareError,
    FlashTimeout,
    ProgrammerNotFound,
    check_elf,
    flash_firmware,
)
from shared.tools.cli import Broker, Root, _client, console, err_console, run_job_with_progress

EXIT_FAILED, EXIT_USAGE, EXIT_NO_PROGRAMMER, EXIT_TIMEOUT = 1, 2, 3, 4

epuck_app = typer.Typer(add_completion=False, no_args_is_help=True, help="e-puck2 robots (epuck-gateway).")


_EXIT_BY_CODE = {"invalid_request": EXIT_USAGE, "unavailable": EXIT_NO_PROGRAMMER, "timeout": EXIT_TIMEOUT}


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
    force: Annotated[bool, typer.Option("--force", help="Flash an image without a vector table at the boot address "
                                                        "0x08000000 (the robot cannot start it on its own)")] = False,
    stall_timeout: Annotated[float, typer.Option(
        min=0.5, help="Here: give up (and retry once) a load or verify without progress for this many seconds; "
                      "through the gateway its EPUCK_FLASH_STALL_S applies")] = STALL_S,
    node: Annotated[str, typer.Option("--node", help="epuck-gateway node name")] = "epuck-gateway",
    broker: Broker = None,
    root: Root = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job to be accepted")] = 30.0,
    job_timeout: Annotated[float, typer.Option(help="Seconds to wait for the result")] = 600.0,
) -> None:
    """Update the firmware of an e-puck2's main MCU through its onboard programmer (gdb-multiarch)."""
    try:
        image = check_elf(firmware, force)
    except FirmwareError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    console.print(f"{firmware}: {image.size} bytes to write in {len(image.segments)} segment(s), "
                  f"entry 0x{image.entry:08x}")
    if is_local_port(robot):
        _flash_here(robot, firmware, not no_verify, force, stall_timeout)
        return
    req: dict[str, Any] = {"elf_base64": base64.b64encode(firmware.read_bytes()).decode(), "verify": not no_verify}
    if force:
        req["force"] = True
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
        raise _fail(f"{err.get('code')}: {err.get('message')}", _EXIT_BY_CODE.get(str(err.get("code")), EXIT_FAILED))
    if result is None:
        raise _fail("the job gave no result")
    if not result.get("ok"):
        err = result.get("error") or {}
        code = _EXIT_BY_CODE.get(str(err.get("code")), EXIT_FAILED)
        raise _fail(f"{'cancelled' if result.get('cancelled') else err.get('code')}: {err.get('message')}", code)
    body = result.get("result") or {}
    console.print(f"[green]{robot}: {body.get('bytes_loaded')} bytes loaded"
                  f"{', verified' if body.get('verified') else ''} in {body.get('duration_s')} s[/green]")


def _flash_here(port: str, firmware: Path, verify: bool, force: bool, stall_s: float) -> None:
    """Flash through a programmer on this computer: the bar counts the bytes written to flash; it is full
    when the load is done and stays so through verify and detach."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=err_console) as bar:
        task = bar.add_task("connect", total=None)

        def progress(phase: str, done: int, total: int) -> None:
            if phase == "load" and total:
                bar.update(task, description=phase, completed=done, total=total)
            elif phase == "retry":
                bar.update(task, description=phase, completed=0)
            else:
                bar.update(task, description=phase)

        try:
            res = flash_firmware(port, firmware, progress, verify=verify, force=force, stall_s=stall_s)
        except ProgrammerNotFound as exc:
            raise _fail(str(exc), EXIT_NO_PROGRAMMER) from None
        except BadFirmware as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        except FlashTimeout as exc:
            raise _fail(str(exc), EXIT_TIMEOUT) from None
        except FirmwareError as exc:
            raise _fail(str(exc)) from None
        bar.update(task, description="done")
    retried = f" (after {len(res.retried)} retry: {'; '.join(res.retried)})" if res.retried else ""
    console.print(f"[green]{port}: {res.bytes_loaded} bytes loaded{', verified' if res.verified else ''} "
                  f"in {res.duration_s} s{retried}[/green]")
