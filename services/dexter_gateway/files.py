"""An arm's file channel: the `read_file` and `write_file` jobs (`r` and `W` blocks), one at a time per arm.

DexRun keeps one write handle, one #keyword and one shell per connection, so one file job holds the channel
(`busy`: the arm refuses raw `r`/`W` meanwhile, and its status poller slips a `g` in between two blocks). A transfer
owns the link for its whole run (`ArmLink.hold`) on one long-lived thread per arm: measured, a new thread per job
waited ~35-40 µs longer for each block's reply than the raw client (README, "Performance").
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.dexter_gateway import protocol as p
from services.dexter_gateway.arguments import check_shell
from services.dexter_gateway.link import ArmLink, DexterLinkError, Hold
from services.dexter_gateway.models import DexterFileContent, DexterFileWritten, DexterReadFile, DexterWriteFile
from services.dexter_gateway.protocol import Firmware, ProtocolError, Request
from services.dexter_gateway.replies import errno_error, link_error
from services.dexter_gateway.settings import DexterSettings
from shared import CommandError, ErrorCode, JobContext


class FileJobs:
    """The arm's file jobs: what its `read_file` / `write_file` handlers (device.py) admit and run."""

    def __init__(self, arm_id: str, link: ArmLink, firmware: Firmware, settings: DexterSettings,
                 on_decode_error: Callable[[str], None]) -> None:
        self.arm_id = arm_id
        self.link = link
        self.firmware = firmware
        self.settings = settings
        self._on_decode_error = on_decode_error
        self.job: str | None = None  # the job holding the file channel (r/W keep state on the robot)
        self._lock = threading.Lock()
        self._transfers = ThreadPoolExecutor(1, thread_name_prefix=f"dexter-transfer-{arm_id}")

    @property
    def busy(self) -> bool:
        return self.job is not None

    def close(self) -> None:
        self._transfers.shutdown(wait=False)  # a running transfer ends at its next block (the link is stopping)

    def check_shell(self, target: str) -> None:
        s = self.settings
        check_shell(target, enabled=s.dexter_shell_enabled, allowlist=s.dexter_shell_allowlist,
                    firmware=self.firmware)

    # -- admission ----------------------------------------------------------------------------------
    # Every job's request is judged before a job id exists: what can be refused up front (a path DexRun would
    # cut or misparse, data that is not base64, a request over 255 bytes) gets `invalid_request` in the command's
    # reply and no job starts; only what the robot alone can say (ENOENT, EBUSY...) ends in the job's result.
    def _check(self, oplet: str, args: Sequence[Any]) -> None:
        try:
            self.link.prepare(oplet, args)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    def _admit(self, req: Any) -> None:
        if not self.link.serving:
            raise link_error(DexterLinkError("unavailable", f"arm {self.arm_id} is not connected: {self.link.message}"))
        with self._lock:
            if self.job is not None:
                raise CommandError(ErrorCode.BUSY, f"a {self.job} job is using the arm's file channel "
                                   "(DexRun keeps one write handle, one keyword and one shell)")
            self.job = "read_file" if isinstance(req, DexterReadFile) else "write_file"

    def admit_read(self, req: DexterReadFile) -> None:
        if p.target_kind(req.path) == "shell":
            self.check_shell(req.path)
        self._check("r", ("0", req.path))  # block 0 in full: a file path, a #keyword or a shell line
        self._admit(req)

    def admit_write(self, req: DexterWriteFile) -> None:
        _write_data(req)
        self._check("W", ("f", "0", req.path))  # the data blocks are write_requests' own, valid by construction
        self._admit(req)

    # -- the jobs -----------------------------------------------------------------------------------
    def read(self, req: DexterReadFile, job: JobContext) -> DexterFileContent:
        def run() -> DexterFileContent:
            with self._transfer(job) as hold:
                return self._read_file(req, job, hold)
        try:
            return self._transfers.submit(run).result()
        finally:
            self.job = None

    def write(self, req: DexterWriteFile, job: JobContext) -> DexterFileWritten:
        try:
            return self._transfers.submit(self._write_file, req, job).result()
        finally:
            self.job = None

    @contextlib.contextmanager
    def _transfer(self, job: JobContext) -> Iterator[Hold]:
        """A file job owns the link for its whole run (`DexterLink.hold`): its blocks go back to back on the
        job's thread; link errors become the contract's codes, a cancel while waiting a cancelled result."""
        try:
            with self.link.hold(cancelled=lambda: job.cancelled) as hold:
                yield hold
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except DexterLinkError as exc:
            if job.cancelled and exc.code == "unavailable":
                job.check_cancelled()  # gave up its turn because of the cancel: a cancelled result, not an error
            raise link_error(exc) from None

    def _read_block(self, hold: Hold, block: int, target: str) -> p.ReadBlock:
        # block 0 is validated in full; later blocks differ only in the block number
        req = self.link.prepare("r", (str(block), target)) if block == 0 else p.Request("r", (str(block), target))
        rep = hold.exchange(req).reply
        try:
            return p.decode_read(rep)
        except ProtocolError as exc:
            self._on_decode_error(str(exc))
            raise CommandError(ErrorCode.DEVICE_ERROR, f"arm {self.arm_id}: undecodable r reply: {exc}") from None

    def _read_file(self, req: DexterReadFile, job: JobContext, hold: Hold, phase: str = "reading",
                   total: int = 0) -> DexterFileContent:
        kind = p.target_kind(req.path)
        data = bytearray()
        blocks = 0
        exit_status = None
        if kind == "shell":
            shell = p.ShellRead()
            target = req.path
            while not shell.done:
                job.check_cancelled()
                blk = self._read_block(hold, 1 if blocks else 0, target if not blocks else "`")
                if blocks == 0 and blk.error in (p.EBUSY, p.ECHILD):
                    raise errno_error(f"shell {req.path[1:]!r}", blk.error)
                blocks += 1
                shell.feed(blk)
                job.progress("reading", len(shell.output), 0, blocks=blocks)
                if len(shell.output) > req.max_bytes:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"output exceeds max_bytes={req.max_bytes}")
                if not blk.payload and not shell.done:
                    job.wait(0.005)  # still running: output trickles
            data, exit_status = shell.output, shell.exit_status
        else:
            prev = b""
            while True:
                job.check_cancelled()
                blk = self._read_block(hold, blocks, req.path)
                if blk.error:
                    if kind == "keyword" and blk.error == p.ESPIPE and blocks > 0:
                        break  # newest: keyword data exhausted
                    raise errno_error(f"read {req.path!r}", blk.error)
                if kind == "keyword" and blocks > 0 and blk.payload == prev and blk.length == p.MAX_CONTENT_CHARS:
                    break  # stable: past the end it repeats the previous reply's stale bytes
                blocks += 1
                data += blk.payload
                prev = blk.payload
                job.progress(phase, len(data), total, blocks=blocks)
                if len(data) > req.max_bytes:
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"{req.path!r} exceeds max_bytes={req.max_bytes}")
                if blk.length < p.MAX_CONTENT_CHARS:
                    break
                if kind == "keyword" and self.firmware is Firmware.STABLE and _complete_json(data):
                    break  # stable never says "exhausted": stop at a complete value
        out = DexterFileContent(path=req.path, kind=kind, bytes=len(data), blocks=blocks, exit_status=exit_status)
        raw = bytes(data)
        if req.encoding != "base64":
            try:
                out.text = raw.decode("utf-8")
            except UnicodeDecodeError:
                if req.encoding == "text":
                    raise CommandError(ErrorCode.INVALID_REQUEST, f"{req.path!r} is not UTF-8 text; "
                                       "ask for encoding=base64") from None
        if out.text is None:
            out.base64 = base64.b64encode(raw).decode()
        if kind == "keyword" and out.text is not None:
            try:
                out.value = p.decode_keyword(req.path, out.text)
            except ProtocolError as exc:
                self._on_decode_error(str(exc))
        return out

    def _write_file(self, req: DexterWriteFile, job: JobContext) -> DexterFileWritten:
        data = _write_data(req)  # admitted (admit_write): these cannot fail here
        try:
            seq = p.write_requests(req.path, data)
            # `W f <path>` is checked in full; the data blocks are write_requests' own escaped chunks (valid by
            # construction, tests/dexter_gateway/test_protocol.py), so each is built without unescaping it again
            built = [self.link.prepare(*seq[0]), *(Request(oplet, tuple(args)) for oplet, args in seq[1:])]
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        # bytes each block carries: every '%' in an escaped chunk starts a 3-character escape of one byte
        sizes = [0, *(len(args[2]) - 2 * args[2].count("%") if len(args) > 2 else 0 for _oplet, args in seq[1:])]
        done = 0
        last = len(built) - 1
        with self._transfer(job) as hold:
            for i, request in enumerate(built):
                if job.cancelled:
                    if i > 0:  # close DexRun's write handle (the file keeps what was written), then report it
                        with contextlib.suppress(DexterLinkError, ProtocolError):
                            hold.exchange(self.link.prepare("W", ["e", "0"]))
                    job.check_cancelled()
                try:
                    rep = hold.exchange(request).reply
                except DexterLinkError:
                    if job.cancelled and i > 0 and not hold.held:  # cancelled while waiters had the link
                        with contextlib.suppress(DexterLinkError, ProtocolError):
                            self.link.request("W", ["e", "0"])
                    raise
                if rep.error:  # DexRun reports no fopen/fwrite errors (§4.2); anything here is worth stopping for
                    raise errno_error(f"write {req.path!r}", rep.error)
                done += sizes[i]
                job.progress("writing", done, len(data), force=i == last, blocks=i)
            verified = None
            if req.verify:
                back = self._read_file(DexterReadFile(path=req.path, encoding="base64",
                                                      max_bytes=max(len(data) + 62, 62)), job, hold, "verifying",
                                       len(data))
                verified = base64.b64decode(back.base64 or "") == data if back.base64 is not None else \
                    (back.text or "").encode() == data
        if not verified and req.verify:
            raise CommandError(ErrorCode.DEVICE_ERROR, f"{req.path!r} reads back {back.bytes} bytes that differ "
                               f"from the {len(data)} written (DexRun does not report write errors)")
        return DexterFileWritten(path=req.path, bytes=len(data), blocks=len(seq) - 1, verified=verified)


def _write_data(req: DexterWriteFile) -> bytes:
    if req.text is not None:
        return req.text.encode("utf-8")
    try:
        return base64.b64decode(req.base64 or "", validate=True)
    except (binascii.Error, ValueError):
        raise CommandError(ErrorCode.INVALID_REQUEST, "base64 is not valid base64") from None


def _complete_json(data: bytearray) -> bool:
    try:
        json.loads(bytes(data))
    except ValueError:
        return False
    return True


__all__ = ["FileJobs"]
