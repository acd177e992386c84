"""The MQTT side's reads of the cycle's shared slots never raise on a slot that cannot hold a status."""

from typing import cast

from services.ethercat_loop.settings import EthercatSettings
from services.ethercat_loop.snapshot import PalmSnapshot
from services.ethercat_loop.transport.process_backend import ProcessBackend
from services.ethercat_loop.transport.shm import SharedBlock


def test_a_raw_status_slot_too_short_is_skipped_and_counted() -> None:
    # A benchmark once saw the node's publishing loop die on an empty raw slot (struct.error in _merge):
    # the read must skip it, count it, and keep the last good snapshot.
    backend = ProcessBackend(EthercatSettings())
    shm = SharedBlock.create()
    backend._shm = shm
    last_good = cast(PalmSnapshot, object())  # what the cycle's last full snapshot gave (never merged here)
    backend._snap = last_good
    try:
        assert shm.write_slot("raw", b"")
        assert backend.snapshot() is last_good
        assert backend.bad_raw_reads == 1
        assert shm.write_slot("raw", b"\x00" * 10)
        assert backend.snapshot() is last_good
        assert backend.bad_raw_reads == 2
    finally:
        backend._shm = None
        shm.close()
