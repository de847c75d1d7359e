"""The planner's predictions against measurement: auto_offload at 100%, 50% and 20% of
the model states (and 20% with the host short too), on two model shapes, each step time
and tier peak predicted before step 1, then measured.

    .venv/bin/python benchmarks/planner.py            # a few minutes on 2 vCPUs
    .venv/bin/python benchmarks/planner.py --tiny     # seconds: checks the harness
    .venv/bin/python benchmarks/planner.py --models gpt
    .venv/bin/python benchmarks/planner.py --device cuda

Per model shape, one process trains it five times from the same seed on the same
batches (fp32, ``torch.optim.AdamW``): plain PyTorch (the step-time reference) and
``hetstore.offload(auto_offload=True, max_device_memory=f x states)`` per budget. The
variants step interleaved, one step each per round in a random order (see
``_common.interleaved``), so the shared machine's drift hits all alike.

The shapes:
- ``gpt``: ``hetstore.demo.gpt.GPT``, planned at ``offload()`` from ``example_inputs``
  (the tokens only: the first training forward, which also passes the targets, is
  traced again and planned for, since the loss's saved tensors were not in the trace);
- ``llama``: a transformers ``LlamaForCausalLM`` built from a config, with
  ``example_inputs=(input_ids,)`` and called as the Trainer calls it
  (``model(input_ids=..., labels=...)``): the keyword call is traced again at the first
  training forward, as for the GPT.

The last budget runs twice: with ``example_inputs``, and with budgets only (``budgets
only``), as the seed's config is written: the optimizer states are placed at
``offload()`` before any activation is known, filling the host, and the first training
batch is traced and planned for, moving some units' states to disk before step 1.

Reported per budget: the plan (what it offloads); the step time it predicted before
step 1 (``runtime.plan``: one block's forward and backward timed for real at the
batch's shapes by ``planner.probe``, copies, disk and optimizer from the machine probes,
the root from FLOPs at the rate the block achieved); the prediction re-made after the
profiled steps (``runtime.calibrated_plan``: measured per-unit compute and loop
overhead, transfers and optimizer still modelled); the measured median step; and each
tier's predicted (pre-run) and measured peak (from the second step: the first step's
re-plan runs the compute probe, which counts in a budget while it runs). The issue's bar: 0.8-1.2 for the pre-run
step time, +-10% for the peaks.

Process memory (``--rss``, on by default on a CPU device): the tiers' figures are
hetstore's own accounting, so each budget also trains alone in a subprocess that
measures its peak resident set (``hetstore.peak_rss``) and its size before ``offload()``
(interpreter, torch, hetstore); the table sets the predicted device and host peaks plus
that start-up size against the measured peak RSS (tests/api/test_rss_budgets.py states the
bound: within 192 MiB above it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hetstore
from _common import REPO, format_table, interleaved, machine_line, median, size
from hetstore import OffloadConfig
from hetstore.api import PROFILED_STEPS
from hetstore.demo.gpt import GPT, batches
from hetstore.planner import UnitChoice
from hetstore.planner.tracer import model_data_trace

# (device budget, host budget, example_inputs given) as shares of the model states;
# None: the machine's RAM. The last two make the host short too, so the plan spills to
# disk: once planned at offload() from example_inputs, once from budgets only (the first
# training batch is traced and planned for, moving optimizer states to disk).
BUDGETS = (
    (1.0, None, True),
    (0.5, None, True),
    (0.2, None, True),
    (0.2, 1.0, True),
    (0.2, 1.0, False),
)

TINY_RSS_BUDGET = BUDGETS[3]


def label(budget) -> str:
    device, host, given = budget
    return (
        f"{device:.0%}"
        + ("" if host is None else f", host {host:.0%}")
        + ("" if given else ", budgets only")
    )


class GptShape:
    name = "gpt"

    def __init__(self, args):
        self.shape = dict(width=args.width, depth=args.depth, vocab=args.vocab, ctx=args.ctx)
        self.title = (
            f"GPT width {args.width} depth {args.depth} vocab {args.vocab}, "
            f"batch {args.batch} x {args.ctx} tokens"
        )

    def build(self):
        return GPT(**self.shape)

    def example_inputs(self, x):
        return x  # the tokens only, as a user would pass them

    def loss(self, model, x, y):
        return model(x, y)


class LlamaShape:
    name = "llama"

    def __init__(self, args):
        from transformers import LlamaConfig

        self.config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.width,
            intermediate_size=int(args.width * 8 / 3) // 64 * 64 or 64,
            num_hidden_layers=args.depth,
            num_attention_heads=max(1, args.width // 64),
            num_key_value_heads=max(1, args.width // 64),
            max_position_embeddings=args.ctx,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        self.title = (
            f"transformers LlamaForCausalLM from config (hidden {args.width}, "
            f"{args.depth} layers, vocab {args.vocab}), batch {args.batch} x {args.ctx} tokens"
        )

    def build(self):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(self.config)

    def example_inputs(self, x):
        return (x,)  # input_ids, as a Trainer user would have them (no labels)

    def loss(self, model, x, y):
        return model(input_ids=x, labels=x).loss


SHAPES = {"gpt": GptShape, "llama": LlamaShape}


def build_variant(shape, args, device, folder, budget, data):
    """The model and optimizer offloaded for one budget (or plain, ``budget=None``)."""
    torch.manual_seed(0)
    model = shape.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if budget is None:
        return model.to(device), opt
    fraction, host_fraction, given = budget
    if args.tiny and host_fraction is not None:
        # the host pool rounds every buffer up to a 4 KiB page, several percent of a
        # model this small, which the cost model (bytes) does not count
        host_fraction *= 1.25
    states_bytes = states_of(shape, args)
    config = OffloadConfig(
        auto_offload=True,
        device=args.device,
        offload_path=folder,
        max_device_memory=int(states_bytes * fraction),
        offload_cpu_size=None if host_fraction is None else int(states_bytes * host_fraction),
        enable_pinned_mem=device.type == "cuda",
        # the tiny model's saved tensors are all small: let every one move
        activation_min_bytes=0 if args.tiny else OffloadConfig().activation_min_bytes,
    )
    example = shape.example_inputs(data[0][0]) if given else None
    return hetstore.offload(model, opt, config, example_inputs=example)


def states_of(shape, args) -> int:
    """The model states alone: no trace of the forward, no machine probe."""
    return model_data_trace(shape.build(), OffloadConfig(device=args.device), None).state_bytes


def rss_child(shape, args, device, folder, index: int) -> None:
    """``--rss-child``: one budget's variant trained alone; its memory as JSON."""
    data = batches(PROFILED_STEPS + 2, vocab=args.vocab, batch=args.batch, ctx=args.ctx)
    with open("/proc/self/status") as f:
        baseline = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    model, opt = build_variant(shape, args, device, folder, BUDGETS[index], data)
    for x, y in data:
        shape.loss(model, x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    planned = hetstore.state_of(model).runtime.plan.estimate
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak_rss": hetstore.peak_rss(),
                "predicted_device": planned.device,
                "predicted_host": planned.host,
            }
        )
    )


