"""Disk offload gives the same numbers as plain PyTorch, and survives a full disk.

Tolerances as in test_host_offload (TIGHT: fp32 round-off; the streamed step runs the
same fused kernel on chunks that start at multiples of 2048 elements of each segment,
so every element sees the same arithmetic as the in-memory step).
"""

from __future__ import annotations

import os

import pytest
import torch

import hetstore
from hetstore.errors import OutOfTierMemory
from tests.disk_helpers import small_tmpfs
from tests.models.cnn import ResNet, image_batches
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, disk_config, pair, run, train_both

TIERS = ("none", "cpu", "disk")


@pytest.mark.parametrize("param", TIERS)
@pytest.mark.parametrize("optim", TIERS)
def test_gpt_fp32_parity_every_placement(tmp_path, param, optim):
    cfg = disk_config(tmp_path, param, optim)
    ref, mine, (ref_losses, _), (losses, _) = train_both(GPT, batches(5), cfg)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    if "disk" in (param, optim):
        assert hetstore.memory_stats(mine)["disk"]["peak"] > 0


def wide_gpt():
    return GPT(vocab=96, width=64, depth=3, heads=4, ctx=16)


def two_groups(params):
    """Decay / no-decay groups: two optimizer segments per unit."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        fused=True,
    )


@pytest.mark.parametrize("grad_tier", ["disk", "cpu"])
def test_groups_accumulation_and_clipping(tmp_path, grad_tier):
    cfg = disk_config(tmp_path, offload_grad=grad_tier)
    ref, mine, (ref_losses, ref_norms), (losses, norms) = train_both(
        wide_gpt, batches(8, vocab=96), cfg, make_opt=two_groups, accumulate=2, clip=0.5
    )
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert norms == ref_norms  # same per-parameter norms, summed in the same order
    assert_same_weights(ref, mine)


def test_small_chunks_split_parameters(tmp_path):
    # 16 KiB chunks = 4096 fp32 elements: the 64x192 qkv weight spans several chunks and
    # every segment has several; the step stays exact (chunks start at multiples of 2048)
    cfg = disk_config(tmp_path, optimizer_chunk_size="16KB")
    ref, mine, (ref_losses, _), (losses, _) = train_both(
        wide_gpt, batches(6, vocab=96), cfg, make_opt=two_groups, accumulate=2
    )
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_clip_norm_of_parameters_split_across_chunks(tmp_path):
    """A parameter split across chunks gets its norm from the chunks' norms: equal to
    torch's up to summation order (1e-6 relative), not bitwise -- so the parity tests
    above clip with whole parameters per chunk."""
    cfg = disk_config(tmp_path, optimizer_chunk_size="16KB")
    ref, mine = pair(wide_gpt)
    mine, opt = hetstore.offload(mine, two_groups(mine.parameters()), cfg)
    for model in (ref, mine):
        x, y = batches(1, vocab=96)[0]
        model(x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    norm = opt.clip_grad_norm_(1e9)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)


def test_sgd_momentum_on_disk(tmp_path):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, fused=True)

    ref, mine, (ref_losses, _), (losses, _) = train_both(
        GPT, batches(5), disk_config(tmp_path), make_opt=sgd
    )
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_cnn_with_batchnorm_on_disk(tmp_path):
    data = image_batches(4)
    ref, mine, (ref_losses, _), (losses, _) = train_both(ResNet, data, disk_config(tmp_path))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_bf16_disk_equals_bf16_host(tmp_path):
    """Same math, other tier: bf16 compute with states on disk matches states on host."""
    data = batches(4)
    _, host_model = pair(GPT)
    _, disk_model = pair(GPT)
    host_model, host_opt = hetstore.offload(
        host_model,
        adamw(host_model.parameters()),
        disk_config(tmp_path, "cpu", "cpu", compute_dtype="bf16"),
    )
    disk_model, disk_opt = hetstore.offload(
        disk_model, adamw(disk_model.parameters()), disk_config(tmp_path, compute_dtype="bf16")
    )
    host_losses, _ = run(host_model, host_opt, data)
    disk_losses, _ = run(disk_model, disk_opt, data)
    assert host_losses == disk_losses
    assert_same_weights(host_model, disk_model, rtol=0, atol=0)


def test_optimizer_state_dict_matches_torch_and_round_trips(tmp_path):
    ref, mine = pair(GPT)
    ref_opt = adamw(ref.parameters())
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), disk_config(tmp_path))
    run(ref, ref_opt, batches(3))
    run(mine, opt, batches(3))
    ref_sd, sd = ref_opt.state_dict(), opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for index, ref_state in ref_sd["state"].items():
        for key, value in ref_state.items():
            torch.testing.assert_close(sd["state"][index][key], value, **TIGHT)

    # load the plain optimizer's state into a fresh disk-offloaded copy: training goes on
    # identically
    _, other = pair(GPT)
    other.load_state_dict(ref.state_dict())
    other, other_opt = hetstore.offload(other, adamw(other.parameters()), disk_config(tmp_path))
    other_opt.load_state_dict(ref_sd)
    more = batches(2, seed=7)
    ref_losses, _ = run(ref, ref_opt, more)
    losses, _ = run(other, other_opt, more)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, other)


def test_disk_states_leave_no_files_after_close(tmp_path):
    _, mine = pair(GPT)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), disk_config(tmp_path))
    run(mine, opt, batches(2))
    tier_dir = hetstore.state_of(mine).tiers.disk.path
    assert os.listdir(tier_dir)
    hetstore.state_of(mine).tiers.close()
    assert not os.path.exists(tier_dir)


def root_heavy_gpt():
    # the root unit (embeddings) is bigger than a block, so its shadow needs new space
    # after the blocks' shadows have been recycled (see test below)
    return GPT(vocab=1024, width=32, depth=3, heads=4, ctx=16)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("in_forward", [False, "auto"], ids=["step-in-step", "step-in-forward"])
def test_disk_full_mid_step_raises_then_step_again_completes(tmp_path, in_forward):
    """The file system fills between offload() and the step. Stepped in
    ``optimizer.step()``: the blocks are stepped, the root unit's new state cannot be
    allocated. With the steps run on into the next forward (the default): a block handed
    to the worker holds its shadow, so a later unit's step finds the disk full; each
    block is then either stepped or untouched. Either way the error names the tier, the
    path and what to do; the root's state is untouched; after space is freed, step()
    again finishes and training matches plain PyTorch exactly."""
    data = batches(3, vocab=1024)
    with small_tmpfs(tmp_path, "8M") as mnt:
        ref, mine = pair(root_heavy_gpt)
        ref_opt = adamw(ref.parameters())
        cfg = disk_config(mnt, offload_disk_size="4MB", step_in_forward=in_forward)
        mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
        root = hetstore.state_of(mine).runtime.root
        block_shadow = 3 * 53248  # master + 2 moments of a block, page-rounded
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (free_bytes(mnt) - block_shadow - 16384))
        x, y = data[0]
        for model in (ref, mine):
            model(x, y).backward()
        ref_opt.step()
        root_before = root.master_copy().clone()
        blocks = hetstore.state_of(mine).runtime.block_units
        blocks_before = [block.master_copy().clone() for block in blocks]
        with pytest.raises(OutOfTierMemory) as info:
            opt.step()
        message = str(info.value)
        assert info.value.tier == "disk" and "full" in message and str(mnt) in message
        assert "offload_path" in message
        notes = " ".join(getattr(info.value, "__notes__", []))
        if in_forward:  # what the steps handed to the worker hold, and the way out
            assert "into the next forward" in notes and "step_in_forward=False" in notes
        else:
            assert not notes
        torch.testing.assert_close(root.master_copy(), root_before, rtol=0, atol=0)
        ref_params = dict(ref.named_parameters())
        stepped = 0
        for block, before in zip(blocks, blocks_before, strict=True):
            master = block.master_copy()
            if in_forward and torch.equal(master, before):
                continue  # its step was to come after the failure
            stepped += 1
            for e in block.entries:
                got = master[e.offset : e.offset + e.numel].view(e.shape)
                torch.testing.assert_close(got, ref_params[e.name].detach(), **TIGHT)
        if not in_forward:
            assert stepped == len(blocks)  # every block before the root, in order
        assert stepped >= 1
        os.remove(filler)
        opt.step()  # finishes the interrupted step: the root only
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_losses, _ = run(ref, ref_opt, data[1:])
        losses, _ = run(mine, opt, data[1:])
        torch.testing.assert_close(losses, ref_losses, **TIGHT)
        assert_same_weights(ref, mine)
        hetstore.state_of(mine).tiers.close()


def test_disk_capacity_smaller_than_states_refused_before_training(tmp_path):
    _, mine = pair(GPT)
    with pytest.raises(OutOfTierMemory) as info:
        hetstore.offload(
            mine, adamw(mine.parameters()), disk_config(tmp_path, offload_disk_size="64KB")
        )
    assert info.value.tier == "disk" and "offload_disk_size" in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing left behind


@pytest.mark.parametrize("depth", [1, 2])
def test_disk_reads_are_prefetched_in_forward_and_backward(tmp_path, depth):
    """After the first step recorded the order, every block's parameters were already
    being read when its forward or backward asked for them (only the root, fetched at
    the very start, is read on demand)."""
    _, mine = pair(GPT)
    cfg = disk_config(tmp_path, prefetch_depth=depth)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    data = batches(3)
    run(mine, opt, data[:1])
    stager = hetstore.state_of(mine).runtime.root.param_stager
    stager.prefetched = stager.unprefetched = 0
    run(mine, opt, data[1:])
    blocks = len(hetstore.state_of(mine).runtime.block_units)
    assert stager.prefetched == 2 * blocks * 2  # forward + backward, two steps
    assert stager.unprefetched == 2  # the root, once per step


CRASHING_RUN = """
import os, signal, sys, torch, hetstore
from tests.models.gpt import GPT, batches
model = GPT()
cfg = hetstore.OffloadConfig(offload_param="disk", offload_optimizer="disk",
                             offload_path=sys.argv[1], enable_pinned_mem=False, device="cpu")
model, opt = hetstore.offload(model, torch.optim.AdamW(model.parameters()), cfg)
x, y = batches(1)[0]
model(x, y).backward()
opt.step()
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs
"""


def test_a_killed_runs_swap_files_are_removed_by_the_next_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=root)
    assert proc.returncode == -9
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith("hetstore-")]
    assert len(leftovers) == 1 and len(os.listdir(tmp_path / leftovers[0])) > 2
    _, mine = pair(GPT)
    mine, _ = hetstore.offload(mine, adamw(mine.parameters()), disk_config(tmp_path))
    remaining = [p for p in os.listdir(tmp_path) if p.startswith("hetstore-")]
    assert remaining == [os.path.basename(hetstore.state_of(mine).tiers.disk.path)]
