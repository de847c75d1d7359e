"""On a CPU device, a step taken in backward reads its unit's master from the unit's
device copy, lent to it at the end of the unit's backward, instead of reading the same
fp32 values back from disk (``Unit.lend_device_copy``, ``LentMasters.lend``).

Reference: the same offloaded model with lending switched off (``Unit.lends_device_copy``
patched to False), compared with ``==`` on losses and ``torch.equal`` on weights: the
step reads the same values from memory instead of disk, so anything but bitwise equality
is a bug. The disk traffic must drop by exactly the masters not read, and the lent
copies must be counted on the host tier, bounded, and all given back.
"""

from __future__ import annotations

import pytest

import hetstore
from hetstore import OffloadConfig
from hetstore.footprints import LENT_MASTERS
from hetstore.optim import borrowed
from tests.models.gpt import batches
from tests.optim.helpers import assert_bitwise, fresh, train, without_lending
from tests.optim.helpers import config as step_ahead_config

LENT = "lent master "


def offloaded(path, consume: bool, **kwargs):
    model, opt = fresh()
    overlap = not consume  # the step in backward, or the speculation beside it
    config = step_ahead_config(path, overlap, "cpu", step_in_backward=consume, **kwargs)
    return hetstore.offload(model, opt, config)


def watch_lent(model) -> dict:
    """Record, at every change of the host tier, how many lent masters it holds and
    whose they are."""
    account = hetstore.state_of(model).tiers.host.account
    seen = {"most": 0, "names": set()}

    def observe():
        lent = [label for label, _ in account.holders(10**6) if label.startswith(LENT)]
        seen["most"] = max(seen["most"], len(lent))
        seen["names"].update(label[len(LENT) :] for label in lent)

    account.observer = observe
    return seen


def disk_read(model) -> int:
    return hetstore.state_of(model).tiers.disk.stats()["bytes_read"]


def trained(path, consume: bool, data, lend: bool, monkeypatch, **kwargs):
    with monkeypatch.context() as patch:
        if not lend:
            without_lending(patch)
        model, opt = offloaded(path, consume, **kwargs)
        seen = watch_lent(model)
        before = disk_read(model)
        losses = train(model, opt, data, **({} if consume else {"wait_worker": True}))
        read = disk_read(model) - before
    return model, opt, losses, read, seen


@pytest.mark.parametrize("consume", [True, False], ids=["step_in_backward", "overlap_step"])
def test_the_master_comes_from_the_lent_copy_bitwise_and_is_not_read_from_disk(
    tmp_path, monkeypatch, consume
):
    data = batches(3, vocab=64)
    ref, _, ref_losses, ref_read, ref_seen = trained(
        tmp_path / "ref", consume, data, False, monkeypatch
    )
    model, opt, losses, read, seen = trained(tmp_path / "lent", consume, data, True, monkeypatch)
    assert losses == ref_losses
    assert_bitwise(model, ref)
    stats = opt.speculation_stats
    assert stats["rolled_back"] == 0 and stats["not_started"] == 0
    lent = stats["master_from_memory"]
    assert lent > 0 and ref_seen["most"] == 0
    # the blocks are alike: each lent step read one block's master less from disk
    runtime = hetstore.state_of(model).runtime
    blocks = [u for u in runtime.units if u is not runtime.root and u.trainable_numel]
    assert {u.master_numel for u in blocks} == {blocks[0].master_numel}
    assert ref_read - read == lent * blocks[0].master_numel * 4
    # counted on the host while lent, never the root's, at most LENT_MASTERS at once,
    # and all given back
    assert 0 < seen["most"] <= LENT_MASTERS
    assert runtime.root.name not in seen["names"]
    holders = hetstore.state_of(model).tiers.host.account.holders(10**6)
    assert not [label for label, _ in holders if label.startswith(LENT)]


def test_a_clip_that_bites_rolls_back_to_the_master_on_disk(tmp_path, monkeypatch):
    """overlap_step with a clip that scales the gradients: the speculations that read a
    lent master are discarded and the units stepped again from disk, bitwise as without
    lending (and as without any step ahead)."""
    data = batches(3, vocab=64)
    kwargs = {"clip": 1e-3}
    with monkeypatch.context() as patch:
        without_lending(patch)
        ref, ref_opt = hetstore.offload(*fresh(), step_ahead_config(tmp_path / "ref", False))
        ref_losses = train(ref, ref_opt, data, **kwargs)
    model, opt = offloaded(tmp_path / "lent", consume=False)
    losses = train(model, opt, data, wait_worker=True, **kwargs)
    assert losses == ref_losses
    assert_bitwise(model, ref)
    stats = opt.speculation_stats
    assert stats["master_from_memory"] > 0 and stats["rolled_back"] > 0


def test_no_more_than_the_cap_are_lent_and_none_without_host_room(tmp_path, monkeypatch):
    data = batches(2, vocab=64)
    monkeypatch.setattr(borrowed, "LENT_MASTERS", 1)
    model, opt, _, _, seen = trained(tmp_path / "one", True, data, True, monkeypatch)
    assert seen["most"] == 1
    # the host one byte short of a block's copy beside what the rest of backward will
    # still allocate, at each lend: the step reads the master from disk, and trains
    lend = borrowed.LentMasters.lend

    def short_of_room(self, job, lent_now):
        host = job.unit.tiers.host.account
        room = host.current + self._worker.unmade_bytes() + job.unit.device_bytes
        host.capacity = room - 1
        try:
            return lend(self, job, lent_now)
        finally:
            host.capacity = None

    monkeypatch.setattr(borrowed, "LENT_MASTERS", 3)
    monkeypatch.setattr(borrowed.LentMasters, "lend", short_of_room)
    model, opt, losses, _, seen = trained(tmp_path / "tight", True, data, True, monkeypatch)
    ref, _, ref_losses, _, _ = trained(tmp_path / "ref", True, data, False, monkeypatch)
    stats = opt.speculation_stats
    assert stats["master_from_memory"] == 0 and seen["most"] == 0
    assert stats["committed"] == 2 * len(opt.step_ahead.unit_steps) and stats["not_started"] == 0
    assert losses == ref_losses
    assert_bitwise(model, ref)


def test_the_plan_counts_the_lent_copies_beside_the_host_peak(tmp_path):
    def plan(**kwargs):
        model, opt = fresh()
        config = OffloadConfig(
            offload_param="disk",
            offload_optimizer="disk",
            offload_path=str(tmp_path),
            enable_pinned_mem=False,
            device="cpu",
            **kwargs,
        )
        return hetstore.plan(model, batches(1, vocab=64)[0], config, optimizer=opt, probe=False)

    fp32 = plan(step_in_backward=True)
    block = max(u.param_bytes for u in fp32.units if u.name != "root")
    assert fp32.estimate.host_lent == LENT_MASTERS * block
    assert "lent to them" in str(fp32)
    # the step after backward reads the master from disk; a bf16 home is not the master
    assert plan(overlap_step=False).estimate.host_lent == 0
    assert plan(compute_dtype="bf16", step_in_backward=True).estimate.host_lent == 0
