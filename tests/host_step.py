"""The reference for a step hetstore runs on the host while the model computes on CUDA."""

from __future__ import annotations

import torch


class HostStepReference:
    """Plain PyTorch with the optimizer on the host (ZeRO-Offload's split, written out):
    the model computes on CUDA, each parameter has an fp32 copy on the CPU with the
    optimizer; after backward the gradients are copied to the host, the CPU optimizer
    steps, and the new weights are copied back. This is the arithmetic hetstore does when
    ``offload_optimizer`` is 'cpu' or 'disk', so the comparison with it is tight."""

    def __init__(self, model: torch.nn.Module, make_optimizer):
        self.model = model
        self.master = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
        self.optimizer = make_optimizer(self.master)

    def step(self, clip: float | None = None) -> torch.Tensor | None:
        """Gradients to the host, optionally clipped there (as hetstore clips the host
        gradients ``p.grad`` hands out), the host step, the weights back."""
        for master, p in zip(self.master, self.model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.detach().cpu()
        norm = None if clip is None else torch.nn.utils.clip_grad_norm_(self.master, clip)
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.master, self.model.parameters(), strict=True):
                p.copy_(master)
        return norm

    def zero_grad(self) -> None:
        self.model.zero_grad()
        self.optimizer.zero_grad()
