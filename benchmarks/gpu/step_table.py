"""GPU: one table of training steps, hetstore and its peers, every row against plain PyTorch.

For a lent GPU machine (``benchmarks/gpu/run_all.sh`` runs it there, about 8 minutes with
the CUDA tests):

    python benchmarks/gpu/step_table.py part --model gpt --json OUT/step_gpt.json
    python benchmarks/gpu/step_table.py part --model llama --json OUT/step_llama.json
    python benchmarks/gpu/step_table.py table --dir OUT [--results-dir benchmarks/results]
    python benchmarks/gpu/step_table.py --smoke      (or SMOKE=1): every row, tiny, on the CPU

A ``part`` is one process for one model: it builds every runner of that model from the
same random weights, then for each batch shape runs one warm-up round and timed rounds
in which every runner takes one step on the same batch, in a fresh seeded order per
round (machine noise hits all alike), then one profiled round for the GPU busy fraction.
So each row's ratio is to plain PyTorch measured in the same process on the same
batches, and the loss difference is step by step: compared only while a runner has
taken as many optimizer steps as plain (not after the steady row's extra steps, an
overlap trial run alone, or a slow row's skipped rounds). A runner other than plain
whose warm-up step took over ``--one-step-s`` takes one timed step per shape, so that
the disk rows do not take the time of the others' rounds. ``--budget-s`` bounds the
part: rounds are dropped (never below one timed round per batch shape) so that every
shape gets the same number of timed steps where the time allows; the row's ``steps``
says how many ran. It writes its rows as JSON after each timed round, so a part stopped
by its ``timeout`` keeps what it finished (a shape cut short, the steps it took);
``table`` merges the parts into one table (a row missing says
so) and, with ``--results-dir``, writes ``gpu_step_engine_<date>_<device>.txt``.

Runners (every one under ``torch.autocast(device, bfloat16)``, fp32 master weights,
``AdamW(lr=1e-4)`` fused):

- ``plain``: the model on the GPU in fp32, torch's fused AdamW on the GPU.
- ``hetstore host``: ``offload_param="cpu", offload_optimizer="cpu"``,
  ``compute_dtype="bf16"`` (bf16 copies on the device, the fp32 master and the states in
  pinned host memory), every other key at its default: on a GPU the host units'
  ordinary steps run in place beside the next forward, each landing before its unit's
  fetch. It is timed in steady state: an untimed step before each timed one (whose
  steps the timed step's forward lands) and the timed step's own finished after the
  timing, so its time is one period of a training loop; it takes two steps a round, so
  its losses are compared with plain's only in the warm-up round (its exactness is the
  CUDA tests').
  ``hetstore host no-overlap``: the same with ``overlap_step=False,
  step_in_forward=False`` (the overlap must never be slower: ``'auto'`` keeps
  whichever of the two its trial measured faster, ``optim.policy.OverlapTrial``, which a
  run starts after 20 steps; here each hetstore row with a trial runs it alone after
  each shape's warm-up round, ``OverlapTrial.restart``, so its timed steps take the way
  a long run keeps, and a note says which; rows whose steps take over ``--settle-s``
  keep the untried default); ``hetstore host step_in_backward``: the same placement
  with ``step_in_backward=True`` (each block's ordinary host step in place on the worker
  as soon as its gradients are on the host, beside the rest of backward; the root's in
  the next forward; timed in steady state like ``hetstore host``; no clipping, which it
  refuses); ``hetstore states on host``: ``offload_param="none",
  offload_optimizer="cpu"`` (the bf16 parameters stay on the GPU, the fp32 master and
  states on the host: torchao's placement, so the two compare like for like);
  ``hetstore disk``:
  ``offload_param="disk", offload_optimizer="disk"`` under ``--offload-dir``, defaults.
  Its step's time includes ``optimizer.finish_steps_in_forward()``: the unit steps that
  ``step_in_forward`` leaves to the next forward are finished inside the step that
  started them, so none of it runs while another runner is timed (an upper bound: a
  training loop would overlap them with its next forward).
- ``fsdp2 cpu-offload``: ``fully_shard(block)`` per block and on the root, one rank (a
  process group of 1 on a free port), ``CPUOffloadPolicy()`` (fp32 parameters,
  gradients and AdamW states in pinned host memory, the step on the CPU) and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
- ``torchao cpu-offload``: ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW,
  fused=True)``: fp32 parameters on the GPU, gradients copied to pinned host memory per
  parameter, the AdamW step on the CPU, the parameters copied back. torchao is imported
  with its compiled extensions skipped (only the pure-Python optimizer is used); if the
  package does not import, its ``optim/cpu_offload.py`` alone is loaded; if that fails
  too the row says why.

Columns: median step time of the timed steps and its ratio to plain's median; the GPU
busy fraction of one profiled step (the union of every kernel's and copy's interval
over the step's wall time, ``spans.profile_step``); the CUDA allocator's peak
of the runner's own (what it holds between steps plus the most a step allocates above
that, as ``offload_step.py`` measures it); the largest |loss - plain's loss| over all of
the shape's steps (bf16 device copies in hetstore and FSDP2 make it about 1e-3). Below
the table, where each runner's profiled step spent its time (``spans.breakdown``): the
GPU's kernels and copies each way, and each CPU thread's ops (the caller's, autograd's,
the optimizer's worker), with the longest of them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent)]  # spans.py beside; _common.py above

from spans import breakdown_line, profile_step  # noqa: E402

import hetstore  # noqa: E402
from _common import format_table, git_commit, size  # noqa: E402

RUNNERS = (
    "plain",
    "hetstore host",
    "hetstore host no-overlap",
    "hetstore host step_in_backward",
    "hetstore states on host",
    "hetstore disk",
    "fsdp2 cpu-offload",
    "torchao cpu-offload",
)
MODELS = ("gpt", "llama")
LR = 1e-4
GPU_BATCHES = "8x512,32x512"
SMOKE_BATCHES = "2x16,4x16"
HEADER = (
    "model",
    "tokens/step",
    "runner",
    "median step ms",
    "/ plain",
    "GPU busy",
    "peak CUDA",
    "max |loss - plain|",
    "steps",
)


class Unavailable(Exception):
    """A runner that cannot run here; its message is what the row says."""


# ----------------------------------------------------------------------------- models
@dataclass
class ModelSpec:
    key: str
    title: str
    vocab: int
    ctx: int
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def gpt_spec(smoke: bool, ctx: int) -> ModelSpec:
    """offload_step.py's model: hetstore.demo.gpt.GPT, width 1024, depth 12, vocab 32768
    (185M parameters with a context of 512, tied embeddings)."""
    from hetstore.demo.gpt import GPT

    width, depth, heads, vocab = (64, 2, 2, 256) if smoke else (1024, 12, 16, 32768)
    return ModelSpec(
        "gpt",
        f"hetstore.demo.gpt.GPT (width {width}, depth {depth}, {heads} heads, vocab {vocab})",
        vocab,
        ctx,
        lambda: GPT(vocab, width, depth, heads, ctx),
        lambda model: list(model.blocks),
        lambda model, idx: model(idx[:, :-1], idx[:, 1:]),
    )


def llama_spec(smoke: bool, ctx: int) -> ModelSpec:
    """A Llama-shaped model with random weights from transformers' LlamaConfig (nothing
    downloaded): hidden 2048, 16 layers, SwiGLU 5632, 16 heads, vocab 32000, untied:
    0.95B parameters (TinyLlama's width with plain multi-head attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, vocab = (
        (64, 128, 2, 2, 256) if smoke else (2048, 5632, 16, 16, 32000)
    )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=ctx,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )

    def loss(model, idx):
        x = idx[:, :-1]
        return model(input_ids=x, labels=x, use_cache=False).loss  # shifted inside

    return ModelSpec(
        "llama",
        f"transformers LlamaForCausalLM from LlamaConfig (hidden {hidden}, {layers} layers, "
        f"SwiGLU {inter}, {heads} heads, vocab {vocab}, untied, sdpa)",
        vocab,
        ctx,
        lambda: LlamaForCausalLM(config),
        lambda model: list(model.model.layers),
        loss,
    )


