"""The step-ahead tests' model, placement, training loop and bitwise comparisons (moved
here from test_step_ahead, unchanged): every test of a step taken
outside ``optimizer.step()`` compares with the ordinary step through them."""

from __future__ import annotations

import contextlib

import torch

import hetstore
from hetstore import OffloadConfig
from tests.models.gpt import GPT
from tests.parity import adamw

WIDTH = 48  # blocks of ~28K parameters: several 8192-element chunks each


def config(path, overlap: bool, grad: str = "cpu", **kwargs) -> OffloadConfig:
    """Units with master and states on disk, gradients in memory (``grad='cpu'``: read
    there) or on disk (read back by the worker); ``grad='host'``: everything in host
    memory instead, stepped in ``optimizer.step()`` (on a GPU, in the next forward)."""
    tier = "cpu" if grad == "host" else "disk"
    return OffloadConfig(
        offload_param=tier,
        offload_optimizer=tier,
        offload_grad="cpu" if grad == "host" else grad,
        offload_path=str(path),
        optimizer_chunk_size=8192 * 4,
        overlap_step=overlap,
        enable_pinned_mem=False,
        device="cpu",
        **kwargs,
    )


def fresh(make_opt=adamw):
    torch.manual_seed(0)
    model = GPT(width=WIDTH, depth=3)
    return model, make_opt(model.parameters())


def train(
    model,
    opt,
    data,
    *,
    fp16=False,
    clip=None,
    torch_clip=None,
    accumulate=1,
    no_sync=False,
    scheduler=None,
    between=None,
    wait_worker=False,
):
    """``wait_worker``: before the clip or ``between``, let the steps taken ahead finish,
    so a change of the gradients comes after they read them (a host unit's speculation
    that read them after the change sees the same values, commits, and is right; the
    counts would depend on the worker's timing)."""
    losses = []
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accumulate == 0
        hold = hetstore.no_sync(model) if no_sync and not last else contextlib.nullcontext()
        with hold:
            loss = model(x, y) / accumulate
            (opt.scale_loss(loss) if fp16 else loss).backward()
        losses.append(loss.item())
        if not last:
            continue
        if wait_worker:
            finish_steps_taken_ahead(opt)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        if between is not None:
            between(model, opt)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def finish_steps_taken_ahead(opt) -> None:
    ahead = opt.step_ahead
    if ahead is not None:
        for spec in ahead.pending().values():
            spec.future.result()


def assert_bitwise(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def assert_same_optimizer_state(a, b):
    """Step counters and every state tensor, bit for bit (torch's format)."""
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        assert sa[index].keys() == sb[index].keys(), index
        for key, value in sa[index].items():
            assert torch.equal(value, sb[index][key]), (index, key)


def train_both(build, data, **train_kwargs) -> list[tuple]:
    """Train ``build(True)`` and ``build(False)`` (each a fresh model and optimizer, the
    two ways to compare) on ``data`` with :func:`train` (``scheduler``: made from the
    optimizer); the losses and the weights must be the same, bit for bit. Returns each
    run's (model, optimizer, losses), the ``True`` one first."""
    runs = []
    for flag in (True, False):
        model, opt = build(flag)
        kwargs = dict(train_kwargs)
        if "scheduler" in kwargs:
            kwargs["scheduler"] = kwargs["scheduler"](opt)
        runs.append((model, opt, train(model, opt, data, **kwargs)))
    (first, _, first_losses), (second, _, second_losses) = runs
    assert first_losses == second_losses
    assert_bitwise(first, second)
    return runs
