"""The same behaviour on CUDA: parity, real memory freed, the budget held by the allocator.

Skipped without CUDA; run on a lent GPU (``pytest -m cuda``).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.host_step import HostStepReference
from tests.models.gpt import GPT, batches

pytestmark = pytest.mark.cuda
TIGHT = dict(rtol=1e-5, atol=1e-6)  # cuBLAS may pick different kernels run to run


def cuda_config(param="cpu", optim="cpu", **kwargs):
    return OffloadConfig(offload_param=param, offload_optimizer=optim, device="cuda", **kwargs)


# Against a model trained wholly on the GPU the optimizer's kernel differs (CPU against
# CUDA AdamW: measured on an H100 to differ by ~1 ulp per step), and Adam divides by
# sqrt(v), which magnifies such differences for elements whose gradient is near zero:
# after 4 steps at lr 1e-3 the largest weight difference measured was 6e-6. Bounded at
# 5e-5 here, 5% of one step's largest update (lr).
ALL_GPU = dict(rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize(
    "param, optim",
    [("cpu", "cpu"), ("none", "cpu"), ("cpu", "none"), ("disk", "disk"), ("disk", "cpu")],
)
def test_cuda_parity_with_plain_pytorch(tmp_path, param, optim):
    """Bitwise equal to plain PyTorch doing the same split (the optimizer where hetstore
    steps it), and within ALL_GPU of the model trained wholly on the GPU."""
    torch.manual_seed(0)
    gpu = GPT(width=64, depth=4).cuda()
    split = copy.deepcopy(gpu)
    mine = copy.deepcopy(gpu).cpu()
    gpu_opt = torch.optim.AdamW(gpu.parameters(), lr=1e-3, fused=True)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    # where hetstore steps: on the host for 'cpu'/'disk' optimizer states
    host_step = optim != "none"
    ref = HostStepReference(split, adamw) if host_step else None
    mine, opt = hetstore.offload(
        mine, adamw(mine.parameters()), cuda_config(param, optim, offload_path=str(tmp_path))
    )
    for x, y in batches(4):
        x, y = x.cuda(), y.cuda()
        gpu_loss = gpu(x, y)
        gpu_loss.backward()
        gpu_opt.step()
        gpu_opt.zero_grad()
        if ref is not None:
            ref_loss = split(x, y)
            ref_loss.backward()
            ref.step()
            ref.zero_grad()
        loss = mine(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            assert loss.item() == ref_loss.item()
        torch.testing.assert_close(loss.item(), gpu_loss.item(), **TIGHT)
    if optim == "cpu":  # both keys 'auto': on a GPU host units step in the next forward
        stats = opt.speculation_stats
        assert stats["started"] == 0, stats  # host units are never stepped in backward
        # fetched from host memory: every unit's step (4 blocks and the root) of the
        # first 3 steps lands in the next forward (the 4th at the state_dict() below);
        # kept on the GPU, none (there is no fetch to land them)
        assert stats["in_forward"] >= (5 * 3 if param == "cpu" else 0), stats
        assert stats["in_forward"] <= (5 * 4 if param == "cpu" else 0), stats
    for key, value in gpu.state_dict().items():
        got = mine.state_dict()[key].cuda()
        if ref is not None:
            assert torch.equal(got, split.state_dict()[key]), key
        else:
            torch.testing.assert_close(got, value, **TIGHT)
        torch.testing.assert_close(got, value, **ALL_GPU)


@pytest.mark.parametrize(
    "param, optim, staging, in_backward",
    [
        ("cpu", "cpu", True, False),
        # each block's host step in place on the worker during backward, once its
        # gradients' copies to the host have landed (the worker waits for their event)
        ("cpu", "cpu", True, True),
        ("disk", "disk", True, False),
        # the bf16 parameters kept on the GPU, refreshed from the host master after each
        # step through pinned staging (runtime.upload), or torch's copy_ where the host
        # budget has no room for the staging
        ("none", "cpu", True, False),
        ("none", "cpu", False, False),
    ],
)
def test_cuda_bf16_compute_matches_a_bf16_model_with_an_fp32_host_master(
    tmp_path, monkeypatch, param, optim, staging, in_backward
):
    """``compute_dtype="bf16"`` (what benchmarks/gpu/step_table.py's hetstore rows run):
    bf16 copies on the GPU, the fp32 master and AdamW on the host. Reference: a bf16
    model on the GPU whose gradients, in fp32, step an fp32 master on the host, copied
    back: the same arithmetic, so losses and weights bit for bit."""
    if not staging:
        from hetstore.errors import OutOfTierMemory
        from hetstore.tiers.host import HostTier

        allocate = HostTier.allocate

        def no_room_to_stage(self, nbytes, label, *args, **kwargs):
            if "upload staging" in label:
                raise OutOfTierMemory(
                    f"no room for {label}", tier="host", requested=nbytes, capacity=0
                )
            return allocate(self, nbytes, label, *args, **kwargs)

        monkeypatch.setattr(HostTier, "allocate", no_room_to_stage)
    torch.manual_seed(0)
    base = GPT(width=64, depth=4)
    master = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-3, fused=True)
    ref_model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    mine = copy.deepcopy(base)
    mine, opt = hetstore.offload(
        mine,
        torch.optim.AdamW(mine.parameters(), lr=1e-3, fused=True),
        cuda_config(
            param,
            optim,
            offload_path=str(tmp_path),
            compute_dtype="bf16",
            step_in_backward=in_backward,
        ),
    )
    for x, y in batches(4):
        x, y = x.cuda(), y.cuda()
        ref_loss = ref_model(x, y)
        ref_loss.backward()
        for p_master, p_bf16 in zip(master.parameters(), ref_model.parameters(), strict=True):
            p_master.grad = p_bf16.grad.float().cpu()
            p_bf16.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p_master, p_bf16 in zip(master.parameters(), ref_model.parameters(), strict=True):
                p_bf16.copy_(p_master.to("cuda", torch.bfloat16))
        loss = mine(x, y)
        assert loss.dtype == torch.bfloat16
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == ref_loss.item()
    for key, value in master.state_dict().items():
        assert torch.equal(mine.state_dict()[key].cpu(), value), key
    if in_backward:  # (every block, each step: the root's in optimizer.step())
        blocks = len(hetstore.state_of(mine).runtime.units) - 1
        assert opt.speculation_stats["committed"] == 4 * blocks


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_cuda_accumulation_and_clipping_match_the_host_step(tmp_path, placement):
    """Four micro-batches per step, clipped at a norm that bites, the gradients crossing
    to the host while backward goes on: bitwise equal to plain PyTorch stepping on the
    host (the micro-batches summed on the GPU there, on the host here: an fp32 add is the
    same on both)."""
    torch.manual_seed(0)
    ref_model = GPT(width=64, depth=4).cuda()
    mine = copy.deepcopy(ref_model).cpu()

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)

    ref = HostStepReference(ref_model, adamw)
    mine, opt = hetstore.offload(
        mine,
        adamw(mine.parameters()),
        cuda_config(placement, placement, offload_path=str(tmp_path)),
    )
    data = batches(12)
    for step in range(3):
        for x, y in data[step * 4 : step * 4 + 4]:
            x, y = x.cuda(), y.cuda()
            (ref_model(x, y) / 4).backward()
            (mine(x, y) / 4).backward()
        want = ref.step(clip=0.05)
        if placement == "disk":  # no tensor can stand for a gradient on disk
            got = opt.clip_grad_norm_(0.05)
        else:
            got = torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.05)
        assert want > 0.05, "the clip must bite for this test to mean anything"
        assert float(got) == float(want)
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    for key, value in ref_model.state_dict().items():
        assert torch.equal(mine.state_dict()[key].cuda(), value), key


def released_bytes_settled() -> int:
    """``memory_allocated`` once the caching allocator has taken back the blocks whose
    last use on a side stream is done (it does so at its next allocation)."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    return torch.cuda.memory_allocated()


def test_cuda_released_units_free_device_memory():
    torch.manual_seed(0)
    model = GPT(width=256, depth=4)
    model, opt = hetstore.offload(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), cuda_config()
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x, y = (t.cuda() for t in batches(1)[0])
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    # after the step no unit is materialized: far less than the parameters stays allocated
    assert released_bytes_settled() - before < params_bytes / 4
    assert hetstore.memory_stats(model)["device"]["current"] == 0


def test_cuda_budget_enforced_by_allocator_until_release():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    model = GPT(width=64, depth=2)
    hetstore.offload(model, None, cuda_config(max_device_memory="64MB"))
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(64 * 2**20 / total)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    hetstore.release(model)
    # the fraction is process-wide: releasing the model gives it back
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(before, abs=1e-9)
    torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # fits again


def test_cuda_host_blocks_are_unregistered_before_their_pages_go():
    """A registration left on unmapped pages made the next mapping there fail to pin
    and copies from it fail ('resource already mapped'), in the same process."""
    import gc
    import warnings

    from hetstore.tiers.host import PinnedMemoryWarning
    from hetstore.tiers.hostmem import MappedBlock, _cuda_call

    block = MappedBlock(8 * 2**20)
    block.register_cuda()
    locks, view = block.page_locks, block.tensor[4096:]
    del block
    gc.collect()
    assert locks.cuda_registered  # a view still uses the pages
    del view
    gc.collect()
    assert not locks.cuda_registered  # unregistered by the last view's finalizer
    # a failed CUDA call is reported as such and not left for torch's next kernel
    never = MappedBlock(4096)
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        _cuda_call("cudaHostUnregister", never.address)
    assert (torch.ones(4, device="cuda") + 1).sum().item() == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        for _ in range(3):  # models made and dropped in turn, each pinning its blocks
            torch.manual_seed(0)
            model, opt = hetstore.offload(
                GPT(width=64, depth=2),
                None,
                cuda_config(),
            )
            x, y = (t.cuda() for t in batches(1)[0])
            model(x, y).backward()
            assert hetstore.state_of(model).tiers.host.pinned
            del model, opt
            gc.collect()


@pytest.mark.parametrize("acts", ["cpu", "disk"])
def test_cuda_activation_offload_parity_and_freed_memory(tmp_path, acts):
    """Saved activations leave the device during forward (the allocator shows it) and
    come back for backward with the same result as plain PyTorch."""
    torch.manual_seed(0)
    ref = GPT(width=128, depth=4).cuda()
    mine = copy.deepcopy(ref)
    x, y = next(iter(batches(1, batch=32)))
    x, y = x.cuda(), y.cuda()

    def after_forward(model):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(x, y)
        torch.cuda.synchronize()
        return loss, torch.cuda.memory_allocated() - before

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_loss, kept = after_forward(ref)
    ref_loss.backward()
    ref_opt.step()
    mine, opt = hetstore.offload(
        mine,
        torch.optim.AdamW(mine.parameters(), lr=1e-3),
        cuda_config(
            "none",
            "none",
            offload_activations=acts,
            offload_path=str(tmp_path),
            activation_min_bytes=0,
        ),
    )
    loss, left = after_forward(mine)
    packed = hetstore.state_of(mine).runtime.activations.packed_bytes
    assert packed > kept / 2
    assert left < kept - packed * 0.8, (left, kept, packed)  # freed, not just copied
    loss.backward()
    opt.step()
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(mine.state_dict()[key].cuda(), value, **TIGHT)


@pytest.mark.parametrize("placement", ["cpu", "disk"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip-bites"])
def test_cuda_steps_in_the_next_forward_match_the_ordinary_step(tmp_path, clip, placement):
    """``step_in_forward`` on CUDA: the steps run during the next forward and train bit
    for bit like the ordinary step. Everything on disk: their new parameters handed to
    the fetch, the first units' states read during backward when the clip bites. In
    host memory: the ordinary step in place, waited for at each unit's fetch."""
    data = batches(4)
    runs = []
    for in_forward in (True, False):
        torch.manual_seed(0)
        model = GPT(width=64, depth=4)
        model, opt = hetstore.offload(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
            cuda_config(
                placement,
                placement,
                offload_path=str(tmp_path / str(in_forward)),
                step_in_forward=in_forward,
            ),
        )
        losses = []
        for x, y in data:
            loss = model(x.cuda(), y.cuda())
            loss.backward()
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((model, opt, losses))
    (on, on_opt, on_losses), (off, _, off_losses) = runs
    assert on_losses == off_losses
    for key, value in off.state_dict().items():
        assert torch.equal(on.state_dict()[key], value), key
    stats = on_opt.speculation_stats
    # on a GPU the steps overlap backward where they can ('auto'); what is not committed
    # there runs in the next forward
    assert stats["in_forward"] + stats["committed"] == 5 * len(data), stats  # 4 blocks, root
    if clip is not None and placement == "disk":  # the next backwards' steps held back
        assert stats["in_forward"] >= 5 * (len(data) - 1), stats
        assert stats["read_ahead"] > 0, stats
    if placement == "cpu":  # the root's step is never taken in backward
        assert stats["in_forward"] >= len(data), stats


def _live_cuda_tensors(most: int = 5) -> str:
    """What still holds CUDA memory, for a failure's message: the largest live CUDA
    tensors and what refers to each (two levels of referrers' types)."""
    held = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    held.sort(key=lambda t: t.nelement() * t.element_size(), reverse=True)
    lines = []
    for t in held[:most]:
        owners = [
            f"{type(r).__name__}<-{[type(rr).__name__ for rr in gc.get_referrers(r)][:4]}"
            for r in gc.get_referrers(t)
            if r is not held
        ]
        lines.append(f"{tuple(t.shape)} {t.dtype}: {owners[:4]}")
    return f"{len(held)} live CUDA tensors; largest: " + "; ".join(lines)


@pytest.mark.parametrize("param, optim", [("none", "none"), ("none", "cpu"), ("cpu", "cpu")])
def test_cuda_evict_gives_back_every_byte_and_restore_trains_bitwise(tmp_path, param, optim):
    """After evict the allocator holds what it held before offload() (every byte hetstore
    put on the GPU is gone, the cached blocks too); with a cycle after every step the
    losses and weights are bitwise those of the run without."""
    results = []
    for cycles in (False, True):
        gc.collect()  # (the last round's model is gone: release() must have freed it)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = GPT(width=64, depth=4)
        model.register_buffer("scale", torch.ones(64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        model, opt = hetstore.offload(model, opt, cuda_config(param, optim))
        losses = []
        for x, y in batches(4):
            loss = model(x.cuda(), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            del loss
            if cycles:
                report = hetstore.evict(model, opt)
                torch.cuda.synchronize()
                assert hetstore.memory_stats(model)["device"]["current"] == 0
                assert torch.cuda.memory_allocated() == baseline, report
                hetstore.restore(model, opt)
        results.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}))
        hetstore.release(model)
        torch.cuda.synchronize()
        # release() gives back every byte at once, before the model is collected: what
        # is left is the model's own buffers (the allocator's 512-byte blocks)
        buffers = sum(-(-b.nbytes // 512) * 512 for b in model.buffers() if b.is_cuda)
        assert torch.cuda.memory_allocated() == baseline + buffers, _live_cuda_tensors()
        del model, opt
    (plain_losses, plain), (losses, weights) = results
    assert losses == plain_losses
    for key, value in weights.items():
        assert torch.equal(value, plain[key]), key
