"""``step_in_backward`` for units whose master, states and parameters' home are in host
memory: each unit's ordinary step runs in place on the worker during backward, as soon
as its gradients are on the host; its next use lands it, and ``optimizer.step()`` waits
for what still runs. That needs a device copy apart from the home (an accelerator's), so
these tests fetch by copying, as on a GPU (``copied``); on a CPU device the parameters
are the home itself, which backward may still read, and nothing is stepped in backward
(the last test).

Reference: the same offloaded model without ``step_in_backward`` (the ordinary host step
in ``optimizer.step()``), compared with ``==`` on losses and ``torch.equal`` on weights
and optimizer states: the worker runs the same inner optimizer with the same group
values on the same buffers, so anything but equality is a bug. Plain PyTorch once, with
torch's fused AdamW, TIGHT (fp32 round-off of the flat step, as every host test). What
it cannot do exactly (clip, read p.grad, change a group after backward, a second
backward or step) must raise, never train differently.
"""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore import ConfigError, GradientAccessError, OffloadConfig
from hetstore.optim import in_memory
from hetstore.runtime.unit import Unit
from tests.models.gpt import batches
from tests.optim.helpers import (
    assert_bitwise,
    assert_same_optimizer_state,
    fresh,
    train_both,
)
from tests.parity import TIGHT, adamw, assert_same_weights


@pytest.fixture(autouse=True)
def copied(request, monkeypatch):
    """Fetch by copying, as on an accelerator (not for the CPU device's own test)."""
    if "cpu_device" not in request.node.name:
        monkeypatch.setattr(Unit, "fetches_in_place", property(lambda self: False))


def host(tmp_path, name: str, consume: bool, make_opt=adamw, freeze=None, **kwargs):
    model, opt = fresh(make_opt)
    if freeze is not None:
        freeze(model)
    cfg = OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        offload_path=str(tmp_path / name),
        device="cpu",
        step_in_backward=consume,
        overlap_step=False,
        **kwargs,
    )
    if freeze is not None:  # the frozen weight's optimizer must not hold it
        opt = make_opt([p for p in model.parameters() if p.requires_grad])
    return hetstore.offload(model, opt, cfg)


def units_of(model):
    return hetstore.state_of(model).runtime.units


def both(tmp_path, steps=3, make_opt=adamw, freeze=None, config_kwargs=None, **train_kwargs):
    data = batches(steps * train_kwargs.get("accumulate", 1), vocab=64)

    def build(consume: bool):
        name = "in" if consume else "after"
        return host(tmp_path, name, consume, make_opt, freeze, **(config_kwargs or {}))

    (inside, in_opt, _), (_, after_opt, _) = train_both(build, data, **train_kwargs)
    assert_same_optimizer_state(in_opt, after_opt)
    return inside, in_opt, data


def test_host_steps_in_backward_train_bitwise_like_the_ordinary_step_and_plain(tmp_path):
    steps = 3
    inside, opt, data = both(tmp_path, steps)
    stats = opt.speculation_stats
    # every unit but the root (whose gradients are final only at backward's end, and
    # which stays resident until then) was stepped inside backward
    stepped = len(units_of(inside)) - 1
    assert stats["started"] == stats["committed"] == stepped * steps
    assert not opt.step_ahead.jobs  # optimizer.step() settled every one
    # and the ordinary host step is plain PyTorch's, up to the flat step's round-off
    plain, plain_opt = fresh()
    for x, y in data:
        plain(x, y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    assert_same_weights(plain, inside, **TIGHT)


def test_sgd_momentum_scheduler_and_bf16(tmp_path):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)

    both(
        tmp_path,
        make_opt=sgd,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
        config_kwargs=dict(compute_dtype="bf16"),
    )


def test_accumulation_under_no_sync(tmp_path):
    inside, opt, _ = both(tmp_path, steps=2, accumulate=3, no_sync=True)
    assert opt.speculation_stats["committed"] == (len(units_of(inside)) - 1) * 2


def test_a_unit_whose_frozen_weight_backward_still_reads_steps_in_optimizer_step(tmp_path):
    """A unit with a frozen weight stays resident until backward moves past it: its
    step is not taken in backward (the worker would write weights backward reads), and
    optimizer.step() steps it the ordinary way."""

    def freeze(model):
        next(iter(model.blocks[1].parameters())).requires_grad_(False)

    inside, opt, _ = both(tmp_path, steps=2, freeze=freeze)
    assert opt.speculation_stats["committed"] == (len(units_of(inside)) - 2) * 2


def test_on_a_gpu_the_root_is_left_to_the_next_forward(tmp_path, monkeypatch):
    """With host steps in the next forward as on a GPU, what backward could not take
    (the root) runs there, and the result is still the ordinary step's."""
    monkeypatch.setattr(OffloadConfig, "steps_memory_in_forward", lambda self, device=None: True)
    inside, opt, _ = both(tmp_path, steps=3, config_kwargs=dict(step_in_forward=True))
    stats = opt.speculation_stats
    assert stats["committed"] == (len(units_of(inside)) - 1) * 3
    assert stats["in_forward"] == 3  # the root, each step


