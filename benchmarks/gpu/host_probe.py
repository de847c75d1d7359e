"""The host's side of a step taken ahead, without a GPU in the loop: one unit's
ordinary fused AdamW step against its speculative form (the live master, gradient and
two moments copied into shadows, then stepped there), on the main thread and on a
worker thread, alone and beside each other.

    python benchmarks/gpu/host_probe.py [--numel 12600000]

Each row is the best of 5 runs. On the H100 machine's 16-core host (2026-11-26) the
ordinary step of a 12.6M-element unit took 1.3 ms and the speculative one 6.4-6.9 ms:
the copies, not the arithmetic, are the speculation's price (docs/dev/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ADAMW = dict(
    lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=12_600_000)
    n = parser.parse_args().numel
    print(f"{torch.get_num_threads()} intra-op threads, {os.cpu_count()} CPUs, {n} elements")
    live = [torch.randn(n) for _ in range(4)]  # master, gradient, exp_avg, exp_avg_sq
    live[3].abs_()
    shadows = [torch.empty(n) for _ in range(4)]
    step = torch.tensor(1.0)

    def fused(p, g, m, v):
        torch._fused_adamw_([p], [g], [m], [v], [], [step], **ADAMW)

    def ordinary():
        fused(*live)

    def speculative():
        for shadow, value in zip(shadows, live, strict=True):
            shadow.copy_(value)
        fused(*shadows)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1000

    pool = ThreadPoolExecutor(1)
    rows = [
        ("ordinary, main thread", best(ordinary)),
        ("speculative, main thread", best(speculative)),
        ("ordinary, worker thread", pool.submit(best, ordinary).result()),
        ("speculative, worker thread", pool.submit(best, speculative).result()),
    ]

    def ordinary_beside_worker() -> float:
        busy = pool.submit(lambda: [speculative() for _ in range(3)])
        took = best(ordinary)
        busy.result()
        return took

    rows.append(("ordinary, main, worker speculating", ordinary_beside_worker()))
    print("| step | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
