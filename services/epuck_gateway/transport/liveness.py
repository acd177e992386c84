"""How long a healthy robot may stay silent, from what it was asked to send (pure: times come in).

The robot's cycle (reference section 4, ESP32 `socket_task`): with the image requested, each cycle
sends the image first and then, when sensors are requested too, the sensors packet that follows it;
so the cycle, and every packet, waits for the image. Over WiFi images arrive with a heavy tail
(reference section 5: p90 1.1 s, max 5.9 s). With no image requested, the robot sends a sensors
packet or an 0x03 every cycle (10-20 ms). A fixed silence limit is therefore either too short for a
slow image stream (the link flapped once a second at 1 fps) or too long to find a dead robot fast.

Here the allowed silence is `stale_s` plus the expected gap between packets:
- no image requested: no extra gap (the robot talks every cycle), so a dead robot is found in ~stale_s;
- image requested: the longest of the last few image intervals actually seen on this link (the
  sensors packet rides on the image, so it tells nothing more), capped at `image_gap_max_s`; before
  the link has seen two images, the cap itself (the first image after a request may be slow).
A request change keeps the old allowance until the robot's first packet after it, since the robot
applies a command only at its next cycle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.epuck_gateway.protocol.wifi import REQ_IMAGE

RECENT_IMAGES = 8


@dataclass
class LinkLiveness:
    stale_s: float = 0.8
    image_gap_max_s: float = 6.0  # above the longest image interval measured over WiFi (5.9 s)
    request: int = 0
    _intervals: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_IMAGES))
    _last_image: float | None = None
    _held_gap: float | None = None  # allowance of the previous request until the robot's next packet

    def reset(self, request: int) -> None:
        """A new link."""
        self.request = request
        self._intervals.clear()
        self._last_image = None
        self._held_gap = None

    def set_request(self, request: int) -> None:
        if request == self.request:
            return
        self._held_gap = max(self._held_gap or 0.0, self.expected_gap())
        if (request ^ self.request) & REQ_IMAGE:
            self._intervals.clear()  # a new image stream: the old intervals say nothing about it
            self._last_image = None
        self.request = request

    def on_packet(self, now: float, image: bool) -> None:
        self._held_gap = None
        if image and self.request & REQ_IMAGE:
            if self._last_image is not None:
                self._intervals.append(now - self._last_image)
            self._last_image = now

    def expected_gap(self) -> float:
        gap = 0.0
        if self.request & REQ_IMAGE:
            gap = min(max(self._intervals), self.image_gap_max_s) if self._intervals else self.image_gap_max_s
        if self._held_gap is not None:
            gap = max(gap, self._held_gap)
        return gap

    def allowed_silence(self) -> float:
        return self.stale_s + self.expected_gap()