def rss_rows(shape, args) -> list:
    """Per budget, the predicted device + host peaks and start-up size against the
    measured peak RSS of a process that trains that variant alone. ``--tiny``: the
    budget with a host cap only (each is a process that starts torch: a harness check
    needs one)."""
    rows = []
    for index, budget in enumerate(BUDGETS):
        if args.tiny and budget != TINY_RSS_BUDGET:
            continue
        command = [sys.executable, __file__, "--rss-child", f"{shape.name}:{index}"]
        command += [f"--{k}={getattr(args, k)}" for k in ("width", "depth", "vocab", "batch")]
        command += [f"--ctx={args.ctx}", f"--device={args.device}", f"--dir={args.dir}"]
        command += ["--tiny"] if args.tiny else []
        out = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            rows.append([shape.name, label(budget), "-", "-", "-", out.stderr.strip()[-80:]])
            continue
        got = json.loads(out.stdout.strip().splitlines()[-1])
        predicted = got["predicted_device"] + got["predicted_host"] + got["baseline"]
        rows.append(
            [
                shape.name,
                label(budget),
                size(got["baseline"]),
                size(predicted),
                size(got["peak_rss"]),
                f"{got['peak_rss'] / predicted:.2f}",
            ]
        )
    return rows


def run_shape(shape, args, device, folder) -> tuple[str, list, list]:
    warm = PROFILED_STEPS  # profiled steps, then the measured ones
    data = batches(warm + args.steps, vocab=args.vocab, batch=args.batch, ctx=args.ctx)
    states_bytes = states_of(shape, args)
    variants = {"plain": build_variant(shape, args, device, folder, None, data)}
    for budget in BUDGETS:
        variants[budget] = build_variant(shape, args, device, folder, budget, data)
    cursor = dict.fromkeys(variants, 0)

    def one_step(name):
        model, opt = variants[name]
        x, y = data[cursor[name]]
        cursor[name] += 1
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        loss = shape.loss(model, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        return time.perf_counter() - start

    for round_ in range(warm):  # the profiled steps
        for name in variants:
            one_step(name)
            if round_ == 0 and name != "plain":
                # the first step's re-plan ran the compute probe, counted in a budget
                # while it ran: the peaks compared with the plan are training's
                hetstore.state_of(variants[name][0]).tiers.reset_peaks()
    samples = interleaved({n: (lambda n=n: one_step(n)) for n in variants}, args.steps)
    plain_s = median(samples["plain"])
    title = f"{shape.title}; model states {size(states_bytes)}; plain PyTorch step {plain_s * 1e3:.0f} ms"
    rows, peaks = [], []
    for budget in BUDGETS:
        model, _ = variants[budget]
        runtime = hetstore.state_of(model).runtime
        planned, calibrated = runtime.plan.estimate, runtime.calibrated_plan.estimate
        measured = median(samples[budget])
        moved = sum(u.choice != UnitChoice() for u in runtime.plan.units)
        rows.append(
            [
                shape.name,
                label(budget),
                f"{moved}/{len(runtime.plan.units)} units",
                planned.basis,
                f"{planned.step_s * 1e3:.0f} ms",
                f"{calibrated.step_s * 1e3:.0f} ms",
                f"{measured * 1e3:.0f} ms",
                f"**{planned.step_s / measured:.2f}**",
                f"{calibrated.step_s / measured:.2f}",
                f"{measured / plain_s:.2f}",
            ]
        )
        stats = hetstore.memory_stats(model)
        for tier in ("device", "host", "disk"):
            predicted, got = planned.peak(tier), stats[tier]["peak"]
            if tier == "disk":  # speculations' shadows, where the disk has room
                room = stats[tier]["capacity"]
                predicted += planned.disk_shadows
                predicted = predicted if room is None else min(room, predicted)
            if not predicted and not got:
                continue
            ratio = f"{got / predicted:.2f}" if predicted else "-"
            peaks.append([shape.name, label(budget), tier, size(predicted), size(got), ratio])
        hetstore.release(model)
    return title, rows, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama", help="comma list of gpt, llama")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="measured rounds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=str(REPO / "offload"), help="offload_path parent")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long harness check")
    parser.add_argument(
        "--rss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure each budget's peak RSS in a process of its own (default: on a CPU)",
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)  # shape:budget index
    args = parser.parse_args()
    if args.tiny:
        args.width, args.depth, args.batch, args.ctx, args.steps, args.vocab = 64, 4, 2, 16, 2, 64
    device = torch.device(args.device)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-planner-", dir=args.dir)
    if args.rss_child:
        name, index = args.rss_child.split(":")
        rss_child(SHAPES[name](args), args, device, folder, int(index))
        return
    measure_rss = device.type == "cpu" if args.rss is None else args.rss
    titles, rows, peaks, memory = [], [], [], []
    for name in args.models.split(","):
        title, shape_rows, shape_peaks = run_shape(SHAPES[name](args), args, device, folder)
        titles.append(f"- {name}: {title}")
        rows += shape_rows
        peaks += shape_peaks
        if measure_rss:
            memory += rss_rows(SHAPES[name](args), args)
    print(f"# planner predictions vs measurement ({machine_line()}, device {device})")
    print("\n".join(titles) + "\n")
    print(
        format_table(
            [
                "model",
                "budget / states",
                "offloaded",
                "compute basis",
                "predicted (pre-run)",
                "predicted (calibrated)",
                "measured (median)",
                "pre-run / measured",
                "calibrated / measured",
                "measured / plain",
            ],
            rows,
        )
    )
    print()
    print(
        format_table(
            [
                "model",
                "budget",
                "tier",
                "predicted peak (pre-run)",
                "measured peak",
                "measured / predicted",
            ],
            peaks,
        )
    )
    if memory:
        print()
        print(
            format_table(
                [
                    "model",
                    "budget",
                    "start-up RSS",
                    "predicted device + host + start-up",
                    "measured peak RSS",
                    "measured / predicted",
                ],
                memory,
            )
        )


if __name__ == "__main__":
    main()
