"""``python -m tests.nemesis --seed N --minutes M --topology single|sentinel|cluster``
(``./dev nemesis ...``): one run; exit code 0 when no rule was broken, 1 otherwise."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from tests.nemesis.run import run
from tests.nemesis.topology import TOPOLOGIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev nemesis", description=__doc__)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--topology", choices=TOPOLOGIES, default="single")
    parser.add_argument(
        "--keep", type=Path, default=None, help="where the run's processes, logs and history go"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    outcome = run(seed, args.minutes, args.topology, args.keep)
    for line in outcome.report:
        print(line)
    if outcome.ok:
        print(f"nemesis: PASSED (seed {seed}, {args.topology})")
        return 0
    print(f"nemesis: FAILED with {len(outcome.violations)} violation(s); "
          f"rerun: ./dev nemesis --seed {seed} --minutes {args.minutes:g} "
          f"--topology {args.topology}")  # fmt: skip
    return 1


if __name__ == "__main__":
    sys.exit(main())
