"""``enable_pinned_mem``: 'auto' by default, silent on a CPU device; the warnings that
remain point at the user's line, not at hetstore's internals (issue 49: every CPU run
with the defaults printed a PinnedMemoryWarning attributed to api.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hetstore
from hetstore import ConfigError, OffloadConfig
from hetstore.tiers import PinnedMemoryWarning
from hetstore.tiers.host import HostTier
from hetstore.tiers.hostmem import MappedBlock


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _config(tmp_path, **kw) -> OffloadConfig:
    return OffloadConfig(
        offload_param="cpu", offload_optimizer="cpu", offload_path=str(tmp_path), device="cpu", **kw
    )


def _pinned_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, PinnedMemoryWarning)]


def test_the_default_is_auto_and_a_cpu_run_is_silent(tmp_path):
    assert OffloadConfig().enable_pinned_mem == "auto"
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        model, opt = hetstore.offload(
            model, torch.optim.AdamW(model.parameters()), _config(tmp_path)
        )
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    hetstore.release(model)


def test_asking_for_pinning_on_a_cpu_warns_at_the_users_line(tmp_path):
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = hetstore.offload(
            model, torch.optim.AdamW(model.parameters()), _config(tmp_path, enable_pinned_mem=True)
        )
    found = _pinned_warnings(caught)
    assert len(found) == 1 and "compute device is 'cpu'" in str(found[0].message)
    assert found[0].filename == __file__, found[0].filename
    hetstore.release(model)


def test_a_failed_registration_warns_once_at_the_users_line(monkeypatch):
    """Pinning asked for on a CUDA device and refused (the memlock limit): one warning,
    pageable blocks from then on, reported where the user's call made the tier grow."""

    def refuse(self):
        raise RuntimeError("cudaHostRegister: out of memory (the memlock limit)")

    monkeypatch.setattr(MappedBlock, "register_cuda", refuse)
    tier = HostTier(capacity=None, block_size=1 << 20, pin="auto", device=torch.device("cuda"))
    assert tier.pinned  # until a registration fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffer = tier.allocate(4096, "test")
        tier.allocate(2 << 20, "a second block: no second warning")
    found = _pinned_warnings(caught)
    assert len(found) == 1 and "could not pin" in str(found[0].message)
    assert found[0].filename == __file__, found[0].filename
    assert not tier.pinned
    buffer.tensor.fill_(1)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_other_values_are_refused(bad):
    with pytest.raises(ConfigError, match="enable_pinned_mem"):
        OffloadConfig(enable_pinned_mem=bad)
