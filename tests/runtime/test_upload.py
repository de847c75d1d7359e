"""runtime.upload: a host-to-device cast copy through pinned staging gives bitwise what
``copy_`` gives (the same round-to-nearest-even cast), however the values split into
chunks. Its chunking runs on the CPU too (a CPU destination copies synchronously)."""

import pytest
import torch

from hetstore.runtime import upload

CHUNK = upload.CHUNK_ELEMENTS


@pytest.mark.parametrize(
    "numel",
    [0, 1, 1000, CHUNK, CHUNK + 3, 2 * CHUNK, 2 * CHUNK + 12345, 3 * CHUNK + 1],
    ids=lambda n: f"{n}",
)
def test_every_chunking_gives_the_cast_copy_bitwise(numel):
    gen = torch.Generator().manual_seed(numel)
    src = torch.randn(numel, generator=gen) * 1e3  # many values that round in bf16
    dst = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
    staging = torch.empty(upload.staging_numel(numel), dtype=torch.bfloat16)
    assert staging.numel() <= 2 * CHUNK  # bounded, whatever the unit's size
    upload.upload_cast(dst, src, staging)
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))


def test_only_a_cast_from_host_onto_cuda_is_staged():
    host32, host16 = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    assert not upload.needs_staging(host16, host32)  # host to host: one cast, no copy
    meta16 = torch.zeros(4, dtype=torch.bfloat16, device="meta")
    assert not upload.needs_staging(meta16, host32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pinned_master_lands_on_the_device_as_copy_gives_it():
    numel = 2 * CHUNK + 777
    src = (torch.randn(numel) * 1e3).pin_memory()
    assert upload.needs_staging(torch.empty(1, dtype=torch.bfloat16, device="cuda"), src)
    dst = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    staging = torch.empty(upload.staging_numel(numel), dtype=torch.bfloat16).pin_memory()
    upload.upload_cast(dst, src, staging)
    expected = torch.empty_like(dst)
    expected.copy_(src)  # torch's own (slow) path
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_step_worker_thread_never_stages():
    """The staging comes from the host tier, which only the caller's thread allocates
    from: on the optimizer's worker thread (optim.step_worker marks it) a copy takes
    torch's way."""
    from concurrent.futures import ThreadPoolExecutor

    src = torch.randn(16).pin_memory()
    dst = torch.empty(16, dtype=torch.bfloat16, device="cuda")
    assert upload.needs_staging(dst, src)
    assert not upload.needs_staging(dst, src[:0])  # (nothing to copy)
    with ThreadPoolExecutor(1, initializer=upload.mark_step_worker) as worker:
        assert not worker.submit(upload.needs_staging, dst, src).result()
    assert upload.needs_staging(dst, src)  # (the mark is the worker thread's only)
