"""The largest model this machine trains: a >= 6.5B-parameter GPT, fp32 master weights.

    .venv/bin/python benchmarks/largest_model.py            # 6.57B, 3 steps: ~15 min, ~45 GB disk
    .venv/bin/python benchmarks/largest_model.py --tiny     # seconds: checks the harness
    .venv/bin/python benchmarks/largest_model.py --hf-config benchmarks/configs/llama7b.json \
        --layers 59 --auto                                   # a Llama, its layers scaled

The model is ``hetstore.demo.gpt.GPT`` (tied embeddings, LayerNorm, GELU MLP) of width
4096 and depth 32 with a 32000-token vocabulary: 12 * 4096^2 * 32 + 32000 * 4096 +
biases = 6.57B parameters, 26.3 GB in fp32, more than this machine's RAM. It is built on
the meta device and materialized one block at a time by ``hetstore.offload`` (GPT-2's
init), so host memory never holds more than a few blocks.

Placement: parameters, fp32 master weights and optimizer states all on disk
(``offload_param="disk", offload_optimizer="disk"``), AdamW (torch's fused kernel),
``optimizer_state_format="8bit"`` (2.03 bytes per parameter for the two moments) and
``step_in_backward=True``: each block is stepped inside backward from its gradients in
memory, so gradients never reach the disk. Bytes on disk per parameter: 4 (master) +
2.03 (moments) = 6.03, against 16 for fp32 states with gradients on disk.

Data: the demo corpus as byte ids; the same batch every step (``--batch`` sequences of
``--ctx`` tokens), so a falling loss shows that the steps train the model.

Reported per step: forward, backward (which includes the optimizer work of
``step_in_backward``) and ``optimizer.step()`` times; the disk bytes read and written
in each phase (``hetstore.state_of(model).tiers.disk.stats()``); the disk-bound time of
the step, ``read / read_bw + written / write_bw``, with the bandwidths of hetstore's own
AIO engine measured in the same run after the steps; peak RSS; the disk tier's peak
(regions in use) and the bytes the offload directory holds on the file system.

There is no plain-PyTorch reference: its fp32 weights alone do not fit in RAM here. The
reference is the disk: the fraction ``disk-bound / step`` says how close to the disk's
limit the step runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import hetstore
from _common import format_table, machine_line, size
from disk_io import layout
from disk_offload import DiskBandwidth
from hetstore.demo import load_corpus
from hetstore.demo.gpt import GPT
from hetstore.tiers.disk import _du  # bytes the offload directory takes on the file system

REPO = Path(__file__).resolve().parent.parent
# Adam's first steps move every weight by about lr (m / sqrt(v) is +-1): at width 4096
# coherent moves of 1e-4 over 16384 inputs swamp the outputs. Measured with plain
# PyTorch on width 4096, depth 4, this batch: lr 1e-4 took the loss from 10.90 to 15.71
# after one step, 1e-5 to 5.80, 3e-6 to 8.96. Depth 32 amplifies it (lr 1e-4 took this
# model from 11.29 to 19.33): 3e-6, as a warm-up's first steps would be.
LR = 3e-6


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--state-format", default="8bit", choices=["fp32", "bf16", "8bit"])
    parser.add_argument(
        "--no-step-in-backward",
        action="store_true",
        help="gradients to disk and the step after backward (overlap_step)",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="auto_offload: the planner places each unit (what `hetstore plan --max-model` "
        "assumes) instead of everything on disk; its predicted peaks are printed beside "
        "the measured ones",
    )
    parser.add_argument("--max-device-memory", default="5GB")
    parser.add_argument("--offload-cpu-size", default="12GB")
    parser.add_argument("--offload-disk-size", default=None, help="default: the free space")
    parser.add_argument("--bandwidth-bytes", type=int, default=2 << 30)
    parser.add_argument("--dir", default=str(REPO / "offload"), help="offload_path's parent")
    parser.add_argument(
        "--hf-config",
        help="train a Hugging Face causal LM from this config.json instead of the GPT "
        "(built on the meta device, initialized by its own _init_weights)",
    )
    parser.add_argument("--layers", type=int, help="with --hf-config: num_hidden_layers")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other OffloadConfig key (repeatable), e.g. optimizer_chunk_size=512KB to "
        "scale a reproduction down with the model",
    )
    parser.add_argument("--tiny", action="store_true", help="a few-MB model: checks the harness")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.heads, args.vocab = 64, 2, 4, 256
        args.ctx, args.steps, args.bandwidth_bytes = 16, 2, 64 << 20
        args.max_device_memory, args.offload_cpu_size = "64MB", "256MB"
    return args


def peak_rss() -> int:
    return hetstore.peak_rss()


def _setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` from --set: VALUE as JSON where it is JSON (``false``, ``3``), else
    the string (``512KB``)."""
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    args = parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    where = tempfile.mkdtemp(prefix="largest-", dir=args.dir)
    free_before = shutil.disk_usage(where).free
    torch.manual_seed(0)
    if args.hf_config:
        from hetstore.cli_plan import _hf_model  # (built on the meta device)

        model = _hf_model(args.hf_config, args.layers)
        init_fn = model._init_weights
        described = (
            f"{type(model).__name__} from {args.hf_config}, {model.config.num_hidden_layers} layers"
        )

        def loss_of(x, y):  # Hugging Face shifts the labels itself
            return model(input_ids=x, labels=x).loss
    else:
        with torch.device("meta"):
            model = GPT(
                vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads, ctx=args.ctx
            )
        init_fn = GPT.init_weights
        described = f"GPT width {args.width}, depth {args.depth}, vocab {args.vocab}"

        def loss_of(x, y):
            return model(x, y)

    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
    placement = (
        {"auto_offload": True}
        if args.auto
        else {"offload_param": "disk", "offload_optimizer": "disk"}
    )
    config = hetstore.OffloadConfig(
        **placement,
        optimizer_state_format=args.state_format,
        step_in_backward=not args.no_step_in_backward,
        max_device_memory=args.max_device_memory,
        offload_cpu_size=args.offload_cpu_size,
        **({"offload_disk_size": args.offload_disk_size} if args.offload_disk_size else {}),
        offload_path=where,
        enable_pinned_mem=False,
        device="cpu",
        compute_dtype="fp32",
        **dict(_setting(kv) for kv in args.set),
    )
    print(machine_line())
    print(f"model: {described}: {params:,} params")
    t0 = time.perf_counter()
    model, optimizer = hetstore.offload(model, optimizer, config, init_fn=init_fn)
    init_s = time.perf_counter() - t0
    disk = hetstore.state_of(model).tiers.disk
    print(
        f"offloaded (materialized on disk) in {init_s:.0f} s; disk tier {size(disk.stats()['current'])}"
    )

    data = load_corpus()
    starts = torch.randint(0, data.numel() - args.ctx - 1, (args.batch,))
    chunk = torch.stack([data[s : s + args.ctx + 1] for s in starts.tolist()])
    x, y = chunk[:, :-1], chunk[:, 1:]

    rows, steps = [], []
    for step in range(args.steps):
        marks = [(time.perf_counter(), disk.stats())]
        loss = loss_of(x, y)
        marks.append((time.perf_counter(), disk.stats()))
        loss.backward()
        marks.append((time.perf_counter(), disk.stats()))
        optimizer.step()
        optimizer.zero_grad()
        marks.append((time.perf_counter(), disk.stats()))
        phases = {}
        for name, (t_a, s_a), (t_b, s_b) in zip(
            ("forward", "backward", "step"), marks[:-1], marks[1:], strict=True
        ):
            phases[name] = {
                "s": t_b - t_a,
                "read": s_b["bytes_read"] - s_a["bytes_read"],
                "written": s_b["bytes_written"] - s_a["bytes_written"],
            }
        record = {
            "step": step + 1,
            "loss": loss.item(),
            "phases": phases,
            "seconds": marks[-1][0] - marks[0][0],
            "peak_rss": peak_rss(),
            "disk_peak": disk.stats()["peak"],
            "on_file_system": _du(where),
        }
        steps.append(record)
        print(
            f"step {step + 1}: loss {record['loss']:.4f}, {record['seconds']:.0f} s "
            f"(fwd {phases['forward']['s']:.0f}, bwd {phases['backward']['s']:.0f}, "
            f"step {phases['step']['s']:.0f}), peak RSS {size(record['peak_rss'])}",
            flush=True,
        )
    speculation = optimizer.speculation_stats
    state_bytes = disk.stats()["current"]
    predicted = None
    runtime = hetstore.state_of(model).runtime
    if runtime.plan is not None and runtime.plan.estimate is not None:
        e = runtime.plan.estimate
        predicted = {"device": e.device, "host": e.host, "disk": e.disk, "step_s": e.step_s}
        tiers = hetstore.state_of(model).tiers
        measured = {
            "device": tiers.device_tier.usage().peak,
            "host": tiers.host.usage().peak,
            "disk": disk.stats()["peak"],
        }
        print(
            "planner predicted peaks device/host/disk "
            + " / ".join(size(predicted[k]) for k in ("device", "host", "disk"))
            + f", step {predicted['step_s']:.0f} s; measured "
            + " / ".join(size(measured[k]) for k in ("device", "host", "disk"))
        )
        predicted["measured"] = measured
    hetstore.release(model)

    # overwrites of a laid-out file, as the tier's recycled region files are
    layout(os.path.join(where, "bandwidth.bin"), args.bandwidth_bytes)
    bandwidth = DiskBandwidth(os.path.join(where, "bandwidth.bin"), args.bandwidth_bytes, fio=False)
    bandwidth.round()
    read_bw, write_bw = bandwidth.engine("read"), bandwidth.engine("write")
    os.remove(os.path.join(where, "bandwidth.bin"))
    shutil.rmtree(where, ignore_errors=True)

    for r in steps:
        read = sum(p["read"] for p in r["phases"].values())
        written = sum(p["written"] for p in r["phases"].values())
        r["disk_bound_s"] = read / read_bw + written / write_bw
        cells = [
            str(r["step"]),
            f"{r['loss']:.4f}",
            f"{r['seconds']:.0f}",
            *(f"{r['phases'][p]['s']:.0f}" for p in ("forward", "backward", "step")),
            f"{size(read)} / {size(written)}",
            f"{r['disk_bound_s']:.0f} ({r['disk_bound_s'] / r['seconds']:.2f})",
            size(r["peak_rss"]),
        ]
        rows.append(cells)
    header = [
        "step",
        "loss",
        "step s",
        "fwd s",
        "bwd s (+ steps in it)",
        "optimizer.step() s",
        "disk read / written",
        "disk-bound s (fraction)",
        "peak RSS",
    ]
    print()
    print(format_table(header, rows))
    print()
    print(
        f"params {params:,} ({params / 1e9:.2f}B); states on disk (tier, in use) "
        f"{size(state_bytes)} = {state_bytes / params:.2f} B/param; disk tier peak "
        f"{size(steps[-1]['disk_peak'])}; offload directory on the file system at most "
        f"{size(max(r['on_file_system'] for r in steps))} (free before: {size(free_before)}); "
        f"AIO engine read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s; "
        f"offload (materialize) {init_s:.0f} s; steps in backward {speculation}"
    )
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    shape = (
        f"{Path(args.hf_config).stem}_l{model.config.num_hidden_layers}"
        if args.hf_config
        else f"w{args.width}_d{args.depth}"
    )
    name = f"largest_model_{shape}_{args.state_format}"
    name += "_step_after_backward" if args.no_step_in_backward else ""
    name += "_auto.json" if args.auto else ".json"
    if not args.tiny:
        (out / name).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "params": params,
                    "state_bytes": state_bytes,
                    "init_s": init_s,
                    "read_bw": read_bw,
                    "write_bw": write_bw,
                    "free_before": free_before,
                    "steps": steps,
                    "speculation": speculation,
                    "predicted": predicted,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
