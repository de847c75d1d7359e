"""The ``hetstore`` command line (also ``python -m hetstore``).

    hetstore demo      train a GPT under a device budget its training states exceed
    hetstore plan      plan a GPT's placement on this machine without building it
    hetstore bench     this machine's tier rates: copies, disk, optimizer, FLOPs
    hetstore report    draw the per-tier memory timeline of a saved timeline.json

Errors are one line with what to change, and a non-zero exit code: 1 for out of memory,
2 for bad flags, files or directories.
"""

from __future__ import annotations

import argparse
import sys

from hetstore.cli_plan import add_plan_parser, run_plan

__all__ = ["main"]


def _demo_parser(sub) -> None:
    from hetstore.demo import SIZES, DemoSettings

    d = DemoSettings()
    p = sub.add_parser(
        "demo",
        help="train the demo GPT under a device budget its training states exceed",
        description=(
            "Train a small byte-level GPT on a text shipped with hetstore, with "
            "auto_offload under a device budget smaller than its training states. Shows "
            "progress, a summary, and writes memory_timeline.png, loss.png and "
            "timeline.json."
        ),
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps ({d.steps})")
    cpu, cuda = SIZES["cpu"], SIZES["cuda"]
    p.add_argument(
        "--width", type=int, help=f"model width ({cpu['width']} on CPU, {cuda['width']} on CUDA)"
    )
    p.add_argument(
        "--depth",
        type=int,
        help=f"number of blocks ({cpu['depth']} on CPU, {cuda['depth']} on CUDA)",
    )
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step ({d.batch})")
    p.add_argument(
        "--budget-fraction",
        type=float,
        help=f"device budget as a share of the training states ({cpu['budget_fraction']} "
        f"on CPU, {cuda['budget_fraction']} on CUDA)",
    )
    p.add_argument(
        "--device", default=d.device, help="cuda, cpu or auto (default: cuda if present)"
    )
    p.add_argument("--out", default=d.out, help="directory for the PNGs and timeline.json (.)")
    p.add_argument("--offload-path", help="directory for the disk tier (default ./offload)")
    p.add_argument("--config", help="an OffloadConfig file (.yaml/.json/.toml) to start from")
    p.add_argument(
        "--compare", action="store_true", help="also train plain PyTorch and compare losses"
    )
    p.add_argument(
        "--no-offload",
        action="store_true",
        help="keep everything on the device: shows the out-of-memory report, exits 1",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure this machine's tiers: copy and disk bandwidth, optimizer and FLOP rates",
        description="The probes the planner plans with (about a second), as a table.",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--path", default="./offload", help="directory probed for the disk tier")


def _report_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="draw the per-tier memory timeline of a saved timeline.json",
        description="Draw a memory timeline saved by `hetstore demo` (timeline.json) or "
        "by hetstore.timeline.TimelineRecorder as a PNG.",
    )
    p.add_argument("timeline", help="the timeline JSON file")
    p.add_argument("--out", help="the PNG to write (default: next to the JSON)")


def run_bench(args) -> int:
    import hetstore
    from hetstore._cli import BENCH_FLAGS, in_flags, progress
    from hetstore.errors import ConfigError
    from hetstore.planner.machine import measure_machine

    try:
        device = hetstore.OffloadConfig(
            device=args.device, offload_path=args.path
        ).resolved_device()
        progress(
            "bench", f"probing the machine (memory copy, disk, optimizer step, matmul on {device})"
        )
        rates = measure_machine(device, args.path)
    except ConfigError as exc:
        print(f"hetstore bench: {in_flags(str(exc), BENCH_FLAGS)}", file=sys.stderr)
        return 2
    except OSError as exc:
        reason = in_flags(exc.strerror or str(exc), BENCH_FLAGS)
        print(
            f"hetstore bench: cannot probe the disk under --path {args.path!r}: {reason}; "
            "pass --path DIR on a writable local disk",
            file=sys.stderr,
        )
        return 2
    link = "pinned host <-> CUDA" if device.type == "cuda" else "memcpy (CPU device)"
    rows = [
        ("host -> device copy", f"{rates.to_device / 1e9:.2f} GB/s", link),
        ("device -> host copy", f"{rates.from_device / 1e9:.2f} GB/s", link),
        ("disk read", f"{rates.disk_read / 1e9:.2f} GB/s", f"O_DIRECT under {args.path}"),
        ("disk write", f"{rates.disk_write / 1e9:.2f} GB/s", f"O_DIRECT under {args.path}"),
        ("host optimizer", f"{rates.host_step / 1e9:.2f} G elem/s", "fused AdamW, fp32"),
        ("device optimizer", f"{rates.device_step / 1e9:.2f} G elem/s", f"fused AdamW on {device}"),
        ("device FLOP rate", f"{rates.flops / 1e12:.3f} TFLOP/s", "one matmul"),
    ]
    spread = dict(rates.spread)
    print(
        f"hetstore bench: {device}  (each rate the fastest of a few runs; +N%: how much "
        "longer the median run took)\n"
    )
    width = max(len(r[0]) for r in rows)
    for name, value, how in rows:
        probe = _BENCH_PROBES.get(name, name)
        extra = f"  +{spread[probe]:.0%}" if probe in spread else ""
        print(f"  {name:<{width}}  {value:>16}{extra:>7}   {how}")
    return 0


# rows of `hetstore bench` -> their probe in MachineRates.spread
_BENCH_PROBES = {
    "host -> device copy": "copy to device",
    "device -> host copy": "copy from device",
    "device FLOP rate": "matmul",
}


def run_report(args) -> int:
    from pathlib import Path

    from hetstore.errors import ConfigError
    from hetstore.report import plot_timeline
    from hetstore.timeline import MemoryTimeline

    try:
        timeline = MemoryTimeline.load(args.timeline)
        out = Path(args.out) if args.out else Path(args.timeline).with_suffix(".png")
        written = plot_timeline(timeline, out)
    except ConfigError as exc:  # matplotlib missing; a ValueError, so caught first
        print(f"hetstore report: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"hetstore report: cannot draw {args.timeline!r}: {reason}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def run_demo_command(args) -> int:
    import os

    from hetstore.demo import DemoSettings, run_demo

    # On CUDA the budget binds the whole process, and the caching allocator's fixed-size
    # segments strand freed memory between its pools (91 MiB of a 0.58 GiB budget, seen
    # on an H100): segments that grow and shrink strand far less. Read when CUDA first
    # allocates, so set here, before anything has; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    settings = DemoSettings(
        steps=args.steps,
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        budget_fraction=args.budget_fraction,
        device=args.device,
        out=args.out,
        offload_path=args.offload_path,
        config_file=args.config,
        compare=args.compare,
        no_offload=args.no_offload,
        progress=not args.no_progress,
    )
    return run_demo(settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetstore",
        description="Train PyTorch models larger than device memory: parameters, gradients, "
        "optimizer states and activations placed across device, host memory and disk.",
        epilog="Run `hetstore COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _demo_parser(sub)
    add_plan_parser(sub)
    _bench_parser(sub)
    _report_parser(sub)
    args = parser.parse_args(argv)
    commands = {
        "demo": run_demo_command,
        "plan": run_plan,
        "bench": run_bench,
        "report": run_report,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
