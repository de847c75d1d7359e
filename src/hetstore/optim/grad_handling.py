"""The gradients' side of the offloaded optimizer: fp16 loss scaling and unscaling,
``clip_grad_norm_`` over gradients wherever they live (in memory in place; on disk as
factors the step applies as it reads each chunk, with norms recorded in backward), and
the reads of gradients on disk that torch's own clip makes through ``p.grad``.

One of the classes :class:`~hetstore.optim.offloaded.OffloadedOptimizer` is made of. It
reads the unit steps and units the optimizer holds (``_unit_steps``, ``units``) and owns
``_disk_grad_factors``, ``_clipped`` and ``_unscaled``.
"""

from __future__ import annotations

import torch

from hetstore.errors import ConfigError
from hetstore.optim.grad_norms import ChunkNorms, scan_grads
from hetstore.optim.streamed import StreamedUnitStep
from hetstore.runtime.unit import ParamEntry
from hetstore.tiers.store import transfers_only

__all__ = ["GradHandling"]


class GradHandling:
    """Loss scaling, unscaling and clipping of an offloaded optimizer (module doc)."""

    def _memory_grad_views(self) -> dict[int, torch.Tensor]:
        """id(param) -> its gradient view, for parameters with a gradient in memory."""
        views = {}
        for unit in self.units:
            if unit.grad is None or transfers_only(unit.grad):
                continue
            for entry in unit.trainable_entries:
                if entry.has_grad:
                    views[id(entry.param)] = unit.grad[entry.offset : entry.offset + entry.numel]
        return views

    def _grad_shards(self) -> list[torch.Tensor]:
        """Sharded: the in-memory gradient shards of units that have gradients (whole
        flat buffers; their padding is zero)."""
        return [
            u.grad
            for u in self.units
            if isinstance(u.grad, torch.Tensor) and u.trainable_numel and u.grads.any()
        ]

    def _disk_units(self) -> list[StreamedUnitStep]:
        return [
            us
            for us in self._unit_steps
            if isinstance(us, StreamedUnitStep)
            and transfers_only(us.unit.grad)
            and us.unit.grads.any()
        ]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` under fp16 dynamic loss scaling, else ``loss`` unchanged.

        Usage with ``compute_dtype="fp16"``: ``optimizer.scale_loss(loss).backward()``
        (or ``optimizer.backward(loss)``), then ``optimizer.step()`` as usual.
        """
        if self.loss_scaler is None:
            return loss
        return loss * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.scale_loss(loss).backward(**kwargs)

    def _unscale(self) -> bool:
        """Divide gradients by the loss scale once per step; return True if any is inf/NaN
        (again on a second call: ``clip_grad_norm_`` unscales before ``step()`` does, and
        the step must still skip; it used to see False there and step with inf/NaN)."""
        if self.loss_scaler is None:
            return False
        if self._unscaled:
            return self._found_inf
        self._unscaled = True
        if self.step_ahead is not None:
            self.step_ahead.policy.step_called()
        inv = 1.0 / self.loss_scaler.scale
        if self.shards is not None:
            views = self._grad_shards()
        else:
            views = list(self._memory_grad_views().values())
        found = False
        if views:
            unscaled = None
            if self.step_ahead is not None:  # steps taken ahead applied inv themselves
                unscaled = self.step_ahead.backward.unscaling(
                    [u for u in self.units if isinstance(u.grad, torch.Tensor)]
                )
            torch._foreach_mul_(views, inv)
            if unscaled is not None:
                unscaled(inv)
            found = not all(bool(torch.isfinite(v).all()) for v in views)
        self._disk_grad_factors.append(inv)
        finite = [True]

        def check(chunk: torch.Tensor, start: int) -> None:
            if finite[0] and not bool(torch.isfinite(chunk).all()):
                finite[0] = False

        for unit_step in self._disk_units():
            if found or not finite[0]:
                break
            scan_grads(unit_step, self._disk_grad_factors, check)
        found = found or not finite[0]
        if self.shards is not None:  # every rank skips the step, or none does
            flag = torch.tensor(float(found), device=self.units[0].device)
            self.shards.all_reduce(flag, "max", "the fp16 overflow check")
            found = bool(flag)
        self._found_inf = found
        return found

    def prepare_grad_reads(self, norm_type: float) -> None:
        """Before a clip reads the gradients (``clip_grad_norm_``, or torch's through
        ``p.grad`` of gradients on disk): the steps still running on them land, and from
        the next backward on each disk unit's L2 norms are taken as its gradients are
        written (with fp16 the clip reads unscaled gradients, which backward has not)."""
        if self.step_ahead is not None:
            self.step_ahead.policy.step_called()
        self.finish_steps_in_forward()
        if self.grad_norms is not None and norm_type == 2.0 and self.loss_scaler is None:
            self.grad_norms.enabled = True

    def disk_grad_norms(self, norm_type: float) -> dict[int, torch.Tensor]:
        """id(param) -> norm of its (factored) gradient, for gradients on disk. A
        parameter split across two chunks combines the chunks' norms."""
        norms: dict[int, torch.Tensor] = {}
        # the norms recorded from the gradients in backward are what the clip would read
        # while no factor is to be applied yet (an earlier clip scales them)
        usable = self.grad_norms is not None and norm_type == 2.0 and not self._disk_grad_factors
        for unit_step in self._disk_units():
            recorded = self.grad_norms.norms_of(unit_step.unit) if usable else None
            if recorded is not None:  # taken at the end of backward: no read from disk
                norms.update(recorded)
                continue
            chunked = ChunkNorms(unit_step.unit, norm_type)
            scan_grads(unit_step, self._disk_grad_factors, chunked.visit)
            norms.update(chunked.result())
        return norms

    def disk_grads_version(self) -> tuple:
        """Changes whenever the gradients on disk, or the factors on them, change."""
        states = tuple(s.unit.grads.state() for s in self._disk_units())
        return (len(self._disk_grad_factors), states)

    def disk_grad_entries(self) -> list[ParamEntry]:
        """The parameters whose gradients are on disk and present."""
        return [e for s in self._disk_units() for e in s.unit.trainable_entries if e.has_grad]

    def scale_disk_grads(self, factor: torch.Tensor) -> None:
        """Multiply every gradient on disk by ``factor`` (as the step reads them)."""
        self._disk_grad_factors.append(factor)

    def forget_disk_factors(self) -> None:
        """Every gradient on disk was cleared through torch's API: the factors meant for
        them go (as optimizer.zero_grad() drops them)."""
        self._disk_grad_factors = []
        self.disk_grads.forget()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the global gradient norm over every gradient, wherever it lives.

        Same semantics and return value as ``torch.nn.utils.clip_grad_norm_`` over the
        original parameters (norms per parameter, then the norm of those norms, summed in
        ``model.parameters()`` order). Gradients on disk are read once for their norms and
        scaled as the step reads them.
        """
        self._check_alive("clip_grad_norm_")
        if self.modes.in_backward:
            raise ConfigError(
                "optimizer.clip_grad_norm_(): with step_in_backward=True each unit is stepped "
                "inside backward, before the global norm is known, and its gradients are "
                "gone; set step_in_backward=False to clip (overlap_step still steps beside "
                "backward, exactly)"
            )
        norm_type = float(norm_type)
        self.prepare_grad_reads(norm_type)
        self._unscale()
        if self.shards is not None:
            return self._clip_sharded(max_norm, norm_type, error_if_nonfinite)
        memory = self._memory_grad_views()
        per_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for key, view in memory.items():
            per_device.setdefault(view.device, []).append((key, view))
        norms: dict[int, torch.Tensor] = {}
        for items in per_device.values():
            computed = torch._foreach_norm([v for _, v in items], norm_type)
            norms.update(zip((k for k, _ in items), computed, strict=True))
        norms.update(self.disk_grad_norms(norm_type))
        ordered = [norms[id(p)] for p in self._norm_order if id(p) in norms]
        if not ordered:
            return torch.tensor(0.0)
        target = ordered[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(target) for n in ordered]), norm_type)
        self._check_finite(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coef) != 1.0:  # x * 1.0 is x: not clipping leaves the buffers untouched,
            self._clipped = True  # so a step already taken ahead still holds
            for items in per_device.values():
                device = items[0][1].device
                torch._foreach_mul_([v for _, v in items], coef.to(device))
        self._disk_grad_factors.append(coef.cpu())
        return total

    @staticmethod
    def _check_finite(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} for gradients is non-finite, so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )

    def _clip_sharded(
        self, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """``clip_grad_norm_`` over shards: each rank sums its shards' ``|g|^p`` (or takes
        their max for the inf-norm), the ranks all-reduce, and every rank clips by the
        same factor. Equal to torch's per-parameter norm-of-norms up to fp32 rounding of
        the summation order (it sums in float64, then rounds)."""
        infinite = norm_type == float("inf")
        partials: list[torch.Tensor] = []

        def add(chunks: list[torch.Tensor]) -> None:
            for norm in torch._foreach_norm(chunks, norm_type):
                norm = norm.double().cpu()
                partials.append(norm if infinite else norm**norm_type)

        flats = self._grad_shards()
        if flats:
            add(flats)
        for unit_step in self._disk_units():
            scan_grads(unit_step, self._disk_grad_factors, lambda chunk, start: add([chunk]))
        local = torch.zeros((), dtype=torch.float64)
        if partials:
            stacked = torch.stack(partials)
            local = stacked.max() if infinite else stacked.sum()
        local = local.to(self.units[0].device)
        self.shards.all_reduce(local, "max" if infinite else "sum", "the gradient norm")
        total = (local if infinite else local ** (1.0 / norm_type)).float().cpu()
        self._check_finite(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if flats and float(coef) != 1.0:  # (x * 1.0 is x: a step taken ahead holds)
            self._clipped = True
            torch._foreach_mul_(flats, coef.to(flats[0].device))
        self._disk_grad_factors.append(coef)
        return total
