"""Frozen parameters inside a unit: kept on the device until backward has left the unit,
never rewritten by a step (PEFT LoRA, a frozen LayerNorm inside a block).

Reference: plain PyTorch with torch's fused AdamW over the trainable parameters. Tolerance
TIGHT (fp32 round-off): the same fused kernel on the same fp32 gradients (measured equal).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.models.gpt import GPT, batches
from tests.test_hf_models import build, llama
from tests.test_host_offload import TIGHT, assert_same_weights

peft = pytest.importorskip("peft")

PLACEMENTS = ["none", "cpu", "disk"]


def config(param: str) -> OffloadConfig:
    # gradients in host memory, so torch's gradient APIs work on every placement
    return OffloadConfig(
        offload_param=param,
        offload_optimizer="cpu",
        offload_grad="cpu",
        enable_pinned_mem=False,
        device="cpu",
    )


def trainable_adamw(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def tiny_llama():
    cfg = llama()
    cfg.num_hidden_layers = 3
    return build(cfg)


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)  # LoRA's B starts at zero; make it non-zero so A's gradient is too
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def llama_batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def train_llama(model, optimizer, data):
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("param", PLACEMENTS)
def test_peft_lora_trains_like_plain_pytorch(param):
    ref = lora(tiny_llama())
    mine = copy.deepcopy(ref)
    ref_losses = train_llama(ref, trainable_adamw(ref), llama_batches(4))
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config(param))
    losses = train_llama(mine, opt, llama_batches(4))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_lora_base_on_disk_is_only_read_after_the_first_step():
    """Per step the frozen base is read once for forward and once for backward and never
    written: only the adapters' compute-dtype copy (the head of each unit's layout, up
    to the aligned start of its frozen part) is rewritten on disk; their fp32 master and
    states change in host memory. (Before: every unit's whole home, base included.)"""
    mine = lora(tiny_llama())
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config("disk"))
    runtime = hetstore.state_of(mine).runtime
    disk = hetstore.state_of(mine).tiers.disk
    data = llama_batches(3)
    train_llama(mine, opt, data[:1])
    read, written = disk.bytes_read, disk.bytes_written
    train_llama(mine, opt, data[1:])
    blocks = sum(u.home_bytes for u in runtime.block_units)
    root = runtime.root.home_bytes
    adapters = sum(u.frozen_start * u.compute_dtype.itemsize for u in runtime.units)
    assert adapters > 0
    assert disk.bytes_written - written == 2 * adapters
    # page-aligned reads: at most one page more per read than the unit's bytes
    per_step = (disk.bytes_read - read) / 2
    assert 2 * blocks + root <= per_step <= 2 * blocks + root + 4096 * (2 * 3 + 1)


class FrozenNormGPT(GPT):
    def __init__(self):
        super().__init__()
        for block in self.blocks:
            block.ln1.requires_grad_(False)  # a frozen LayerNorm inside every block


@pytest.mark.parametrize("param", PLACEMENTS)
def test_block_with_a_frozen_layernorm(param):
    torch.manual_seed(0)
    ref = FrozenNormGPT()
    mine = copy.deepcopy(ref)
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config(param))
    ref_opt = trainable_adamw(ref)
    for model, optimizer in ((ref, ref_opt), (mine, opt)):
        for x, y in batches(4):
            model(x, y).backward()
            optimizer.step()
            model.zero_grad()
    assert_same_weights(ref, mine)


def test_wholly_frozen_blocks_are_released_during_backward():
    """Freezing the first blocks (a common fine-tune) must not keep them all on the
    device until backward ends: when backward reaches a block, the blocks after it are
    gone (they were kept until the end before: four at once here)."""
    torch.manual_seed(0)
    model = GPT(width=64, depth=6)
    for block in model.blocks[:4]:
        block.requires_grad_(False)
    model, opt = hetstore.offload(model, trainable_adamw(model), config("cpu"))
    units = hetstore.state_of(model).runtime.block_units
    seen = []

    def count(grad):
        seen.append(sum(u.materialized for u in units))

    def hang(module, args, out):  # after hetstore's hook: runs once the block is fetched
        out.register_hook(count)

    for block in model.blocks:
        block.register_forward_hook(hang)
    x, y = batches(1)[0]
    model(x, y).backward()
    assert len(seen) == 6
    assert max(seen) == 1, seen
    assert not any(u.materialized for u in units)
