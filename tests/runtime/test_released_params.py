"""Reading and writing an offloaded parameter between uses (hetstore/runtime/released.py).

A released unit's parameters have no bytes. Reading one used to read freed memory or kill
the interpreter (exit 139: ``model.blocks[0].ln1.weight.detach().clone()``). Now a read
gets the value forward would see, bit for bit -- checked against ``state_dict()`` (the
fp32 master) cast to the compute dtype, which is exactly what a fetch puts on the device --
and a write is refused before it changes anything, naming ``load_state_dict``.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

import hetstore
from hetstore import OffloadedParameterError
from hetstore.runtime.released import is_released
from hetstore.runtime.unit import Unit
from tests.disk_helpers import disk_config
from tests.models.gpt import GPT, batches
from tests.parity import adamw, config

PLACEMENTS = {
    "host": lambda path: config("cpu", "cpu"),
    "host-bf16": lambda path: config("cpu", "cpu", compute_dtype="bf16"),
    "disk": disk_config,  # overlap_step is on: the step runs ahead in backward
    "disk params, host states": lambda path: dataclasses.replace(
        disk_config(path), offload_optimizer="cpu"
    ),
}


def offloaded(placement, path, steps=2):
    torch.manual_seed(0)
    model = GPT()
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), PLACEMENTS[placement](path)
    )
    for x, y in batches(steps):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def forward_values(model) -> dict[str, torch.Tensor]:
    """What forward computes with: the master (state_dict) in the compute dtype."""
    dtype = {p.dtype for p in model.parameters()}.pop()
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def disk_bytes_read(model) -> int:
    disk = hetstore.state_of(model).tiers.disk
    return 0 if disk is None else disk.bytes_read


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_reads_between_steps_give_what_forward_sees(placement, tmp_path):
    model, _ = offloaded(placement, tmp_path)
    wanted = forward_values(model)
    params = dict(model.named_parameters())
    assert all(is_released(p) for p in params.values())  # every unit is released now
    for name, p in params.items():
        got = p.detach().clone()
        assert type(got) is torch.Tensor and got.dtype == p.dtype and got.shape == p.shape
        assert torch.equal(got, wanted[name]), name
        with torch.no_grad():
            assert torch.equal(p.float().norm(), wanted[name].float().norm()), name
    # torch's own readers of whole lists of parameters
    with torch.no_grad():
        vector = nn.utils.parameters_to_vector(model.parameters())
    assert torch.equal(vector, torch.cat([wanted[n].reshape(-1) for n in params]))


def test_printing_a_parameter_prints_its_value(tmp_path):
    model, _ = offloaded("host", tmp_path)
    wanted = forward_values(model)
    p = model.blocks[0].ln1.weight
    assert repr(p) == repr(nn.Parameter(wanted["blocks.0.ln1.weight"]))


def test_an_ema_kept_between_steps_follows_the_weights(tmp_path):
    """The EMA loop of timm / diffusers: ema = decay * ema + (1 - decay) * p after each
    step. Every read is the current weights, bit for bit (compared with state_dict)."""
    torch.manual_seed(0)
    model = GPT()
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), disk_config(tmp_path))
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    wanted = {n: v.clone() for n, v in model.state_dict().items() if n in ema}
    for x, y in batches(3):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].mul_(0.9).add_(p, alpha=0.1)
        state = model.state_dict()
        for n in wanted:
            wanted[n].mul_(0.9).add_(state[n], alpha=0.1)
    for n in ema:
        assert torch.equal(ema[n], wanted[n]), n


@pytest.mark.parametrize("placement", ["host", "host-bf16", "disk"])
def test_an_alias_kept_across_steps_follows_the_weights(placement, tmp_path):
    """In plain PyTorch ``w = p.detach()`` (or ``p.data``, a view) shares the parameter's
    memory: kept across a step it shows the new weights. Here an alias is a read (there
    are no bytes between uses): it must follow the steps and loads all the same, every
    alias of one read agreeing, while a clone stays a snapshot."""
    model, optimizer = offloaded(placement, tmp_path, steps=1)
    name = "blocks.0.fc.weight"
    p = model.blocks[0].fc.weight
    w, d = p.detach(), p.data
    with torch.no_grad():
        flat = p.view(-1)
    row = w[1]  # an alias of an alias
    snapshot = p.detach().clone()
    for x, y in batches(2, seed=7):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    wanted = forward_values(model)[name]
    assert not torch.equal(wanted, snapshot)  # the weights did move: the test can fail
    assert torch.equal(snapshot, snapshot.clone()) and type(snapshot) is torch.Tensor
    assert torch.equal(row, wanted[1])  # an alias of an alias, used first
    assert torch.equal(w, wanted) and torch.equal(d, wanted)
    assert torch.equal(flat, wanted.view(-1))
    # a load is a change too
    zeros = torch.zeros(p.shape)
    model.load_state_dict({name: zeros}, strict=False)
    assert torch.equal(w, zeros.to(p.dtype)) and torch.equal(row, zeros[1].to(p.dtype))
    with pytest.raises(OffloadedParameterError):  # and an alias still refuses writes
        w.add_(1.0)


def test_an_alias_outlives_its_model_with_its_last_value(tmp_path):
    """An alias kept after hetstore.release (or after the model is dropped) keeps the last
    value it showed, and does not keep the model's tiers alive."""
    import gc
    import weakref

    model, optimizer = offloaded("host", tmp_path, steps=1)
    w = model.blocks[0].fc.weight.detach()
    shown = w.clone()
    units = weakref.ref(hetstore.state_of(model).units[0])
    x, y = batches(1, seed=9)[0]
    model(x, y).backward()
    optimizer.step()
    hetstore.release(model)
    assert torch.equal(w, shown)  # released: the value it last showed (no read, no crash)
    assert repr(w) == repr(shown)  # printed as plain PyTorch prints a tensor
    del model, optimizer
    gc.collect()
    assert units() is None  # the alias did not keep the unit (and its tiers) alive


