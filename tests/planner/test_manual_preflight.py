"""A manual placement that cannot fit its capacities is refused at ``offload()``.

Before, the buffers the runtime makes lazily (the disk paths' host staging, the
optimizer step's chunk buffers, its shadow on disk, the device working copies) ran out
mid-run: in backward, or at the first or a later ``optimizer.step()``. The check
(``planner.floor``) compares per-tier floors with the capacities. A floor must never be
above what training holds, or a configuration that trains would be refused: the
first test measures that across placements, and asserts the floors are tight where
nothing but staging is on the host.
"""

from __future__ import annotations

import os

import pytest
import torch

import hetstore
from hetstore import OutOfDeviceMemory
from hetstore._sizes import format_size
from hetstore.errors import OutOfTierMemory
from hetstore.planner.floor import check_manual_floor, floor_of_config
from hetstore.planner.tracer import model_data_trace
from hetstore.tier import Tier
from tests.models.gpt import GPT, batches
from tests.parity import disk_config
from tests.parity import train as train_on

VOCAB = 4096  # a root unit (tied embedding and head) five times a block


def model_and_optimizer(kind="adamw"):
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=64, depth=2, heads=4, ctx=16)
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, optimizer


def floor_of(model, optimizer, cfg):
    trace = model_data_trace(model, cfg, None, optimizer=optimizer)
    return floor_of_config(trace, cfg, optimizer)


def train(model, optimizer, steps=3):
    return train_on(model, optimizer, batches(steps, vocab=VOCAB))


CASES = [
    # (param, optimizer, extra config): every tier holding something, staging sizes varied
    ("disk", "disk", {}),
    ("disk", "disk", {"prefetch_depth": 0}),
    ("disk", "disk", {"prefetch_depth": 2, "optimizer_chunk_size": 64 << 10}),
    ("disk", "disk", {"offload_grad": "cpu"}),
    ("disk", "disk", {"compute_dtype": "bf16"}),
    ("disk", "disk", {"step_in_backward": True}),
    ("cpu", "disk", {}),
    ("none", "disk", {}),
    ("cpu", "cpu", {}),
    ("none", "cpu", {}),
    ("cpu", "none", {}),
]


@pytest.mark.parametrize("param, optim, extra", CASES)
def test_the_floor_is_never_above_what_training_holds(tmp_path, param, optim, extra):
    tight = (param, optim) == ("disk", "disk") and not {"offload_grad", "step_in_backward"} & set(
        extra
    )
    model, optimizer = model_and_optimizer()
    cfg = disk_config(tmp_path, param, optim, offload_activations="none", **extra)
    floor = floor_of(model, optimizer, cfg)
    model, optimizer = hetstore.offload(model, optimizer, cfg)
    train(model, optimizer)
    stats = hetstore.memory_stats(model)
    for tier in Tier:
        peak = stats[tier.label]["peak"]
        assert floor.total(tier) <= peak, (tier, floor.parts.get(tier), peak)
    if tight:
        # only staging is on the host: the floor is what is held, to the layout's padding
        assert floor.total(Tier.HOST) >= 0.98 * stats["host"]["peak"]
    hetstore.release(model)