SPECS = {"gpt": gpt_spec, "llama": llama_spec}


def count_label(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K"


# ---------------------------------------------------------------------------- runners
@dataclass
class Runner:
    name: str
    status: str = "ok"  # or what the row says instead of figures
    model: nn.Module | None = None
    opt: Any = None
    finish: Callable[[], None] | None = None  # called inside the timed step
    # timed in steady state (steps left to the next forward): an untimed step before each
    # timed one, whose steps its forward lands, and ``finish`` after the timing
    steady: bool = False
    release: Callable[[], None] | None = None
    note: str = ""
    built_bytes: int = 0
    resident: int | None = None
    # optimizer steps taken: a loss is compared with plain's only when both have taken
    # as many (not after a steady round's extra step, an overlap trial run alone, or a
    # slow row's skipped timed rounds)
    steps_taken: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def drop(self, status: str) -> None:
        self.status = status
        with contextlib.suppress(Exception):
            if self.release is not None:
                self.release()
        self.model = self.opt = self.finish = self.release = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class Context:
    spec: ModelSpec
    device: torch.device
    offload_dir: str
    mesh: Any = None

    def device_mesh(self):
        """A process group of one rank on a free local port (gloo for CPU tensors, NCCL
        for CUDA ones), made once per process."""
        if self.mesh is not None:
            return self.mesh
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
        self.mesh = init_device_mesh(self.device.type, (1,))
        return self.mesh


def build_plain(runner: Runner, make: Callable[[], nn.Module], ctx: Context) -> None:
    runner.model = make().to(ctx.device)
    runner.opt = torch.optim.AdamW(runner.model.parameters(), lr=LR, fused=True)


def hetstore_builder(
    param: str,
    optim: str,
    overlap,
    in_forward="auto",
    steady: bool = False,
    in_backward: bool = False,
):
    def build(runner: Runner, make: Callable[[], nn.Module], ctx: Context) -> None:
        model = make()
        config = hetstore.OffloadConfig(
            offload_param=param,
            offload_optimizer=optim,
            device=ctx.device.type,
            compute_dtype="bf16",
            offload_path=ctx.offload_dir,
            overlap_step=overlap,
            step_in_forward=in_forward,
            step_in_backward=in_backward,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        runner.model, runner.opt = hetstore.offload(model, opt, config, process_group=False)
        runner.finish = runner.opt.finish_steps_in_forward
        runner.steady = steady
        runner.release = lambda: hetstore.release(runner.model)

    return build


def build_fsdp2(runner: Runner, make: Callable[[], nn.Module], ctx: Context) -> None:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    mesh = ctx.device_mesh()
    model = make()
    # pinning needs an accelerator: on the CPU (the smoke run) the host copies are plain
    policy = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in ctx.spec.blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    runner.model = model
    runner.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def load_cpu_offload_optimizer() -> tuple[type, str]:
    """torchao's CPUOffloadOptimizer and where it came from. Its compiled extensions are
    not needed (nor loaded: a build for another torch can fail to load, or crash); if
    the package does not import, its pure-Python module alone is loaded."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    spec = importlib.util.find_spec("torchao")
    if spec is None or spec.origin is None:
        raise Unavailable(
            "unavailable: torchao is not installed (benchmarks/gpu/fetch_wheels.sh puts "
            "its wheel in .wheels/, which run_all.sh installs)"
        )
    try:
        from importlib.metadata import version

        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer, f"torchao {version('torchao')}"
    except Exception as exc:  # the package's other modules may not import on this torch
        first = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    source = Path(spec.origin).parent / "optim" / "cpu_offload.py"
    saved = {name: sys.modules.get(name) for name in ("torchao", "torchao.utils")}
    try:
        package = types.ModuleType("torchao")
        package.__path__ = []
        utils = types.ModuleType("torchao.utils")
        utils.get_available_devices = lambda: (
            ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        )
        sys.modules.update({"torchao": package, "torchao.utils": utils})
        module_spec = importlib.util.spec_from_file_location("_torchao_cpu_offload", source)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module.CPUOffloadOptimizer, f"torchao's cpu_offload.py alone (import: {first})"
    except Exception as exc:
        raise Unavailable(
            f"unavailable: torchao does not import ({first}); its cpu_offload.py alone: "
            f"{type(exc).__name__}: {exc}".splitlines()[0][:240]
        ) from exc
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def build_torchao(runner: Runner, make: Callable[[], nn.Module], ctx: Context) -> None:
    optimizer_class, source = load_cpu_offload_optimizer()
    runner.note = source
    if ctx.device.type != "cuda":
        raise Unavailable(f"needs CUDA ({source} imported)")
    runner.model = make().to(ctx.device)
    runner.opt = optimizer_class(runner.model.parameters(), torch.optim.AdamW, lr=LR, fused=True)


BUILDERS = {
    "plain": build_plain,
    # (the defaults: on a GPU the host units' steps run in the next forward)
    "hetstore host": hetstore_builder("cpu", "cpu", "auto", steady=True),
    "hetstore host no-overlap": hetstore_builder("cpu", "cpu", False, False),
    # (each block's host step in place beside the rest of backward; the root's left to
    # the next forward)
    "hetstore host step_in_backward": hetstore_builder(
        "cpu", "cpu", "auto", steady=True, in_backward=True
    ),
    # (torchao's placement: the parameters stay on the GPU, master and states on the host)
    "hetstore states on host": hetstore_builder("none", "cpu", "auto"),
    "hetstore disk": hetstore_builder("disk", "disk", "auto"),
    "fsdp2 cpu-offload": build_fsdp2,
    "torchao cpu-offload": build_torchao,
}


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settled_allocated(device: torch.device) -> int:
    """``memory_allocated`` once finished work is done and the caching allocator has
    taken back blocks freed on a side stream (offload_step.py's); 0 on the CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.empty(1, device=device)
    return torch.cuda.memory_allocated(device)


def train_step(
    runner: Runner, spec: ModelSpec, idx: torch.Tensor, device, finish: bool = True
) -> tuple[float, float]:
    """One training step, synchronized at both ends: (seconds, loss); ``finish``: the
    steps it leaves to the next forward finished inside it."""
    sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = spec.loss(runner.model, idx)
    loss.backward()
    runner.opt.step()
    runner.steps_taken += 1
    runner.opt.zero_grad()
    if finish and runner.finish is not None:
        runner.finish()
    sync(device)
    return time.perf_counter() - start, loss.item()


@contextlib.contextmanager
def steady_state(runner: Runner, spec: ModelSpec, idx: torch.Tensor, device):
    """Around a measured step of a ``steady`` runner: an untimed step before it (the
    steps it leaves land in the measured step's forward, as in a training loop), and
    what the measured step leaves finished after it, before another runner runs."""
    if runner.steady:
        train_step(runner, spec, idx, device, finish=False)
    yield not runner.steady  # (whether the measured step finishes its own)
    if runner.steady and runner.finish is not None:
        runner.finish()
        sync(device)


@dataclass
class Samples:
    times: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    peak: int | None = None
    busy: float | None = None
    breakdown: dict | None = None  # where the profiled step's time went (spans.breakdown)
    warm_s: float = 0.0  # the warm-up round's step


class Part:
    """One model's runners, measured batch shape by batch shape."""

    def __init__(self, args, spec: ModelSpec, device: torch.device, started: float):
        self.args = args
        self.spec = spec
        self.device = device
        self.deadline = started + args.budget_s - args.reserve_s if args.budget_s else math.inf
        self.order = random.Random(0)
        self.runners: list[Runner] = []
        self.busy_rounds = 0
        self.out: dict[str, Any] = {
            "model": spec.key,
            "title": spec.title,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "runners": list(RUNNERS),
            "batches": args.batches,
            "rows": [],
            "notes": [],
        }

    def save(self) -> None:
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.out, indent=1))
        os.replace(tmp, path)

    def note(self, text: str) -> None:
        print(f"# {text}", flush=True)
        self.out["notes"].append(text)

    # -- set-up
    def build(self, offload_dir: str) -> None:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        base = self.spec.build()
        n = sum(p.numel() for p in base.parameters())
        self.out["params"] = n
        self.out["label"] = f"{self.spec.key} {count_label(n)}"
        self.note(
            f"{self.out['label']}: {self.spec.title}, built in {time.perf_counter() - t0:.1f} s"
        )
        self.save()
        ctx = Context(self.spec, self.device, offload_dir)
        make = functools.partial(copy.deepcopy, base)  # each runner its own copy
        for name in RUNNERS:
            runner = Runner(name)
            if self.args.runners and name not in self.args.runners:
                runner.status = "not run: --runners"
                self.runners.append(runner)
                continue
            t0 = time.perf_counter()
            before = settled_allocated(self.device)
            try:
                BUILDERS[name](runner, make, ctx)
            except Unavailable as exc:
                runner.drop(str(exc))
            except Exception as exc:
                traceback.print_exc()
                runner.drop(f"unavailable: {one_line(exc)}")
            runner.built_bytes = settled_allocated(self.device) - before
            took = time.perf_counter() - t0
            shown = f" ({runner.note})" if runner.note and runner.ok else ""
            self.note(f"{name}: {runner.status}{shown}, set up in {took:.1f} s")
            self.runners.append(runner)
        self.out["runner_notes"] = {r.name: r.note for r in self.runners if r.note}
        del base, make
        gc.collect()

    # -- rounds
    def active(self) -> list[Runner]:
        return [r for r in self.runners if r.ok]

    def round(self, idx, samples, kind: str) -> float:
        """Every active runner takes one step on ``idx``; returns the round's seconds."""
        t0 = time.perf_counter()
        losses: dict[str, float] = {}
        cuda = self.device.type == "cuda"
        for runner in self.order.sample(self.active(), len(self.active())):
            got = samples[runner.name]
            if (
                kind == "timed"
                and runner.name != "plain"  # (every row's reference)
                and got.times
                and got.warm_s > self.args.one_step_s
            ):
                continue  # (a slow row: one timed step, the others' rounds go faster)
            try:
                if kind == "busy":
                    with steady_state(runner, self.spec, idx, self.device) as finish:
                        busy, got.breakdown, (_, loss) = profile_step(
                            lambda r=runner, f=finish: train_step(
                                r, self.spec, idx, self.device, f
                            ),
                            cuda,
                        )
                    got.busy = busy
                elif kind == "warm-up" and runner.resident is None:
                    before = settled_allocated(self.device)
                    got.warm_s, loss = train_step(runner, self.spec, idx, self.device)
                    runner.resident = settled_allocated(self.device) - before + runner.built_bytes
                elif kind == "warm-up":
                    got.warm_s, loss = train_step(runner, self.spec, idx, self.device)
                elif kind == "timed":
                    start = settled_allocated(self.device)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(self.device)
                    with steady_state(runner, self.spec, idx, self.device) as finish:
                        seconds, loss = train_step(runner, self.spec, idx, self.device, finish)
                    got.times.append(seconds)
                    if cuda:
                        above = torch.cuda.max_memory_allocated(self.device) - start
                        got.peak = max(got.peak or 0, (runner.resident or 0) + above)
                else:
                    _, loss = train_step(runner, self.spec, idx, self.device)
                losses[runner.name] = loss
            except Exception as exc:
                self.failed(runner, exc, f"in a {kind} step")
        plain = losses.get("plain")
        taken = {r.name: r.steps_taken for r in self.runners}
        for name, loss in losses.items():
            if plain is not None and name != "plain" and taken[name] == taken["plain"]:
                samples[name].diffs.append(abs(loss - plain))
            if not math.isfinite(loss):
                samples[name].diffs.append(math.inf)
        return time.perf_counter() - t0

    def failed(self, runner: Runner, exc: Exception, where: str) -> None:
        """``runner`` raised: its rows say so from here on, the others go on."""
        traceback.print_exc()
        runner.drop(f"failed: {one_line(exc)}")
        self.note(f"{runner.name}: {runner.status} ({where})")

    def settle_overlap(self, label: str, idx: torch.Tensor, samples) -> None:
        """Each runner whose steps choose their overlap by trial (hetstore under
        ``overlap_step='auto'``: ``optimizer.overlap_trial``) runs that trial for this
        batch shape, alone, before the timed rounds, so that they time the way a long
        run keeps. Left to itself the trial would start after 20 steps (each row here
        takes a few), and in the rounds the other runners' steps would land in the
        intervals it compares. A runner whose warm-up step took over ``--settle-s``
        keeps its untried default (the note says so)."""
        for runner in self.active():
            trial = getattr(runner.opt, "overlap_trial", None)
            if trial is None:
                continue
            took = samples[runner.name].warm_s
            limit = 4 * (trial.steps + 1)  # (it ends after 2 * (steps + 1) steps)
            if took > self.args.settle_s or not self.fits(limit * took):
                why = f"steps of {took:.1f} s" if took > self.args.settle_s else "time"
                self.note(f"{label}: {runner.name}: overlap trial not run ({why})")
                continue
            trials, steps = trial.trials, 0
            trial.restart()
            try:
                while trial.trials == trials and steps < limit:
                    train_step(runner, self.spec, idx, self.device, finish=False)
                    steps += 1
                if runner.finish is not None:
                    runner.finish()
                sync(self.device)
            except Exception as exc:
                self.failed(runner, exc, "in its overlap trial")
                continue
            if trial.trials == trials:
                self.note(f"{label}: {runner.name}: overlap trial unfinished after {steps} steps")
                continue
            way = "overlap" if trial.overlapping else "no overlap"
            self.note(f"{label}: {runner.name}: overlap trial kept {way} ({steps} steps alone)")

    def later_rounds(self, shapes, index: int, estimate: float, timed: int) -> float:
        """Seconds the shapes after ``shapes[index]`` need for a warm-up, ``timed`` timed
        and the profiled round, guessed from this shape's round by sqrt(tokens): an
        offloaded step grows slower than its tokens, plain's about linearly."""
        batch, ctx = shapes[index]
        rounds = 1 + timed + self.busy_rounds
        return sum(
            estimate * math.sqrt(b * c / (batch * ctx)) * rounds for b, c in shapes[index + 1 :]
        )

    def fits(self, seconds: float) -> bool:
        return time.monotonic() + seconds <= self.deadline

    def run(self) -> None:
        shapes = [tuple(int(v) for v in s.split("x")) for s in self.args.batches.split(",")]
        generator = torch.Generator().manual_seed(1)
        self.busy_rounds = 1  # (on a CPU too: the breakdown, and the smoke test's check)
        for index, (batch, ctx) in enumerate(shapes):
            label = f"{batch}x{ctx}"
            samples = {r.name: Samples() for r in self.runners}

            def tokens(batch=batch, ctx=ctx):
                idx = torch.randint(0, self.spec.vocab, (batch, ctx + 1), generator=generator)
                return idx.to(self.device)

            def say(what: str, seconds: float, label=label) -> None:
                print(f"# {self.out['label']} {label}: {what} {seconds:.1f} s", flush=True)

            estimate = self.round(tokens(), samples, "warm-up")
            say("warm-up round", estimate)
            self.settle_overlap(label, tokens(), samples)
            finished = list(self.out["rows"])  # the shapes before this one
            timed = 0
            while timed < self.args.steps and self.active():
                need = estimate * (1 + 1.3 * self.busy_rounds)
                if timed >= 1 and not self.fits(
                    need + self.later_rounds(shapes, index, estimate, timed + 1)
                ):
                    self.note(
                        f"{label}: {timed} timed step{'s' if timed != 1 else ''} of "
                        f"{self.args.steps} "
                        "(the rest would not fit the part's time budget)"
                    )
                    break
                estimate = self.round(tokens(), samples, "timed")
                timed += 1
                say(f"timed round {timed}", estimate)
                # saved after every round: a part killed by its limit keeps this shape's
                # steps so far (its rows say how many)
                self.out["rows"] = finished + self.rows(label, samples)
                self.save()
            if self.busy_rounds and self.active():
                if self.fits(1.3 * estimate + self.later_rounds(shapes, index, estimate, 1)):
                    say("profiled round", self.round(tokens(), samples, "busy"))
                else:
                    self.note(f"{label}: no profiled step (the part's time budget)")
            self.out["rows"] = finished + self.rows(label, samples)
            self.save()
            self.drop_slow(label, samples)
            print(format_table(HEADER, [row_cells(r) for r in self.out["rows"]]), flush=True)

    def drop_slow(self, label: str, samples: dict[str, Samples]) -> None:
        """``--slow-s``: the runners whose median step at ``label`` took longer are not run
        at the later shapes (their rows there say so); never plain, every row's reference."""
        limit = self.args.slow_s
        for runner in self.active():
            if runner.name == "plain":
                continue
            times = samples[runner.name].times
            if limit and times and statistics.median(times) > limit:
                runner.drop(
                    f"not run: its {label} step took {statistics.median(times):.0f} s, "
                    f"over --slow-s {limit:.0f}"
                )
                self.note(f"{runner.name}: {runner.status}")

    def rows(self, label: str, samples: dict[str, Samples]) -> list[dict[str, Any]]:
        plain = samples["plain"].times
        plain_median = statistics.median(plain) if plain else None
        rows = []
        for runner in self.runners:
            got = samples[runner.name]
            row: dict[str, Any] = {
                "model": self.out["label"],
                "tokens": label,
                "runner": runner.name,
                "status": runner.status,
                "steps": len(got.times),
            }
            if got.times:  # a runner that failed later keeps the steps it took
                median = statistics.median(got.times)
                row.update(
                    median_ms=median * 1e3,
                    ratio=median / plain_median if plain_median else None,
                    busy=got.busy,
                    breakdown=got.breakdown,
                    peak=got.peak,
                    loss_diff=max(got.diffs) if got.diffs else None,
                    times_ms=[t * 1e3 for t in got.times],
                )
            rows.append(row)
        return rows

    def close(self) -> None:
        for runner in self.runners:
            if runner.release is not None:
                with contextlib.suppress(Exception):
                    runner.release()
        self.runners = []
        gc.collect()


def run_part(args, device: torch.device) -> int:
    started = time.monotonic()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    try:
        ctx = max(int(shape.split("x")[1]) for shape in args.batches.split(","))
        spec = SPECS[args.model](args.smoke, ctx)
    except Exception as exc:
        traceback.print_exc()
        Path(args.json).write_text(
            json.dumps({"model": args.model, "error": f"unavailable: {one_line(exc)}", "rows": []})
        )
        return 1
    part = Part(args, spec, device, started)
    offload_dir = tempfile.mkdtemp(prefix="hetstore-step-table-", dir=args.offload_dir)
    try:
        part.build(offload_dir)
        part.run()
    finally:
        part.close()
        shutil.rmtree(offload_dir, ignore_errors=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # FSDP2's group of one
    print(f"# {args.model} part: {time.monotonic() - started:.0f} s", flush=True)
    return 0


# ---------------------------------------------------------------------------- the table
def row_cells(row: dict[str, Any]) -> list[str]:
    head = [row["model"], row["tokens"], row["runner"]]
    if row.get("median_ms") is None:
        return [*head, row["status"], "-", "-", "-", "-", "-"]
    ms = row["median_ms"]
    cells = [
        f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}",
        "-" if row.get("ratio") is None else f"{row['ratio']:.2f}",
        "-" if row.get("busy") is None else f"{row['busy']:.0%}",
        size(row.get("peak")),
        "-" if row.get("loss_diff") is None else f"{row['loss_diff']:.1e}",
        str(row["steps"]) + ("" if row["status"] == "ok" else f" ({row['status']})"),
    ]
    return [*head, *cells]


STOPPED = "not measured: the part stopped before this shape (its timeout? see the log)"


def merge(
    folder: Path, models: list[str], batches: list[str]
) -> tuple[list[list[str]], list[dict]]:
    """Every expected row, from each model's part file; a row the part did not write
    says why."""
    cells, parts = [], []
    for model in models:
        path = folder / f"step_{model}.json"
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError):
            part = {"model": model, "rows": [], "missing": f"not run: no {path.name} (see the log)"}
        parts.append(part)
        label = part.get("label", model)
        have = {(r["tokens"], r["runner"]): r for r in part.get("rows", [])}
        for tokens in batches:
            for runner in RUNNERS:
                row = have.get((tokens, runner))
                if row is None:
                    why = part.get("error") or part.get("missing") or STOPPED
                    row = {"model": label, "tokens": tokens, "runner": runner, "status": why}
                cells.append(row_cells(row))
    return cells, parts


