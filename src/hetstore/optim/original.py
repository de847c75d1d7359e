"""The optimizer the user made stays valid after ``offload()``.

Scripts build the optimizer and its scheduler first and wrap afterwards (as
``accelerator.prepare(model, optimizer, scheduler)`` does), and callbacks, loggers and a
second scheduler keep the optimizer they were given. So the optimizer ``offload()``
returns shares the original's ``param_groups`` list and ``defaults`` (the same dicts:
an lr set through either is the one the step uses), and the original's torch-facing
methods are pointed at it: ``step`` (closure included), ``zero_grad``, ``state_dict``,
``load_state_dict`` and ``add_param_group``; the two share their step hooks.

The redirects are bound methods on the instance, the way torch's own LR schedulers wrap
``optimizer.step``; a scheduler made before ``offload()`` keeps its marker
(``_wrapped_by_lr_sched``) and sees ``_opt_called`` set by either optimizer's step, so it
neither warns nor stops scheduling. They hold the offloaded optimizer: a caller keeping
only the original (``_, opt = hetstore.offload(...)`` never used) trains with it for as
long as it keeps it, whatever else holds the offloaded one (held weakly, it had been
collected at a moment that depended on the placement).
"""

from __future__ import annotations

import types

from torch.optim import Optimizer

__all__ = ["redirect_original"]

# the torch-facing methods a caller of the original optimizer may still use
_REDIRECTED = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


class _Redirect:
    """``original.<name>(...)`` -> ``offloaded.<name>(...)`` (a callable bound to the
    original with ``types.MethodType``, so torch's scheduler can re-wrap it)."""

    def __init__(self, offloaded: Optimizer, name: str):
        self._offloaded = offloaded
        self._name = name

    def __call__(self, original: Optimizer, *args, **kwargs):
        # (the offloaded step sets the original's _opt_called, which torch's LR
        # scheduler checks, whichever of the two was stepped)
        return getattr(self._offloaded, self._name)(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        return types.MethodType(self, obj)


def redirect_original(original: Optimizer, offloaded: Optimizer) -> None:
    """Make ``original`` a view of ``offloaded`` (see the module doc): call once, after
    ``offloaded`` took over ``original.param_groups``."""
    # step hooks registered on either (register_step_pre_hook / _post_hook, before or
    # after offload()) run around the step that is taken: the returned optimizer's
    offloaded._optimizer_step_pre_hooks = original._optimizer_step_pre_hooks
    offloaded._optimizer_step_post_hooks = original._optimizer_step_post_hooks
    scheduled = getattr(original.step, "_wrapped_by_lr_sched", False)
    for name in _REDIRECTED:
        setattr(original, name, types.MethodType(_Redirect(offloaded, name), original))
    if scheduled:  # a scheduler made before offload() wrapped step: keep its marker
        original.step.__func__._wrapped_by_lr_sched = True
