"""`robobus fleet-watch`'s logic on a fake clock: a site is unreachable once no heartbeat came for the timeout,
reachable again on the next one, each change published once; a site never heard of is unreachable after one
timeout; the watcher's own reconnect does not mark sites down; foreign topics are counted, not crashed on."""

from __future__ import annotations

import pytest

from shared.fleet_watch import FleetWatchSettings, Watcher


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def w() -> tuple[Watcher, Clock, list[tuple[str, str]]]:
    clock, sent = Clock(), []
    return Watcher(["site-a/robobus", "site-b/robobus"], 4.0, lambda t, v: sent.append((t, v)), clock), clock, sent


def test_reachable_on_a_heartbeat_unreachable_after_the_timeout_and_back(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    watcher.heartbeat("site-b/robobus/_bridge/uptime")
    assert sent == [("site-a/robobus/_bridge/reachable", "1"), ("site-b/robobus/_bridge/reachable", "1")]
    for _ in range(3):  # heartbeats every 2 s from site-b only
        clock.t += 2.0
        watcher.heartbeat("site-b/robobus/_bridge/uptime")
        watcher.tick()
    assert sent[2:] == [("site-a/robobus/_bridge/reachable", "0")]  # at 6 s > 4 s, not at 4 s
    watcher.tick()
    assert len(sent) == 3  # published once, not at every tick
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    assert sent[3:] == [("site-a/robobus/_bridge/reachable", "1")]
    assert watcher.counts["unreachable"] == 1 and watcher.counts["reachable"] == 3


def test_not_before_the_timeout(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 4.0
    watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent


def test_a_site_never_heard_of_is_unreachable_after_one_timeout(w):
    watcher, clock, sent = w
    watcher.tick()
    assert sent == []
    clock.t += 4.5
    watcher.tick()
    assert sorted(sent) == [("site-a/robobus/_bridge/reachable", "0"), ("site-b/robobus/_bridge/reachable", "0")]


def test_the_watchers_own_reconnect_gives_each_site_a_new_timeout(w):
    watcher, clock, sent = w
    watcher.heartbeat("site-a/robobus/_bridge/uptime")
    clock.t += 30  # the watcher was cut off from its broker, not the site
    watcher.restart()
    watcher.tick()
    assert ("site-a/robobus/_bridge/reachable", "0") not in sent


def test_foreign_topics_are_counted(w):
    watcher, _, sent = w
    watcher.heartbeat("site-c/robobus/_bridge/uptime")
    watcher.heartbeat("site-a/robobus/status")
    assert watcher.counts["unexpected"] == 2 and sent == []


def test_sites_setting():
    s = FleetWatchSettings(fleet_sites="site-a=site-a/robobus site-b/robobus")
    assert s.roots() == ["site-a/robobus", "site-b/robobus"]
    with pytest.raises(ValueError):
        FleetWatchSettings(fleet_sites="site-a=site-a/#")
    with pytest.raises(ValueError):
        FleetWatchSettings(fleet_watch_timeout_s=1.0)  # below one heartbeat period (2 s): it would flap
