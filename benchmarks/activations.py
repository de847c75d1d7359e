"""Activation offload: a GPT's training step with its saved activations kept, on host, on disk.

    .venv/bin/python benchmarks/activations.py                 # ~1 minute on 2 vCPUs
    .venv/bin/python benchmarks/activations.py --tiny          # seconds: checks the harness
    .venv/bin/python benchmarks/activations.py --device cuda   # the same on a GPU

Every variant trains ``hetstore.demo.gpt.GPT`` from the same seed on the same
``hetstore.demo.gpt.batches`` with ``torch.optim.AdamW(fused=True)``, in fp32, at a batch
whose tensors saved for backward are many times the parameters (the defaults: ~300 MiB
saved per step against 14 MiB of parameters):

* ``plain``: the model and optimizer as they are (the step time reference);
* ``none``: ``hetstore.offload`` with ``offload_activations="none"``: the saved
  activations stay on the device (on a CPU device hetstore counts them against it);
* ``cpu``: ``offload_activations="cpu"``: each saved storage of at least
  ``activation_min_bytes`` is copied to the host tier and dropped from the device;
* ``disk``: ``offload_activations="disk"``: the same, through the host tier to disk.

hetstore runs keep parameters and optimizer on the device (``offload_param="none"``,
``offload_optimizer="none"``), so what changes between them is only where the
activations wait for backward; they use ``device=--device``, pinned host memory on CUDA
only, and an ``offload_path`` in a temporary directory under ``--dir`` (by default
``offload/`` in the repository: the same disk as the repository, never tmpfs).

Each variant runs in its own worker process, so its peaks are its own and nothing is
shared (allocator, page cache). The workers run in lockstep: step i of every variant, in
a random order per step with a short pause before each, then step i + 1, so drift of the
shared machine hits all of them alike.

Reported: median step time (and its forward / backward / optimizer parts), the paired
per-step ratio to plain and to ``none``; the device peak (CPU:
``hetstore.memory_stats(model)["device"]["peak"]``, which counts parameters, gradients,
optimizer states and the saved activations kept on the device, so plain PyTorch has
none; CUDA: ``torch.cuda.max_memory_allocated()``, for every variant) and its ratio to
``none``; the bytes copied off the device per step; peak RSS per process; hetstore's
host and disk peaks; and the largest absolute difference of every run's losses from
plain's (the copies are exact, so they should agree to ~1e-6 or better).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time

import torch

import hetstore
from _common import (
    REPO,
    Worker,
    format_table,
    lockstep,
    loss_report,
    machine_line,
    median,
    peak_rss_bytes,
    reply,
    size,
    spread,
    start_worker,
)
from hetstore._sizes import format_size, parse_size
from hetstore.demo.gpt import GPT, batches

LR = 3e-4
WEIGHT_DECAY = 0.1
LOSS_TOLERANCE = 1e-4  # largest absolute loss difference from plain accepted

# variant -> offload_activations; None: plain PyTorch
VARIANTS: dict[str, str | None] = {"plain": None, "none": "none", "cpu": "cpu", "disk": "disk"}
PHASES = ("fwd", "bwd", "opt")  # forward; backward; optimizer.step() + zero_grad()


# ---------------------------------------------------------------------------- worker
def build(variant: str, args: argparse.Namespace):
    torch.manual_seed(0)
    model = GPT(
        vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads, ctx=args.ctx
    )
    acts = VARIANTS[variant]
    if acts is None:
        model = model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if acts is not None:
        config = hetstore.OffloadConfig(
            offload_param="none",
            offload_optimizer="none",
            offload_activations=acts,
            activation_min_bytes=args.activation_min_bytes,
            max_device_memory=args.max_device_memory,
            offload_path=args.offload_path,
            enable_pinned_mem=args.device == "cuda",
            device=args.device,
            compute_dtype="fp32",
        )
        model, optimizer = hetstore.offload(model, optimizer, config)
    return model, optimizer


class SavedBytes:
    """Pass-through saved-tensor hooks that add up the distinct storages a forward saves
    for backward, parameters aside (what activation offload can move). Plain's worker
    wraps its first (warm-up) forward in them: no extra forward, no extra memory."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def copied_bytes(model) -> int:
    """Bytes hetstore's activation hooks have copied off the device so far; 0 if none."""
    activations = getattr(getattr(hetstore.state_of(model), "runtime", None), "activations", None)
    return getattr(activations, "packed_bytes", 0) or 0


