"""A seeded fault soak of a real fleet (docs/soak.md), one of three:

- `--fleet controller` (tests/controller/soak.py): redis-server, two controller replicas on
  it, sim engines, a client through both replicas; after each fault the shared index must
  converge to what the engines hold and both replicas agree and route;
- `--fleet planner` (tests/controller/planner_soak.py): a controller and a planner keeping
  prefill and decode pools of sim engines, traffic in bursts and quiet spells; after each
  fault the controller's engines must be the planner's live children, each pool within its
  bounds;
- `--fleet indexer` (tests/indexer/soak.py): two indexer replicas on redis-server following
  sim engines, a bridge into one, engine traffic and prefix queries against both; after each
  fault the shared index must be what the engines hold and both replicas answer alike.

    python docs/benchmarks/soak.py [--fleet controller|planner|indexer] [--seconds 300]
        [--seed 1] [--engines 3] [--rate 4] [--workdir DIR]

Run from the checkout's root (it imports the soak from tests/). Prints each fault, then a
summary: faults injected, requests (and queries) by outcome, convergence time per kind of
fault, the errors of fault windows by fault and cause, failures. Exit 0 when no invariant
failed, 1 otherwise; the processes' logs stay in --workdir if given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from tests.controller.planner_soak import PlannerSoak  # noqa: E402
from tests.controller.soak import Soak  # noqa: E402
from tests.indexer.soak import IndexerSoak  # noqa: E402
from tests.soak_fleet import SeededSoak, drive  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fleet",
        choices=("controller", "planner", "indexer"),
        default="controller",
        help="controller replicas, a planner-run disaggregated fleet, or indexer replicas and "
        "a bridge (docs/soak.md)",
    )
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engines", type=int, default=3, help="controller fleet only")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--workdir", type=Path, help="keep configs and logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        soak: SeededSoak
        if args.fleet == "planner":
            soak = PlannerSoak(workdir, args.seed)
        elif args.fleet == "indexer":
            soak = IndexerSoak(workdir, args.seed)
        else:
            soak = Soak(workdir, args.seed, args.engines)
        report = asyncio.run(drive(soak, seconds=args.seconds, rate_per_s=args.rate))
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
