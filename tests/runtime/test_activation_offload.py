"""Saved activations: counted against the CPU device budget, offloaded to host or disk."""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore import OffloadConfig, OutOfDeviceMemory
from tests.models.cnn import ResNet, image_batches
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, pair, run, train_both


def act_config(path, acts, param="cpu", optim="cpu", **kwargs):
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        offload_activations=acts,
        activation_min_bytes=0,  # the test models are small: offload everything
        offload_path=str(path),
        enable_pinned_mem=False,
        device="cpu",
        **kwargs,
    )


@pytest.mark.parametrize("acts", ["cpu", "disk"])
@pytest.mark.parametrize("param, optim", [("none", "none"), ("cpu", "cpu"), ("disk", "disk")])
def test_gpt_parity_with_activations_offloaded(tmp_path, acts, param, optim):
    cfg = act_config(tmp_path, acts, param, optim)
    ref, mine, (ref_losses, _), (losses, _) = train_both(GPT, batches(4), cfg, clip=1.0)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert hetstore.state_of(mine).runtime.activations.packed_bytes > 0


@pytest.mark.parametrize("acts", ["cpu", "disk"])
def test_cnn_parity_with_activations_offloaded(tmp_path, acts):
    data = image_batches(3)
    ref, mine, (ref_losses, _), (losses, _) = train_both(ResNet, data, act_config(tmp_path, acts))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_activation_checkpointing_regions_are_left_to_checkpoint(tmp_path):
    def checkpointed():
        return GPT(checkpointing=True)

    cfg = act_config(tmp_path, "cpu")
    ref, mine, (ref_losses, _), (losses, _) = train_both(checkpointed, batches(4), cfg)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    # only what lies outside the checkpointed blocks (embeddings, head, loss) was copied
    _, plain = pair(GPT)
    plain, opt = hetstore.offload(plain, adamw(plain.parameters()), act_config(tmp_path, "cpu"))
    run(plain, opt, batches(1))
    ckpt_bytes = hetstore.state_of(mine).runtime.activations.packed_bytes / 4
    assert ckpt_bytes < hetstore.state_of(plain).runtime.activations.packed_bytes / 2


def test_each_saved_storage_is_copied_once(tmp_path):
    """q, k and v are views of one projection; a tensor feeding two ops is saved twice:
    the bytes copied equal the distinct saved storages of a plain run, not the saves."""
    torch.manual_seed(0)
    plain = GPT()
    _, mine = pair(GPT)
    mine, _ = hetstore.offload(mine, None, act_config(tmp_path, "cpu"))
    x, y = batches(1)[0]
    per_save, distinct = [], {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in {
            p.untyped_storage().data_ptr() for p in plain.parameters()
        }:
            per_save.append(t.untyped_storage().nbytes())
            distinct[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(x, y).backward()
    mine(x, y).backward()
    packed = hetstore.state_of(mine).runtime.activations.packed_bytes
    assert packed == sum(distinct.values()) < sum(per_save)


def test_large_batch_ooms_without_offload_and_trains_with_it(tmp_path):
    """The seed's case: the model data fits the device budget, the saved activations of
    a large batch do not; offloading them makes the same run fit."""
    # measured device peaks at batch 64 of 16x16 images: 7.2 MiB keeping the saved
    # activations, 0.5 MiB offloading them
    data = image_batches(2, batch=64, size=16)
    budget = "2MB"
    torch.manual_seed(0)
    model = ResNet()
    cfg = act_config(tmp_path, "none", max_device_memory=budget)
    model, opt = hetstore.offload(model, adamw(model.parameters()), cfg)
    with pytest.raises(OutOfDeviceMemory) as info:
        run(model, opt, data)
    assert "activations" in str(info.value) and "max_device_memory" in str(info.value)

    ref, mine = pair(ResNet)
    cfg = act_config(tmp_path, "cpu", max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    stats = hetstore.memory_stats(mine)
    assert (
        stats["device"]["peak"]
        <= hetstore.OffloadConfig(max_device_memory=budget).max_device_memory
    )
    assert stats["device"]["current"] < stats["device"]["peak"]  # activations released


def test_activations_are_released_after_backward(tmp_path):
    _, mine = pair(GPT)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), act_config(tmp_path, "none"))
    x, y = batches(1)[0]
    device = hetstore.state_of(mine).tiers.device_tier.account
    before = device.current
    loss = mine(x, y)
    assert device.current > before  # counted while saved
    loss.backward()
    del loss
    assert device.current == before


@pytest.mark.parametrize("acts", ["none", "cpu"])
def test_a_forward_dropped_without_its_backward_gives_its_activations_back(tmp_path, acts):
    """Validation in train mode with autograd on, or an exception between forward and
    backward: the graph goes when the loss does. (Records that held a node's own saved
    output made a cycle no collector sees: every such forward leaked its graph.)"""
    _, mine = pair(GPT)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), act_config(tmp_path, acts))
    x, y = batches(1)[0]
    device = hetstore.state_of(mine).tiers.device_tier.account
    loss = mine(x, y)
    loss.backward()
    del loss
    after_a_step = dict(device.holders(n=100)).get("activations", 0)
    for _ in range(3):
        loss = mine(x, y)
        del loss
        assert dict(device.holders(n=100)).get("activations", 0) == after_a_step
    assert not hetstore.state_of(mine).runtime.graph_alive
    hetstore.release(mine)


