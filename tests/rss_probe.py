"""Run by test_rss: create a GPT whose fp32 training states exceed 3 GiB on the meta
device, train it with everything on disk, print peak RSS and the figures as JSON.

With a checkpoint directory it then saves the whole training state (``hetstore.save``),
takes one more step, loads the checkpoint back and repeats that step: the peak resident
set of the save and of the load are measured on their own (Linux resets the peak, VmHWM,
when 5 is written to /proc/self/clear_refs) besides the whole run's (``hetstore.peak_rss``: VmHWM)."""

from __future__ import annotations

import json
import sys
import time

import torch

import hetstore
from hetstore.demo.gpt import GPT


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def step(model, optimizer, x, y) -> float:
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def checkpoint_round_trip(model, optimizer, x, y, directory: str) -> dict:
    out = {}
    reset_peak_rss()  # (without it, the whole run's peak: an upper bound)
    start = time.perf_counter()
    saved = hetstore.save(directory, model, optimizer)
    out["save_s"] = time.perf_counter() - start
    out["save_peak_rss"] = hetstore.peak_rss()
    out["checkpoint_bytes"] = sum(f.stat().st_size for f in saved.iterdir())
    out["next_loss"] = step(model, optimizer, x, y)
    out["after_next_loss"] = step(model, optimizer, x, y)
    reset_peak_rss()  # (without it, the whole run's peak: an upper bound)
    start = time.perf_counter()
    hetstore.load(directory, model, optimizer)
    out["load_s"] = time.perf_counter() - start
    out["load_peak_rss"] = hetstore.peak_rss()
    out["resumed_loss"] = step(model, optimizer, x, y)
    out["resumed_after_loss"] = step(model, optimizer, x, y)
    return out


def current_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def named_weights_growth(model) -> dict:
    """The resident set ``hetstore.named_weights`` adds while a consumer takes every
    weight and drops it (an engine's load_weights copies each tensor in): its peak over
    what was resident before it started."""
    reset_peak_rss()
    before = current_rss()
    numel = 0
    for _, tensor in hetstore.named_weights(model, torch.float32):
        numel += tensor.numel()
    units = hetstore.state_of(model).runtime.units
    return {
        "named_weights_growth": hetstore.peak_rss() - before,
        "named_weights_numel": numel,
        "largest_unit_bytes": max(u.master_numel * 4 for u in units),
    }


def main(path: str, depth: int, steps: int, checkpoint: str | None = None) -> None:
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
    model, optimizer = hetstore.offload(model, optimizer, config, init_fn=GPT.init_weights)
    idx = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = [step(model, optimizer, x, y) for _ in range(steps)]
    stats = hetstore.memory_stats(model)
    figures = named_weights_growth(model)
    if checkpoint:
        figures.update(checkpoint_round_trip(model, optimizer, x, y, checkpoint))
    print(
        json.dumps(
            {
                "params": n_params,
                "states_bytes": n_params * 16,  # fp32 param + grad + 2 Adam moments
                "peak_rss": hetstore.peak_rss(),
                "device_peak": stats["device"]["peak"],
                "disk_peak": stats["disk"]["peak"],
                "losses": losses,
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
