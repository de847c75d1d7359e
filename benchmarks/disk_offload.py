"""Training step of a GPT with its states on disk: against host offload and plain PyTorch.

    .venv/bin/python benchmarks/disk_offload.py            # ~77M parameters, a few minutes
    .venv/bin/python benchmarks/disk_offload.py --tiny     # seconds: checks the harness

Every variant trains ``hetstore.demo.gpt.GPT`` from the same seed on the same
``hetstore.demo.gpt.batches`` with ``torch.optim.AdamW(fused=True)``, in fp32:

* ``plain``: the model and optimizer as they are (the reference);
* ``cpu``: ``offload_param="cpu", offload_optimizer="cpu"`` (``overlap_step='auto'``: on
  this CPU device every unit is stepped in ``optimizer.step()``);
* ``disk``: ``offload_param="disk", offload_optimizer="disk"`` (gradients follow to disk),
  ``overlap_step=True, step_in_forward=False``: the defaults until 2026-11-26, every step
  done when ``optimizer.step()`` returns;
* ``disk (defaults)``: the same placement with every other key at its default (today
  ``overlap_step='auto'`` and ``step_in_forward='auto'``);
* ``disk (no overlap)``: as ``disk`` with ``overlap_step=False``.
* ``plain (+ disk traffic)``: ``plain`` while a thread moves, through hetstore's
  ``AsyncIOEngine`` on a scratch file, the bytes a disk variant moves in each phase
  (``--traffic``): the forward's from the forward's start, and the forward ends only when
  they are moved (a step in the next forward must land before its unit is used); the
  backward's (and the optimizer step's) from the backward's start, and the step ends when
  they are. Nothing of hetstore runs in the step itself, so this is the floor of any
  design that moves those bytes in those phases on this machine, with perfect overlap and
  no CPU of its own (docs/dev/BENCHMARKS.md).
* ``disk (grad cpu)``: as ``disk`` with ``offload_grad="cpu"``: units are stepped ahead,
  during backward (``overlap_step``, on by default, applies here).
* ``disk (grad cpu; no overlap)``: the same with ``overlap_step=False``: every unit is
  stepped in ``optimizer.step()``.
* ``disk (in forward)``, ``disk (grad cpu; in forward)``: as ``disk`` and ``disk (grad
  cpu)`` with ``step_in_forward=True``: the steps ``optimizer.step()`` would still run
  (after a clip that bit, the root's) run on during the next forward.

hetstore runs use ``enable_pinned_mem=False, device="cpu"`` and an ``offload_path`` in a
temporary directory under ``--dir`` (by default ``offload/`` in the repository: the same
disk as the repository, never tmpfs). Each variant runs in its own worker process, so
its peak RSS is its own and nothing is shared (page cache, allocator). The workers run in
lockstep: step i of every variant, in a random order per step with a short pause before
each, then step i + 1, so drift of the shared machine hits all of them alike.

The disk's own bandwidth is measured in the same run, in the same rounds (one per timed
step), by sequential O_DIRECT writes and reads of ``--disk-size`` bytes on a file in the
same directory as the offload path:

* with fio, bs 8M, in a few engine / numjobs / iodepth configurations; the configuration
  with the best median per direction gives "(fio)". ``--no-fio`` or no fio: skipped.
* with hetstore's own ``AsyncIOEngine`` at its defaults on a huge-page mmap buffer, as the
  disk tier runs it ("(engine)", the ``disk_io.py`` pass). On a virtio disk fio, whose
  buffers are 4 KiB pages, reads well below what the disk delivers to huge-page buffers
  (see docs/dev/BENCHMARKS.md), so both are shown.

For a disk variant, the bytes it read and wrote per step
(``hetstore.state_of(model).tiers.disk.stats()``, summed over the timed steps / their number) give
the time the disk alone needs, ``t_disk = read_bytes / read_bw + write_bytes / write_bw``,
and the *disk-bound fraction* ``t_disk / step time``: 1.0 means the step runs at the
disk's limit. The same is reported per phase (forward, backward, optimizer step).

Reported: median step time (and its forward / backward / optimizer parts), the paired
per-step ratio to plain and to host offload, peak RSS per process, hetstore's host and
disk peaks, the disk traffic per step, and the largest relative difference of every
run's losses from plain's (they should agree to ~1e-6).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

import hetstore
from _common import (
    REPO,
    Worker,
    bench_command,
    format_table,
    lockstep,
    loss_report,
    machine_line,
    median,
    peak_rss_bytes,
    record_json,
    reply,
    size,
    spread,
    start_worker,
)
from disk_io import MiB, hetstore_pass, host_buffer, layout, machine_summary
from hetstore._sizes import format_size, parse_size
from hetstore.demo.gpt import GPT, batches
from hetstore.tiers.aio import ALIGNMENT, AsyncIOEngine, DiskFile
from hetstore.tiers.hostmem import round_up

LR = 3e-4
WEIGHT_DECAY = 0.1

# variant -> (offload_param, offload_optimizer, offload_grad, overlap_step,
# step_in_forward); None: plain
VARIANTS: dict[str, tuple[str, str, str | None, bool | str, bool | str] | None] = {
    "plain": None,
    "cpu": ("cpu", "cpu", None, "auto", False),  # on this CPU device: stepped after backward
    "disk": ("disk", "disk", None, True, False),
    "disk (defaults)": ("disk", "disk", None, "auto", "auto"),
    "disk (no overlap)": ("disk", "disk", None, False, False),
    "plain (+ disk traffic)": None,
    "disk (in forward)": ("disk", "disk", None, True, True),
    "disk (grad cpu)": ("disk", "disk", "cpu", True, False),
    "disk (grad cpu; no overlap)": ("disk", "disk", "cpu", False, False),
    "disk (grad cpu; in forward)": ("disk", "disk", "cpu", True, True),
}
# fio configurations tried each round: (ioengine, numjobs, iodepth), all bs 8M, O_DIRECT
FIO_CONFIGS = [("libaio", 1, 16), ("libaio", 2, 8), ("psync", 4, 1)]
FIO_BS = "8M"
PHASES = ("fwd", "bwd", "opt")  # forward; backward; optimizer.step() + zero_grad()


TRAFFIC_VARIANT = "plain (+ disk traffic)"
TRAFFIC_CHUNK = 32 * MiB  # the disk tier's default optimizer chunk


class DiskTraffic:
    """The ``plain (+ disk traffic)`` variant's IO: ``start(read, written)`` moves that
    many bytes on a thread, in ``TRAFFIC_CHUNK`` requests, a read and a write in flight at
    once, on a scratch file of ``file_size`` bytes under ``directory`` (offsets wrap);
    ``wait()`` waits for them."""

    def __init__(self, directory: str, file_size: int = 512 * MiB):
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, "traffic.bin")
        self._size = file_size
        layout(self._path, file_size)
        self._file = DiskFile(self._path, create=False)
        self._engine = AsyncIOEngine()
        self._bufs = [host_buffer(TRAFFIC_CHUNK, "thp")[0] for _ in range(2)]
        self._offset = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, read: int, written: int) -> None:
        self._thread = threading.Thread(target=self._move, args=(read, written), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the disk traffic failed") from self._error

    def _move(self, read: int, written: int) -> None:
        try:
            self._move_all({"r": read, "w": written})
        except BaseException as exc:  # raised on the worker's thread by wait()
            self._error = exc

    def _move_all(self, left: dict[str, int]) -> None:
        while left["r"] > 0 or left["w"] > 0:
            handles = []
            for kind, buf in zip("rw", self._bufs, strict=True):
                n = min(left[kind], TRAFFIC_CHUNK)
                if n <= 0:
                    continue
                n = round_up(n, ALIGNMENT)  # (O_DIRECT lengths)
                submit = self._engine.submit_read if kind == "r" else self._engine.submit_write
                handles.append(submit(self._file, self._offset, buf[:n]))
                left[kind] -= n
                self._offset = (self._offset + TRAFFIC_CHUNK) % (self._size - TRAFFIC_CHUNK)
            for h in handles:
                h.wait()

    def close(self) -> None:
        self._engine.close()
        self._file.close()
        os.unlink(self._path)


def traffic_bytes(spec: str, params: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``--traffic`` in bytes: ((forward read, written), (backward and step read, written))."""
    phases = [[int(float(x) * params * 4) for x in p.split(",")] for p in spec.split("/")]
    return tuple(phases[0]), tuple(phases[1])


