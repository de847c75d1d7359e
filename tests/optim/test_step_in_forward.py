"""``step_in_forward``: the disk units' steps that ``optimizer.step()`` would run after
backward run on during the next forward, each committed before its unit's next use.

Reference: the same offloaded model without it (the ordinary streamed step), compared
bitwise: the worker runs the same chunks through the same fused kernel with the group
values, gradient flags and factors of the ``optimizer.step()`` call, so anything but
equality is a bug. The ordinary step itself is checked against plain PyTorch elsewhere
(tests/api/test_disk_offload.py, TIGHT).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hetstore
from hetstore.errors import ConfigError
from hetstore.optim import borrowed, policy
from hetstore.optim.step_worker import StepWorker
from hetstore.optim.streamed import StreamedUnitStep
from hetstore.runtime.staging import GradStager, ParamStager
from tests.models.gpt import GPT, Block, batches
from tests.optim.helpers import (
    WIDTH,
    assert_bitwise,
    assert_same_optimizer_state,
    config,
    fresh,
    train,
)
from tests.parity import adamw

GRADS = pytest.mark.parametrize("grad", ["cpu", "disk"])


def offloaded(tmp_path, name: str, grad: str, in_forward: bool, overlap=False, make=None):
    model, opt = fresh(make) if make is not None else fresh()
    where = tmp_path / name
    cfg = config(where, overlap, grad, step_in_forward=in_forward)
    return hetstore.offload(model, opt, cfg)


def assert_trained_alike(results) -> object:
    """Two ``(model, optimizer, losses)`` runs: the same losses, and weights and
    optimizer states bit for bit; the first run's optimizer."""
    (on, on_opt, on_losses), (off, off_opt, off_losses) = results
    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    return on_opt


def units_of(model) -> int:
    return len(hetstore.state_of(model).runtime.units)


@GRADS
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip-bites"])
@pytest.mark.parametrize("overlap", [False, True], ids=["alone", "with-overlap_step"])
def test_steps_in_the_next_forward_train_bitwise_like_the_ordinary_step(
    tmp_path, grad, clip, overlap
):
    data = batches(4, vocab=64)
    on, on_opt = offloaded(tmp_path, "on", grad, True, overlap)
    off, off_opt = offloaded(tmp_path, "off", grad, False, overlap)
    on_losses = train(on, on_opt, data, clip=clip)
    off_losses = train(off, off_opt, data, clip=clip)
    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    stats = on_opt.speculation_stats
    # every unit step that was not committed in backward ran in the next forward
    assert stats["in_forward"] + stats["committed"] == units_of(on) * len(data)
    if clip is not None or not overlap:  # a clip that bites: none is kept from backward
        assert stats["committed"] == 0
        assert stats["in_forward"] == units_of(on) * len(data)
    assert not on_opt.step_ahead.in_forward_jobs()  # state_dict() above committed the last ones


@GRADS
def test_every_reader_between_step_and_forward_sees_the_stepped_values(tmp_path, grad):
    """Right after optimizer.step() (steps still pending): the model's and the
    optimizer's state_dict(), a released parameter's value and, with gradients in
    memory, p.grad read what the ordinary step left, and the next step trains on."""
    data = batches(3, vocab=64)
    on, on_opt = offloaded(tmp_path, "on", grad, True)
    off, off_opt = offloaded(tmp_path, "off", grad, False)
    for x, y in data:
        for model, opt in ((on, on_opt), (off, off_opt)):
            model(x, y).backward()
            opt.clip_grad_norm_(0.05)
            opt.step()
        assert on_opt.step_ahead.in_forward_jobs(), "nothing was left to the next forward"
        weight = next(p for n, p in on.named_parameters() if "blocks.1" in n)
        weight_off = dict(off.named_parameters())[
            next(n for n, p in on.named_parameters() if p is weight)
        ]
        assert torch.equal(weight.detach().clone(), weight_off.detach().clone())
        if grad == "cpu":
            assert torch.equal(weight.grad, weight_off.grad)
        assert_bitwise(on, off)
        assert_same_optimizer_state(on_opt, off_opt)
        for opt in (on_opt, off_opt):
            opt.zero_grad()
    assert on_opt.speculation_stats["in_forward"] == units_of(on) * len(data)


