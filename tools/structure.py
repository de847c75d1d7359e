"""Structure counts of hetstore's source, the figures issue 46 asks for.

    python tools/structure.py            # the counts
    python tools/structure.py --list     # and every site behind them

- *private reaches*: a name starting with one underscore that belongs to another module,
  read from outside it: ``from a.b import _x``, an import of a private module
  (``a._b``) from outside its package, or ``obj._attr`` where ``obj`` is not
  ``self``/``cls`` and ``_attr`` is not defined in the same module (a module may use the
  private names of its own classes on other instances of them).
- *type dispatch on disk*: ``isinstance(..., DiskArray)`` outside ``hetstore/tiers``.
- *planner sites naming a tier*: in ``hetstore/planner``, a tier other than the device
  named by hand: ``Tier.HOST`` / ``Tier.DISK``, or an attribute named after one
  (``.host``, ``.disk_read``, ``e.host_read_ahead``), where the planner does not walk
  ``Tier`` or ask a tier's property (``tier.py``'s tables).
- *largest classes*: lines from ``class`` to the class's last line.
- *private reads in tests*: the same reaches from ``tests/``: ``obj._attr`` where
  ``_attr`` is a private name hetstore defines (not torch's, not the test module's own)
  and ``from hetstore... import _name``. Importing a private *module* (``hetstore._sizes``)
  is allowed there.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "hetstore"
TESTS = SRC.parent.parent / "tests"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _own_names(tree: ast.AST) -> set[str]:
    """Every private name a module defines: attributes set or declared, functions,
    classes, globals."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if _private(n)}


def private_reaches(path: Path, ours: set[str]) -> list[str]:
    """``ours``: the private names hetstore's modules define (a reach into torch's
    ``module._parameters`` is torch's business, not a reach between our modules)."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = _package_of(module, path)
    own = _own_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(SRC.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            target = node.module
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module])
            if not target.startswith("hetstore"):
                continue
            # a private module is its package's: usable anywhere below that package
            parts = target.split(".")
            first = next((i for i, p in enumerate(parts) if _private(p)), None)
            owner_pkg = None if first is None else ".".join(parts[:first])
            if owner_pkg is not None and not (
                module == owner_pkg or module.startswith(owner_pkg + ".")
            ):
                found.append(f"{where} import from private module {target}")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where} import {target}.{alias.name}")
        elif _reaches(node, own, ours):
            found.append(f"{where} .{node.attr}")
    return found


def _reaches(node: ast.AST, own: set[str], ours: set[str]) -> bool:
    """``obj._attr`` where ``_attr`` is a private name of another hetstore module (not
    ``self``'s or ``cls``'s, not one the reading module defines itself)."""
    if not isinstance(node, ast.Attribute) or not _private(node.attr):
        return False
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return False
    return node.attr not in own and node.attr in ours


def _is_module(dotted: str) -> bool:
    """Whether ``hetstore.a.b`` names a module or package of hetstore's source."""
    path = SRC.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_private_reads(path: Path, ours: set[str]) -> list[str]:
    """The private names of hetstore a test module reads (see the module docstring)."""
    tree = ast.parse(path.read_text())
    own = _own_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(TESTS.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetstore"):
            for alias in node.names:
                if _private(alias.name) and not _is_module(f"{node.module}.{alias.name}"):
                    found.append(f"{where} import {node.module}.{alias.name}")
        elif _reaches(node, own, ours):
            found.append(f"{where} .{node.attr}")
    return sorted(found, key=lambda r: (r.split(":")[0], int(r.split(":")[1].split()[0])))


def disk_dispatch(path: Path) -> list[str]:
    if "tiers" in path.relative_to(SRC).parts[:1]:
        return []
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and "DiskArray" in ast.unparse(node.args[1])
        ):
            found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    return found


def planner_tier_names(path: Path) -> list[str]:
    if "planner" not in path.relative_to(SRC).parts[:1]:
        return []
    sys.path.insert(0, str(SRC.parent))
    from hetstore.tier import Tier

    members = {t.name for t in Tier if t is not Tier.DEVICE}
    labels = {t.label for t in Tier if t is not Tier.DEVICE}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        by_member = isinstance(node.value, ast.Name) and node.value.id == "Tier"
        if (by_member and node.attr in members) or (
            not by_member and node.attr.split("_")[0] in labels and node.attr not in _NOT_TIERS
        ):
            found.append(
                (node.lineno, f"{path.relative_to(SRC.parent)}:{node.lineno} {ast.unparse(node)}")
            )
    return [site for _, site in sorted(found)]


# names that start like a tier's and are not one: the CPU's own rates (it steps and
# copies buffers of any tier), and the standard library's free-space call
_NOT_TIERS = {"host_step", "host_copy", "disk_usage"}


def classes(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.end_lineno - node.lineno + 1, f"{path.relative_to(SRC.parent)}:{node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def counts() -> dict:
    files = sorted(SRC.rglob("*.py"))
    import torch  # names torch's own classes carry (nn.Module._buffers) are not ours

    theirs = {n for n in dir(torch.nn.Module()) + dir(torch.Tensor) if _private(n)}
    ours = set().union(*(_own_names(ast.parse(f.read_text())) for f in files)) - theirs
    reaches = [r for f in files for r in private_reaches(f, ours)]
    dispatch = [d for f in files for d in disk_dispatch(f)]
    tier_names = [n for f in files for n in planner_tier_names(f)]
    sized = sorted((c for f in files for c in classes(f)), reverse=True)
    lines = sum(len(f.read_text().splitlines()) for f in files)
    tests = sorted(TESTS.rglob("*.py")) if TESTS.is_dir() else []
    test_reads = [r for f in tests for r in test_private_reads(f, ours)]
    return {
        "modules": len(files),
        "lines": lines,
        "private_reaches": reaches,
        "disk_dispatch": dispatch,
        "planner_tier_names": tier_names,
        "largest_classes": sized[:8],
        "test_private_reads": test_reads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every site")
    args = parser.parse_args(argv)
    c = counts()
    print(f"modules {c['modules']}, lines {c['lines']}")
    print(f"cross-module private reaches: {len(c['private_reaches'])}")
    if args.list:
        for r in c["private_reaches"]:
            print("   ", r)
    print(f"isinstance(..., DiskArray) outside tiers/: {len(c['disk_dispatch'])}")
    if args.list:
        for d in c["disk_dispatch"]:
            print("   ", d)
    print(f"planner sites naming a tier other than the device: {len(c['planner_tier_names'])}")
    if args.list:
        for n in c["planner_tier_names"]:
            print("   ", n)
    print(f"private reads in tests: {len(c['test_private_reads'])}")
    if args.list:
        for r in c["test_private_reads"]:
            print("   ", r)
    print("largest classes:")
    for n, name in c["largest_classes"]:
        print(f"    {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