def on_disk(variant: str) -> bool:
    placement = VARIANTS[variant]
    return placement is not None and placement[0] == "disk"


# ---------------------------------------------------------------------------- worker
def build(variant: str, args: argparse.Namespace):
    torch.manual_seed(0)
    model = GPT(
        vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads, ctx=args.ctx
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    placement = VARIANTS[variant]
    if placement is not None:
        param, opt, grad, overlap, in_forward = placement
        config = hetstore.OffloadConfig(
            offload_param=param,
            offload_optimizer=opt,
            offload_grad=grad,
            overlap_step=overlap,
            step_in_forward=in_forward,
            offload_path=args.offload_path,
            enable_pinned_mem=False,
            device="cpu",
            compute_dtype="fp32",
        )
        model, optimizer = hetstore.offload(model, optimizer, config)
    return model, optimizer


def disk_counters(model, variant: str) -> tuple[int, int]:
    """(bytes read, bytes written) by the disk tier since it was made; 0, 0 off disk."""
    if not on_disk(variant):
        return 0, 0
    stats = hetstore.state_of(model).tiers.disk.stats()
    return stats["bytes_read"], stats["bytes_written"]


def worker(variant: str, args: argparse.Namespace) -> None:
    """Line protocol on stdin/stdout: JSON commands in, one JSON reply per command."""
    t0 = time.perf_counter()
    model, optimizer = build(variant, args)
    data = batches(args.warmup + args.steps, vocab=args.vocab, batch=args.batch, ctx=args.ctx)
    params = sum(p.numel() for p in model.parameters())
    traffic = None
    if variant == TRAFFIC_VARIANT:
        traffic = DiskTraffic(args.offload_path)
        forward_bytes, backward_bytes = traffic_bytes(args.traffic, params)
    reply({"ready": True, "params": params, "build_s": time.perf_counter() - t0})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "step":
            x, y = data[command["step"]]
            marks = [(time.perf_counter(), *disk_counters(model, variant))]
            if traffic is not None:
                traffic.start(*forward_bytes)
            loss = model(x, y)
            if traffic is not None:
                traffic.wait()
                traffic.start(*backward_bytes)
            marks.append((time.perf_counter(), *disk_counters(model, variant)))
            loss.backward()
            marks.append((time.perf_counter(), *disk_counters(model, variant)))
            norm = None
            if args.clip:  # what a user writes: torch's clip, or hetstore's for disk grads
                if VARIANTS[variant] is None:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                else:
                    norm = optimizer.clip_grad_norm_(args.clip)
            optimizer.step()
            optimizer.zero_grad()
            if traffic is not None:
                traffic.wait()
            marks.append((time.perf_counter(), *disk_counters(model, variant)))
            out = {"loss": loss.item(), "time": marks[-1][0] - marks[0][0]}
            out["norm"] = None if norm is None else float(norm)
            out["read"] = marks[-1][1] - marks[0][1]
            out["written"] = marks[-1][2] - marks[0][2]
            for phase, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True):
                out[phase] = b[0] - a[0]
                out[f"{phase}_read"] = b[1] - a[1]
                out[f"{phase}_written"] = b[2] - a[2]
            reply(out)
        elif command["op"] == "stats":
            stats = None if VARIANTS[variant] is None else hetstore.memory_stats(model)
            speculation = getattr(optimizer, "speculation_stats", None)
            reply({"rss": peak_rss_bytes(), "memory_stats": stats, "speculation": speculation})
        else:
            break
    if traffic is not None:
        traffic.close()


