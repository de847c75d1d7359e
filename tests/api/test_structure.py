"""Issue 46's structure counts (tools/structure.py): no hetstore module reaches into
another module's private names."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _structure_tool():
    """tools/structure.py, loaded by path (tools/ is not a package)."""
    path = next(
        p / "tools" / "structure.py"
        for p in Path(__file__).resolve().parents
        if (p / "tools" / "structure.py").is_file()
    )
    spec = importlib.util.spec_from_file_location("hetstore_tools_structure", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_cross_module_private_reaches():
    counts = _structure_tool().counts()
    assert counts["modules"] > 0  # the tool found hetstore's source
    assert counts["private_reaches"] == []


def test_no_dispatch_on_the_disk_tiers_type_outside_the_tiers():
    """Code outside hetstore.tiers asks a buffer what it can do (tiers.store.addressable),
    never whether it is a DiskArray: a new tier of either kind needs no change there."""
    assert _structure_tool().counts()["disk_dispatch"] == []