def device_peak(model, variant: str, device: str) -> int | None:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    if VARIANTS[variant] is None:
        return None  # plain PyTorch on CPU: nothing counts a "device"
    return hetstore.memory_stats(model)["device"]["peak"]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker(variant: str, args: argparse.Namespace) -> None:
    """Line protocol on stdin/stdout: JSON commands in, one JSON reply per command."""
    t0 = time.perf_counter()
    dev = args.device
    model, optimizer = build(variant, args)
    data = batches(args.warmup + args.steps, vocab=args.vocab, batch=args.batch, ctx=args.ctx)
    data = [(x.to(dev), y.to(dev)) for x, y in data]
    params = sum(p.numel() for p in model.parameters())
    reply({"ready": True, "params": params, "build_s": time.perf_counter() - t0})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "step":
            x, y = data[command["step"]]
            copied = copied_bytes(model)
            sync(dev)
            counting = VARIANTS[variant] is None and command["step"] == 0
            counter = SavedBytes(model) if counting else contextlib.nullcontext()
            marks = [time.perf_counter()]
            with counter:
                loss = model(x, y)
            sync(dev)
            marks.append(time.perf_counter())
            loss.backward()
            sync(dev)
            marks.append(time.perf_counter())
            optimizer.step()
            optimizer.zero_grad()
            sync(dev)
            marks.append(time.perf_counter())
            out = {"loss": loss.item(), "time": marks[-1] - marks[0]}
            out["copied"] = copied_bytes(model) - copied
            if counting:
                out["saved"] = counter.total
            for phase, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True):
                out[phase] = b - a
            reply(out)
        elif command["op"] == "stats":
            hetstore_stats = None if VARIANTS[variant] is None else hetstore.memory_stats(model)
            reply(
                {
                    "rss": peak_rss_bytes(),
                    "device_peak": device_peak(model, variant, dev),
                    "memory_stats": hetstore_stats,
                }
            )
        else:
            break


# ---------------------------------------------------------------------------- driver
def paired_ratio(times: list[float], reference: list[float]) -> float:
    return median([t / r for t, r in zip(times, reference, strict=True)])


def summarize(
    results: dict[str, list[dict[str, float]]], stats: dict[str, dict], warmup: int, device: str
) -> str:
    """One row per variant."""
    timed = {v: r[warmup:] for v, r in results.items()}
    plain = [s["time"] for s in timed["plain"]]
    none = [s["time"] for s in timed["none"]] if "none" in timed else None
    none_peak = stats["none"]["device_peak"] if "none" in stats else None
    rows = []
    for variant, steps in timed.items():
        times = [s["time"] for s in steps]
        parts = [f"{median([s[k] for s in steps]):.3f}" for k in PHASES]
        peak = stats[variant]["device_peak"]
        tiers = stats[variant]["memory_stats"] or {}
        row = [variant, f"{median(times):.3f} {spread(times)}", *parts]
        row.append(f"**{paired_ratio(times, plain):.2f}**")
        row.append(f"**{paired_ratio(times, none):.2f}**" if none else "-")
        row.append(size(peak))
        row.append(f"**{peak / none_peak:.2f}**" if peak is not None and none_peak else "-")
        copied = sum(s["copied"] for s in steps) / len(steps)
        row.append(size(copied) if VARIANTS[variant] not in (None, "none") else "-")
        row.append(size(stats[variant]["rss"]))
        row += [size(tiers.get(t, {}).get("peak")) for t in ("host", "disk")]
        rows.append(row)
    peak_source = (
        "CUDA peak (max_memory_allocated)" if device == "cuda" else "device peak (hetstore)"
    )
    header = ["variant", "step s, median [min..max]", "fwd s", "bwd s", "opt s"]
    header += ["time / plain", "time / none", peak_source, "peak / none"]
    header += ["copied off device / step", "peak RSS", "hetstore host peak", "hetstore disk peak"]
    return format_table(header, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Defaults: GPT width 256, depth 4, 4 heads, vocab 2048, ctx 256, batch 16 "
        "(3.7M parameters, ~300 MiB saved for backward per step); 2 warm-up + 8 timed steps.",
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=256, help="sequence length")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model, 1 + 3 steps: a harness check"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="compute device of every variant (cuda: the device peak is "
        "torch.cuda.max_memory_allocated)",
    )
    parser.add_argument(
        "--activation-min-bytes",
        default="1MiB",
        help="hetstore's activation_min_bytes: smaller saved storages stay on the device",
    )
    parser.add_argument(
        "--max-device-memory",
        default=None,
        help="hetstore's max_device_memory (default: none, so every variant runs and the "
        "peaks show what each needs)",
    )
    parser.add_argument(
        "--dir",
        default=str(REPO / "offload"),
        help="a temporary directory for the offload path is made here "
        "(must be on the disk under test; not tmpfs)",
    )
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--offload-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.heads, args.vocab = 64, 2, 2, 256
        args.ctx, args.batch, args.steps, args.warmup = 64, 8, 3, 1
        args.activation_min_bytes = "16KiB"  # the tiny model's saved tensors are small
        args.tiny = False  # the fields above now say it all; workers get them explicitly
    return args


