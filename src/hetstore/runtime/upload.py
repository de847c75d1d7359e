"""Host values onto the device in another dtype, cast on the host into pinned memory.

``dst.copy_(src)`` with ``src`` a CPU tensor, ``dst`` a CUDA tensor and the dtypes
different is torch's slow path: it casts on the host into a pageable temporary and
copies from that, synchronously. On an H200's host (``benchmarks/gpu/host_probe.py``,
2026-11-28) that took 3.64 ms per 12.6M fp32 elements into bf16, where the same cast
into pinned memory took 0.43 ms and the pinned copy 0.47 ms. A device home refreshed
from its host master (``offload_param='none'``) paid it for every parameter at every
step: 45 ms of the 185M GPT's 195 ms step in the profile (``cudaMemcpyAsync`` on the
caller's thread).

So the cast goes into pinned staging of the destination's dtype and the copy goes from
there, in chunks through two halves of the staging, so that the host casts one chunk
while the previous one is copied. Staging, rather than copying the fp32 values and
casting on the device, moves half the bytes over the link and needs no device memory;
the cast is the same rounding either way (round to nearest even), so the result is
bitwise what ``copy_`` gives.
"""

from __future__ import annotations

import threading

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "mark_step_worker",
    "needs_staging",
    "staging_numel",
    "upload_cast",
]

CHUNK_ELEMENTS = 4 * 2**20  # 8 MiB of bf16 per half: each copy well past its launch cost

_thread = threading.local()


def mark_step_worker() -> None:
    """Called on the optimizer's worker thread when it starts (optim.step_worker): the
    staging comes from the host tier, which only the caller's thread allocates from (the
    worker's jobs are handed their buffers), so a copy made there takes torch's way."""
    _thread.step_worker = True


def needs_staging(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` would take torch's host-cast, pageable path and this
    thread may stage it instead."""
    return (
        dst.device.type == "cuda"
        and src.device.type == "cpu"
        and dst.dtype != src.dtype
        and src.numel() > 0
        and not getattr(_thread, "step_worker", False)
    )


def staging_numel(numel: int) -> int:
    """Elements of staging :func:`upload_cast` uses for ``numel`` values."""
    return min(numel, 2 * CHUNK_ELEMENTS)


def upload_cast(dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor) -> None:
    """``dst.copy_(src)`` (both 1-D, same length) through ``staging`` (host, pinned where
    ``dst`` is on CUDA, ``dst``'s dtype, at least :func:`staging_numel` elements). On
    return the copies are done and ``staging`` is free again."""
    numel = src.numel()
    chunk = -(-staging_numel(numel) // 2) if numel > CHUNK_ELEMENTS else max(numel, 1)
    halves = [staging[:chunk], staging[chunk : 2 * chunk]]
    done: list[torch.cuda.Event | None] = [None, None]
    try:
        for index, start in enumerate(range(0, numel, chunk)):
            half, end = index % 2, min(start + chunk, numel)
            if done[half] is not None:
                done[half].synchronize()  # its previous copy has read it
            staged = halves[half][: end - start]
            staged.copy_(src[start:end])
            dst[start:end].copy_(staged, non_blocking=dst.is_cuda)
            if dst.is_cuda:
                done[half] = torch.cuda.Event()
                done[half].record(torch.cuda.current_stream(dst.device))
    finally:  # (even after an error: the staging is freed once this returns)
        for event in done:
            if event is not None:
                event.synchronize()
