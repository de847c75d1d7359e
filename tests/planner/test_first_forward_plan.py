"""auto_offload with budgets only (no example_inputs), as the seed's config is written: the
plan made at offload() places the model states, the first training forward traces its
batch on meta tensors and places the activations (moving parameters off the device when
they must make room), and a later larger batch is re-planned. Training matches plain
PyTorch and the device peak stays within the budget."""

from __future__ import annotations

import warnings

import pytest
import torch

import hetstore
from hetstore import OffloadConfig, OutOfDeviceMemory, OutOfTierMemory, Tier
from hetstore.planner import cost
from hetstore.planner.tracer import model_data_trace
from hetstore.tiers.flat import DiskArray
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, pair, run
from tests.planner.helpers import auto_config


def model():
    """Blocks hold most of the states (the root unit never leaves the device)."""
    return GPT(width=64, depth=8)


def budgets_only(tmp_path, **kw):
    """auto_offload and budgets, as the seed's config is written (no example_inputs
    anywhere below). activation_min_bytes=0: this model's saved tensors are all far below
    the 1 MiB default (sized for real models), which would keep every one on the device."""
    return auto_config(tmp_path, **kw)


def states_bytes() -> int:
    return model_data_trace(model(), OffloadConfig(device="cpu"), None).state_bytes


