"""Parameters whose unit is released: reads are served, writes refused, nothing crashes.

Between uses a unit's device copy has no bytes (:meth:`Unit.release` resizes its storage
to 0, FSDP2's trick), and torch checks no storage bounds: reading such a parameter -- to
print a weight, keep an EMA copy, log a norm between steps -- would read freed memory or
kill the interpreter. So while its unit is released, each parameter's class is switched
from ``nn.Parameter`` to :class:`ReleasedParameter` (a subclass: identity, ``isinstance``,
shape, dtype, device, ``requires_grad`` and ``.grad`` are unchanged), and switched back
when the unit is fetched, so forward and backward see plain Parameters at no cost (a class
switch is a pointer store; torch.compile traces the class it always sees in forward).

What a released parameter does, through ``__torch_function__``:

- metadata (``shape``, ``dtype``, ``numel()``, ``.grad``, ``requires_grad_()``, hooks ...)
  is answered as always, reading nothing;
- a read (``clone()``, ``norm()``, arithmetic, ``print``, ``torch.save(p)``) runs on the
  parameter's current value, as forward would see it (compute dtype, on its device), read
  from the unit's home (or its master when newer): exact, at the cost of one read (a disk
  read for a unit on disk). ``*_like`` factories read nothing;
- a result that shares memory with that value (``p.data``, ``p.detach()``, a view or a
  slice) is a :class:`ReadOnlyValue`: in plain PyTorch writing through it changes the
  parameter, here it would change a copy, so it refuses writes instead of losing them.
  It stays an alias as in plain PyTorch: kept across a step (or a load), its next use
  reads the parameter's new value into the same memory first (:class:`LiveRead`), so
  ``w = p.detach()`` taken once follows the weights, and every alias of one read (``w``,
  ``w[0]``, ``w.view(-1)``) sees the same bytes;
- a write (an in-place op, ``out=``, ``p.data = ...``) raises
  :class:`~hetstore.errors.OffloadedParameterError` naming ``load_state_dict``, which
  writes hetstore's fp32 master (the source of truth) and refreshes every copy;
- a use needing a gradient (gradients on, the parameter requires one, and a result then
  requires one: a penalty or an embedding lookup outside forward) is refused: hetstore
  collects a unit's gradients only around its module's forward, so it would be lost;
- the bytes themselves (``data_ptr``, storage, DLPack) are refused: there are none, and a
  read's are a temporary's; a numpy array of a read is read-only.

A parameter sharded over ranks refuses reads too (its value is spread over ranks: a
collective, which ``model.state_dict()`` on every rank is); one whose model was freed by
``hetstore.release()`` refuses everything but metadata.

The layer goes on ``nn.Parameter`` itself or on the class a model's grad contract made
(runtime/grads.py), which wraps any subclass of it too. A value is read where it is used,
so state_dict()/``hetstore.save`` or ``hetstore.export_weights`` stay the way to read a
whole model: they read each unit once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_map

from hetstore.errors import OffloadedParameterError

if TYPE_CHECKING:
    from hetstore.runtime.unit import ParamEntry, Unit

__all__ = [
    "LiveRead", "ParamSource", "Released", "ReadOnlyValue", "attach", "conceal", "expose",
    "is_released", "source_of",
]  # fmt: skip

_SOURCE = "_hetstore_source"  # the attribute a managed parameter carries: its ParamSource


class ParamSource:
    """Where a released parameter's value comes from: its unit and its entry there."""

    __slots__ = ("unit", "entry", "refusal")

    def __init__(self, unit: Unit | None, entry: ParamEntry, refusal: str | None = None):
        self.unit, self.entry, self.refusal = unit, entry, refusal

    def read(self) -> torch.Tensor:
        refusal = self.refusal
        if refusal is None and self.unit is not None:
            refusal = self.unit.refusal  # (evicted: hetstore.evict)
        if refusal is not None:
            raise OffloadedParameterError(f"parameter {self.entry.name!r}: {refusal}")
        return self.unit.read_param(self.entry)


class LiveRead:
    """One read of a released parameter, shared by every alias taken of it (``p.detach()``,
    ``p.data``, their views): before an alias is used, a read that the parameter's unit
    has changed since (``Unit.param_version``) is read again into the same memory, so
    aliases follow the parameter as they do in plain PyTorch.

    It holds the unit and its entry weakly: an alias kept in a logger or an EMA dict must
    not keep a dropped model's tiers (host pool, disk files, IO threads) alive. Once the
    model is gone or released, the alias keeps the last value it had."""

    __slots__ = ("name", "value", "version", "_unit", "_entry")

    def __init__(self, source: ParamSource, value: torch.Tensor):
        self.name = source.entry.name
        self.value = value
        self.version = source.unit.param_version
        self._unit = weakref.ref(source.unit)
        self._entry = weakref.ref(source.entry)

    def refresh(self) -> None:
        unit, entry = self._unit(), self._entry()
        if unit is None or entry is None or unit.closed or unit.param_version == self.version:
            return
        version = unit.param_version
        fresh = unit.read_param(entry)
        # a read taken under inference_mode (a validation loop) is an inference tensor:
        # only written to inside that mode
        with DisableTorchFunctionSubclass(), torch.inference_mode(self.value.is_inference()):
            with torch.no_grad():
                self.value.copy_(fresh)
        self.version = version


