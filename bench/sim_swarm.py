"""A 1,000-peer swarm with churn in virtual time, driving swarm's own record, routing, placement,
rebalancing and heal code (issue 31). Prints one JSON object.

    python bench/sim_swarm.py --peers 1000 --minutes 60 --seed 1 --out bench/results/sim_swarm-2026-12-03.json

The world model and what is modelled rather than real: bench/swarm_sim.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm_sim import Sim  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-churn", action="store_true", help="no departures, no shock (the outage stays)")
    ap.add_argument("--sessions-per-min", type=float, default=20.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    sim = Sim(peers=args.peers, minutes=args.minutes, seed=args.seed, churn=not args.no_churn,
              sessions_per_min=args.sessions_per_min)
    out = sim.run()
    out["command"] = "python bench/sim_swarm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(out)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
