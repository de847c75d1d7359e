"""GPU: offloaded training vs plain PyTorch, side by side, one placement per row.

One command on a machine with CUDA:

    python benchmarks/gpu/offload_step.py [--width 1024 --depth 12 --steps 6]
        [--variants cpu-cpu,cpu-cpu:no-overlap,none-cpu,disk-disk]

Each variant ``PARAM-OPTIM`` is ``offload_param``-``offload_optimizer`` with the
defaults ``overlap_step='auto'`` (units with states on disk are stepped during backward)
and ``step_in_forward='auto'`` (what is left of the disk units' steps, and on a GPU the
host-memory units' steps, run during the next forward); ``PARAM-OPTIM:no-overlap`` sets
``overlap_step=False`` (every unit stepped in ``optimizer.step()``), the comparison for
the overlap; ``PARAM-OPTIM:in-forward`` sets ``step_in_forward=True`` (the same, and
with ``overlap_step=False`` too); ``PARAM-OPTIM:step-after`` sets
``step_in_forward=False`` (what backward left is stepped in ``optimizer.step()``). ``--clip C`` clips every model's gradients at C before its step
(hetstore's ``clip_grad_norm_``, torch's for plain). Prints, per
row: the median step time and its ratio to plain PyTorch (measured in the same run, the
steps interleaved so that machine noise hits all alike), the time in forward, backward
and the optimizer step, the CUDA allocator's peak (the model's own: what it holds between steps plus the most its
step allocates above that, from ``torch.cuda.max_memory_allocated``),
and the GPU busy fraction of one profiled step (the union of every kernel's and copy's
interval on the device over the step's wall time, from ``torch.profiler``). Then the
largest loss difference from plain.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

import hetstore
from hetstore.demo.gpt import GPT


def clip(model, optimizer, max_norm: float | None) -> None:
    if max_norm is None:
        return
    if hasattr(optimizer, "clip_grad_norm_"):
        optimizer.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def timed_step(model, optimizer, x, y, max_norm=None) -> tuple[list[float], float]:
    marks = []
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    loss = model(x, y)
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    loss.backward()
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    clip(model, optimizer, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:], strict=False)], loss.item()


def settled_allocated() -> int:
    """``memory_allocated`` once finished work is done and the caching allocator has
    taken back blocks freed on a side stream (it does so at its next allocation)."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    return torch.cuda.memory_allocated()


def busy_fraction(model, optimizer, x, y, max_norm=None) -> float | None:
    """Share of one step's wall time during which the GPU ran a kernel or a copy (None
    when the profiler failed)."""
    from spans import device_busy_fraction

    def step():
        model(x, y).backward()
        clip(model, optimizer, max_norm)
        optimizer.step()
        optimizer.zero_grad()

    return device_busy_fraction(step)[0]