# ---------------------------------------------------------------------------- driver
def fio_bw(path: str, nbytes: int, write: bool, engine: str, numjobs: int, iodepth: int) -> float:
    """One sequential O_DIRECT pass of fio over ``path``: bytes/s. (disk_io.fio_pass with
    bs 8M, the disk tier's request size, instead of its 1M.)"""
    per = nbytes // numjobs // MiB * MiB
    cmd = [
        "fio", "--name=t", f"--filename={path}", f"--size={per}", f"--offset_increment={per}",
        f"--numjobs={numjobs}", f"--bs={FIO_BS}", f"--rw={'write' if write else 'read'}",
        "--direct=1", f"--ioengine={engine}", f"--iodepth={iodepth}", "--group_reporting",
        "--output-format=json", *(["--end_fsync=1"] if write else []),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if write else "read"]["bw_bytes"])


class DiskBandwidth:
    """The disk's sequential O_DIRECT bandwidth, sampled once per ``round`` call: every fio
    configuration, and hetstore's own AsyncIOEngine (its defaults, as the disk tier runs
    it, on a huge-page mmap buffer like the host tier's), each a write then a read of the
    whole file."""

    ENGINE = "hetstore AsyncIOEngine, defaults, mmap + MADV_HUGEPAGE buffer"

    def __init__(self, path: str, nbytes: int, fio: bool):
        self.path, self.nbytes = path, nbytes
        self.configs = list(FIO_CONFIGS) if fio else []
        self.names = [f"fio {e} numjobs {nj} iodepth {qd}" for e, nj, qd in self.configs]
        self.names.append(self.ENGINE)
        self.samples: dict[tuple[str, str], list[float]] = {
            (name, d): [] for name in self.names for d in ("read", "write")
        }
        self.buffer, _ = host_buffer(nbytes, "thp")
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, out=self.buffer)

    def round(self) -> None:
        for name, cfg in zip(self.names, [*self.configs, None], strict=True):
            for direction in ("write", "read"):
                write = direction == "write"
                if cfg is None:  # hetstore_pass gives GB/s
                    bw = hetstore_pass(self.path, self.buffer, write, {}) * 1e9
                else:
                    bw = fio_bw(self.path, self.nbytes, write, *cfg)
                self.samples[(name, direction)].append(bw)

    def best_fio(self, direction: str) -> tuple[float, str] | None:
        """The fio configuration with the highest median in ``direction``: median, name."""
        if not self.configs:
            return None
        name = max(self.names[:-1], key=lambda n: median(self.samples[(n, direction)]))
        return median(self.samples[(name, direction)]), name

    def engine(self, direction: str) -> float:
        return median(self.samples[(self.ENGINE, direction)])

    def cell(self, name: str, direction: str) -> str:
        xs = self.samples[(name, direction)]
        return f"{gb_s(median(xs))} [{gb_s(min(xs))}..{gb_s(max(xs))}]"


