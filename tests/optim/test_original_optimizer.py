"""The optimizer the user made stays valid after ``offload()``, and ``step(closure)``
behaves as torch's.

Most scripts build the optimizer and its scheduler first and wrap afterwards; whatever
holds the original (a scheduler, a warm-up callback, a logger) must see and steer the
step hetstore takes. Reference: plain PyTorch on the same seed with torch's fused AdamW;
tolerance TIGHT (fp32 round-off: the same fused kernel on the same gradients, measured
bitwise equal), as in test_host_offload.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hetstore
from hetstore import ConfigError
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, disk_config, pair

PLACEMENTS = ["cpu", "disk"]


def train(model, optimizer, scheduler, data, *, edit=None):
    """A plain loop that steers through ``scheduler`` and ``edit(step)``, both made on
    the optimizer the user built; returns the losses and the lr each step used."""
    losses, lrs = [], []
    for i, (x, y) in enumerate(data):
        if edit is not None:
            edit(i)
        loss = model(x, y)
        loss.backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, lrs


@pytest.mark.parametrize("where", PLACEMENTS)
def test_scheduler_made_before_offload_keeps_scheduling(where, tmp_path):
    """StepLR and a param-group edit made on the original AdamW, then offload(): the lr
    halves every step and the edit (weight decay off at step 2) lands, exactly as in
    plain PyTorch, with no warning from torch's scheduler."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    original = adamw(mine.parameters())
    sched = torch.optim.lr_scheduler.StepLR(original, 1, 0.5)

    def decay_off(opt):
        def edit(step):
            if step == 2:
                for group in opt.param_groups:
                    group["weight_decay"] = 0.0

        return edit

    mine, opt = hetstore.offload(mine, original, disk_config(tmp_path, where, where))
    data = batches(5)
    ref_losses, ref_lrs = train(ref, ref_opt, ref_sched, data, edit=decay_off(ref_opt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler.step() before optimizer.step()"
        losses, lrs = train(mine, opt, sched, data, edit=decay_off(original))
    assert ref_lrs == [1e-2 * 0.5**i for i in range(5)]
    assert lrs == ref_lrs
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert original.param_groups is opt.param_groups


@pytest.mark.parametrize("where", PLACEMENTS)
def test_the_original_optimizer_steps_through_hetstore(where, tmp_path):
    """A caller holding only the original (a Trainer callback, a script written before
    the wrap) steps, zeroes and saves through it: the same training, the same state."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    original = adamw(mine.parameters())
    mine, opt = hetstore.offload(mine, original, disk_config(tmp_path, where, where))
    for x, y in batches(3):
        for model, optimizer in ((ref, ref_opt), (mine, original)):
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same_weights(ref, mine)
    saved = original.state_dict()
    assert saved["state"].keys() == ref_opt.state_dict()["state"].keys()
    for index, state in saved["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, ref_opt.state_dict()["state"][index][key], **TIGHT)
    original.load_state_dict(ref_opt.state_dict())  # and loads through it


def test_the_original_alone_keeps_training():
    """A caller that keeps only the optimizer it made (``_, opt`` never used): the
    returned one lives as long as the original, on every placement (held weakly, it had
    gone at a garbage collection whose moment depended on the placement)."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    original = adamw(mine.parameters())
    hetstore.offload(mine, original, disk_config("unused", "cpu", "cpu"))
    import gc

    gc.collect()
    for x, y in batches(2):
        for model, optimizer in ((ref, ref_opt), (mine, original)):
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same_weights(ref, mine)


def test_add_param_group_after_offload_is_refused():
    model = GPT()
    mine, opt = hetstore.offload(
        model, adamw(list(model.parameters())[:-1]), disk_config("x", "cpu", "cpu")
    )
    with pytest.raises(ConfigError, match="before calling hetstore.offload"):
        opt.add_param_group({"params": [list(model.parameters())[-1]]})


# ---------------------------------------------------------------------- step(closure)
def closure_steps(model, optimizer, data, clip):
    """Steps the way torch's docs and Lightning's automatic optimization do:
    ``optimizer.step(closure)``, the closure computing the loss, its backward and the
    clip (torch's own clip_grad_norm_ on p.grad)."""
    losses = []
    for x, y in data:

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            return loss

        with torch.no_grad():  # (the closure must still see gradients enabled)
            losses.append(optimizer.step(closure).item())
    return losses


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("clip", [1e9, 0.05], ids=["no-bite", "bites"])
def test_step_with_a_closure_is_torchs(where, clip, tmp_path):
    """On cpu and disk (gradients in host memory, for torch's clip), with a clip that
    bites and one that does not: the closure's loss comes back and training is plain
    PyTorch's."""
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    cfg = disk_config(tmp_path, where, where).replace(offload_grad="cpu")
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    data = batches(4)
    ref_losses = closure_steps(ref, ref_opt, data, clip)
    losses = closure_steps(mine, opt, data, clip)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_step_with_a_closure_under_fp16_scaling():
    """fp16 compute: the closure scales its loss (optimizer.backward), the step
    unscales, clips through hetstore and skips on overflow as without a closure."""
    torch.manual_seed(0)
    plain, closed = GPT(), GPT()
    closed.load_state_dict(plain.state_dict())
    cfg = disk_config("x", "cpu", "cpu").replace(compute_dtype="fp16")
    plain, plain_opt = hetstore.offload(plain, adamw(plain.parameters()), cfg)
    closed, closed_opt = hetstore.offload(closed, adamw(closed.parameters()), cfg)
    for x, y in batches(3):
        plain_opt.backward(plain(x, y))
        plain_opt.clip_grad_norm_(1.0)
        plain_opt.step()
        plain_opt.zero_grad()

        def closure(x=x, y=y):
            loss = closed(x, y)
            closed_opt.backward(loss)
            closed_opt.clip_grad_norm_(1.0)
            return loss

        closed_opt.step(closure)
        closed_opt.zero_grad()
    assert_same_weights(plain, closed, rtol=0, atol=0)


def test_step_hooks_registered_on_the_original_run_around_the_step():
    """A callback that registered a step hook on the optimizer before offload() (a
    profiler, an EMA updater) keeps being called, once per step, before and after."""
    model = GPT()
    original = adamw(model.parameters())
    calls = []
    original.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    model, opt = hetstore.offload(model, original, disk_config("unused", "cpu", "cpu"))
    opt.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for x, y in batches(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert calls == ["pre", "post"] * 2