def device_slug(name: str) -> str:
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla")]
    return "".join(c for c in (words[0] if words else "cpu") if c.isalnum()) or "gpu"


def make_table(args) -> int:
    folder = Path(args.dir)
    models = args.models.split(",")
    batches = args.batches.split(",")
    cells, parts = merge(folder, models, batches)
    device = next((p["device"] for p in parts if p.get("device")), "unknown device")
    torch_version = next((p["torch"] for p in parts if p.get("torch")), torch.__version__)
    python = next((p["python"] for p in parts if p.get("python")), platform.python_version())
    cpus = next((p["cpus"] for p in parts if p.get("cpus")), os.cpu_count())
    lines = [
        f"$ {args.run_command}",
        f"# {device}, torch {torch_version}, Python {python}, {cpus} CPUs; git {git_commit()}",
    ]
    lines += [f"# {note}" for note in args.note]
    for part in parts:
        if part.get("title"):
            lines.append(f"# {part['label']}: {part['title']}")
    peers = {}
    for part in parts:
        peers.update(part.get("runner_notes", {}))
    for name, note in peers.items():
        lines.append(f"# {name}: {note}")
    lines += [
        "# every runner under torch.autocast(bf16), fp32 master weights, AdamW lr 1e-4 fused; "
        "hetstore compute_dtype bf16, FSDP2 MixedPrecisionPolicy(bf16, reduce fp32); plain "
        "and torchao fp32 parameters on the GPU",
        "# each (model, tokens) block: one process per model, one warm-up round, timed "
        "rounds in a seeded random order per round, one profiled round (GPU busy); ratio = "
        "median / plain's median in the same process; peak CUDA = the runner's own "
        "(between steps + the most a step allocates above that); a hetstore step includes "
        "finish_steps_in_forward()",
        "",
        format_table(HEADER, cells),
    ]
    profiled = [
        f"# {r['model']} {r['tokens']} {r['runner']}: {breakdown_line(r['breakdown'])}"
        for part in parts
        for r in part.get("rows", [])
        if r.get("breakdown")
    ]
    if profiled:
        lines += ["", "# where each profiled step's time went, ms (spans.breakdown):", *profiled]
    for part in parts:
        for note in part.get("notes", []):
            if any(key in note for key in ("timed step", "failed:", "no profiled", "trial")):
                lines.append(f"# {part.get('label', part['model'])}: {note}")
    text = "\n".join(lines) + "\n"
    print(text, end="", flush=True)
    if args.results_dir:
        results = Path(args.results_dir)
        results.mkdir(parents=True, exist_ok=True)
        stem = f"gpu_step_engine_{datetime.date.today().isoformat()}_{device_slug(device)}"
        path, run = results / f"{stem}.txt", 1
        while path.exists():
            run += 1
            path = results / f"{stem}_run{run}.txt"
        path.write_text(text)
        print(f"# written to {path}", flush=True)
        copy = Path(args.copy_to) / path.name if args.copy_to else None
        if copy is not None and not (copy.exists() and copy.samefile(path)):
            shutil.copy(path, copy)
    return 0


