"""The cost model alone: memory per tier and step time of given choices."""

from __future__ import annotations

from hetstore.planner import Trace, UnitChoice, estimate
from tests.test_planner import CPU, GPU, MiB, gpt_like, unit


def test_everything_on_device_counts_every_state_and_activation():
    trace = gpt_like(machine=CPU)
    e = estimate(trace, [UnitChoice()] * len(trace.units), 1)
    states = trace.state_bytes
    saved = sum(u.saved_bytes for u in trace.units)
    one_grad = max(u.max_param_numel * u.compute_itemsize for u in trace.units)
    assert e.device == states + saved + one_grad
    assert e.host == e.disk == 0
    assert e.compute_s == sum(u.forward_s + u.backward_s for u in trace.units)
    assert e.stall_s == e.exposed_s == 0


def test_offloaded_params_leave_a_working_set_of_depth_plus_one_units():
    trace = gpt_like(machine=CPU)
    blocks_cpu = [UnitChoice(param="cpu") if not u.is_root else UnitChoice() for u in trace.units]
    base = estimate(trace, [UnitChoice()] * len(trace.units), 1)
    block = trace.units[0].param_bytes
    for depth in (0, 1, 2):
        e = estimate(trace, blocks_cpu, depth)
        assert base.device - e.device == 4 * block - (depth + 1) * block
        assert e.host == 4 * block


def test_fp32_parameters_alias_their_master():
    u = unit("b", MiB, itemsize=4)
    trace = Trace(units=(u, unit("root", MiB, root=True, itemsize=4)), machine=CPU)
    e = estimate(trace, [UnitChoice("cpu", "cpu"), UnitChoice()], 1)
    assert e.host == u.master_bytes + u.grad_bytes + u.state_bytes  # no second copy


def test_disk_optimizer_needs_host_staging_and_a_shadow():
    trace = gpt_like(machine=CPU)
    choices = [UnitChoice(optimizer="disk") for _ in trace.units]
    e = estimate(trace, choices, 1, chunk_bytes=MiB)
    u = max(trace.units, key=lambda u: u.master_bytes)
    on_disk = sum(x.master_bytes + x.grad_bytes + x.state_bytes for x in trace.units)
    assert e.disk == on_disk + u.master_bytes + u.state_bytes
    assert e.host == 3 * u.grad_bytes + 3 * 4 * MiB  # grads + 3 chunks of 4 arrays


def test_copies_stall_a_cpu_device_and_hide_behind_gpu_compute():
    for machine, stalls in ((CPU, True), (GPU, False)):
        trace = gpt_like(machine=machine)
        choices = [UnitChoice(activations="cpu") for _ in trace.units]
        e = estimate(trace, choices, 1)
        copies = sum(2 * u.saved_bytes / machine.to_device for u in trace.units)
        if stalls:
            assert abs(e.stall_s - copies) < 1e-12
        else:
            assert e.stall_s == 0 and e.exposed_s < copies


def test_slower_tiers_predict_slower_steps():
    trace = gpt_like(machine=GPU)
    n = len(trace.units)
    steps = [
        estimate(trace, [UnitChoice(optimizer=t, param="none") for _ in range(n)], 1).step_s
        for t in ("none", "cpu", "disk")
    ]
    assert steps[0] < steps[1] < steps[2]
