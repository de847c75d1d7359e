"""The ``hetstore`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetstore",
        description="Train PyTorch models larger than device memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train the demo model under a device budget its states exceed")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from hetstore.demo import run_demo

        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
