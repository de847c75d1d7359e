"""Run by test_rss_budgets: train a meta-built GPT under given budgets and report the
process's peak resident set against them, as JSON on the last line of stdout.

``baseline_rss`` is the resident set just before the model is built: the interpreter,
torch and hetstore imported, the memory a process spends before hetstore holds a byte.
``peak_rss`` is the whole run's high-water mark (``hetstore.peak_rss``: VmHWM, which
unlike ``ru_maxrss`` does not start at the parent's size)."""

from __future__ import annotations

import json
import sys

import torch

import hetstore
from hetstore.demo.gpt import GPT


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(path: str, placement: str, depth: int, device_budget: int, host_budget: int) -> None:
    keys = {
        "cpu": dict(offload_param="cpu", offload_optimizer="cpu"),
        "disk": dict(offload_param="disk", offload_optimizer="disk"),
        "auto": dict(auto_offload=True),
    }[placement]
    config = hetstore.OffloadConfig(
        **keys,
        offload_path=path,
        max_device_memory=device_budget,
        offload_cpu_size=host_budget,
        enable_pinned_mem=False,
        device="cpu",
    )
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    baseline = rss_now()
    with torch.device("meta"):
        model = GPT(vocab=256, width=1024, depth=depth, heads=16, ctx=64)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model, optimizer = hetstore.offload(model, optimizer, config, init_fn=GPT.init_weights)
    losses = []
    for _ in range(3):
        loss = model(x, y)
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stats = hetstore.memory_stats(model)
    plan = hetstore.state_of(model).plan
    print(
        json.dumps(
            {
                "params": n_params,
                "states_bytes": n_params * 16,
                "baseline_rss": baseline,
                "peak_rss": hetstore.peak_rss(),
                "device_peak": stats["device"]["peak"],
                "host_peak": stats["host"]["peak"],
                "disk_peak": stats["disk"]["peak"],
                "predicted_host": plan.estimate.host if plan.estimate is not None else None,
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
