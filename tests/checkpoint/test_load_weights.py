"""hetstore.load_weights: safetensors weights streamed into an offloaded model.

Loading is a copy (fp32 file -> fp32 master), so weights are compared exactly; forward
and training afterwards are compared with plain PyTorch at fp32 round-off (TIGHT).
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import hetstore
from hetstore import ConfigError, OffloadConfig
from hetstore.weights import LoadResult
from tests.models.cnn import ResNet, image_batches
from tests.models.gpt import GPT, batches
from tests.parity import train

TIGHT = dict(rtol=1e-6, atol=1e-7)
PLACEMENTS = [("cpu", "cpu"), ("disk", "disk"), ("none", "disk")]


def cfg(tmp_path, param="cpu", optim="cpu"):
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        offload_path=str(tmp_path / "offload"),
        enable_pinned_mem=False,
        device="cpu",
    )


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def trained(factory, data, seed=0):
    """A plain model trained a few steps, so its weights are not any seed's init."""
    torch.manual_seed(seed)
    model = factory()
    train(model, adamw(model.parameters()), data)
    return model


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_equal(model, expected: dict[str, torch.Tensor]):
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def untied(state: dict[str, torch.Tensor], drop=("head.weight",)) -> dict[str, torch.Tensor]:
    """``save_file`` refuses shared tensors: keep one name of the tied GPT weight."""
    return {k: v.contiguous() for k, v in state.items() if k not in drop}


def offloaded_gpt(tmp_path, param="cpu", optim="cpu", seed=1):
    torch.manual_seed(seed)
    model = GPT()
    return hetstore.offload(model, adamw(model.parameters()), cfg(tmp_path, param, optim))


@pytest.fixture
def gpt_file(tmp_path):
    """A trained GPT saved with ``save_model``, which keeps one tied alias (``head.weight``,
    not the name the runtime's entry uses), and the plain model."""
    ref = trained(GPT, batches(2, seed=5))
    file = tmp_path / "gpt.safetensors"
    safetensors.torch.save_model(ref, str(file))
    return ref, file


@pytest.mark.parametrize("param, optim", PLACEMENTS)
def test_gpt_roundtrip_forward_and_training(tmp_path, gpt_file, param, optim):
    ref, file = gpt_file
    expected = snapshot(ref)
    mine, opt = offloaded_gpt(tmp_path, param, optim)
    assert not torch.equal(mine.state_dict()["wte.weight"], expected["wte.weight"])

    assert hetstore.load_weights(mine, file) == LoadResult([], [])
    assert_state_equal(mine, expected)
    x, y = batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), **TIGHT)

    data = batches(2, seed=11)
    ref_losses = train(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(train(mine, opt, data), ref_losses, **TIGHT)


@pytest.mark.parametrize("param, optim", [("cpu", "cpu"), ("disk", "disk")])
def test_cnn_batchnorm_buffers_are_loaded(tmp_path, param, optim):
    ref = trained(ResNet, image_batches(2, seed=3))  # running stats moved off their init
    expected = snapshot(ref)
    file = tmp_path / "cnn.safetensors"
    safetensors.torch.save_file(expected, str(file))
    torch.manual_seed(1)
    model = ResNet()
    mine, _ = hetstore.offload(model, adamw(model.parameters()), cfg(tmp_path, param, optim))

    hetstore.load_weights(mine, file)
    assert_state_equal(mine, expected)  # includes running_mean/var, num_batches_tracked
    ref.eval(), mine.eval()
    x, _ = image_batches(1, seed=4)[0]
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), **TIGHT)


