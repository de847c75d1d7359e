"""Host optimizer step: hetstore's ``OffloadedOptimizer.step()`` against fused torch and DeepSpeed.

    .venv/bin/python benchmarks/optimizer_step.py [--params 100M] [--blocks 50] [--repeats 9]

What is timed, per variant, on the same sizes (``--blocks`` tensors/units of equal size):

* ``hetstore fp32`` / ``hetstore bf16``: the real ``OffloadedOptimizer.step()`` of a model
  (a stack of ``nn.Linear`` blocks, one unit each) offloaded with offload_param=cpu and
  offload_optimizer=cpu. Gradients arrive once through a real backward (hooks, flat fp32
  grad buffers, ``has_grad`` flags); they are then overwritten with the same random
  values as the references'. ``zero_grad()`` is never called, so every step steps every
  unit. The step includes what hetstore really does after the kernel:
  ``refresh_from_master()``, which for bf16 casts the fp32 master into the bf16 copy.
* ``torch fused``: ``torch.optim.AdamW(fused=True)`` over ``--blocks`` separate fp32 tensors.
* ``torch fused + bf16 cast``: the same, then ``low.copy_(param)`` per tensor -- what any
  mixed-precision offload must do after the step (DeepSpeed ZeRO-Offload does the same copy
  separately), so the fair reference for ``hetstore bf16``.
* ``DeepSpeedCPUAdam``: run by the benchmark venv's interpreter in a worker process that
  is driven round by round in lockstep with this one (so it is interleaved too). Needs
  ``python3 -m venv .bench-venv && .bench-venv/bin/pip install torch==2.13.0 deepspeed==0.19.8``;
  its cpu_adam op JIT-builds on first use (~1 min, kept in ``.bench-venv/torch_extensions``).

Every round runs each variant once (``--steps`` steps, timed together), rotating the order;
figures are medians of ``--repeats`` rounds with [min..max]. After timing, hetstore's
weights are compared with torch's (same initial weights, gradients and number of steps).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import hetstore
from _common import (
    BENCH_PYTHON,
    TORCH_EXTENSIONS_DIR,
    format_table,
    interleaved,
    machine_line,
    median,
    parse_count,
    spread,
)
from hetstore.optim import OffloadedOptimizer
from hetstore.runtime.unit import Unit

LR = 1e-4
WEIGHT_DECAY = 0.01
DS_PIP = "torch==2.13.0 deepspeed==0.19.8"  # pinned: an unpinned torch pulls CUDA wheels
GRAD_SCALE = 1e-3  # gradients of a plausible size, far from fp32 denormals (slow paths)

# The DeepSpeed side, run by the benchmark venv's interpreter. Protocol on stdin/stdout:
# it prints "ready", then answers every "run" line with the seconds ``steps`` steps took.
DS_WORKER = r"""
import json, os, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
args = json.loads(sys.argv[1])
torch.manual_seed(0)
params = [torch.randn(args["numel"]) for _ in range(args["count"])]
for p in params:
    p.grad = torch.randn(args["numel"]) * args["grad_scale"]
opt = DeepSpeedCPUAdam(params, lr=args["lr"], weight_decay=args["wd"], adamw_mode=True)
opt.step()  # builds/loads the op and allocates the moments outside the timed region
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    start = time.perf_counter()
    for _ in range(args["steps"]):
        opt.step()
    print(time.perf_counter() - start, flush=True)
"""


class Stack(nn.Module):
    """``blocks`` equal Linear layers in an ``nn.ModuleList``: hetstore makes each a unit."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))  # tanh keeps activations bounded over 50 layers
        return x


def width_for(total: int, blocks: int) -> int:
    """Width w with blocks * (w*w + w) closest to ``total`` (weight plus bias per block)."""
    per_block = total / blocks
    return max(1, round((-1 + (1 + 4 * per_block) ** 0.5) / 2))


def random_grads(numel: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) * GRAD_SCALE for _ in range(count)]


