"""Run by test_rss: create a GPT whose fp32 training states exceed 3 GiB on the meta
device, train it with everything on disk, print peak RSS and the figures as JSON."""

from __future__ import annotations

import json
import resource
import sys

import torch

import hetstore
from hetstore.demo.gpt import GPT


def main(path: str, depth: int, steps: int) -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(vocab=256, width=1024, depth=depth, heads=16, ctx=64)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    config = hetstore.OffloadConfig(
        offload_param="disk",
        offload_optimizer="disk",
        offload_path=path,
        max_device_memory="256MB",
        optimizer_chunk_size="8MB",
        enable_pinned_mem=False,
        device="cpu",
    )
    model, optimizer = hetstore.offload(model, optimizer, config, init_fn=GPT._init_weights)
    idx = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stats = hetstore.memory_stats(model)
    print(
        json.dumps(
            {
                "params": n_params,
                "states_bytes": n_params * 16,  # fp32 param + grad + 2 Adam moments
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "device_peak": stats["device"]["peak"],
                "disk_peak": stats["disk"]["peak"],
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