def test_what_needs_the_gradients_later_is_refused(tmp_path):
    model, opt = host(tmp_path, "in", True)
    (x, y), (x2, y2) = batches(2, vocab=64)
    model(x, y).backward()
    with pytest.raises(ConfigError, match="step_in_backward"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(GradientAccessError, match="step_in_backward"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="no_sync"):
        model(x2, y2).backward()
    opt.param_groups[0]["lr"] *= 0.5
    with pytest.raises(RuntimeError, match="'lr'"):
        opt.step()


def test_a_second_step_and_a_backward_without_zero_grad_are_refused(tmp_path):
    model, opt = host(tmp_path, "in", True)
    (x, y), (x2, y2) = batches(2, vocab=64)
    model(x, y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="consumed"):
        opt.step()
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(x2, y2).backward()
    opt.zero_grad()
    model(x2, y2).backward()
    opt.step()


def failing_unit(model, monkeypatch) -> str:
    victim = units_of(model)[2].name
    original = in_memory.step_in_place

    def failing(job):
        if job.unit.name == victim:
            raise OSError("injected")
        original(job)

    monkeypatch.setattr(in_memory, "step_in_place", failing)
    return victim


def test_a_step_that_fails_on_the_worker_raises_at_optimizer_step(tmp_path, monkeypatch):
    model, opt = host(tmp_path, "in", True)
    victim = failing_unit(model, monkeypatch)
    x, y = batches(1, vocab=64)[0]
    model(x, y).backward()
    with pytest.raises(RuntimeError, match=f"{victim}.*in place during backward") as info:
        opt.step()
    assert isinstance(info.value.__cause__, OSError)
    opt.step()  # raised once: the step goes on (the unit stays as the worker left it)
    assert not opt.step_ahead.jobs


def test_a_failure_raised_where_a_reader_landed_it_is_not_raised_again(tmp_path, monkeypatch):
    model, opt = host(tmp_path, "in", True)
    victim = failing_unit(model, monkeypatch)
    x, y = batches(1, vocab=64)[0]
    model(x, y).backward()
    with pytest.raises(RuntimeError, match=f"{victim}.*in place during backward"):
        model.state_dict()  # (reads every unit: lands its step first)
    opt.step()
    assert opt.speculation_stats["committed"] == len(units_of(model)) - 2  # (not the failed)


@pytest.mark.parametrize("consume_disk", [False, True], ids=["host", "disk"])
def test_what_would_drop_the_steps_taken_is_refused_before_any_change(tmp_path, consume_disk):
    """Between a backward that stepped units and optimizer.step(), plain PyTorch would
    drop (zero_grad) or replace (a load) what those steps already used, and a checkpoint
    would hold a step half taken (a save): refused, naming the way out, before anything
    is written; the step then trains as without them."""
    if consume_disk:
        from tests.optim.helpers import config as disk_config

        model, opt = fresh()
        cfg = disk_config(tmp_path / "disk", False, "disk", step_in_backward=True)
        model, opt = hetstore.offload(model, opt, cfg)
    else:
        model, opt = host(tmp_path, "in", True)
    ref, ref_opt = host(tmp_path, "ref", False)
    (x, y), (x2, y2) = batches(2, vocab=64)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x, y).backward()
        o.step()
        o.zero_grad()
    hetstore.save(tmp_path / "ckpt", model, opt)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    for m in (model, ref):
        m(x2, y2).backward()
    attempts = {
        "optimizer.zero_grad": opt.zero_grad,
        "optimizer.load_state_dict": lambda: opt.load_state_dict(saved_opt),
        "a load or edit": lambda: model.load_state_dict(saved_model),
        "hetstore.save": lambda: hetstore.save(tmp_path / "ckpt", model, opt),
    }
    for what, attempt in attempts.items():
        with pytest.raises(RuntimeError, match=f"{what}.*optimizer.step\\(\\) first"):
            attempt()
    with pytest.raises(RuntimeError, match="a load or edit"):
        hetstore.load(tmp_path / "ckpt", model, opt)
    ref_opt.step()
    opt.step()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, **TIGHT)
    # after optimizer.step() the same loads go through (the refused ones left no state)
    opt.zero_grad()
    model.load_state_dict(saved_model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved_model[key]), key
    opt.load_state_dict(saved_opt)
    hetstore.load(tmp_path / "ckpt", model, opt)


def test_on_a_cpu_device_nothing_is_stepped_in_backward(tmp_path):
    """The parameters are the home itself there, and a tensor backward saved may share
    its storage and be read after the unit's last gradient (a detached use of a weight):
    no unit is stepped in backward, and training is the ordinary step's, bitwise."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 32) / 32**0.5)

        def forward(self, x):
            w = self.w
            return x + torch.tanh(torch.nn.functional.linear(x, w.detach()) + x @ w.t())

    def run(consume: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(Block() for _ in range(3)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = OffloadConfig(
            offload_param="cpu",
            offload_optimizer="cpu",
            offload_path=str(tmp_path / str(consume)),
            device="cpu",
            step_in_backward=consume,
            overlap_step=False,
        )
        model, opt = hetstore.offload(model, opt, cfg, units=list(model))
        losses = []
        for i in range(3):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(i))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return model, opt, losses

    inside, in_opt, in_losses = run(True)
    after, _, after_losses = run(False)
    assert in_losses == after_losses
    assert_bitwise(inside, after)
    assert in_opt.speculation_stats["started"] == 0


@pytest.mark.parametrize(
    ("optimizer", "param"), [("none", "cpu"), ("cpu", "none"), ("cpu", "disk")]
)
def test_placements_it_cannot_step_in_backward_are_refused(tmp_path, optimizer, param):
    with pytest.raises(ConfigError, match="step_in_backward=True with offload_optimizer"):
        OffloadConfig(
            offload_param=param,
            offload_optimizer=optimizer,
            offload_path=str(tmp_path),
            step_in_backward=True,
        )
