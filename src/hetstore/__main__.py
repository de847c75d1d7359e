"""The ``hetstore`` command line."""

from __future__ import annotations

import argparse
import sys

from hetstore.cli_plan import add_plan_parser, run_plan

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetstore",
        description="Train PyTorch models larger than device memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train the demo GPT under a device budget its training states exceed"
    )
    demo.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    demo.add_argument("--width", type=int, default=256, help="model width (default 256)")
    demo.add_argument("--depth", type=int, default=6, help="number of blocks (default 6)")
    demo.add_argument(
        "--compare", action="store_true", help="also train plain PyTorch and compare losses"
    )
    demo.add_argument(
        "--no-offload",
        action="store_true",
        help="keep everything on the device: shows the out-of-memory report",
    )
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "demo":
        from hetstore.demo import DemoSettings, run_demo

        settings = DemoSettings(
            steps=args.steps,
            width=args.width,
            depth=args.depth,
            compare=args.compare,
            no_offload=args.no_offload,
        )
        return run_demo(settings)
    return 2


if __name__ == "__main__":
    sys.exit(main())