@pytest.mark.parametrize("fraction", [2.0, 0.5, 0.2])
def test_budgets_only_train_like_plain_pytorch_within_the_budget(tmp_path, fraction):
    data = batches(3, batch=8)
    budget = int(states_bytes() * fraction)
    ref, mine = pair(model)
    cfg = budgets_only(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    runtime = hetstore.state_of(mine).runtime
    assert runtime.trace.batch_shapes == ()  # nothing traced yet: no batch was given
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    peak = hetstore.memory_stats(mine)["device"]["peak"]
    print(f"\n{fraction:.0%} of the states: budget {budget}, device peak {peak}\n{runtime.plan}")
    assert peak <= budget
    # the plan in effect was made for the batch that ran
    assert runtime.trace.batch_shapes == ((8, 16), (8, 16))
    assert sum(u.saved_bytes for u in runtime.trace.units) > 0
    planned = [w for w in caught if "planned the placement" in str(w.message)]
    if fraction < 1.0:
        assert planned, "the first batch should have moved activations off the device"
        assert any(u.choice.activations != Tier.DEVICE for u in runtime.plan.units)


def test_the_first_batch_moves_parameters_off_the_device_when_activations_need_the_room(
    tmp_path, monkeypatch
):
    """The plan made without a batch kept every block's parameters on the device; the
    first batch's activations do not fit beside them, so some parameters move to host
    (copied once, bit for bit) and training still matches plain PyTorch.

    Planned as for an accelerator, where fetching a parameter kept on host costs a copy:
    on a CPU device a host home is used in place, costs nothing to fetch, and the plan
    made without a batch already moves parameters there when it frees device room."""
    monkeypatch.setattr(cost, "_fetched_in_place", lambda choice, machine: False)
    data = batches(2, batch=64)
    states = states_bytes()
    ref, mine = pair(model)
    # every parameter (fp32: a quarter of the states) fits with room to spare, so the
    # plan made without a batch keeps them all on the device; with batch 64's activations
    # offloaded, the working set beside them needs about 34% of the states
    budget = int(states * 0.3)
    cfg = budgets_only(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    runtime = hetstore.state_of(mine).runtime
    before = {u.name: u.choice.param for u in runtime.plan.units}
    assert set(before.values()) == {Tier.DEVICE}
    with pytest.warns(UserWarning, match=r"planned the placement \(.*params: device -> host"):
        losses, _ = run(mine, opt, data)
    moved = [u for u in runtime.units if u.placement.param is Tier.HOST]
    assert moved and all(runtime.plan.choice_of(u.name).param is Tier.HOST for u in moved)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget


def test_a_later_larger_batch_is_replanned_within_the_budget(tmp_path):
    small = batches(2, batch=2)
    big = batches(2, batch=16, seed=1)
    budget = states_bytes() // 2
    ref, mine = pair(model)
    cfg = budgets_only(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    runtime = hetstore.state_of(mine).runtime
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, _ = run(mine, opt, small)
    assert runtime.trace.batch_shapes == ((2, 16), (2, 16))
    with pytest.warns(UserWarning, match=r"8.00x the traced .* re-planned the placement"):
        more, _ = run(mine, opt, big)
    ref_opt = adamw(ref.parameters())
    ref_losses = run(ref, ref_opt, small)[0] + run(ref, ref_opt, big)[0]
    torch.testing.assert_close(losses + more, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget


def test_a_batch_nothing_fits_is_refused_before_its_forward_with_the_capacity(tmp_path):
    """States fit the budget, the first batch's activations cannot even with everything
    offloaded: refused before the forward allocates anything, naming the device memory
    that would hold it; a smaller batch then trains."""
    budget = states_bytes() // 8
    ref, mine = pair(model)
    cfg = budgets_only(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    huge = batches(1, batch=512)[0]
    with pytest.raises(OutOfDeviceMemory, match=r"max_device_memory\). Lower the batch size") as e:
        mine(*huge)
    assert e.value.requested > budget
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget
    data = batches(2, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)


def test_states_that_cannot_fit_are_refused_at_offload(tmp_path):
    _, mine = pair(model)
    with pytest.raises(OutOfDeviceMemory, match="device: needs at least"):
        hetstore.offload(
            mine, adamw(mine.parameters()), budgets_only(tmp_path, max_device_memory=4096)
        )
    assert hetstore.state_of(mine) is None


def test_example_inputs_without_the_targets_are_traced_again_at_the_first_training_step(
    tmp_path,
):
    """``example_inputs`` often hold the tokens only, while a training forward also
    passes the targets: the loss's saved tensors (the logits cross-entropy keeps for its
    backward) were not in the trace. A plan accepted on that trace ran out of device
    memory at the first step (the demo's shape at 60 MB: 'requested 2.00 MiB for
    activations'). The forward with more inputs than the trace saw is traced again and
    planned for, before it allocates: training matches plain PyTorch within the budget."""
    torch.manual_seed(0)
    ref = GPT(width=256, depth=8, vocab=512, ctx=128)
    mine = GPT(width=256, depth=8, vocab=512, ctx=128)
    mine.load_state_dict(ref.state_dict())
    data = batches(2, vocab=512, batch=8, ctx=128)
    budget = 60 << 20
    cfg = OffloadConfig(
        auto_offload=True,
        device="cpu",
        offload_path=str(tmp_path),
        enable_pinned_mem=False,
        max_device_memory=budget,  # activation_min_bytes: the 1 MiB default
    )
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, example_inputs=data[0][0])
    runtime = hetstore.state_of(mine).runtime
    assert runtime.trace.batch_shapes == ((8, 128),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-plan may or may not move anything
        losses, _ = run(mine, opt, data[:1])
    assert runtime.trace.batch_shapes == ((8, 128), (8, 128))
    # the first step also ran the re-plan's compute probe, counted in the device budget
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget
    hetstore.state_of(mine).tiers.reset_peaks()
    more, _ = run(mine, opt, data[1:])
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses + more, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    peak = hetstore.memory_stats(mine)["device"]["peak"]  # a training step's
    assert peak <= budget
    assert peak <= runtime.plan.estimate.device  # the plan in effect counted the loss


def tight_host(tmp_path):
    """Budgets only, the host sized to the model states: the plan made at offload() keeps
    every optimizer state on host (nothing else is known yet)."""
    states = states_bytes()
    return budgets_only(
        tmp_path, max_device_memory=int(states * 0.2), offload_cpu_size=int(states * 1.0)
    )


@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_first_batch_moves_optimizer_states_to_disk_when_activations_need_the_host(
    tmp_path, clip
):
    """The plan made without a batch put every optimizer state on host; batch 16's
    activations, offloaded, need host room for their disk staging, so the first batch
    moves some units' master, gradients and states to disk (before any step: written
    once) and training matches plain PyTorch within every budget, with a clip that bites
    (0.05) or none."""
    data = batches(3, batch=16)
    ref, mine = pair(model)
    cfg = tight_host(tmp_path)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    runtime = hetstore.state_of(mine).runtime
    assert {u.choice.optimizer for u in runtime.plan.units} == {Tier.HOST}
    with pytest.warns(
        UserWarning, match=r"planned the placement \(.*optimizer states: host -> disk"
    ):
        losses, norms = run(mine, opt, data, clip=clip)
    moved = [u for u in runtime.units if u.placement.optimizer is Tier.DISK]
    assert moved and all(runtime.plan.choice_of(u.name).optimizer is Tier.DISK for u in moved)
    assert all(isinstance(u.master, DiskArray) and isinstance(u.grad, DiskArray) for u in moved)
    ref_opt = adamw(ref.parameters())
    ref_losses, ref_norms = run(ref, ref_opt, data, clip=clip)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    torch.testing.assert_close(norms, ref_norms, **TIGHT)
    assert_same_weights(ref, mine)
    stats = hetstore.memory_stats(mine)
    for tier in ("device", "host"):
        assert stats[tier]["peak"] <= stats[tier]["capacity"], tier
    # the states left the host: its peak is the plan's, which counts them on disk, within
    # 5% (every saved tensor takes whole 4 KiB pages, which the cost model does not
    # count: this model's LayerNorm statistics are 512 bytes each)
    assert 0.9 * runtime.plan.estimate.host <= stats["host"]["peak"]
    assert stats["host"]["peak"] <= 1.05 * runtime.plan.estimate.host
    assert stats["disk"]["current"] >= sum(u.master.nbytes for u in moved)
    # torch's format: what a plain optimizer would hold
    assert_same_optimizer_state(ref_opt.state_dict(), opt.state_dict())


def assert_same_optimizer_state(ref: dict, mine: dict) -> None:
    """Within TIGHT (tests/optim/test_step_ahead.py's is bit for bit, between two hetstore
    runs; against plain PyTorch's per-parameter fused step the flat one differs in the
    last bits)."""
    assert ref["state"].keys() == mine["state"].keys()
    for index, state in ref["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                mine["state"][index][key], value, **TIGHT, msg=f"{index} {key}"
            )


def test_states_loaded_before_the_first_batch_move_to_disk_with_their_values(tmp_path):
    """A resume with budgets only: a checkpoint is loaded right after offload(), then
    the first batch moves states to disk; the loaded moments and step counts go with
    them, so training goes on as the plain run does."""
    first, rest = batches(2, batch=16), batches(2, batch=16, seed=1)
    ref, mine = pair(model)
    ref_opt = adamw(ref.parameters())
    run(ref, ref_opt, first)
    mine.load_state_dict(ref.state_dict())
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), tight_host(tmp_path))
    opt.load_state_dict(ref_opt.state_dict())
    with pytest.warns(UserWarning, match="optimizer states: host -> disk"):
        losses, _ = run(mine, opt, rest)
    ref_losses, _ = run(ref, ref_opt, rest)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert_same_optimizer_state(ref_opt.state_dict(), opt.state_dict())


def test_a_first_batch_that_fits_no_placement_is_refused_before_its_forward(tmp_path):
    """Batch 64's activations need more host room for their disk staging than the host
    has even with every optimizer state on disk: refused before the forward, naming the
    capacity and the batch size (example_inputs would not help: nothing fits)."""
    _, mine = pair(model)
    mine, _ = hetstore.offload(mine, adamw(mine.parameters()), tight_host(tmp_path))
    runtime = hetstore.state_of(mine).runtime
    with pytest.raises(OutOfTierMemory, match=r"Lower the batch size or raise offload_cpu_size$"):
        mine(*batches(1, batch=64)[0])
    # refused before anything moved: the states are where offload() built them
    assert all(u.placement.optimizer is Tier.HOST for u in runtime.units)


def test_a_checkpoint_of_moved_states_resumes_bitwise_in_a_run_that_moves_them_again(tmp_path):
    """Checkpoints are placement-independent across the move too: a run whose first
    batch moved states to disk saves; a fresh budgets-only run loads it before its own
    first batch (its states on host, holding the loaded values), moves them at that
    batch, and trains on exactly as the saving run does."""
    first, more = batches(2, batch=16), batches(2, batch=16, seed=3)
    _, saving = pair(model)
    saving, saving_opt = hetstore.offload(
        saving, adamw(saving.parameters()), tight_host(tmp_path / "a")
    )
    run(saving, saving_opt, first)
    hetstore.save(tmp_path / "checkpoint", saving, saving_opt)
    expected, _ = run(saving, saving_opt, more)
    _, resumed = pair(model, seed=1)  # other initial weights: the checkpoint replaces them
    resumed, resumed_opt = hetstore.offload(
        resumed, adamw(resumed.parameters()), tight_host(tmp_path / "b")
    )
    hetstore.load(tmp_path / "checkpoint", resumed, resumed_opt)
    with pytest.warns(UserWarning, match="optimizer states: host -> disk"):
        losses, _ = run(resumed, resumed_opt, more)
    assert losses == expected
    assert_same_weights(saving, resumed, rtol=0, atol=0)


def test_a_move_that_fails_part_way_leaves_the_unit_as_it_was(tmp_path, monkeypatch):
    """The disk fills while the first batch moves states: the unit whose states could
    not be written keeps its master, gradients and states in host memory, every account
    is as before it started, the forward is refused with the error, and the next try
    moves and trains like plain PyTorch."""
    from hetstore.tiers.disk import DiskTier

    data = batches(2, batch=16)
    ref, mine = pair(model)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), tight_host(tmp_path))
    runtime = hetstore.state_of(mine).runtime
    before = {t: s["current"] for t, s in hetstore.memory_stats(mine).items()}
    allocate = DiskTier.allocate_flat

    def disk_full(self, numel, dtype, label):
        # the master, the gradients and the first moment were made: the second fails
        if label.startswith("exp_avg_sq"):
            raise OutOfTierMemory("disk full (injected)", tier="disk", requested=1, capacity=0)
        return allocate(self, numel, dtype, label)

    monkeypatch.setattr(DiskTier, "allocate_flat", disk_full)
    with pytest.raises(OutOfTierMemory, match="injected"):
        mine(*data[0])
    assert all(u.placement.optimizer is Tier.HOST for u in runtime.units)
    assert all(not isinstance(u.master, DiskArray) for u in runtime.units)
    after = {t: s["current"] for t, s in hetstore.memory_stats(mine).items()}
    assert after == before
    monkeypatch.setattr(DiskTier, "allocate_flat", allocate)
    with pytest.warns(UserWarning, match="optimizer states: host -> disk"):
        losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_states_move_only_at_the_first_batch_of_a_budgets_only_run(tmp_path):
    """A later batch with tensors the trace never saw (example_inputs without the
    targets) is planned again, but optimizer states built on host stay there: by then
    they may have stepped, or hold a micro-batch's gradients."""
    _, mine = pair(model)
    x, y = batches(1, batch=16)[0]
    mine, opt = hetstore.offload(
        mine, adamw(mine.parameters()), tight_host(tmp_path), example_inputs=(x,)
    )
    runtime = hetstore.state_of(mine).runtime
    built = {u.name: u.placement.optimizer for u in runtime.units}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run(mine, opt, [(x, y)])
        except OutOfTierMemory as refused:  # a clear refusal is allowed; a move is not
            assert "example_inputs" in str(refused)
    assert {u.name: u.placement.optimizer for u in runtime.units} == built
    assert not [w for w in caught if "optimizer states" in str(w.message)]