def write_shards(state, directory, parts=3) -> str:
    """A Hugging Face style sharded checkpoint: shard files and model.safetensors.index.json."""
    keys = list(state)
    weight_map, total = {}, 0
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: state[k] for k in keys[i::parts]}
        safetensors.torch.save_file(chunk, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
        total += sum(v.numel() * v.element_size() for v in chunk.values())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return str(index)


@pytest.mark.parametrize("via", ["index", "directory"])
def test_sharded_checkpoint(tmp_path, gpt_file, via):
    ref, _ = gpt_file
    expected = snapshot(ref)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    index = write_shards(untied(expected), ckpt)
    assert len(list(ckpt.glob("*.safetensors"))) == 3
    mine, _ = offloaded_gpt(tmp_path, "disk", "disk")
    result = hetstore.load_weights(mine, index if via == "index" else ckpt)
    assert result == LoadResult([], [])
    assert_state_equal(mine, expected)


def test_directory_with_single_file(tmp_path, gpt_file):
    ref, file = gpt_file
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    file.rename(ckpt / "model.safetensors")
    mine, _ = offloaded_gpt(tmp_path)
    hetstore.load_weights(mine, ckpt)
    assert_state_equal(mine, snapshot(ref))


def test_meta_model_then_load(tmp_path, gpt_file):
    ref, file = gpt_file
    with torch.device("meta"):
        lazy = GPT()
    mine, opt = hetstore.offload(lazy, adamw(lazy.parameters()), cfg(tmp_path, "disk", "disk"))
    hetstore.load_weights(mine, file)
    assert_state_equal(mine, snapshot(ref))
    data = batches(2, seed=11)
    ref_losses = train(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(train(mine, opt, data), ref_losses, **TIGHT)


def test_tied_weight_under_either_name(tmp_path, gpt_file):
    ref, _ = gpt_file
    expected = snapshot(ref)
    # only the alias the runtime does not use as the entry name
    only_head = tmp_path / "head.safetensors"
    safetensors.torch.save_file(untied(expected, drop=("wte.weight",)), str(only_head))
    mine, _ = offloaded_gpt(tmp_path)
    assert hetstore.load_weights(mine, only_head) == LoadResult([], [])
    assert_state_equal(mine, expected)

    # both names, different values: the first name in named_parameters order wins
    both = {k: v.clone() for k, v in expected.items()}
    both["head.weight"] = torch.zeros_like(both["head.weight"])
    two = tmp_path / "both.safetensors"
    safetensors.torch.save_file(both, str(two))
    assert hetstore.load_weights(mine, two) == LoadResult([], [])
    assert_state_equal(mine, expected)  # head.weight == wte.weight, not the zeros


def test_half_precision_file_is_cast_to_fp32(tmp_path, gpt_file):
    ref, _ = gpt_file
    expected = snapshot(ref)
    for dtype in (torch.float16, torch.bfloat16):
        file = tmp_path / f"{dtype}.safetensors"
        half = {k: v.to(dtype) for k, v in untied(expected).items()}
        safetensors.torch.save_file(half, str(file))
        mine, _ = offloaded_gpt(tmp_path / str(dtype), "disk", "disk")
        hetstore.load_weights(mine, file)
        state = mine.state_dict()
        for key, value in expected.items():
            assert state[key].dtype == torch.float32
            assert torch.equal(state[key], value.to(dtype).float()), key


def broken_file(tmp_path, state, kind) -> tuple[str, str]:
    """A checkpoint with one defect; returns its path and the key the error must name."""
    state = untied(state)
    if kind == "missing":
        key = "blocks.1.fc.bias"
        del state[key]
    elif kind == "unexpected":
        key = "blocks.7.extra.weight"
        state[key] = torch.ones(3)
    else:
        key = "ln_f.weight"
        state[key] = torch.ones(33)
    file = tmp_path / f"{kind}.safetensors"
    safetensors.torch.save_file(state, str(file))
    return str(file), key


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_bad_checkpoint_raises_and_writes_nothing(tmp_path, gpt_file, kind):
    ref, _ = gpt_file
    file, key = broken_file(tmp_path, snapshot(ref), kind)
    mine, _ = offloaded_gpt(tmp_path, "cpu", "disk")
    before = snapshot(mine)
    with pytest.raises(ConfigError, match=kind) as err:
        hetstore.load_weights(mine, file)
    assert repr(key) in str(err.value)
    if kind == "shape":
        assert "[33]" in str(err.value) and "[32]" in str(err.value)
    assert_state_equal(mine, before)
    if kind == "shape":  # not a matter of strictness
        with pytest.raises(ConfigError, match="shape"):
            hetstore.load_weights(mine, file, strict=False)
        assert_state_equal(mine, before)


def test_non_strict_loads_what_matches_and_lists_the_rest(tmp_path, gpt_file):
    ref, _ = gpt_file
    expected = snapshot(ref)
    state = untied(expected)
    del state["blocks.1.fc.bias"], state["wpe.weight"]
    state["extra"] = torch.ones(2)
    file = tmp_path / "partial.safetensors"
    safetensors.torch.save_file(state, str(file))
    mine, _ = offloaded_gpt(tmp_path, "disk", "disk")
    before = snapshot(mine)

    result = hetstore.load_weights(mine, file, strict=False)
    assert result.missing_keys == ["wpe.weight", "blocks.1.fc.bias"]
    assert result.unexpected_keys == ["extra"]
    after = mine.state_dict()
    for key in expected:
        kept = key in ("blocks.1.fc.bias", "wpe.weight")
        assert torch.equal(after[key], (before if kept else expected)[key]), key


def test_many_missing_keys_are_counted(tmp_path, gpt_file):
    file = tmp_path / "tiny.safetensors"
    safetensors.torch.save_file({"ln_f.weight": torch.ones(32)}, str(file))
    mine, _ = offloaded_gpt(tmp_path)
    with pytest.raises(ConfigError, match=r"missing key\(s\) .* and \d+ more"):
        hetstore.load_weights(mine, file)


def test_missing_paths(tmp_path):
    mine, _ = offloaded_gpt(tmp_path)
    nowhere = tmp_path / "nowhere.safetensors"
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        hetstore.load_weights(mine, nowhere)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        hetstore.load_weights(mine, empty)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"wte.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        hetstore.load_weights(mine, index)


def test_not_safetensors(tmp_path):
    mine, _ = offloaded_gpt(tmp_path)
    before = snapshot(mine)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ConfigError, match="junk.safetensors.*not a safetensors file"):
        hetstore.load_weights(mine, junk)
    bad_index = tmp_path / "bad.index.json"
    bad_index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError, match="weight_map"):
        hetstore.load_weights(mine, bad_index)
    shard = tmp_path / "shard.safetensors"
    safetensors.torch.save_file({"ln_f.weight": torch.ones(32)}, str(shard))
    liar = tmp_path / "liar.index.json"
    liar.write_text(json.dumps({"weight_map": {"wte.weight": "shard.safetensors"}}))
    with pytest.raises(ConfigError, match="'wte.weight' to shard.safetensors"):
        hetstore.load_weights(mine, liar)
    assert_state_equal(mine, before)