def _one_step(model, opt, data):
    losses, _ = run(model, opt, data)
    return losses, hetstore.state_of(model).runtime.activations


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_disk_restores_are_prefetched_in_reverse_unit_order(tmp_path, depth):
    """Reaching a unit's saved tensors in backward starts reading the ones of the units
    before it: with prefetch, most restores find their bytes on the way; without, none."""
    ref, mine = pair(GPT)
    cfg = act_config(tmp_path, "disk", "none", "none", prefetch_depth=depth)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    losses, hooks = _one_step(mine, opt, batches(2))
    ref_losses, _ = run(ref, adamw(ref.parameters()), batches(2))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert hooks.restores > 0
    if depth == 0:
        assert hooks.restored_ahead == 0
    else:
        # not ahead: the last group (loss, head), restored first, and tensors saved in a
        # unit but first unpacked by the next one's backward (the residual stream)
        assert hooks.restored_ahead >= hooks.restores * 3 // 4  # measured: 82 of 96


def test_per_unit_activation_tier(tmp_path):
    """The planner's per-unit choice: one block keeps its activations, one goes to disk,
    the rest to host; training is unchanged and fewer bytes leave the device."""
    cfg = act_config(tmp_path, "cpu", "none", "none")
    _, everything = pair(GPT)
    everything, opt = hetstore.offload(everything, adamw(everything.parameters()), cfg)
    run(everything, opt, batches(1))
    all_bytes = hetstore.state_of(everything).runtime.activations.packed_bytes

    ref, mine = pair(GPT)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    hooks = hetstore.state_of(mine).runtime.activations
    hooks.set_unit_tier("blocks.0", "none")
    hooks.set_unit_tier("blocks.1", "disk")
    losses, _ = run(mine, opt, batches(3))
    ref_losses, _ = run(ref, adamw(ref.parameters()), batches(3))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert 0 < hooks.packed_bytes / 3 < all_bytes
    with pytest.raises(hetstore.ConfigError, match="blocks.99"):
        hooks.set_unit_tier("blocks.99", "cpu")
    with pytest.raises(hetstore.ConfigError, match="'nvme'"):
        hooks.set_unit_tier("blocks.0", "nvme")


def test_the_oom_report_names_activation_min_bytes_when_small_activations_overflow():
    """offload_activations='cpu' moves only tensors of at least activation_min_bytes;
    when the ones it leaves on the device are what overflows, the report says so and
    names the key (the same budget trains with activation_min_bytes=0)."""

    def attempt(min_bytes):
        torch.manual_seed(0)
        model = GPT(width=64, depth=3, ctx=16)
        cfg = OffloadConfig(
            offload_param="cpu",
            offload_optimizer="cpu",
            offload_activations="cpu",
            activation_min_bytes=min_bytes,
            max_device_memory="400KB",
            device="cpu",
            enable_pinned_mem=False,
        )
        model, _ = hetstore.offload(model, torch.optim.AdamW(model.parameters()), cfg)
        x, y = batches(1, batch=8)[0]
        model(x, y).backward()

    with pytest.raises(OutOfDeviceMemory) as info:
        attempt("1GB")
    message = str(info.value)
    assert "activation_min_bytes (1.00 GiB)" in message and "'activations' holder" in message
    attempt(0)