def _linears():
    """Four Linear layers: no root unit (every parameter is in a block)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _group_per_parameter():
    model, _ = model_and_optimizer()
    groups = [{"params": [p]} for p in model.parameters()]
    return model, torch.optim.AdamW(groups, lr=1e-3, fused=True)


def _no_optimizer():
    model, _ = model_and_optimizer()
    return model, None


@pytest.mark.parametrize(
    "make, extra",
    [
        (_linears, {}),
        (_group_per_parameter, {}),
        (_group_per_parameter, {"optimizer_chunk_size": 20 << 10}),
        (model_and_optimizer, {"optimizer_state_format": "8bit"}),
        (model_and_optimizer, {"optimizer_chunk_size": 20 << 10}),
        (_no_optimizer, {"offload_optimizer": "cpu"}),
    ],
    ids=["no-root", "groups", "groups-odd-chunk", "8bit", "odd-chunk", "no-optimizer"],
)
def test_the_floor_holds_for_other_model_and_optimizer_shapes(tmp_path, make, extra):
    """Shapes a review found over-counted: no root unit (the parameter staging turns one
    slot over), a param group per parameter (chunks never cross a group), a chunk size
    the layout rounds down, 8-bit states, and no optimizer (no fp32 master for
    parameters already in the compute dtype)."""
    model, optimizer = make()
    optim = extra.pop("offload_optimizer", "disk")
    cfg = disk_config(tmp_path, "disk", optim, offload_activations="none", **extra)
    floor = floor_of(model, optimizer, cfg)
    model, optimizer = hetstore.offload(model, optimizer, cfg)
    torch.manual_seed(1)
    for _ in range(2):
        if isinstance(model, torch.nn.Sequential):
            loss = model(torch.randn(8, 256)).pow(2).mean()
        else:
            x, y = batches(1, vocab=VOCAB)[0]
            loss = model(x, y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    stats = hetstore.memory_stats(model)
    for tier in Tier:
        assert floor.total(tier) <= stats[tier.label]["peak"], (tier, floor.parts.get(tier))
    hetstore.release(model)


def test_host_staging_over_offload_cpu_size_is_refused_before_anything_is_built(tmp_path):
    """Everything on disk with a root unit of 1 MiB: parameter staging, gradient staging
    and the step's chunks need 9.06 MiB of host at the step. 9 MiB used to train one
    step and fail in the second ``optimizer.step()`` ('swap root grad')."""
    model, optimizer = model_and_optimizer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(OutOfTierMemory) as info:
        hetstore.offload(model, optimizer, disk_config(tmp_path, offload_cpu_size=9 << 20))
    message = str(info.value)
    assert info.value.tier == "host" and info.value.capacity == 9 << 20
    assert info.value.requested > 9 << 20
    assert "offload_cpu_size" in message and format_size(info.value.requested) in message
    for part in ("parameter staging", "gradient staging", "chunk buffers"):
        assert part in message
    assert "prefetch_depth" in message and "optimizer_chunk_size" in message
    # nothing was built: no offload directory, the model untouched and usable as before
    assert os.listdir(tmp_path) == []
    assert hetstore.state_of(model) is None
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
    # at the floor (rounded up to what the layout's padding adds) it trains
    model, optimizer = model_and_optimizer()
    model, optimizer = hetstore.offload(
        model, optimizer, disk_config(tmp_path, offload_cpu_size=info.value.requested + (64 << 10))
    )
    assert len(train(model, optimizer)) == 3
    hetstore.release(model)


@pytest.mark.parametrize(
    "param, optim, budget, names",
    [
        # parameters on host: the root unit (1 MiB) and the largest block are on the
        # device together; half a MiB used to pass offload() and stop in the first forward
        ("cpu", "cpu", 512 << 10, ["the root unit's working copy"]),
        # everything on the device: the error names what moves the states off it
        ("none", "none", 4 << 20, ["optimizer states", "offload_optimizer='cpu' moves"]),
    ],
)
def test_a_device_floor_over_max_device_memory_is_refused(tmp_path, param, optim, budget, names):
    model, optimizer = model_and_optimizer()
    cfg = disk_config(tmp_path, param, optim, max_device_memory=budget)
    with pytest.raises(OutOfDeviceMemory) as info:
        hetstore.offload(model, optimizer, cfg)
    message = str(info.value)
    assert "max_device_memory" in message and all(name in message for name in names)
    assert info.value.requested > budget


def test_a_disk_without_room_for_the_steps_shadow_is_refused(tmp_path):
    """Master and AdamW states on disk take 3 x 1 MiB for the root; its step writes a
    shadow beside them. A capacity between the two used to fail at the step."""
    model, optimizer = model_and_optimizer()
    cfg = disk_config(tmp_path, "cpu", "disk")
    floor = floor_of(model, optimizer, cfg)
    shadow = dict(floor.parts[Tier.DISK])["the optimizer step's shadow"]
    stored = floor.total(Tier.DISK) - shadow
    with pytest.raises(OutOfTierMemory) as info:
        hetstore.offload(model, optimizer, cfg.replace(offload_disk_size=stored + shadow // 2))
    assert info.value.tier == "disk"
    assert "offload_disk_size" in str(info.value) and "shadow" in str(info.value)


def test_sgd_with_momentum_states_made_later_are_not_counted_against_it(tmp_path):
    """SGD's momentum is made at the first step, not at offload(): the floor leaves it out
    (a floor must not be above what is held), and a placement that trains still does."""
    model, optimizer = model_and_optimizer("sgd")
    cfg = disk_config(tmp_path)
    floor = floor_of(model, optimizer, cfg)
    assert "optimizer states" not in dict(floor.parts[Tier.DISK])
    model, optimizer = hetstore.offload(model, optimizer, cfg)
    train(model, optimizer, steps=2)
    assert floor.total(Tier.HOST) <= hetstore.memory_stats(model)["host"]["peak"]
    hetstore.release(model)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_a_capacity_that_is_the_machines_is_named_as_such(tier, tmp_path):
    """With offload_cpu_size / offload_disk_size unset the capacity is the RAM / the free
    space at offload_path: the refusal says so, and does not advise raising a key that was
    never set past what the machine has."""
    model, optimizer = model_and_optimizer()
    cfg = disk_config(tmp_path)
    floor = floor_of(model, optimizer, cfg)
    capacities = {tier: floor.total(tier) - 1}
    with pytest.raises(OutOfTierMemory) as info:
        check_manual_floor(floor, capacities, cfg, machine=frozenset({tier}))
    message = str(info.value)
    assert f"{tier.capacity_key} is not set" in message
    assert f"raise {tier.capacity_key}" not in message
    if tier is Tier.DISK:
        assert "is free at offload_path" in message and str(tmp_path) in message
    else:
        assert "of RAM" in message and "offload_optimizer='disk'" in message
    # the same capacity given by the key: the key is what to raise
    with pytest.raises(OutOfTierMemory, match=f"raise {tier.capacity_key} to at least"):
        check_manual_floor(floor, capacities, cfg)


def test_the_steps_chunk_buffers_are_a_whole_segment_not_one_parameter(tmp_path):
    """A block's one param group (its segment) is 3x its largest parameter, and the
    step's chunk (under optimizer_chunk_size) is the whole segment: a floor that sized
    the chunk by the largest parameter let a host budget 8 MiB short through, which
    then failed in the first step ('swap blocks.0 grad'). Now refused at offload(),
    and a budget at the floor trains."""

    def make():
        torch.manual_seed(0)
        model = GPT(vocab=256, width=256, depth=2, heads=4, ctx=16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    model, optimizer = make()
    blocks = model.blocks[0]
    segment = sum(p.numel() for p in blocks.parameters())
    assert segment > 3 * max(p.numel() for p in blocks.parameters())
    cfg = disk_config(tmp_path)
    floor = floor_of(model, optimizer, cfg)
    chunks = dict(floor.parts[Tier.HOST])["the optimizer step's chunk buffers"]
    assert chunks == segment * (4 + 8 + 4)  # fp32 master, Adam's two states, gradient
    need = floor.total(Tier.HOST)
    with pytest.raises(OutOfTierMemory, match="chunk buffers"):
        hetstore.offload(model, optimizer, disk_config(tmp_path, offload_cpu_size=need - 4096))
    model, optimizer = make()
    model, optimizer = hetstore.offload(
        model, optimizer, disk_config(tmp_path, offload_cpu_size=need + (64 << 10))
    )
    x, y = batches(1, vocab=256)[0]
    for _ in range(2):
        model(x, y).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert hetstore.memory_stats(model)["host"]["peak"] <= need + (64 << 10)
    hetstore.release(model)


def test_two_param_groups_make_two_chunk_sets_at_least(tmp_path):
    """Decay and no-decay groups: each unit's step chunks each group's segment apart, so
    a block whose groups each fit one chunk pipelines two buffer sets, not one (the
    floor had counted trainable / chunk, one set: short by a whole set)."""

    def make():
        torch.manual_seed(0)
        model = GPT(vocab=256, width=256, depth=2, heads=4, ctx=16)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups, lr=1e-3, fused=True)

    model, optimizer = make()
    cfg = disk_config(tmp_path)
    floor = floor_of(model, optimizer, cfg)
    block = [p for p in model.blocks[0].parameters() if p.dim() >= 2]
    longest = sum(p.numel() for p in block)
    chunks = dict(floor.parts[Tier.HOST])["the optimizer step's chunk buffers"]
    assert chunks == 2 * longest * (4 + 8 + 4)  # two sets of the decay segment's chunk
    need = floor.total(Tier.HOST)
    model, optimizer = make()
    model, optimizer = hetstore.offload(
        model, optimizer, disk_config(tmp_path, offload_cpu_size=need + (64 << 10))
    )
    for x, y in batches(2, vocab=256):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert hetstore.memory_stats(model)["host"]["peak"] >= need  # never above what is held
    hetstore.release(model)
