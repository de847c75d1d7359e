import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # (The peak-RSS probes used to run first: after ~200 other tests a probe measured
    # 1.03-1.31 GiB instead of 0.8. The cause: ru_maxrss, which Linux carries over fork
    # and exec, so a probe started by pytest reported pytest's size. The probes read
    # VmHWM now, hetstore.peak_rss.)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
