import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # The peak-RSS probes run first. Why: after ~200 other tests the same probe
    # subprocess measured 1.03-1.31 GiB peak RSS instead of 0.8 (reproducible in a fresh
    # clone, cause not found yet; it is not environment variables or imports). See the
    # issue 6 note; until found, measure on a quiet machine.
    items.sort(
        key=lambda item: 0 if item.path.name in ("test_rss.py", "test_rss_budgets.py") else 1
    )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
