"""Where each unit's step may run is the step policy's (hetstore.optim.policy), asked by
the runtime's arrangement and by the planner's cost model alike: for the model as
placed, the units the planner prices as stepped away from ``optimizer.step()`` are the
ones the runtime's step ahead takes."""

from __future__ import annotations

from dataclasses import replace

import pytest

import hetstore
from hetstore import OffloadConfig
from hetstore.optim import policy
from hetstore.planner import cost
from tests.models.gpt import GPT
from tests.parity import adamw
from tests.planner.helpers import CPU, GPU


@pytest.mark.parametrize(
    "placement",
    [
        dict(offload_param="disk", offload_optimizer="disk"),
        dict(offload_param="cpu", offload_optimizer="cpu"),
        dict(offload_param="cpu", offload_optimizer="disk"),
        dict(auto_offload=True, max_device_memory=250 * 2**10, offload_cpu_size=700 * 2**10),
    ],
    ids=["disk", "host", "host params, disk states", "auto"],
)
@pytest.mark.parametrize("overlap", [True, False])
def test_the_planner_prices_the_steps_the_runtime_takes_ahead(tmp_path, placement, overlap):
    model = GPT(width=32, depth=6)
    config = OffloadConfig(
        device="cpu",
        enable_pinned_mem=False,
        offload_path=str(tmp_path),
        overlap_step=overlap,
        step_in_forward=False,
        activation_min_bytes=0,
        **placement,
    )
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), config)
    runtime = hetstore.state_of(model).runtime
    trace, plan = runtime.trace, runtime.plan
    modes = cost.step_modes(trace)
    priced = set()
    for u, planned in zip(trace.units, plan.units, strict=True):
        site = cost.step_site(u, planned.choice)
        if policy.streamed_ahead(site, modes):
            priced.add(u.name)
    ahead = optimizer.step_ahead
    taken = set() if ahead is None else {s.unit.name for s in ahead.unit_steps}
    assert priced == taken
    if overlap and placement.get("offload_param") == "disk":
        assert taken  # (disk units: not two empty sets)


@pytest.mark.parametrize("copied", [True, False], ids=["fetch-copies", "cpu-device"])
def test_the_planner_prices_the_host_steps_the_runtime_takes_in_backward(
    tmp_path, monkeypatch, copied
):
    """``step_in_backward`` with everything in host memory: the units the planner prices
    as stepped during backward are those a backward hands to the worker: every block
    but one with a frozen weight, not the root, where fetches copy (as on a GPU); none
    on a CPU device, whose parameters are the home itself."""
    from hetstore.runtime.unit import Unit
    from tests.models.gpt import batches

    if copied:
        monkeypatch.setattr(Unit, "fetches_in_place", property(lambda self: False))
    model = GPT(width=32, depth=6)
    model.blocks[2].fc.weight.requires_grad_(False)
    config = OffloadConfig(
        device="cpu",
        enable_pinned_mem=False,
        offload_path=str(tmp_path),
        offload_param="cpu",
        offload_optimizer="cpu",
        step_in_backward=True,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = hetstore.offload(model, adamw(trainable), config)
    runtime = hetstore.state_of(model).runtime
    # (a manual plan's trace has no machine rates: the planner prices it for one)
    trace = replace(runtime.trace, machine=GPU if copied else CPU)
    plan = runtime.plan
    priced = {
        u.name
        for u, planned in zip(trace.units, plan.units, strict=True)
        if cost.stepped_in_backward(u, planned.choice, trace)
    }
    x, y = batches(1, vocab=64)[0]
    model(x, y).backward()
    taken = {job.unit.name for job in optimizer.step_ahead.consumed().values()}
    optimizer.step()
    assert priced == taken
    assert len(taken) == (len(runtime.units) - 2 if copied else 0)
