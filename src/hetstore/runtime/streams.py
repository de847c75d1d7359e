"""The CUDA side streams of one offloaded model: one owner, each stream named for what
it carries. None on a CPU device, where every copy is a synchronous memcpy.

Why side streams at all: copies overlap compute only when they are issued on a stream
other than the one computing. Why three: parameters come in (host to device) while saved
activations go out (device to host) and come back; a PCIe/NVLink link is full duplex,
so the two directions on separate streams run at once instead of queueing behind each
other. Gradients go out on their own stream so that they never wait behind an
activation's copy back in, which backward is waiting for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CudaStreams"]


@dataclass(frozen=True)
class CudaStreams:
    params: torch.cuda.Stream  # units' parameter fetches (host or disk staging to device)
    activations: torch.cuda.Stream  # saved activations to host and back before backward
    grads: torch.cuda.Stream  # gradients to host memory while backward goes on

    @staticmethod
    def for_device(device: torch.device) -> CudaStreams | None:
        if device.type != "cuda":
            return None
        return CudaStreams(*(torch.cuda.Stream(device) for _ in range(3)))
