"""``hetstore plan``: can this machine train this GPT, where does everything go, how fast.

The model is built on the meta device and traced on meta tensors: nothing is allocated,
so a 70B model plans as quickly as a small one. ``--max-model`` walks a ladder of GPT
shapes and reports the largest the capacities can hold. ``--measure N`` then trains the
planned GPT for real for N steps on random tokens and prints the measured step time
beside the predicted one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_plan_parser", "run_plan"]

# (width, depth) steps of the --max-model search, about 2x parameters per step
LADDER = [
    (768, 12),
    (1024, 24),
    (1536, 24),
    (2048, 24),
    (2560, 32),
    (4096, 32),
    (5120, 40),
    (6144, 48),
    (8192, 64),
    (12288, 96),
    (16384, 128),
]


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a GPT's placement on this machine without building it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--width", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--depth", type=int, default=32, help="number of blocks (default 32)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--ctx", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--device-memory", help="max_device_memory, e.g. 24GB (default: all)")
    p.add_argument("--host-memory", help="offload_cpu_size, e.g. 64GB (default: the RAM)")
    p.add_argument("--disk", help="offload_disk_size, e.g. 1TB (default: free space)")
    p.add_argument("--path", default="./offload", help="offload_path (default ./offload)")
    p.add_argument("--dtype", default="fp32", help="compute dtype: fp32, bf16, fp16")
    p.add_argument(
        "--state-format",
        default="fp32",
        help="optimizer_state_format: fp32 (default), bf16 or 8bit (bytes per parameter of "
        "the optimizer states: 8, 4 or 2.03 for Adam)",
    )
    p.add_argument(
        "--step-in-backward",
        action="store_true",
        help="step_in_backward: units with states on disk are stepped inside backward and "
        "their gradients never go to disk (4 bytes per parameter less there)",
    )
    p.add_argument("--json", metavar="FILE", help="also save the plan as JSON")
    p.add_argument(
        "--measure",
        type=int,
        metavar="STEPS",
        help="then build the GPT for real (hetstore.offload with these capacities) and "
        "train STEPS steps on random tokens after the profiled ones: the measured step "
        "time beside the predicted one (only for a model this machine can train)",
    )
    p.add_argument(
        "--max-model", action="store_true", help="find the largest GPT of the ladder that fits"
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="predict compute from FLOPs only; by default one block's forward and backward "
        "run for real at the batch's shapes (skipped when one would take over 2 s)",
    )
    p.add_argument(
        "--hf-config",
        metavar="PATH",
        help="plan a Hugging Face causal LM (Llama, Qwen, Mistral, GPT-2 ...) from its "
        "config.json, a file or a directory holding one, instead of the GPT: built on "
        "the meta device, nothing downloaded; printed beside accelerate's estimate-memory",
    )


def _gpt(width: int, depth: int, vocab: int, ctx: int):
    import torch

    from hetstore.demo.gpt import GPT

    with torch.device("meta"):
        return GPT(vocab=vocab, width=width, depth=depth, heads=max(1, width // 128), ctx=ctx)


def _try_depth(plan_at, depth: int):
    """``(depth, numel, plan)`` when ``plan_at(depth)`` (``(numel, plan)``, raising
    OutOfTierMemory when it does not fit) fits, else None; prints a line either way."""
    from hetstore.errors import OutOfTierMemory

    try:
        numel, plan = plan_at(depth)
    except OutOfTierMemory as exc:
        print(f"{'':>6} {depth:>5} {'':>9}  does not fit ({exc.tier} short)")
        return None
    print(f"{'':>6} {depth:>5} {numel / 1e9:>8.2f}B  fits")
    return depth, numel, plan


def _max_depth(plan_at, fits, fails_at: int | None):
    """The deepest model ``plan_at`` fits (see :func:`_try_depth`), knowing ``fits``
    (``(depth, numel, plan)``, or None: none known) fits and ``fails_at`` does not (None:
    none known; the depth doubles from ``fits`` until one fails). Returns ``(depth,
    numel, plan)`` or None. Model size grows with depth, so fitting is monotone in it:
    a bisection."""
    best = fits
    lo, hi = (fits[0] if fits else 0), fails_at
    while hi is None or hi - lo > 1:
        depth = max(1, 2 * lo) if hi is None else (lo + hi) // 2
        found = _try_depth(plan_at, depth)
        if found is None:
            hi = depth
        else:
            best, lo = found, depth
    return best


def _hf_model(path: str, depth: int | None = None):
    """A causal LM from a Hugging Face config.json, on the meta device (no weights);
    ``depth`` replaces its number of layers (``--max-model`` scales it)."""
    import torch
    import transformers

    from hetstore.errors import ConfigError

    location = _config_path(path)
    try:
        values = json.loads(location.read_text())
        if depth is not None:
            values["num_hidden_layers"] = depth
        hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--hf-config {path!r}: not a config.json of a causal LM transformers knows ({exc})"
        ) from None


def _hf_max_model(args, tokens, config, machine) -> int:
    """``--max-model --hf-config``: the deepest model of that architecture and width
    (``num_hidden_layers`` scaled) that fits."""
    import hetstore

    def plan_at(depth: int, probe: bool = False):  # the search compares fits: no timing
        model = _hf_model(args.hf_config, depth)
        numel = sum(p.numel() for p in model.parameters())
        return numel, hetstore.plan(model, (tokens,), config, machine=machine, probe=probe)

    start = json.loads(_config_path(args.hf_config).read_text()).get("num_hidden_layers", 1)
    print(f"{'':>6} {'depth':>5} {'params':>9}  result")
    first = _try_depth(plan_at, start)
    found = _max_depth(plan_at, first, None) if first else _max_depth(plan_at, None, start)
    if found is None:
        print("not even one layer of this architecture fits these capacities")
        return 1
    depth, numel, plan = found
    if not args.no_probe:  # the answer's step time: one block timed, not FLOPs
        numel, plan = plan_at(depth, probe=True)
    print(f"\nlargest: {args.hf_config} with {depth} layers, {numel / 1e9:.2f}B parameters\n")
    print(plan)
    if args.json:
        plan.save(args.json)
        print(f"\nplan saved to {args.json}")
    return 0


def _config_path(path: str) -> Path:
    location = Path(path)
    return location / "config.json" if location.is_dir() else location


def accelerate_side_by_side(model, plan) -> str:
    """accelerate's ``estimate-memory`` figures for ``model`` beside the plan's, and why
    they differ."""
    from accelerate.utils import calculate_maximum_sizes

    from hetstore._sizes import format_size
    from hetstore.tier import TIER_LABELS, Tier

    weights, (largest, _) = calculate_maximum_sizes(model)
    params = sum(u.param_bytes for u in plan.units)
    states = params + sum(u.optimizer_bytes for u in plan.units)
    saved = sum(u.saved_bytes for u in plan.units)
    e = plan.estimate
    rows = [
        ("", "accelerate estimate-memory", "hetstore plan"),
        ("weights", format_size(weights), format_size(params)),
        ("largest layer", format_size(largest), "-"),
        ("training with Adam", f"{format_size(4 * weights)} (4 x weights)", format_size(states)),
        ("saved for backward", "not counted", format_size(saved)),
        (
            "peaks " + "/".join(TIER_LABELS),
            "-",
            " / ".join(format_size(e.peak(tier)) for tier in Tier),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        "accelerate counts the weights in their dtype and takes Adam training as four times",
        "that (weights, gradients and two moments, all in that dtype). hetstore's model",
        "states are 16 bytes per trainable element (fp32 master, fp32 gradient, two fp32",
        "moments) plus the parameters in the compute dtype (no second copy where those are",
        "the fp32 master on its tier); it adds the tensors saved for backward at this",
        "batch, and gives each tier's peak after placement, staging buffers included.",
    ]
    return "\n".join(lines)


def _refused(exc, args) -> str:
    """The planner's refusal in the CLI's terms: flags for keys, and for a disk short
    of free space the flag that plans for another disk."""
    from hetstore._cli import PLAN_FLAGS, in_flags

    text = in_flags(str(exc), PLAN_FLAGS)
    if "  disk: needs at least" in text and args.disk is None:
        text += (
            "\n  planning writes nothing to disk: to plan for the disk you will train on, "
            "pass --disk SIZE (e.g. --disk 2TB)"
        )
    return text


def run_plan(args) -> int:
    import torch

    import hetstore
    from hetstore._cli import PLAN_FLAGS, in_flags, progress
    from hetstore._sizes import format_duration, format_size
    from hetstore.errors import ConfigError, OutOfTierMemory
    from hetstore.planner.machine import measure_machine

    if args.measure is not None and (args.measure < 1 or args.max_model or args.hf_config):
        print(
            "hetstore plan: --measure takes a number of steps (at least 1) and plans the "
            "GPT of --width/--depth: not with --max-model or --hf-config",
            file=sys.stderr,
        )
        return 2
    try:
        config = hetstore.OffloadConfig(
            auto_offload=True,
            device=args.device,
            max_device_memory=args.device_memory,
            offload_cpu_size=args.host_memory,
            offload_disk_size=args.disk,
            offload_path=args.path,
            compute_dtype=args.dtype,
            optimizer_state_format=args.state_format,
            step_in_backward=args.step_in_backward,
        )
        device = config.resolved_device()
        progress(
            "plan", f"probing the machine (memory copy, disk, optimizer step, matmul on {device})"
        )
        machine = measure_machine(device, config.offload_path, config.optimizer_state_format)
    except (ConfigError, OSError) as exc:
        print(f"hetstore plan: {in_flags(str(exc), PLAN_FLAGS)}", file=sys.stderr)
        return 2
    tokens = torch.empty(args.batch, args.ctx, dtype=torch.long, device="meta")
    searching = "tracing the model" + (
        "" if args.no_probe else " (one block timed for real where that takes under 2 s)"
    )
    if args.hf_config:
        try:
            model = _hf_model(args.hf_config)
        except ConfigError as exc:
            print(f"hetstore plan: {exc}", file=sys.stderr)
            return 2
        if args.max_model:
            progress("plan", "searching the deepest model that fits")
            return _hf_max_model(args, tokens, config, machine)
        numel = sum(p.numel() for p in model.parameters())
        progress("plan", f"{searching} and searching placements")
        try:
            plan = hetstore.plan(model, (tokens,), config, machine=machine, probe=not args.no_probe)
        except OutOfTierMemory as exc:
            print(f"hetstore plan: {_refused(exc, args)}", file=sys.stderr)
            return 1
        name = type(model).__name__
        print(
            f"{name} from {args.hf_config}: {numel / 1e9:.2f}B parameters, batch "
            f"{args.batch} x {args.ctx} tokens\n"
        )
        print(plan)
        print()
        print(accelerate_side_by_side(model, plan))
        if args.json:
            plan.save(args.json)
            print(f"\nplan saved to {args.json}")
        return 0

    def plan_for(width, depth, probe):
        model = _gpt(width, depth, args.vocab, args.ctx)
        numel = sum(p.numel() for p in model.parameters())
        return numel, hetstore.plan(model, (tokens, tokens), config, machine=machine, probe=probe)

    if args.max_model:
        progress("plan", "searching the largest GPT that fits")
        print(f"{'width':>6} {'depth':>5} {'params':>9}  result")
        largest = None
        for width, depth in LADDER:
            try:
                numel, plan = plan_for(width, depth, probe=False)  # what fits: no timing
            except OutOfTierMemory as exc:
                print(f"{width:>6} {depth:>5} {'':>9}  does not fit ({exc.tier} short)")
                break
            largest = (width, depth, numel, plan)
            print(
                f"{width:>6} {depth:>5} {numel / 1e9:>8.2f}B  fits, predicted step "
                f"{format_duration(plan.estimate.step_s)}"
            )
        if largest is None:
            print("not even the smallest GPT of the ladder fits these capacities")
            return 1
        # between the largest rung that fits and the next: the deepest model of each
        # of the two widths that fits (the next width's shallower ones may be larger)
        rung = LADDER.index(largest[:2])
        searches = [(largest[0], largest[1:], None)]
        if rung + 1 < len(LADDER):
            searches.append((LADDER[rung + 1][0], None, LADDER[rung + 1][1]))
        for width, fits, fails_at in searches:
            print(f"width {width}: the deepest that fits")
            found = _max_depth(lambda d, w=width: plan_for(w, d, probe=False), fits, fails_at)
            if found is not None and found[1] > largest[2]:
                largest = (width, *found)
        width, depth, numel, plan = largest
        if not args.no_probe:  # the answer's step time: one block timed, not FLOPs
            numel, plan = plan_for(width, depth, probe=True)
        print(f"\nlargest: width {width}, depth {depth}, {numel / 1e9:.2f}B parameters\n")
        print(plan)
    else:
        progress("plan", f"{searching} and searching placements")
        try:
            numel, plan = plan_for(args.width, args.depth, probe=not args.no_probe)
        except OutOfTierMemory as exc:
            print(f"hetstore plan: {_refused(exc, args)}", file=sys.stderr)
            return 1
        print(
            f"GPT width {args.width}, depth {args.depth}: {numel / 1e9:.2f}B parameters, "
            f"batch {args.batch} x {args.ctx} tokens, model states "
            f"{format_size(sum(u.param_bytes + u.optimizer_bytes for u in plan.units))}\n"
        )
        print(plan)
    if args.json:
        plan.save(args.json)
        print(f"\nplan saved to {args.json}")
    if args.measure is not None:
        return _measure(args, config, plan)
    return 0


def _measure(args, config, plan) -> int:
    """``--measure``: train the planned GPT for real, built on the meta device and
    materialized by ``offload()`` into its tiers, on random tokens: the profiled steps,
    then ``args.measure`` steps timed; prints their median beside the predictions."""
    import statistics
    import time

    import torch

    import hetstore
    from hetstore._cli import PLAN_FLAGS, in_flags, progress
    from hetstore._sizes import format_duration
    from hetstore.api import PROFILED_STEPS
    from hetstore.errors import ConfigError, OutOfTierMemory

    device = config.resolved_device()
    g = torch.Generator().manual_seed(0)
    steps = PROFILED_STEPS + args.measure
    data = [
        torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g) for _ in range(steps)
    ]
    batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
    model = _gpt(args.width, args.depth, args.vocab, args.ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    progress(
        "plan",
        f"--measure: building the model in its tiers and training {PROFILED_STEPS} profiled "
        f"+ {args.measure} timed steps",
    )
    times = []
    try:
        with hetstore.offloaded(
            model, optimizer, config, example_inputs=batches[0], init_fn=type(model).init_weights
        ) as (model, optimizer):
            runtime = hetstore.state_of(model).runtime
            own = runtime.plan
            for step, (x, y) in enumerate(batches):
                start = time.perf_counter()
                model(x, y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step >= PROFILED_STEPS:
                    times.append(time.perf_counter() - start)
            calibrated = runtime.calibrated_plan
    except (OutOfTierMemory, ConfigError, OSError) as exc:
        print(f"hetstore plan: --measure: {in_flags(str(exc), PLAN_FLAGS)}", file=sys.stderr)
        return 1 if isinstance(exc, OutOfTierMemory) else 2
    measured = statistics.median(times)
    predicted = plan.estimate.step_s
    same = [u.choice for u in own.units] == [u.choice for u in plan.units]
    lines = [
        "",
        f"measured over {len(times)} steps after {PROFILED_STEPS} profiled ones: median "
        f"{format_duration(measured)} (fastest {format_duration(min(times))}, slowest "
        f"{format_duration(max(times))})",
        f"predicted {format_duration(predicted)} (the plan above); measured / predicted "
        f"{measured / predicted:.2f} (the fastest step: {min(times) / predicted:.2f})",
    ]
    if not same:
        lines.append(
            f"offload() planned again on this machine and chose another placement: "
            f"predicted {format_duration(own.estimate.step_s)} for it (measured / predicted "
            f"{measured / own.estimate.step_s:.2f})"
        )
    if calibrated is not None and calibrated.estimate is not None:
        after = calibrated.estimate.step_s
        lines.append(
            f"after the profiled steps (each unit's compute measured): predicted "
            f"{format_duration(after)}; measured / predicted {measured / after:.2f}"
        )
    print("\n".join(lines))
    return 0