def test_an_alias_read_under_inference_mode_follows_the_weights(tmp_path):
    """A validation loop under torch.inference_mode reads an alias; kept and used after
    the next step, it is read again like any other."""
    model, optimizer = offloaded("host", tmp_path, steps=1)
    with torch.inference_mode():
        w = model.blocks[0].fc.weight.detach()
    for x, y in batches(1, seed=4):
        model(x, y).backward()
        optimizer.step()
    assert torch.equal(w, forward_values(model)["blocks.0.fc.weight"])


def test_metadata_reads_nothing(tmp_path):
    model, _ = offloaded("disk", tmp_path)
    before = disk_bytes_read(model)
    for p in model.parameters():
        assert p.shape == p.size() and p.numel() == p.nelement() > 0
        assert p.dtype == torch.float32 and p.device.type == "cpu" and p.requires_grad
        assert p.is_leaf and p.dim() == p.ndim and p.is_contiguous()
        assert torch.zeros_like(p).shape == p.shape
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in model.parameters())  # what Trainer and PEFT log
    assert n_params == sum(p.numel() for p in GPT().parameters())
    assert disk_bytes_read(model) == before


WRITES = {
    "in-place op": lambda p, v: p.add_(1.0),
    "copy_ into .data (EMA copy_to)": lambda p, v: p.data.copy_(v),
    "slice assignment through detach()": lambda p, v: p.detach().__setitem__(0, 3.0),
    "a view of .data": lambda p, v: p.data.view(-1).zero_(),
    "nn.init": lambda p, v: nn.init.normal_(p),
    "out=": lambda p, v: torch.add(v, 1.0, out=p),
    ".data assignment": lambda p, v: setattr(p, "data", v),
    "vector_to_parameters": lambda p, v: nn.utils.vector_to_parameters(v.reshape(-1), [p]),
    "an in-place operator": lambda p, v: p.__imul__(2.0),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_writes_are_refused_and_lose_nothing(write, tmp_path):
    model, optimizer = offloaded("host", tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = model.blocks[0].fc.weight
    with torch.no_grad(), pytest.raises(OffloadedParameterError) as info:
        WRITES[write](p, torch.zeros(p.shape))
    assert "'blocks.0.fc.weight'" in str(info.value) and "load_state_dict" in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # the way out named by the error: it writes the master, and forward uses it
    model.load_state_dict({"blocks.0.fc.weight": torch.zeros(p.shape)}, strict=False)
    assert torch.equal(p.detach(), torch.zeros(p.shape))


def test_writing_into_another_tensor_from_a_parameter_is_allowed(tmp_path):
    model, _ = offloaded("host", tmp_path)
    wanted = forward_values(model)["blocks.0.fc.weight"]
    p = model.blocks[0].fc.weight
    target = torch.empty(p.shape)
    with torch.no_grad():
        target.copy_(p)
        assert torch.equal(target, wanted)
        torch.mul(p, 2.0, out=target)
        assert torch.equal(target, wanted * 2.0)


def test_a_use_that_needs_the_gradient_outside_forward_is_refused(tmp_path):
    """With gradients on, a computation on a released parameter would give a result
    requiring grad in plain PyTorch -- a gradient hetstore would never collect (the unit
    is not in use): an L2 penalty added outside forward, an embedding looked up outside
    the model's forward (inputs_embeds). Refused, naming the ways out; the same reads
    without a gradient, and results that need none, are served."""
    model, _ = offloaded("host", tmp_path)
    p = model.blocks[0].fc.weight
    ids = batches(1)[0][0]
    uses = {
        "penalty": lambda: sum(q.pow(2).sum() for q in model.parameters()),
        "embedding": lambda: model.wte(ids),
        "copy into a tensor": lambda: torch.empty(p.shape).copy_(p),
    }
    for name, use in uses.items():
        with pytest.raises(OffloadedParameterError, match="torch.no_grad") as info:
            use()
        assert "outside its module's forward with gradients on" in str(info.value), name
        with torch.no_grad():
            assert not use().requires_grad, name
    # results without a gradient need no refusal, with gradients on
    wanted = forward_values(model)["blocks.0.fc.weight"]
    assert torch.equal(p > 0, wanted > 0) and p.argmax() == wanted.argmax()
    assert not p.detach().requires_grad and not p.data.requires_grad
    assert repr(p).endswith("requires_grad=True)")


def test_bytes_numpy_and_aten_writes_cannot_escape(tmp_path):
    model, _ = offloaded("host", tmp_path)
    p, q = model.blocks[0].fc.weight, model.blocks[1].fc.weight
    for escape in (
        lambda: p.data_ptr(),
        lambda: p.untyped_storage(),
        lambda: p.detach().untyped_storage(),
        lambda: torch.from_dlpack(p.detach()),
    ):
        with pytest.raises(OffloadedParameterError, match="no bytes of its own"):
            escape()
    array = p.detach().numpy()  # a copy of the value: refuses writes, which would be lost
    with pytest.raises(ValueError, match="read-only"):
        array[0, 0] = 5.0
    with torch.no_grad(), pytest.raises(OffloadedParameterError, match="add_"):
        torch.ops.aten.add_.Tensor(q, 1.0)
    assert torch.equal(q.detach(), forward_values(model)["blocks.1.fc.weight"])


def test_a_parameter_subclass_is_offloaded_and_served(tmp_path):
    """A model with its own subclass of nn.Parameter: offloaded as before, and read
    between steps like any other parameter."""

    class Tagged(nn.Parameter):
        pass

    torch.manual_seed(0)
    model = GPT()
    model.blocks[0].fc.weight = Tagged(model.blocks[0].fc.weight.detach().clone())
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), config("cpu", "cpu"))
    x, y = batches(1)[0]
    model(x, y).backward()
    optimizer.step()
    p = model.blocks[0].fc.weight
    assert isinstance(p, Tagged) and is_released(p)
    assert torch.equal(p.detach(), forward_values(model)["blocks.0.fc.weight"])


