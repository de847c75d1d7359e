"""Disk tier IO: hetstore's AsyncIOEngine against fio and DeepSpeed's aio_handle, side by side.

    .venv/bin/python benchmarks/disk_io.py [--size 2GiB] [--dir PATH] [--repeats 3]

All engines move the same ``--size`` bytes to and from one file on the same file system,
with O_DIRECT, in rounds: every configuration runs once per round, and the rounds repeat,
so drift of a shared disk hits all of them alike. Each figure is the median of the
rounds, [min..max] beside it. Writes are timed up to and including ``fsync``; the file is
laid out (fully written) first, so writes overwrite allocated blocks, as in the disk tier
(which recycles region files). Reads are cold by construction (O_DIRECT bypasses the page
cache).

Peers are optional at run time:
  * fio: ``apt-get install -y fio libaio-dev``
  * DeepSpeed: a separate venv, never the project's:
    ``python3 -m venv .bench-venv && .bench-venv/bin/pip install torch==2.13.0 deepspeed==0.19.8``
    (the aio op JIT-builds on first use, ~3 min, kept in ``TORCH_EXTENSIONS_DIR``, by
    default ``.bench-venv/torch_extensions``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetstore._sizes import format_size, parse_size
from hetstore.tiers.aio import DEFAULT_THREADS, AsyncIOEngine, DiskFile
from hetstore.tiers.hostmem import MappedBlock

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent
_ENGINE_DEFAULTS = {
    k: p.default for k, p in inspect.signature(AsyncIOEngine).parameters.items()
}  # the engine's defaults, whatever they are today

# The DeepSpeed side, run by the benchmark venv's interpreter: one round of every config.
DS_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder
args = json.loads(sys.argv[1])
path, size = args["path"], args["size"]
aio = AsyncIOBuilder().load(verbose=False)
h0 = aio.aio_handle(2**20, 32, False, True, 1)
# page-locked buffers (posix_memalign + mlock), DeepSpeed's recommended IO memory
src = h0.new_cpu_locked_tensor(size // 4, torch.empty(0, dtype=torch.float32))
dst = h0.new_cpu_locked_tensor(size // 4, torch.empty(0, dtype=torch.float32))
torch.manual_seed(0)
src.uniform_()
out = []
for block, qd, par in args["configs"]:
    h = aio.aio_handle(block, qd, False, True, par)
    t0 = time.perf_counter()
    h.sync_pwrite(src, path)
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
    w = size / (time.perf_counter() - t0) / 1e9
    dst.zero_()
    t0 = time.perf_counter()
    h.sync_pread(dst, path)
    r = size / (time.perf_counter() - t0) / 1e9
    out.append({"config": [block, qd, par], "write": w, "read": r, "ok": bool(torch.equal(src, dst))})
    del h
h0.free_cpu_locked_tensor(src)
h0.free_cpu_locked_tensor(dst)
print("RESULT " + json.dumps(out))
"""


@dataclass
class Row:
    """One configuration's measurements across rounds (GB/s = 1e9 bytes/s)."""

    peer: str  # "hetstore", "fio", "deepspeed"
    name: str
    memory: str  # what buffer memory this side used
    write: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    note: str = ""

    def median(self, direction: str) -> float:
        xs = getattr(self, direction)
        return statistics.median(xs) if xs else float("nan")

    def cell(self, direction: str) -> str:
        xs = getattr(self, direction)
        if not xs:
            return "-"
        return f"{statistics.median(xs):.2f} [{min(xs):.2f}..{max(xs):.2f}]"


# -- buffers ------------------------------------------------------------------------------


def host_buffer(nbytes: int, kind: str) -> tuple[torch.Tensor, str]:
    """A buffer of the kind the host tier gives (``thp+mlock``/``thp``) or plain torch."""
    if kind == "torch":
        return torch.empty(nbytes, dtype=torch.uint8), "torch.empty (4 KiB pages, 64 B aligned)"
    block = MappedBlock(nbytes, huge_pages=True)
    desc = "mmap + MADV_HUGEPAGE"
    if kind == "thp+mlock":
        try:
            block.lock()
            desc += " + mlock"
        except OSError as exc:
            desc += f" (mlock failed: {exc.strerror})"
    block.tensor.fill_(0)  # fault every page in now, not inside the first timed pass
    return block.tensor[:nbytes], desc


def layout(path: str, size: int) -> None:
    """Write the whole file once, so that timed writes are overwrites."""
    buf, _ = host_buffer(64 * MiB, "thp")
    torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, out=buf)
    f = DiskFile(path)
    os.ftruncate(f.fd, 0)
    with AsyncIOEngine() as eng:
        for off in range(0, size, buf.numel()):
            eng.submit_write(f, off, buf[: min(buf.numel(), size - off)]).wait()
    os.fsync(f.fd)
    f.close()


