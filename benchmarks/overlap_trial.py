"""overlap_step='auto' measures whether overlap pays (optim.policy's OverlapTrial): does it
keep the faster way, and what does the trial cost?

    .venv/bin/python benchmarks/overlap_trial.py            # ~77M GPT, about 10 minutes
    .venv/bin/python benchmarks/overlap_trial.py --tiny     # seconds: checks the harness

Cases, each trained ``--steps`` steps from the same seed on the same batches
(``hetstore.demo.gpt``, fused AdamW, fp32):

* ``disk (defaults)``: parameters, gradients and states on disk, every key at its
  default: the overlap (steps in backward, read ahead, steps in the next forward) hides
  disk traffic and should be kept. Clip 1.0 through the optimizer (it bites every step
  here: the steps run in the next forward), issue 47's case (the default ``--cases``);
* ``host (defaults)``: master and states in host memory, every key at its default: on a
  GPU (``--device cuda``: bf16 copies on the device, the forward under bf16 autocast,
  pinned host memory, each step synchronized) the host units' ordinary steps run in
  place beside the next forward; on a CPU device nothing overlaps (no trial).

Runners per case, each in its own process, one after the other in the order A B C C B A
(drift of the shared machine hits all alike):

* ``no overlap``: ``overlap_step=False, step_in_forward=False`` (the reference);
* ``overlap, no trial``: ``overlap_step='auto'`` with the trial taken out (always
  overlapping);
* ``auto``: ``overlap_step='auto'`` as shipped: after ``TRIAL_AFTER`` steps, one step not
  counted and ``TRIAL_STEPS`` counted without overlap, then the faster way.

Reported per runner: the median step time (forward, backward, clip and step, as the
trial measures it) of the steps before the trial, of the trial's steps, and of the steps
after it (from the second after the decision), each as a ratio to ``no overlap``'s same
steps; the way ``auto`` chose; the losses' largest difference from ``no overlap``'s
(every way is exact: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import hetstore
from _common import REPO, bench_command, format_table, machine_line, median
from hetstore.demo.gpt import GPT, batches
from hetstore.optim import policy

# case -> (offload_param, offload_optimizer, clip through the optimizer or None)
CASES = {
    "disk (defaults)": ("disk", "disk", 1.0),
    "host (defaults)": ("cpu", "cpu", None),
}
CPU_CASES = ("disk (defaults)",)
RUNNERS = ("no overlap", "overlap, no trial", "auto")


def run(case: str, runner: str, args: argparse.Namespace) -> dict:
    """One runner's training: each step's seconds and loss, and the ways it took."""
    param, opt, clip = CASES[case]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = GPT(
        vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads, ctx=args.ctx
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    off = runner == "no overlap"
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        config = hetstore.OffloadConfig(
            offload_param=param,
            offload_optimizer=opt,
            overlap_step=False if off else "auto",
            step_in_forward=False if off else "auto",
            offload_path=where,
            enable_pinned_mem=cuda,
            device=device.type,
            compute_dtype="bf16" if cuda else "fp32",
        )
        model, optimizer = hetstore.offload(model, optimizer, config)
        ahead = optimizer.step_ahead
        trial = optimizer.overlap_trial  # (None where nothing overlaps: host on a CPU)
        if runner == "overlap, no trial" and trial is not None:  # (its first: far away)
            trial.after = 10**9
        times, losses, ways = [], [], []
        for x, y in batches(args.steps, vocab=args.vocab, batch=args.batch, ctx=args.ctx):
            x, y = x.to(device), y.to(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x, y)
            loss.backward()
            if clip is not None:
                optimizer.clip_grad_norm_(clip)
            ways.append(ahead is not None and ahead.policy.overlapping)
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        stats = optimizer.speculation_stats
        hetstore.release(model)
    return {"times": times, "losses": losses, "ways": ways, "stats": stats}


def way_after(runs: list[list[bool]]) -> str:
    """The way each run took after the trial: 'overlap', 'none', or each run's mix."""
    says = ["overlap" if all(w) else "none" if not any(w) else "mixed" for w in runs]
    return says[0] if len(set(says)) == 1 else " / ".join(says)


def windows(steps: int, after: int, counted: int) -> dict[str, slice]:
    """Step indices: before the trial, the trial's (the step not counted too), after it
    (from the second step after the decision: the first still lands the other way's)."""
    end = after + 1 + counted
    return {"before": slice(2, after), "trial": slice(after, end), "after": slice(end + 1, steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--cases", default=None, help=f"default: {', '.join(CPU_CASES)}")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast and copies)")
    p.add_argument("--dir", default=str(REPO / "offload"), help="offload directory's parent")
    p.add_argument("--tiny", action="store_true", help="a tiny model and trial: the harness")
    p.add_argument("--json", help="write the rows and every run's figures here too")
    p.add_argument("--one", help=argparse.SUPPRESS)  # (worker: 'case|runner')
    args = p.parse_args()
    if args.tiny:
        args.width, args.depth, args.heads, args.vocab, args.ctx, args.steps = 32, 2, 2, 64, 16, 12
        policy.TRIAL_AFTER, policy.TRIAL_STEPS = 4, 2
    os.makedirs(args.dir, exist_ok=True)
    if args.one:
        case, runner = args.one.split("|")
        print(json.dumps(run(case, runner, args)))
        return
    cases = [c.strip() for c in (args.cases or ",".join(CPU_CASES)).split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; allowed: {list(CASES)}")
    span = windows(args.steps, policy.TRIAL_AFTER, policy.TRIAL_STEPS)
    print(machine_line())
    print(
        f"GPT width {args.width} depth {args.depth}, batch {args.batch}x{args.ctx}, "
        f"{args.steps} steps; trial after {policy.TRIAL_AFTER} steps, "
        f"1 + {policy.TRIAL_STEPS} without overlap"
    )
    rows, figures = [], {}
    for case in cases:
        got: dict[str, list[dict]] = {r: [] for r in RUNNERS}
        for runner in [*RUNNERS, *reversed(RUNNERS)]:
            argv = [sys.argv[0], *sys.argv[1:], "--one", f"{case}|{runner}"]
            out = subprocess.run(
                [sys.executable, *argv], capture_output=True, text=True, check=True
            ).stdout
            got[runner].append(json.loads(out.strip().splitlines()[-1]))
        figures[case] = got
        reference = got["no overlap"]
        for runner in RUNNERS:
            cells = [case, runner]
            for window in span.values():
                # each run's median over the window, then the median of the two runs
                mine = median([median(r["times"][window]) for r in got[runner]])
                base = median([median(r["times"][window]) for r in reference])
                cells.append(f"{mine:.3f} s ({mine / base:.2f}x)")
            ways = [r["ways"][span["after"]] for r in got[runner]]
            cells.append("-" if runner == "no overlap" else way_after(ways))
            diff = max(
                abs(a - b)
                for r, ref in zip(got[runner], reference, strict=True)
                for a, b in zip(r["losses"], ref["losses"], strict=True)
            )
            cells.append(f"{diff:.1e}")
            rows.append(cells)
        print(f"{case}: auto's stats {got['auto'][0]['stats']}")
    header = ["case", "runner", "before the trial", "the trial", "after it", "way after"]
    header.append("max |loss - no overlap|")
    print(format_table(header, rows))
    print(f"command: {bench_command('benchmarks/overlap_trial.py', sys.argv[1:])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "figures": figures}, f)


if __name__ == "__main__":
    main()