def test_model_to_its_own_device_is_a_noop_and_a_cast_is_refused(tmp_path):
    """Trainer and accelerate call model.to(device): with nothing to change it must pass.
    A cast would change copies only: refused, naming compute_dtype."""
    model, optimizer = offloaded("host", tmp_path)
    params = list(model.parameters())
    assert model.to("cpu") is model and model.float() is model
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    with pytest.raises(OffloadedParameterError, match="compute_dtype"):
        model.half()
    x, y = batches(1)[0]
    model(x, y).backward()  # still trains
    optimizer.step()


def test_what_returns_the_parameter_itself_is_decided_without_a_stand_in(tmp_path, monkeypatch):
    """``p.to(...)``, ``p.cpu()``, ``p.float()`` hand back ``p`` itself when nothing would
    change, as in plain PyTorch; anything else is a read. ``model.to(device)`` decides it
    from the arguments (torch's own parser), allocating nothing the size of a parameter
    (on CUDA that would be device memory outside the budget)."""
    import hetstore.runtime.released as released_module

    model, _ = offloaded("host", tmp_path)
    p = model.blocks[0].fc.weight
    wanted = forward_values(model)["blocks.0.fc.weight"]
    stand_ins = []
    real = released_module._returns_self_on_stand_in
    monkeypatch.setattr(
        released_module,
        "_returns_self_on_stand_in",
        lambda func, param, args, kwargs, device: (
            stand_ins.append(device) or real(func, param, args, kwargs, device)
        ),
    )
    assert model.to("cpu") is model and model.to(torch.device("cpu"), torch.float32) is model
    assert stand_ins == []
    same = [
        p.to("cpu"), p.to(torch.float32), p.to(p), p.to("cpu", torch.float32, non_blocking=True),
        p.to(memory_format=torch.preserve_format), p.to(memory_format=torch.contiguous_format),
        p.cpu(), p.float(), p.contiguous(),
    ]  # fmt: skip
    assert all(q is p for q in same)
    assert set(stand_ins) <= {"meta"}  # the casts ask a meta tensor: no bytes
    with torch.no_grad():  # (with gradients on, a real cast is a differentiable use)
        changed_ones = (p.to(torch.float16), p.to("cpu", copy=True), p.double(), p.half())
    for changed in changed_ones:
        assert changed is not p and type(changed) is torch.Tensor
        assert torch.equal(changed, wanted.to(changed.dtype))


