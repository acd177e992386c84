"""Print the pip requirements of the kit or of some extras, read from pyproject.toml (one per line).

The image build installs the kit's requirements, then one service's extra, each in its own layer, before
any source is copied: a code change rebuilds only the last layer, and every image shares the kit layer.
    python3 requirements.py pyproject.toml              # the kit (project.dependencies)
    python3 requirements.py pyproject.toml epuck,sim    # those extras only (self-references resolved)
"""

from __future__ import annotations

import re
import sys
import tomllib

SELF = re.compile(r"^robobus\[(?P<extras>[^\]]+)\]$")


def extra_requirements(optional: dict[str, list[str]], names: list[str], seen: set[str] | None = None) -> list[str]:
    seen = set() if seen is None else seen
    out: list[str] = []
    for name in names:
        if name in seen:
            continue
        if name not in optional:
            raise SystemExit(f"requirements.py: pyproject.toml has no extra {name!r} (has: {', '.join(optional)})")
        seen.add(name)
        for req in optional[name]:
            m = SELF.match(req.replace(" ", ""))
            out += extra_requirements(optional, m["extras"].split(","), seen) if m else [req]
    return out


def main(argv: list[str]) -> None:
    with open(argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    names = [n for n in (argv[2] if len(argv) > 2 else "").split(",") if n]
    reqs = extra_requirements(project.get("optional-dependencies", {}), names) if names else project["dependencies"]
    print("\n".join(dict.fromkeys(reqs)))


if __name__ == "__main__":
    main(sys.argv)
