"""``hetstore.evict`` / ``hetstore.restore``: the device memory given back between steps and
taken again, with training bitwise what it is without the cycles; nothing leaks over many
cycles; and the refusals.

Exactness is bitwise (``==`` on losses, ``torch.equal`` on weights): evict and restore copy
bytes and change no value, so any difference at all is a bug.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.api.helpers import footprint
from tests.models.gpt import GPT, batches

CYCLES = 20


def _config(placement: str, path) -> OffloadConfig:
    common = dict(enable_pinned_mem=False, device="cpu", offload_path=str(path))
    if placement == "mixed":  # compute-dtype parameters on the device, fp32 master on host
        return OffloadConfig(
            offload_param="none", offload_optimizer="cpu", compute_dtype="bf16", **common
        )
    if placement == "spill":  # everything on the device, the host too small to take it
        return OffloadConfig(
            offload_param="none", offload_optimizer="none", offload_cpu_size="1MB", **common
        )
    return OffloadConfig(offload_param=placement, offload_optimizer=placement, **common)


def _offloaded(placement: str, path):
    torch.manual_seed(0)
    model = GPT(vocab=64, width=64, depth=3, heads=4, ctx=16)
    model.register_buffer("scale", torch.ones(64))  # a module buffer moves too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return hetstore.offload(model, optimizer, _config(placement, path))


def _train(placement: str, path, cycles: bool):
    model, optimizer = _offloaded(placement, path)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses, moved = [], []
    for x, y in batches(CYCLES):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if cycles:
            before = hetstore.memory_stats(model)["device"]["current"]
            out = hetstore.evict(model, optimizer)
            assert hetstore.memory_stats(model)["device"]["current"] == 0
            back = hetstore.restore(model, optimizer)
            assert hetstore.memory_stats(model)["device"]["current"] == before
            assert back.total == out.total
            moved.append(out)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hetstore.release(model)
    return losses, weights, moved, initial


@pytest.mark.parametrize("placement", ["none", "mixed", "cpu", "disk", "spill"])
def test_twenty_cycles_train_bitwise_like_none(placement, tmp_path):
    plain_losses, plain_weights, _, initial = _train(placement, tmp_path, cycles=False)
    losses, weights, moved, _ = _train(placement, tmp_path, cycles=True)
    assert losses == plain_losses
    assert weights.keys() == plain_weights.keys()
    for key, value in weights.items():
        assert torch.equal(value, plain_weights[key]), key
    moved_by = max((plain_weights[k].float() - initial[k].float()).abs().max() for k in initial)
    assert len(plain_losses) == CYCLES and moved_by > 1e-2  # it trained
    # what moved: every device byte, to the host (to disk where the host budget is short)
    if placement in ("cpu", "disk"):
        # their states stay off the device between steps: only the module buffer moves
        assert all(m.bytes == {"host": 64 * 4} for m in moved)
    elif placement == "spill":
        assert all(m.bytes.get("disk", 0) > 0 for m in moved)
    else:
        assert all(m.bytes.get("host", 0) > 0 and "disk" not in m.bytes for m in moved)


def test_evict_moves_what_the_device_held_and_restore_brings_it_back(tmp_path):
    model, optimizer = _offloaded("none", tmp_path)
    x, y = next(iter(batches(1)))
    model(x, y).backward()
    optimizer.step()  # (the gradients stay: evicting before zero_grad keeps them)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    device = hetstore.state_of(model).tiers.device_tier
    held = device.account.current
    host = hetstore.state_of(model).tiers.host.account.current
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    report = hetstore.evict(model)
    assert report.total >= held  # (and the optimizer's step counts, not accounted)
    assert hetstore.memory_stats(model)["device"]["current"] == 0
    taken = hetstore.state_of(model).tiers.host.account.current - host
    assert report.total <= taken < report.total + report.storages * 4096  # (whole pages)
    assert hetstore.evict(model).total == 0  # evicting again does nothing
    with pytest.raises(hetstore.GradientAccessError, match="evicted"):
        _ = next(model.parameters()).grad  # (its buffer has no bytes now)
    hetstore.restore(model, keep_buffers=False)
    assert device.account.current == held
    assert hetstore.state_of(model).tiers.host.account.current == host
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert hetstore.restore(model).total == 0  # restoring again does nothing
    hetstore.release(model)


def test_the_host_buffers_are_kept_between_cycles(tmp_path):
    """Pinned once: the second evict copies into the buffers the first one made."""
    model, optimizer = _offloaded("none", tmp_path)
    host = hetstore.state_of(model).tiers.host
    before = host.account.current
    hetstore.evict(model)
    hetstore.restore(model)
    kept = dict(host.account.holders(n=100))["eviction buffers"]
    assert host.account.current == before + kept
    addresses = sorted(b.tensor.data_ptr() for b in hetstore.state_of(model).eviction.spare)
    for _ in range(3):
        hetstore.evict(model)
        assert "eviction buffers" not in dict(host.account.holders(n=100))
        hetstore.restore(model)
        spare = hetstore.state_of(model).eviction.spare
        assert sorted(b.tensor.data_ptr() for b in spare) == addresses
    hetstore.evict(model)
    hetstore.restore(model, keep_buffers=False)  # given back
    assert host.account.current == before
    hetstore.release(model)


def test_a_model_released_while_evicted_frees_everything(tmp_path):
    model, optimizer = _offloaded("none", tmp_path)
    tiers = hetstore.state_of(model).tiers
    scale = model.scale
    hetstore.evict(model)
    hetstore.release(model)
    assert tiers.host.account.current == 0  # the evicted copies went
    assert model.scale is scale and torch.equal(scale, torch.ones(64))  # the model keeps it
    # (the model keeps its buffers after a release, as without an eviction)
    assert [label for label, _ in tiers.device_tier.account.holders()] == ["module buffers"]


def test_a_hundred_cycles_leave_files_fds_threads_and_rss_flat(tmp_path, capsys):
    model, optimizer = _offloaded("none", tmp_path)
    x, y = next(iter(batches(1)))
    for _ in range(5):  # warm-up: allocator caches, the host pool's first block
        hetstore.evict(model)
        hetstore.restore(model)
    gc.collect()
    time.sleep(0.2)
    before = footprint(tmp_path)
    samples = []
    for i in range(100):
        hetstore.evict(model)
        hetstore.restore(model)
        if i % 10 == 0:  # a step now and then: cycles interleave with training
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        samples.append(footprint(tmp_path))
        for key in ("files", "fds", "threads"):
            assert samples[-1][key] == before[key], (i, key, before, samples[-1])
    cycles = list(range(len(samples)))
    slopes = {
        key: statistics.linear_regression(cycles, [s[key] for s in samples]).slope
        for key in samples[0]
    }
    state_bytes = hetstore.memory_stats(model)["device"]["current"]
    with capsys.disabled():
        print(
            "\nper evict/restore cycle (slope over 100 cycles): "
            + ", ".join(f"{k} {v:+.3g}" for k, v in slopes.items())
            + f"; the device holds {state_bytes} bytes"
        )
    # a leak of 1/20 of what moves per cycle would show as a slope of 5% of it
    assert slopes["rss"] < state_bytes / 20, slopes
    assert samples[-1]["mappings"] - before["mappings"] <= 4, (before, samples[-1])
    hetstore.release(model)


# ---------------------------------------------------------------------- refusals
def test_an_evicted_model_and_its_optimizer_refuse_until_restored(tmp_path):
    model, optimizer = _offloaded("none", tmp_path)
    x, y = next(iter(batches(1)))
    hetstore.evict(model, optimizer)
    with pytest.raises(hetstore.ConfigError, match=r"evicted .*hetstore.restore\(model\)"):
        model(x, y)
    for call in (optimizer.step, optimizer.zero_grad, optimizer.state_dict):
        with pytest.raises(hetstore.ConfigError, match="evicted"):
            call()
    with pytest.raises(hetstore.ConfigError, match="before evicting"):
        hetstore.named_weights(model)
    for read in (
        model.state_dict,
        lambda: model.load_state_dict({}),
        lambda: model.blocks[0](torch.zeros(1, 16, 64)),  # a block on its own
        lambda: copy.deepcopy(model),
    ):
        with pytest.raises(hetstore.ConfigError, match="evicted"):
            read()
    # the parameters homed on the device, and the model's buffers, have no bytes: a read
    # says so instead of touching freed memory
    with pytest.raises(hetstore.OffloadedParameterError, match="evicted"):
        next(model.parameters()).sum()
    assert model.scale.device.type == "meta"
    for call in (
        lambda: hetstore.save(tmp_path / "ckpt", model, optimizer),
        lambda: hetstore.load(tmp_path / "ckpt", model, optimizer),
        lambda: hetstore.export_weights(tmp_path / "export", model),
    ):
        with pytest.raises(hetstore.ConfigError, match=r"evicted .*hetstore.restore\(model\)"):
            call()
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "export").exists()
    hetstore.restore(model, optimizer)
    model(x, y).backward()  # and now it runs
    optimizer.step()
    hetstore.release(model)


def test_evict_refuses_during_backward_and_in_the_middle_of_a_step(tmp_path):
    model, optimizer = _offloaded("none", tmp_path)
    x, y = next(iter(batches(1)))
    loss = model(x, y)
    refused = []

    def evict_now(grad):
        with pytest.raises(hetstore.ConfigError, match="during a backward") as err:
            hetstore.evict(model)
        refused.append(err)
        return grad

    loss.register_hook(evict_now)
    loss.backward()
    assert refused
    optimizer.step()
    optimizer.zero_grad()
    # a forward whose graph awaits its backward: its saved tensors and parameters are read
    loss = model(x, y)
    with pytest.raises(hetstore.ConfigError, match="awaits its backward"):
        hetstore.evict(model)
    del loss  # dropped without a backward: nothing awaits
    assert hetstore.evict(model).total > 0
    hetstore.restore(model)
    loss = model(x, y)
    loss.backward()
    hetstore.evict(model)  # the loss kept after its backward is no graph awaiting one
    hetstore.release(model)


def test_evict_refuses_others_models_and_optimizers(tmp_path):
    model, optimizer = _offloaded("cpu", tmp_path)
    other, other_optimizer = _offloaded("cpu", tmp_path)
    with pytest.raises(hetstore.ConfigError, match="not the one hetstore.offload"):
        hetstore.evict(model, other_optimizer)
    with pytest.raises(hetstore.ConfigError, match="is not offloaded"):
        hetstore.evict(GPT(vocab=64, width=64, depth=1, heads=4, ctx=16))
    with pytest.raises(TypeError, match="nn.Module"):
        hetstore.restore(optimizer)
    hetstore.release(other)
    with pytest.raises(hetstore.ConfigError, match="released"):
        hetstore.evict(other)
    hetstore.release(model)


def test_a_refused_forward_moves_nothing_and_dropping_the_loss_allows_evict(tmp_path):
    """The refusal comes first of all the model's hooks: no unit is fetched, no batch is
    traced. And a graph dropped without its backward holds nothing back (its root unit,
    fetched in place on a CPU device, is released by evict)."""
    model, optimizer = _offloaded("cpu", tmp_path)
    x, y = next(iter(batches(1)))
    loss = model(x, y)
    del loss
    assert hetstore.evict(model).bytes == {"host": 64 * 4}  # (the module buffer)
    with pytest.raises(hetstore.ConfigError, match="evicted"):
        model(x, y)
    assert hetstore.memory_stats(model)["device"]["current"] == 0
    hetstore.restore(model)
    model(x, y).backward()
    optimizer.step()
    hetstore.release(model)


def test_a_model_of_one_unit_with_a_graph_alive_is_not_evicted(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model, optimizer = hetstore.offload(model, optimizer, _config("none", tmp_path))
    loss = model(torch.randn(4, 8)).square().sum()
    with pytest.raises(hetstore.ConfigError, match="awaits its backward"):
        hetstore.evict(model)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert hetstore.evict(model).total > 0
    hetstore.restore(model)
    hetstore.release(model)


def test_kept_host_buffers_are_given_back_when_the_host_runs_out_of_room(tmp_path):
    """restore keeps its host buffers for the next evict, counted in the host tier; an
    allocation that finds no room frees them first instead of failing."""
    torch.manual_seed(0)
    model = GPT(vocab=64, width=64, depth=3, heads=4, ctx=16)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    config = OffloadConfig(
        offload_param="none",
        offload_optimizer="none",
        offload_cpu_size="4MB",
        enable_pinned_mem=False,
        device="cpu",
    )
    model, optimizer = hetstore.offload(model, optimizer, config)
    host = hetstore.state_of(model).tiers.host
    hetstore.evict(model)
    hetstore.restore(model)  # ~2.4 MB kept
    kept = dict(host.account.holders(n=100))["eviction buffers"]
    assert kept > 2 * 2**20
    room = host.capacity - host.account.current
    big = host.allocate(room + 2**20, "more than the room left")  # fits once they go
    assert "eviction buffers" not in dict(host.account.holders(n=100))
    host.free(big)
    hetstore.evict(model)  # (made again)
    hetstore.restore(model)
    hetstore.release(model)


class _Scaled(torch.nn.Module):
    """Blocks whose forward saves the model's buffer for backward (``x * scale``)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))
        self.register_buffer("scale", torch.full((64,), 0.5))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x) * self.scale)
        return x.square().mean()


def test_a_saved_buffer_is_still_the_models_after_a_cycle(tmp_path):
    """With activations offloaded, a buffer saved for backward is not an activation (it
    is not copied off the device); restore gives the buffer a new storage, and it must
    still be known as the model's: the bytes packed per step stay the same."""
    torch.manual_seed(0)
    model = _Scaled()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    config = OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        offload_activations="cpu",
        activation_min_bytes=0,
        enable_pinned_mem=False,
        device="cpu",
    )
    model, optimizer = hetstore.offload(model, optimizer, config)
    activations = hetstore.state_of(model).runtime.activations
    packed = []
    for _ in range(3):
        before = activations.packed_bytes
        model(torch.randn(8, 64)).backward()
        optimizer.step()
        optimizer.zero_grad()
        packed.append(activations.packed_bytes - before)
        hetstore.evict(model)
        hetstore.restore(model)
    assert packed[0] > 0 and packed == [packed[0]] * 3, packed
    hetstore.release(model)
