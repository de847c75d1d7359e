"""Synthetic traces, machines and configurations the planner tests share (moved here from
test_planner and test_auto_offload, unchanged); benchmarks/planner_ladders.py uses them
too."""

from __future__ import annotations

import random

from hetstore import OffloadConfig
from hetstore.planner import Capacities, MachineRates, Trace, UnitChoice, UnitTrace, estimate

MiB = 1 << 20
GPU = MachineRates(
    to_device=20e9, from_device=20e9, disk_read=3e9, disk_write=2e9,
    host_step=1e9, device_step=50e9, flops=100e12, copies_overlap=True, device="cuda",
)  # fmt: skip
CPU = MachineRates(
    to_device=8e9, from_device=8e9, disk_read=1e9, disk_write=0.5e9,
    host_step=0.3e9, device_step=0.3e9, flops=50e9, copies_overlap=False, device="cpu",
)  # fmt: skip


def unit(name, numel, saved=0, forward_s=0.01, root=False, itemsize=2):
    return UnitTrace(
        name=name, numel=numel, trainable_numel=numel, compute_itemsize=itemsize,
        state_itemsize=8, saved_bytes=saved, forward_s=forward_s, backward_s=2 * forward_s,
        max_param_numel=numel // 4, is_root=root,
    )  # fmt: skip


def gpt_like(blocks=4, numel=4 * MiB, saved=16 * MiB, machine=GPU):
    units = [unit(f"blocks.{i}", numel, saved) for i in range(blocks)]
    units.append(unit("root", numel // 2, saved // 4, root=True))
    return Trace(units=tuple(units), machine=machine)


def caps(device=None, host=None, disk=None):
    return Capacities(device, host, disk)


def config(**kw):
    return OffloadConfig(device="cpu", **kw)


def all_none_peak(trace, tier="device"):
    return estimate(trace, [UnitChoice()] * len(trace.units), 1).peak(tier)


def random_trace(rng: random.Random, machine):
    units = [
        unit(
            f"b{i}",
            rng.randint(1, 64) * MiB // 8,
            rng.randint(0, 64) * MiB,
            forward_s=rng.uniform(1e-4, 1e-2),
        )
        for i in range(rng.randint(2, 6))
    ]
    units.append(unit("root", rng.randint(1, 16) * MiB // 8, rng.randint(0, 8) * MiB, root=True))
    return Trace(units=tuple(units), machine=machine)


def auto_config(tmp_path, **kw):
    return OffloadConfig(
        auto_offload=True,
        activation_min_bytes=0,
        offload_path=str(tmp_path),
        enable_pinned_mem=False,
        device="cpu",
        **kw,
    )