def attach(param: nn.Parameter, source: ParamSource) -> None:
    setattr(param, _SOURCE, source)


def source_of(param: nn.Parameter) -> ParamSource:
    return getattr(param, _SOURCE)


def conceal(param: nn.Parameter) -> None:
    """The unit's bytes are going: reads of ``param`` are served from now on."""
    if hasattr(param, _SOURCE) and not isinstance(param, Released):
        variant = _released_variant(type(param))
        if variant is not None:
            param.__class__ = variant


def expose(param: nn.Parameter) -> None:
    """The unit's bytes are there: ``param`` gets its own class back."""
    if isinstance(param, Released):
        param.__class__ = type(param).__dict__["_hetstore_plain"]


def is_released(param: torch.Tensor) -> bool:
    return isinstance(param, Released)


def _released_variant(cls: type) -> type | None:
    """``cls`` with :class:`Released` in front. ``nn.Parameter``'s is
    :class:`ReleasedParameter`; a class a model's :class:`GradContract` made keeps its own
    (never one on a class of torch's or a library's); None for any other class (a
    subclass of ``nn.Parameter`` from elsewhere gets the layer once the contract wraps it)."""
    if cls is nn.Parameter:
        return ReleasedParameter
    if "_hetstore_managed" not in cls.__dict__:
        return None
    variant = cls.__dict__.get("_hetstore_released_variant")
    if variant is None:
        variant = type(cls.__name__, (Released, cls), {"_hetstore_plain": cls})
        cls._hetstore_released_variant = variant
    return variant


# ---------------------------------------------------------------------- classification
def _getters(*names: str) -> set:
    return {getattr(torch.Tensor, n).__get__ for n in names if hasattr(torch.Tensor, n)}


def _setters(*names: str) -> set:
    return {getattr(torch.Tensor, n).__set__ for n in names if hasattr(torch.Tensor, n)}


# Read nothing but metadata: answered by the parameter itself.
_METADATA = (
    _getters(
        "shape", "dtype", "device", "requires_grad", "grad", "_grad", "is_leaf", "grad_fn",
        "_grad_fn", "ndim", "layout", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse",
        "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps", "itemsize", "nbytes",
        "_version", "output_nr", "_base", "retains_grad", "_backward_hooks",
        "_post_accumulate_grad_hooks",
    )
    | _setters(
        "grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"
    )
    | {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
        torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_signed,
        torch.Tensor.get_device, torch.Tensor.requires_grad_, torch.Tensor.retain_grad,
        torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.__hash__, torch.Tensor.__len__, torch.Tensor.storage_offset,
        torch.numel, torch._has_compatible_shallow_copy_type,
    }
)  # fmt: skip

# Would hand out the bytes themselves (an address, the storage, a DLPack capsule): there
# are none between uses, and a read's are a temporary's (two parameters would share an
# address, a write through them would be lost).
_NO_BYTES = {
    torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage,
    torch.Tensor._typed_storage, torch.Tensor.__dlpack__,
}  # fmt: skip

# Use only the shape, dtype and device of their tensor argument: served by an empty one.
_LIKE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor,
}  # fmt: skip

# May hand back their own argument (``p.to(p.device)``, ``p.float()`` of an fp32 ``p``):
# then they must give the parameter itself, as in plain PyTorch -- ``model.to(device)``
# (Trainer and accelerate call it) assigns each result to ``p.data``, a no-op then.
_MAY_RETURN_SELF = {
    torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.float,
    torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.contiguous,
    torch.Tensor.type, torch.Tensor.type_as,
}  # fmt: skip

_DTYPE_CASTS = {
    torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double,
    torch.Tensor.contiguous,
}  # fmt: skip