def test_zero_grad_and_a_scheduler_right_after_step_do_not_reach_the_pending_steps(tmp_path):
    """zero_grad() clears the flags and the scheduler changes the lr while the steps
    still run: they step with the flags and values of the optimizer.step() call."""
    data = batches(4, vocab=64)
    results = []
    for in_forward in (True, False):
        model, opt = offloaded(tmp_path, f"{in_forward}", "cpu", in_forward)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        losses = []
        for x, y in data:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            model.zero_grad(set_to_none=False)  # torch's zero_() through p.grad
            opt.zero_grad()
            scheduler.step()
        results.append((model, opt, losses))
    (on, on_opt, on_losses), (off, off_opt, off_losses) = results
    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)


def test_a_step_that_fails_on_the_worker_runs_again_at_the_units_use(tmp_path, monkeypatch):
    data = batches(3, vocab=64)
    failed = []
    original = StreamedUnitStep.run_into_shadows

    def failing_once(self, *args, **kwargs):
        if not failed:
            failed.append(self.unit.name)
            raise OSError("injected: the worker's write failed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StreamedUnitStep, "run_into_shadows", failing_once)
    on, on_opt = offloaded(tmp_path, "on", "disk", True)
    off, off_opt = offloaded(tmp_path, "off", "disk", False)
    assert train(on, on_opt, data, clip=0.05) == train(off, off_opt, data, clip=0.05)
    assert failed
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)


def test_a_step_that_keeps_failing_raises_at_the_use_and_loses_nothing(tmp_path, monkeypatch):
    """The worker's step and the retry both fail: the next forward raises, naming the
    unit and step_in_forward; the unit keeps its weights from before the step; once the
    fault is gone the next use steps it and training goes on exactly."""
    data = batches(3, vocab=64)
    on, on_opt = offloaded(tmp_path, "on", "disk", True)
    off, off_opt = offloaded(tmp_path, "off", "disk", False)
    runtime = hetstore.state_of(on).runtime
    target = next(u for u in runtime.units if u is not runtime.root)

    def master_on_disk() -> torch.Tensor:  # read past the gate: what is there now
        out = torch.empty(target.master.numel)
        target.master.disk.read(target.master.region, out).wait()
        return out

    fault = {"on": True}
    run, step = StreamedUnitStep.run_into_shadows, StreamedUnitStep.step

    def guard(original):
        def call(self, *args, **kwargs):
            if self.unit is target and fault["on"]:
                raise OSError("injected: no space left on device")
            return original(self, *args, **kwargs)

        return call

    monkeypatch.setattr(StreamedUnitStep, "run_into_shadows", guard(run))
    monkeypatch.setattr(StreamedUnitStep, "step", guard(step))
    before = master_on_disk()
    x, y = data[0]
    for model, opt in ((on, on_opt), (off, off_opt)):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(OSError, match="no space left") as failure:
        on(*data[1])
    assert any(
        "step_in_forward" in note and target.name in note for note in failure.value.__notes__
    )
    assert target.work_pending  # still to be done
    assert torch.equal(master_on_disk(), before)  # nothing half-written in its place
    fault["on"] = False
    losses_on = train(on, on_opt, data[1:])
    losses_off = train(off, off_opt, data[1:])
    assert losses_on == losses_off
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)


def _train_counting_reads(model, opt, data) -> tuple[list[float], list[int]]:
    """Losses, and the disk bytes read from each backward to the end of the next forward
    (its fetches, what it reads ahead, the steps finished in that forward and its
    fetches)."""
    disk = hetstore.state_of(model).runtime.units[0].tiers.disk
    losses, reads = [], []
    x, y = data[0]
    loss = model(x, y)
    for x, y in data[1:]:
        before = disk.stats()["bytes_read"]
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        loss = model(x, y)
        reads.append(disk.stats()["bytes_read"] - before)
    return losses, reads