def test_copies_and_pickles_are_plain_parameters_with_the_value(tmp_path):
    model, _ = offloaded("disk", tmp_path)
    wanted = forward_values(model)["blocks.1.qkv.weight"]
    p = model.blocks[1].qkv.weight
    clone = copy.deepcopy(p)
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        assert type(other) is nn.Parameter and torch.equal(other.detach(), wanted)
    assert is_released(p)  # and the original is untouched


def test_forward_and_backward_see_plain_parameters(tmp_path):
    """The layer is off while a unit is in use: nothing of it runs per op in training."""
    model, optimizer = offloaded("host", tmp_path, steps=0)
    seen = []
    block = model.blocks[0]
    # after hetstore's own pre-hook, which fetches the unit
    block.register_forward_pre_hook(lambda m, a: seen.append(any(map(is_released, m.parameters()))))
    x, y = batches(1)[0]
    model(x, y).backward()
    assert seen == [False]
    assert all(is_released(p) for p in block.parameters())


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_training_reads_no_parameter_through_the_layer(placement, tmp_path, monkeypatch):
    """The runtime, the optimizer and torch's clipping never go through a served read
    (it would be a disk read per parameter): steps with clipping and zero_grad read none."""
    model, optimizer = offloaded(placement, tmp_path, steps=0)
    reads = []
    monkeypatch.setattr(Unit, "read_param", lambda self, entry: reads.append(entry.name))
    for x, y in batches(3):
        model(x, y).backward()
        optimizer.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()
    hetstore.memory_stats(model)
    assert reads == []


def test_reads_between_backward_and_step_are_the_weights_before_the_step(tmp_path):
    """With the step run ahead in backward's shadow (overlap_step on disk), a read before
    optimizer.step() still sees the committed weights; after it, the new ones."""
    model, optimizer = offloaded("disk", tmp_path)
    before = forward_values(model)
    x, y = batches(3)[2]
    model(x, y).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    optimizer.step()
    after = forward_values(model)
    assert any(not torch.equal(after[n], before[n]) for n in after)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), after[name]), name


class StopGradientFirst(nn.Module):
    """A block that uses its weight through ``.detach()`` before its gradient-carrying
    use: that use's backward runs after the weight's gradient is in (or, with
    ``clone``, reads a copy of its own)."""

    def __init__(self, clone: bool):
        super().__init__()
        self.clone = clone
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self, x):
        stopped = self.weight.detach()
        b = nn.functional.linear(x, stopped.clone() if self.clone else stopped)
        return torch.tanh(x @ self.weight.t()) + torch.sin(b)


class StopGradientModel(nn.Module):
    def __init__(self, clone: bool):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(StopGradientFirst(clone) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


@pytest.mark.parametrize("clone", [False, True], ids=["detach", "detach-clone"])
def test_a_weight_used_detached_after_its_gradient_stops_backward_or_trains_with_a_copy(
    monkeypatch, clone
):
    """As on a GPU (fetches copy): a weight's stop-gradient use whose backward comes after
    the weight's gradient reads a device copy already freed, and backward stops with
    torch's storage error (never a wrong value); with ``.detach().clone()``, the way out
    docs/guide/troubleshooting.md names, training is plain PyTorch's."""
    monkeypatch.setattr(Unit, "fetches_in_place", property(lambda self: False))
    torch.manual_seed(0)
    ref = StopGradientModel(clone)
    mine = copy.deepcopy(ref)
    mine, opt = hetstore.offload(
        mine, adamw(mine.parameters()), config("cpu", "cpu"), units=list(mine.blocks)
    )
    x = torch.randn(4, 8)
    if not clone:
        with pytest.raises(RuntimeError, match="storage of size 0"):
            mine(x).backward()
        return
    ref_opt = adamw(ref.parameters())
    for net, optimizer in ((ref, ref_opt), (mine, opt)):
        for _ in range(2):
            net(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    for key, value in ref.state_dict().items():
        assert torch.equal(mine.state_dict()[key], value), key
