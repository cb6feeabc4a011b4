"""A seeded fault soak of a real fleet (tests/controller/soak.py): redis-server, two controller
replicas on it, sim engines, a client through both replicas, random faults; after each, the
shared index must converge to what the engines hold and both replicas agree and route. With
`--fleet planner` (tests/controller/planner_soak.py): a controller and a planner keeping
prefill and decode pools of sim engines, traffic in bursts and quiet spells; after each fault
the controller's engines must be the planner's live children, each pool within its bounds.

    python docs/benchmarks/soak.py [--fleet replicas|planner] [--seconds 300] [--seed 1]
        [--engines 3] [--rate 4]

Run from the checkout's root (it imports the soak from tests/). Prints each fault, then a
summary: faults injected, requests by outcome, convergence time per kind of fault, failures.
Exit 0 when no invariant failed, 1 otherwise; the processes' logs stay in --workdir if given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from tests.controller.planner_soak import run_planner_soak  # noqa: E402
from tests.controller.soak import run_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", choices=("replicas", "planner"), default="replicas")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engines", type=int, default=3, help="replicas' fleet only")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--workdir", type=Path, help="keep configs and logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.fleet == "planner":
            run = run_planner_soak(workdir, args.seed, seconds=args.seconds, rate_per_s=args.rate)
        else:
            run = run_soak(
                workdir, args.seed, seconds=args.seconds, engines=args.engines, rate_per_s=args.rate
            )
        report = asyncio.run(run)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