def write_spans(runs, x, y, max_norm, path) -> None:
    """Two more steps per variant with hetstore's step machinery timed per thread
    (spans.py): a summary printed, every span written to ``path`` as JSON."""
    import json

    from spans import record_spans, summary

    everything = {}
    for name, (model, opt) in runs.items():
        torch.cuda.synchronize()
        with record_spans() as spans:
            for step in range(2):  # two: work a step leaves to the next forward is seen
                spans.mark(f"forward {step}")
                loss = model(x, y)
                torch.cuda.synchronize()
                spans.mark(f"backward {step}")
                loss.backward()
                torch.cuda.synchronize()
                spans.mark(f"step {step}")
                clip(model, opt, max_norm)
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
            spans.mark("end")
        print(f"spans of {name}:")
        print("\n".join(summary(spans)))
        everything[name] = spans.records
    with open(path, "w") as f:
        json.dump(everything, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", default="cpu-cpu,cpu-cpu:no-overlap,none-cpu,disk-disk")
    parser.add_argument("--clip", type=float, default=None, help="clip gradients at this norm")
    parser.add_argument(
        "--spans", default=None, help="write per-thread spans of one more step per variant here"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu needs CUDA; run it on a machine with a GPU")

    torch.manual_seed(0)
    base = GPT(args.vocab, args.width, args.depth, args.width // 64, args.ctx)
    n_params = sum(p.numel() for p in base.parameters())
    runs, allocated_at_build = {}, {}
    before = settled_allocated()
    plain = copy.deepcopy(base).cuda()
    runs["plain"] = (plain, torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True))
    allocated_at_build["plain"] = settled_allocated() - before
    offload_dir = tempfile.mkdtemp(prefix="hetstore-gpu-bench-")
    for variant in args.variants.split(","):
        placement, _, flag = variant.partition(":")
        in_forward = {"": "auto", "no-overlap": "auto", "in-forward": True, "step-after": False}
        if flag not in in_forward:
            raise SystemExit(
                f"variant {variant!r}: a suffix is ':no-overlap', ':in-forward' or ':step-after'"
            )
        param, optim = placement.split("-")
        model = copy.deepcopy(base)
        config = hetstore.OffloadConfig(
            offload_param=param,
            offload_optimizer=optim,
            device="cuda",
            offload_path=offload_dir,
            overlap_step=False if flag == "no-overlap" else "auto",
            step_in_forward=in_forward[flag],
        )
        before = settled_allocated()
        runs[variant] = hetstore.offload(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), config
        )
        allocated_at_build[variant] = settled_allocated() - before

    del base

    g = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g).cuda()
        return idx[:, :-1], idx[:, 1:]

    # Every model is resident in this one process, so a model's own footprint is what
    # it holds between steps (measured across its first step, which warms up kernels,
    # records the execution order and makes the optimizer states) plus what its step
    # adds above the memory allocated when the step starts.
    resident = {}
    x, y = batch()
    for name, (model, opt) in runs.items():
        before = settled_allocated()
        timed_step(model, opt, x, y, args.clip)
        resident[name] = settled_allocated() - before + allocated_at_build[name]
    phases = {name: [] for name in runs}
    peaks = dict.fromkeys(runs, 0)
    diff = 0.0
    for _ in range(args.steps):
        x, y = batch()
        losses = {}
        for name, (model, opt) in runs.items():
            start = settled_allocated()
            torch.cuda.reset_peak_memory_stats()
            times, losses[name] = timed_step(model, opt, x, y, args.clip)
            above = torch.cuda.max_memory_allocated() - start
            peaks[name] = max(peaks[name], resident[name] + above)
            phases[name].append(times)
        diff = max(diff, max(abs(v - losses["plain"]) for v in losses.values()))
    if args.spans:
        write_spans(runs, x, y, args.clip, args.spans)
    busy = {name: busy_fraction(model, opt, x, y, args.clip) for name, (model, opt) in runs.items()}

    print(
        f"{torch.cuda.get_device_name()}: GPT {n_params / 1e6:.0f}M params, "
        f"batch {args.batch}x{args.ctx}, {args.steps} timed steps, AdamW fused, "
        f"clip {args.clip}"
    )
    print("| variant | step s | / plain | fwd s | bwd s | opt s | CUDA peak (own) | GPU busy |")
    print("|---|---|---|---|---|---|---|---|")
    plain_median = statistics.median(sum(t) for t in phases["plain"])
    for name in runs:
        total = statistics.median(sum(t) for t in phases[name])
        fwd, bwd, opt = (statistics.median(t[k] for t in phases[name]) for k in range(3))
        print(
            f"| {name} | {total:.3f} | {total / plain_median:.2f} | {fwd:.3f} | {bwd:.3f} | "
            f"{opt:.3f} | {peaks[name] / 2**30:.2f} GiB | "
            f"{'-' if busy[name] is None else format(busy[name], '.0%')} |"
        )
    print(f"max |loss difference| from plain = {diff:.2e}")
    for name, (_, opt) in runs.items():
        stats = getattr(opt, "speculation_stats", None)
        if stats:
            print(f"{name}: steps taken away from optimizer.step() {stats}")


if __name__ == "__main__":
    main()
