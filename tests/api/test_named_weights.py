"""``hetstore.named_weights``: the weights ``model.state_dict()`` gives, unit by unit, each a
fresh CPU tensor, a tied weight once; streamed, with the host memory it holds bounded."""

from __future__ import annotations

import pytest
import torch

import hetstore
from tests.models.gpt import GPT, batches
from tests.parity import adamw, config, disk_config, train


def _offloaded(placement: str, tmp_path, **kwargs):
    torch.manual_seed(0)
    model = GPT(vocab=64, width=64, depth=3, heads=4, ctx=16)
    if placement == "disk":
        cfg = disk_config(tmp_path, **kwargs)
    else:
        cfg = config(placement, placement, **kwargs)
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), cfg)
    train(model, optimizer, batches(2))  # the weights have moved from their initial values
    return model, optimizer


def _without_tied_aliases(state: dict) -> dict:
    """state_dict() names a tied weight under each name; named_weights under its first."""
    seen, out = set(), {}
    for name, value in state.items():
        if value.data_ptr() in seen and value.numel():
            continue
        seen.add(value.data_ptr())
        out[name] = value
    return out


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_the_weights_are_the_state_dicts_bitwise(placement, tmp_path):
    model, _ = _offloaded(placement, tmp_path)
    expected = _without_tied_aliases(model.state_dict())
    got = dict(hetstore.named_weights(model, torch.float32))
    assert got.keys() == expected.keys()
    assert "head.weight" not in got and "wte.weight" in got  # tied: once, its first name
    for name, value in got.items():
        assert value.device.type == "cpu" and value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name].cpu()), name
        assert value.data_ptr() != expected[name].data_ptr(), name  # a copy, not a view
    hetstore.release(model)


def test_the_default_dtype_is_the_compute_dtype(tmp_path):
    model, _ = _offloaded("disk", tmp_path, compute_dtype="bf16")
    expected = _without_tied_aliases(model.state_dict())
    got = dict(hetstore.named_weights(model))
    for name, value in got.items():
        if expected[name].is_floating_point():
            assert value.dtype == torch.bfloat16, name
            assert torch.equal(value, expected[name].to(torch.bfloat16)), name
    hetstore.release(model)


def test_a_disk_master_is_read_one_unit_at_a_time(tmp_path):
    """The host tier's peak while iterating rises by at most one unit's fp32 master (the
    buffer each unit is read into, given back before the next one), and is given back."""
    model, _ = _offloaded("disk", tmp_path)
    host = hetstore.state_of(model).tiers.host
    units = hetstore.state_of(model).runtime.units
    largest = max(u.numel for u in units) * 4
    before = host.account.current
    host.account.reset_peak()
    for _ in hetstore.named_weights(model):
        assert host.account.current - before <= largest + 4096  # (page rounding)
    assert host.account.peak - before <= largest + 4096
    assert host.account.peak - before >= min(u.numel for u in units) * 4  # (it was read)
    assert host.account.current == before
    hetstore.release(model)


def test_a_plain_module_gives_its_own_tensors():
    torch.manual_seed(0)
    model = GPT(vocab=64, width=32, depth=2, heads=4, ctx=16)
    got = dict(hetstore.named_weights(model, torch.float64))
    expected = _without_tied_aliases(model.state_dict())
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.dtype == torch.float64
        assert torch.equal(value, expected[name].double()), name


def test_bad_input_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(TypeError, match="nn.Module"):
        hetstore.named_weights("model")
    model, _ = _offloaded("cpu", tmp_path)
    with pytest.raises(hetstore.ConfigError, match="dtype=torch.int8"):
        hetstore.named_weights(model, torch.int8)
    hetstore.release(model)
    with pytest.raises(hetstore.ConfigError, match="released"):
        hetstore.named_weights(model)
