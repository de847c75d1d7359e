"""The cost model alone: memory per tier and step time of given choices."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from hetstore.planner import Trace, UnitChoice, estimate
from hetstore.planner.cost import memory, times
from hetstore.planner.plan import Capacities, Plan
from hetstore.tier import Tier
from tests.planner.helpers import CPU, GPU, MiB, gpt_like, unit


def test_everything_on_device_counts_every_state_and_activation():
    trace = gpt_like(machine=CPU)
    e = estimate(trace, [UnitChoice()] * len(trace.units), 1)
    states = trace.state_bytes
    saved = sum(u.saved_bytes for u in trace.units)
    # backward begins with the root's head, every activation still there, and the
    # gradient of the root's largest parameter in flight; a block's largest (larger
    # here) is in flight only once the activations after it are gone
    grad = [u.max_param_numel * u.compute_itemsize for u in trace.units]
    before = [sum(u.saved_bytes for u in trace.units[: k + 1]) for k in range(len(grad))]
    assert trace.units[-1].is_root and grad[-1] < max(grad)
    assert e.device == states + max(b + g for b, g in zip(before, grad, strict=True))
    assert e.device == states + saved + grad[-1]
    # the planner's fit adds the two moments' extras up: a bound for its search
    assert memory(trace, [UnitChoice()] * len(trace.units), 1, 32 << 20)[Tier.DEVICE] >= e.device
    assert e.host == e.disk == 0
    assert e.compute_s == sum(u.forward_s + u.backward_s for u in trace.units)
    assert e.stall_s == e.exposed_s == 0


@pytest.mark.parametrize(
    "machine, where, ahead",
    [
        (GPU, "cpu", True),  # copied to the device on the side stream, depth ahead
        (GPU, "disk", False),  # prefetched into host staging, fetched when used
        (CPU, "cpu", False),  # nothing is copied ahead on a CPU device
    ],
)
def test_offloaded_params_leave_a_working_set_of_what_prefetch_puts_on_the_device(
    machine, where, ahead
):
    # without activations, the device peaks while a block runs: its copy, those
    # prefetched beside it, and its largest gradient in flight
    trace = gpt_like(machine=machine)
    trace = replace(
        trace,
        units=tuple(replace(u, saved_bytes=0, largest_saved_bytes=0) for u in trace.units),
    )
    blocks = [UnitChoice(param=where) if not u.is_root else UnitChoice() for u in trace.units]
    base = estimate(trace, [UnitChoice()] * len(trace.units), 1)
    block = trace.units[0].param_bytes
    for depth in (0, 1, 2):
        e = estimate(trace, blocks, depth)
        held = depth + 1 if ahead else 1
        assert base.device - e.device == 4 * block - held * block, depth
        assert (e.host if where == "cpu" else e.disk) == 4 * block


def test_blocks_copies_and_the_end_of_forwards_activations_peak_apart():
    """At the end of forward every kept activation is on the device and no block runs;
    while a block runs backward, the activations after it are gone. The plan's figure is
    the larger of the two moments; the planner's fit, their sum."""
    trace = gpt_like(machine=CPU)
    n = len(trace.units)
    blocks_host = [UnitChoice(param="cpu") if not u.is_root else UnitChoice() for u in trace.units]
    e = estimate(trace, blocks_host, 0)
    no_saved = replace(
        trace,
        units=tuple(replace(u, saved_bytes=0, largest_saved_bytes=0) for u in trace.units),
    )
    block = trace.units[0].param_bytes
    grad = [u.max_param_numel * u.compute_itemsize for u in trace.units]
    saved = [u.saved_bytes for u in trace.units]
    # the model data alone: what the estimate without activations holds besides its own
    # peak moment (a block's copy and its largest gradient)
    model_data = estimate(no_saved, blocks_host, 0).device - (block + max(grad[:-1]))
    moments = [sum(saved)] + [
        sum(saved[: k + 1]) + grad[k] + (block if not trace.units[k].is_root else 0)
        for k in range(n)
    ]
    assert e.device == model_data + max(moments)
    summed = memory(trace, blocks_host, 0, 32 << 20)[Tier.DEVICE]
    assert summed == model_data + block + max(sum(saved[: k + 1]) + grad[k] for k in range(n))
    assert e.device < summed


