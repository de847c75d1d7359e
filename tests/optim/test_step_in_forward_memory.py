"""``step_in_forward`` for units whose master and states are in host memory (on a GPU;
here made to apply on this CPU device): ``optimizer.step()`` hands their ordinary step
to the worker, which runs it in place beside the next forward, each landing before its
unit's next use.

Reference: the same offloaded model without ``step_in_forward``, compared bitwise. The
worker runs the same inner optimizer with the group values of the ``optimizer.step()``
call on the same buffers, so anything but equality is a bug. (The ordinary host step is
checked against plain PyTorch elsewhere: tests/api/test_host_offload.py.)
"""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore.config import OffloadConfig
from hetstore.optim.in_memory import InMemoryUnitStep
from tests.models.gpt import batches
from tests.optim.helpers import assert_bitwise, assert_same_optimizer_state, fresh, train


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """Host units' steps run in the next forward as they do on a GPU."""
    monkeypatch.setattr(
        OffloadConfig, "steps_memory_in_forward", lambda self, device=None: self.step_in_forward
    )


def host(tmp_path, name: str, in_forward: bool, overlap=False):
    model, opt = fresh()
    cfg = OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        offload_path=str(tmp_path / name),
        overlap_step=overlap,
        step_in_forward=in_forward,
    )
    return hetstore.offload(model, opt, cfg)


def units_of(model) -> int:
    return len(hetstore.state_of(model).runtime.units)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip-bites"])
@pytest.mark.parametrize("overlap", [False, True], ids=["alone", "with-overlap_step"])
def test_host_steps_in_the_next_forward_train_bitwise_like_the_ordinary_step(
    tmp_path, clip, overlap
):
    data = batches(4, vocab=64)
    on, on_opt = host(tmp_path, "on", True, overlap)
    off, off_opt = host(tmp_path, "off", False, overlap)
    assert train(on, on_opt, data, clip=clip) == train(off, off_opt, data, clip=clip)
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    stats = on_opt.speculation_stats
    # every unit not committed from backward (the root always) ran in the next forward
    assert stats["in_forward"] + stats["committed"] == units_of(on) * len(data)
    if not overlap:
        assert stats["in_forward"] == units_of(on) * len(data)
    assert not on_opt.step_ahead.in_place()  # state_dict() above waited for the last ones


def test_every_reader_between_step_and_forward_sees_the_stepped_values(tmp_path):
    """Right after optimizer.step(), the steps still pending: a released parameter's
    value, p.grad, the model's and the optimizer's state_dict() and a checkpoint read
    what the ordinary step left; zero_grad through torch and a scheduler do not reach
    the pending steps; the next step trains on."""
    data = batches(3, vocab=64)
    on, on_opt = host(tmp_path, "on", True)
    off, off_opt = host(tmp_path, "off", False)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (on_opt, off_opt)]
    for i, (x, y) in enumerate(data):
        for model, opt in ((on, on_opt), (off, off_opt)):
            model(x, y).backward()
            opt.step()
        assert on_opt.step_ahead.in_place(), "nothing was left to the next forward"
        names = [n for n, _ in on.named_parameters()]
        name = next(n for n in names if "blocks.1" in n)
        weight, weight_off = dict(on.named_parameters())[name], dict(off.named_parameters())[name]
        if i == 0:
            assert torch.equal(weight.detach().clone(), weight_off.detach().clone())
            assert torch.equal(weight.grad, weight_off.grad)
        elif i == 1:
            hetstore.save(tmp_path / "ckpt-on", on, on_opt)
            hetstore.save(tmp_path / "ckpt-off", off, off_opt)
            assert_bitwise(on, off)
        else:
            assert_same_optimizer_state(on_opt, off_opt)
        for model, opt, scheduler in ((on, on_opt, schedulers[0]), (off, off_opt, schedulers[1])):
            model.zero_grad(set_to_none=False)  # torch's zero_() through p.grad
            opt.zero_grad()
            scheduler.step()
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)
    saved_on = hetstore.load(tmp_path / "ckpt-on", on, on_opt)
    saved_off = hetstore.load(tmp_path / "ckpt-off", off, off_opt)
    assert saved_on == saved_off
    assert_bitwise(on, off)


def test_micro_batches_step_once_and_in_the_next_forward(tmp_path):
    data = batches(8, vocab=64)
    on, on_opt = host(tmp_path, "on", True)
    off, off_opt = host(tmp_path, "off", False)
    on_losses = train(on, on_opt, data, accumulate=4, clip=0.05)
    assert on_losses == train(off, off_opt, data, accumulate=4, clip=0.05)
    assert_bitwise(on, off)
    assert on_opt.speculation_stats["in_forward"] == units_of(on) * 2