def gb_s(bw: float) -> str:
    return f"{bw / 1e9:.2f}"


def disk_cells(
    read: float, written: float, seconds: float, bw: dict[str, float] | None
) -> list[str]:
    """t_disk and t_disk / seconds at bandwidth ``bw`` ({"read", "write"}: bytes/s)."""
    if bw is None:
        return ["-", "-"]
    t_disk = read / bw["read"] + written / bw["write"]
    return [f"{t_disk:.3f}", f"**{t_disk / seconds:.2f}**"]


def summarize(
    results: dict[str, list[dict[str, float]]],
    stats: dict[str, dict],
    warmup: int,
    fio_rate: dict[str, float] | None,
    engine_bw: dict[str, float],
) -> tuple[str, str]:
    """The main table (one row per variant) and the per-phase table of the disk variants."""
    timed = {v: [s for s in r[warmup:] if not s.get("after_gap")] for v, r in results.items()}
    plain = [s["time"] for s in timed["plain"]]
    host = [s["time"] for s in timed["cpu"]] if "cpu" in timed else None
    rows, phase_rows = [], []
    for variant, steps in timed.items():
        n = len(steps)
        times = [s["time"] for s in steps]
        parts = [f"{median([s[k] for s in steps]):.3f}" for k in PHASES]
        ratio = median([t / p for t, p in zip(times, plain, strict=True)])
        to_host = median([t / h for t, h in zip(times, host, strict=True)]) if host else None
        tiers = stats[variant]["memory_stats"] or {}
        row = [variant, f"{median(times):.3f} {spread(times)}", *parts, f"**{ratio:.2f}**"]
        row += [f"{to_host:.2f}" if to_host is not None else "-", size(stats[variant]["rss"])]
        row += [size(tiers.get(t, {}).get("peak")) for t in ("host", "disk")]
        if on_disk(variant):
            read = sum(s["read"] for s in steps) / n
            written = sum(s["written"] for s in steps) / n
            fio_cells = disk_cells(read, written, median(times), fio_rate)
            engine_cells = disk_cells(read, written, median(times), engine_bw)
            row += [size(read), size(written), *fio_cells, engine_cells[1]]
            for phase in PHASES:
                seconds = median([s[phase] for s in steps])
                p_read = sum(s[f"{phase}_read"] for s in steps) / n
                p_written = sum(s[f"{phase}_written"] for s in steps) / n
                phase_rows.append(
                    [variant, phase, f"{seconds:.3f}", size(p_read), size(p_written)]
                    + disk_cells(p_read, p_written, seconds, fio_rate)
                    + disk_cells(p_read, p_written, seconds, engine_bw)
                )
        else:
            row += ["-"] * 5
        rows.append(row)
    header = ["variant", "step s, median [min..max]", "fwd s", "bwd s", "opt s", "time / plain"]
    header += ["time / cpu", "peak RSS", "hetstore host peak", "hetstore disk peak"]
    header += ["disk read / step", "disk written / step", "t_disk s (fio)"]
    header += ["disk-bound fraction (fio)", "disk-bound fraction (engine)"]
    phase_header = ["variant", "phase", "s, median", "disk read", "disk written"]
    phase_header += ["t_disk s (fio)", "fraction (fio)", "t_disk s (engine)", "fraction (engine)"]
    return format_table(header, rows), format_table(phase_header, phase_rows)