# ---------------------------------------------------------------------------- hetstore
@dataclass
class HetstoreCase:
    model: nn.Module
    optimizer: OffloadedOptimizer
    compute_dtype: torch.dtype

    @property
    def units(self) -> list[Unit]:
        return self.optimizer.units


def build_hetstore(width: int, blocks: int, dtype: str, grads: list[torch.Tensor]) -> HetstoreCase:
    torch.manual_seed(0)
    model = Stack(width, blocks)
    config = hetstore.OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        max_device_memory="256MB",
        enable_pinned_mem=False,
        device="cpu",
        compute_dtype=dtype,
    )
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model, optimizer = hetstore.offload(model, inner, config)
    case = HetstoreCase(model, optimizer, config.torch_compute_dtype)
    real_backward(case, width)
    for unit, grad in zip(case.units, grads, strict=True):
        unit.grad.copy_(grad)  # same gradients as the references, through the real buffers
    return case


def real_backward(case: HetstoreCase, width: int) -> None:
    """One real backward, so gradients and ``has_grad`` flags arrive as in training."""
    x = torch.randn(4, width, dtype=case.compute_dtype)
    case.model(x).float().square().mean().backward()
    flags = [e.has_grad for u in case.units for e in u.trainable_entries]
    if not all(flags):
        raise RuntimeError(f"{flags.count(False)} parameters got no gradient from backward")


