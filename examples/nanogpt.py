"""A nanoGPT-style character-level training loop whose model states exceed the device
budget, wrapped with one ``hetstore.offload`` call and ``auto_offload=True``: the planner
traces one batch and places every layer's parameters, optimizer states and activations.

Everything else is a plain PyTorch loop: AdamW, warm-up then cosine LR schedule, gradient
accumulation, global gradient-norm clipping. It prints the budget and the model states,
the plan, the loss as it goes down, and the device peak against the budget.

    python examples/nanogpt.py            # about 20 s on 2 idle CPU cores
    python examples/nanogpt.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import hetstore
from hetstore._sizes import format_size
from hetstore.demo import load_corpus


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, a ModuleList of blocks (hetstore makes each block
    a unit), a final LayerNorm and an LM head tied to the token embedding."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: scale the residual projections down with depth
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, temperature: float = 0.8, seed: int = 0):
        g = torch.Generator(idx.device).manual_seed(seed)
        for _ in range(new_tokens):
            logits = self(idx[:, -self.context :])[:, -1]
            probs = torch.softmax(logits / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
        return idx


def get_batch(data: torch.Tensor, batch: int, context: int, g: torch.Generator):
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=g).tolist()
    chunk = torch.stack([data[s : s + context + 1] for s in starts])
    return chunk[:, :-1], chunk[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.5,
        help="max_device_memory as a share of the model states",
    )
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.depth, args.heads, args.context = 64, 3, 2, 32
        args.batch, args.accum, args.steps, args.warmup = 8, 2, 16, 2

    # character level: the corpus's distinct bytes are the vocabulary
    raw = load_corpus()
    chars = torch.unique(raw)
    data = torch.searchsorted(chars, raw)
    vocab = chars.numel()

    torch.manual_seed(0)
    model = GPT(vocab, args.width, args.depth, args.heads, args.context)
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params  # fp32 weights + gradients + AdamW's two moments
    budget = int(states * args.budget_fraction)
    print(f"GPT: {args.depth} layers, width {args.width}, vocab {vocab} (characters)")
    print(
        f"{n_params:,} parameters; model states (fp32 param+grad+2 Adam moments): {states:,} bytes ({format_size(states)})"
    )
    print(
        f"max_device_memory: {budget:,} bytes ({format_size(budget)}) = {args.budget_fraction:.0%} of the states"
    )

    # nanoGPT's choice: weight decay on matrices, none on biases, LayerNorms, embeddings' rows
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(0)
    example = get_batch(data, args.batch, args.context, g)
    with tempfile.TemporaryDirectory() as offload_path:
        config = hetstore.OffloadConfig(
            auto_offload=True,
            max_device_memory=budget,
            # the default (1 MiB) leaves small saved tensors on the device; this toy
            # model's are all small, and the budget cannot hold them all
            activation_min_bytes="4KB",
            offload_path=offload_path,
            enable_pinned_mem=torch.cuda.is_available(),
        )
        model, optimizer = hetstore.offload(model, optimizer, config, example_inputs=example)
        print(f"\nthe plan auto_offload chose:\n{hetstore.state_of(model).plan}\n")
        device = config.resolved_device()

        # an LR scheduler over the returned optimizer: its param_groups are live
        scheduler = torch.optim.lr_scheduler.SequentialLR(
            optimizer,
            [
                torch.optim.lr_scheduler.LinearLR(
                    optimizer, start_factor=0.1, total_iters=args.warmup
                ),
                torch.optim.lr_scheduler.CosineAnnealingLR(
                    optimizer, T_max=args.steps - args.warmup, eta_min=args.lr / 10
                ),
            ],
            milestones=[args.warmup],
        )
        losses = []
        start = time.perf_counter()
        for step in range(args.steps):
            total = 0.0
            for _ in range(args.accum):
                x, y = get_batch(data, args.batch, args.context, g)
                loss = model(x.to(device), y.to(device)) / args.accum
                loss.backward()  # gradients accumulate (in the tier the plan chose)
                total += loss.item()
            # the global norm over every gradient, wherever hetstore keeps it
            if hasattr(optimizer, "clip_grad_norm_"):
                norm = optimizer.clip_grad_norm_(args.clip)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            losses.append(total)
            if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {total:.4f}  grad norm {norm:.3f}  lr {lr:.2e}")
        elapsed = time.perf_counter() - start

        prompt = data[: args.context // 2].unsqueeze(0).to(device)
        sample = model.generate(prompt, args.context)[0, prompt.shape[1] :]
        text = bytes(chars[sample.cpu()].tolist()).decode("utf-8", errors="replace")
        print(f"\nsample after training: {text!r}")

        window = max(1, args.steps // 5)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        verdict = "decreased" if last < first else "did NOT decrease"
        print(
            f"\nloss: mean of first {window} steps {first:.4f} -> last {window} steps {last:.4f} ({verdict})"
        )
        print(f"{args.steps} steps in {elapsed:.1f} s")
        stats = hetstore.memory_stats(model)
        peak = stats["device"]["peak"]
        print(
            f"device peak {peak:,} bytes of budget {budget:,} bytes "
            f"({'within budget' if peak <= budget else 'OVER BUDGET'}); "
            f"host peak {format_size(stats['host']['peak'])}, disk peak {format_size(stats['disk']['peak'])}"
        )
        if last >= first or peak > budget:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
