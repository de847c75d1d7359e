"""Units stepped ahead during backward (``overlap_step``) train exactly like the ordinary
step: bit for bit, on the commit path and on the rollback path.

Reference: the same offloaded model with ``overlap_step=False`` (the ordinary streamed
step), compared with ``==`` on losses and ``torch.equal`` on weights: the speculative
step runs the same chunks through the same fused kernel, so anything but bitwise
equality is a bug. Plain PyTorch with torch's fused AdamW as well, TIGHT (fp32
round-off), as for every disk test.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.models.gpt import batches
from tests.optim.helpers import (
    assert_bitwise,
    assert_same_optimizer_state,
    config,
    fresh,
    train,
    train_both,
)
from tests.parity import TIGHT, adamw, assert_same_weights


def offloaded(tmp_path, overlap: bool, make_opt=adamw, grad="cpu", **kwargs):
    model, opt = fresh(make_opt)
    where = tmp_path / ("on" if overlap else "off")
    return hetstore.offload(model, opt, config(where, overlap, grad, **kwargs))


def both(
    tmp_path, steps=3, make_opt=adamw, grad="cpu", config_kwargs=None, setup=None, **train_kwargs
):
    """Train overlapped and not on the same batches; check they agree bit for bit."""
    data = batches(steps * train_kwargs.get("accumulate", 1), vocab=64)

    def build(overlap: bool):
        model, opt = offloaded(tmp_path, overlap, make_opt, grad, **(config_kwargs or {}))
        if setup is not None:
            setup(model, opt)
        return model, opt

    (on, on_opt, on_losses), (off, off_opt, _) = train_both(build, data, **train_kwargs)
    assert_same_optimizer_state(on_opt, off_opt)
    assert off_opt.speculation_stats is None
    # every shadow committed or discarded went back: the tiers hold what they held (with
    # Adam's states, made in the tiers by both; SGD's first momentum is torch's own in the
    # ordinary step, a shadow in the host tier when stepped ahead)
    if make_opt is adamw:
        assert (
            hetstore.memory_stats(on)["host"]["current"]
            == hetstore.memory_stats(off)["host"]["current"]
        )
    return on, on_opt, on_losses, data


def block_units(model):
    return len(hetstore.state_of(model).runtime.units) - 1  # the root holds the embeddings


def ahead_units(model) -> int:
    """Units a step ahead takes: every one on disk."""
    return len(hetstore.state_of(model).runtime.units)


# disk units with gradients in memory or on disk (host-memory units are never stepped
# ahead: test_which_units_overlap_step_steps_ahead)
GRADS = pytest.mark.parametrize("grad", ["cpu", "disk"])
PLACES = pytest.mark.parametrize("grad", ["cpu"])


@GRADS
def test_stepped_ahead_units_commit_and_train_like_plain_pytorch(tmp_path, grad):
    model, opt, losses, data = both(tmp_path, steps=3, grad=grad)
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert stats["started"] == stats["committed"] == 3 * units
    assert stats["rolled_back"] == stats["cancelled"] == 0
    ref, ref_opt = fresh()
    assert train(ref, ref_opt, data) == pytest.approx(losses, rel=1e-6)
    assert_same_weights(ref, model, **TIGHT)


@GRADS
def test_clipping_that_does_not_bite_commits(tmp_path, grad):
    _, opt, _, _ = both(tmp_path, clip=1e9, grad=grad)
    assert opt.speculation_stats["rolled_back"] == 0
    assert opt.speculation_stats["committed"] > 0


@GRADS
def test_clipping_that_bites_rolls_back_and_steps_again(tmp_path, grad):
    """The first step's speculations roll back; the clip bit, so the next steps' would
    too: they are held back (the ordinary step runs, with no wasted traffic)."""
    model, opt, _, _ = both(tmp_path, clip=1e-3, grad=grad)
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert stats["committed"] == 0 and stats["rolled_back"] == stats["started"] == units
    assert stats["held_back"] == 2 * units


@GRADS
def test_speculation_resumes_after_a_step_whose_clip_did_not_bite(tmp_path, grad):
    """Clip at 1e-3 (bites), 1e-3, then 1e9 (does not): step 2 is held back; step 3 is held
    back too (the step before it bit) and speculates again for step 4, which commits."""
    limits = {}

    def setup(model, opt):
        limits[id(opt)] = [1e-3, 1e-3, 1e9, 1e9]

    def clip(model, opt):
        opt.clip_grad_norm_(limits[id(opt)].pop(0))

    model, opt, _, _ = both(tmp_path, steps=4, grad=grad, setup=setup, between=clip)
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert stats["held_back"] == 2 * units
    assert stats["rolled_back"] == units  # step 1
    assert stats["committed"] == units  # step 4


def test_the_clip_reads_no_gradient_back_from_disk(tmp_path):
    """Gradients on disk: from the second step on, clip_grad_norm_ uses the per-parameter
    norms recorded from the gradient stager's buffer in backward, and reads nothing --
    with the step ahead and without it. They are taken in the chunks the scan of the
    disk reads, so the total is the same bits as a run that scans every step, and
    torch's within fp32 round-off (a parameter cut by a chunk border gets the norm of its
    pieces' norms: 1 ulp here)."""
    data = batches(3, vocab=64)
    runs = {}
    for name, overlap in (("overlap", True), ("no overlap", False), ("scan", False)):
        model, opt = offloaded(tmp_path, overlap, grad="disk")
        if name == "scan":
            opt.grad_norms.close()  # the clip reads every step's gradients back
            opt.grad_norms = None
        disk = hetstore.state_of(model).tiers.disk
        totals, read_by_clip = [], []
        for x, y in data:
            model(x, y).backward()
            # (the worker's reads ahead for the steps, started with backward, are not the
            # clip's: on a loaded machine the last of them was still going on here)
            for ahead in opt.step_ahead.read_aheads.records if opt.step_ahead is not None else ():
                ahead.future.result()
            before = disk.stats()["bytes_read"]
            totals.append(opt.clip_grad_norm_(1e-3))
            read_by_clip.append(disk.stats()["bytes_read"] - before)
            opt.step()
            opt.zero_grad()
        runs[name] = (model, totals, read_by_clip)
        units = hetstore.state_of(model).runtime.units
        grad_bytes = sum(u.trainable_numel * 4 for u in units)
        hetstore.release(model)
    scanned, read_scanning = runs["scan"][1:]
    assert min(read_scanning) >= grad_bytes
    for name in ("overlap", "no overlap"):
        _, totals, read = runs[name]
        assert all(torch.equal(a, b) for a, b in zip(totals, scanned, strict=True)), name
        assert read[0] >= grad_bytes and read[1:] == [0, 0], name
    ref, ref_opt = fresh()
    for (x, y), total in zip(data, scanned, strict=True):
        ref(x, y).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        ref_opt.step()
        ref_opt.zero_grad()


