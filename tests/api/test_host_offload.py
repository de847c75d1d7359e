"""Host offload gives the same numbers as plain PyTorch.

Tolerances: the offloaded optimizer runs torch's fused Adam/AdamW/SGD kernel on flat
per-unit buffers. Against a reference that uses the same fused kernel per parameter, the
math is the same element by element, so we compare at fp32 round-off (rtol 1e-6, atol
1e-7; measured: bitwise equal here). Against torch's default (for-loop) AdamW the kernels
round differently (~1e-7 relative per step), and Adam's m/sqrt(v) turns a 1e-7 difference
in a near-zero gradient into up to one lr of weight difference, so that comparison checks
losses at 1e-4 relative only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hetstore
from hetstore import OutOfDeviceMemory
from tests.models.cnn import ResNet, image_batches
from tests.models.gpt import GPT, batches
from tests.parity import (
    TIGHT,
    adamw,
    assert_same_weights,
    config,
    pair,
    run,
    states_bytes,
    train_both,
)

PLACEMENTS = [("none", "none"), ("cpu", "none"), ("none", "cpu"), ("cpu", "cpu")]


@pytest.mark.parametrize("param, optim", PLACEMENTS)
def test_gpt_fp32_parity(param, optim):
    ref, mine, (ref_losses, _), (losses, _) = train_both(GPT, batches(6), config(param, optim))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


@pytest.mark.parametrize("param, optim", PLACEMENTS)
def test_cnn_batchnorm_parity(param, optim):
    data = image_batches(5)
    ref, mine, (ref_losses, _), (losses, _) = train_both(ResNet, data, config(param, optim))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)  # includes BatchNorm running stats
    # eval mode uses the running statistics: same outputs
    ref.eval(), mine.eval()
    x, _ = data[0]
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), **TIGHT)


def test_against_default_torch_adamw_losses():
    def default_adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)  # default for-loop kernel

    _, _, (ref_losses, _), (losses, _) = train_both(GPT, batches(5), make_opt=default_adamw)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=0)


def test_gradient_accumulation_four_micro_batches():
    ref, mine, (ref_losses, _), (losses, _) = train_both(GPT, batches(8), accumulate=4)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    # gradients summed over 4 backward() calls in fp32: same rounding order as torch's .grad
    assert_same_weights(ref, mine)


def test_clip_grad_norm_matches_torch():
    ref, mine, (_, ref_norms), (_, norms) = train_both(GPT, batches(5), clip=0.5)
    assert all(n > 0.5 for n in ref_norms), "the clip must be active for this test to mean anything"
    torch.testing.assert_close(norms, ref_norms, **TIGHT)
    assert_same_weights(ref, mine)


def test_lr_scheduler_and_two_param_groups():
    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    ref, mine = pair(GPT)
    ref_opt = adamw(groups(ref))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.3)
    mine, opt = hetstore.offload(mine, adamw(groups(mine)), config())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    data = batches(6)
    ref_losses, _ = run(ref, ref_opt, data, scheduler=ref_sched)
    losses, _ = run(mine, opt, data, scheduler=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] < 1e-2  # the schedule really moved
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_frozen_parameters_stay_frozen():
    def freeze(model):
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        return model

    ref, mine = pair(lambda: freeze(GPT()))
    frozen_before = copy.deepcopy(ref.blocks[0].state_dict())
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    mine, opt = hetstore.offload(
        mine, adamw([p for p in mine.parameters() if p.requires_grad]), config()
    )
    data = batches(4)
    ref_losses, _ = run(ref, ref_opt, data)
    losses, _ = run(mine, opt, data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    for key, value in mine.blocks[0].state_dict().items():
        torch.testing.assert_close(value, frozen_before[key], rtol=0, atol=0)


@pytest.mark.parametrize("param, optim", [("cpu", "cpu"), ("none", "none")])
def test_activation_checkpointing(param, optim):
    ref, mine, (ref_losses, _), (losses, _) = train_both(
        lambda: GPT(checkpointing=True), batches(4), config(param, optim)
    )
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


class TwiceBlock(nn.Module):
    """Calls the same block twice in one forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        h = torch.tanh(self.blocks[0](h))  # second use of block 0
        return nn.functional.cross_entropy(self.out(h), y)


def test_module_called_twice_in_one_forward():
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)
    ]
    ref, mine, (ref_losses, _), (losses, _) = train_both(TwiceBlock, data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_no_grad_evaluation_and_train_eval_switch():
    ref, mine = pair(GPT)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), config())
    x, y = batches(1)[0]
    mine.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(mine(x, y), ref(x, y), **TIGHT)
    assert hetstore.memory_stats(mine)["device"]["current"] == 0, "eval must release every unit"
    mine.train()
    mine(x, y).backward()
    opt.step()
    assert hetstore.memory_stats(mine)["device"]["current"] == 0


def test_bf16_compute_against_bf16_reference():
    """Reference: bf16 model for forward/backward, fp32 master + fused AdamW, cast back."""
    torch.manual_seed(0)
    base = GPT()
    master = copy.deepcopy(base)
    ref_opt = adamw(master.parameters())
    ref_model = copy.deepcopy(base).to(torch.bfloat16)
    mine_model = copy.deepcopy(base)
    mine_model, opt = hetstore.offload(
        mine_model, adamw(mine_model.parameters()), config(compute_dtype="bf16")
    )
    ref_losses, losses = [], []
    for x, y in batches(4):
        loss = ref_model(x, y)
        loss.backward()
        ref_losses.append(loss.item())
        for p_master, p_bf16 in zip(master.parameters(), ref_model.parameters(), strict=True):
            p_master.grad = p_bf16.grad.float()
            p_bf16.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p_master, p_bf16 in zip(master.parameters(), ref_model.parameters(), strict=True):
                p_bf16.copy_(p_master)
        loss = mine_model(x, y)
        assert loss.dtype == torch.bfloat16
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    # state_dict returns the fp32 master, not the bf16 working copy
    mine_sd = mine_model.state_dict()
    assert all(v.dtype == torch.float32 for v in mine_sd.values())
    assert_same_weights(master, mine_model)


