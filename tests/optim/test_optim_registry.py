"""The flat-optimizer registry agrees with torch: the per-element states it names for a
family and its settings are those torch's own optimizer keeps after a step, so the
streamed disk step, the preallocation and the planner's state bytes cannot drift from
the installed torch."""

from __future__ import annotations

import pytest
import torch

from hetstore.optim.registry import flat_spec, flat_steppable, state_itemsize

CASES = [
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
]


@pytest.mark.parametrize("cls, settings", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_registry_names_the_states_torch_keeps(cls, settings):
    param = torch.zeros(4, requires_grad=True)
    param.grad = torch.ones(4)
    optimizer = cls([param], lr=0.1, **settings)
    optimizer.step()
    kept = optimizer.state[param]
    per_element = {k for k, v in kept.items() if isinstance(v, torch.Tensor) and v.shape == (4,)}
    spec = flat_spec(optimizer)
    assert set(spec.state_keys(optimizer.param_groups)) == per_element
    assert spec.has_step == ("step" in kept)
    assert state_itemsize(optimizer) == 4 * len(per_element)
    assert flat_steppable(optimizer)


def test_what_is_not_stepped_flat():
    param = torch.zeros(4, requires_grad=True)
    assert flat_spec(torch.optim.Adagrad([param])) is None
    assert not flat_steppable(torch.optim.Adagrad([param]))
    assert not flat_steppable(torch.optim.SGD([param], lr=0.1, differentiable=True))
    assert state_itemsize(torch.optim.Adagrad([param])) == 8  # assumed: two fp32 states
    assert state_itemsize(None) == 8  # no optimizer: planned as AdamW


def test_a_subclass_is_its_familys():
    class MyAdamW(torch.optim.AdamW):
        pass

    assert flat_spec(MyAdamW) is flat_spec(torch.optim.AdamW)
