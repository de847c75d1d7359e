"""On a CPU device a unit whose home is in host memory is fetched in place: the
parameters are pointed at views of the home, not copied into a fresh device buffer
(``Unit.fetches_in_place``). An accelerator takes the copying path, which is forced here
(``copied``) so both stay tested on CPU. Disk homes are copied out of their staging
buffer either way.

Shown: fetched parameters are views of the home and released ones hold no bytes;
training is bitwise plain PyTorch's either way, host and disk placements (same kernels
on the same fp32 values: only where forward reads the weights from changes); the device
budget is charged the same, so plans and budgets do not depend on the path; a master
replaced while fetched (a step committed by swap) is what the parameters then show.
"""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore.runtime.unit import Residency, Unit
from hetstore.tier import Tier
from tests.models.gpt import GPT, batches
from tests.parity import adamw, assert_same_weights, config, pair, run, states_bytes


def gpt():
    return GPT(vocab=64, width=32, depth=3, heads=4, ctx=16)


@pytest.fixture
def copied(monkeypatch):
    """Fetch by copying, as on an accelerator."""
    monkeypatch.setattr(Unit, "fetches_in_place", property(lambda self: False))


def host_units(model):
    return [u for u in hetstore.state_of(model).units if u.placement.param is Tier.HOST]


def test_fetched_parameters_are_views_of_the_home_and_released_ones_have_no_bytes():
    torch.manual_seed(0)
    model = gpt()
    model, optimizer = hetstore.offload(model, adamw(model.parameters()), config("cpu", "cpu"))
    units = host_units(model)
    assert units and all(u.fetches_in_place for u in units)
    seen = []

    def record(unit):
        def hook(module, args):
            home = unit.home
            start, end = home.data_ptr(), home.data_ptr() + home.nbytes
            seen.append(
                unit.residency is Residency.IN_PLACE
                and all(start <= e.param.data_ptr() < end for e in unit.entries)
            )

        return hook

    block = model.blocks[1]
    unit = next(u for u in units if u.name == "blocks.1")
    handle = block.register_forward_pre_hook(record(unit))
    # a pre-hook registered after hetstore's runs after its fetch
    x, y = batches(1, vocab=64, batch=2, ctx=16)[0]
    model(x, y).backward()
    handle.remove()
    assert seen == [True]
    optimizer.step()
    for u in units:
        assert u.residency is Residency.RELEASED
        assert u.device_flat.untyped_storage().nbytes() == 0
        # released: reads are served from home, the bytes are not the parameters' own
        entry = u.entries[0]
        assert hetstore.runtime.released.is_released(entry.param)
        torch.testing.assert_close(
            entry.param.detach().reshape(-1),
            u.home[entry.offset : entry.offset + entry.numel],
            rtol=0,
            atol=0,
        )


def _train(steps: int, tier: str = "cpu", path=None):
    torch.manual_seed(0)
    data = batches(steps * 2, vocab=64, batch=2, ctx=16)
    ref, mine = pair(gpt)
    ref_opt = adamw(ref.parameters())
    # half the model states: the device holds the running unit, not the model
    disk = {} if path is None else {"offload_path": str(path)}
    cfg = config(tier, tier, max_device_memory=states_bytes(mine) // 2, **disk)
    mine, mine_opt = hetstore.offload(mine, adamw(mine.parameters()), cfg)
    ref_losses, ref_norms = run(ref, ref_opt, data, accumulate=2, clip=0.5)
    losses, norms = run(mine, mine_opt, data, accumulate=2, clip=0.5)
    assert losses == ref_losses
    assert norms == ref_norms
    assert_same_weights(ref, mine, rtol=0, atol=0)
    return hetstore.memory_stats(mine)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("fetch", ["in place", "copied"])
def test_both_paths_train_bitwise_like_plain_pytorch(fetch, tier, request, tmp_path):
    if fetch == "copied":
        request.getfixturevalue("copied")
    _train(steps=3, tier=tier, path=tmp_path)


def test_the_device_budget_is_charged_the_same_in_place_as_copied(request):
    in_place = _train(steps=2)
    request.getfixturevalue("copied")
    copied = _train(steps=2)
    assert in_place["device"]["peak"] == copied["device"]["peak"]
    assert 0 < in_place["device"]["peak"] <= in_place["device"]["capacity"]
