"""PyTorch Lightning's Trainer drives an offloaded LightningModule as it drives a plain
one: automatic optimization (``optimizer.step(closure)``), ``gradient_clip_val``
(torch's ``clip_grad_norm_`` on ``p.grad``), ``accumulate_grad_batches``, an LR
scheduler, and checkpoint resume (``trainer.save_checkpoint`` then ``ckpt_path=``).

The only change to the module is one line in ``configure_optimizers``:
``_, optimizer = hetstore.offload(self, optimizer, config)``. Reference: the same module
without that line, on the same seed; tolerance TIGHT (fp32 round-off: the same fused
AdamW kernel on the same gradients, measured bitwise equal), as in test_host_offload.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, assert_same_weights

pl = pytest.importorskip("pytorch_lightning")


def placement(where: str | None, path) -> OffloadConfig | None:
    if where is None:
        return None
    # Lightning clips through torch's clip_grad_norm_ on p.grad: with gradients in host
    # memory, or on disk ("disk-grads": p.grad serves the clip, optim.disk_grads)
    grad = "disk" if where == "disk-grads" else "cpu"
    where = "disk" if where == "disk-grads" else where
    return OffloadConfig(
        offload_param=where,
        offload_optimizer=where,
        offload_grad=grad,
        offload_path=str(path),
        enable_pinned_mem=False,
        device="cpu",
    )


class LitGPT(pl.LightningModule):
    def __init__(self, config: OffloadConfig | None):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT()
        self.config = config
        self.losses: list[float] = []

    def forward(self, x, y):
        return self.gpt(x, y)

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        if self.config is not None:  # the one line hetstore adds
            _, optimizer = hetstore.offload(self, optimizer, self.config)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def fit(module, steps, *, ckpt_path=None, **trainer_args):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    loader = torch.utils.data.DataLoader(batches(16), batch_size=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*num_workers.*")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


WHERE = pytest.mark.parametrize("where", ["cpu", "disk", "disk-grads"])


@WHERE
def test_trainer_clip_and_accumulation_like_the_plain_module(where, tmp_path):
    args = dict(gradient_clip_val=0.5, accumulate_grad_batches=2)
    plain, mine = LitGPT(None), LitGPT(placement(where, tmp_path))
    fit(plain, 3, **args)
    fit(mine, 3, **args)
    assert len(plain.losses) == 6  # 3 steps of 2 micro-batches
    torch.testing.assert_close(mine.losses, plain.losses, **TIGHT)
    assert_same_weights(plain, mine)


def two_then_resumed(config_of, tmp_path, **args) -> tuple[list[float], LitGPT]:
    """Two steps, ``trainer.save_checkpoint``, then a new module and Trainer resumed
    from the file for two more (Lightning restarts a plain DataLoader's epoch, the same
    with or without hetstore); the losses of all four steps and the resumed module."""
    first = LitGPT(config_of("a"))
    trainer = fit(first, 2, **args)
    ckpt = tmp_path / f"two_steps_{id(first)}.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = LitGPT(config_of("b"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*resuming from a checkpoint.*")
        fit(resumed, 4, ckpt_path=str(ckpt), **args)
    return first.losses + resumed.losses, resumed


@WHERE
def test_checkpoint_resume_continues_exactly(where, tmp_path):
    """Lightning's checkpoint (the model's state_dict and the optimizer's, in torch's
    format) saved from an offloaded module and resumed into a new one continues as the
    plain module does."""
    args = dict(gradient_clip_val=0.5)
    plain_losses, plain = two_then_resumed(lambda _: None, tmp_path, **args)
    losses, mine = two_then_resumed(lambda sub: placement(where, tmp_path / sub), tmp_path, **args)
    assert len(losses) == 4
    torch.testing.assert_close(losses, plain_losses, **TIGHT)
    assert_same_weights(plain, mine)
