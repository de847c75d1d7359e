"""Evict and restore throughput against a plain copy of the same bytes, in the same run.

A GPT whose states all live on the device (``offload_param=offload_optimizer='none'``:
fp32 master, gradients and Adam's moments there) is trained one step, then evicted to
host memory and restored ``--repeats`` times. Each round also times the references on
buffers of the same sizes, interleaved in a random order:

- **copy out**: ``host.copy_(device)`` into preallocated host buffers, one per storage
  (what evict does at best: its host buffers are kept from the last cycle);
- **copy out + free**: the same, then each device storage's bytes freed, as evict must
  (on a CPU device the memory goes back to the system: ``munmap``, not free of cost);
- **copy in**: ``device.copy_(host)`` into preallocated device buffers (restore at
  best);
- **alloc + copy in**: a fresh device buffer per storage, then the copy (what restore
  must do: the device bytes were given back, so it allocates them again; on a CPU device
  a fresh allocation page-faults on its first touch, on CUDA the caching allocator
  answers).

On a CUDA device the host buffers are pinned (``enable_pinned_mem``) and the references
are pinned ``copy_`` too; the issue's target is evict and restore at >= 0.8 of them.

    .venv/bin/python benchmarks/evict_restore.py                 # ~100M GPT, CPU
    .venv/bin/python benchmarks/evict_restore.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import hetstore  # noqa: E402
from hetstore.demo.gpt import GPT  # noqa: E402


def _storages(model) -> list[int]:
    """The sizes of the storages an evict moves (read from one evict's host buffers)."""
    state = hetstore.state_of(model)
    sizes = []
    for unit in state.runtime.units:
        for buffer in unit.buffers_on(hetstore.Tier.DEVICE):
            sizes.append(buffer.untyped_storage().nbytes())
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--dir", default=None, help="offload_path (a spill to disk goes here)")
    parser.add_argument("--out", help="write the table and its provenance to this file")
    parser.add_argument("--json", help="write a result record (docs/performance.md) here")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.depth, args.repeats = 64, 2, 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    torch.manual_seed(0)
    model = GPT(
        vocab=8192, width=args.width, depth=args.depth, heads=max(1, args.width // 64), ctx=64
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config = hetstore.OffloadConfig(
        offload_param="none",
        offload_optimizer="none",
        device=str(device),
        enable_pinned_mem=cuda,
        **({"offload_path": args.dir} if args.dir else {}),
    )
    model, optimizer = hetstore.offload(model, optimizer, config)
    idx = torch.randint(0, 8192, (2, 65), device=device)
    model(idx[:, :-1], idx[:, 1:]).backward()
    optimizer.step()  # the moments exist; the gradients stay (evicted with the rest)

    sizes = _storages(model)
    total = sum(sizes)
    pin = dict(pin_memory=True) if cuda else {}
    host_refs = [torch.empty(n, dtype=torch.uint8, **pin) for n in sizes]
    device_refs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    for t in host_refs + device_refs:
        t.fill_(1)  # first touch outside the timings

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    moved = {"evict": [], "restore": []}
    restore_seconds: list[float] = []  # (timed with each evict, reported beside it)

    def evict() -> float:
        seconds = timed(lambda: moved["evict"].append(hetstore.evict(model, optimizer)))
        restore_seconds.append(timed(lambda: moved["restore"].append(hetstore.restore(model))))
        return seconds

    def copy_out() -> None:
        for h, d in zip(host_refs, device_refs, strict=True):
            h.copy_(d, non_blocking=cuda)

    def copy_out_free() -> float:
        seconds = timed(lambda: (copy_out(), [d.untyped_storage().resize_(0) for d in device_refs]))
        for d, n in zip(device_refs, sizes, strict=True):  # (untimed: back for the others)
            d.untyped_storage().resize_(n)
            d.fill_(1)
        return seconds

    def copy_in() -> None:
        for h, d in zip(host_refs, device_refs, strict=True):
            d.copy_(h, non_blocking=cuda)

    def alloc_copy_in() -> None:
        fresh = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        for h, d in zip(host_refs, fresh, strict=True):
            d.copy_(h, non_blocking=cuda)
        sync()

    evict()  # warm-up: the host pool's blocks are mapped (and pinned) once
    restore_seconds.clear()
    samples = _common.interleaved(
        {
            "evict": evict,
            "copy out": lambda: timed(copy_out),
            "copy out + free": copy_out_free,
            "copy in": lambda: timed(copy_in),
            "alloc + copy in": lambda: timed(alloc_copy_in),
        },
        repeats=args.repeats,
    )
    samples["restore"] = restore_seconds
    assert all(r.total >= total for r in moved["evict"]), "evict moved less than the states"

    def rate(name: str) -> float:
        return total / _common.median(samples[name]) / 2**30

    rows = [
        ("evict", "copy out", rate("evict"), rate("copy out")),
        ("evict", "copy out + free", rate("evict"), rate("copy out + free")),
        ("restore", "copy in", rate("restore"), rate("copy in")),
        ("restore", "alloc + copy in", rate("restore"), rate("alloc + copy in")),
    ]
    table = _common.format_table(
        ["hetstore", "reference", "hetstore GiB/s", "reference GiB/s", "ratio", "spread (s)"],
        [
            (mine, ref, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}", _common.spread(samples[mine]))
            for mine, ref, a, b in rows
        ],
    )
    command = "python benchmarks/evict_restore.py " + " ".join(sys.argv[1:])
    lines = [
        f"# evict/restore of {_common.size(total)} in {len(sizes)} storages "
        f"({args.width}x{args.depth} GPT, states on {device}), median of {args.repeats}",
        table,
        "",
        f"machine: {_common.machine_line()}",
        f"command: {command.strip()}",
        f"commit: {_common.git_commit()}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        _common.record_json(
            args.json,
            scenario="evict_restore",
            rows=[
                {
                    "config": f"{device.type}: {mine} vs {ref}",
                    "bytes": _common.size(total),
                    "gib_s": round(a, 2),
                    "reference_gib_s": round(b, 2),
                    "ratio": round(a / b, 2),
                }
                for mine, ref, a, b in rows
            ],
            command=command.strip(),
            machine=_common.machine_line(),
        )
    hetstore.release(model)


if __name__ == "__main__":
    main()
