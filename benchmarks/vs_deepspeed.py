"""hetstore against DeepSpeed ZeRO-3 offload: the same GPT training, side by side.

    .venv/bin/python benchmarks/vs_deepspeed.py                      # 100M and 350M, all cases
    .venv/bin/python benchmarks/vs_deepspeed.py --sizes 100M --steps 4 --cases cpu-fp32
    .venv/bin/python benchmarks/vs_deepspeed.py --tiny               # seconds: a harness check
    make bench-deepspeed ARGS="--sizes 100M"                         # sets up .venv first

DeepSpeed comes from the ``bench`` extra (``pip install -e ".[bench]"``; ``make
bench-deepspeed`` and ``make test`` install it into ``.venv``). ``--ds-python`` runs the
DeepSpeed worker under another interpreter (it imports torch and DeepSpeed, never
hetstore). DeepSpeed JIT-builds its ops (CPUAdam, AsyncIO) on first use; they are kept in
``torch_extensions/`` inside that interpreter's virtual environment (git-ignored), so only
the first run pays for the build, and the build is timed apart from ``deepspeed.initialize``.

Each case trains one GPT (``_ds_model.PRESETS``; tied embeddings, pre-norm blocks, causal
SDPA) from the same seed (the initial weights' SHA-256 is compared) on the same batches
with AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, one parameter group; no
gradient clipping unless ``--clip``: DeepSpeed's config is told ``"gradient_clipping": 0``,
since it otherwise clips at 1.0):

* ``hetstore``: ``hetstore.offload(model, torch.optim.AdamW(fused=True), config)``,
  ``device="cpu"``, ``enable_pinned_mem=False``, one unit per block;
* ``deepspeed``: ``deepspeed.initialize`` with ZeRO stage 3 and its ``AdamW`` optimizer
  (DeepSpeedCPUAdam when offloading, what DeepSpeed uses by default), single process over
  gloo, DS_ACCELERATOR=cpu. ``--ds-optimizer fused`` hands DeepSpeed the same
  ``torch.optim.AdamW(fused=True)`` as hetstore instead (``zero_force_ds_cpu_optimizer``
  off; no op build): the same kernel on both sides, so the losses must agree to float
  rounding, which makes it the correctness check; ``torch`` takes DeepSpeed's
  ``torch_adam`` (torch's single-tensor AdamW).

Cases (``--cases``), placement-dtype:

* ``cpu-fp32``, ``cpu-bf16``: parameters and optimizer states in host memory (hetstore
  ``offload_param="cpu", offload_optimizer="cpu"``; DeepSpeed ``offload_param`` and
  ``offload_optimizer`` ``{"device": "cpu"}``);
* ``disk-bf16``: both on disk (hetstore ``"disk"`` with an ``offload_path``; DeepSpeed
  ``"nvme"`` with an ``nvme_path``), bf16 on both sides: DeepSpeed swaps parameters to
  NVMe only with bf16 enabled. ``disk-fp32`` runs too when asked for, but DeepSpeed then
  keeps its parameters in memory (see the note printed with it).

bf16 is hetstore's ``compute_dtype="bf16"`` and DeepSpeed's ``"bf16": {"enabled": true}``:
bf16 parameters and gradients in forward and backward, fp32 master weights and Adam states.
A bf16 case starts from weights rounded to bf16 values on both sides: DeepSpeed builds its
fp32 master from the bf16 cast of the model, hetstore keeps the fp32 weights it is given,
and from fp32 initial weights that alone moves the losses apart by ~1e-3 in 8 steps.

The two workers (one process each, so each peak RSS is its own) run in lockstep: step i of
both in a random order with a short pause before each, then step i + 1, so drift of the
shared machine hits both alike; ratios are medians of the per-step ratios. Reported per
case: median step time (forward, backward, optimizer step), peak RSS
(``ru_maxrss``), set-up time (``hetstore.offload`` vs ``deepspeed.initialize``; DeepSpeed's
op build or load and ``init_distributed`` apart), bytes read and written per step and in
all (``/proc/self/io``, the same counter for both IO engines), the offload directory's
size, and the losses, which must agree within ``LOSS_TOLERANCE`` (relative, every step).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _ds_model import (
    BETAS,
    EPS,
    LR,
    PRESETS,
    WEIGHT_DECAY,
    Channel,
    batch,
    build_model,
    dir_bytes,
    io_bytes,
    peak_rss_bytes,
    weights_digest,
)

REPO = Path(__file__).resolve().parent.parent
SIDES = ("hetstore", "deepspeed")
# plain PyTorch on the same model and batches, in the same lockstep: what neither side
# can beat without changing the arithmetic (bf16: torch.autocast, fp32 master weights)
PLAIN = "plain"
CASES = ("cpu-fp32", "cpu-bf16", "disk-bf16", "disk-fp32")
DEFAULT_CASES = ("cpu-fp32", "cpu-bf16", "disk-bf16")
PHASES = ("fwd", "bwd", "opt")
# Largest relative difference of the two sides' losses, at any step. Two things in
# DeepSpeed round differently from hetstore (which matches a plain PyTorch loop bit for
# bit): DeepSpeedCPUAdam vs torch's fused AdamW (about an ulp of the fp32 weights per
# step), and ZeRO-3's replacement of torch.nn.functional.linear (memory_efficient_linear,
# on by default), which adds the bias after the matmul, rounding twice in bf16 where torch
# rounds once. fp32: measured <= 3e-7 in 10 steps. bf16: each flipped rounding moves a
# weight by 2^-8 relative and the runs drift apart: 3e-5 (tiny) to 1e-4 (100M) in 8-10
# steps, 8e-3 at 350M after 10 steps, where the loss oscillates at lr 3e-4 (step 0's batch
# scores 9.7 after 8 steps and 10.0-10.1 after 10, on both sides). With --exact both
# differences are removed and the losses are equal (measured: 0).
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
EXACT_TOLERANCE = 1e-6
# Optimizer swap buffers with --ds-pipeline: with the default 4, the swap-out of the first
# sub-group finds none free (AssertionError in pipelined_optimizer_swapper.py).
PIPELINE_BUFFERS = 12
DS_NOTE_DISK_FP32 = (
    "DeepSpeed does not swap parameters to NVMe without bf16: its parameters stay in memory"
)


def parse_case(case: str) -> tuple[str, str]:
    placement, dtype = case.split("-")
    return placement, dtype


# ------------------------------------------------------------------------------ workers
def timed_step(forward, backward, update) -> dict[str, float]:
    """One training step in three timed phases, with this process's IO counters."""
    r0, w0 = io_bytes()
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    backward(loss)
    t2 = time.perf_counter()
    update()
    t3 = time.perf_counter()
    r1, w1 = io_bytes()
    out = {"loss": loss.item(), "time": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2}
    out.update(read=r1 - r0, written=w1 - w0)
    return out