@PLACES
def test_a_scheduler_changing_the_lr_every_step(tmp_path, grad):
    """scheduler.step() after optimizer.step(): the next backward already sees the new lr."""
    _, opt, _, _ = both(
        tmp_path,
        steps=4,
        grad=grad,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
    )
    assert opt.speculation_stats["rolled_back"] == 0 < opt.speculation_stats["committed"]


@GRADS
def test_an_lr_changed_between_backward_and_step_rolls_back(tmp_path, grad):
    def halve(model, opt):
        for group in opt.param_groups:
            group["lr"] *= 0.5

    _, opt, _, _ = both(tmp_path, between=halve, grad=grad)
    stats = opt.speculation_stats
    assert stats["committed"] == 0 and stats["rolled_back"] > 0


@PLACES
def test_model_zero_grad_between_backward_and_step_discards(tmp_path, grad):
    """No gradient left: the ordinary step skips every unit, and so must the speculation.
    (Gradients on disk refuse ``model.zero_grad()``: ``p.grad`` cannot be read there.)"""
    _, opt, _, _ = both(tmp_path, grad=grad, between=lambda model, opt: model.zero_grad())
    assert opt.speculation_stats["committed"] == 0


@GRADS
@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulating_four_micro_batches(tmp_path, no_sync, grad):
    """With no_sync around the first three backward passes only the last one speculates;
    without it the first step learns the count (its early speculations are superseded)
    and the later steps speculate once per unit."""
    model, opt, _, _ = both(tmp_path, steps=3, accumulate=4, no_sync=no_sync, grad=grad)
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert stats["committed"] == 3 * units and stats["rolled_back"] == 0
    if no_sync:
        assert stats["started"] == 3 * units and stats["cancelled"] == 0
    else:
        assert stats["cancelled"] == 3 * units  # backward passes 1-3 of the first step
        assert stats["started"] == 6 * units


