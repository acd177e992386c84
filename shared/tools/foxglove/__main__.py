"""`python -m shared.tools.foxglove [OPTIONS]`: `robobus foxglove` alone, what `make run` starts (the `robobus` CLI
would load every sub-command's module, which would stay resident in the bridge for nothing)."""

from __future__ import annotations

import typer

from shared.tools.foxglove.cli import foxglove


def main() -> None:
    typer.run(foxglove)


if __name__ == "__main__":
    main()