# -- hetstore ------------------------------------------------------------------------------


def hetstore_pass(path: str, buf: torch.Tensor, write: bool, cfg: dict) -> float:
    f = DiskFile(path, create=False)
    try:
        with AsyncIOEngine(**cfg) as eng:
            t0 = time.perf_counter()
            if write:
                eng.submit_write(f, 0, buf).wait()
                os.fsync(f.fd)
            else:
                eng.submit_read(f, 0, buf).wait()
            return buf.numel() / (time.perf_counter() - t0) / 1e9
    finally:
        f.close()


# -- fio -----------------------------------------------------------------------------------

FIO_CONFIGS = [("psync", nj, 1) for nj in (1, 2, 4)] + [
    ("libaio", nj, qd) for nj in (1, 2, 4) for qd in (8, 32)
]


def fio_pass(path: str, size: int, write: bool, engine: str, numjobs: int, iodepth: int) -> float:
    per = size // numjobs // MiB * MiB
    cmd = [
        "fio", "--name=t", f"--filename={path}", f"--size={per}", f"--offset_increment={per}",
        f"--numjobs={numjobs}", "--bs=1M", f"--rw={'write' if write else 'read'}", "--direct=1",
        f"--ioengine={engine}", f"--iodepth={iodepth}", "--group_reporting",
        "--output-format=json", *(["--end_fsync=1"] if write else []),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job["write" if write else "read"]["bw_bytes"] / 1e9


# -- DeepSpeed -----------------------------------------------------------------------------

DS_CONFIGS = [(MiB, 32, 1), (MiB, 32, 4), (8 * MiB, 32, 4)]


def deepspeed_round(python: str, path: str, size: int) -> list[dict]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    venv = Path(python).absolute().parent.parent
    if (venv / "pyvenv.cfg").exists():  # keep the op builds (~3 min) with that venv
        env.setdefault("TORCH_EXTENSIONS_DIR", str(venv / "torch_extensions"))
    arg = json.dumps({"path": path, "size": size, "configs": DS_CONFIGS})
    proc = subprocess.run(
        [python, "-c", DS_SCRIPT, arg],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"DeepSpeed run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


# -- the run -------------------------------------------------------------------------------


def machine_summary(directory: str) -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    fs = subprocess.run(
        ["findmnt", "-no", "SOURCE,FSTYPE", "--target", directory], capture_output=True, text=True
    ).stdout.strip()
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = "?"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), kernel {platform.release()}, {directory} on {fs or '?'}, "
        f"THP {thp}, torch {torch.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="2GiB", help="bytes per transfer (>= 1 GiB recommended)")
    ap.add_argument(
        "--dir", default=str(REPO / "offload" / "disk_io_bench"), help="where the test file goes"
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds (median reported)")
    default_ds = REPO / ".bench-venv" / "bin" / "python"
    ap.add_argument("--deepspeed-python", default=str(default_ds) if default_ds.exists() else None)
    ap.add_argument("--no-sweep", action="store_true", help="hetstore defaults only")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()

    size = parse_size(args.size) // MiB * MiB
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "disk_io_bench.bin")
    print(
        f"# benchmarks/disk_io.py --size {format_size(size)} --dir {args.dir} --repeats {args.repeats}"
    )
    print(f"# {machine_summary(args.dir)}")
    layout(path, size)

    bufs = {kind: host_buffer(size, kind) for kind in ("thp+mlock", "thp", "torch")}
    src, _ = bufs["thp+mlock"]
    torch.randint(0, 256, (size,), dtype=torch.uint8, out=src)  # every page distinct
    for kind in ("thp", "torch"):
        bufs[kind][0].copy_(src)

    d = {k: _ENGINE_DEFAULTS[k] for k in ("block_size", "queue_depth", "threads")}
    het: list[tuple[Row, str, dict]] = [
        (Row("hetstore", "defaults", bufs["thp+mlock"][1]), "thp+mlock", d),
        (Row("hetstore", "defaults", bufs["thp"][1]), "thp", d),
        (Row("hetstore", "defaults", bufs["torch"][1], note="unaligned: all bounced"), "torch", d),
    ]
    d_threads = min(d["threads"] or DEFAULT_THREADS, d["queue_depth"])
    if not args.no_sweep:
        sweep = [{**d, "threads": t} for t in (2, 4, 16) if t != d_threads]
        sweep += [{**d, "block_size": b * MiB} for b in (1, 2, 4, 16) if b * MiB != d["block_size"]]
        sweep += [{**d, "threads": 16, "queue_depth": 16, "block_size": 4 * MiB}]
        for cfg in sweep:
            name = f"threads {cfg['threads'] or d_threads}, qd {cfg['queue_depth']}, block {cfg['block_size'] // MiB} MiB"
            het.append((Row("hetstore", name, bufs["thp+mlock"][1]), "thp+mlock", cfg))
    het[0][0].name = het[1][0].name = het[2][0].name = (
        f"defaults (threads {d_threads}, qd {d['queue_depth']}, block {d['block_size'] // MiB} MiB)"
    )

    have_fio = shutil.which("fio") is not None and not args.no_fio
    fio_rows = [
        Row("fio", f"{e} numjobs {nj} iodepth {qd}", "fio's own (malloc, 4 KiB pages)")
        for e, nj, qd in FIO_CONFIGS
    ]
    ds_python = None if args.no_deepspeed else args.deepspeed_python
    ds_rows = [
        Row("deepspeed", f"aio_handle block {b // MiB} MiB, qd {q}, intra_op {p}",
            "new_cpu_locked_tensor (posix_memalign + mlock)")
        for b, q, p in DS_CONFIGS
    ]  # fmt: skip
    ds_error = None

    dst, _ = host_buffer(size, "thp+mlock")
    verified = False
    for rnd in range(args.repeats):
        t_round = time.perf_counter()
        groups = ["hetstore", "fio", "deepspeed"]
        for group in groups[rnd % 3 :] + groups[: rnd % 3]:  # rotate: no fixed position
            if group == "hetstore":
                k = rnd % len(het)  # rotate here too: the first pass of a group runs colder
                for row, kind, cfg in het[k:] + het[:k]:
                    buf = bufs[kind][0]
                    row.write.append(hetstore_pass(path, buf, True, cfg))
                    row.read.append(
                        hetstore_pass(path, dst if kind == "thp+mlock" else buf, False, cfg)
                    )
                    if not verified:
                        assert torch.equal(dst, src), "hetstore read back different bytes"
                        verified = True
            elif group == "fio" and have_fio:
                for row, (e, nj, qd) in zip(fio_rows, FIO_CONFIGS, strict=True):
                    row.write.append(fio_pass(path, size, True, e, nj, qd))
                    row.read.append(fio_pass(path, size, False, e, nj, qd))
            elif group == "deepspeed" and ds_python and ds_error is None:
                try:
                    for row, res in zip(
                        ds_rows, deepspeed_round(ds_python, path, size), strict=True
                    ):
                        row.write.append(res["write"])
                        row.read.append(res["read"])
                        if not res["ok"]:
                            row.note = "DATA MISMATCH"
                except (RuntimeError, OSError) as exc:
                    ds_error = str(exc).strip().splitlines()[-1]
        print(
            f"# round {rnd + 1}/{args.repeats} took {time.perf_counter() - t_round:.0f} s",
            flush=True,
        )
    os.remove(path)

    rows = (
        [r for r, _, _ in het]
        + (fio_rows if have_fio else [])
        + (ds_rows if ds_python and ds_error is None else [])
    )
    print(
        f"\nGB/s (1e9 B/s) for {format_size(size)} transfers; median [min..max] of {args.repeats} rounds\n"
    )
    print("| engine | configuration | buffer memory | write (incl. fsync) | read | note |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.peer} | {r.name} | {r.memory} | {r.cell('write')} | {r.cell('read')} | {r.note} |"
        )
    if args.no_fio:
        print("| fio | skipped (--no-fio) | | | | |")
    elif not have_fio:
        print("| fio | not installed | | | | `apt-get install -y fio libaio-dev` |")
    if args.no_deepspeed:
        print("| deepspeed | skipped (--no-deepspeed) | | | | |")
    elif not ds_python:
        print(
            "| deepspeed | not installed | | | | `python3 -m venv .bench-venv && .bench-venv/bin/pip "
            "install torch==2.13.0 deepspeed==0.19.8`, or pass --deepspeed-python |"
        )
    elif ds_error is not None:
        print(f"| deepspeed | failed | | | | {ds_error} |")

    head = het[0][0]
    best_het = {
        k: max((r for r, _, _ in het), key=lambda r, k=k: r.median(k)) for k in ("write", "read")
    }
    peers = [r for r in rows if r.peer != "hetstore"]
    print(f"\nhetstore defaults ({head.memory}) vs the best peer configuration, per direction:\n")
    print(
        "| direction | hetstore defaults | best hetstore config | best peer | ratio defaults / best peer |"
    )
    print("|---|---|---|---|---|")
    for k in ("write", "read"):
        best = max(peers, key=lambda r, k=k: r.median(k)) if peers else None
        peer_txt = (
            f"{best.median(k):.2f} ({best.peer}: {best.name})" if best else "no peer measured"
        )
        ratio = f"{head.median(k) / best.median(k):.2f}x" if best else "-"
        bh = best_het[k]
        print(
            f"| {k} | {head.median(k):.2f} | {bh.median(k):.2f} ({bh.name}) | {peer_txt} | {ratio} |"
        )


if __name__ == "__main__":
    main()
