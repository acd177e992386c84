"""`python -m shared.tools.prometheus [OPTIONS]`: `robobus prometheus` alone, what `make run` starts (without the
rest of the CLI's sub-commands resident in the exporter)."""

from __future__ import annotations

import typer

from shared.tools.prometheus.cli import prometheus


def main() -> None:
    typer.run(prometheus)


if __name__ == "__main__":
    main()
