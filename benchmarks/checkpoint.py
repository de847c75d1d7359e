"""Checkpoint throughput: hetstore.save / load / export_weights against the disk's fio
bandwidth and torch.distributed.checkpoint (DCP), side by side in one run.

    .venv/bin/python benchmarks/checkpoint.py [--width 1024 --depth 8] [--repeats 3]

A GPT built on the meta device is trained one step with parameters and optimizer
states on disk (everything a save reads comes from the disk tier), then each round runs,
in a fresh random order:

- fio: sequential 1 MiB writes (O_DIRECT, fsync at the end) and reads of the
  checkpoint's size in the same directory: the disk's ceiling for this IO;
- hetstore.save (disk tier -> checkpoint files), hetstore.load (checksums, then the
  checkpoint -> the disk tier) and hetstore.export_weights (fp32 weights);
- DCP: model.state_dict() + optimizer.state_dict() (which must first read every state
  from disk into host memory: timed separately) and dcp.save / dcp.load of that dict.

GB/s is the checkpoint's bytes over the wall time. Save and load read and write the same
disk at once (tier <-> files), so the disk-bound ideal for them is about half of fio's
one-direction figure; the table's ratio is against fio's write (save, export) or read
(load) bandwidth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

import hetstore
from _common import format_table, interleaved, machine_line, median, size, spread
from hetstore.demo.gpt import GPT


def build(width: int, depth: int, swap: Path):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(vocab=256, width=width, depth=depth, heads=16, ctx=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    config = hetstore.OffloadConfig(
        offload_param="disk",
        offload_optimizer="disk",
        offload_path=str(swap),
        optimizer_chunk_size="16MB",
        enable_pinned_mem=False,
        device="cpu",
    )
    model, optimizer = hetstore.offload(model, optimizer, config, init_fn=GPT.init_weights)
    idx = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(0))
    model(idx[:, :-1], idx[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def fio(path: Path, nbytes: int, write: bool) -> float:
    """Seconds fio takes to write (or read) ``nbytes`` sequentially, O_DIRECT, 1 MiB."""
    cmd = [
        "fio", "--name=ckpt", f"--filename={path}", f"--size={nbytes // 2**20}M", "--bs=1M",
        f"--rw={'write' if write else 'read'}", "--direct=1", "--ioengine=libaio",
        "--iodepth=16", "--output-format=json", *(["--end_fsync=1"] if write else []),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return nbytes / job["write" if write else "read"]["bw_bytes"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir here)")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    args = ap.parse_args()
    if args.tiny:
        args.width, args.depth, args.repeats = 256, 1, 1

    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or "."))
    try:
        model, optimizer = build(args.width, args.depth, root / "swap")
        saved = hetstore.save(root / "ck", model, optimizer)
        nbytes = sum(f.stat().st_size for f in saved.iterdir())
        export_bytes = sum(
            f.stat().st_size for f in hetstore.export_weights(root / "export", model)
        )
        params = sum(p.numel() for p in model.parameters())
        variants = {
            "hetstore.save": lambda: timed(lambda: hetstore.save(root / "ck", model, optimizer)),
            "hetstore.load": lambda: timed(lambda: hetstore.load(root / "ck", model, optimizer)),
            "hetstore.export_weights": lambda: timed(
                lambda: hetstore.export_weights(root / "export", model)
            ),
        }
        if not args.no_fio and shutil.which("fio"):
            variants["fio write"] = lambda: fio(root / "fio.dat", nbytes, write=True)
            variants["fio read"] = lambda: fio(root / "fio.dat", nbytes, write=False)
        dcp_phase: dict[str, list[float]] = {"state_dict()": []}
        if not args.no_dcp:
            import torch.distributed.checkpoint as dcp

            def dcp_state() -> dict:
                start = time.perf_counter()
                state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                dcp_phase["state_dict()"].append(time.perf_counter() - start)
                return state

            def dcp_save() -> float:
                state = dcp_state()
                shutil.rmtree(root / "dcp", ignore_errors=True)
                return timed(lambda: dcp.save(state, checkpoint_id=root / "dcp", no_dist=True))

            def dcp_load() -> float:
                state = dcp_state()
                return timed(lambda: dcp.load(state, checkpoint_id=root / "dcp", no_dist=True))

            variants["dcp.save (state in memory)"] = dcp_save
            variants["dcp.load (into memory)"] = dcp_load
            dcp_save()  # the loads need a checkpoint
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process warnings
            samples = interleaved(variants, args.repeats, settle=0.2)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fio_write = median(samples["fio write"]) if "fio write" in samples else None
    fio_read = median(samples["fio read"]) if "fio read" in samples else None
    rows = []
    for name, values in samples.items():
        moved = export_bytes if name.startswith("hetstore.export") else nbytes
        seconds = median(values)
        reference = fio_read if ("load" in name or name == "fio read") else fio_write
        ratio = "-" if reference is None else f"{(moved / seconds) / (nbytes / reference):.2f}"
        rows.append(
            [name, size(moved), f"{seconds:.2f} {spread(values)}", f"{moved / seconds / 1e9:.2f}"]
            + [ratio]
        )
    if dcp_phase["state_dict()"]:
        seconds = median(dcp_phase["state_dict()"])
        rows.append(
            ["DCP's state_dict() (disk tier -> host memory)", size(nbytes), f"{seconds:.2f}"]
            + [f"{nbytes / seconds / 1e9:.2f}", "-"]
        )
    print(machine_line())
    print(
        f"GPT width {args.width} depth {args.depth}: {params / 1e6:.0f}M parameters, "
        f"checkpoint {size(nbytes)} (fp32 masters + 2 AdamW moments), export {size(export_bytes)}"
        f"; {args.repeats} rounds, interleaved"
    )
    print(format_table(["operation", "bytes", "median s [min..max]", "GB/s", "/ fio"], rows))


if __name__ == "__main__":
    main()