@PLACES
def test_sgd_with_momentum(tmp_path, grad):
    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01)

    _, opt, _, _ = both(tmp_path, make_opt=sgd, grad=grad)
    assert opt.speculation_stats["rolled_back"] == 0 < opt.speculation_stats["committed"]


@PLACES
def test_an_optimizer_state_load_between_backward_and_step_is_not_overwritten(tmp_path, grad):
    """A speculation made from the states before a load must not be committed over it."""
    donor, donor_opt = offloaded(tmp_path / "donor", False, grad=grad)
    data = batches(2, vocab=64)
    train(donor, donor_opt, data[:1])
    saved = donor_opt.state_dict()

    def load(model, opt):
        opt.load_state_dict(saved)

    _, opt, _, _ = both(tmp_path, steps=2, between=load, grad=grad)
    assert opt.speculation_stats["committed"] == 0


@pytest.mark.parametrize("overlap", ["auto", True, False])
def test_which_units_overlap_step_steps_ahead(tmp_path, overlap):
    """Disk units are stepped ahead unless False; host-memory units never, whatever the
    key (optim.in_memory says why: on a GPU their step runs in the next forward)."""
    for grad in ("host", "cpu"):
        model, opt = fresh()
        cfg = config(tmp_path / f"{grad}{overlap}", True, grad)
        cfg = OffloadConfig(
            **{**{k: getattr(cfg, k) for k in OffloadConfig.keys()}, "overlap_step": overlap}
        )
        model, opt = hetstore.offload(model, opt, cfg)
        x, y = batches(1, vocab=64)[0]
        model(x, y).backward()
        stats = opt.speculation_stats
        if grad == "host" or overlap is False:
            assert stats is None
        else:
            assert stats["started"] == ahead_units(model)
        opt.step()
        hetstore.release(model)


def test_overlap_step_takes_auto_true_or_false_only():
    with pytest.raises(
        hetstore.ConfigError, match="overlap_step='yes': must be 'auto', True or False"
    ):
        OffloadConfig(overlap_step="yes")


def test_host_and_disk_units_in_one_model(tmp_path, monkeypatch):
    """A placement with states on disk for some units and in host memory for others:
    the disk units stepped ahead and committed, the host ones at ``optimizer.step()``,
    bit for bit the ordinary step, and plain PyTorch's within fp32 round-off."""
    import hetstore.api
    from hetstore.planner.cost import UnitChoice

    plan_for = hetstore.api._plan_for

    def alternating(*args, **kwargs):
        trace, plan = plan_for(*args, **kwargs)

        class Mixed:
            def __getattr__(self, name):
                return getattr(plan, name)

            def choice_of(self, name):
                tier = "disk" if name.endswith(("0", "2")) else "cpu"
                return UnitChoice(tier, tier, plan.choice_of(name).activations)

        return trace, Mixed()

    monkeypatch.setattr(hetstore.api, "_plan_for", alternating)
    model, opt, losses, data = both(tmp_path, grad="host")
    units = hetstore.state_of(model).runtime.units
    tiers = [u.placement.optimizer.value for u in units]
    assert tiers.count("disk") == 2 and tiers.count("cpu") == 2, tiers
    stats = opt.speculation_stats
    assert stats["started"] == stats["committed"] == 3 * 2  # the disk units
    ref, ref_opt = fresh()
    assert train(ref, ref_opt, data) == pytest.approx(losses, rel=1e-6)
    assert_same_weights(ref, model, **TIGHT)