def test_plain_module_is_loaded_directly(tmp_path, gpt_file):
    ref, file = gpt_file
    torch.manual_seed(1)
    plain = GPT()
    assert hetstore.load_weights(plain, file) == LoadResult([], [])
    assert_state_equal(plain, snapshot(ref))
    assert plain.head.weight is plain.wte.weight  # still tied
    with torch.device("meta"):
        lazy = GPT()
    with pytest.raises(ConfigError, match=r"hetstore\.offload"):
        hetstore.load_weights(lazy, file)


def test_disk_load_holds_about_one_unit_in_host_memory(tmp_path):
    def deep():
        return GPT(depth=8)

    ref = trained(deep, batches(1))
    file = tmp_path / "deep.safetensors"
    safetensors.torch.save_model(ref, str(file))
    torch.manual_seed(1)
    model = deep()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    mine, _ = hetstore.offload(model, adamw(model.parameters()), cfg(tmp_path, "disk", "disk"))
    units = hetstore.state_of(mine).runtime.units
    largest = max(u.numel for u in units) * 4
    hetstore.state_of(mine).tiers.reset_peaks()
    before = hetstore.memory_stats(mine)["host"]["current"]

    hetstore.load_weights(mine, file)
    peak = hetstore.memory_stats(mine)["host"]["peak"]
    assert peak < model_bytes
    # the unit's fp32 master scratch and its compute-dtype copy, page-rounded
    assert peak - before <= 2 * (largest + 4096)
    assert_state_equal(mine, snapshot(ref))
