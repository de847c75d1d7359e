"""``hetstore demo``: a GPT whose training states exceed the device budget trains anyway.

Trains a small GPT on a text shipped with the package, byte-level, with parameters and
optimizer states offloaded to host memory under a device budget smaller than the
states; prints the loss as it goes and the per-tier peaks at the end. ``compare`` also
trains plain PyTorch on the same batches and shows the losses agree; ``no_offload``
shows the failure the budget causes without offload.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from importlib import resources

import torch

import hetstore
from hetstore._sizes import format_size
from hetstore.demo.gpt import GPT

__all__ = ["DemoSettings", "run_demo", "load_corpus"]


@dataclass(frozen=True)
class DemoSettings:
    width: int = 256
    depth: int = 6
    context: int = 64
    batch: int = 8
    steps: int = 40
    lr: float = 3e-3
    budget_fraction: float = 0.2  # device budget as a share of the training states
    seed: int = 0
    compare: bool = False
    no_offload: bool = False


def load_corpus() -> torch.Tensor:
    text = resources.files("hetstore.demo").joinpath("corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def _batches(data: torch.Tensor, settings: DemoSettings):
    g = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.steps):
        starts = torch.randint(
            0, data.numel() - settings.context - 1, (settings.batch,), generator=g
        )
        chunk = torch.stack([data[s : s + settings.context + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def _model(settings: DemoSettings) -> GPT:
    torch.manual_seed(settings.seed)
    heads = max(1, settings.width // 64)
    return GPT(
        vocab=256, width=settings.width, depth=settings.depth, heads=heads, ctx=settings.context
    )


def run_demo(settings: DemoSettings = DemoSettings(), out=sys.stdout) -> int:
    data = load_corpus()
    model = _model(settings)
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params  # fp32 params + grads + two Adam moments
    budget = int(states * settings.budget_fraction)
    reference = copy.deepcopy(model) if settings.compare else None
    place = "none" if settings.no_offload else "cpu"
    config = hetstore.OffloadConfig(
        offload_param=place,
        offload_optimizer=place,
        offload_activations=place,
        activation_min_bytes="64KB",  # the demo's activations are small
        max_device_memory=budget,
        offload_cpu_size="4GB",
    )
    device = config.resolved_device()
    print(
        f"hetstore demo: GPT {settings.depth} layers x width {settings.width}, "
        f"{n_params / 1e6:.2f}M parameters on {device}\n"
        f"  training states (fp32 params + grads + Adam moments): {format_size(states)}\n"
        f"  device budget (max_device_memory):                   {format_size(budget)}\n"
        f"  placement: parameters, optimizer states, activations -> {place}",
        file=out,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, fused=True)
    try:
        model, optimizer = hetstore.offload(model, optimizer, config)
        losses = _train(model, optimizer, data, settings, device, out, label="hetstore")
    except hetstore.OutOfDeviceMemory as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 1
    stats = hetstore.memory_stats(model)
    print("\nper-tier peak (bytes hetstore accounted):", file=out)
    for tier, s in stats.items():
        print(
            f"  {tier:>6}: peak {format_size(s['peak']):>12}  of {format_size(s['capacity'])}",
            file=out,
        )
    within = stats["device"]["peak"] <= budget
    print(f"  device peak within budget: {'yes' if within else 'NO'}", file=out)
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=settings.lr, fused=True)
        ref_losses = _train(reference.to(device), ref_opt, data, settings, device, None, "plain")
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        print(
            f"\nplain PyTorch (no budget) final loss {ref_losses[-1]:.4f}; "
            f"max |loss difference| over {len(losses)} steps: {diff:.2e}",
            file=out,
        )
    return 0 if within else 1


def _train(model, optimizer, data, settings, device, out, label) -> list[float]:
    losses = []
    start = time.perf_counter()
    for step, (x, y) in enumerate(_batches(data, settings), 1):
        loss = model(x.to(device), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if out is not None and (step % 5 == 0 or step == 1):
            rate = step * settings.batch * settings.context / (time.perf_counter() - start)
            print(
                f"  [{label}] step {step:3d}  loss {losses[-1]:.4f}  {rate:8.0f} tokens/s", file=out
            )
    return losses
