"""An arm's commands to DexRun and their replies: each request validated (the argument-less ones once per arm),
sent on the caller's thread when its turn in the link's FIFO comes, its reply turned into what the command answers:
`send` (a model, for the jobs and the commands that read it) and `command` (the inline path: the short commands on
paho's network thread, the reply as the bytes the kit publishes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic_core import to_json

from services.dexter_gateway.link import ArmLink, DexterLinkError, LinkReply
from services.dexter_gateway.models import DexterCommandReply
from services.dexter_gateway.protocol import ProtocolError, Request
from services.dexter_gateway.replies import ERRNO_CODES, error_dict, link_error, reply_dict
from services.dexter_gateway.settings import DexterSettings
from services.dexter_gateway.status import StatusBook
from shared import CommandError, ErrorCode, JobContext
from shared.dispatch import Deferred
from shared.payloads import Serialized

# The inline path: the short commands run on paho's network thread, which sends the request itself
# when the arm's link is idle and waits at most this long for the reply (a DexRun `h` answers in ~50-100 µs on
# loopback); past it, the wait goes to the command pool (`Deferred`) with the link's turn, so a silent robot holds
# the node's MQTT no longer than this. Capped by the kit's own hand-over wait (`command_handoff_ms`: how long
# paho's thread already waits for a pooled handler; 0 turns the inline path off).
INLINE_WAIT_MAX_S = 0.001


class ArmExchange:
    """One arm's requests and replies (the link does the turns and the wire)."""

    def __init__(self, arm_id: str, link: ArmLink, settings: DexterSettings, book: StatusBook,
                 on_decode_error: Callable[[str], None]) -> None:
        self.arm_id = arm_id
        self.link = link
        self.settings = settings
        self.book = book  # the status mode a reply is decoded in
        self._on_decode_error = on_decode_error
        self._argless: dict[str, Request] = {}  # validated requests without arguments, by oplet (prepare)
        self.inline_wait_s = min(INLINE_WAIT_MAX_S, settings.command_handoff_ms / 1000)

    def send(self, oplet: str, args: Sequence[Any] = (), *, timeout_s: float | None = None,
             errno_reply: bool = False, fail_on_error: bool = True, job: JobContext | None = None,
             prepared: Request | None = None) -> DexterCommandReply:
        """One command, on the caller's thread; a job's cancel stops it waiting for its turn (a command
        already sent completes on the robot). `prepared`: the request already validated by the caller."""
        req = prepared if prepared is not None else self.prepare(oplet, args)
        try:
            lr = self.link.submit(req, timeout_s=timeout_s, cancelled=None if job is None else lambda: job.cancelled)
        except DexterLinkError as exc:
            raise link_error(exc) from None
        return self._reply_model(lr, errno_reply=errno_reply, fail_on_error=fail_on_error)

    def prepare(self, oplet: str, args: Sequence[Any]) -> Request:
        if not args:  # `h`, `F`, `g`...: the same request every time (the link numbers each one as it sends it)
            req = self._argless.get(oplet)
            if req is not None:
                return req
        try:
            req = self.link.prepare(oplet, args)
        except ProtocolError as exc:
            raise CommandError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        if not args:  # keyed by oplet: at most one per oplet DexRun knows (the rest fail validation above)
            self._argless[oplet] = req
        return req

    def command(self, oplet: str, args: Sequence[Any] = ()) -> Serialized:
        """A bound command's one exchange: on paho's thread (the inline path, `INLINE_WAIT_MAX_S`) when the
        link is idle and its reply comes in time; otherwise raises `Deferred`, and the kit's pool finishes it:
        the reply's wait (the turn kept: nothing overtakes it), or, with the link busy, a turn like everyone's.
        Either way the reply goes out as `Serialized` (`_reply_json`)."""
        req = self.prepare(oplet, args)
        if self.inline_wait_s <= 0:
            return self._on_pool(lambda: self.link.submit(req))
        try:
            out = self.link.try_inline(req, self.inline_wait_s)
        except DexterLinkError as exc:
            raise link_error(exc) from None
        if out is None:  # in use or queued: take a turn like everyone else, on the pool
            raise Deferred(lambda: self._on_pool(lambda: self.link.submit(req)))
        if isinstance(out, LinkReply):
            return self._reply_json(out)
        pending = out  # the reply is still to come: its wait goes to the pool, the turn with it
        raise Deferred(lambda: self._on_pool(pending.finish))

    def _on_pool(self, exchange: Callable[[], LinkReply]) -> Serialized:
        """The rest of an inline command on the kit's pool: its exchange (a turn, or the pending reply's wait)."""
        try:
            lr = exchange()
        except DexterLinkError as exc:
            raise link_error(exc) from None
        return self._reply_json(lr)

    def _reply_dict(self, lr: LinkReply, *, errno_reply: bool, fail_on_error: bool) -> dict[str, Any]:
        """The reply as one dict laid out as `DexterCommandReply` (`reply_dict`); a non-zero basic code fails
        the command when `fail_on_error`."""
        rep = lr.reply
        errno = errno_reply or rep.oplet == "r"
        if fail_on_error and rep.error:
            err = error_dict(rep.error, errno)
            if err["code"] != 0:
                code = ERRNO_CODES.get(err["code"], ErrorCode.DEVICE_ERROR) if errno else ErrorCode.DEVICE_ERROR
                raise CommandError(code, f"arm {self.arm_id}: {lr.request.oplet!r} failed: {err['message']}")
        latest, mode = self.book.latest, self.book.mode
        if latest is not None and latest[0] is rep:
            mode = latest[1]
        try:
            return reply_dict(lr, mode, self.settings.dexter_servo_deg_per_unit, self.settings.dexter_j6_zero_units,
                              time.time(), errno_reply=errno_reply)
        except ProtocolError as exc:
            self._on_decode_error(str(exc))
            raise CommandError(ErrorCode.DEVICE_ERROR, f"arm {self.arm_id}: undecodable reply: {exc}") from None

    def _reply_model(self, lr: LinkReply, *, errno_reply: bool, fail_on_error: bool) -> DexterCommandReply:
        """The reply as a model (for the jobs and the commands that read it), validated in one pass."""
        return DexterCommandReply.model_validate(self._reply_dict(lr, errno_reply=errno_reply,
                                                                  fail_on_error=fail_on_error))

    def _reply_json(self, lr: LinkReply) -> Serialized:
        """A bound command's reply as the bytes the kit publishes: pydantic-core's `to_json` of the dict, which
        is laid out as the model, so the bytes are the model's (tests/dexter_gateway/test_status.py proves it on
        random replies) at a third of the cost of validating the dict and dumping the model (~6 against ~21 µs
        here); the dict comes from our own decoder, so there is nothing in it to validate."""
        return Serialized(to_json(self._reply_dict(lr, errno_reply=False, fail_on_error=True)))


__all__ = ["INLINE_WAIT_MAX_S", "ArmExchange"]
