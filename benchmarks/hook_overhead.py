"""hetstore's own CPU time per step, where the ops are small: the thread that feeds a GPU.

On a GPU at common batch sizes the step is bound by the CPU threads that launch the
kernels, not by the GPU (the H200 run of 2026-11-28: GPT 185M at 8x512, GPU kernels
14 ms of plain's 25.5 ms step). Every microsecond hetstore's hooks spend in Python there
(per saved tensor, per parameter's gradient, per unit's fetch and release) is added to
the step. This measures that time on the CPU, where it is the same Python: a GPT of tiny
ops (width 64, depth 12, one 16-token sequence, one intra-op thread), so that the ops
cost little and the hooks show. Plain PyTorch and each placement run in one process,
their steps interleaved in a seeded random order each round, each phase timed apart (forward, backward, optimizer step and
zero_grad); the table gives the medians and what each adds to plain's.

    .venv/bin/python benchmarks/hook_overhead.py [--steps 80] [--out FILE]

Placements: ``host`` (``offload_param='cpu'``: the units fetched around each use) and
``states on host`` (``offload_param='none'``: the parameters stay on the device), both
``offload_optimizer='cpu'``, ``compute_dtype='bf16'``, under ``torch.autocast(bf16)``,
``overlap_step=False`` (the step in ``optimizer.step()``, as on a CPU device anyway).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import hetstore  # noqa: E402
from hetstore.demo.gpt import GPT  # noqa: E402

VOCAB, CTX = 256, 16
PLACEMENTS = {"host": "cpu", "states on host": "none"}


def build(base: torch.nn.Module, placement: str | None):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if placement is not None:
        config = hetstore.OffloadConfig(
            offload_param=PLACEMENTS[placement],
            offload_optimizer="cpu",
            device="cpu",
            compute_dtype="bf16",
            overlap_step=False,
            step_in_forward=False,
        )
        model, opt = hetstore.offload(model, opt, config, process_group=False)
    return model, opt


def step(model, opt, idx: torch.Tensor) -> tuple[float, float, float]:
    """Seconds of the forward (with the loss), the backward, and step + zero_grad."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", help="write the table and its provenance to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = GPT(vocab=VOCAB, width=64, depth=12, heads=4, ctx=CTX)
    runners = {"plain": build(base, None), **{p: build(base, p) for p in PLACEMENTS}}
    idx = torch.randint(0, VOCAB, (1, CTX + 1))
    variants = {name: functools.partial(step, *runner, idx) for name, runner in runners.items()}
    # (1 intra-op thread: no OpenMP team spins on after a step, so no settling between)
    _common.interleaved(variants, args.warmup, settle=0)
    times = _common.interleaved(variants, args.steps, settle=0)
    medians = {
        name: [statistics.median(phase) * 1e3 for phase in zip(*samples, strict=True)]
        for name, samples in times.items()
    }
    plain = sum(medians["plain"])
    rows = []
    for name, phases in medians.items():
        total = sum(phases)
        added = "-" if name == "plain" else f"{total - plain:+.2f}"
        rows.append(
            [name, *(f"{ms:.2f}" for ms in (*phases, total)), added, f"{total / plain:.2f}"]
        )
    header = ("runner", "forward", "backward", "step + zero_grad", "total", "added to plain")
    lines = [
        f"# hetstore's own CPU time per step: tiny GPT (width 64, depth 12, 1x{CTX} tokens, "
        f"{sum(p.numel() for p in base.parameters()) / 1e3:.0f}K parameters), 1 intra-op "
        f"thread, median of {args.steps} interleaved steps, ms",
        _common.format_table((*header, "/ plain"), rows),
        "",
        f"machine: {_common.machine_line()}",
        f"command: python benchmarks/hook_overhead.py {' '.join(sys.argv[1:])}".rstrip(),
        f"commit: {_common.git_commit()}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
