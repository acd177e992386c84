"""`robobus record` / `replay` / `inspect` / `recover`: the bus in MCAP files.

Registered as `robobus.cli` entry points (pyproject.toml); `python -m shared.tools.record_cli` runs the same
commands without the rest of the CLI (the `recorder` process of `make run` and compose uses it).

    robobus record -o run.mcap                     # everything under the topic root, until Ctrl-C
    robobus record 'robobus/epuck-gateway/#' --max-size 500MB --max-duration 1h -o runs/epuck.mcap
    robobus inspect run.mcap                       # topics, counts, rates, time range, schemas
    robobus replay run.mcap --root replay --rate 2 # twice as fast, under another root
    robobus recover killed.mcap -o fixed.mcap      # a file a killed recorder left
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from shared.settings import load_settings

console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 240)

Broker = Annotated[str | None, typer.Option("--broker", "-b", help="Broker URL (default ROBOBUS_MQTT_URL)")]


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 500MB, 2GB, 1048576)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*", text.lower())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration (e.g. 90, 90s, 10m, 2h)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def record(
    filters: Annotated[list[str] | None, typer.Argument(help="MQTT topic filters (default: ROOT/#)")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="MCAP file; {time} = start time "
                                               "(default ROBOBUS_RECORD_PATH)")] = None,
    broker: Broker = None,
    root: Annotated[str | None, typer.Option("--root", help="Topic root (default ROBOBUS_TOPIC_ROOT)")] = None,
    max_size: Annotated[str | None, typer.Option("--max-size", help="Rotate at this size, e.g. 500MB")] = None,
    max_duration: Annotated[str | None, typer.Option("--max-duration", help="Rotate after, e.g. 10m")] = None,
    compression: Annotated[str | None, typer.Option(help="zstd, lz4 or none")] = None,
    wait_broker: Annotated[float, typer.Option(help="Exit 3 if the broker is not reached in this many "
                                               "seconds (0 = keep trying, for unattended runs)")] = 10.0,
    seconds: Annotated[float, typer.Option(help="Stop after this many seconds (0 = until Ctrl-C)")] = 0.0,
    info: Annotated[Path | None, typer.Option("--info", help="Describe a recording instead (= inspect)")] = None,
    foxglove_images: Annotated[bool | None, typer.Option(
        "--foxglove-images/--no-foxglove-images", help="Beside each image topic's raw bytes, a channel of the same "
        "topic as foxglove.CompressedImage (default ROBOBUS_RECORD_FOXGLOVE_IMAGES, on)")] = None,
    if_enabled: Annotated[bool, typer.Option("--if-enabled", help="Record only when ROBOBUS_RECORD=1, else "
                                             "idle until stopped (make run's Procfile)")] = False,
) -> None:
    """Record the bus into MCAP (chunked, compressed, indexed); Ctrl-C closes the file cleanly."""
    if info is not None:
        inspect_cmd(info)
        return
    if if_enabled and os.environ.get("ROBOBUS_RECORD", "0").strip().lower() not in ("1", "true", "yes", "on"):
        # make run's supervisor starts a process that exits again: stay, quietly, until stopped
        err.print("robobus record: bus recording off (ROBOBUS_RECORD=1 records the bus into "
                  f"{os.environ.get('ROBOBUS_RECORD_PATH', 'recordings/')})", highlight=False)
        _stop_on_signals().wait()
        return
    from shared.logs import setup_logging
    from shared.tools.bus_catalog import TopicCatalog, load_document
    from shared.tools.recorder import LeanSubscriber, Recorder, RecorderSettings, RecordOptions

    overrides: dict[str, Any] = {}
    if broker:
        overrides["mqtt_url"] = broker
    if root:
        overrides["topic_root"] = root
    if max_size:
        overrides["record_max_bytes"] = _size(max_size)
    if max_duration:
        overrides["record_max_duration_s"] = _duration(max_duration)
    if compression:
        overrides["record_compression"] = compression
    if filters:
        overrides["record_filters"] = filters
    if foxglove_images is not None:
        overrides["record_foxglove_images"] = foxglove_images
    settings = load_settings(RecorderSettings, **overrides)
    setup_logging("WARNING" if settings.log_level == "INFO" else settings.log_level, settings.log_json)
    subs = settings.record_filters or [f"{settings.topic_root}/#"]
    doc = load_document(settings.record_asyncapi)
    opts = RecordOptions.from_settings(settings, subs, doc, output)
    stop = _stop_on_signals()
    try:
        recorder = Recorder(opts, TopicCatalog.from_document(doc, settings.topic_root))
    except OSError as exc:
        err.print(f"[red]robobus record: cannot write {opts.path}: {exc}[/red]")
        raise typer.Exit(1) from None
    sub = LeanSubscriber(settings, subs, recorder.write, session_expiry_s=settings.record_session_expiry_s)
    status = StatusLine(recorder, sub, tty=sys.stderr.isatty())
    err.print(f"robobus record: {' '.join(subs)} from {opts.broker} -> {opts.path}"
              f"{' (rotating)' if recorder.rotating else ''}; Ctrl-C stops", highlight=False)
    started = time.monotonic()

    def tick() -> None:
        recorder.tick()
        status.update()
        now = time.monotonic()
        if seconds and now - started >= seconds:
            stop.set()
        if wait_broker and not sub.connected.is_set() and not status.ever_connected and \
                now - started > wait_broker:
            status.gave_up = True
            stop.set()

    failure: list[BaseException] = []

    def work() -> None:
        try:
            sub.run(stop, tick)
        except BaseException as exc:  # RecordingFailed (disk full...), or a bug: stop and say so
            failure.append(exc)
            stop.set()

    worker = threading.Thread(target=work, name="record", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # the main thread stays free for signals
    try:
        recorder.close()
    except OSError as exc:
        failure.append(exc)
    status.finish()
    if failure:
        err.print(f"[red]robobus record: {failure[0]}[/red]")
        raise typer.Exit(1)
    if status.gave_up:
        err.print(f"[red]robobus record: no broker at {opts.broker} after {wait_broker:g} s "
                  f"({sub.last_error or 'no answer'})[/red]")
        raise typer.Exit(3)


class StatusLine:
    """The live line: messages/s, topics, messages, bytes written, current file. On a terminal it
    redraws in place once a second; otherwise (a Procfile, a container log) one line every 10 s."""

    def __init__(self, recorder: Any, sub: Any, tty: bool) -> None:
        self.recorder = recorder
        self.sub = sub
        self.tty = tty
        self.every = 1.0 if tty else 10.0
        self.last = time.monotonic()
        self.last_count = 0
        self.ever_connected = False
        self.was_subscribed = False
        self.gave_up = False

    def update(self) -> None:
        if self.sub.connected.is_set():
            self.ever_connected = True
        subscribed = self.sub.subscribed.is_set()
        if subscribed and not self.was_subscribed:
            self._print(f"robobus record: subscribed to {' '.join(self.sub.filters)}", newline=True)
        self.was_subscribed = subscribed
        now = time.monotonic()
        if now - self.last < self.every:
            return
        st = self.recorder.stats
        rate = (st.messages - self.last_count) / (now - self.last)
        self.last, self.last_count = now, st.messages
        f = self.recorder.file
        state = "REC" if subscribed else "waiting for the broker"
        line = (f"{state} {rate:8.0f} msg/s | {self.recorder.topic_count} topics | {st.messages} msgs | "
                f"{_human(self.recorder.bytes_written())} written | {f.path.name if f else '-'}")
        self._print(line, newline=not self.tty)

    def _print(self, line: str, newline: bool) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line + ("\n" if newline else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        st = self.recorder.stats
        files = ", ".join(str(p) for p in st.files)
        self._print(f"robobus record: {st.messages} messages on {self.recorder.topic_count} topics, "
                    f"{_human(st.finished_bytes)} in {files}", newline=True)


def replay(
    file: Annotated[Path, typer.Argument(help="MCAP recording", exists=True, dir_okay=False)],
    rate: Annotated[float, typer.Option(help="Speed factor (2 = twice as fast; 0 = as fast as possible)")] = 1.0,
    topics: Annotated[list[str] | None, typer.Option("--topics", help="Only recorded topics matching this "
                                                     "MQTT filter (repeatable)")] = None,
    loop: Annotated[bool, typer.Option("--loop", help="Start again at the end, until Ctrl-C")] = False,
    root: Annotated[str | None, typer.Option("--root", help="Republish under this topic root (the recorded "
                                             "root is replaced; topics outside it are skipped)")] = None,
    from_root: Annotated[str | None, typer.Option(help="The recorded root (default: from the file)")] = None,
    include_commands: Annotated[bool, typer.Option("--include-commands", help="Also replay commands and "
                                                   "inbound streams (they move hardware!)")] = False,
    no_retain: Annotated[bool, typer.Option("--no-retain", help="Publish nothing retained")] = False,
    realtime: Annotated[bool, typer.Option("--realtime", help="SCHED_FIFO for the publishing thread (root or "
                                           "CAP_SYS_NICE): tighter timing on a busy host")] = False,
    broker: Broker = None,
) -> None:
    """Republish a recording with its original timing (or scaled), optionally under another root."""
    from shared.tools.recorder import RecorderSettings
    from shared.tools.replay import RecordingError, Replayer, ReplayOptions, connect_publisher

    if rate < 0:
        raise typer.BadParameter("--rate must be >= 0")
    overrides: dict[str, Any] = {"mqtt_url": broker} if broker else {}
    if root:
        overrides["topic_root"] = root  # validated like any topic root
    settings = load_settings(RecorderSettings, **overrides)
    opts = ReplayOptions(rate=rate, topics=tuple(topics or ()), loop=loop, root=root, from_root=from_root,
                         include_commands=include_commands, retain=not no_retain, realtime=realtime)
    try:
        pub = connect_publisher(settings)
    except ConnectionError as exc:
        err.print(f"[red]robobus replay: {exc}[/red]")
        raise typer.Exit(3) from None
    stop = _stop_on_signals()
    rp = Replayer(file, opts, pub.publish)
    try:
        stats = rp.run(stop)
        pub.drain()
    except RecordingError as exc:
        err.print(f"[red]robobus replay: {file}: {exc}[/red]")
        raise typer.Exit(1) from None
    except ConnectionError as exc:
        err.print(f"[red]robobus replay: {exc}[/red]")
        raise typer.Exit(3) from None
    finally:
        pub.close()
    late = sorted(stats.late_ns)
    timing = ""
    if late:
        timing = (f"; publish lateness p50 {late[len(late) // 2] / 1e6:.2f} ms, "
                  f"p99 {late[min(len(late) - 1, int(len(late) * 0.99))] / 1e6:.2f} ms")
    skipped = ""
    if stats.skipped_commands:
        skipped = f"; {stats.skipped_commands} command messages not replayed"
        if not include_commands:
            skipped += " (--include-commands replays them)"
    if stats.skipped_outside_root:
        skipped += f"; {stats.skipped_outside_root} outside the recorded root skipped"
    rt = f"; {rp.realtime_note}" if rp.realtime_note else ""
    err.print(f"robobus replay: {stats.published} messages published ({stats.loops} pass(es)){skipped}{timing}{rt}",
              highlight=False)


def inspect_cmd(
    file: Annotated[Path, typer.Argument(help="MCAP recording", exists=True, dir_okay=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
) -> None:
    """Topics, message counts, rates, time range and the schema of every channel of a recording."""
    from dataclasses import asdict

    from shared.tools.replay import RecordingError, inspect

    try:
        s = inspect(file)
    except RecordingError as exc:
        err.print(f"[red]robobus inspect: {file}: {exc}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(asdict(s), indent=2))
        return

    def ts(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if ns else "-"

    m = s.metadata
    console.print(f"[bold]{s.path}[/]  {_human(s.size)}, {s.messages} messages, {len(s.channels)} channels, "
                  f"{s.chunks} chunks ({s.compression}), written by {s.library}", highlight=False)
    console.print(f"time  {ts(s.start_ns)} -> {ts(s.end_ns)} UTC  ({s.duration_s:.3f} s)", highlight=False)
    if m:
        console.print(f"from  {m.get('broker', '?')} root '{m.get('root', '?')}' filters {m.get('filters', '?')} "
                      f"on {m.get('hostname', '?')} (part {m.get('part', '0')})", highlight=False)
    table = Table()
    for col in ("topic", "count", "rate Hz", "kind", "schema / encoding", "flags"):
        table.add_column(col, justify="right" if col in ("count", "rate Hz") else "left")
    for c in s.channels:
        flags = " ".join(f for f, on in (("retained", c.retain), ("command", c.node_receives),
                                         ("derived, not replayed", c.derived)) if on)
        enc = c.schema if c.schema != "-" else c.encoding
        table.add_row(c.topic, str(c.count), f"{c.rate_hz:.2f}", c.kind, enc, flags)
    console.print(table)


def recover_cmd(
    file: Annotated[Path, typer.Argument(help="A damaged or unfinished MCAP file", exists=True, dir_okay=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the repaired file")],
) -> None:
    """Repair a file a killed recorder left: keep every whole record, write a complete indexed file."""
    from shared.tools.replay import recover

    r = recover(file, output)
    note = f" (reading stopped at: {r.error})" if r.error else " (the input was complete)"
    err.print(f"robobus recover: {r.messages} messages on {r.channels} channels -> {output}{note}", highlight=False)


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Record and replay the bus in MCAP.")
app.command("record")(record)
app.command("replay")(replay)
app.command("inspect")(inspect_cmd)
app.command("recover")(recover_cmd)

if __name__ == "__main__":
    app()
