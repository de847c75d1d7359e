"""Measuring the machine the planner plans for: copy, disk, optimizer and FLOP rates.

Short probes (about a second in all), each the fastest of a few runs after a warm-up (see
``fastest_rate``): a 64 MiB copy (pinned host <-> device on CUDA, a memcpy on a CPU
"device"), a 64 MiB write and read through the disk tier's own engine (O_DIRECT) under
``offload_path``, a fused AdamW step over 4M fp32 elements on host (and on the device), a
compact state format's decode and encode of Adam's two states over as many, and a matmul
for the FLOP rate. How much slower each probe's median run was than its fastest is kept
(``MachineRates.spread``), and the share of the CPU other processes took meanwhile
(``others_busy``); a plan prints both: either high says the machine was busy while it
was measured, and a step then may take many times the prediction (the fastest run of a
probe that was slowed all along is slow too).
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import time

import torch

from hetstore._safefs import make_private_dir, open_root, removing_created_dirs
from hetstore.optim.state_format import decode, encode, state_format, stored_arrays
from hetstore.planner.plan import Capacities
from hetstore.planner.trace import MachineRates
from hetstore.tier import Tier
from hetstore.tiers.aio import AsyncIOEngine, DiskFile
from hetstore.tiers.hostmem import MappedBlock

__all__ = ["measure_machine", "machine_capacities", "fastest_rate"]

_PROBE = 64 << 20

# Timed runs of each probe after its warm-up, and the fastest is the rate. Why the
# fastest, not the median: on a shared machine (2 cores here, other jobs beside) another
# process only ever adds time to a run -- a preempted thread, a matmul's worker waiting
# at a barrier for a core, caches and memory bandwidth taken -- and never takes any
# away, so the fastest run is what this hardware does, and the figure that repeats from
# one run of `hetstore plan` to the next. The median was what the machine did under the
# load of that second: three identical plans of one GPT predicted 466 s, 6044 s and
# 3176 s per step (issue 49). Five runs: the probes stay about a second in all.
_REPEATS = 5


def fastest_rate(amount: float, run, repeats: int = _REPEATS, sync=lambda: None, before=None):
    """``(rate, spread)``: ``amount`` per second of the fastest of ``repeats`` runs of
    ``run`` after a warm-up, and how much longer the median run took (0.25: 25% longer;
    the median, not the slowest: one run preempted once is not a busy machine);
    ``before`` runs untimed before each."""
    run()
    sync()  # warm up
    seconds = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        sync()
        seconds.append(time.perf_counter() - start)
    fastest = max(min(seconds), 1e-9)
    return amount / fastest, statistics.median(seconds) / fastest - 1


def _copy_rates(device: torch.device):
    """``((rate, spread), (rate, spread))`` of copies to and from the device."""
    if device.type == "cuda":
        host = torch.empty(_PROBE, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(_PROBE, dtype=torch.uint8, device=device)
        sync = torch.cuda.synchronize
        to = fastest_rate(_PROBE, lambda: dev.copy_(host, non_blocking=True), sync=sync)
        back = fastest_rate(_PROBE, lambda: host.copy_(dev, non_blocking=True), sync=sync)
        return to, back
    a = torch.empty(_PROBE, dtype=torch.uint8)
    b = torch.empty(_PROBE, dtype=torch.uint8)
    rate = fastest_rate(_PROBE, lambda: b.copy_(a))
    return rate, rate


def _disk_rates(path: str):
    """``((rate, spread), (rate, spread))`` of reads and writes of one probe file in a
    private directory under ``path`` (created as the disk tier creates its own: see
    hetstore._safefs). The disk probed is the one training will use; ``path`` and the
    parents it lacked are removed again afterwards (``hetstore plan`` and ``bench`` left
    an empty ./offload behind)."""
    with removing_created_dirs(path):
        root_fd = open_root(path, "offload_path")
        name = f"hetstore-probe-{secrets.token_hex(4)}"
        try:
            dir_fd = make_private_dir(root_fd, name, os.path.join(path, name))
            try:
                return _probe_file(os.path.join(path, name, "probe"), dir_fd)
            finally:
                os.close(dir_fd)
                shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
        finally:
            os.close(root_fd)


def _probe_file(path: str, dir_fd: int):
    engine = AsyncIOEngine()
    block = MappedBlock(_PROBE)
    file = DiskFile(path, dir_fd=dir_fd)
    try:
        buffer = block.tensor[:_PROBE]
        buffer.fill_(1)
        write = fastest_rate(_PROBE, lambda: engine.submit_write(file, 0, buffer).wait(), repeats=3)
        read = fastest_rate(_PROBE, lambda: engine.submit_read(file, 0, buffer).wait(), repeats=3)
    finally:
        file.close()
        engine.close()
        block.release()
    return read, write


def _cold_caches(device: torch.device):
    """On a CPU, what evicts the CPU caches before a timed optimizer step: in training
    the step finds its states cold (a whole forward and backward ran since it last
    touched them), and a step timed on warm caches ran 1.6x faster than one on cold
    ones here."""
    if device.type != "cpu":
        return None
    sweep = torch.empty(_PROBE, dtype=torch.uint8)
    return lambda: sweep.fill_(1)


def _step_rate(device: torch.device, numel: int = 4 << 20):
    """``(rate, spread)`` of fused AdamW steps, in elements per second."""
    param = torch.zeros(numel, device=device, requires_grad=True)
    param.grad = torch.ones(numel, device=device)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    return fastest_rate(numel, opt.step, sync=sync, before=_cold_caches(device))


def codec_rate(format_name: str, numel: int = 4 << 20) -> float:
    """State elements per second the compact format ``format_name`` decodes to fp32 and
    encodes back, as a step of its states does around the fused kernel (measured on
    this 2-core CPU: 8-bit 0.38G state elements/s, bf16 2.9G, the fused AdamW step
    1.2G elements/s: the 8-bit codec of Adam's two states takes 6x the step itself); 0
    for fp32, which is stepped as stored."""
    return _codec(format_name, numel)[0]


def _codec(format_name: str, numel: int = 4 << 20):
    fmt = state_format(format_name)
    if fmt.exact:
        return 0.0, 0.0
    cpu = torch.device("cpu")
    scratch = torch.rand(numel)
    arrays = stored_arrays(fmt, numel)
    stored = {
        key: {suffix: torch.empty(n, dtype=dtype) for suffix, (dtype, n) in arrays.items()}
        for key in ("exp_avg", "exp_avg_sq")
    }

    def round_trip():
        for key, state in stored.items():
            encode(fmt, key, scratch, state[""], state.get("scales"))
            decode(fmt, key, state[""], state.get("scales"), scratch)

    return fastest_rate(numel * len(stored), round_trip, before=_cold_caches(cpu))


def _flop_rate(device: torch.device):
    """``(rate, spread)`` of one matmul in FLOP/s. On a CPU a 512 x 512 product takes
    about a millisecond: ten runs, so the fastest is not one lucky time slice."""
    n = 2048 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    return fastest_rate(2 * n**3, lambda: a @ b, repeats=2 * _REPEATS, sync=sync)


def measure_machine(
    device: torch.device | str, offload_path: str, state_format_name: str = "fp32"
) -> MachineRates:
    """Measure this machine's rates for ``device``, with disk probes under
    ``offload_path``, for optimizer states stored in ``state_format_name``."""
    device = torch.device(device)
    before, started = _busy_ticks(), time.monotonic()
    to_device, from_device = _copy_rates(device)
    disk_read, disk_write = _disk_rates(offload_path)
    host_step = _step_rate(torch.device("cpu"))
    device_step = host_step if device.type == "cpu" else _step_rate(device)
    flops = _flop_rate(device)
    codec = _codec(state_format_name)
    others = _others_share(before, started)
    probes = {
        "copy to device": to_device,
        "copy from device": from_device,
        "disk read": disk_read,
        "disk write": disk_write,
        "host optimizer": host_step,
        "device optimizer": device_step,
        "matmul": flops,
        "state codec": codec,
    }
    if device.type == "cpu":  # the same probe twice
        del probes["copy from device"], probes["device optimizer"]
    if not codec[0]:
        del probes["state codec"]
    return MachineRates(
        to_device=to_device[0],
        from_device=from_device[0],
        disk_read=disk_read[0],
        disk_write=disk_write[0],
        host_step=host_step[0],
        device_step=device_step[0],
        flops=flops[0],
        copies_overlap=device.type == "cuda",
        device=device.type,
        state_codec=codec[0],
        spread=tuple((name, round(spread, 4)) for name, (_, spread) in probes.items()),
        others_busy=others,
    )


def _busy_ticks() -> tuple[int, int] | None:
    """``(ticks all CPUs were busy, ticks this process ran)`` since boot, from /proc;
    None without it (not Linux)."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rpartition(")")[2].split()
        # user nice system idle iowait irq softirq steal (guest time is within user);
        # utime and stime are the 14th and 15th fields, counted from the pid
        return cpu[0] + cpu[1] + cpu[2] + sum(cpu[5:8]), int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def _others_share(before: tuple[int, int] | None, started: float) -> float | None:
    """The share of the machine's CPU time other processes took since ``before`` (see
    ``MachineRates.others_busy``); None where it cannot be read."""
    after = _busy_ticks()
    seconds = time.monotonic() - started
    cpus = os.cpu_count() or 1
    if before is None or after is None or seconds <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return round(min(max(others / os.sysconf("SC_CLK_TCK") / seconds / cpus, 0.0), 1.0), 3)


