"""Hugging Face transformers models under hetstore: the parts that differ from our own test
models (rotary-embedding buffers, tied or untied heads, keyword-only calls with labels and
attention masks, HF's own gradient checkpointing, meta-device creation, save_pretrained)
train and save like plain PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hetstore
from tests.models.hf import build, gpt2, llama

transformers = pytest.importorskip("transformers")

# exact in fp32 on CPU except AdamW's flat fused step (a few ulps, see DESIGN.md)
LOSS_TOL = dict(rtol=0, atol=1e-6)
WEIGHT_TOL = dict(rtol=0, atol=1e-5)


def data(steps=3):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # left padding in one row
        out.append((ids, mask))
    return out


def train(model, optimizer, batches, clip=True):
    losses = []
    for ids, mask in batches:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        if not clip:
            pass
        elif hasattr(optimizer, "clip_grad_norm_"):
            optimizer.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def config_for(tmp_path, **kw):
    return hetstore.OffloadConfig(
        offload_path=str(tmp_path), enable_pinned_mem=False, activation_min_bytes=0, **kw
    )


PLACEMENTS = {
    "disk": dict(offload_param="disk", offload_optimizer="disk"),
    "cpu+activations": dict(
        offload_param="cpu", offload_optimizer="cpu", offload_activations="disk"
    ),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize(
    "make", [llama, lambda: llama(tie=True), gpt2], ids=["llama", "llama-tied", "gpt2"]
)
def test_trains_like_plain_pytorch(tmp_path, make, placement):
    model = build(make())
    reference = copy.deepcopy(model)
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), config_for(tmp_path, **PLACEMENTS[placement])
    )
    # one unit per decoder layer, the rest (embeddings, final norm, head) in the root
    layers = "transformer.h" if isinstance(model, transformers.GPT2LMHeadModel) else "model.layers"
    names = [u.name for u in hetstore.state_of(model).runtime.units]
    assert names == [f"{layers}.0", f"{layers}.1", "root"]
    batches = data()
    losses = train(model, optimizer, batches)
    torch.testing.assert_close(
        losses, train(reference, adamw(reference.parameters()), batches), **LOSS_TOL
    )
    mine, theirs = model.state_dict(), reference.state_dict()
    assert list(mine) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], **WEIGHT_TOL, msg=key)


def checkpoint_layers(model, reentrant: bool) -> None:
    """transformers' activation checkpointing of every layer."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable({"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})


def test_hf_gradient_checkpointing_with_activation_offload(tmp_path):
    model = build(llama())
    reference = copy.deepcopy(model)
    for m in (model, reference):
        checkpoint_layers(m, reentrant=False)
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), config_for(tmp_path, **PLACEMENTS["cpu+activations"])
    )
    batches = data()
    torch.testing.assert_close(
        train(model, optimizer, batches),
        train(reference, adamw(reference.parameters()), batches),
        **LOSS_TOL,
    )


def test_hf_reentrant_checkpointing_with_the_step_inside_backward(tmp_path):
    """transformers' checkpointing with ``use_reentrant=True`` (transformers 4's default):
    each layer's backward runs inside the outer one, which the runtime takes as one
    backward, so ``step_in_backward`` steps every unit there (no clip: it refuses one),
    and training is plain PyTorch's."""
    model = build(llama())
    reference = copy.deepcopy(model)
    for m in (model, reference):
        checkpoint_layers(m, reentrant=True)
    cfg = config_for(tmp_path, **PLACEMENTS["disk"], step_in_backward=True)
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), cfg)
    batches = data()
    torch.testing.assert_close(
        train(model, optimizer, batches, clip=False),
        train(reference, adamw(reference.parameters()), batches, clip=False),
        **LOSS_TOL,
    )
    stats = optimizer.speculation_stats
    assert stats["started"] == stats["committed"] == 3 * len(batches), stats  # 2 layers, root


def test_meta_built_model_loads_save_pretrained_weights(tmp_path):
    """Built on the meta device, materialized with HF's own init (which also recomputes
    the rotary inv_freq buffers, not saved in the checkpoint), then loaded from
    save_pretrained's safetensors: same logits as the saved model."""
    saved = build(llama())
    saved.save_pretrained(tmp_path / "ckpt")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama())
    model, _ = hetstore.offload(
        model,
        None,
        config_for(tmp_path, offload_param="cpu"),
        init_fn=model._init_weights,
    )
    hetstore.load_weights(model, tmp_path / "ckpt")
    ids = data(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, saved(ids).logits, rtol=0, atol=0)


def test_save_pretrained_from_disk_placement_round_trips(tmp_path):
    model = build(gpt2())
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), config_for(tmp_path, **PLACEMENTS["disk"])
    )
    train(model, optimizer, data(1))
    model.save_pretrained(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    mine = model.state_dict()
    for key, value in back.state_dict().items():
        torch.testing.assert_close(value, mine[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2-tied", "llama"])
def test_export_weights_loads_with_from_pretrained(tmp_path, make):
    config = make()
    model = build(config)
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), config_for(tmp_path / "swap", **PLACEMENTS["disk"])
    )
    batches = data(2)
    train(model, optimizer, batches)
    out = tmp_path / "export"
    hetstore.export_weights(out, model)
    config.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    ids, mask = batches[0]
    model.eval(), loaded.eval()
    with torch.no_grad():
        mine = model(input_ids=ids, attention_mask=mask).logits
        theirs = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(mine, theirs)  # the same fp32 weights, the same kernels


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_auto_offload_without_example_inputs_plans_at_the_first_keyword_call(
    tmp_path, make, masked
):
    """Trainer-style calls (keyword arguments only), budgets only: the first batch is
    traced on fake tensors from its keyword tensors and the activations placed for it.
    With a padding mask too: transformers reads the mask's values in Python only when
    it is not tracing, and it counts a fake tensor as tracing, so it keeps the mask,
    as the real masked batch does (on meta tensors that check failed and every unit's
    activations went to host instead). Training matches plain PyTorch within a budget
    of half the model states."""
    from hetstore.planner.tracer import model_data_trace

    model = build(make())
    reference = copy.deepcopy(model)
    states = model_data_trace(model, hetstore.OffloadConfig(device="cpu"), None).state_bytes
    budget = states // 2
    cfg = config_for(tmp_path, auto_offload=True, max_device_memory=budget, device="cpu")
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), cfg)
    runtime = hetstore.state_of(model).runtime
    batches = data() if masked else [(ids, None) for ids, _ in data()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(model, optimizer, batches)
    assert not [w for w in caught if "could not trace" in str(w.message)]
    # keyword tensors by name: attention_mask, input_ids, labels
    assert runtime.trace.batch_shapes == ((2, 16),) * (3 if masked else 2)
    assert sum(u.saved_bytes for u in runtime.trace.units) > 0
    # the compute probe ran transformers' decoder layer for real from its recorded
    # call (position embeddings, a cache object it passes as None)
    assert runtime.trace.compute_basis == "probed"
    assert runtime.plan.estimate.basis == "probed"
    torch.testing.assert_close(
        losses, train(reference, adamw(reference.parameters()), batches), **LOSS_TOL
    )
    assert hetstore.memory_stats(model)["device"]["peak"] <= budget
