"""Copies of an offloaded model, and loads that would replace its parameters.

``copy.deepcopy(model)`` -- which ``torch.optim.swa_utils.AveragedModel`` and timm's EMA
helpers start with -- failed with ``cannot pickle 'mmap.mmap' object``. It now gives what
plain PyTorch gives: an independent plain model holding the weights the original computes
with (hetstore/runtime/copying.py). ``load_state_dict(..., assign=True)`` silently
replaced the managed parameters, so training changed nothing; it is now refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import hetstore
from hetstore import OffloadedParameterError
from tests.disk_helpers import disk_config
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, config, pair

PLACEMENTS = {"host": lambda path: config("cpu", "cpu"), "disk": disk_config}
HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called", "_state_dict_pre_hooks", "_state_dict_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def train(model, optimizer, data):
    for x, y in data:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def hook_counts(model: nn.Module) -> list[int]:
    return [len(getattr(m, name)) for m in model.modules() for name in HOOK_DICTS]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_deepcopy_gives_an_independent_plain_model_with_the_weights(placement, tmp_path):
    torch.manual_seed(0)
    model = GPT()
    plain_hooks = hook_counts(model)
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), PLACEMENTS[placement](tmp_path)
    )
    train(model, optimizer, batches(2))
    calls = []
    model.blocks[1].register_forward_hook(lambda m, a, out: calls.append(1))  # the user's
    # a user's own dict with small integer keys, like torch's hook ids
    model.id2label = {i: f"label {i}" for i in range(200)}
    wanted = model.state_dict()
    copied = copy.deepcopy(model)

    assert hetstore.state_of(copied) is None
    assert copied.id2label == model.id2label  # only hetstore's hook entries went
    assert sum(hook_counts(copied)) == sum(plain_hooks) + 1  # only the user's hook is left...
    assert len(copied.blocks[1]._forward_hooks) == 1  # ...and it was copied
    for name, p in copied.named_parameters():
        assert type(p) is nn.Parameter and p.requires_grad, name
        assert torch.equal(p.detach(), wanted[name]), name  # fp32 compute: the master
    x, y = batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(copied(x, y), model(x, y))  # computes what the original does
    assert len(calls) == 2

    # independent: training the copy leaves the original, and the original still trains
    plain_opt = torch.optim.AdamW(copied.parameters(), lr=1e-2)
    copied(x, y).backward()
    plain_opt.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in wanted.items())
    train(model, optimizer, batches(1, seed=5))
    assert not torch.equal(model.state_dict()["blocks.0.fc.weight"], wanted["blocks.0.fc.weight"])
    # a module of the model copies the same way
    block = copy.deepcopy(model.blocks[0])
    assert hetstore.state_of(block) is None and not block._forward_pre_hooks
    assert torch.equal(block.fc.weight.detach(), model.state_dict()["blocks.0.fc.weight"])


def test_averaged_model_keeps_the_ema_plain_pytorch_keeps():
    """torch's own EMA (AveragedModel with get_ema_multi_avg_fn), updated after every
    step, on the offloaded model and on a plain one: the host fp32 placement trains
    within TIGHT of plain PyTorch (its parity tests), so the averages agree within it."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), config("cpu", "cpu"))
    averages = []
    for model, optimizer in ((ref, ref_opt), (mine, opt)):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for x, y in batches(3):
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
        averages.append(ema)
    assert_same_weights(averages[0].module, averages[1].module, **TIGHT)


def test_load_state_dict_with_assign_is_refused_and_loads_nothing(tmp_path):
    torch.manual_seed(0)
    model = GPT()
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), config("cpu", "cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    zeros = {k: torch.zeros_like(v) for k, v in before.items()}
    with pytest.raises(OffloadedParameterError, match="assign=True"):
        model.load_state_dict(zeros, assign=True)
    with pytest.raises(OffloadedParameterError, match="assign=True"):
        model.blocks[0].load_state_dict(
            {k.removeprefix("blocks.0."): v for k, v in zeros.items() if k.startswith("blocks.0.")},
            assign=True,
        )
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # none replaced
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    train(model, optimizer, batches(1))  # and they still train
    assert not torch.equal(model.state_dict()["blocks.0.fc.weight"], before["blocks.0.fc.weight"])


def test_a_released_model_refuses_to_be_copied():
    torch.manual_seed(0)
    model, _ = hetstore.offload(GPT(), None, config("cpu", "cpu"))
    hetstore.release(model)
    with pytest.raises(OffloadedParameterError):
        copy.deepcopy(model)