@pytest.mark.parametrize("depth", [0, 1, 2], ids=lambda d: f"prefetch_depth={d}")
def test_the_next_forward_takes_the_stepped_parameters_instead_of_reading_them_back(
    tmp_path, monkeypatch, depth
):
    """A step finished in the next forward leaves its unit's new parameters in a
    parameter staging buffer; the unit's fetch takes them from there. Against the same
    run with that turned off: the same losses and weights bit for bit, and exactly the
    staged units' parameter bytes fewer read from disk."""
    data = batches(4, vocab=64)

    def run(name: str):
        model, opt = fresh()
        cfg = config(tmp_path / name, False, "disk", step_in_forward=True, prefetch_depth=depth)
        model, opt = hetstore.offload(model, opt, cfg)
        losses, reads = _train_counting_reads(model, opt, data)
        return model, opt, losses, reads

    staged = []
    stage = ParamStager.stage

    def recording(self, unit, slot):
        staged.append(unit)
        return stage(self, unit, slot)

    with monkeypatch.context() as patch:
        patch.setattr(borrowed, "stages_params", lambda unit: False)
        off, off_opt, off_losses, off_reads = run("off")
    monkeypatch.setattr(ParamStager, "stage", recording)
    on, on_opt, on_losses, on_reads = run("on")

    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    steps = len(data) - 1
    assert off_opt.speculation_stats["params_staged"] == 0
    assert on_opt.speculation_stats["params_staged"] == len(staged)
    # at least the first units forward uses: they get the buffers free at the step
    assert len(staged) >= steps * min(depth + 1, units_of(on))
    assert sum(off_reads) - sum(on_reads) == sum(u.home_bytes for u in staged)


class _MlpSometimes(Block):
    """A block whose MLP (ln2, fc, out) is left out while ``skip``: those parameters
    get no gradient that step."""

    skip = False

    def forward(self, x):
        if not self.skip:
            return super().forward(x)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize(
    "in_forward, fp16",
    [(True, False), (False, False), (True, True)],
    ids=["in-the-next-forward", "in-step", "fp16-in-the-next-forward"],
)
def test_the_last_gradients_written_are_stepped_from_the_stagers_buffer(
    tmp_path, monkeypatch, in_forward, fp16
):
    """The units whose backward ended last (the first the next forward uses) step from
    the gradient stager's buffer their gradients were written from, not from a read
    back: in the next forward, or in ``optimizer.step()``. Against the same run with
    that turned off: the same losses, weights and states bit for bit, with a clip that
    bites and the first block's MLP without gradients every other step (zeroed in the
    lent buffer as the ordinary step zeroes them in what it reads; the buffer holds
    another unit's gradients there), and exactly the lent units' gradient bytes fewer
    read from disk. fp16: the loss scale's unscale factor and the clip's, both applied
    as the step reads the lent buffer (into its own), as to what it reads from disk."""
    data = batches(5, vocab=64)

    def run(name: str):
        model, _ = fresh()
        for k, block in enumerate(model.blocks):  # (one class: the blocks are the units)
            model.blocks[k] = _MlpSometimes(WIDTH, block.heads)
            model.blocks[k].load_state_dict(block.state_dict())
        opt = adamw(model.parameters())
        half = {"compute_dtype": "fp16"} if fp16 else {}
        cfg = config(tmp_path / name, False, "disk", step_in_forward=in_forward, **half)
        model, opt = hetstore.offload(model, opt, cfg)
        blocks = model.blocks
        # (the disk bytes read from each backward to the end of the next forward)
        disk = hetstore.state_of(model).runtime.units[0].tiers.disk
        losses, reads, taken = [], 0, 0
        x, y = data[0]
        loss = model(x, y)
        for i, (x, y) in enumerate(data[1:], 1):
            before = disk.stats()["bytes_read"]
            (opt.scale_loss(loss) if fp16 else loss).backward()
            losses.append(loss.item())
            opt.clip_grad_norm_(0.05)
            scale = opt.loss_scaler.scale if fp16 else None
            opt.step()
            taken += not fp16 or opt.loss_scaler.scale == scale  # (an overflow skips it)
            opt.zero_grad()
            blocks[0].skip = i % 2 == 1
            loss = model(x, y)
            reads += disk.stats()["bytes_read"] - before
        return model, opt, losses, (reads, taken)

    lent = []
    lend_written = GradStager.lend_written

    def recording(self, unit, has_grad):
        grads = lend_written(self, unit, has_grad)
        lent.extend([unit] if grads is not None else [])
        return grads

    # (new parameters left in a staging buffer for the fetch, or read back, depend on
    # the worker's timing: read back in both runs)
    monkeypatch.setattr(borrowed, "stages_params", lambda unit: False)
    with monkeypatch.context() as patch:
        patch.setattr(GradStager, "lend_written", lambda self, unit, has_grad: None)
        off, off_opt, off_losses, (off_reads, steps) = run("off")
    monkeypatch.setattr(GradStager, "lend_written", recording)
    on, on_opt, on_losses, (on_reads, _) = run("on")

    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    # the stager's three buffers: the root's, and the two blocks' last written
    assert {u.name for u in lent} == {"root", "blocks.0", "blocks.1"}
    assert len(lent) == 3 * steps and steps >= len(data) - 2
    assert off_reads - on_reads == sum(u.trainable_numel * 4 for u in lent)


