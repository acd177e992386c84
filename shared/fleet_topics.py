"""The topic filters a fleet centre's watchers (`robobus fleet-watch`, deploy/fleet_gate.py) subscribe to, and the
broker ACL grants them (deploy/make_secrets.py central_acl): one filter per depth of the sites' roots, not one per
site.

ejabberd's mod_mqtt (the clustered centre) checks every filter of a SUBSCRIBE against its whole access list, about
12 entries a site; the watchers SUBSCRIBE again every few seconds there (their subscriptions can drop out of a
node's index: deploy/README.md "A clustered centre"), so a filter per site made each renewal N filters x 12N
entries: with 300 sites configured, the two watchers alone kept the node they were on busy at 87 % of a core
(bench/fleet.py, 10 sites running). A wildcard per root depth (`+/+/_bridge/uptime` for roots like
`site-a/robobus`) is a few filters whatever the fleet's size. It also matches roots that are no site's: a watcher
ignores what it has no site for, and only a site's bridge can publish under its root."""

from __future__ import annotations

from collections.abc import Iterable


def root_filters(roots: Iterable[str], suffix: str) -> list[str]:
    """`+/.../+/<suffix>`, one `+` per level, for each depth among `roots`."""
    return sorted({"/".join(["+"] * len(r.split("/")) + [suffix]) for r in roots})