def serve(chan: Channel, step_fn, stats_fn, io_start: tuple[int, int]) -> None:
    """Answer step and stats commands; ``io_start``: the IO counters before set-up."""
    for command in chan.commands():
        if command["op"] == "step":
            chan.send(step_fn(command["step"]))
        elif command["op"] == "stats":
            r, w = io_bytes()
            out = {"rss": peak_rss_bytes(), "read_total": r - io_start[0]}
            out["written_total"] = w - io_start[1]
            chan.send({**out, **stats_fn()})


def hetstore_worker(args: argparse.Namespace) -> None:
    chan = Channel()
    placement, dtype = parse_case(args.case)
    cfg = PRESETS[args.size]
    t0 = time.perf_counter()
    import hetstore

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = build_model(cfg, parse_case(args.case)[1])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    build_s = time.perf_counter() - t0
    digest = weights_digest(model)
    config = hetstore.OffloadConfig(
        offload_param=placement,
        offload_optimizer=placement,
        offload_path=args.offload_path,
        compute_dtype=dtype,
        enable_pinned_mem=False,
        device="cpu",
    )
    io0 = io_bytes()
    t0 = time.perf_counter()
    model, optimizer = hetstore.offload(model, optimizer, config)
    setup_s = time.perf_counter() - t0
    io1 = io_bytes()
    chan.send(
        {
            "params": sum(p.numel() for p in model.parameters()),
            "digest": digest,
            "import_s": import_s,
            "build_s": build_s,
            "setup_s": setup_s,
            "setup_written": io1[1] - io0[1],
            "version": hetstore.__version__ if hasattr(hetstore, "__version__") else "?",
        }
    )

    def step(i: int) -> dict[str, float]:
        x, y = batch(cfg, i)

        def update() -> None:
            if args.clip:
                optimizer.clip_grad_norm_(args.clip)
            optimizer.step()
            optimizer.zero_grad()

        return timed_step(lambda: model(x, y), lambda loss: loss.backward(), update)

    def stats() -> dict[str, Any]:
        with torch.no_grad():
            after = model(*batch(cfg, 0)).item()
        return {
            "dir_bytes": dir_bytes(args.offload_path),
            "tiers": hetstore.memory_stats(model),
            "loss_after": after,
        }

    serve(chan, step, stats, io0)