def test_a_unit_without_a_step_pending_finds_a_staging_buffer_without_waiting(
    tmp_path, monkeypatch
):
    """A frozen block has a disk home but no step: forward fetches it while the steps
    of the units after it are pending. A buffer stays free for it, so its fetch never
    has to finish a later unit's step to get one (that would make the forward wait for
    the worker out of order); training stays bitwise."""
    data = batches(4, vocab=64)
    reclaims = []
    reclaim = borrowed.ParamLending.give_one_back

    def counting(self):
        reclaims.append(1)
        return reclaim(self)

    monkeypatch.setattr(borrowed.ParamLending, "give_one_back", counting)
    results = []
    for in_forward in (True, False):
        torch.manual_seed(0)
        model = GPT(width=WIDTH, depth=3)
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        opt = adamw([p for p in model.parameters() if p.requires_grad])
        cfg = config(tmp_path / f"{in_forward}", False, "disk", step_in_forward=in_forward)
        model, opt = hetstore.offload(model, opt, cfg)
        results.append((model, opt, train(model, opt, data, clip=0.05)))
    on_opt = assert_trained_alike(results)
    assert on_opt.speculation_stats["params_staged"] > 0
    assert not reclaims


def _train_reading_ahead(
    tmp_path, name: str, data, *, units: int, clip=None, overlap=False, in_forward=True
):
    """Train with at most ``units`` units read ahead; the losses, and per step the disk
    bytes read in backward and in the next forward (with optimizer.step())."""
    model, opt = fresh()
    cfg = config(tmp_path / name, overlap, "disk", step_in_forward=in_forward)
    model, opt = hetstore.offload(model, opt, cfg)
    disk = hetstore.state_of(model).runtime.units[0].tiers.disk
    ahead = opt.step_ahead
    losses, in_backward, in_forward = [], [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "READ_AHEAD_UNITS", units)
        # (staged parameters, which depend on the worker's pace, would blur the count)
        patch.setattr(borrowed, "stages_params", lambda unit: False)
        x, y = data[0]
        loss = model(x, y)
        for x, y in data[1:]:
            start = disk.stats()["bytes_read"]
            loss.backward()
            for record in ahead.read_aheads.records:  # (the worker's reads are async)
                ahead.worker.wait(record)
            middle = disk.stats()["bytes_read"]
            losses.append(loss.item())
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            loss = model(x, y)
            in_backward.append(middle - start)
            in_forward.append(disk.stats()["bytes_read"] - middle)
    return model, opt, losses, in_backward, in_forward


