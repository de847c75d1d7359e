"""Training step of a GPT: hetstore-offloaded against plain PyTorch, side by side.

    .venv/bin/python benchmarks/train_step.py [--size 100M] [--steps 8] [--warmup 2]
    .venv/bin/python benchmarks/train_step.py --tiny      # a few seconds: checks the harness

Both variants train the same nanoGPT-style model (tied embeddings, LayerNorm, a
ModuleList of pre-norm blocks, causal SDPA attention) from the same seed on the same
batches with ``torch.optim.AdamW(fused=True)``, in fp32:

* ``plain``: the model and optimizer as they are;
* ``offloaded``: ``hetstore.offload(model, optimizer, config)`` with offload_param=cpu and
  offload_optimizer=cpu (each block a unit; fp32 master, gradients and Adam states in the
  host tier; a block's parameters are copied in before its forward and backward).

Each variant runs in its own worker process (so its peak RSS is its own), and the two
are driven in lockstep: step i of one, then step i of the other (random order per step,
a short pause between), so drift of the shared machine hits both alike. Reported: median
step time (and forward / backward / optimizer parts), the paired per-step ratio
offloaded / plain, each process's peak RSS, hetstore's device/host peaks, and the largest
difference between the two runs' losses.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hetstore
from _common import (
    bench_command,
    format_table,
    lockstep,
    loss_report,
    machine_line,
    median,
    peak_rss_bytes,
    record_json,
    reply,
    size,
    spread,
    start_worker,
)

LR = 3e-4
WEIGHT_DECAY = 0.1


# ---------------------------------------------------------------------------- model
@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    width: int
    layers: int
    heads: int
    seq: int
    batch: int


PRESETS = {
    # ~91M parameters: 85M in 12 blocks + 6.3M tied embedding
    "100M": GPTConfig(vocab=8192, width=768, layers=12, heads=12, seq=128, batch=4),
    # the shape of the DeepSpeed ZeRO-3 probe in /work/shared/BASELINES.md
    "27M": GPTConfig(vocab=4096, width=512, layers=8, heads=8, seq=128, batch=4),
    "tiny": GPTConfig(vocab=256, width=64, layers=2, heads=2, seq=32, batch=2),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: hetstore puts it in the root unit
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(cfg: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same in every process: sequences of a fixed affine map
    t -> (5t + 3) mod vocab from random starts -- a rule the model can learn, not noise."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(cfg.vocab, (cfg.batch, 1), generator=gen)
    tokens = [start]
    for _ in range(cfg.seq):
        tokens.append((tokens[-1] * 5 + 3) % cfg.vocab)
    seq = torch.cat(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------------------- worker
def build(variant: str, cfg: GPTConfig, max_device_memory: str):
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if variant == "offloaded":
        config = hetstore.OffloadConfig(
            offload_param="cpu",
            offload_optimizer="cpu",
            max_device_memory=max_device_memory,
            enable_pinned_mem=False,
            device="cpu",
            compute_dtype="fp32",
        )
        model, optimizer = hetstore.offload(model, optimizer, config)
    return model, optimizer


def train_step(model, optimizer, cfg: GPTConfig, step: int) -> dict[str, float]:
    x, y = batch(cfg, step)
    t0 = time.perf_counter()
    loss = model(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    t3 = time.perf_counter()
    return {"loss": loss.item(), "time": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2}


def worker(variant: str, cfg: GPTConfig, max_device_memory: str) -> None:
    """Line protocol on stdin/stdout: JSON commands in, one JSON reply per command."""
    model, optimizer = build(variant, cfg, max_device_memory)
    params = sum(p.numel() for p in model.parameters())
    reply({"ready": True, "params": params})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "step":
            reply(train_step(model, optimizer, cfg, command["step"]))
        elif command["op"] == "stats":
            stats = hetstore.memory_stats(model) if variant == "offloaded" else None
            reply({"rss": peak_rss_bytes(), "memory_stats": stats})
        else:
            break


# ---------------------------------------------------------------------------- driver
def summarize(results: dict[str, list[dict[str, float]]], stats: dict[str, dict], warmup: int):
    timed = {v: r[warmup:] for v, r in results.items()}
    plain = [s["time"] for s in timed["plain"]]
    rows = []
    for variant, steps in timed.items():
        times = [s["time"] for s in steps]
        parts = [f"{median([s[k] for s in steps]):.3f}" for k in ("fwd", "bwd", "opt")]
        ratio = median([t / p for t, p in zip(times, plain, strict=True)])
        tiers = stats[variant]["memory_stats"] or {}
        rows.append(
            [variant, f"{median(times):.3f} {spread(times)}", *parts, f"{ratio:.3f}"]
            + [size(stats[variant]["rss"])]
            + [size(tiers.get(t, {}).get("peak")) for t in ("device", "host")]
        )
    header = ["variant", "step s, median [min..max]", "fwd s", "bwd s", "opt s"]
    header += ["time / plain", "peak RSS", "hetstore device peak", "hetstore host peak"]
    return format_table(header, rows)


def record_row(
    results: dict[str, list[dict[str, float]]], stats: dict[str, dict], warmup: int, args
) -> dict:
    """The offloaded variant's figures, as ``summarize`` computes them, for record_json."""
    timed = {v: r[warmup:] for v, r in results.items()}
    plain = [s["time"] for s in timed["plain"]]
    steps = timed["offloaded"]
    times = [s["time"] for s in steps]
    cfg = PRESETS[args.size]
    loss_diff = max(  # over every step, as loss_report
        abs(a["loss"] - b["loss"])
        for a, b in zip(results["offloaded"], results["plain"], strict=True)
    )
    tiers = stats["offloaded"]["memory_stats"] or {}
    return {
        "config": f"{args.size} GPT, batch {cfg.batch}x{cfg.seq}, fp32: offload_param=cpu, "
        "offload_optimizer=cpu, CPU device",
        "plain_s": round(median(plain), 3),
        "hetstore_s": round(median(times), 3),
        "ratio": round(median([t / p for t, p in zip(times, plain, strict=True)]), 3),
        **{f"{k}_s": round(median([s[k] for s in steps]), 3) for k in ("fwd", "bwd", "opt")},
        "plain_rss": size(stats["plain"]["rss"]),
        "hetstore_rss": size(stats["offloaded"]["rss"]),
        "host_peak": size(tiers.get("host", {}).get("peak")),
        "loss_diff": f"{loss_diff:.2e}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100M", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--tiny", action="store_true", help="tiny model, 3 steps: a harness check")
    parser.add_argument(
        "--max-device-memory",
        default="512MB",
        help="hetstore's device budget (the 100M model's activations, kept on the device "
        "and counted there since the CPU device counts them, take ~205 MiB at batch 4x128 "
        "beside ~50 MiB of fetched parameters: 256MB no longer holds them)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the result as a record for docs/performance.md "
        "(benchmarks/results/*.json; then run tools/perf_page.py)",
    )
    parser.add_argument("--worker", choices=("plain", "offloaded"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.size, args.steps, args.warmup = "tiny", 3, 1
    cfg = PRESETS[args.size]
    if args.worker:
        worker(args.worker, cfg, args.max_device_memory)
        return

    print(machine_line())
    argv = ["--size", args.size, "--max-device-memory", args.max_device_memory]
    workers = [start_worker(__file__, v, argv) for v in ("plain", "offloaded")]
    try:
        params = workers[0].params
        print(f"GPT {args.size}: {params / 1e6:.1f}M params, {asdict(cfg)}")
        print(f"AdamW(fused=True) lr={LR} wd={WEIGHT_DECAY}, fp32; ", end="")
        print(f"{args.warmup} warm-up + {args.steps} timed steps, lockstep")
        results = lockstep(workers, args.warmup + args.steps, progress=False)
        stats = {w.variant: w.request({"op": "stats"}) for w in workers}
    finally:
        for w in workers:
            w.close()
    print()
    print(summarize(results, stats, args.warmup))
    print()
    print(loss_report(results)[0])
    if not all(math.isfinite(s["loss"]) for r in results.values() for s in r):
        sys.exit("non-finite loss")
    if args.json:
        record_json(
            args.json,
            scenario="train_step",
            rows=[record_row(results, stats, args.warmup, args)],
            command=bench_command("benchmarks/train_step.py", sys.argv[1:]),
            machine=machine_line(),
        )


if __name__ == "__main__":
    main()