def model_argv(args: argparse.Namespace) -> list[str]:
    """The flags that fix the model, data, step counts and configuration: passed to
    every worker."""
    flags = ("width", "depth", "heads", "vocab", "ctx", "batch", "steps", "warmup", "device")
    flags += ("activation_min_bytes",)
    out = [x for f in flags for x in (f"--{f.replace('_', '-')}", str(getattr(args, f)))]
    if args.max_device_memory is not None:
        out += ["--max-device-memory", args.max_device_memory]
    return out


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker, args)
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        wheel = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        sys.exit(
            f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
            f"{wheel}); run on a machine with a GPU, or leave out --device for the CPU run"
        )
    for flag, value in (
        ("--activation-min-bytes", args.activation_min_bytes),
        ("--max-device-memory", args.max_device_memory),
    ):
        if value is not None:
            try:
                parse_size(value)
            except ValueError as err:
                sys.exit(f"{flag} {value!r}: {err}")

    command = [".venv/bin/python", "benchmarks/activations.py", *model_argv(args)]
    os.makedirs(args.dir, exist_ok=True)
    print("$ " + shlex.join(command))
    print(f"# {machine_line()}")
    if args.device == "cuda":
        print(f"# {torch.cuda.get_device_name()}")

    workdir = tempfile.mkdtemp(prefix="activations_", dir=args.dir)
    worker_argv = model_argv(args) + ["--offload-path", os.path.join(workdir, "offload")]
    workers: list[Worker] = []
    try:
        for v in VARIANTS:
            workers.append(start_worker(__file__, v, worker_argv))
        params = workers[0].params
        print(
            f"# GPT width {args.width}, depth {args.depth}, {args.heads} heads, vocab "
            f"{args.vocab}, ctx {args.ctx}, batch {args.batch}: {params / 1e6:.2f}M parameters "
            f"({format_size(params * 4)} fp32; with AdamW's gradient and two moments "
            f"{format_size(params * 16)})"
        )
        print(
            f"# AdamW(fused=True) lr={LR} wd={WEIGHT_DECAY}, fp32, device {args.device}; "
            f"offload_param=offload_optimizer='none', activation_min_bytes="
            f"{args.activation_min_bytes}, max_device_memory={args.max_device_memory}; "
            f"{args.warmup} warm-up + {args.steps} timed steps, lockstep; offload_path under "
            f"{workdir}"
        )
        print("# build s: " + ", ".join(f"{w.variant} {w.build_s:.1f}" for w in workers))
        results = lockstep(workers, args.warmup + args.steps, warmup=args.warmup)
        stats = {w.variant: w.request({"op": "stats"}) for w in workers}
        saved = results["plain"][0]["saved"]
        print(
            f"# saved for backward per step (plain, distinct storages, parameters aside): "
            f"{format_size(saved)}, {saved / (params * 4):.0f}x the parameters"
        )
        warm = [
            f"{v} " + "/".join(f"{s['time']:.2f}" for s in r[: args.warmup])
            for v, r in results.items()
        ]
        print("# warm-up step s: " + ", ".join(warm))
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        "time / plain, time / none: median of the per-step ratios (same round); "
        "peak / none: device peak over none's; "
        + (
            "CUDA peak: torch.cuda.max_memory_allocated() of each process"
            if args.device == "cuda"
            else "device peak: hetstore.memory_stats(model)['device']['peak'] (parameters, "
            "gradients, optimizer states and the saved activations kept on the device; "
            "plain PyTorch has no such count)"
        )
        + "\n"
    )
    print(summarize(results, stats, args.warmup, args.device))
    print()
    text, worst = loss_report(results)
    print(text)
    if not all(math.isfinite(s["loss"]) for r in results.values() for s in r):
        sys.exit("non-finite loss")
    if worst > LOSS_TOLERANCE:
        sys.exit(f"losses differ from plain by up to {worst:.2e} (absolute)")


if __name__ == "__main__":
    main()