def plain_worker(args: argparse.Namespace) -> None:
    """The reference: the same model and batches in a plain PyTorch loop, everything in
    memory, torch.optim.AdamW(fused=True); bf16 under torch.autocast (bf16 matmuls,
    fp32 weights and gradients: PyTorch's own mixed precision)."""
    chan = Channel()
    _, dtype = parse_case(args.case)
    cfg = PRESETS[args.size]
    model = build_model(cfg, dtype)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    io0 = io_bytes()
    chan.send(
        {"digest": weights_digest(model), "params": sum(p.numel() for p in model.parameters())}
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step(i: int) -> dict[str, float]:
        x, y = batch(cfg, i)

        def forward():
            with autocast:
                return model(x, y)

        def update() -> None:
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad()

        return timed_step(forward, lambda loss: loss.backward(), update)

    def stats() -> dict[str, Any]:
        with torch.no_grad(), autocast:
            return {"loss_after": model(*batch(cfg, 0)).item()}

    serve(chan, step, stats, io0)


def ds_config(args: argparse.Namespace, cfg, largest_param: int) -> dict[str, Any]:
    """The DeepSpeed config of one case: ZeRO-3, both offloads, AdamW as above."""
    placement, dtype = parse_case(args.case)
    opt_params: dict[str, Any] = {
        "lr": LR,
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
    }
    if args.ds_optimizer == "torch":
        opt_params["torch_adam"] = True
    zero: dict[str, Any] = {"stage": 3}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": opt_params},
        # DeepSpeed 0.19.8 clips the gradient norm at 1.0 unless told otherwise
        # (GRADIENT_CLIPPING_DEFAULT); hetstore, like torch, only when asked to
        "gradient_clipping": args.clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if args.ds_optimizer == "fused":
        del config["optimizer"]  # the client optimizer is passed to initialize()
    if args.ds_optimizer != "cpuadam":
        # torch's AdamW over ZeRO-Offload is refused unless asked for explicitly
        config["zero_force_ds_cpu_optimizer"] = False
    if args.exact:
        # keep torch's own F.linear (ZeRO-3 replaces it by default; see LOSS_TOLERANCE)
        zero["memory_efficient_linear"] = False
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if placement == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        # One swap buffer holds one parameter, so a buffer is sized to the largest one
        # (the embedding); five of them is DeepSpeed's default count. The optimizer is
        # swapped in sub-groups of ~one block (hetstore steps one unit at a time too);
        # --ds-pipeline overlaps their reads and writes with the step (off by default, as
        # in DeepSpeed; it needs more swap buffers than the default 4). AsyncIO at queue
        # depth 32 and 4 threads: the fastest setting measured here (BASELINES.md).
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": args.offload_path,
            "pin_memory": False,
            "buffer_count": 5,
            "buffer_size": largest_param,
            "max_in_cpu": 0,
        }
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": args.offload_path,
            "pin_memory": False,
            "buffer_count": PIPELINE_BUFFERS if args.ds_pipeline else 4,
            "pipeline_read": args.ds_pipeline,
            "pipeline_write": args.ds_pipeline,
        }
        zero["sub_group_size"] = args.ds_sub_group_size
        # A parameter kept for reuse keeps its swap buffer: with the default reuse distance
        # (1e9) the first block's parameters hold all five and the next fetch fails
        # ("Not enough buffers 0 for swapping 1"). Release after use, as hetstore does.
        zero["stage3_max_reuse_distance"] = 0
        config["aio"] = {
            "block_size": 1 << 20,
            "queue_depth": 32,
            "intra_op_parallelism": 4,
            "single_submit": False,
            "overlap_events": True,
        }
    return config


