"""liveness.py: the allowed silence follows the requested streams (pure, times passed in)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.epuck_gateway.protocol.wifi import REQ_IMAGE, REQ_SENSORS
from services.epuck_gateway.transport.liveness import LinkLiveness


def test_without_images_the_robot_talks_every_cycle() -> None:
    for request in (0, REQ_SENSORS):
        lv = LinkLiveness(stale_s=0.8)
        lv.reset(request)
        assert lv.allowed_silence() == 0.8


def test_with_images_the_allowance_follows_the_image_intervals_seen() -> None:
    lv = LinkLiveness(stale_s=0.8, image_gap_max_s=6.0)
    lv.reset(REQ_IMAGE | REQ_SENSORS)
    assert lv.allowed_silence() == pytest.approx(6.8)  # no interval seen yet: the cap
    t = 100.0
    for dt in (1.0, 1.1, 0.9):  # one image a second; the sensors packet rides on each image
        t += dt
        lv.on_packet(t, image=True)
        lv.on_packet(t + 0.01, image=False)
    assert lv.allowed_silence() == pytest.approx(0.8 + 1.1)  # the longest recent interval
    lv.on_packet(t + 30.0, image=True)  # a 30 s stall is capped
    assert lv.allowed_silence() == pytest.approx(6.8)


def test_a_request_change_keeps_the_old_allowance_until_the_robot_answers() -> None:
    lv = LinkLiveness(stale_s=0.8, image_gap_max_s=6.0)
    lv.reset(REQ_IMAGE)
    lv.on_packet(0.0, image=True)
    lv.on_packet(2.0, image=True)
    lv.set_request(REQ_SENSORS)  # images off: the robot may still be inside a 2 s image cycle
    assert lv.allowed_silence() == pytest.approx(2.8)
    lv.on_packet(2.5, image=False)
    assert lv.allowed_silence() == pytest.approx(0.8)
    lv.set_request(REQ_SENSORS | REQ_IMAGE)  # images on: the first may take as long as the cap
    assert lv.allowed_silence() == pytest.approx(6.8)


@given(st.lists(st.floats(0.0, 100.0), max_size=30))
def test_the_allowance_is_bounded(intervals: list[float]) -> None:
    lv = LinkLiveness(stale_s=0.8, image_gap_max_s=6.0)
    lv.reset(REQ_IMAGE)
    t = 0.0
    for dt in intervals:
        t += dt
        lv.on_packet(t, image=True)
    assert 0.8 <= lv.allowed_silence() <= 6.8
