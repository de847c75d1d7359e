"""``hetstore demo``: a GPT whose training states exceed the device budget trains anyway.

Trains a small byte-level GPT on a text shipped with the package, with
``auto_offload=True`` under a device budget smaller than its training states: the
planner decides where every unit's parameters, optimizer states and activations live.
Shows a progress bar (step, loss, tokens/s, each tier's use), then a summary (sizes,
budget, per-tier peaks, placement, predicted and measured step time) and writes two
pictures: the per-tier memory timeline of one step (``memory_timeline.png``, its data in
``timeline.json`` for ``hetstore report``) and the loss curve (``loss.png``).
``compare`` also trains plain PyTorch on the same batches and shows the losses agree;
``no_offload`` keeps everything on the device and shows the out-of-memory report the
budget causes.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch

import hetstore
from hetstore._cli import in_flags
from hetstore._sizes import format_duration, format_size
from hetstore.demo.gpt import GPT
from hetstore.errors import ConfigError, OutOfTierMemory
from hetstore.model_state import state_of

__all__ = ["DemoSettings", "run_demo", "load_corpus"]

BYTES_PER_PARAM = 16  # fp32 weights + gradients + two Adam moments


# The demo model's size and budget share where the user gives none, per device kind.
# Why larger on CUDA: there the budget binds the whole process through the allocator,
# and the CUDA runtime's own allocations (cuBLAS workspaces: 64 MiB on an H100) would not
# fit the CPU demo's 19 MiB budget. Why a larger share: at 25% of this model's states
# (0.58 GiB) the H100 run stopped over budget, the allocator holding ~50 MiB of cached
# blocks beside what the planner placed; at 50% it trains within budget.
SIZES = {
    "cpu": dict(width=256, depth=6, context=64, budget_fraction=0.25),
    "cuda": dict(width=1024, depth=12, context=256, budget_fraction=0.5),
}


@dataclass(frozen=True)
class DemoSettings:
    width: int | None = None  # None: SIZES for the device
    depth: int | None = None
    context: int | None = None
    batch: int = 8
    steps: int = 100
    lr: float = 5e-4
    budget_fraction: float | None = None  # device budget as a share of the states
    host_fraction: float | None = 1.0  # host budget likewise (None: the machine's RAM)
    seed: int = 0
    device: str = "auto"
    out: str = "."
    offload_path: str | None = None  # None: the config file's, else OffloadConfig's default
    config_file: str | None = None  # an OffloadConfig file; the demo's keys override it
    compare: bool = False
    no_offload: bool = False
    progress: bool = True

    def sized_for(self, device: torch.device) -> DemoSettings:
        """These settings with the model's size filled in for ``device`` where unset."""
        defaults = SIZES["cuda" if device.type == "cuda" else "cpu"]
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def check(self) -> None:
        for key in ("width", "depth", "context", "batch", "steps"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"--{key} must be at least 1, got {getattr(self, key)}")
        if self.budget_fraction is not None and not 0 < self.budget_fraction <= 10:
            raise ConfigError(f"--budget-fraction must be in (0, 10], got {self.budget_fraction}")