# ------------------------------------------------------------------------------- main
def smoke(args) -> int:
    """Every row with tiny models on the CPU (hetstore's device is the CPU)."""
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="step-table-smoke-"))
    device = torch.device("cpu")
    started = time.monotonic()
    for model in MODELS:
        part_args = argparse.Namespace(
            model=model,
            batches=SMOKE_BATCHES,
            steps=2,
            budget_s=0,
            reserve_s=0,
            json=str(folder / f"step_{model}.json"),
            offload_dir=args.offload_dir,
            runners=None,
            slow_s=args.slow_s,
            settle_s=2.0,
            one_step_s=2.0,
            smoke=True,
        )
        run_part(part_args, device)
    table_args = argparse.Namespace(
        dir=str(folder),
        models=",".join(MODELS),
        batches=SMOKE_BATCHES,
        results_dir=None,
        copy_to=None,
        note=[f"smoke: tiny models on the CPU, {time.monotonic() - started:.0f} s"],
        run_command="python benchmarks/gpu/step_table.py --smoke",
    )
    code = make_table(table_args)
    if not args.out:
        shutil.rmtree(folder, ignore_errors=True)
    return code


def main() -> int:
    # `timeout` stops a part with SIGTERM: leave through the finally blocks (the disk
    # tier's files are removed; the rows of the finished shapes are already written)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every row, tiny, on the CPU")
    parser.add_argument("--out", default=None, help="--smoke: keep the part files here")
    parser.add_argument("--offload-dir", default=None, help="folder for the disk tier")
    parser.add_argument("--slow-s", type=float, default=0, help="--smoke: as a part's")
    sub = parser.add_subparsers(dest="command")
    part = sub.add_parser("part", help="one model's rows, written as JSON")
    part.add_argument("--model", choices=MODELS, required=True)
    part.add_argument("--batches", default=GPU_BATCHES, help="BxCTX,... (default %(default)s)")
    part.add_argument("--steps", type=int, default=5, help="timed steps per batch shape")
    part.add_argument("--budget-s", type=float, default=0, help="the part's seconds (0: none)")
    part.add_argument("--reserve-s", type=float, default=15, help="kept for clean-up")
    part.add_argument(
        "--slow-s",
        type=float,
        default=0,
        help="a runner whose median timed step took longer is not run at the later batch "
        "shapes (0: no limit), so that one slow row cannot take the others' time",
    )
    part.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="a runner with an overlap trial runs it alone before each shape's timed rounds "
        "if its warm-up step took at most this",
    )
    part.add_argument(
        "--one-step-s",
        type=float,
        default=2.0,
        help="a runner whose warm-up step took longer takes one timed step per shape",
    )
    part.add_argument("--json", required=True)
    part.add_argument("--runners", type=lambda s: s.split(","), default=None)
    part.add_argument("--offload-dir", default=None, help="folder for the disk tier")
    part.add_argument("--cpu", action="store_true", help="run on the CPU")
    part.add_argument("--tiny", action="store_true", help="the smoke run's tiny models")
    table = sub.add_parser("table", help="merge the parts' rows into one table")
    table.add_argument("--dir", required=True, help="where the parts wrote step_<model>.json")
    table.add_argument("--models", default=",".join(MODELS))
    table.add_argument("--batches", default=GPU_BATCHES)
    table.add_argument("--results-dir", default=None, help="write the results file here")
    table.add_argument("--copy-to", default=None, help="and copy it here")
    table.add_argument("--run-command", default="bash benchmarks/gpu/run_all.sh")
    table.add_argument("--note", action="append", default=[], help="a line for the header")
    args = parser.parse_args()
    if args.smoke or (args.command is None and os.environ.get("SMOKE") == "1"):
        return smoke(args)
    if args.command == "table":
        return make_table(args)
    if args.command == "part":
        args.smoke = args.tiny
        if not args.cpu and not torch.cuda.is_available():
            raise SystemExit("step_table.py part needs CUDA (or --cpu, or --smoke)")
        return run_part(args, torch.device("cpu" if args.cpu else "cuda"))
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