def load_ops(args: argparse.Namespace) -> dict[str, Any]:
    """Build or load the DeepSpeed ops this case uses, before ``init_distributed`` and
    ``initialize`` (which would otherwise hide minutes of compilation): seconds, and
    whether a build was cached."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    placement, _ = parse_case(args.case)
    # init_distributed on the CPU accelerator loads its shared-memory collectives op
    builders = [get_accelerator().create_op_builder("ShareMemCommBuilder")]
    if args.ds_optimizer == "cpuadam":
        builders.append(CPUAdamBuilder())
    if placement == "disk":
        builders.append(AsyncIOBuilder())
    ext_dir = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    out: dict[str, Any] = {"ops": {}}
    for builder in builders:
        name = builder.name
        cached = any(ext_dir.glob(f"{name}*/{name}*.so"))
        t0 = time.perf_counter()
        builder.load(verbose=False)
        out["ops"][name] = {"s": time.perf_counter() - t0, "cached": cached}
    return out


def deepspeed_worker(args: argparse.Namespace) -> None:
    chan = Channel()
    for key, value in dict(
        DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
    ).items():
        os.environ.setdefault(key, value)
    os.environ["MASTER_PORT"] = str(args.master_port)
    cfg = PRESETS[args.size]
    t0 = time.perf_counter()
    import logging

    import deepspeed

    import_s = time.perf_counter() - t0
    deepspeed.utils.logger.setLevel(logging.WARNING)
    t0 = time.perf_counter()
    model = build_model(cfg, parse_case(args.case)[1])
    build_s = time.perf_counter() - t0
    digest = weights_digest(model)
    largest = max(p.numel() for p in model.parameters())
    config = ds_config(args, cfg, largest)
    ops = load_ops(args)
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo")
    dist_s = time.perf_counter() - t0
    os.makedirs(args.offload_path, exist_ok=True)
    io0 = io_bytes()
    t0 = time.perf_counter()
    client = None
    if args.ds_optimizer == "fused":
        client = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=client, model_parameters=model.parameters(), config=config
    )
    setup_s = time.perf_counter() - t0
    io1 = io_bytes()
    chan.send(
        {
            "params": sum(
                p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
            ),
            "digest": digest,
            "import_s": import_s,
            "build_s": build_s,
            "setup_s": setup_s,
            "setup_written": io1[1] - io0[1],
            "dist_s": dist_s,
            "optimizer": type(engine.optimizer.optimizer).__name__
            if hasattr(engine.optimizer, "optimizer")
            else type(engine.optimizer).__name__,
            "version": deepspeed.__version__,
            "config": config,
            **ops,
        }
    )

    def step(i: int) -> dict[str, float]:
        x, y = batch(cfg, i)
        return timed_step(lambda: engine(x, y), engine.backward, engine.step)

    def stats() -> dict[str, Any]:
        with torch.no_grad():
            after = engine(*batch(cfg, 0)).item()
        return {"dir_bytes": dir_bytes(args.offload_path), "loss_after": after}

    serve(chan, step, stats, io0)


# ------------------------------------------------------------------------------ driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_ds_python() -> str:
    """This interpreter when DeepSpeed is installed in it (the bench extra), else
    ``.bench-venv``'s when there is one."""
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    bench = REPO / ".bench-venv" / "bin" / "python"
    if bench.exists():
        return str(bench)
    sys.exit(
        "DeepSpeed is not installed: .venv/bin/pip install -e '.[bench]' (make bench-deepspeed "
        "does it), or point --ds-python at an interpreter that has deepspeed==0.19.8"
    )