def test_a_full_host_waits_for_activation_writes_in_flight_instead_of_failing(
    tmp_path, monkeypatch
):
    """Activations bound for disk hold a host buffer only until their write lands. On a
    slow disk (here: a write is reported unfinished until waited for) the staging of the
    units before is still held when a unit packs. A host one page short of that peak
    runs out, and the allocation waits for the writes in flight instead of failing
    (ActivationHooks.host_buffer). Trains like plain PyTorch; without the wait, the same
    host is refused."""
    from hetstore import OutOfTierMemory
    from hetstore.runtime import activations

    data = batches(2, batch=8)
    settle = activations._Storage.settle

    def slow_disk(self, wait):
        if not wait and self._written is not None:
            return False
        return settle(self, wait)

    monkeypatch.setattr(activations._Storage, "settle", slow_disk)

    def train(capacity=None):
        ref, mine = pair(GPT)
        cfg = act_config(
            tmp_path / str(capacity),
            "disk",
            "none",
            "none",
            offload_cpu_size=capacity,
            prefetch_depth=0,  # backward restores one saved tensor at a time
        )
        mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
        try:
            losses, _ = run(mine, opt, data)
            ref_losses, _ = run(ref, adamw(ref.parameters()), data)
            torch.testing.assert_close(losses, ref_losses, **TIGHT)
            assert_same_weights(ref, mine)
            return hetstore.memory_stats(mine)["host"]["peak"]
        finally:
            hetstore.release(mine)

    held = train()  # every write in flight until a later unit's group settles it
    short = held - 4096
    waits = []
    host_buffer = activations.ActivationHooks.host_buffer

    def counting(self, nbytes):
        before = len(self._unsettled)
        out = host_buffer(self, nbytes)
        waits.append(len(self._unsettled) < before)
        return out

    monkeypatch.setattr(activations.ActivationHooks, "host_buffer", counting)
    assert train(capacity=short) <= short
    assert any(waits)
    # the control: the allocation alone, without the wait, is refused on this host
    monkeypatch.setattr(
        activations.ActivationHooks,
        "host_buffer",
        lambda self, nbytes: self.tiers.host.allocate(nbytes, "activations", torch.uint8),
    )
    with pytest.raises(OutOfTierMemory, match="activations"):
        train(capacity=short)


class _ViewsBlock(torch.nn.Linear):
    """Autograd saves views and aliases of its weight, not the Parameter: ``w.t()`` for
    the product, ``w.detach()`` beside an input that requires grad."""

    def forward(self, x):
        return torch.tanh(x @ self.weight.t() + self.bias) * self.weight.detach()[0]


class _SavesWeightViews(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ViewsBlock(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_saved_views_of_the_weights_are_not_offloaded_as_activations(tmp_path, param):
    """A saved tensor in a unit's parameter storage is the model's, found by that storage
    (the parameters of host units sit in shared host blocks on a CPU device): only the
    activations' bytes are copied out."""
    torch.manual_seed(0)
    model = _SavesWeightViews()
    x = torch.randn(4, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).backward()
    activations = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in saved
        if t.untyped_storage().data_ptr() not in weights
    }
    views = [t for t in saved if t.untyped_storage().data_ptr() in weights]
    assert any(not isinstance(t, torch.nn.Parameter) for t in views)  # (the case at hand)
    mine, _ = hetstore.offload(model, None, act_config(tmp_path, "cpu", param, "cpu"))
    stash = hetstore.state_of(mine).runtime.activations
    for _ in range(2):  # (the second forward: every unit fetched before)
        before = stash.packed_bytes
        mine(x).backward()
        assert stash.packed_bytes - before == sum(activations.values())
