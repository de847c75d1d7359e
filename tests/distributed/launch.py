"""Start ``world`` ranks of tests/distributed/worker.py as plain subprocesses (what
torchrun does, minus its agent: torchrun tears every rank down when one exits, and the
failure tests need the survivors to report)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world: int, args: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def torchrun(world: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run the worker under the real torchrun."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world),
        "--master-port",
        str(free_port()),
        str(WORKER),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
