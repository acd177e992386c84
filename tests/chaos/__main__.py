"""`make chaos` / `make soak`: the chaos faults against the whole simulated system, then a soak; prints the
table of faults, invariants and violations and exits 1 on any violation.

    python -m tests.chaos [--soak-minutes 30] [--garbage 1000] [--no-partition]
"""

from __future__ import annotations

import argparse
import sys

from tests.chaos import faults
from tests.chaos.stack import sim_stack
from tests.fixtures import can_netns


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--soak-minutes", type=float, default=3.0, help="soak length (30 for the long run)")
    p.add_argument("--garbage", type=int, default=1000, help="garbage payloads per command topic")
    p.add_argument("--no-partition", action="store_true", help="skip the network partition (needs root)")
    p.add_argument("--only-soak", action="store_true", help="no faults, the soak only")
    a = p.parse_args()
    results: list[faults.FaultResult] = []
    with sim_stack() as stack:
        print(f"stack up: {sorted(stack.expected_nodes)}", flush=True)
        if not a.only_soak:
            for fault in (faults.broker_kill9, faults.device_vanish, faults.flood, faults.node_kill9):
                results.append(fault(stack))
                print(faults.table(results[-1:]), flush=True)
            results.append(faults.garbage(stack, a.garbage))
            print(faults.table(results[-1:]), flush=True)
        soak_s = a.soak_minutes * 60
        results.append(faults.soak(stack, soak_s, sample_every_s=min(60.0, soak_s / 6), warmup_s=min(60.0, soak_s / 3)))
    if not a.only_soak and not a.no_partition:
        reason = can_netns()
        if reason is None:
            from tests.chaos.partition import partition

            results.append(partition())
        else:
            print(f"network partition skipped: {reason}")
    print("\n" + faults.table(results))
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