@pytest.mark.parametrize(
    "overlap, in_forward",
    [(False, True), (True, True), (True, False)],
    ids=["in-forward-alone", "in-forward-after-a-clip-that-bit", "in-step-after-a-clip-that-bit"],
)
def test_the_first_units_states_are_read_during_backward_for_their_step(
    tmp_path, overlap, in_forward
):
    """No step will be taken in backward (a clip bit, or step_in_forward without
    overlap_step): backward reads the first units' masters and states into host memory,
    and their steps, in the next forward or in optimizer.step(), read them there. The
    same losses, weights and states bit for bit as without; the step and the next
    forward read exactly those bytes less, backward as much more."""
    data = batches(4, vocab=64)
    clip = 0.05 if overlap else None
    on, on_opt, on_losses, on_bwd, on_fwd = _train_reading_ahead(
        tmp_path, "on", data, units=2, clip=clip, overlap=overlap, in_forward=in_forward
    )
    off, off_opt, off_losses, off_bwd, off_fwd = _train_reading_ahead(
        tmp_path, "off", data, units=0, clip=clip, overlap=overlap, in_forward=in_forward
    )
    assert on_losses == off_losses
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    runtime = hetstore.state_of(on).runtime
    order = runtime.use_order() if in_forward else [s.unit for s in on_opt.unit_steps]
    first = [u for u in order if u.trainable_numel][:2]
    per_step = sum(
        u.master.nbytes + sum(a.nbytes for a in on_opt.step_ahead.step_of(u).states.values())
        for u in first
    )
    # the first backward reads ahead only once a clip bit (with overlap_step)
    steps_ahead = len(data) - 1 - (1 if overlap else 0)
    assert on_opt.speculation_stats["read_ahead"] == 2 * steps_ahead
    assert off_opt.speculation_stats["read_ahead"] == 0
    moved = [off - on for off, on in zip(off_fwd, on_fwd, strict=True)]
    assert moved == [on - off for on, off in zip(on_bwd, off_bwd, strict=True)]
    # from the second step on (the first has no states yet: its masters only)
    assert moved[1:] == [per_step] * (len(data) - 2)
    if not overlap:  # (with it, the first step's speculations read when the worker does)
        assert 0 < moved[0] < per_step
    assert not on_opt.step_ahead.read_aheads.records  # each step freed what it read ahead


def test_read_ahead_states_are_stepped_where_they_were_read(tmp_path, monkeypatch):
    """The step of a unit read ahead (fp32 states: the compact formats are not read
    ahead) steps and writes its chunks in the buffers they were read into
    (``StreamedUnitStep._views_of``), not in copies: the same losses, weights and states
    bit for bit as without reading ahead, and every step that took what was read ahead
    stepped it there."""
    data = batches(4, vocab=64)
    in_place = []
    views_of = StreamedUnitStep._views_of

    def counted(self, read_ahead):
        views = views_of(self, read_ahead)
        if views is not None:
            in_place.append(self.unit.name)
        return views

    monkeypatch.setattr(StreamedUnitStep, "_views_of", counted)
    results = []
    for units in (2, 0):
        monkeypatch.setattr(policy, "READ_AHEAD_UNITS", units)
        model, opt = fresh()
        cfg = config(tmp_path / f"ra{units}", True, "disk")
        model, opt = hetstore.offload(model, opt, cfg)
        results.append((model, opt, train(model, opt, data, clip=0.05)))
    on_opt = assert_trained_alike(results)
    assert on_opt.speculation_stats["read_ahead"] > 0
    assert len(in_place) == on_opt.speculation_stats["read_ahead"]


def test_a_step_after_a_clip_leaves_no_read_ahead_and_no_worker_behind(tmp_path):
    """optimizer.step() without step_in_forward, after a clip that bit: it used what
    backward read ahead, and freed the rest; the worker thread, which holds the model,
    goes with them (a model dropped between steps leaves nothing running)."""
    data = batches(3, vocab=64)
    model, opt = fresh()
    cfg = config(tmp_path, True, "disk", step_in_forward=False)
    model, opt = hetstore.offload(model, opt, cfg)
    for x, y in data:
        model(x, y).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        assert not opt.step_ahead.read_aheads.records
        assert not opt.step_ahead.worker.running  # (before zero_grad, which stops it too)
        opt.zero_grad()
    assert opt.speculation_stats["read_ahead"] > 0