def test_a_cpu_backward_restores_a_whole_nodes_saved_tensors():
    """On a CPU device each offloaded saved tensor comes back as autograd unpacks it, a
    node's together (attention: q, k, v, its output), so the restore the device holds
    is the largest node's, not the largest tensor's. They are dropped once the node has
    run, before the gradients it made are counted (and moved out): the restore and a
    gradient are never held at once (measured on the runtime's accounting: a GPT block's
    backward peaked at its working copy plus its largest restore, 361.75 KiB, as now
    predicted; adding the largest gradient had predicted 424.75 KiB)."""
    trace = gpt_like(machine=CPU)
    offloaded = [UnitChoice(activations="cpu")] * len(trace.units)
    grad = max(u.max_param_numel * u.compute_itemsize for u in trace.units)

    def with_node(nbytes):
        units = tuple(replace(u, largest_node_bytes=nbytes) for u in trace.units)
        return estimate(replace(trace, units=units), offloaded, 0).device

    assert with_node(grad + 3 * MiB) == with_node(grad) + 3 * MiB  # the largest node's
    assert with_node(grad // 2) == with_node(grad)  # a gradient alone, below it


def test_without_a_machine_every_prefetch_is_counted_on_the_device():
    trace = gpt_like(machine=None)
    blocks = [UnitChoice(param="disk") if not u.is_root else UnitChoice() for u in trace.units]
    everything = memory(trace, [UnitChoice()] * len(trace.units), 2, 2**24)[Tier.DEVICE]
    block = trace.units[0].param_bytes
    assert everything - memory(trace, blocks, 2, 2**24)[Tier.DEVICE] == 4 * block - 3 * block


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


def test_a_host_home_costs_no_fetch_copy_on_a_cpu_device_and_a_copy_on_a_gpu():
    """On a CPU device a fetch uses a home in host memory in place (Unit.fetch); an
    accelerator copies it in: two fetches a block (forward, backward), one for the root."""
    for machine in (CPU, replace(GPU, copies_overlap=False)):  # a GPU copy that stalls
        trace = gpt_like(machine=machine)
        kept = estimate(trace, [UnitChoice(optimizer="cpu") for _ in trace.units], 1)
        fetched = estimate(trace, [UnitChoice("cpu", "cpu") for _ in trace.units], 1)
        copies = sum(
            (1 if u.is_root else 2) * u.param_bytes / machine.to_device for u in trace.units
        )
        expected = 0.0 if machine.device == "cpu" else copies
        assert abs((fetched.stall_s - kept.stall_s) - expected) < 1e-12


def test_slower_tiers_predict_slower_steps():
    trace = gpt_like(machine=GPU)
    n = len(trace.units)
    steps = [
        estimate(trace, [UnitChoice(optimizer=t, param="none") for _ in range(n)], 1).step_s
        for t in ("none", "cpu", "disk")
    ]
    assert steps[0] < steps[1] < steps[2]


# ---------------------------------------------------------------- stepping during backward
def disk_trace(forward_s: float, machine=GPU, root_trainable=True):
    blocks = [unit(f"blocks.{i}", 4 * MiB, forward_s=forward_s) for i in range(4)]
    root = unit("root", 2 * MiB, forward_s=forward_s, root=True)
    if not root_trainable:
        root = replace(root, trainable_numel=0)
    return Trace(units=(*blocks, root), machine=machine)


ON_DISK = UnitChoice(param="disk", optimizer="disk")


def test_disk_steps_hide_behind_a_long_backward_except_the_roots():
    """Backward far longer than a unit's step: every block's step is done before
    backward ends; the root's gradients come last, so its step is never hidden."""
    trace = disk_trace(forward_s=10.0, root_trainable=False)
    choices = [ON_DISK] * 5
    serial = estimate(trace, choices, 1, overlap=False)
    e = estimate(trace, choices, 1)
    assert serial.optimizer_hidden_s == 0 and serial.optimizer_s > 0
    assert e.optimizer_hidden_s == pytest.approx(serial.optimizer_s)
    assert e.optimizer_s == pytest.approx(0.0, abs=1e-12)
    assert e.step_without_overlap_s == pytest.approx(serial.step_s)

    with_root = disk_trace(forward_s=10.0)
    serial = estimate(with_root, choices, 1, overlap=False)
    e = estimate(with_root, choices, 1)
    root_alone = estimate(with_root, [UnitChoice()] * 4 + [ON_DISK], 1, overlap=False)
    blocks_on_device = estimate(with_root, [UnitChoice()] * 5, 1, overlap=False)
    root_step = root_alone.optimizer_s - (blocks_on_device.optimizer_s - 2 * MiB / GPU.device_step)
    assert e.optimizer_s == pytest.approx(root_step)
    assert e.optimizer_hidden_s == pytest.approx(serial.optimizer_s - root_step)


def test_the_roots_step_is_not_hidden_behind_the_next_forward_while_blocks_step_in_backward():
    """With overlap_step the runtime steps the root in backward too, when its gradients
    are final at backward's end, and optimizer.step() waits for it (StepAhead.grads_final
    takes every disk unit): step_in_forward hides nothing more of a step without a clip
    that bites. (The policy had the root's step in the next forward, which the runtime
    never did, so the planner hid it there.)"""
    trace = disk_trace(forward_s=10.0)
    choices = [ON_DISK] * 5
    in_forward = estimate(replace(trace, step_in_forward=True), choices, 1)
    not_in_forward = estimate(replace(trace, step_in_forward=False), choices, 1)
    assert in_forward.optimizer_s > 0  # the root's step, exposed
    assert in_forward.optimizer_s == pytest.approx(not_in_forward.optimizer_s)
    assert in_forward.optimizer_hidden_s == pytest.approx(not_in_forward.optimizer_hidden_s)


def test_nothing_hides_behind_a_backward_that_takes_no_time():
    e = estimate(disk_trace(forward_s=0.0), [ON_DISK] * 5, 1)
    assert e.optimizer_hidden_s == 0


def test_on_a_cpu_device_the_workers_arithmetic_is_not_hidden():
    """The worker's fused step takes cores from backward on a CPU device."""
    gpu_like = replace(CPU, device="cuda")
    hidden = {
        m.device: estimate(disk_trace(10.0, m, root_trainable=False), [ON_DISK] * 5, 1)
        for m in (CPU, gpu_like)
    }
    arithmetic = 4 * 4 * MiB / CPU.host_step
    assert hidden["cpu"].optimizer_hidden_s == pytest.approx(
        hidden["cuda"].optimizer_hidden_s - arithmetic
    )


def test_units_not_on_disk_are_stepped_after_backward():
    choices = [UnitChoice(param="cpu", optimizer="cpu")] * 5
    assert estimate(disk_trace(10.0), choices, 1).optimizer_hidden_s == 0


def test_the_plan_shows_the_overlap():
    trace = disk_trace(forward_s=10.0)
    plan = Plan.build(trace, [ON_DISK] * 5, 1, Capacities(None, None, None), "manual")
    assert "hides" in plan.table() and "without it the step would take" in plan.table()


def test_overlap_step_off_in_the_trace_hides_nothing():
    """``overlap_step=False`` reaches the cost model through the trace."""
    trace = replace(disk_trace(forward_s=10.0), step_overlap=False)
    e = estimate(trace, [ON_DISK] * 5, 1)
    assert e.optimizer_hidden_s == 0
    assert e.step_s == estimate(disk_trace(forward_s=10.0), [ON_DISK] * 5, 1).step_without_overlap_s
    assert Trace.from_json(trace.to_json()).step_overlap is False


def test_step_in_backward_keeps_no_gradients_on_disk():
    """``step_in_backward``: units with states and parameters on disk hold no gradient
    there (two shadows instead of one: the unit being stepped, and one awaiting its
    commit), and their steps neither write nor read gradients."""
    trace = disk_trace(forward_s=0.0, machine=CPU)
    consumed = replace(trace, step_in_backward=True)
    before = estimate(trace, [ON_DISK] * 5, 1)
    after = estimate(consumed, [ON_DISK] * 5, 1)
    grads = sum(u.grad_bytes for u in trace.units)
    shadow = max(u.numel * 4 + u.state_bytes for u in trace.units)  # fp32: home is the master
    assert before.disk - after.disk == grads - shadow
    # no gradient writes beside backward, no gradient reads in the (disk-bound) steps
    assert after.exposed_s < before.exposed_s
    read_back = sum(u.grad_bytes / CPU.disk_read for u in trace.units)
    assert before.optimizer_s - after.optimizer_s == pytest.approx(read_back)
    # units not on disk keep their gradients where they are
    host = [UnitChoice(optimizer="cpu")] * 5
    assert estimate(consumed, host, 1).host == estimate(trace, host, 1).host
    assert Trace.from_json(consumed.to_json()).step_in_backward is True


def test_a_compact_state_format_adds_its_codec_to_the_host_step():
    """8-bit states (2.03 bytes for Adam's two moments): each state element is decoded
    before the fused kernel and encoded after it, at the machine's measured codec rate;
    fp32 states (8 bytes) are stepped as stored and cost nothing more."""
    machine = replace(CPU, state_codec=0.1e9)
    fp32 = Trace(units=(unit("b", MiB), unit("root", MiB, root=True)), machine=machine)
    compact = replace(fp32, units=tuple(replace(u, state_itemsize=2.03) for u in fp32.units))
    host = [UnitChoice(optimizer="cpu")] * 2
    n = sum(u.trainable_numel for u in fp32.units)
    plain = estimate(fp32, host, 1).optimizer_s  # the step, and the weights sent back
    assert plain >= n / CPU.host_step
    assert estimate(compact, host, 1).optimizer_s == pytest.approx(plain + 2 * n / 0.1e9)
    # no codec rate measured (a trace from before it was): the step alone
    assert estimate(replace(compact, machine=CPU), host, 1).optimizer_s == pytest.approx(plain)


def test_a_master_that_is_the_home_is_read_from_disk_by_forward_and_backward():
    """fp32 parameters with their optimizer on disk: the master is the home, and the
    parameter stager reads it from disk for forward and again for backward, so a slower
    disk read shows in the transfers (the step's own reads aside)."""
    units = tuple(replace(u, compute_itemsize=4) for u in disk_trace(0.0).units)
    slow = Trace(units=units, machine=replace(GPU, disk_read=GPU.disk_read / 10))
    fast = Trace(units=units, machine=GPU)
    assert estimate(slow, [ON_DISK] * 5, 1).exposed_s > estimate(fast, [ON_DISK] * 5, 1).exposed_s
    # and its host staging is counted: depth + 1 buffers of the largest home
    host = estimate(fast, [ON_DISK] * 5, 1).host
    assert host - estimate(fast, [ON_DISK] * 5, 0).host == max(u.param_bytes for u in units)


def test_host_buffers_and_disk_regions_are_counted_in_whole_pages():
    """A unit whose arrays are not multiples of 4 KiB: each array (master, gradients,
    each state) takes whole pages on disk, as the disk tier allocates regions."""
    odd = 1000  # elements: 4000 bytes in fp32, one page each
    trace = Trace(units=(unit("b", odd, itemsize=4), unit("root", 0, root=True)), machine=CPU)
    e = estimate(trace, [UnitChoice("disk", "disk"), UnitChoice()], 1)
    page = 4096
    arrays = 1 + 1 + 2  # master (the home), gradients, two states
    shadow = 1 + 2  # master and states
    assert e.disk == (arrays + shadow) * page


def test_the_codec_rate_is_measured_for_compact_formats_only():
    """fp32 states have no codec (0: nothing added); the compact ones get a rate (its
    size is a timing, left to the planner benchmark)."""
    from hetstore.planner.machine import codec_rate

    assert codec_rate("fp32") == 0.0
    assert all(0 < codec_rate(name, 1 << 16) < float("inf") for name in ("bf16", "8bit"))


def test_activations_on_host_and_the_disk_staging_peak_at_different_moments():
    # blocks 0-1 send activations to disk, 2-3 keep them on host: the host holds the
    # disk staging while blocks 0-1 run (forward and backward) and blocks 2-3's
    # activations from their forward to their backward, never both at once
    trace = gpt_like(machine=CPU, saved=16 * MiB)
    tiers = ["disk", "disk", "cpu", "cpu"]
    choices = [UnitChoice(activations=t) for t in tiers] + [UnitChoice()]
    assert estimate(trace, choices, 1).host == 32 * MiB  # was 64 (the sum)
    # interleaved: block 2 runs with block 1 resident on host and block 2's staging
    tiers = ["disk", "cpu", "disk", "cpu"]
    choices = [UnitChoice(activations=t) for t in tiers] + [UnitChoice()]
    assert estimate(trace, choices, 1).host == 48 * MiB  # 16 + 16 (window 1-2) + 16
    # the activations on disk and the step's shadow are not on disk at the same time
    choices = [UnitChoice(optimizer="disk", activations="disk") for _ in tiers] + [UnitChoice()]
    e = estimate(replace(trace, step_overlap=False), choices, 1)
    states = sum(u.master_bytes + u.grad_bytes + u.state_bytes for u in trace.units[:4])
    assert e.disk == states + 4 * 16 * MiB  # the shadow (one unit's) is smaller


ON_HOST = UnitChoice(param="cpu", optimizer="cpu")


def test_host_units_are_not_stepped_ahead_in_backward():
    """Units with states in host memory are not stepped speculatively during backward
    (``overlap_step``; optim.in_memory says why): nothing of their steps hides behind
    backward, on a GPU or a CPU device; what is left is the ordinary step."""
    for machine in (GPU, CPU):
        trace = disk_trace(forward_s=10.0, machine=machine)
        serial = estimate(trace, [ON_HOST] * 5, 1, overlap=False)
        e = estimate(replace(trace, step_overlap=True), [ON_HOST] * 5, 1)
        assert e.optimizer_hidden_s == 0
        assert e.optimizer_s == pytest.approx(serial.optimizer_s)


HOST_HOME = UnitChoice(param="cpu", optimizer="cpu")


def test_host_steps_in_backward_hide_behind_it_except_the_roots():
    """``step_in_backward``: each block's ordinary host step runs in place on the worker
    once its gradients are final, behind the rest of backward; the root, resident until
    backward's end, is stepped in optimizer.step() (or, with host steps in the next
    forward, there: counted once). On a CPU device the parameters are the home itself,
    which backward may still read: nothing is stepped in backward, nothing hidden."""
    root_n = 2 * MiB
    base = disk_trace(forward_s=10.0)
    serial = estimate(base, [HOST_HOME] * 5, 1, overlap=False)
    inside = estimate(replace(base, step_in_backward=True), [HOST_HOME] * 5, 1)
    assert inside.optimizer_s == pytest.approx(root_n / GPU.host_step)
    assert inside.optimizer_s + inside.optimizer_hidden_s == pytest.approx(serial.optimizer_s)
    both = replace(base, step_in_backward=True, step_in_forward_memory=True)
    e = estimate(both, [HOST_HOME] * 5, 1)
    assert e.optimizer_hidden_s == pytest.approx(inside.optimizer_hidden_s)
    assert e.optimizer_s == pytest.approx(root_n / GPU.host_step)  # its wait in forward
    on_cpu = replace(disk_trace(10.0, CPU), step_in_backward=True)
    assert estimate(on_cpu, [HOST_HOME] * 5, 1).optimizer_hidden_s == 0


def test_host_steps_in_the_next_forward_hide_behind_it_on_a_gpu_except_the_roots():
    """``step_in_forward`` on a GPU: host units' ordinary steps run in place beside the
    next forward, which takes the root first (its step hides behind nothing) and each
    block after its own step. Not on a CPU device."""
    n, root_n = 4 * MiB, 2 * MiB
    base = disk_trace(forward_s=10.0)
    serial = estimate(base, [HOST_HOME] * 5, 1, overlap=False)
    forward = estimate(replace(base, step_in_forward_memory=True), [HOST_HOME] * 5, 1)
    assert forward.optimizer_hidden_s == pytest.approx(4 * n / GPU.host_step)
    assert forward.optimizer_s == pytest.approx(root_n / GPU.host_step)
    assert forward.optimizer_s + forward.optimizer_hidden_s == pytest.approx(serial.optimizer_s)
    on_cpu = replace(disk_trace(10.0, CPU), step_in_forward_memory=True)
    assert estimate(on_cpu, [HOST_HOME] * 5, 1).optimizer_hidden_s == 0
    # the disk units' step_in_forward ('auto', the default) leaves host units' steps be
    disk_only = replace(base, step_in_forward=True)
    assert estimate(disk_only, [HOST_HOME] * 5, 1).optimizer_s == pytest.approx(serial.optimizer_s)


def test_steps_left_after_backward_hide_behind_the_next_forward_except_the_roots(
    monkeypatch,
):
    """``step_in_forward`` without ``overlap_step``: every disk unit's step runs on
    beside the next forward, which fetches the root first (its step hides behind
    nothing) and then each block after its own step: a long forward hides the blocks'
    steps, as a long backward does with ``overlap_step``. With both, backward hides the
    blocks' and the forward nothing more. On a CPU device the worker's arithmetic counts
    against it. (Without reading ahead during backward: that takes the root's reads
    off the forward's path too, tested below.)"""
    from hetstore.optim import policy
    from hetstore.planner import cost

    monkeypatch.setattr(policy, "READ_AHEAD_UNITS", 0)
    monkeypatch.setattr(cost, "GRAD_STAGING_SLOTS", 0)  # (tested below)
    choices = [ON_DISK] * 5
    forward_only = replace(disk_trace(forward_s=10.0), step_overlap=False, step_in_forward=True)
    serial = estimate(forward_only, choices, 1, overlap=False)
    in_backward = estimate(disk_trace(forward_s=10.0), choices, 1)  # the root's is left
    e = estimate(forward_only, choices, 1)
    assert 0 < in_backward.optimizer_s < serial.optimizer_s
    assert e.optimizer_s == pytest.approx(in_backward.optimizer_s)
    assert e.optimizer_hidden_s == pytest.approx(serial.optimizer_s - in_backward.optimizer_s)
    both = estimate(replace(forward_only, step_overlap=True), choices, 1)
    assert both.optimizer_s == pytest.approx(in_backward.optimizer_s)
    assert Trace.from_json(forward_only.to_json()).step_in_forward is True

    on_cpu = replace(disk_trace(10.0, CPU), step_overlap=False, step_in_forward=True)
    cpu_serial = estimate(on_cpu, choices, 1, overlap=False)
    cpu = estimate(on_cpu, choices, 1)
    arithmetic = (4 * 4 * MiB + 2 * MiB) / CPU.host_step  # every unit's, root's too
    root = Trace(units=(on_cpu.units[-1],), machine=CPU)
    root_step = estimate(root, [ON_DISK], 1, overlap=False).optimizer_s
    assert cpu.optimizer_hidden_s == pytest.approx(cpu_serial.optimizer_s - root_step - arithmetic)


def test_the_next_forward_reads_no_gradient_still_in_the_stagers_buffers(monkeypatch):
    """``GradStager.lend_written``: the steps in the next forward of the units whose
    backward ended last (the root, and the first blocks that forward uses, as many as
    the stager has buffers) borrow their gradients from the stager instead of reading
    them back. A forward long enough to hide the blocks' steps waits for the root's
    only: shorter by the root's gradient read."""
    from hetstore.optim import policy
    from hetstore.planner import cost

    monkeypatch.setattr(policy, "READ_AHEAD_UNITS", 0)
    choices = [ON_DISK] * 5
    forward_only = replace(disk_trace(forward_s=10.0), step_overlap=False, step_in_forward=True)
    assert cost._grads_kept(forward_only, choices) == [4, 0, 1]  # the root first
    kept = estimate(forward_only, choices, 1)
    monkeypatch.setattr(cost, "GRAD_STAGING_SLOTS", 0)
    read_back = estimate(forward_only, choices, 1)
    root = forward_only.units[-1]
    saved = root.grad_bytes / forward_only.machine.inward(Tier.DISK)
    assert kept.optimizer_s == pytest.approx(read_back.optimizer_s - saved)


def test_a_step_in_the_next_forward_saves_that_forwards_parameter_reads():
    """A unit stepped during the next forward leaves its new parameters in staging for
    that forward's fetch: each disk home is read once a step (in backward; the root,
    fetched once, not at all) instead of twice. Not where frozen parameters without a
    master (LoRA's base) have to be read anyway. Without prefetch (depth 0) every read
    is a stall, so the stall shows exactly what is no longer read."""
    choices = [ON_DISK] * 5
    base = replace(disk_trace(forward_s=1e-3), step_overlap=False)
    in_forward = replace(base, step_in_forward=True)
    _, stall_before, *_ = times(base, choices, 0, overlap=True)
    _, stall_after, *_ = times(in_forward, choices, 0, overlap=True)
    one_read_each = sum(u.param_bytes for u in base.units) / GPU.disk_read
    assert stall_before - stall_after == pytest.approx(one_read_each)

    lora = replace(
        in_forward, units=tuple(replace(u, frozen_compute_numel=1024) for u in base.units)
    )
    lora_base = replace(lora, step_in_forward=False)
    assert times(lora, choices, 0, overlap=True)[1] == pytest.approx(
        times(lora_base, choices, 0, overlap=True)[1]
    )


def test_the_plan_predicts_a_clip_that_bites_and_what_step_in_forward_saves_then(
    monkeypatch,
):
    """A clip that bites rolls back every step taken in backward: the estimate gives the
    step time then, with the disk units' steps after backward (as overlap_step=False
    predicts it, less the first units' reads, read ahead during backward) and with
    step_in_forward (as a trace without overlap_step but with it predicts it), and the
    plan says so. Nothing when no unit is stepped on disk."""
    from hetstore.optim import policy

    choices = [ON_DISK] * 5
    trace = disk_trace(forward_s=0.05)
    after, in_forward = estimate(trace, choices, 1).clip_bites_s
    serial = estimate(trace, choices, 1, overlap=False).step_s
    first = trace.units[:4]  # optimizer.step()'s order: the units'
    reads = sum((u.master_bytes + u.state_bytes) / GPU.disk_read for u in first)
    assert after == pytest.approx(serial - reads)
    assert estimate(trace, choices, 1).host_read_ahead == sum(
        u.master_bytes + u.state_bytes for u in first
    )
    with monkeypatch.context() as patch:
        patch.setattr(policy, "READ_AHEAD_UNITS", 0)
        assert estimate(trace, choices, 1).clip_bites_s[0] == pytest.approx(serial)
    forward_only = replace(trace, step_overlap=False, step_in_forward=True)
    assert in_forward == pytest.approx(estimate(forward_only, choices, 1).step_s)
    assert in_forward < after
    text = Plan.build(trace, choices, 1, Capacities(None, None, None), "manual").table()
    assert "clip that bites" in text and "step_in_forward=True" in text

    already = replace(trace, step_in_forward=True)
    after_on, in_forward_on = estimate(already, choices, 1).clip_bites_s
    assert after_on == pytest.approx(in_forward_on) == pytest.approx(in_forward)
    text = Plan.build(already, choices, 1, Capacities(None, None, None), "manual").table()
    assert "clip that bites" in text and "step_in_forward=True" not in text

    on_host = [UnitChoice(param="cpu", optimizer="cpu")] * 5
    assert estimate(trace, on_host, 1).clip_bites_s is None
    assert estimate(replace(trace, step_in_backward=True), choices, 1).clip_bites_s is None


def test_the_first_units_read_ahead_during_backward_shorten_a_disk_bound_forward(
    monkeypatch,
):
    """Every disk unit stepped during the next forward, whose compute is short: the
    forward waits for the worker, and reading the first READ_AHEAD_UNITS units' masters
    and states during backward takes those reads off its path. The plan reports the
    host memory it takes; none without step_in_forward or with compact states."""
    from hetstore.optim import policy

    choices = [ON_DISK] * 5
    # a host step far faster than the disk: each step is its reads plus its writes
    fast_host = replace(GPU, host_step=1e15)
    trace = replace(
        disk_trace(forward_s=1e-4, machine=fast_host), step_overlap=False, step_in_forward=True
    )
    with_ahead = estimate(trace, choices, 1)
    monkeypatch.setattr(policy, "READ_AHEAD_UNITS", 0)
    without = estimate(trace, choices, 1)
    monkeypatch.undo()
    first = [trace.units[-1], *trace.units[:3]]  # the root, then the first blocks
    reads = sum((u.master_bytes + u.state_bytes) / GPU.disk_read for u in first)
    assert without.step_s - with_ahead.step_s == pytest.approx(reads)
    assert with_ahead.host_read_ahead == sum(u.master_bytes + u.state_bytes for u in first)
    text = Plan.build(trace, choices, 1, Capacities(None, None, None), "manual").table()
    assert "read during backward" in text
    overlap_off = replace(trace, step_in_forward=False)  # no step ahead: nothing reads ahead
    assert estimate(overlap_off, choices, 1).host_read_ahead == 0


def test_a_trace_saved_before_the_host_speculation_went_still_loads():
    """A trace saved by a version that still priced host units stepped in backward names
    a rate (``host_copy``, and its probe's spread) and keys (``step_overlap_memory``,
    ``pace_memory_steps``) no longer kept: it loads, without them."""
    trace = replace(disk_trace(forward_s=0.01), machine=replace(GPU, spread=(("matmul", 0.1),)))
    data = json.loads(trace.to_json())
    data["machine"]["host_copy"] = 4e9
    data["machine"]["spread"].append(["host copy", 0.2])
    data["step_overlap_memory"] = data["pace_memory_steps"] = True
    loaded = Trace.from_json(json.dumps(data))
    assert loaded.machine == trace.machine
    assert loaded == trace


def test_disk_steps_in_backward_never_cost_on_a_cpu_device():
    """On a CPU device the worker's arithmetic shares backward's cores: a backward too
    short for the disk units' steps hides nothing of them, and the overlap never prices
    the step above the one without it (what the worker did not finish is what the
    ordinary step would have done)."""
    trace = replace(disk_trace(forward_s=0.0025, machine=CPU), step_in_forward=False)
    serial = estimate(trace, [ON_DISK] * 5, 1, overlap=False)
    e = estimate(trace, [ON_DISK] * 5, 1)
    assert e.optimizer_hidden_s == 0
    assert e.optimizer_s == pytest.approx(serial.optimizer_s)
    plan = Plan.build(trace, [ON_DISK] * 5, 1, Capacities(None, None, None), "manual")
    assert "costs" not in plan.table()


@pytest.mark.parametrize(
    "make_optimizer, grad, priced",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "cpu", True),
        (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), "cpu", False),  # not stepped flat
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "none", False),  # gradients on the GPU
    ],
    ids=["adamw", "not-flat", "grads-on-device"],
)
def test_host_steps_in_the_next_forward_are_priced_where_the_runtime_takes_them(
    make_optimizer, grad, priced
):
    """On a GPU the runtime runs a host unit's step in the next forward only where it
    steps it flat from gradients in host memory (InMemoryUnitStep.steps_flat_in_memory):
    the trace says the same, so the planner hides no step the runtime would not."""
    from hetstore import OffloadConfig
    from hetstore.demo.gpt import GPT
    from hetstore.planner.tracer import model_data_trace

    model = GPT(width=32, depth=2, heads=2, vocab=64, ctx=16)
    config = OffloadConfig(offload_param="cpu", offload_optimizer="cpu", offload_grad=grad)
    trace = model_data_trace(model, config, GPU, optimizer=make_optimizer(model.parameters()))
    assert trace.step_in_forward_memory is priced
