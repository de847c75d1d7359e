"""``p.grad`` of a gradient on disk, for torch's own ``clip_grad_norm_``.

Trainer, accelerate and Lightning clip through ``torch.nn.utils.clip_grad_norm_``, which
asks each ``p.grad`` for its norm (``torch.linalg.vector_norm``) and then scales it in
place (``mul_`` by one clamped coefficient). A gradient on disk has no tensor to show,
yet both operations have an exact answer without one: its norm is the one the
optimizer's own clip takes (recorded in backward, or read in chunks), and a scale is a
factor the step applies to each chunk as it reads it, in the order torch would have
applied it in place (``OffloadedOptimizer.scale_disk_grads``).

So ``p.grad`` of such a parameter is a :class:`DiskGradient`: a tensor with the
gradient's shape, dtype and device and no storage, which answers those two operations
(``torch.nn.utils.clip_grad_norm_`` groups it apart from foreach, so it sees them one
tensor at a time) and refuses every other use with :class:`GradientAccessError`, naming
the ways out. A scale must reach every gradient on disk alike, as one factor applies to
all of them: one that reached only some is refused at ``optimizer.step()``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten

from hetstore.errors import GradientAccessError

if TYPE_CHECKING:
    from hetstore.optim.offloaded import OffloadedOptimizer
    from hetstore.runtime.unit import ParamEntry, Unit

__all__ = ["DiskGradients", "DiskGradient"]

# what a reader may ask of a DiskGradient besides its norm and a scale: metadata only
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.__len__,
    torch._has_compatible_shallow_copy_type,  # (module._apply, before `grad.data = moved`)
}
_PROPERTIES = {
    "device",
    "dtype",
    "shape",
    "layout",
    "requires_grad",
    "grad_fn",
    "is_leaf",
    "is_sparse",
    "is_cuda",
    "is_meta",
    "ndim",
    "is_nested",
    "_base",
}


def _refusal(entry: ParamEntry, what: str) -> GradientAccessError:
    return GradientAccessError(
        f"cannot {what} the .grad of {entry.name!r}: its gradient lives on disk, where no "
        "tensor can stand for it; p.grad there serves torch.nn.utils.clip_grad_norm_ (its "
        "norm and one scale for every gradient) and zero_grad only. Clip with "
        "optimizer.clip_grad_norm_(max_norm), or set offload_grad='cpu' to keep gradients "
        "in host memory, where every torch gradient API works"
    )


class DiskGradient(torch.Tensor):
    """The ``p.grad`` of one parameter whose gradient is on disk (see module doc)."""

    _entry: ParamEntry
    _owner: DiskGradients

    @staticmethod
    def __new__(cls, entry: ParamEntry, owner: DiskGradients, device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, entry.shape, dtype=torch.float32, device=device
        )
        tensor._entry = entry
        tensor._owner = owner
        return tensor

    def __repr__(self) -> str:
        return f"DiskGradient({self._entry.name!r}, shape={tuple(self._entry.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in _METADATA or (name == "__get__" and _property_name(func) in _PROPERTIES):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        gradient = _first_disk_gradient(args, kwargs)
        if func is torch.linalg.vector_norm and args[0] is gradient:
            ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            if len(args) > 2 or set(kwargs) - {"ord"}:
                raise _refusal(gradient._entry, "take a partial norm of")
            return gradient._owner.norm(gradient._entry, float(ord))
        if func is torch.Tensor.mul_ and args[0] is gradient and len(args) == 2:
            gradient._owner.scale(gradient._entry, args[1])
            return gradient
        if func in (torch.Tensor.to, torch.Tensor.cpu) and args[0] is gradient:
            # a move to where it already is (module.cpu(), module.to(device, dtype) of a
            # model whose gradients are on disk) is itself, as in torch
            if func is torch.Tensor.cpu:
                device, dtype = torch.device("cpu"), None
            else:
                device, dtype, *_ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if (device is None or torch.device(device) == gradient.device) and dtype in (
                None,
                gradient.dtype,
            ):
                return gradient
        if name == "__set__" and _property_name(func) == "data" and len(args) == 2:
            value = args[1]  # module._apply's `grad.data = moved` after a no-op move
            if isinstance(value, DiskGradient) and value._entry is gradient._entry:
                return None
        raise _refusal(gradient._entry, f"use {name or func} on")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        gradient = _first_disk_gradient(args, kwargs)
        raise _refusal(gradient._entry, f"run {func} on")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    __hash__ = torch.Tensor.__hash__  # (identity, as a tensor's)


def _first_disk_gradient(args, kwargs) -> DiskGradient:
    """The DiskGradient an op was called with, wherever it sits (``torch.stack([g])``,
    ``torch._foreach_norm([g])`` take lists)."""
    return next(t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, DiskGradient))


def _property_name(getter) -> str:
    owner = getattr(getter, "__self__", None)
    return getattr(owner, "__name__", "")


class DiskGradients:
    """Hands out the :class:`DiskGradient` of parameters whose gradients are on disk,
    and answers them from ``optimizer``'s gradients (norms, factors)."""

    def __init__(self, optimizer: OffloadedOptimizer):
        # weakly: the model's gradient contract holds this, and a model must not keep
        # the optimizer it was offloaded with alive
        self._optimizer_ref = weakref.ref(optimizer)
        self._norms: tuple[tuple, dict[int, torch.Tensor]] | None = None
        # the factor being applied by the clip under way and the parameters it reached
        self._factor: torch.Tensor | None = None
        self._reached: set[int] = set()

    @property
    def _optimizer(self) -> OffloadedOptimizer:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise GradientAccessError(
                "gradients on disk: the optimizer hetstore.offload() returned is gone, and "
                "with it what they are read through"
            )
        return optimizer

    def gradient(self, entry: ParamEntry, device: torch.device) -> DiskGradient:
        if self._optimizer.loss_scaler is not None:
            raise GradientAccessError(
                f"cannot read the .grad of {entry.name!r}: its gradient lives on disk and "
                "is still multiplied by the fp16 loss scale; clip with "
                "optimizer.clip_grad_norm_(max_norm), which unscales first"
            )
        return DiskGradient(entry, self, device)

    def norm(self, entry: ParamEntry, norm_type: float) -> torch.Tensor:
        """The norm of ``entry``'s gradient as it is now (every factor so far applied):
        all disk gradients' norms are taken once per state of the gradients. A norm asked
        for after a scale begins another clip: the last must have reached them all."""
        self.check_complete()
        optimizer = self._optimizer
        key = (norm_type, optimizer.disk_grads_version())
        if self._norms is None or self._norms[0] != key:  # (the clip's first parameter)
            optimizer.prepare_grad_reads(norm_type)
            self._norms = (key, optimizer.disk_grad_norms(norm_type))
        return self._norms[1][id(entry.param)].clone()

    def scale(self, entry: ParamEntry, factor) -> None:
        """``p.grad.mul_(factor)`` of a gradient on disk: the first of a clip's calls
        appends the factor for the step; the others must bring the same one."""
        factor = torch.as_tensor(factor, dtype=torch.float32).cpu()
        if factor.numel() != 1:
            raise _refusal(entry, "scale by a tensor of many elements")
        if (
            self._factor is not None
            and torch.equal(factor, self._factor)
            and id(entry.param) not in self._reached
        ):
            self._reached.add(id(entry.param))
            return
        self.check_complete()  # (a gradient scaled again: the next clip's first)
        self._optimizer.scale_disk_grads(factor)
        self._factor, self._reached = factor, {id(entry.param)}

    def forget(self) -> None:
        """The step took the factors, or zero_grad dropped the gradients."""
        self._norms, self._factor, self._reached = None, None, set()

    def check_complete(self) -> None:
        """Before the step, and before another factor: the last factor reached every
        gradient on disk, as it is applied to every one of them."""
        if self._factor is None:
            return
        missing = [
            e.name for e in self._optimizer.disk_grad_entries() if id(e.param) not in self._reached
        ]
        if missing:  # (kept: step() refuses again until zero_grad() drops the factor)
            raise GradientAccessError(
                f"a scale of p.grad reached some gradients on disk but not {missing[:3]}: "
                "hetstore applies one factor to every gradient on disk as the step reads "
                "them. Clip over all parameters (torch.nn.utils.clip_grad_norm_("
                "model.parameters(), ...)) or with optimizer.clip_grad_norm_(max_norm)"
            )
        self._factor, self._reached = None, set()

    def cleared(self, unit: Unit) -> None:
        """``p.grad = None`` (``model.zero_grad()``) of a gradient on disk in ``unit``:
        once none is left, the factors recorded for them go too, as
        ``optimizer.zero_grad()`` drops them (a clip's factor must not reach the next
        step's gradients)."""
        if unit.grads.any():  # (the common case, checked first: one unit's flags)
            return
        optimizer = self._optimizer_ref()
        if optimizer is not None and not optimizer.disk_grad_entries():
            optimizer.forget_disk_factors()
