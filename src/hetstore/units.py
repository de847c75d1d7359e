"""Grouping a model's parameters into units (chunks moved together).

Default: every child of a container (``nn.ModuleList`` / ``nn.Sequential``) whose
children are all one class and at least two -- transformer layers, ResNet blocks -- is a
unit; every other parameter belongs to one more unit, the *root*, which is present for
the whole step. A parameter shared between units (tied weights) goes to the root, so it
is present whenever any of its users runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = ["UnitSpec", "find_units"]


@dataclass
class UnitSpec:
    """Which parameters one unit owns. ``module`` is None for the root unit."""

    name: str
    module: nn.Module | None
    # (owning module, attribute name, qualified name) for each distinct parameter
    params: list[tuple[nn.Module, str, str]] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.module is None


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in claimed or not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if not any(p.numel() for _, c in children for p in c.parameters()):
            continue
        # skip containers nested inside an already chosen block
        if any(name.startswith(b + ".") for b, _ in blocks):
            continue
        for child_name, child in children:
            blocks.append((f"{name}.{child_name}" if name else child_name, child))
            claimed.update(id(m) for m in child.modules())
    return blocks


def find_units(model: nn.Module, units: Sequence[nn.Module] | None = None) -> list[UnitSpec]:
    """Return the units of ``model``: the block units in module order, then the root.

    ``units`` overrides the default with the user's own list of modules.
    """
    names = {id(m): n for n, m in model.named_modules()}
    if units is not None:
        chosen = []
        for module in units:
            if id(module) not in names:
                raise ValueError(
                    f"units=: {type(module).__name__} is not a submodule of the model passed "
                    "to hetstore.offload"
                )
            chosen.append((names[id(module)], module))
    else:
        chosen = _repeated_blocks(model)

    owner_of: dict[int, int] = {}  # parameter id -> unit index
    specs = [UnitSpec(name, module) for name, module in chosen]
    root = UnitSpec("root", None)
    shared: set[int] = set()
    for index, spec in enumerate(specs):
        for param in spec.module.parameters():
            previous = owner_of.setdefault(id(param), index)
            if previous != index:
                shared.add(id(param))

    seen: set[int] = set()
    for qualified, module, attr, param in _named_parameter_slots(model):
        if id(param) in seen:
            continue  # tied: one slot owns it, the others alias it (see Unit.aliases)
        seen.add(id(param))
        index = owner_of.get(id(param))
        target = root if index is None or id(param) in shared else specs[index]
        target.params.append((module, attr, qualified))
    result = [s for s in specs if s.params]
    if root.params:
        result.append(root)
    return result


def _named_parameter_slots(model: nn.Module):
    """Every (qualified name, module, attribute, parameter), tied ones included, in order."""
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            qualified = f"{mod_name}.{attr}" if mod_name else attr
            yield qualified, module, attr, param
