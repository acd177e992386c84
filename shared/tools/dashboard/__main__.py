"""`python -m shared.tools.dashboard [OPTIONS]`: `robobus dashboard` alone, what `make run` starts.

The same command and options as `robobus dashboard`, without the rest of the `robobus` CLI: that loads every
sub-command's module (the services' CLIs among them), which would stay resident in the server for nothing."""

from __future__ import annotations

import typer

from shared.tools.dashboard.cli import dashboard


def main() -> None:
    typer.run(dashboard)


if __name__ == "__main__":
    main()
