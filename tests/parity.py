"""Plain PyTorch against the offloaded model: the configurations, the training loops and
the comparisons the tests share (moved here from test_host_offload, test_disk_offload and
test_load_weights, unchanged).

Tolerances: the offloaded optimizer runs torch's fused Adam/AdamW/SGD kernel on flat
per-unit buffers. Against a reference that uses the same fused kernel per parameter, the
math is the same element by element, so we compare at fp32 round-off (rtol 1e-6, atol
1e-7; measured: bitwise equal here). Against torch's default (for-loop) AdamW the kernels
round differently (~1e-7 relative per step), and Adam's m/sqrt(v) turns a 1e-7 difference
in a near-zero gradient into up to one lr of weight difference, so that comparison checks
losses at 1e-4 relative only.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import hetstore
from hetstore import OffloadConfig

TIGHT = dict(rtol=1e-6, atol=1e-7)


def config(param="cpu", optim="cpu", **kwargs):
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        enable_pinned_mem=False,
        device="cpu",
        **kwargs,
    )


def adamw(params, **kwargs):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True, **kwargs)


def run(model, optimizer, data, *, accumulate=1, clip=None, scheduler=None):
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        loss = model(x, y) / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            if hasattr(optimizer, "clip_grad_norm_"):
                norms.append(float(optimizer.clip_grad_norm_(clip)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses, norms


def assert_same_weights(ref: nn.Module, mine: nn.Module, **tol):
    ref_sd, mine_sd = ref.state_dict(), mine.state_dict()
    assert ref_sd.keys() == mine_sd.keys()
    for key in ref_sd:
        assert mine_sd[key].shape == ref_sd[key].shape, key
        torch.testing.assert_close(mine_sd[key], ref_sd[key], **(tol or TIGHT), msg=key)


def pair(factory, seed=0):
    torch.manual_seed(seed)
    ref = factory()
    return ref, copy.deepcopy(ref)


def train_both(factory, data, cfg=None, make_opt=adamw, **run_kwargs):
    """Train a plain model and its offloaded copy (same seed) on ``data``; return both
    models and each ``run`` result (losses, clip norms)."""
    ref, mine = pair(factory)
    ref_opt = make_opt(ref.parameters())
    mine, opt = hetstore.offload(mine, make_opt(mine.parameters()), cfg or config())
    ref_out = run(ref, ref_opt, data, **run_kwargs)
    out = run(mine, opt, data, **run_kwargs)
    return ref, mine, ref_out, out


def states_bytes(model):
    """fp32 params + grads + two Adam moments."""
    return 16 * sum(p.numel() for p in model.parameters())


def disk_config(path, param="disk", optim="disk", **kwargs):
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        offload_path=str(path),
        enable_pinned_mem=False,
        device="cpu",
        **kwargs,
    )


def train(model, optimizer, data):
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