def hetstore_steps(case: HetstoreCase, steps: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            case.optimizer.step()  # no zero_grad: the same gradients step every unit again
        return time.perf_counter() - start

    return run


# ---------------------------------------------------------------------------- torch
@dataclass
class TorchCase:
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    low: list[torch.Tensor]  # bf16 copies refreshed after each step; empty: no cast


def build_torch(case: HetstoreCase, grads: list[torch.Tensor], cast: bool) -> TorchCase:
    """Separate fp32 tensors holding the same initial weights as hetstore's masters."""
    params = [unit.master.detach().clone() for unit in case.units]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    low = [p.to(torch.bfloat16) for p in params] if cast else []
    return TorchCase(params, optimizer, low)


def torch_steps(case: TorchCase, steps: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            case.optimizer.step()
            for low, param in zip(case.low, case.params, strict=False):  # empty: no cast
                low.copy_(param)
        return time.perf_counter() - start

    return run


# ---------------------------------------------------------------------------- DeepSpeed
class DeepSpeedWorker:
    """``DeepSpeedCPUAdam`` in the benchmark venv, stepped on request (see DS_WORKER)."""

    def __init__(self, numel: int, count: int, steps: int):
        env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR))
        args = dict(numel=numel, count=count, steps=steps, lr=LR, wd=WEIGHT_DECAY)
        args["grad_scale"] = GRAD_SCALE
        # a file, not a pipe: DeepSpeed's warnings could fill a pipe nobody reads and block it
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [str(BENCH_PYTHON), "-c", DS_WORKER, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            self.log.seek(0)
            raise RuntimeError(f"DeepSpeed worker failed:\n{self.log.read()[-3000:]}")

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def start_deepspeed(numel: int, count: int, steps: int) -> DeepSpeedWorker | None:
    """One attempt; on any failure say why and how to get it, and go on without it."""
    if not BENCH_PYTHON.exists():
        print(
            "DeepSpeedCPUAdam: not installed (no .bench-venv). To include it:\n"
            "  python3 -m venv .bench-venv && "
            f".bench-venv/bin/pip install {DS_PIP}"
        )
        return None
    try:
        return DeepSpeedWorker(numel, count, steps)
    except (RuntimeError, OSError, ValueError) as error:
        print(f"DeepSpeedCPUAdam: not available ({str(error).strip()[-600:]})")
        print(f"  to include it: .bench-venv/bin/pip install {DS_PIP}")
        return None


# ---------------------------------------------------------------------------- report
def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of time(b) / time(a): the speed of a relative to b, each round's
    pair measured back to back, so drift of the shared machine cancels out."""
    return median([tb / ta for ta, tb in zip(a, b, strict=True)])


def report(samples: dict[str, list[float]], numel: int, steps: int) -> str:
    rate = {name: [numel * steps / s / 1e9 for s in times] for name, times in samples.items()}
    refs = [n for n in ("torch fused", "DeepSpeedCPUAdam") if n in rate]
    best = max(refs, key=lambda n: median(rate[n]))
    cast_ref = "torch fused + bf16 cast"
    rows = []
    for name, values in rate.items():
        same = "-"
        if name == "hetstore bf16" and cast_ref in samples:
            same = f"{paired_ratio(samples[name], samples[cast_ref]):.3f}"
        ratio = paired_ratio(samples[name], samples[best])
        rows.append([name, f"{median(values):.3f} {spread(values)}", f"{ratio:.3f}", same])
    header = [
        "variant",
        "G params/s, median [min..max]",
        f"speed / faster ref ({best})",
        f"speed / {cast_ref}",
    ]
    return format_table(header, rows)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def check_weights(het: dict[str, HetstoreCase], ref: dict[str, TorchCase]) -> None:
    """hetstore took the same steps from the same weights and gradients as torch."""
    pairs = [("fp32", "torch fused"), ("bf16", "torch fused + bf16 cast")]
    for dtype, ref_name in pairs:
        if dtype not in het or ref_name not in ref:
            continue
        masters = [u.master for u in het[dtype].units]
        diff = max_diff(masters, ref[ref_name].params)
        print(f"max |hetstore {dtype} master - {ref_name}| = {diff:.2e}")
        if dtype == "bf16":
            diff = max_diff([u.home for u in het[dtype].units], ref[ref_name].low)
            print(f"max |hetstore bf16 copy - torch bf16 copy| = {diff:.2e}")


# ---------------------------------------------------------------------------- profile
def unit_tensors(case: HetstoreCase) -> list[tuple[torch.Tensor, ...]]:
    """(master, grad, exp_avg, exp_avg_sq, step, compute copy) of each unit's one segment."""
    out = []
    for unit_step in case.optimizer._unit_steps:
        master = unit_step.tensors[0]
        state = unit_step.optimizer.state[master]
        out.append(
            (master, master.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
            + (unit_step.unit.home,)
        )
    return out


def inner_steps(case: HetstoreCase) -> Callable[[], None]:
    """What hetstore's step does minus its own bookkeeping: each unit's torch optimizer,
    then the refresh."""

    def run() -> None:
        for unit_step in case.optimizer._unit_steps:
            unit_step.optimizer.step()
            unit_step.unit.refresh_from_master()

    return run


def raw_kernel_steps(case: HetstoreCase) -> Callable[[], None]:
    """The floor: torch's fused kernel called directly per unit (no torch.optim.Optimizer
    machinery), then the cast, on hetstore's own buffers."""
    tensors = unit_tensors(case)
    hyper = dict(lr=LR, beta1=0.9, beta2=0.999, weight_decay=WEIGHT_DECAY, eps=1e-8)

    @torch.no_grad()
    def run() -> None:
        for master, grad, exp_avg, exp_avg_sq, step, home in tensors:
            step.add_(1)
            torch._fused_adamw_(
                [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
                amsgrad=False, maximize=False, **hyper,
            )  # fmt: skip
            if home is not master:
                home.copy_(master)

    return run


def per_step(run: Callable[[], None], steps: int) -> Callable[[], float]:
    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        return time.perf_counter() - start

    return timed


def profile_breakdown(het: dict[str, HetstoreCase], steps: int, repeats: int) -> None:
    """Where hetstore's step time goes, by subtraction: the real step, the same minus
    hetstore's bookkeeping, the same minus torch.optim's per-call machinery. Interleaved,
    paired against the raw kernel. Run after the weight check: it advances the states."""
    variants: dict[str, Callable[[], float]] = {}
    for dtype, case in het.items():
        variants[f"{dtype}: OffloadedOptimizer.step()"] = per_step(case.optimizer.step, steps)
        variants[f"{dtype}: per unit Optimizer.step() + refresh"] = per_step(
            inner_steps(case), steps
        )
        variants[f"{dtype}: per unit _fused_adamw_ (+ cast)"] = per_step(
            raw_kernel_steps(case), steps
        )
    samples = interleaved(variants, repeats)
    rows = []
    for name, times in samples.items():
        floor = samples[name.split(":")[0] + ": per unit _fused_adamw_ (+ cast)"]
        ms = median(times) / steps * 1e3
        rows.append([name, f"{ms:.2f}", f"{paired_ratio(times, floor):.3f}"])
    print("\nBreakdown (ms per step; speed relative to the raw kernel on the same buffers):")
    print(format_table(["what runs", "ms/step", "speed / raw kernel"], rows))
    python_overhead()


def python_overhead() -> None:
    """Per-step Python cost with the kernels made negligible: 50 units of 72 elements."""
    width, blocks = 8, 50
    grads = random_grads(width * width + width, blocks)
    case = build_hetstore(width, blocks, "fp32", grads)
    ref = build_torch(case, grads, cast=False)
    samples = interleaved(
        {"hetstore": hetstore_steps(case, 100), "torch fused": torch_steps(ref, 100)}, 5
    )
    het_us, ref_us = (median(samples[k]) / 100 * 1e6 for k in ("hetstore", "torch fused"))
    print(
        f"\nPython overhead per step, {blocks} tiny units: hetstore {het_us:.0f} us, "
        f"torch fused over {blocks} tensors {ref_us:.0f} us "
        f"({(het_us - ref_us) / blocks:.1f} us more per unit)"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(100):
        case.optimizer.step()
    profiler.disable()
    print("cProfile of 100 of these steps, by own time:")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(12)


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100M", help="total parameters (default 100M)")
    parser.add_argument("--blocks", type=int, default=50, help="units / tensors (default 50)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="steps timed together per sample")
    parser.add_argument("--dtypes", default="fp32,bf16", help="hetstore compute dtypes")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument(
        "--profile", action="store_true", help="also break hetstore's step time down"
    )
    args = parser.parse_args()

    width = width_for(parse_count(args.params), args.blocks)
    numel_per = width * width + width
    numel = numel_per * args.blocks
    print(machine_line())
    print(f"{numel / 1e6:.1f}M fp32 params in {args.blocks} tensors/units of {numel_per:,}")
    print(f"AdamW lr={LR} weight_decay={WEIGHT_DECAY}; {args.repeats} rounds x {args.steps} steps")

    grads = random_grads(numel_per, args.blocks)
    het = {d: build_hetstore(width, args.blocks, d, grads) for d in args.dtypes.split(",")}
    first = next(iter(het.values()))
    ref = {"torch fused": build_torch(first, grads, cast=False)}
    if "bf16" in het:
        ref["torch fused + bf16 cast"] = build_torch(first, grads, cast=True)

    variants: dict[str, Callable[[], float]] = {}
    for dtype, case in het.items():
        variants[f"hetstore {dtype}"] = hetstore_steps(case, args.steps)
    for name, case in ref.items():
        variants[name] = torch_steps(case, args.steps)
    worker = None if args.no_deepspeed else start_deepspeed(numel_per, args.blocks, args.steps)
    if worker is not None:
        variants["DeepSpeedCPUAdam"] = worker.run
    try:
        for run in variants.values():
            run()  # warm-up: first-touch page faults and lazy state land outside the timing
        samples = interleaved(variants, args.repeats)
    finally:
        if worker is not None:
            worker.close()
    print()
    print(report(samples, numel, args.steps))
    print()
    check_weights(het, ref)
    if args.profile:
        profile_breakdown(het, args.steps, args.repeats)


if __name__ == "__main__":
    main()