def extensions_dir(python: str) -> Path:
    """Where DeepSpeed's JIT-built ops are kept for ``python``: ``torch_extensions`` in
    its virtual environment (builds depend on that torch's paths), git-ignored."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    venv = Path(python).parent.parent
    if (venv / "pyvenv.cfg").exists():
        return venv / "torch_extensions"
    return REPO / "build" / "torch_extensions"


def start(side: str, python: str, args: argparse.Namespace, extra: list[str], env, log: Path):
    from _common import Worker

    class SideWorker(Worker):
        """_common.Worker with a chosen interpreter, environment and log file."""

        def __init__(self) -> None:
            self.variant = side
            self.log = log
            with open(log, "w") as err:
                self.proc = subprocess.Popen(
                    [python, __file__, "--worker", side, *extra],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            self.ready = self.request(None)

        def request(self, command):
            try:
                return super().request(command)
            except RuntimeError:
                tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
                raise RuntimeError(f"{side} worker failed (log {self.log}):\n{tail}") from None

    return SideWorker()


def run_case(size: str, case: str, args: argparse.Namespace, first: str) -> dict[str, Any]:
    """Both sides of one case, in lockstep; what each reported."""
    from _common import lockstep

    workdir = Path(tempfile.mkdtemp(prefix=f"vs_ds_{size}_{case}_", dir=args.dir))
    logs = Path(args.dir) / "vs_deepspeed_logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = ["--size", size, "--case", case, "--ds-optimizer", args.ds_optimizer]
    base += ["--ds-sub-group-size", str(args.ds_sub_group_size), "--clip", str(args.clip)]
    base += ["--ds-pipeline"] if args.ds_pipeline else []
    base += ["--exact"] if args.exact else []
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions_dir(args.ds_python)))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    placement, _ = parse_case(case)
    workers = {}
    try:
        order = [first, *(s for s in SIDES if s != first)] + ([PLAIN] if args.plain else [])
        for side in order:
            extra = [*base, "--offload-path", str(workdir / side)]  # unused off disk
            if side == "deepspeed":
                extra += ["--master-port", str(free_port())]
            python = args.ds_python if side == "deepspeed" else sys.executable
            log = logs / f"{size}-{case}-{side}.log"
            workers[side] = start(side, python, args, extra, env, log)
        total = args.warmup + args.steps
        results = lockstep(list(workers.values()), total, warmup=args.warmup, progress=False)
        stats = {side: w.request({"op": "stats"}) for side, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "size": size,
        "case": case,
        "exact": args.exact,
        "ready": {side: w.ready for side, w in workers.items()},
        "steps": results,
        "stats": stats,
    }


def ratio_cell(h: float, d: float, fmt: str = ".2f") -> str:
    return f"{h / d:{fmt}}" if d else "-"


def losses(run: dict[str, Any], side: str) -> list[float]:
    """A side's loss at every step, then its loss on step 0's batch after training."""
    return [s["loss"] for s in run["steps"][side]] + [run["stats"][side]["loss_after"]]


def loss_check(run: dict[str, Any]) -> tuple[float, float]:
    """(largest relative difference of the two sides' losses, the tolerance for the dtype)."""
    hs, ds = losses(run, "hetstore"), losses(run, "deepspeed")
    worst = max(abs(a - b) / abs(b) for a, b in zip(hs, ds, strict=True))
    if run.get("exact"):
        return worst, EXACT_TOLERANCE
    return worst, LOSS_TOLERANCE[parse_case(run["case"])[1]]


def tables(runs: list[dict[str, Any]], warmup: int) -> str:
    from _common import format_table, median, size, spread

    time_rows, phase_rows, setup_rows, io_rows, loss_rows = [], [], [], [], []
    plain_rows = []
    for run in runs:
        label = [run["size"], run["case"]]
        timed = {side: run["steps"][side][warmup:] for side in SIDES}
        h_t = [s["time"] for s in timed["hetstore"]]
        d_t = [s["time"] for s in timed["deepspeed"]]
        paired = median([a / b for a, b in zip(h_t, d_t, strict=True)])
        rss = {side: run["stats"][side]["rss"] for side in SIDES}
        time_rows.append(
            label
            + [f"{median(h_t):.3f} {spread(h_t)}", f"{median(d_t):.3f} {spread(d_t)}"]
            + [f"**{paired:.2f}**", size(rss["hetstore"]), size(rss["deepspeed"])]
            + [f"**{ratio_cell(rss['hetstore'], rss['deepspeed'])}**"]
        )
        if PLAIN in run["steps"]:
            p_t = [s["time"] for s in run["steps"][PLAIN][warmup:]]

            def against_plain(side_t, p_t=p_t):
                return median([a / b for a, b in zip(side_t, p_t, strict=True)])

            plain_rows.append(
                label
                + [f"{median(p_t):.3f} {spread(p_t)}", f"**{against_plain(h_t):.2f}**"]
                + [f"{against_plain(d_t):.2f}", f"**{1 / against_plain(d_t):.2f}**"]
            )
        for phase in PHASES:
            h = median([s[phase] for s in timed["hetstore"]])
            d = median([s[phase] for s in timed["deepspeed"]])
            phase_rows.append(label + [phase, f"{h:.3f}", f"{d:.3f}", ratio_cell(h, d)])
        hr, dr = run["ready"]["hetstore"], run["ready"]["deepspeed"]
        ops = "; ".join(
            f"{name} {o['s']:.1f} ({'cached' if o['cached'] else 'built'})"
            for name, o in dr.get("ops", {}).items()
        )
        setup_rows.append(
            label
            + [f"{hr['setup_s']:.2f}", f"{dr['setup_s']:.2f}"]
            + [f"**{ratio_cell(hr['setup_s'], dr['setup_s'])}**", ops or "-"]
            + [f"{dr['dist_s']:.2f}", f"{hr['import_s']:.1f} / {dr['import_s']:.1f}"]
            + [dr.get("optimizer", "?")]
        )
        row = list(label)
        for side in SIDES:
            n = len(timed[side])
            row += [
                size(sum(s["read"] for s in timed[side]) / n),
                size(sum(s["written"] for s in timed[side]) / n),
            ]
        row += [size(run["ready"][side]["setup_written"]) for side in SIDES]
        row += [size(run["stats"][side]["written_total"]) for side in SIDES]
        row += [size(run["stats"][side]["dir_bytes"]) for side in SIDES]
        io_rows.append(row)
        worst, tol = loss_check(run)
        hs, ds = losses(run, "hetstore"), losses(run, "deepspeed")
        loss_rows.append(
            label
            + [f"{hs[0]:.6f}", f"{ds[0]:.6f}", f"{hs[-2]:.6f}", f"{ds[-2]:.6f}"]
            + [f"{hs[-1]:.6f}", f"{ds[-1]:.6f}"]
            + [f"{worst:.1e}", f"{tol:.0e}", "ok" if worst <= tol else "**over**"]
        )
    n = len(runs[0]["steps"]["hetstore"]) if runs else 0
    out = [
        "Step time (median of the timed steps, s [min..max]) and peak RSS; ratios hetstore / "
        "DeepSpeed (step: median of the per-step ratios)\n",
        format_table(
            ["size", "case", "hetstore step s", "DeepSpeed step s", "step ratio"]
            + ["hetstore peak RSS", "DeepSpeed peak RSS", "RSS ratio"],
            time_rows,
        ),
        *(
            [
                "\nPlain PyTorch on the same model and batches in the same lockstep (in "
                "memory, fused AdamW; bf16 under torch.autocast); plain / DeepSpeed is what "
                "the step ratio above would be if hetstore cost nothing over plain PyTorch\n",
                format_table(
                    ["size", "case", "plain step s", "hetstore / plain", "DeepSpeed / plain"]
                    + ["plain / DeepSpeed"],
                    plain_rows,
                ),
            ]
            if plain_rows
            else []
        ),
        "\nBy phase (median s; opt: hetstore optimizer.step() + zero_grad(), DeepSpeed "
        "engine.step())\n",
        format_table(["size", "case", "phase", "hetstore", "DeepSpeed", "ratio"], phase_rows),
        "\nSet-up: hetstore.offload() vs deepspeed.initialize(), s (model construction "
        "excluded on both sides); DeepSpeed's op build/load before initialize, and "
        "init_distributed, apart\n",
        format_table(
            ["size", "case", "hetstore offload s", "DeepSpeed initialize s", "ratio"]
            + ["DeepSpeed ops s", "DeepSpeed init_distributed s"]
            + ["import s (hetstore / deepspeed)", "DeepSpeed optimizer"],
            setup_rows,
        ),
        "\nStorage traffic (/proc/self/io read_bytes / write_bytes): per timed step, during "
        "set-up, and in all (set-up and every step); the offload directory's allocated size "
        "at the end\n",
        format_table(
            ["size", "case", "hetstore read / step", "hetstore written / step"]
            + ["DeepSpeed read / step", "DeepSpeed written / step"]
            + ["hetstore written in set-up", "DeepSpeed written in set-up"]
            + ["hetstore written in all", "DeepSpeed written in all"]
            + ["hetstore offload dir", "DeepSpeed offload dir"],
            io_rows,
        ),
        f"\nLosses: step 0, step {n - 1}, and step 0's batch again after the last step "
        "(no grad); the largest relative difference between the sides over all of them\n",
        format_table(
            ["size", "case", "hetstore step 0", "DeepSpeed step 0", f"hetstore step {n - 1}"]
            + [f"DeepSpeed step {n - 1}", "hetstore step 0's batch after"]
            + ["DeepSpeed step 0's batch after", "max rel diff", "tolerance", "agree"],
            loss_rows,
        ),
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Presets: "
        + "; ".join(
            f"{name}: width {c.width}, {c.layers} layers, {c.heads} heads, vocab {c.vocab}, "
            f"batch {c.batch} x {c.seq} tokens"
            for name, c in PRESETS.items()
        ),
    )
    parser.add_argument("--sizes", default="100M,350M", help="comma-separated presets")
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, of: {', '.join(CASES)}",
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny preset, 1 + 3 steps: a harness check"
    )
    parser.add_argument(
        "--ds-optimizer",
        choices=("cpuadam", "fused", "torch"),
        default="cpuadam",
        help="DeepSpeed's AdamW: DeepSpeedCPUAdam (default; JIT-built once), the same "
        "torch.optim.AdamW(fused=True) as hetstore's (no build), or DeepSpeed's torch_adam",
    )
    parser.add_argument(
        "--ds-sub-group-size",
        type=int,
        default=10**7,
        help="DeepSpeed's sub_group_size on disk: parameters per optimizer swap group",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="clip the gradient norm at this value on both sides (0: no clipping, the default)",
    )
    parser.add_argument(
        "--ds-pipeline",
        action="store_true",
        help="DeepSpeed on disk: overlap the optimizer swap-in/out with the step "
        "(pipeline_read/pipeline_write)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="give DeepSpeed hetstore's arithmetic: --ds-optimizer fused and ZeRO-3's "
        "memory_efficient_linear off; the losses must then be equal (a correctness check)",
    )
    parser.add_argument("--ds-python", help="interpreter for the DeepSpeed worker")
    parser.add_argument(
        "--dir",
        default=str(REPO / "offload"),
        help="offload paths are made in a temporary directory here (the disk under test, "
        "not tmpfs); worker logs go to DIR/vs_deepspeed_logs",
    )
    parser.add_argument("--json", help="also write every measurement to this JSON file")
    parser.add_argument(
        "--no-plain",
        dest="plain",
        action="store_false",
        help="leave out the plain PyTorch reference run beside the two sides",
    )
    parser.add_argument("--worker", choices=(*SIDES, PLAIN), help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--offload-path", help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.steps, args.warmup = "tiny", 3, 1
    if args.exact:
        args.ds_optimizer = "fused"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "hetstore":
        hetstore_worker(args)
        return 0
    if args.worker == "deepspeed":
        deepspeed_worker(args)
        return 0
    if args.worker == PLAIN:
        plain_worker(args)
        return 0

    from _common import machine_line

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [s for s in sizes if s not in PRESETS] + [c for c in cases if c not in CASES]
    if bad:
        sys.exit(f"unknown sizes or cases {bad}: sizes {list(PRESETS)}, cases {list(CASES)}")
    args.ds_python = args.ds_python or default_ds_python()
    os.makedirs(args.dir, exist_ok=True)

    command = [".venv/bin/python", "benchmarks/vs_deepspeed.py", "--sizes", ",".join(sizes)]
    command += ["--cases", ",".join(cases), "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--ds-optimizer", args.ds_optimizer]
    command += ["--clip", str(args.clip)] if args.clip else []
    command += ["--ds-pipeline"] if args.ds_pipeline else []
    command += ["--exact"] if args.exact else []
    command += [] if args.plain else ["--no-plain"]
    print("$ " + shlex.join(command), flush=True)
    print(f"# {machine_line()}")
    print(f"# DeepSpeed worker: {args.ds_python}; ops in {extensions_dir(args.ds_python)}")
    print(
        f"# AdamW lr={LR} betas={BETAS} eps={EPS} weight_decay={WEIGHT_DECAY}, gradient "
        f"clipping {args.clip or 'off'}; "
        f"{args.warmup} warm-up + {args.steps} timed steps, lockstep",
        flush=True,
    )
    runs = []
    for i, (size, case) in enumerate((s, c) for s in sizes for c in cases):
        first = SIDES[i % 2]  # who sets up first alternates from case to case
        t0 = time.perf_counter()
        run = run_case(size, case, args, first)
        ready = run["ready"]
        if len({r["digest"] for r in ready.values()}) != 1:
            sys.exit(f"{size} {case}: the sides start from different weights")
        if ready["hetstore"]["params"] != ready["deepspeed"]["params"]:
            sys.exit(f"{size} {case}: parameter counts differ: {ready}")
        print(
            f"# {size} {case}: {ready['hetstore']['params'] / 1e6:.1f}M parameters, "
            f"{time.perf_counter() - t0:.0f} s; weights digest {ready['hetstore']['digest']}; "
            f"DeepSpeed config {ready['deepspeed']['config']['zero_optimization']}",
            flush=True,
        )
        if case == "disk-fp32":
            print(f"# note: {DS_NOTE_DISK_FP32}")
        runs.append(run)
    print(f"# deepspeed {runs[0]['ready']['deepspeed']['version']}, torch {torch.__version__}")
    print()
    print(tables(runs, args.warmup))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(runs, indent=1))
    status = 0
    for run in runs:
        if not all(math.isfinite(x) for side in SIDES for x in losses(run, side)):
            print(f"{run['size']} {run['case']}: non-finite loss", file=sys.stderr)
            status = 1
        worst, tol = loss_check(run)
        if worst > tol:
            print(
                f"{run['size']} {run['case']}: losses differ by {worst:.2e} (relative), "
                f"over the tolerance {tol:.0e}",
                file=sys.stderr,
            )
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