def record_rows(
    results: dict[str, list[dict[str, float]]],
    stats: dict[str, dict],
    args: argparse.Namespace,
    params: int,
    engine_bw: dict[str, float],
) -> list[dict]:
    """The disk variants' figures, as ``summarize`` computes them, for record_json."""
    timed = {v: [s for s in r[args.warmup :] if not s.get("after_gap")] for v, r in results.items()}
    plain = [s["time"] for s in timed["plain"]]
    ref = [s["loss"] for s in results["plain"]]
    clip = "no clip"
    bites = None
    if args.clip:
        norms = [s["norm"] for s in results["plain"]]
        clip = f"clip {args.clip}"
        bites = f"{sum(n > args.clip for n in norms)} of {len(norms)} steps"
    rows = []
    for variant, steps in timed.items():
        if not on_disk(variant):
            continue
        n = len(steps)
        times = [s["time"] for s in steps]
        losses = [s["loss"] for s in results[variant]]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        rows.append(
            {
                "config": f"{params / 1e6:.1f}M GPT, fp32, batch {args.batch}, {clip}: {variant}",
                "clip_bites": bites,
                "plain_s": round(median(plain), 3),
                "hetstore_s": round(median(times), 3),
                "ratio": round(median([t / p for t, p in zip(times, plain, strict=True)]), 2),
                **{f"{k}_s": round(median([s[k] for s in steps]), 3) for k in PHASES},
                "disk_read": size(sum(s["read"] for s in steps) / n),
                "disk_written": size(sum(s["written"] for s in steps) / n),
                "plain_rss": size(stats["plain"]["rss"]),
                "hetstore_rss": size(stats[variant]["rss"]),
                "engine_read": round(engine_bw["read"] / 1e9, 2),
                "engine_write": round(engine_bw["write"] / 1e9, 2),
                "loss_diff": f"{loss_diff:.2e}",
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Defaults: GPT width 768, depth 10, 12 heads, vocab 8192, ctx 128, batch 4 "
        "(77.3M parameters); 2 warm-up + 8 timed steps; disk bandwidth on 1 GiB.",
    )
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=10, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--ctx", type=int, default=128, help="sequence length")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument(
        "--chain",
        type=int,
        default=1,
        help="steps each variant runs back to back per round; the first of each chain is "
        "not timed (with step_in_forward its forward would find the last steps already "
        "done in the other variants' turns)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny model, 1 + 3 steps, disk bandwidth on 64 MiB: a harness check",
    )
    parser.add_argument(
        "--dir",
        default=str(REPO / "offload"),
        help="a temporary directory for the offload path and fio's file is made here "
        "(must be on the disk under test; not tmpfs)",
    )
    parser.add_argument(
        "--disk-size", default="1GiB", help="bytes per disk bandwidth pass (fio and engine)"
    )
    parser.add_argument("--no-fio", action="store_true", help="skip fio (engine bandwidth only)")
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="clip the gradient norm at this value before each step (0: no clipping); "
        "plain uses torch.nn.utils.clip_grad_norm_, hetstore optimizer.clip_grad_norm_",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of: {', '.join(VARIANTS)} (plain is always run)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the disk variants' results as a record for docs/performance.md "
        "(benchmarks/results/*.json; then run tools/perf_page.py)",
    )
    parser.add_argument(
        "--traffic",
        default="2.75,3.0/1.9,1.06",
        help=f"FWD_READ,FWD_WRITTEN/BWD_READ,BWD_WRITTEN: the bytes {TRAFFIC_VARIANT!r} "
        "moves in the forward and in the backward with the optimizer step, in multiples of "
        "the model's fp32 parameter bytes (the default: what 'disk (defaults)' moves with "
        "--clip 1.0 on the default GPT, 811 / 884 MiB and 560 / 313 MiB)",
    )
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--offload-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.heads, args.vocab = 64, 2, 2, 256
        args.ctx, args.batch, args.steps, args.warmup = 32, 2, 3, 1
        args.disk_size = "64MiB"
        args.tiny = False  # the fields above now say it all; workers get them explicitly
    return args


