"""The model, data and worker plumbing of ``vs_deepspeed.py``, in plain PyTorch.

Both workers import this file, and nothing here imports hetstore or DeepSpeed: the
DeepSpeed worker may run in an interpreter where hetstore is not installed, and neither
worker's peak RSS should carry the other library.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hetstore

# AdamW, the same on both sides (DeepSpeed's config and torch.optim.AdamW take these names)
LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
SEED = 0


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    width: int
    layers: int
    heads: int
    seq: int
    batch: int


PRESETS = {
    # 97.8M parameters: 12 blocks of 7.1M + a 12.6M tied embedding
    "100M": GPTConfig(vocab=16384, width=768, layers=12, heads=12, seq=128, batch=4),
    # 336M parameters: 24 blocks of 12.6M + a 33.6M tied embedding (GPT-2 medium's body)
    "350M": GPTConfig(vocab=32768, width=1024, layers=24, heads=16, seq=128, batch=4),
    # a harness check, in seconds; the embedding is 1 MiB in bf16, the smallest tensor
    # DeepSpeed swaps to NVMe (smaller ones stay in memory)
    "tiny": GPTConfig(vocab=4096, width=128, layers=2, heads=2, seq=32, batch=2),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT-style: learned positions, pre-norm blocks, tied input/output embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
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
        logits = self.head(self.ln_f(x)).float()  # a bf16 loss would hide differences
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: GPTConfig, dtype: str = "fp32") -> GPT:
    """The model in fp32. For a bf16 run its weights are rounded to bf16 values first:
    DeepSpeed casts the model to bf16 and builds its fp32 master from that cast, while
    hetstore (like torch mixed precision) keeps the fp32 weights it was given as master.
    Starting both from bf16-representable weights removes that known difference, so the
    losses can be compared closely (vs_deepspeed.md shows its size without this)."""
    torch.manual_seed(SEED)
    model = GPT(cfg)
    if dtype == "bf16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    return model


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in ``named_parameters`` order: both workers
    send it before handing the model over, so equal initial weights are checked, not
    assumed."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(memoryview(p.detach().contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()[:16]


def batch(cfg: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same in every process: sequences of the affine rule
    t -> (5t + 3) mod vocab from random starts, something the model can learn."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = [torch.randint(cfg.vocab, (cfg.batch, 1), generator=gen)]
    for _ in range(cfg.seq):
        tokens.append((tokens[-1] * 5 + 3) % cfg.vocab)
    seq = torch.cat(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------------- worker plumbing
class Channel:
    """The worker's reply line to the driver, kept apart from everything else printed.

    DeepSpeed logs to stdout, and JIT builds of its ops print from C++, so a reply on
    fd 1 would be interleaved with them. We move the driver's pipe to a private fd and
    point fd 1 (and ``sys.stdout``) at stderr, which the driver sends to a log file.
    """

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def commands(self):
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "quit":
                return
            yield command


def peak_rss_bytes() -> int:
    return hetstore.peak_rss()  # KiB on Linux


def io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused to be fetched from / sent to the
    storage layer, all threads: the same counter for both libraries' IO engines."""
    fields = dict(
        line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if ": " in line
    )
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def dir_bytes(path: str | None) -> int | None:
    """Bytes of disk allocated to the files under ``path`` (sparse holes not counted)."""
    if not path or not os.path.isdir(path):
        return None
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
