"""Run one fuzz target under atheris (coverage-guided): `python -m tests.fuzz TARGET [-runs=N |
-max_total_time=S] [corpus_dir]`; `python -m tests.fuzz --list` names them. An exception the target does not
allow is reported with the input that caused it (libFuzzer writes crash-<hash> in the working directory) and
a non-zero exit."""

from __future__ import annotations

import importlib
import sys

import atheris


def main() -> None:
    from tests.fuzz.targets import targets

    all_targets = targets()
    if len(sys.argv) < 2 or sys.argv[1] == "--list":
        print("\n".join(sorted(all_targets)))
        return
    target = all_targets[sys.argv[1]]
    # the decoders and what they call, nothing else: the services' packages (an out-of-tree one's too)
    with atheris.instrument_imports(include=sorted({"services", *(m.split(".")[0] for m in target.modules)})):
        for mod in target.modules:
            importlib.import_module(mod)
    allowed = target.allowed()

    def one_input(data: bytes) -> None:
        try:
            target.run(data)
        except allowed:
            pass

    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