def _returns_self(func, param: torch.Tensor, args, kwargs) -> bool:
    """Whether ``func(param, *args, **kwargs)`` hands back ``param`` itself, decided from
    the arguments and the metadata: nothing is read, nothing allocated on the device
    (``model.to()`` asks this of every parameter)."""
    if func is torch.Tensor.to:
        kwargs = dict(kwargs)
        if kwargs.pop("copy", False):
            return False
        try:  # the parser torch's Module.to uses: (device, dtype, non_blocking, format)
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):  # a positional copy=...: decide on a stand-in
            return _returns_self_on_stand_in(func, param, args, kwargs, param.device)
        return (
            _same_device(device, param.device)
            and dtype in (None, param.dtype)
            and _keeps_layout(param, memory_format)
        )
    if func is torch.Tensor.cpu:
        return param.device.type == "cpu" and _keeps_layout(param, kwargs.get("memory_format"))
    if func is torch.Tensor.cuda:
        device = args[0] if args else kwargs.get("device")
        if device is None:
            device = "cuda"
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        return _same_device(torch.device(device), param.device) and _keeps_layout(
            param, kwargs.get("memory_format")
        )
    if func in _DTYPE_CASTS:  # dtype and layout only: a meta stand-in answers
        return _returns_self_on_stand_in(func, param, args, kwargs, "meta")
    # type(...) / type_as(...): the type names a device kind too; a real stand-in
    # (rare calls: an uninitialized allocation the size of the parameter)
    return _returns_self_on_stand_in(func, param, args, kwargs, param.device)


def _keeps_layout(param: torch.Tensor, memory_format) -> bool:
    """A conversion to ``memory_format`` leaves ``param``'s layout (torch's own rule, asked
    of a meta tensor with its strides: no bytes)."""
    if memory_format in (None, torch.preserve_format):
        return True
    conversion = {"memory_format": memory_format}
    return _returns_self_on_stand_in(torch.Tensor.to, param, (), conversion, "meta")


def _returns_self_on_stand_in(func, param, args, kwargs, device) -> bool:
    stand_in = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=device)
    return func(stand_in, *args, **kwargs) is stand_in


def _same_device(wanted: torch.device | None, actual: torch.device) -> bool:
    if wanted is None:
        return True
    if wanted.type != actual.type:
        return False
    if wanted.index is None and wanted.type == "cuda":
        return torch.cuda.current_device() == actual.index
    return wanted.index is None or wanted.index == actual.index


_DATA_SET = torch.Tensor.data.__set__
_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__setitem__", "__set__",  # a property set (.data = x) that is not metadata
}  # fmt: skip


def _written(func, args, kwargs) -> list:
    """The tensors ``func`` writes into: its first argument when it works in place (a
    trailing ``_``, an in-place operator, ``inplace=True``, a property set such as
    ``.data = x``), and its ``out=``."""
    name = getattr(func, "__name__", "").split(".")[0]  # aten's "add_.Tensor" too
    targets = []
    in_place = (
        (name.endswith("_") and not name.endswith("__"))
        or name in _INPLACE_DUNDERS
        or kwargs.get("inplace") is True
    )
    if in_place:  # the first argument, positional or not (nn.init passes tensor=)
        first = args[0] if args else next(iter(kwargs.values()), None)
        targets.append(first)
    if kwargs.get("out") is not None:
        targets.append(kwargs["out"])
    return [t for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)]


def _refuse_write(tensor: torch.Tensor, func) -> OffloadedParameterError:
    what = getattr(func, "__name__", None) or repr(func)
    hint = ""
    if func == _DATA_SET:
        what = ".data = ..."
        hint = (
            " (model.to(), .cuda() or .half() of an offloaded model cannot move or cast "
            "it: hetstore places the parameters, and compute_dtype sets their dtype)"
        )
    whose = "" if isinstance(tensor, Released) else "a value read from "
    subject = f"{what} on {whose}offloaded parameter {_name_of(tensor)!r}"
    return OffloadedParameterError(
        f"{subject} outside forward{hint}: between uses its unit has no device copy and "
        "hetstore's fp32 master is the source of truth, so a write here would change a "
        "copy and be lost. Write weights with model.load_state_dict(new_values, "
        "strict=False) (or hetstore.load_weights for a file): it writes the master and "
        "refreshes every copy; train them through hetstore's optimizer"
    )