@PLACES
def test_release_with_a_speculation_pending(tmp_path, grad):
    model, opt = offloaded(tmp_path, True, grad=grad)
    x, y = batches(1, vocab=64)[0]
    model(x, y).backward()
    assert opt.speculation_stats["started"] > 0
    hetstore.release(model)  # waits for the worker, drops the shadows, frees everything
    with pytest.raises(hetstore.ConfigError):
        opt.step()


@PLACES
def test_a_copy_of_the_model_is_not_touched(tmp_path, grad):
    """Speculation writes shadows only: between backward and step the parameters a
    forward reads are the old ones (an eval forward there sees what plain PyTorch sees)."""
    model, opt = offloaded(tmp_path, True, grad=grad)
    ref = copy.deepcopy(fresh()[0])
    x, y = batches(1, vocab=64)[0]
    model(x, y).backward()
    with torch.no_grad():
        assert model(x, y) == ref(x, y)


def test_a_disk_too_small_for_every_shadow_steps_ahead_a_window_of_units(tmp_path):
    """Speculations hold a shadow of their unit's states until the step. On a disk with
    room for about two and a half more blocks' states, at most two units a step are
    stepped ahead (room for one ordinary step is kept), the others after backward: no
    error, bit for bit the same."""
    data = batches(3, vocab=64)
    probe, probe_opt = offloaded(tmp_path / "probe", False)
    losses = train(probe, probe_opt, data)
    in_use = hetstore.memory_stats(probe)["disk"]["current"]
    step = probe_opt.streamed_step_of(hetstore.state_of(probe).runtime.block_units[0])
    shadow = step.shadow_bytes
    weights = {k: v.clone() for k, v in probe.state_dict().items()}
    hetstore.release(probe)
    model, opt = offloaded(tmp_path, True, offload_disk_size=in_use + shadow * 5 // 2)
    assert train(model, opt, data) == losses
    stats = opt.speculation_stats
    units = len(hetstore.state_of(model).runtime.units)
    assert stats["committed"] == stats["started"] > 0  # the window: some units ...
    assert stats["started"] + stats["not_started"] == 3 * units  # ... the others later
    assert stats["not_started"] >= 3 * (units - 2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


@PLACES
def test_gradients_changed_through_data_or_assigned_roll_back(tmp_path, grad):
    """``p.grad.data`` has a version counter of its own, and ``p.grad = t`` writes the
    buffer: handing out ``p.grad`` at all counts as a change."""

    def halve_through_data(model, opt):
        for p in model.parameters():
            p.grad.data.mul_(0.5)

    def assign(model, opt):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)

    for between in (halve_through_data, assign):
        _, opt, _, _ = both(tmp_path / between.__name__, between=between, grad=grad)
        stats = opt.speculation_stats
        assert stats["committed"] == 0 and stats["rolled_back"] == stats["started"] > 0


def test_a_step_that_fails_and_is_resumed_steps_each_unit_once(tmp_path, monkeypatch):
    """The first unit's ordinary step fails (it was rolled back: its gradients were
    handed out); the others were committed. step() again finishes the first unit only,
    as the ordinary path does after the same failure."""
    from hetstore.optim.streamed import StreamedUnitStep

    ordinary_step = StreamedUnitStep.step
    data = batches(3, vocab=64)
    results = []
    for overlap in (True, False):
        model, opt = offloaded(tmp_path, overlap)
        first = opt.unit_steps[0].unit
        failed = []

        def step_once_failing(self, multipliers, first=first, failed=failed):
            if self.unit is first and not failed:
                failed.append(True)
                raise OSError("the disk said no, once")
            return ordinary_step(self, multipliers)

        monkeypatch.setattr(StreamedUnitStep, "step", step_once_failing)
        losses = []
        for x, y in data:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            _ = first.entries[0].param.grad  # handed out: this unit rolls back
            try:
                opt.step()
            except OSError:
                opt.step()  # resume
            opt.zero_grad()
        monkeypatch.setattr(StreamedUnitStep, "step", ordinary_step)
        results.append((model, opt, losses))
    (on, on_opt, on_losses), (off, _, off_losses) = results
    assert failed and on_losses == off_losses
    assert_bitwise(on, off)
    assert on_opt.speculation_stats["committed"] > 0


@PLACES
def test_a_checkpoint_loaded_between_backward_and_step(tmp_path, grad):
    """hetstore.load between backward and step rewrites master and states: the step
    then steps the loaded state with the gradients, exactly as without the overlap."""
    donor, donor_opt = offloaded(tmp_path / "donor", False, grad=grad)
    data = batches(3, vocab=64)
    train(donor, donor_opt, data[:1])
    hetstore.save(tmp_path / "ckpt", donor, donor_opt)

    def load(model, opt):
        hetstore.load(tmp_path / "ckpt", model, opt)

    _, opt, _, _ = both(tmp_path, steps=2, between=load, grad=grad)
    stats = opt.speculation_stats
    assert stats["committed"] == 0 and stats["cancelled"] == stats["started"] > 0


@GRADS
def test_fp16_with_overflow_steps_and_clipping(tmp_path, grad):
    """fp16: speculations unscale by 1/scale themselves (into their own buffer); the
    optimizer's in-place unscale is the one change they expect. The first steps overflow
    at the default scale here: they are skipped and their speculations dropped; the
    others commit, with a clip that does not bite (clipping after an overflow used to
    step with NaN gradients: the step re-read a False overflow flag)."""
    model, opt, losses, _ = both(
        tmp_path, steps=4, grad=grad, config_kwargs=dict(compute_dtype="fp16"), fp16=True, clip=1e9
    )
    assert all(math.isfinite(loss) for loss in losses)
    skipped = round(math.log2(2.0**16 / opt.loss_scaler.scale))  # halved once per overflow
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert 1 <= skipped < 4
    assert stats["cancelled"] == skipped * units
    assert stats["committed"] == (4 - skipped) * units and stats["rolled_back"] == 0


def test_units_whose_gradients_change_every_step_back_off(tmp_path):
    """torch's own clip_grad_norm_ that bites rewrites every gradient, so every step
    taken ahead rolls back. After a rollback a unit waits 1, then 2, then 4 steps before
    it is stepped ahead again: 3 tries in 8 steps, not 8. Exact throughout."""
    model, opt, _, _ = both(tmp_path, steps=8, grad="cpu", torch_clip=1e-3)
    stats = opt.speculation_stats
    units = ahead_units(model)
    assert stats["committed"] == 0
    assert stats["started"] == stats["rolled_back"] == 3 * units, stats
    assert stats["held_back"] == 5 * units, stats


def test_states_on_disk_refuse_a_momentum_turned_on_later(tmp_path):
    """Disk states are arrays laid out at offload() for the states asked for then: a
    step that would need SGD's momentum, turned on since, is refused by name instead of
    stepping without it (it used to, silently)."""
    model, opt = offloaded(
        tmp_path, True, make_opt=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.0)
    )
    data = batches(2, vocab=64)
    train(model, opt, data[:1])
    for group in opt.param_groups:
        group["momentum"] = 0.9
    x, y = data[1]
    model(x, y).backward()
    with pytest.raises(hetstore.ConfigError, match="momentum_buffer.*before\n?.*offload"):
        opt.step()
