"""``requires_grad`` changed after ``offload()`` trains as plain PyTorch, or is refused.

Progressive unfreezing ("train the head first, then the body") freezes blocks for some
steps and unfreezes them later, with one AdamW over every parameter. A parameter that
requires grad when ``offload()`` runs gets its fp32 master, gradient and states laid out;
freezing and unfreezing it afterwards is honoured exactly: while frozen it gets no
gradient and is not stepped, and its first step with a gradient creates its state as
torch's does. A parameter frozen when ``offload()`` runs has none of that laid out: were
it unfrozen later it would silently stay untrained, so its first forward is refused,
naming it and the way out (runtime.unfrozen says why it is not laid out anyway).

Reference: plain PyTorch on the same seed with torch's fused AdamW; tolerance TIGHT
(fp32 round-off: the same kernel on the same gradients, measured bitwise equal), as in
test_host_offload. Over 2 gloo ranks: tests/integration/test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore import HetstoreError
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, disk_config, pair


def freeze_schedule(model, step: int) -> None:
    """The first two blocks frozen for steps 0-1, trained for steps 2-3, frozen again
    from step 4 (what a progressive-unfreezing callback does between steps)."""
    for block in model.blocks[:2]:
        block.requires_grad_(2 <= step < 4)


def train(model, optimizer, data, clip=None):
    losses = []
    for step, (x, y) in enumerate(data):
        freeze_schedule(model, step)
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_unfreeze_at_step_2_and_refreeze_at_step_4(where, clip, tmp_path):
    """offload() with every parameter trainable, the schedule freezing the first two
    blocks right after: the frozen blocks move only while unfrozen, exactly as in plain
    PyTorch (weight decay included: a step with a zero gradient would move them)."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    cfg = disk_config(tmp_path, where, where)
    if clip is not None:  # torch's clip reads p.grad: gradients in host memory
        cfg = cfg.replace(offload_grad="cpu")
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    data = batches(6)
    ref_losses = train(ref, ref_opt, data, clip)
    losses = train(mine, opt, data, clip)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    # the first block was stepped at steps 2 and 3 only, in both
    saved = opt.state_dict()["state"]
    first_block = [
        i for i, (name, _) in enumerate(mine.named_parameters()) if name.startswith("blocks.0.")
    ]
    assert all(float(saved[i]["step"]) == 2 for i in first_block)  # stepped at 2 and 3 only
    ref_saved = ref_opt.state_dict()["state"]
    assert all(float(ref_saved[i]["step"]) == 2 for i in first_block)


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_unfreezing_a_parameter_frozen_at_offload_is_refused(where, tmp_path):
    """Frozen when offload() ran, in the optimizer, unfrozen since: the next forward
    raises, naming the parameters and the way out, before anything is fetched."""
    model = GPT()
    for block in model.blocks[:2]:
        block.requires_grad_(False)
    model, opt = hetstore.offload(
        model, adamw(model.parameters()), disk_config(tmp_path, where, where)
    )
    x, y = batches(1)[0]
    model(x, y).backward()  # frozen: trains as plain PyTorch would
    opt.step()
    opt.zero_grad()
    model.blocks[0].requires_grad_(True)
    with pytest.raises(HetstoreError, match="'blocks.0.") as raised:
        model(x, y)
    assert "freeze them right after" in str(raised.value)
    model.blocks[0].requires_grad_(False)  # frozen again: training goes on
    model(x, y).backward()
    opt.step()


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_frozen_between_forward_and_backward_still_gets_the_forwards_gradient(where, tmp_path):
    """Autograd brings gradients by the graph the forward recorded (a GAN's loop freezes
    the discriminator after its forward): a block frozen between forward and backward
    still gets its gradient and is stepped, as in plain PyTorch."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    mine, opt = hetstore.offload(
        mine, adamw(mine.parameters()), disk_config(tmp_path, where, where)
    )
    for model, optimizer in ((ref, ref_opt), (mine, opt)):
        losses = []
        for x, y in batches(3):
            model.blocks[0].requires_grad_(True)
            loss = model(x, y)
            model.blocks[0].requires_grad_(False)  # after the forward, before backward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        model.results = losses
    torch.testing.assert_close(mine.results, ref.results, **TIGHT)
    assert_same_weights(ref, mine)