def _fp16_backward_that_overflows():
    """An fp16 model after a backward whose gradients overflow; its weights before."""
    torch.manual_seed(0)
    model = GPT()
    model, opt = hetstore.offload(model, adamw(model.parameters()), config(compute_dtype="fp16"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches(1)[0]
    opt.loss_scaler.scale = 2.0**100  # overflows fp16 gradients
    opt.backward(model(x, y))
    return model, opt, before


def _step_is_skipped(model, opt, before) -> None:
    opt.step()
    opt.zero_grad()
    assert opt.loss_scaler.scale == 2.0**99
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed on a skipped step"


def test_fp16_dynamic_loss_scaling_skips_overflow():
    model, opt, before = _fp16_backward_that_overflows()
    _step_is_skipped(model, opt, before)
    opt.loss_scaler.scale = 2.0**8
    losses = []
    x, y = batches(1, seed=3)[0]
    for _ in range(6):  # one batch repeated: progress means memorising it
        loss = model(x, y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], "fp16 training with loss scaling must make progress"


def test_fp16_clipping_before_a_step_that_overflows_still_skips_it():
    """``optimizer.clip_grad_norm_`` unscales first; the step after it must still see
    the overflow (GradScaler's semantics). It used to re-read False, and step the
    weights with the clip's NaN factor."""
    model, opt, before = _fp16_backward_that_overflows()
    norm = opt.clip_grad_norm_(1.0)
    assert not torch.isfinite(norm)
    _step_is_skipped(model, opt, before)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, fused=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),  # per-parameter view path
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    ],
    ids=["sgd-momentum", "rmsprop", "adagrad"],
)
def test_other_optimizers(make):
    ref, mine, (ref_losses, _), (losses, _) = train_both(GPT, batches(4), make_opt=make)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_same_weights(ref, mine, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trips_with_plain_pytorch():
    torch.manual_seed(0)
    mine = GPT()
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), config())
    run(mine, opt, batches(3))

    # offloaded -> plain: same keys and shapes, weights and optimizer state load into torch
    plain = GPT()
    plain.load_state_dict(mine.state_dict())
    plain_opt = adamw(plain.parameters())
    plain_opt.load_state_dict(opt.state_dict())
    data = batches(3, seed=7)
    torch.testing.assert_close(run(plain, plain_opt, data)[0], run(mine, opt, data)[0], **TIGHT)
    assert_same_weights(plain, mine)

    # plain -> offloaded: a fresh offloaded model takes torch's weights and optimizer state
    fresh = GPT()
    fresh, fresh_opt = hetstore.offload(fresh, adamw(fresh.parameters()), config())
    fresh.load_state_dict(plain.state_dict())
    fresh_opt.load_state_dict(plain_opt.state_dict())
    data = batches(3, seed=8)
    torch.testing.assert_close(
        run(fresh, fresh_opt, data)[0], run(plain, plain_opt, data)[0], **TIGHT
    )
    assert_same_weights(plain, fresh)


def test_device_peak_stays_within_budget_below_states_size():
    torch.manual_seed(0)
    model = GPT(width=64, depth=4)
    states = states_bytes(model)
    budget = states // 2  # the running unit, its gradients and the saved activations
    model, opt = hetstore.offload(
        model, adamw(model.parameters()), config(max_device_memory=budget)
    )
    run(model, opt, batches(3))
    stats = hetstore.memory_stats(model)
    assert 0 < stats["device"]["peak"] <= budget < states
    assert stats["host"]["current"] >= states * 3 // 4  # master + moments + grads live on host


def test_states_too_big_for_device_refused_before_training():
    torch.manual_seed(0)
    model = GPT(width=64, depth=4)
    budget = states_bytes(model) // 4
    with pytest.raises(OutOfDeviceMemory) as info:
        hetstore.offload(
            model, adamw(model.parameters()), config("none", "none", max_device_memory=budget)
        )
    message = str(info.value)
    assert "max_device_memory" in message
    assert "offload_optimizer='cpu'" in message or "offload_param='cpu'" in message


def test_memory_stats_shape():
    model = GPT()
    model, _ = hetstore.offload(model, adamw(model.parameters()), config())
    stats = hetstore.memory_stats(model)
    assert set(stats) == {"device", "host", "disk"}
    with pytest.raises(TypeError):
        hetstore.memory_stats(nn.Linear(2, 2))


def test_bad_inputs_raise_clear_errors():
    model = GPT()
    other = nn.Linear(3, 3)
    with pytest.raises(hetstore.ConfigError, match="not in the model"):
        hetstore.offload(model, adamw(other.parameters()), config())
    with pytest.raises(hetstore.ConfigError, match="OffloadConfig"):
        hetstore.offload(model, None, {"offload_param": "cpu"})
    model, _ = hetstore.offload(model, None, config())
    with pytest.raises(hetstore.ConfigError, match="already"):
        hetstore.offload(model, None, config())