def _serve(func, types, args, kwargs):
    """``func`` with every released parameter replaced by its value (see module doc)."""
    kwargs = kwargs or {}
    if func in _METADATA:
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func == _DATA_SET and args[1] is args[0]:  # p.data = p: model.to() of a no-op
        return None
    if func in _MAY_RETURN_SELF and isinstance(args[0], Released):
        with DisableTorchFunctionSubclass():
            if _returns_self(func, args[0], args[1:], kwargs):
                return args[0]
    for target in _written(func, args, kwargs):
        if isinstance(target, (Released, ReadOnlyValue)):
            raise _refuse_write(target, func)
    ours = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, (Released, ReadOnlyValue))]
    if func in _NO_BYTES:
        raise _refuse_bytes(ours[0], func)
    if func is torch.Tensor.__repr__ and isinstance(args[0], Released):
        refusal = getattr(args[0], _SOURCE).refusal
        if refusal is not None:  # a repr must not raise (debuggers, logs): describe it
            return _describe(args[0], refusal)
    shared: dict[int, LiveRead] = {}  # storage address -> the read it belongs to
    # with gradients on, a parameter that requires one is read as a tensor requiring one:
    # a result that then requires a gradient is a differentiable use, refused below
    tracked = torch.is_grad_enabled() or func is torch.Tensor.__repr__
    marked: list[str] = []

    def value_of(x):
        if isinstance(x, Released):
            source = getattr(x, _SOURCE)
            if func in _LIKE:
                return torch.empty(x.shape, dtype=x.dtype, device=x.device)
            value = source.read()
            shared[value.untyped_storage().data_ptr()] = LiveRead(source, value)
            if tracked and x.requires_grad:
                value.requires_grad_(True)  # (repr then prints "requires_grad=True")
                marked.append(source.entry.name)
            return value
        if isinstance(x, ReadOnlyValue):
            live = x._hetstore_live
            live.refresh()  # kept across a step: the parameter's value now
            with DisableTorchFunctionSubclass():
                shared[x.untyped_storage().data_ptr()] = live
                if func is torch.Tensor.__repr__:  # printed as plain PyTorch prints it
                    return x.as_subclass(torch.Tensor)
        return x

    args, kwargs = tree_map(value_of, (args, kwargs))
    with DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
        outputs = tree_flatten(result)[0]
        if marked and func is not torch.Tensor.__repr__:
            if any(isinstance(r, torch.Tensor) and r.requires_grad for r in outputs):
                raise _refuse_grad(marked[0], func)

        def guard(r):
            if ours and hasattr(r, "__array_interface__") and hasattr(r, "flags"):
                r.flags.writeable = False  # numpy() / __array__: a write would be lost
                return r
            if not isinstance(r, torch.Tensor) or isinstance(r, nn.Parameter):
                return r
            ptr = r.untyped_storage().data_ptr()
            if ptr == 0 or ptr not in shared:
                return r
            protected = r.as_subclass(ReadOnlyValue)
            protected._hetstore_live = shared[ptr]
            return protected

        return tree_map(guard, result)


def _name_of(x) -> str:
    return getattr(x, _SOURCE).entry.name if isinstance(x, Released) else x._hetstore_live.name


def _describe(param: torch.Tensor, refusal: str) -> str:
    shape = ", ".join(str(n) for n in param.shape)
    return (
        f"Parameter(shape=({shape}), dtype={param.dtype}, device={param.device}: "
        f"{_name_of(param)!r}, {refusal})"
    )


def _refuse_bytes(x, func) -> OffloadedParameterError:
    return OffloadedParameterError(
        f"{func.__name__}() of offloaded parameter {_name_of(x)!r} (or of a value read from "
        "it) outside forward: between uses it has no bytes of its own (they live in its "
        "unit's tier), and a read's are a temporary's, so an address, storage or DLPack "
        "capsule of it would mislead (two parameters could share one) or lose writes. "
        "Compare parameters by identity; take a copy first (p.detach().clone())"
    )


def _refuse_grad(name: str, func) -> OffloadedParameterError:
    return OffloadedParameterError(
        f"{getattr(func, '__name__', func)} uses offloaded parameter {name!r} outside its "
        "module's forward with gradients on: hetstore brings a unit's parameters in, and "
        "collects their gradients, around the forward of the module it offloads them with "
        "(a whole block, or the model for the rest), so a gradient through this use would "
        "be lost. Compute it inside that forward (a penalty on the weights inside the "
        "model's forward, an embedding lookup by passing input_ids), or read the value "
        "without a gradient: under torch.no_grad(), or from p.detach()"
    )


class Released:
    """Put in front of a managed parameter's class while its unit is released (see the
    module doc): :func:`conceal` and :func:`expose` switch it in and out."""

    def __new__(cls, data=None, requires_grad=True):
        # type(p)(...) -- Parameter.__deepcopy__ does it -- makes an ordinary Parameter
        return nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _serve(func, types, args, kwargs)

    def __reduce_ex__(self, protocol):
        # pickled (torch.save(p), deepcopy) as the ordinary Parameter it stands for
        value = getattr(self, _SOURCE).read()
        return nn.Parameter(value, self.requires_grad).__reduce_ex__(protocol)


class ReleasedParameter(Released, nn.Parameter):
    """``nn.Parameter`` while released (a model's own classes get a variant each)."""

    _hetstore_plain = nn.Parameter


class ReadOnlyValue(torch.Tensor):
    """A value read from a released parameter that shares memory with the read: refuses
    writes, which in plain PyTorch would have changed the parameter, and follows the
    parameter's changes (its :class:`LiveRead`)."""

    _hetstore_live: LiveRead

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _serve(func, types, args, kwargs)

    def __reduce_ex__(self, protocol):
        self._hetstore_live.refresh()
        with DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)
