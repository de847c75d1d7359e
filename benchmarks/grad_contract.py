"""What the gradient contract (``p.grad`` reads hetstore's buffers) costs a training step.

    .venv/bin/python benchmarks/grad_contract.py [--width 512] [--depth 8] [--steps 10]

Two offloaded copies of one GPT (offload_param=cpu, offload_optimizer=cpu, fp32), one
with the contract (hetstore's default) and one with it taken off (the parameters given
back their plain class), step in alternation on the same batches: forward, backward,
step, ``optimizer.zero_grad()``. Prediction: no difference -- nothing runs per step
unless someone reads ``.grad``; the hooks read autograd's field directly either way.
A second table times the two ways to clip, each right after a backward:
``torch.nn.utils.clip_grad_norm_(model.parameters())`` through the contract and hetstore's
``optimizer.clip_grad_norm_``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import hetstore
from hetstore.demo.gpt import GPT, batches
from hetstore.runtime.grads import GradContract


def offloaded(model):
    config = hetstore.OffloadConfig(
        offload_param="cpu", offload_optimizer="cpu", enable_pinned_mem=False, device="cpu"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return hetstore.offload(model, optimizer, config)


def without_contract(model) -> None:
    for handle in hetstore.state_of(model).runtime._handles:
        if isinstance(handle, GradContract):
            handle.remove()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    base = GPT(vocab=4096, width=args.width, depth=args.depth, heads=8, ctx=128)
    with_model, with_opt = offloaded(copy.deepcopy(base))
    bare_model, bare_opt = offloaded(base)
    without_contract(bare_model)
    data = batches(args.steps + 2, vocab=4096, batch=4, ctx=128)
    times = {"contract": [], "no contract": []}
    clip = {"torch.nn.utils.clip_grad_norm_": [], "optimizer.clip_grad_norm_": []}
    for i, (x, y) in enumerate(data):
        pairs = [("contract", with_model, with_opt), ("no contract", bare_model, bare_opt)]
        if i % 2:
            pairs.reverse()  # alternate who goes first: drift hits both alike
        for name, model, optimizer in pairs:
            start = time.perf_counter()
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
        with_model(x, y).backward()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(with_model.parameters(), 1.0)
        middle = time.perf_counter()
        with_opt.clip_grad_norm_(1.0)
        clip["torch.nn.utils.clip_grad_norm_"].append(middle - start)
        clip["optimizer.clip_grad_norm_"].append(time.perf_counter() - middle)
        with_opt.zero_grad()
    params = sum(p.numel() for p in with_model.parameters())
    print(f"GPT {params / 1e6:.1f}M fp32, batch 4x128, {args.steps} steps each (median)")
    reference = statistics.median(times["no contract"])
    print(f"{'variant':<34} {'step s':>8} {'ratio':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<34} {median:>8.4f} {median / reference:>7.3f}")
    reference = statistics.median(clip["optimizer.clip_grad_norm_"])
    print(f"{'clip after backward':<34} {'s':>8} {'ratio':>7}")
    for name, values in clip.items():
        median = statistics.median(values)
        print(f"{name:<34} {median:>8.4f} {median / reference:>7.3f}")


if __name__ == "__main__":
    main()