def test_nothing_is_read_ahead_where_the_steps_chunk_buffers_would_not_fit_beside_it(
    tmp_path, monkeypatch
):
    """A read-ahead in use cannot give way to the chunk buffers its step then makes, so
    none is made unless the host keeps room for those too: with a host tier that has
    room for the read-ahead but not for both, nothing is read ahead, and the steps
    (which then find their buffers) train as before."""
    data = batches(3, vocab=64)
    model, opt = fresh()
    cfg = config(tmp_path, True, "disk", offload_cpu_size=2**30)
    model, opt = hetstore.offload(model, opt, cfg)
    # chunk buffers as large as the host's whole capacity: no room beside them
    monkeypatch.setattr(StepWorker, "slot_bytes", lambda self: 2**30)
    for x, y in data:
        model(x, y).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    assert opt.speculation_stats["read_ahead"] == 0
    assert opt.speculation_stats["held_back"] > 0  # (a read-ahead would have been tried)


def test_what_was_read_ahead_gives_way_to_a_host_allocation_and_to_a_rewrite(tmp_path):
    """Memory read ahead only saves time: a host allocation that finds no room frees
    it (the step then reads the disk), and so does a rewrite of the unit's master
    (here a state-dict load between backward and step); training stays exact."""
    data = batches(3, vocab=64)
    results = []
    for name in ("reclaimed", "plain"):
        model, opt = fresh()
        cfg = config(tmp_path / name, False, "disk", step_in_forward=True)
        model, opt = hetstore.offload(model, opt, cfg)
        host = hetstore.state_of(model).tiers.host
        for i, (x, y) in enumerate(data):
            model(x, y).backward()
            if name == "reclaimed":
                held = host.account.current
                assert opt.step_ahead.read_aheads.records
                if i == 0:
                    assert any(
                        r() for r in host.reclaimers
                    )  # what an allocation without room calls
                    assert not opt.step_ahead.read_aheads.records
                    assert host.account.current < held
                else:
                    model.load_state_dict(model.state_dict())
                    assert not opt.step_ahead.read_aheads.records
            else:
                model.load_state_dict(model.state_dict()) if i else None
            opt.step()
            opt.zero_grad()
        results.append((model, opt))
    (a, a_opt), (b, b_opt) = results
    assert a_opt.speculation_stats["read_ahead"] == 0
    assert_bitwise(a, b)
    assert_same_optimizer_state(a_opt, b_opt)


def test_steps_finish_during_the_loops_own_work_between_step_and_forward(tmp_path):
    """Between optimizer.step() and the next forward a loop loads data and logs: the
    steps run on meanwhile, all of them, not only those that found a parameter buffer
    free (those wait for one only once forward runs and gives them back)."""
    import time

    data = batches(2, vocab=64)
    model, opt = offloaded(tmp_path, "on", "disk", True)
    x, y = data[0]
    model(x, y).backward()
    opt.step()
    pending = list(opt.step_ahead.in_forward_jobs())
    assert len(pending) == units_of(model)
    deadline = time.monotonic() + 30
    while not all(r.future.done() for r in pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r.future.done() for r in pending)
    opt.zero_grad()
    model(*data[1])  # lands them


EXITS_AFTER_A_LAST_STEP = """
import sys, time
import torch, hetstore
from tests.models.gpt import batches
from tests.optim.helpers import config, fresh
model, opt = fresh()
model, opt = hetstore.offload(model, opt, config(sys.argv[1], False, "disk", step_in_forward=True))
for x, y in batches(2, vocab=64):
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
assert opt.step_ahead.in_forward_jobs()  # the last step's units: still to land
print("left", time.perf_counter(), flush=True)
"""


