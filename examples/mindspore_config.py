"""MindSpore's heterogeneous-storage configuration, as its guide writes it, driving hetstore.

The two ``offload_config`` dicts below are copied verbatim from the MindSpore guide
(manual placement, then ``auto_offload``), and so are its ``set_context`` keys except
``max_device_memory``: the guide's '30GB' is scaled down to a budget smaller than this
toy model's states. ``OffloadConfig.from_mindspore`` turns each into a config; a small
model trains with it. Printed per dict: the resulting config (``config.describe()``),
the placement plan, the loss, and the device peak against the budget.

    python examples/mindspore_config.py           # seconds to a minute
    python examples/mindspore_config.py --tiny    # seconds
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import hetstore
from hetstore._sizes import format_size

# mindspore.set_offload_context(offload_config=...), the guide's manual example
MANUAL = {
    "offload_param": "cpu",
    "auto_offload": False,
    "offload_cpu_size": "512GB",
    "offload_disk_size": "1024GB",
    "offload_path": "./offload/",
    "host_mem_block_size": "1GB",
    "enable_aio": True,
    "enable_pinned_mem": True,
}
# the guide's automatic example: offload_param is only the initial placement there
AUTO = {
    "offload_path": "./offload/",
    "auto_offload": True,
    "offload_param": "cpu",
    "offload_cpu_size": "512GB",
    "offload_disk_size": "1024GB",
    "host_mem_block_size": "1GB",
    "enable_aio": True,
    "enable_pinned_mem": True,
}


class ResidualMLP(nn.Module):
    """A classifier whose repeated blocks become hetstore's units."""

    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width))
            for _ in range(depth)
        )  # fmt: skip
        self.out = nn.Linear(width, classes)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.out(h), y)


def train(name: str, offload_config: dict, args) -> list[float]:
    torch.manual_seed(0)
    model = ResidualMLP(args.features, args.width, args.depth, args.classes)
    states = 16 * sum(p.numel() for p in model.parameters())  # fp32 param, grad, 2 moments
    budget = int(states * args.budget_fraction)
    # mindspore.set_context(mode=mindspore.GRAPH_MODE, memory_offload='ON', max_device_memory='30GB')
    config = hetstore.OffloadConfig.from_mindspore(
        offload_config, mode="GRAPH_MODE", memory_offload="ON", max_device_memory=budget
    )
    print(f"== {name}: offload_config = {offload_config}")
    print(f"model states {format_size(states)}, max_device_memory {format_size(budget)}")
    print(f"config.describe():\n{config.describe()}")

    # a learnable task: the label is which of `classes` fixed directions x is nearest
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(args.classes, args.features, generator=g)

    def batch():
        y = torch.randint(0, args.classes, (args.batch,), generator=g)
        return centers[y] + 2.0 * torch.randn(args.batch, args.features, generator=g), y

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    example = batch()  # auto_offload traces one batch to plan activations too
    model, optimizer = hetstore.offload(model, optimizer, config, example_inputs=example)
    print(f"plan ({hetstore.state_of(model).plan.source}):\n{hetstore.state_of(model).plan}")
    device = config.resolved_device()
    losses = []
    for step in range(args.steps):
        x, y = batch()
        loss = model(x.to(device), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    peak = hetstore.memory_stats(model)["device"]["peak"]
    within = "within budget" if peak <= budget else "OVER BUDGET"
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"device peak {peak:,} bytes of budget {budget:,} bytes ({within})\n")
    if peak > budget or losses[-1] >= losses[0]:
        raise SystemExit(1)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.5,
        help="max_device_memory as a share of the model states",
    )
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run")
    args = parser.parse_args()
    if args.tiny:
        args.features, args.width, args.depth, args.batch, args.steps = 16, 32, 3, 16, 10
    manual = train("manual (the guide's first example)", MANUAL, args)
    auto = train("auto_offload (the guide's second example)", AUTO, args)
    # placement moves data, never changes the arithmetic: the two runs see the same batches
    diff = max(abs(a - b) for a, b in zip(manual, auto, strict=True))
    print(f"max |loss difference| between the two placements: {diff:.2e}")


if __name__ == "__main__":
    main()
