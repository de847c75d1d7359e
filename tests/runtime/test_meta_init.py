"""Models built on the meta device are materialized unit by unit into their tiers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetstore
from hetstore import ConfigError
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, disk_config, run


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """Initialized by its modules' reset_parameters() alone."""

    def __init__(self, vocab=50, width=24, depth=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("param, optim", [("cpu", "cpu"), ("disk", "disk"), ("none", "none")])
def test_meta_model_gets_the_weights_an_eager_build_gets(tmp_path, param, optim):
    torch.manual_seed(3)
    eager = Net()
    torch.manual_seed(3)
    with torch.device("meta"):
        lazy = Net()
    opt = adamw(lazy.parameters())  # an optimizer over the meta parameters works
    lazy, opt = hetstore.offload(lazy, opt, disk_config(tmp_path, param, optim))
    assert not any(p.is_meta for p in lazy.parameters())
    assert_same_weights(eager, lazy, rtol=0, atol=0)
    data = batches(4, vocab=50)
    ref_losses, _ = run(eager, adamw(eager.parameters()), data)
    losses, _ = run(lazy, opt, data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(eager, lazy)


def test_init_fn_runs_after_reset_parameters_and_tied_weights_stay_tied(tmp_path):
    with torch.device("meta"):
        model = GPT(vocab=64, width=32, depth=3)
    model, opt = hetstore.offload(
        model, adamw(model.parameters()), disk_config(tmp_path), init_fn=GPT.init_weights
    )
    sd = model.state_dict()
    assert model.head.weight is model.wte.weight
    assert torch.equal(sd["head.weight"], sd["wte.weight"])
    assert torch.count_nonzero(sd["blocks.0.qkv.bias"]) == 0  # init_weights zeroed it
    assert torch.equal(sd["blocks.1.ln1.weight"], torch.ones(32))  # reset_parameters
    assert 0.015 < float(sd["blocks.2.fc.weight"].std()) < 0.025  # GPT-2's std 0.02
    # it trains like a plain model started from the same weights
    plain = GPT(vocab=64, width=32, depth=3)
    plain.load_state_dict(sd)
    data = batches(4)
    ref_losses, _ = run(plain, adamw(plain.parameters()), data)
    losses, _ = run(model, opt, data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)


def test_host_memory_holds_one_unit_at_a_time_while_materializing(tmp_path):
    with torch.device("meta"):
        model = GPT(vocab=64, width=64, depth=6)
    total = sum(p.numel() for p in model.parameters()) * 4
    model, _ = hetstore.offload(model, adamw(model.parameters()), disk_config(tmp_path))
    host_peak = hetstore.memory_stats(model)["host"]["peak"]
    unit_bytes = max(u.numel for u in hetstore.state_of(model).runtime.units) * 4
    # one unit's scratch (+ its compute copy) at a time, not the model
    assert host_peak <= 2 * unit_bytes + 2 * 4096 < total / 2


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))


def test_meta_modules_that_cannot_be_initialized_are_refused(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(ConfigError, match=r"'1' \(NoReset\).*init_fn"):
        hetstore.offload(model, None, disk_config(tmp_path, "cpu", "cpu"))
    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(ConfigError, match=r"buffers on the meta device \(mask\)"):
        hetstore.offload(model, None, disk_config(tmp_path, "cpu", "cpu"))

    def init(module):
        if isinstance(module, NoReset):
            nn.init.ones_(module.scale)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoReset())
    model, _ = hetstore.offload(model, None, disk_config(tmp_path, "cpu", "cpu"), init_fn=init)
    assert torch.equal(model.state_dict()["1.scale"], torch.ones(4))