def test_a_program_whose_last_step_has_no_forward_after_it_exits_promptly(tmp_path):
    """The steps of the last optimizer.step() run on with no forward to give their
    parameter buffers back: the worker must not wait for buffers then, or the
    interpreter, which joins it at exit, would hang."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", EXITS_AFTER_A_LAST_STEP, str(tmp_path / "offload")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ended = time.perf_counter()
    assert done.returncode == 0, done.stderr
    left = float(done.stdout.split()[-1])
    assert ended - left < 10, f"{ended - left:.1f} s from the last step to the exit"


def test_step_in_forward_takes_auto_true_or_false_only():
    for bad in ("yes", "on", 1, None):
        with pytest.raises(ConfigError, match=r"step_in_forward=.*'auto', True or False"):
            hetstore.OffloadConfig(step_in_forward=bad)


def test_the_default_runs_disk_steps_on_into_the_next_forward_unless_overlap_step_is_off(
    tmp_path,
):
    """``step_in_forward='auto'`` (the default): the disk units' steps a clip left after
    backward run on into the next forward, bitwise as with it off; ``overlap_step=False``
    asks for every step in ``optimizer.step()``, and 'auto' follows it. Host-memory units'
    steps move on a GPU only: with 'auto' while overlap_step is not False, or with True."""
    config = hetstore.OffloadConfig
    assert config().step_in_forward == "auto"
    assert config().steps_disk_in_forward
    assert not config(overlap_step=False).steps_disk_in_forward
    assert config(overlap_step=False, step_in_forward=True).steps_disk_in_forward
    assert config().steps_memory_in_forward("cuda")
    assert not config().steps_memory_in_forward("cpu")
    assert config(overlap_step=True).steps_memory_in_forward("cuda")
    assert not config(overlap_step=False).steps_memory_in_forward("cuda")
    assert not config(step_in_forward=False).steps_memory_in_forward("cuda")
    assert config(step_in_forward=True, overlap_step=False).steps_memory_in_forward("cuda")
    assert not config(step_in_forward=True).steps_memory_in_forward("cpu")

    def default_config(where, **kwargs):
        return hetstore.OffloadConfig(
            offload_param="disk",
            offload_optimizer="disk",
            offload_path=str(tmp_path / where),
            enable_pinned_mem=False,
            device="cpu",
            **kwargs,
        )

    data = batches(3, vocab=64)
    runs = {}
    for name, kwargs in {
        "default": {},
        "off": {"step_in_forward": False},
        "no-overlap": {"overlap_step": False},
    }.items():
        model, opt = fresh()
        model, opt = hetstore.offload(model, opt, default_config(name, **kwargs))
        runs[name] = (model, opt, train(model, opt, data, clip=0.05))
    default, off, no_overlap = runs["default"], runs["off"], runs["no-overlap"]
    assert default[2] == off[2] == no_overlap[2]
    assert_bitwise(default[0], off[0])
    assert_bitwise(no_overlap[0], off[0])
    assert_same_optimizer_state(default[1], off[1])
    assert default[1].speculation_stats["in_forward"] == units_of(default[0]) * len(data)
    assert off[1].speculation_stats["in_forward"] == 0
    assert no_overlap[1].step_ahead is None  # nothing stepped ahead of optimizer.step()


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_a_steps_shadow_bytes_are_what_its_shadows_take_of_the_disk(tmp_path, state_format):
    """The room kept for one ordinary step while steps run on into the next forward
    (``StepAhead.disk_reserve``) is a unit's ``shadow_bytes``: it must be what making
    that unit's shadows takes of the disk tier, each array rounded as the tier rounds it.
    Counted unrounded, a disk budget a page or two short let the steps handed to the
    worker take the room the steps left to ``optimizer.step()`` needed, and the default
    raised out of disk where ``step_in_forward=False`` trained."""
    model, opt = fresh()
    cfg = config(tmp_path, False, "disk", optimizer_state_format=state_format)
    model, opt = hetstore.offload(model, opt, cfg)
    train(model, opt, batches(1, vocab=64))  # the states exist
    disk = hetstore.state_of(model).tiers.disk
    unaligned = 0
    for unit_step in opt.unit_steps:
        arrays = [unit_step.unit.master, *unit_step.states.values()]
        unaligned += sum(a.nbytes % 4096 != 0 for a in arrays)
        before = disk.stats()["current"]
        rewrite = unit_step.begin_speculation()
        try:
            assert disk.stats()["current"] - before == unit_step.shadow_bytes
        finally:
            rewrite.discard()
        assert disk.stats()["current"] == before
    assert unaligned  # (else the rounding would not be tested)
