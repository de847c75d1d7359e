"""Reentrant activation checkpointing (``use_reentrant=True``: torch's checkpoint when it
is not passed, and transformers 4's ``gradient_checkpointing_enable()``): each block's
backward runs as a graph task of its own inside the outer backward. The runtime takes it as part of the outer backward: the
steps taken in backward are the same as without checkpointing, and training is bitwise
plain PyTorch's (fused AdamW, the flat step's kernel)."""

from __future__ import annotations

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

import hetstore
import hetstore.demo.gpt as demo_gpt
from tests.models.gpt import GPT, batches
from tests.parity import adamw, assert_same_weights, disk_config, pair, run

STEPS = 3


@pytest.fixture
def reentrant(monkeypatch):
    """The demo GPT's checkpointing, reentrant."""

    def checkpoint(function, *args, use_reentrant):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=True)

    monkeypatch.setattr(demo_gpt, "checkpoint", checkpoint)


def model():
    return GPT(depth=3, checkpointing=True)


def train(cfg, data):
    ref, mine = pair(model)
    ref_out = run(ref, adamw(ref.parameters()), data)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    out = run(mine, opt, data)
    assert out == ref_out  # losses, bitwise
    assert_same_weights(ref, mine, rtol=0, atol=0)
    return opt.speculation_stats


@pytest.mark.parametrize("consume", [False, True], ids=["overlap_step", "step_in_backward"])
def test_disk_units_are_stepped_in_backward_as_without_reentrancy(reentrant, tmp_path, consume):
    """Every unit's step is taken in backward, as it is without checkpointing (before,
    each block's inner backward was taken for a new one: step_in_backward refused it as
    "a second backward before optimizer.step()", and overlap_step stepped 4 of 12)."""
    cfg = disk_config(tmp_path, overlap_step=not consume, step_in_backward=consume)
    stats = train(cfg, batches(STEPS))
    units = 4  # three blocks and the root
    assert stats["started"] == stats["committed"] == units * STEPS, stats


def test_host_units_train_exactly(reentrant, tmp_path):
    train(disk_config(tmp_path, param="cpu", optim="cpu"), batches(STEPS))


def test_a_backward_that_raised_leaves_the_next_one_whole(reentrant, tmp_path):
    """A backward that raises never reaches autograd's end-of-backward callback; the next
    forward starts afresh, so the backward after it is a new one (not taken for one run
    inside the failed one): training goes on as plain PyTorch's does after the same
    failure and a ``zero_grad()``, and every unit is stepped in backward again (from
    the third step: the step after the failure counts two backwards, so the step
    policy expects two micro-batches in the next one and steps it after backward)."""
    data = batches(5)
    ref, mine = pair(model)
    cfg = disk_config(tmp_path, overlap_step=True)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)

    def fail(grad):
        raise RuntimeError("a hook failed")

    def fail_after_the_last_block(block, args):
        # the gradient of the last block's input: after that block's backward, whose
        # gradient hooks saw the backward start (the forward under checkpoint's no_grad,
        # not its recompute)
        if not torch.is_grad_enabled():
            args[0].register_hook(fail)

    for net, optimizer in ((ref, adamw(ref.parameters())), (mine, opt)):
        run(net, optimizer, data[:1])
        handle = net.blocks[-1].register_forward_pre_hook(fail_after_the_last_block)
        x, y = data[1]
        with pytest.raises(RuntimeError, match="a hook failed"):
            net(x, y).backward()
        handle.remove()
        optimizer.zero_grad()
        net.losses = run(net, optimizer, data[2:-1])
        before = dict(opt.speculation_stats)
        net.losses += run(net, optimizer, data[-1:])
    assert mine.losses == ref.losses
    assert_same_weights(ref, mine, rtol=0, atol=0)
    last = {k: opt.speculation_stats[k] - before[k] for k in before}
    assert last["started"] == last["committed"] == 4, last  # three blocks and the root


