"""Does more device capacity ever make the planner predict a slower step?

    python benchmarks/planner_ladders.py [--seeds 40]

Over ``tests/planner/helpers.py``'s random traces (seeds 0..N-1, a GPU's rates for odd
seeds and a CPU device's for even), three host sizes each, it plans at 10% ... 100% of
the device every unit would need and counts the ladders where a larger device was
predicted slower than a smaller one, with the worst ratio. No measurement: the plans'
own predictions, compared with each other.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.planner.helpers import CPU, GPU, all_none_peak, caps, config, random_trace  # noqa: E402

from hetstore.errors import OutOfTierMemory  # noqa: E402
from hetstore.planner.planner import make_plan  # noqa: E402

FRACTIONS = (0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    seeds = parser.parse_args().seeds
    slower, ladders, worst, rows = 0, 0, 1.0, []
    start = time.perf_counter()
    for seed in range(seeds):
        trace = random_trace(random.Random(seed), GPU if seed % 2 else CPU)
        top = all_none_peak(trace)
        host_top = (
            all_none_peak(trace, "host")
            + trace.state_bytes
            + sum(u.saved_bytes for u in trace.units)
        )
        for host in (host_top // 8, host_top // 3, None):
            ladders += 1
            best, bad = float("inf"), 1.0
            for fraction in FRACTIONS:
                try:
                    plan = make_plan(trace, caps(device=int(top * fraction), host=host), config())
                except OutOfTierMemory:
                    continue
                bad = max(bad, plan.estimate.step_s / best)
                best = min(best, plan.estimate.step_s)
            if bad > 1 + 1e-9:
                slower += 1
                worst = max(worst, bad)
                rows.append((seed, "none" if host is None else f"{host / 2**20:.0f} MiB", bad))
    print("| seed | host | slower by |\n|---|---|---|")
    for seed, host, bad in rows:
        print(f"| {seed} | {host} | {100 * (bad - 1):.2f}% |")
    print(
        f"\n{slower} of {ladders} ladders predicted slower with more device capacity "
        f"(worst {100 * (worst - 1):.2f}%), {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
