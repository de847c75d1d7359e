"""The host's side of one host unit's step on a GPU machine, piece by piece: where the
time between a unit's gradients and its next use goes, beside torchao's way.

    python benchmarks/gpu/host_probe.py [--numel 12600000]

A host unit (``offload_param='cpu', offload_optimizer='cpu', compute_dtype='bf16'``)
steps its fp32 master with torch's fused AdamW on the host, then refreshes its bf16 home
from the master on the host (``UnitForms.sync_home``), and its next fetch copies that
home to the device. torchao's ``CPUOffloadOptimizer`` keeps fp32 parameters on the GPU:
it steps the same way and copies the fp32 parameters back, with no cast on the host. So
the rows, each the best of 5 runs on ``--numel`` elements (12.6M: one block of the 185M
GPT):

- the fused AdamW step, on the main thread and on a worker thread (where hetstore's
  steps in the next forward run);
- the host cast of the master into a bf16 home (pinned where CUDA is there);
- with CUDA: the bf16 home's copy to the device, against the fp32 master's copy and a
  cast on the device (torchao's bytes and the other place for the cast); a device home's
  refresh from the fp32 master by ``copy_`` (torch casts on the host into a pageable
  temporary: ``offload_param='none'``'s way until 2026-11-28) and by ``runtime.upload``
  (its way since); the fp32 gradient's copy to the host;
- what a worker's AdamW costs the thread that feeds the device, by the worker's
  intra-op threads: all, all but two, half, a quarter (:func:`contention_rows`).

Before 2026-11-28 this probe compared the ordinary step with a speculative one (copies
into shadows first, then the step): 1.3 against 6.4-6.9 ms on the H100's host; that
speculation was deleted (docs/dev/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from hetstore.runtime import upload

ADAMW = dict(
    lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False
)


def best(fn: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    """Milliseconds of the fastest of 5 runs, after one untimed."""
    fn()
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def rows(n: int) -> list[tuple[str, float]]:
    cuda = torch.cuda.is_available()
    master, grad, exp_avg, exp_avg_sq = (torch.randn(n, pin_memory=cuda) for _ in range(4))
    exp_avg_sq.abs_()
    home = torch.empty(n, dtype=torch.bfloat16, pin_memory=cuda)
    step = torch.tensor(1.0)

    def adamw() -> None:
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step], **ADAMW)

    def cast_home() -> None:
        home.copy_(master)

    worker = ThreadPoolExecutor(1)
    out = [
        ("fused AdamW step, main thread", best(adamw)),
        ("fused AdamW step, worker thread", worker.submit(best, adamw).result()),
        ("cast of the master into the bf16 home, main thread", best(cast_home)),
        (
            "cast of the master into the bf16 home, worker thread",
            worker.submit(best, cast_home).result(),
        ),
    ]
    if cuda:
        device = torch.device("cuda")
        sync = torch.cuda.synchronize
        on_device = torch.empty(n, dtype=torch.bfloat16, device=device)
        fp32_on_device = torch.empty(n, device=device)
        grad_on_device = torch.randn(n, device=device)
        staging = torch.empty(upload.staging_numel(n), dtype=torch.bfloat16, pin_memory=True)
        out += [
            (
                "bf16 home to the device (pinned)",
                best(lambda: on_device.copy_(home, non_blocking=True), sync),
            ),
            (
                # what a device home's refresh from a host master did until 2026-11-28
                # (torch casts a CPU->GPU copy on the host, into a pageable temporary)
                "fp32 master into the bf16 device copy by copy_ (host cast, pageable)",
                best(lambda: on_device.copy_(master), sync),
            ),
            (
                # and what it does since (UnitForms.sync_home -> copy_cast)
                "the same by runtime.upload (host cast into pinned staging, in chunks)",
                best(lambda: upload.upload_cast(on_device, master, staging), sync),
            ),
            (
                "fp32 master to the device, cast there",
                best(
                    lambda: on_device.copy_(fp32_on_device.copy_(master, non_blocking=True)), sync
                ),
            ),
            (
                "fp32 master to the device (torchao's copy back)",
                best(lambda: fp32_on_device.copy_(master, non_blocking=True), sync),
            ),
            (
                "fp32 gradient to the host (pinned)",
                best(lambda: grad.copy_(grad_on_device, non_blocking=True), sync),
            ),
        ]
    worker.shutdown()
    return out + contention_rows(adamw, cuda)


def contention_rows(adamw: Callable[[], None], cuda: bool) -> list[tuple[str, float]]:
    """What a worker's AdamW costs the thread that feeds the device, by the worker's
    intra-op threads (``torch.set_num_threads`` is per thread under OpenMP): a fixed
    amount of feeding work (small kernels launched one after another, as a forward
    launches them; small matrix products on the CPU) alone, then while the worker steps
    in a loop, and the worker's step time at that thread count. On the H200 run of
    2026-11-28 autograd's thread spent 20.5 ms in ``AccumulateGrad`` with the worker's
    16-thread AdamW beside it, against 13.3 ms without."""
    if cuda:
        x, sync = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16), torch.cuda.synchronize
    else:
        x, sync = torch.randn(96, 96), lambda: None

    def feed() -> None:
        for _ in range(500):
            torch.mm(x, x).add_(1.0)

    out = [("feeding work alone (500 launches)", best(feed, sync))]
    threads = torch.get_num_threads()
    # (all; all but the two that feed a GPU, the caller's and autograd's; half; a quarter)
    counts = (threads, max(1, threads - 2), max(1, threads // 2), max(1, threads // 4))
    for count in dict.fromkeys(counts):
        worker = ThreadPoolExecutor(1)
        worker.submit(torch.set_num_threads, count).result()
        stepped = worker.submit(best, adamw).result()
        stop = threading.Event()

        def loop(stop=stop) -> None:
            while not stop.is_set():
                adamw()

        running = worker.submit(loop)
        beside = best(feed, sync)
        stop.set()
        running.result()
        worker.shutdown()
        out += [
            (f"fused AdamW step, worker thread with {count} intra-op thread(s)", stepped),
            (f"feeding work beside that worker's steps ({count} thread(s))", beside),
        ]
    torch.set_num_threads(threads)  # (the setting the workers changed for new threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=12_600_000)
    n = parser.parse_args().numel
    print(f"{torch.get_num_threads()} intra-op threads, {os.cpu_count()} CPUs, {n} elements")
    print("| piece | ms |\n|---|---|")
    for name, ms in rows(n):
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
