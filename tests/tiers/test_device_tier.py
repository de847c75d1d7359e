"""Device accounting and the OutOfDeviceMemory report."""

import pytest
import torch

import hetstore
from hetstore import OffloadConfig, OutOfDeviceMemory
from hetstore.tiers import Tiers

MiB = 2**20


def cpu_tiers(**kwargs):
    defaults = dict(max_device_memory="1MB", offload_cpu_size="16MB", enable_pinned_mem=False)
    return Tiers(OffloadConfig(**{**defaults, **kwargs}), device=torch.device("cpu"))


def test_device_budget_accounting():
    tiers = cpu_tiers()
    a = tiers.device_tier.empty(1000, torch.float32, "params unit 0")
    stats = hetstore.memory_stats(tiers)
    assert stats["device"] == {"current": 4000, "peak": 4000, "capacity": MiB}
    tiers.device_tier.free(a, "params unit 0")
    assert a.untyped_storage().nbytes() == 0  # really freed
    stats = hetstore.memory_stats(tiers)
    assert stats["device"]["current"] == 0 and stats["device"]["peak"] == 4000
    assert set(stats) == {"device", "host", "disk"}
    for tier in stats.values():
        assert set(tier) == {"current", "peak", "capacity"}


def test_out_of_device_memory_message():
    tiers = cpu_tiers()
    tiers.device_tier.empty(200_000, torch.float32, "params unit 0")
    tiers.host.allocate(2 * MiB, "optimizer states unit 0")
    with pytest.raises(OutOfDeviceMemory) as info:
        tiers.device_tier.empty(100_000, torch.float32, "grads unit 1")
    err = info.value
    message = str(err)
    assert isinstance(err, torch.OutOfMemoryError) and err.tier == "device"
    assert err.requested == 400_000 and err.capacity == MiB
    assert "requested 390.62 KiB for 'grads unit 1'" in message  # the request
    assert "capacity 1.00 MiB (max_device_memory)" in message  # capacity and its key
    assert "in use 781.25 KiB" in message and "peak 781.25 KiB" in message
    assert "host: capacity 16.00 MiB" in message and "in use 2.00 MiB" in message  # other tiers
    assert "disk:" in message
    assert "largest holders on device: params unit 0" in message
    assert "max_device_memory >= 1.14 MiB" in message  # what would fit
    # nothing was counted for the refused request
    assert hetstore.memory_stats(tiers)["device"]["current"] == 800_000


def test_advice_callback_lines_are_included():
    def advice(tier, nbytes):
        return [f"  try offload_param='cpu' (frees 3 MiB on {tier})"]

    tiers = Tiers(
        OffloadConfig(max_device_memory="1MB", enable_pinned_mem=False),
        device=torch.device("cpu"),
        advice=advice,
    )
    with pytest.raises(OutOfDeviceMemory, match="try offload_param='cpu'"):
        tiers.device_tier.empty(1_000_000, torch.float32, "x")


def test_release_more_than_held_is_a_bug_not_silent():
    tiers = cpu_tiers()
    tiers.device_tier.reserve(10, "a")
    with pytest.raises(ValueError, match="holds 10"):
        tiers.device_tier.release(11, "a")


def test_unlimited_device_on_cpu():
    tiers = Tiers(OffloadConfig(enable_pinned_mem=False), device=torch.device("cpu"))
    tiers.device_tier.empty(10, torch.float32, "x")
    assert hetstore.memory_stats(tiers)["device"]["capacity"] is None


@pytest.mark.cuda
def test_cuda_budget_sets_memory_fraction():
    tiers = Tiers(OffloadConfig(max_device_memory="1GB"), device=torch.device("cuda"))
    assert tiers.device_tier.capacity == 2**30
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