def test_a_step_that_fails_on_the_worker_raises_at_the_units_next_use(tmp_path, monkeypatch):
    """An in-place step cannot be run again (it may have stepped part of the unit), so
    its error is raised at the unit's next use, once, naming the unit; training goes on
    after it."""
    data = batches(3, vocab=64)
    on, on_opt = host(tmp_path, "on", True)
    train(on, on_opt, data[:1])
    on_opt.finish_steps_in_forward()  # (the first step's, before the patch below)
    victim = next(s for s in on_opt.unit_steps if isinstance(s, InMemoryUnitStep))
    original = victim.step

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the step failed")

    monkeypatch.setattr(victim, "step", failing)  # (the unit's whole step, on the worker)
    x, y = data[1]
    on(x, y).backward()
    on_opt.step()  # returns: the failure is on the worker
    with pytest.raises(RuntimeError, match=f"unit {victim.unit.name!r}.*failed part-way") as err:
        on(x, y)
    monkeypatch.setattr(victim, "step", original)
    assert "injected" in str(err.value.__cause__)
    on_opt.zero_grad()
    losses = train(on, on_opt, data[2:])  # training goes on
    on_opt.finish_steps_in_forward()
    assert not on_opt.step_ahead.in_place() and all(torch.isfinite(torch.tensor(losses)))


def test_a_cpu_device_keeps_the_host_steps_in_optimizer_step(tmp_path, monkeypatch):
    """Without the GPU stand-in: on a CPU device only disk units are stepped in the
    next forward (that forward would compute on the cores the step needs)."""
    monkeypatch.undo()
    on, on_opt = host(tmp_path, "on", True)
    train(on, on_opt, batches(2, vocab=64))
    assert on_opt.step_ahead is None or on_opt.speculation_stats["in_forward"] == 0


def test_the_pending_steps_use_the_values_of_the_optimizer_step_call(tmp_path, monkeypatch):
    """The worker held until the scheduler has changed the lr after optimizer.step():
    the steps still use the lr of that call, as the ordinary step does."""
    import threading

    from hetstore.optim import in_memory as forward_steps

    gate = threading.Event()
    original = forward_steps.step_in_place

    def held(record):
        assert gate.wait(30), "the test never let the worker go"
        return original(record)

    monkeypatch.setattr(forward_steps, "step_in_place", held)
    data = batches(3, vocab=64)
    results = []
    for in_forward in (True, False):
        model, opt = host(tmp_path, str(in_forward), in_forward)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
        for x, y in data:
            model(x, y).backward()  # (its forward waited for every step of the last call)
            gate.clear()
            opt.step()
            scheduler.step()  # before the worker runs a single step of this call
            gate.set()
            opt.zero_grad()
        results.append((model, opt))
    (on, on_opt), (off, off_opt) = results
    assert on_opt.speculation_stats["in_forward"] == units_of(on) * len(data)
    assert_bitwise(on, off)
    assert_same_optimizer_state(on_opt, off_opt)


@pytest.fixture
def held(monkeypatch):
    """The worker's in-place steps wait for this gate (set: they run at once)."""
    import threading

    from hetstore.optim import in_memory as forward_steps

    gate = threading.Event()
    gate.set()
    original = forward_steps.step_in_place

    def wait_for_gate(record):
        assert gate.wait(30), "the test never let the worker go"
        return original(record)

    monkeypatch.setattr(forward_steps, "step_in_place", wait_for_gate)
    return gate


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def stepped_and_held(tmp_path, held):
    """A model whose second step's in-place steps are pending, the worker held until
    0.5 s from now; and its weights before that step."""
    import threading

    data = batches(2, vocab=64)
    model, opt = host(tmp_path, "held", True)
    train(model, opt, data[:1])
    opt.finish_steps_in_forward()
    before = snapshot(model)
    x, y = data[1]
    model(x, y).backward()
    held.clear()
    opt.step()
    assert opt.step_ahead.in_place()
    threading.Timer(0.5, held.set).start()
    return model, opt, before


def test_the_models_state_dict_waits_for_the_pending_steps(tmp_path, held):
    model, opt, before = stepped_and_held(tmp_path, held)
    during = snapshot(model)  # waits for the worker
    opt.finish_steps_in_forward()
    after = snapshot(model)
    assert all(torch.equal(during[k], after[k]) for k in after)
    assert not all(torch.equal(before[k], after[k]) for k in after)


@pytest.mark.parametrize("how", ["load_state_dict", "hetstore.load"])
def test_weights_loaded_while_steps_are_pending_are_not_stepped_over(tmp_path, held, how):
    """model.load_state_dict() and hetstore.load() without the optimizer: the pending
    step lands first, then the loaded weights replace it, as in plain PyTorch."""
    model, opt, before = stepped_and_held(tmp_path, held)
    held.set()
    hetstore.save(tmp_path / "ckpt", model, opt)  # (lands the steps; saved as stepped)
    saved = snapshot(model)
    x, y = batches(3, vocab=64)[2]
    model(x, y).backward()
    held.clear()
    opt.step()
    import threading

    threading.Timer(0.5, held.set).start()
    if how == "load_state_dict":
        model.load_state_dict(saved)
    else:
        hetstore.load(tmp_path / "ckpt", model)
    opt.finish_steps_in_forward()
    got = snapshot(model)
    assert all(torch.equal(got[k], saved[k]) for k in saved)


def test_a_model_dropped_without_release_leaves_no_worker_thread(tmp_path):
    import gc
    import threading
    import time

    def workers() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("hetstore-step-ahead")}

    earlier = workers()  # (other tests' models, not collected yet)
    model, opt = host(tmp_path, "dropped", True)
    train(model, opt, batches(1, vocab=64))  # its steps still pending in the worker
    (mine,) = workers() - earlier
    del model, opt
    for _ in range(50):  # a collected executor's thread exits on its own, soon after
        gc.collect()
        if not mine.is_alive():
            break
        time.sleep(0.1)
    assert not mine.is_alive()