def machine_capacities(config, device: torch.device | str) -> Capacities:
    """The planner's limits on this machine: the configured capacities, else the device's
    memory (CUDA), the physical RAM and the free space under ``offload_path``.

    On a CPU device the "device" and the host tier are the same RAM: unless configured,
    the device gets a quarter of it and the host tier half (the rest is left to
    activations in flight, staging and the process), so a plan never counts the RAM
    twice (it used to call a 21B-parameter GPT trainable on a 24 GiB box)."""
    from hetstore.tiers import physical_memory

    device = torch.device(device)
    ram = physical_memory()
    if device.type == "cuda":
        device_total, host_total = torch.cuda.get_device_properties(device).total_memory, ram
    else:
        device_total, host_total = ram // 4, ram // 2
    # what this machine has of each tier it can measure; a tier it cannot has no
    # limit unless its capacity key is set
    available = {
        Tier.DEVICE: device_total,
        Tier.HOST: host_total,
        Tier.DISK: free_space_at(config.offload_path),
    }
    capacities = Capacities.from_config(config, available)
    budget = capacities.of(Tier.DEVICE)
    if device.type != "cuda" or budget is None:
        return capacities
    return capacities.with_limit(Tier.DEVICE, max(budget - cuda_runtime_share(budget), 0))


# cuBLAS and cuBLASLt workspaces, taken from the budget by the first matrix product
_CUBLAS_WORKSPACES = 64 << 20
# The caching allocator keeps a pool per stream (a block freed on the copy stream is not
# reused by compute) and rounds requests to its block sizes: a share of the budget it
# holds and hetstore's accounting does not see.
_ALLOCATOR_SLACK = 0.10


def cuda_runtime_share(budget: int) -> int:
    """What the CUDA runtime and allocator take of a device budget beside the bytes the
    planner places, so that a plan that fits the planner fits the allocator too (the
    budget binds the whole process there: ``set_per_process_memory_fraction``). From one
    measurement, an H100 with torch 2.11: the demo GPT planned to the full 0.58 GiB
    budget stopped with 0.52 GiB allocated and 36 MiB cached on other streams."""
    return _CUBLAS_WORKSPACES + int(budget * _ALLOCATOR_SLACK)


def free_space_at(path: str) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free