def _check_extras() -> None:
    """The progress bar and the pictures need the ``demo`` extra: say so before training."""
    import importlib.util

    missing = [m for m in ("tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"hetstore demo needs {' and '.join(missing)}: pip install 'hetstore[demo]'"
        )


def load_corpus() -> torch.Tensor:
    """The demo's training text as byte ids (0..255)."""
    text = resources.files("hetstore.demo").joinpath("corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def _batches(data: torch.Tensor, settings: DemoSettings):
    g = torch.Generator().manual_seed(settings.seed)
    out = []
    for _ in range(settings.steps):
        starts = torch.randint(
            0, data.numel() - settings.context - 1, (settings.batch,), generator=g
        )
        chunk = torch.stack([data[s : s + settings.context + 1] for s in starts.tolist()])
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def _model(settings: DemoSettings) -> GPT:
    torch.manual_seed(settings.seed)
    heads = max(1, settings.width // 64)
    return GPT(
        vocab=256, width=settings.width, depth=settings.depth, heads=heads, ctx=settings.context
    )


def _config(settings: DemoSettings, budget: int, states: int) -> hetstore.OffloadConfig:
    if settings.no_offload:  # the seed's failure case: everything stays on the device
        placement = dict(offload_param="none", offload_optimizer="none")
    else:
        placement = dict(auto_offload=True)
    demo_keys = dict(
        **placement,
        max_device_memory=budget,
        device=settings.device,
    )
    if settings.host_fraction is not None:
        demo_keys["offload_cpu_size"] = int(states * settings.host_fraction)
    if settings.offload_path is not None:
        demo_keys["offload_path"] = settings.offload_path
    if settings.config_file is not None:
        config = hetstore.OffloadConfig.from_file(settings.config_file).replace(**demo_keys)
    else:
        # the demo's activations are small: let the planner move them
        config = hetstore.OffloadConfig(activation_min_bytes="64KB", **demo_keys)
    return config  # (enable_pinned_mem 'auto': pinned on CUDA only, and no warning on a CPU)


def run_demo(settings: DemoSettings = DemoSettings(), out=sys.stdout, err=sys.stderr) -> int:
    """Run the demo; returns the exit code (0 trained within budget, 1 out of memory or
    budget passed, 2 bad settings or an unwritable output/offload directory)."""
    out_dir = Path(settings.out)
    try:
        _check_extras()
        settings.check()
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".hetstore-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except ConfigError as exc:
        print(f"hetstore demo: {exc}", file=err)
        return 2
    except OSError as exc:
        print(
            f"hetstore demo: cannot write the pictures under --out {out_dir}: "
            f"{exc.strerror or exc}; pass --out DIR with a writable directory",
            file=err,
        )
        return 2
    flags = _flags(settings)
    data = load_corpus()
    try:
        settings = settings.sized_for(
            hetstore.OffloadConfig(device=settings.device).resolved_device()
        )
    except ConfigError as exc:
        print(f"hetstore demo: {in_flags(str(exc), flags)}", file=err)
        return 2
    model = _model(settings)
    n_params = sum(p.numel() for p in model.parameters())
    states = BYTES_PER_PARAM * n_params
    budget = int(states * settings.budget_fraction)
    try:
        config = _config(settings, budget, states)
    except ConfigError as exc:
        print(f"hetstore demo: {in_flags(str(exc), flags)}", file=err)
        return 2
    # (its disk tier removes the ./offload it made when the model is released)
    return _run(settings, config, model, n_params, states, budget, data, out_dir, out, err)


def _flags(settings: DemoSettings) -> dict[str, str]:
    """The config keys of ``hetstore demo``'s errors named by its flags: offload_path
    unless it came from the --config file."""
    flags = {"device": "--device"}
    if settings.offload_path is not None or settings.config_file is None:
        flags["offload_path"] = "--offload-path"
    return flags


def _run(settings, config, model, n_params, states, budget, data, out_dir, out, err) -> int:
    flags = _flags(settings)
    device = config.resolved_device()
    batches = _batches(data, settings)
    curves = {}
    if settings.compare:
        # Plain PyTorch first, on a copy: on CUDA the budget binds the whole process from
        # offload() on, and the plain model is what does not fit it.
        reference = copy.deepcopy(model).to(device)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=settings.lr)
        curves["plain PyTorch"], _, _ = _train(
            reference, ref_opt, batches, settings, device, err, label="plain"
        )
        del reference, ref_opt
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the plain run's blocks, cached, count in the budget
    print(
        f"hetstore demo: GPT, {settings.depth} blocks x width {settings.width}, "
        f"{n_params / 1e6:.2f}M parameters, on {device}\n"
        f"  training states (fp32 weights + grads + Adam moments): {format_size(states)}\n"
        f"  device budget (max_device_memory):                     {format_size(budget)}"
        f"  ({settings.budget_fraction:.0%} of the states, --budget-fraction)\n"
        f"  placement: {'everything on the device (--no-offload)' if settings.no_offload else 'auto_offload (the planner decides)'}",
        file=out,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    if settings.progress and not settings.no_offload:
        print(
            "hetstore demo: planning the placement (probing the machine, timing one block)...",
            file=err,
            flush=True,
        )
    try:
        try:
            model, optimizer = hetstore.offload(model, optimizer, config, example_inputs=batches[0])
            if not settings.no_offload:
                print(f"\nthe plan:\n{state_of(model).plan}\n", file=out)
            losses, timeline, step_times = _train(model, optimizer, batches, settings, device, err)
        except OutOfTierMemory as exc:
            print(f"\nhetstore demo: {exc}", file=err)
            if exc.tier == "device":
                print(
                    "  (hetstore demo sets max_device_memory to --budget-fraction times the "
                    "training states: raise --budget-fraction)",
                    file=err,
                )
            if settings.no_offload:
                print(
                    "\nThis is what --no-offload shows: the training states do not fit the "
                    "device budget. Run without --no-offload to train anyway.",
                    file=err,
                )
            return 1
        except ConfigError as exc:
            print(f"hetstore demo: {in_flags(str(exc), flags)}", file=err)
            return 2
        except OSError as exc:
            where = flags.get("offload_path", "offload_path")
            print(
                f"hetstore demo: cannot use {where} {config.offload_path!r}: "
                f"{exc.strerror or exc}; pass --offload-path DIR on a writable local disk",
                file=err,
            )
            return 2
        stats = hetstore.memory_stats(model)
        curves = {"hetstore": losses, **curves}
        _summary(model, n_params, states, budget, stats, losses, step_times, curves, out)
        if timeline is not None:
            timeline.title = _timeline_title(settings, timeline, step_times)
        _pictures(timeline, curves, settings, out_dir, out)
        return 0 if stats["device"]["peak"] <= budget else 1
    finally:
        if state_of(model) is not None:
            hetstore.release(model)  # its files and directory under offload_path go now


def _train(model, optimizer, batches, settings, device, err, label="hetstore"):
    """Train on ``batches``; returns the losses, the memory timeline of one steady step
    (after the profiled ones; None for a model hetstore does not manage) and the times of
    the steady steps not recorded."""
    from tqdm import tqdm

    from hetstore.api import PROFILED_STEPS
    from hetstore.timeline import TimelineRecorder

    managed = state_of(model) is not None
    recorded = min(PROFILED_STEPS, len(batches) - 1)
    timeline = None
    losses, step_times = [], []
    start = time.perf_counter()
    bar = tqdm(
        total=len(batches),
        desc=f"{label:>8}",
        file=err,
        disable=not settings.progress,
        mininterval=0.5,
        dynamic_ncols=True,
    )
    for step, (x, y) in enumerate(batches):
        step_start = time.perf_counter()
        recorder = None
        if managed and step == recorded:
            recorder = TimelineRecorder(model, title=f"step {step + 1}")
            timeline = recorder.timeline
        mark = recorder.phase if recorder is not None else (lambda name: None)
        with recorder or contextlib.nullcontext():
            mark("forward")
            loss = model(x.to(device), y.to(device))
            mark("backward")
            loss.backward()
            mark("step")
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if step >= PROFILED_STEPS and recorder is None:
            step_times.append(time.perf_counter() - step_start)
        tokens = (step + 1) * settings.batch * settings.context
        postfix = {
            "loss": f"{losses[-1]:.3f}",
            "tok/s": f"{tokens / (time.perf_counter() - start):.0f}",
        }
        if managed:
            for tier, s in hetstore.memory_stats(model).items():
                postfix[tier] = format_size(s["current"])
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
    bar.close()
    return losses, timeline, step_times


def _timeline_title(settings: DemoSettings, timeline, step_times: list[float]) -> str:
    """The picture's title: which step it shows, and how long that step took beside the
    median of the steps timed (the recorded one is not among them)."""
    recorded = timeline.samples[-1][0] if timeline.samples else 0.0
    title = (
        f"hetstore demo: memory per tier during {timeline.title}, the first after the "
        f"profiled ones (GPT {settings.depth} x {settings.width}, auto_offload)"
    )
    if step_times:
        median = statistics.median(step_times)
        title += (
            f"\nthis step took {format_duration(recorded)} while recorded, "
            f"{recorded / median:.2f}x the median step ({format_duration(median)} over "
            f"{len(step_times)} steps)"
        )
    return title


def _summary(model, n_params, states, budget, stats, losses, step_times, curves, out) -> None:
    runtime = state_of(model).runtime
    plan = runtime.plan
    moved = {"parameters": "param", "optimizer states": "optimizer", "activations": "activations"}
    lines = [
        "",
        "summary",
        f"  model                {n_params / 1e6:.2f}M parameters ({format_size(4 * n_params)} fp32)",
        f"  training states      {format_size(states)}",
        f"  device budget        {format_size(budget)}",
    ]
    for tier, s in stats.items():
        cap = "no limit" if s["capacity"] is None else format_size(s["capacity"])
        lines.append(f"  {tier + ' peak':<20} {format_size(s['peak']):>11}   (may use {cap})")
    for label, field in moved.items():
        counts: dict[str, int] = {}
        for unit in plan.units:
            tier = getattr(unit.choice, field).label
            counts[tier] = counts.get(tier, 0) + 1
        text = ", ".join(f"{n} unit{'s' if n > 1 else ''} on {t}" for t, n in counts.items())
        lines.append(f"  {label:<20} {text}")
    lines += _step_times(plan, runtime.calibrated_plan, step_times)
    within = stats["device"]["peak"] <= budget
    lines.append(f"  device peak within budget: {'yes' if within else 'NO'}")
    lines.append(f"  loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    if "plain PyTorch" in curves:
        plain = curves["plain PyTorch"]
        diff = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
        lines.append(
            f"  plain PyTorch (no budget): last loss {plain[-1]:.4f}; "
            f"max |loss difference| over {len(losses)} steps: {diff:.2e}"
        )
    print("\n".join(lines), file=out)


def _step_times(plan, calibrated, step_times: list[float]) -> list[str]:
    """The summary's lines on step time: predicted before training and after the
    profiled steps, against the median of the steps measured."""
    from hetstore.planner.plan import spread_line

    if plan.estimate is None:
        return []
    before = plan.estimate.step_s
    after = calibrated.estimate.step_s if calibrated and calibrated.estimate else None
    text = f"predicted {format_duration(before)} before training"
    if after is not None:
        text += f", {format_duration(after)} after profiling"
    lines = [f"  {'step time':<20} {text}"]
    if step_times:
        median = statistics.median(step_times)
        lines.append(
            f"  {'':<20} measured {format_duration(median)} (median of {len(step_times)} "
            f"steps; fastest {format_duration(min(step_times))}, slowest "
            f"{format_duration(max(step_times))})"
        )
        ratios = f"{median / before:.2f} before training"
        if after:
            ratios += f", {median / after:.2f} after profiling"
        ratios += f" (the fastest step: {min(step_times) / before:.2f} before training)"
        lines.append(f"  {'':<20} measured / predicted: {ratios}")
    spread = spread_line(plan.estimate)
    if spread:
        lines.append(f"  {'':<20} {spread}")
    return lines


def _pictures(timeline, curves, settings, out_dir: Path, out) -> None:
    from hetstore.report import plot_losses, plot_timeline

    if timeline is None:
        return
    timeline.save(out_dir / "timeline.json")
    written = [
        plot_timeline(timeline, out_dir / "memory_timeline.png"),
        plot_losses(
            curves,
            out_dir / "loss.png",
            title=f"hetstore demo: GPT {settings.depth} x {settings.width}, training loss",
        ),
    ]
    print(
        "\nwrote " + ", ".join(str(p) for p in written) + f" and {out_dir / 'timeline.json'}",
        file=out,
    )
