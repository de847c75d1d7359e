"""PyTorch Lightning with hetstore: a LightningModule whose parameters, gradients and
optimizer states live on disk, trained by ``pl.Trainer`` with gradient clipping,
gradient accumulation and an LR scheduler, exactly as the same module without hetstore.

The only hetstore line is in ``configure_optimizers``. Lightning steps through
``optimizer.step(closure)`` and clips through ``torch.nn.utils.clip_grad_norm_`` on
``p.grad``; both work with gradients on disk. Make the scheduler on the optimizer
``offload()`` returns (Lightning checks that it was returned).

    pip install -e ".[lightning]"
    python examples/lightning_gpt.py            # a few seconds on 2 CPU cores
    python examples/lightning_gpt.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import pytorch_lightning as pl
import torch

import hetstore
from hetstore.demo.gpt import GPT, batches


class LitGPT(pl.LightningModule):
    def __init__(self, width: int, depth: int, offload_path: str | None):
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT(vocab=256, width=width, depth=depth, heads=4, ctx=32)
        self.offload_path = offload_path  # None: plain PyTorch, for the comparison
        self.losses: list[float] = []

    def forward(self, x, y):  # hetstore's hooks are on the module you offload
        return self.net(x, y)

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)
        if self.offload_path is not None:
            config = hetstore.OffloadConfig(
                offload_param="disk",
                offload_optimizer="disk",  # gradients follow: on disk too
                offload_path=self.offload_path,
                device="cpu",
            )
            _, optimizer = hetstore.offload(self, optimizer, config)  # the one added line
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def fit(module: LitGPT, steps: int, batch: int) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = batches(2 * steps, vocab=256, batch=batch, ctx=32)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*num_workers.*")
        trainer.fit(module, loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run")
    args = parser.parse_args()
    width, depth, steps, batch = (64, 2, 3, 2) if args.tiny else (256, 6, 8, 8)
    plain = LitGPT(width, depth, None)
    fit(plain, steps, batch)
    with tempfile.TemporaryDirectory() as path:
        mine = LitGPT(width, depth, path)
        fit(mine, steps, batch)
        stats = hetstore.memory_stats(mine)
    print(f"GPT width {width}, depth {depth}: {steps} steps of 2 micro-batches of {batch}")
    print("micro-batch losses, plain PyTorch:", " ".join(f"{v:.4f}" for v in plain.losses))
    print("micro-batch losses, hetstore:     ", " ".join(f"{v:.4f}" for v in mine.losses))
    plain_sd, mine_sd = plain.state_dict(), mine.state_dict()
    gap = max((plain_sd[k] - mine_sd[k]).abs().max().item() for k in plain_sd)
    print(f"largest weight difference from plain PyTorch: {gap:.3g}")
    print(f"disk peak {stats['disk']['peak']:,} bytes (parameters, gradients, AdamW states)")


if __name__ == "__main__":
    main()
