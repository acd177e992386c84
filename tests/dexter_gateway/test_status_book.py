"""An arm's status bookkeeping (status.py `StatusBook`), pure: made-up replies at made-up times. Which status the
publisher sends and when it polls, the status mode a reply was read in, and when DexRun's error flags change."""

from __future__ import annotations

from services.dexter_gateway import protocol as p
from services.dexter_gateway.link import LinkReply
from services.dexter_gateway.status import StatusBook

PERIOD = 0.1  # DEXTER_STATUS_HZ 10
T0 = 1_700_000_000.0  # an arbitrary wall-clock time


def reply(instr: int, oplet: str = "h", error: int = 0, request: p.Request | None = None) -> LinkReply:
    ints = [0, instr, 1_700_000_000, 0, ord(oplet), error, *range(54)]
    return LinkReply(request or p.Request(oplet), p.decode_reply(p.encode_reply(ints)), 0.0)


def test_a_status_is_fresh_within_the_period_and_published_once() -> None:
    book = StatusBook(p.Firmware.NEWEST)
    assert not book.fresh(T0, PERIOD) and book.take() is None  # nothing yet: poll
    book.seen(reply(1), T0)
    assert book.fresh(T0 + 0.05, PERIOD)  # a command's reply brought one: no poll
    assert not book.fresh(T0 + 0.15, PERIOD)  # over a period old: poll
    latest = book.take()
    assert latest is not None and latest[0].instruction_id == 1 and latest[2] == T0
    assert book.take() is None  # published: not again
    assert not book.fresh(T0 + 0.01, PERIOD)  # and not fresh either: the poll brings the next
    book.seen(reply(2), T0 + 0.02)
    taken = book.take()
    assert taken is not None and taken[0].instruction_id == 2


def test_an_r_block_is_no_status() -> None:
    book = StatusBook(p.Firmware.NEWEST)
    assert not book.seen(reply(1, "r", error=p.ERR_MONITOR), T0)
    assert book.latest is None and book.flags == ()


def test_the_status_mode_of_a_reply() -> None:
    book = StatusBook(p.Firmware.NEWEST)
    book.mode = "1"
    book.seen(reply(1), T0)
    assert book.latest is not None and book.latest[1] == "1"  # read in the mode the arm is in
    assert book.g_args() == ("1",)  # the poll repeats it (`g` alone resets it)
    book.seen(reply(2, "g", request=p.Request("g", ("2",))), T0)
    assert book.latest[1] == "2"  # a `g` with an argument says its own mode
    book.seen(reply(3, "g", request=p.Request("g")), T0)
    assert book.latest[1] == "0"  # `g` alone: mode 0
    stable = StatusBook(p.Firmware.STABLE)
    stable.mode = "1"
    stable.seen(reply(1, "g", request=p.Request("g", ("1",))), T0)
    assert stable.latest is not None and stable.latest[1] == "0" and stable.g_args() == ()  # no modes on stable


def test_flags_change_only_when_the_error_word_brings_new_ones() -> None:
    book = StatusBook(p.Firmware.NEWEST)
    assert not book.seen(reply(1), T0)
    assert book.seen(reply(2, error=p.ERR_MONITOR), T0) and book.flags == ("monitor",)
    assert not book.seen(reply(3, error=p.ERR_MONITOR), T0)  # the same word
    assert not book.seen(reply(4, error=p.ERR_MONITOR | 5), T0)  # another word, the same flags
    assert book.seen(reply(5, error=p.ERR_MONITOR | p.ERR_BOUNDARY), T0)
    assert set(book.flags) == {"monitor", "boundary"}
    assert book.seen(reply(6), T0) and not book.flags  # cleared
