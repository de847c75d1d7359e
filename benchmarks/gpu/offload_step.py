"""GPU: offloaded (params + optimizer on pinned host) vs plain PyTorch, side by side.

One command on a machine with CUDA:

    .venv/bin/python benchmarks/gpu/offload_step.py [--width 1024 --depth 12 --steps 10]

Prints median step time of each, the ratio offloaded/plain, the CUDA allocator's peak
(``torch.cuda.max_memory_allocated``) of each, and the largest loss difference.
The two models start from the same weights and see the same batches; steps interleave so
that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import hetstore
from hetstore.demo.gpt import GPT


def step(model, optimizer, x, y) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu needs CUDA; run it on a machine with a GPU")

    torch.manual_seed(0)
    base = GPT(args.vocab, args.width, args.depth, args.width // 64, args.ctx)
    n_params = sum(p.numel() for p in base.parameters())
    plain = copy.deepcopy(base).cuda()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    config = hetstore.OffloadConfig(offload_param="cpu", offload_optimizer="cpu", device="cuda")
    mine, mine_opt = hetstore.offload(
        base, torch.optim.AdamW(base.parameters(), lr=1e-4, fused=True), config
    )

    g = torch.Generator().manual_seed(1)
    times = {"plain": [], "hetstore": []}
    peaks = {"plain": 0, "hetstore": 0}
    diff = 0.0
    for i in range(args.steps + 1):
        idx = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g).cuda()
        x, y = idx[:, :-1], idx[:, 1:]
        losses = {}
        for name, (model, opt) in (("plain", (plain, plain_opt)), ("hetstore", (mine, mine_opt))):
            torch.cuda.reset_peak_memory_stats()
            seconds, losses[name] = step(model, opt, x, y)
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
            if i:  # the first step warms up kernels and records the execution order
                times[name].append(seconds)
        diff = max(diff, abs(losses["plain"] - losses["hetstore"]))

    print(
        f"{torch.cuda.get_device_name()}: GPT {n_params / 1e6:.0f}M params, "
        f"batch {args.batch}x{args.ctx}, {args.steps} timed steps"
    )
    print("| variant | median step s | / plain | CUDA peak allocated |")
    print("|---|---|---|---|")
    plain_median = statistics.median(times["plain"])
    for name in ("plain", "hetstore"):
        median = statistics.median(times[name])
        print(
            f"| {name} | {median:.3f} | {median / plain_median:.2f} | "
            f"{peaks[name] / 2**30:.2f} GiB |"
        )
    print(f"max |loss difference| = {diff:.2e}")


if __name__ == "__main__":
    main()
