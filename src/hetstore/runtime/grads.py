"""The plain-PyTorch gradient contract: ``p.grad`` of a managed parameter *is* hetstore's.

hetstore moves each gradient out of autograd's ``p.grad`` into its unit's fp32 gradient
buffer as soon as it is complete (the seed's "move, don't clone"), so that the device
never holds a model's worth of gradients. Code that reads or writes gradients through
torch's own API -- ``model.zero_grad()``, ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_``, Trainer's and accelerate's clipping and grad-norm logging, a
user's gradient-noise hook -- must see that buffer, or it silently does nothing.

Why this mechanism (the choices weighed):

- FSDP2 registers the *offloaded* tensor as the module's ``nn.Parameter`` and swaps the
  compute tensor in around forward and backward, so ``p.grad`` lives where the master
  lives. That changes what ``model.parameters()`` returns between phases and has no
  tensor to register when the master is on disk.
- torchao keeps host copies in ``p.grad``. torch only accepts a ``.grad`` of the
  parameter's own dtype and device, which a bf16 parameter with an fp32 gradient, or a
  GPU parameter with a host gradient, is not.
- Chosen: each managed parameter's class becomes a subclass of its own class (the
  in-place class change ``torch.nn.UninitializedParameter.materialize`` does) whose
  ``grad`` property reads and writes the unit's buffer. Autograd's engine keeps using the
  C++ field, which the runtime empties as it moves each gradient out; Python readers get a
  view of the fp32 buffer on the gradient tier's device, and in-place changes through it
  (clipping's scale, ``zero_()``) land in the buffer. Nothing runs unless someone touches
  ``.grad``: the step pays nothing. Gradients on disk, or sharded over ranks, have no
  whole tensor to show: reading them raises :class:`GradientAccessError` naming the way
  out, never a silent ``None``.

Each model gets its own subclasses (made by :class:`GradContract`), so the property
finds that model's units without any global registry or attribute on the parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hetstore.errors import GradientAccessError
from hetstore.runtime import released

if TYPE_CHECKING:
    from hetstore.runtime.unit import ParamEntry, Unit

__all__ = ["GradContract", "torch_grad", "set_torch_grad"]

# autograd's own gradient field, below the property a managed parameter's class adds
_TORCH_GRAD = torch._C.TensorBase.grad


def torch_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Autograd's ``.grad`` of ``param`` (what AccumulateGrad wrote), bypassing the contract."""
    return _TORCH_GRAD.__get__(param)


def set_torch_grad(param: torch.Tensor, value: torch.Tensor | None) -> None:
    _TORCH_GRAD.__set__(param, value)


def _repr_as_plain(param: nn.Parameter) -> str:
    """Print as an ``nn.Parameter`` prints: torch's repr names a subclass, which would
    give ``Parameter(Parameter([...]))`` for the contract's class. A released one is
    printed by the layer that serves its reads (runtime/released.py)."""
    if released.is_released(param):
        return nn.Parameter.__repr__(param)
    with torch.no_grad():  # an alias made under grad mode would print its grad_fn
        return repr(param.as_subclass(nn.Parameter))