def model_argv(args: argparse.Namespace) -> list[str]:
    """The flags that fix the model, data and step counts: passed to every worker."""
    flags = ("width", "depth", "heads", "vocab", "ctx", "batch", "steps", "warmup", "clip")
    flags += ("traffic",)
    return [x for f in flags for x in (f"--{f}", str(getattr(args, f)))]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker, args)
        return

    variants = ["plain"] + [
        v for v in (s.strip() for s in args.variants.split(",")) if v and v != "plain"
    ]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    disk_size = parse_size(args.disk_size) // MiB * MiB
    have_fio = shutil.which("fio") is not None and not args.no_fio

    command = [".venv/bin/python", "benchmarks/disk_offload.py", *model_argv(args)]
    command += ["--disk-size", args.disk_size] + ([] if have_fio else ["--no-fio"])
    if args.chain > 1:  # (the timed steps differ without it: see --chain)
        command += ["--chain", str(args.chain)]
    if variants != list(VARIANTS):
        command += ["--variants", ",".join(variants)]
    os.makedirs(args.dir, exist_ok=True)
    print("$ " + shlex.join(command))
    print(f"# {machine_line()}")
    print(f"# {machine_summary(args.dir)}")

    workdir = tempfile.mkdtemp(prefix="disk_offload_", dir=args.dir)
    offload_path = os.path.join(workdir, "offload")
    fio_file = os.path.join(workdir, "fio.bin")
    worker_argv = model_argv(args) + ["--offload-path", offload_path]
    workers: list[Worker] = []
    try:
        layout(fio_file, disk_size)  # timed writes then overwrite written blocks, as the tier's
        disk = DiskBandwidth(fio_file, disk_size, fio=have_fio)
        for v in variants:
            workers.append(start_worker(__file__, v, worker_argv))
        params = workers[0].params
        print(
            f"# GPT width {args.width}, depth {args.depth}, {args.heads} heads, vocab "
            f"{args.vocab}, ctx {args.ctx}, batch {args.batch}: {params / 1e6:.1f}M parameters "
            f"({format_size(params * 4)} fp32; with AdamW's master, gradient and two moments "
            f"{format_size(params * 16)})"
        )
        print(
            f"# AdamW(fused=True) lr={LR} wd={WEIGHT_DECAY}, fp32; {args.warmup} warm-up + "
            f"{args.steps} timed steps, lockstep"
            + (
                f" in chains of {args.chain} (the first of each not timed)"
                if args.chain > 1
                else ""
            )
            + f"; offload_path under {workdir}"
        )
        print("# build s: " + ", ".join(f"{w.variant} {w.build_s:.1f}" for w in workers))
        if TRAFFIC_VARIANT in variants:
            (fr, fw), (br, bw) = traffic_bytes(args.traffic, params)
            print(
                f"# {TRAFFIC_VARIANT} (--traffic {args.traffic}): {format_size(fr)} read and "
                f"{format_size(fw)} written from the forward's start, {format_size(br)} and "
                f"{format_size(bw)} from the backward's"
            )
        results = lockstep(
            workers,
            args.warmup + args.steps,
            warmup=args.warmup,
            timed_extra=disk.round,
            chain=args.chain,
        )
        stats = {w.variant: w.request({"op": "stats"}) for w in workers}
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        f"Disk bandwidth, GB/s (1e9 B/s): sequential O_DIRECT passes over one "
        f"{format_size(disk_size)} file beside the offload path, fio at bs {FIO_BS}, "
        f"median [min..max] of {len(disk.samples[(disk.ENGINE, 'read')])} rounds "
        f"(one per timed step)\n"
    )
    bw_rows = [[name, disk.cell(name, "write"), disk.cell(name, "read")] for name in disk.names]
    if not have_fio:
        why = "skipped (--no-fio)" if args.no_fio else "not installed (apt-get install -y fio)"
        bw_rows.insert(0, [f"fio: {why}", "-", "-"])
    print(format_table(["measured with", "write (incl. fsync)", "read"], bw_rows))
    fio_rate = None
    if have_fio:
        best = {d: disk.best_fio(d) for d in ("read", "write")}
        fio_rate = {d: bw for d, (bw, _) in best.items()}
        print(
            "\n(fio) below: the best fio configuration per direction: "
            + "; ".join(f"{d} {gb_s(bw)} ({name})" for d, (bw, name) in best.items())
        )
    engine_bw = {d: disk.engine(d) for d in ("read", "write")}
    print(
        "(engine): hetstore's AsyncIOEngine: "
        + "; ".join(f"{d} {gb_s(bw)}" for d, bw in engine_bw.items())
    )
    print(
        "t_disk = bytes read / read bandwidth + bytes written / write bandwidth; "
        "disk-bound fraction = t_disk / step time (1.0: the step runs at the disk's limit)\n"
    )
    table, phase_table = summarize(results, stats, args.warmup, fio_rate, engine_bw)
    print(table)
    print()
    print("Disk variants by phase (opt: optimizer.step() + zero_grad()):\n")
    print(phase_table)
    print()
    for variant, variant_stats in stats.items():
        if variant_stats.get("speculation"):
            print(f"steps taken ahead, {variant}: {variant_stats['speculation']}")
    if args.clip:
        norms = [s["norm"] for s in results["plain"]]
        bites = sum(n > args.clip for n in norms)
        print(
            f"gradient norm (plain), clipped at {args.clip}: "
            + ", ".join(f"{n:.3f}" for n in norms)
            + f"; the clip bit in {bites} of {len(norms)} steps"
        )
    print()
    text, worst = loss_report(results, relative=True)
    print(text)
    if not all(math.isfinite(s["loss"]) for r in results.values() for s in r):
        sys.exit("non-finite loss")
    if worst > 1e-4:
        sys.exit(f"losses differ from plain by up to {worst:.2e} (relative)")
    rows = record_rows(results, stats, args, params, engine_bw) if args.json else []
    if rows:
        record_json(
            args.json,
            scenario="disk_offload",
            rows=rows,
            command=bench_command("benchmarks/disk_offload.py", sys.argv[1:]),
            machine=f"{machine_line()}; {machine_summary(args.dir)}",
        )


if __name__ == "__main__":
    main()