def test_a_backward_retried_after_it_raised_without_a_forward_is_a_new_one(tmp_path):
    """The same graph's backward again (``retain_graph``), no forward between, after one
    that raised past the final norm's gradients: the first attempt's task dropped its
    end-of-backward callback, so the retry starts a backward of its own (counted afresh,
    ended once). Before, it was taken for one run inside the failed one: the root was
    stepped without its embeddings' gradients."""

    def train_retrying(net, optimizer, data):
        losses = []
        for i, (x, y) in enumerate(data):
            armed = [i == 1]

            def fail(grad, armed=armed):
                if armed[0]:
                    armed[0] = False
                    raise RuntimeError("a hook failed")

            def fail_there(block, args, out, fail=fail):
                out.register_hook(fail)  # the last block's output: after the final norm's

            handle = net.blocks[-1].register_forward_hook(fail_there)
            loss = net(x, y)
            handle.remove()
            try:
                loss.backward(retain_graph=True)
            except RuntimeError:
                optimizer.zero_grad()
                loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        return losses

    data = batches(STEPS)
    ref, mine = pair(lambda: GPT(depth=3))
    ref_losses = train_retrying(ref, adamw(ref.parameters()), data)
    cfg = disk_config(tmp_path, step_in_backward=True)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    assert train_retrying(mine, opt, data) == ref_losses
    assert_same_weights(ref, mine, rtol=0, atol=0)


class LossFromTheBlocks(torch.nn.Module):
    """Nothing trainable after the last checkpointed block: the model's first gradient
    hook comes inside a checkpoint's own graph task (its output is made under no_grad,
    so it has no hook of its own either)."""

    def __init__(self, checkpointing: bool = True):
        super().__init__()
        self.checkpointing = checkpointing
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(3)
        )

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            if self.checkpointing:
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h)
        return ((h[..., :4] - y) ** 2).mean()


def test_a_backward_whose_first_gradient_comes_inside_a_checkpoint_is_one(tmp_path):
    """The end of backward is queued from the model output's gradient hook, in the
    outermost graph task: every unit is stepped in backward (before, the callback went on
    the first block's task and ended the backward there: step_in_backward refused "a
    second backward")."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]
    ref, mine = pair(LossFromTheBlocks)
    ref_losses = run(ref, adamw(ref.parameters()), data)
    cfg = disk_config(tmp_path, step_in_backward=True)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, units=list(mine.blocks))
    assert run(mine, opt, data) == ref_losses
    assert_same_weights(ref, mine, rtol=0, atol=0)
    stats = opt.speculation_stats
    assert stats["started"] == stats["committed"] == 4 * len(data), stats  # blocks and root


def test_a_gradient_of_the_inputs_alone_is_not_a_training_backward(tmp_path):
    """``torch.autograd.grad`` of the inputs (a saliency map between steps) goes through
    the model output's hook and no parameter's: it queues the end of a backward that never
    starts, which then does nothing (no step counted, no unit released or committed).
    (Without checkpointing: reentrant checkpointing refuses ``torch.autograd.grad``.)"""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]

    def train_with_saliency(net, optimizer):
        losses = []
        for x, y in data:
            probe = x.clone().requires_grad_(True)
            (saliency,) = torch.autograd.grad(net(probe, y), probe)
            assert saliency.abs().sum() > 0
            losses += run(net, optimizer, [(x, y)])[0]
        return losses

    ref, mine = pair(lambda: LossFromTheBlocks(checkpointing=False))
    ref_losses = train_with_saliency(ref, adamw(ref.parameters()))
    cfg = disk_config(tmp_path, overlap_step=True)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, units=list(mine.blocks))
    assert train_with_saliency(mine, opt) == ref_losses
    assert_same_weights(ref, mine, rtol=0, atol=0)
    stats = opt.speculation_stats
    assert stats["started"] == stats["committed"] == 4 * len(data), stats