class GradContract:
    """Makes ``p.grad`` of every managed parameter of one model read and write its
    unit's gradient buffer; :meth:`remove` gives the parameters their classes back."""

    def __init__(self, units: list[Unit]):
        self._where: dict[int, tuple[Unit, ParamEntry]] = {}
        self._classes: dict[type, type] = {}
        self._swapped: list[tuple[nn.Parameter, type]] = []
        # the optimizer's optim.disk_grads.DiskGradients, set by offload() once it is
        # made: p.grad of a gradient on disk is one of its DiskGradient (else refused)
        self.disk_gradients = None
        for unit in units:
            for entry in unit.entries:
                param = entry.param
                self._where[id(param)] = (unit, entry)
                released.expose(param)  # the managed class goes under the released layer
                base = type(param)
                self._swapped.append((param, base))
                param.__class__ = self._managed_class(base)
                if not unit.materialized:  # (a subclass of Parameter gets its layer now)
                    released.conceal(param)

    def _managed_class(self, base: type) -> type:
        cls = self._classes.get(base)
        if cls is None:
            grad = property(self.read, self.write, doc="The gradient, held by hetstore.")
            namespace = {
                "__module__": __name__,
                "__doc__": base.__doc__,
                "grad": grad,
                "__repr__": _repr_as_plain,
                "_hetstore_managed": True,  # runtime.released may put its layer on top
            }
            cls = type(base.__name__, (base,), namespace)
            self._classes[base] = cls
        return cls

    # ------------------------------------------------------------------ the property
    def read(self, param: nn.Parameter) -> torch.Tensor | None:
        own = torch_grad(param)  # mid-backward, before the runtime moves it out
        if own is not None:
            return own
        where = self._where.get(id(param))
        if where is None:
            return None
        unit, entry = where
        if entry.group is None or not entry.has_grad:
            return None  # frozen, not optimized, or no gradient since the last clear
        if unit.refusal is not None:  # (evicted: the buffer may have no bytes now)
            raise GradientAccessError(f"{entry.name!r}.grad: {unit.refusal}")
        if unit.grads.staged and self.disk_gradients is not None and unit.shards is None:
            unit.barrier()
            unit.grads.wait_copies()
            if not unit.grads.consumed:  # (else _view says why it is gone)
                return self.disk_gradients.gradient(entry, torch.device("cpu"))
        return self._view(unit, entry, "read")

    def write(self, param: nn.Parameter, value: torch.Tensor | None) -> None:
        where = self._where.get(id(param))
        if where is None or where[1].group is None:
            set_torch_grad(param, value)
            return
        unit, entry = where
        if value is None:
            set_torch_grad(param, None)
            entry.has_grad = False  # what model.zero_grad() does: the next backward copies
            if unit.grads.staged and self.disk_gradients is not None:
                self.disk_gradients.cleared(unit)  # (factors a clip left for them go)
            return
        if unit.refusal is not None:
            raise GradientAccessError(f"{entry.name!r}.grad: {unit.refusal}")
        if tuple(value.shape) != tuple(entry.shape):
            raise RuntimeError(
                f"assigned grad has shape {tuple(value.shape)}, but parameter "
                f"{entry.name!r} has shape {tuple(entry.shape)}"
            )
        with torch.no_grad():
            self._view(unit, entry, "write").copy_(value)
        entry.has_grad = True

    @staticmethod
    def _view(unit: Unit, entry: ParamEntry, verb: str) -> torch.Tensor:
        """A view of the gradient buffer. Handing one out counts as changing the
        gradients (``Unit.grads.version``): ``.data`` of it, or ``.numpy()``, changes them
        past its version counter, so a step taken ahead from them is not kept."""
        unit.barrier()  # (step_in_forward) it reads them: a write must wait
        unit.grads.wait_copies()  # mid-backward, a gradient may still be crossing
        if unit.shards is not None:
            raise GradientAccessError(
                f"cannot {verb} the .grad of {entry.name!r}: its unit is sharded over "
                f"{unit.shards.world_size} ranks, so each rank holds 1/{unit.shards.world_size} "
                "of the gradient. Clip with optimizer.clip_grad_norm_(max_norm) (all ranks), "
                "clear with optimizer.zero_grad()"
            )
        if unit.grads.consumed:
            raise GradientAccessError(
                f"cannot {verb} the .grad of {entry.name!r}: the optimizer step inside "
                f"backward (step_in_backward=True) consumed it (unit {unit.name!r}), so it "
                "is gone, and a change to it could no longer reach the step. Clear it with "
                "optimizer.zero_grad(); clipping or reading gradients needs "
                "step_in_backward=False"
            )
        if unit.grads.staged:
            raise GradientAccessError(
                f"cannot {verb} the .grad of {entry.name!r}: its gradient lives on disk "
                f"(unit {unit.name!r}, offload_grad='disk'), where no tensor can stand for it "
                "(reading p.grad gives one that serves torch.nn.utils.clip_grad_norm_). "
                "Clip with optimizer.clip_grad_norm_(max_norm) and clear with "
                "optimizer.zero_grad(), or set offload_grad='cpu' to keep gradients in host "
                "memory, where every torch gradient API works"
            )
        unit.grads.version += 1
        return unit.grad[entry.offset : entry.offset + entry.numel].view(entry.shape)

    # ------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        for param, base in self._swapped:
            was_released = released.is_released(param)
            param.__class__ = base
            if was_released:
                released.conceal(param)
        self._swapped.clear()
        self._where.clear()
