"""The host pool: aligned slices, coalescing free list, capacity, pinning fallback."""

import warnings

import pytest
import torch

from hetstore import OutOfTierMemory
from hetstore.tiers import HostTier, PinnedMemoryWarning
from hetstore.tiers.hostmem import PAGE_SIZE

MiB = 2**20


def make_pool(capacity=16 * MiB, block=4 * MiB, pin=False):
    return HostTier(capacity=capacity, block_size=block, pin=pin, device=torch.device("cpu"))


def test_slices_are_page_aligned_and_writable():
    pool = make_pool()
    buffers = [pool.allocate(n, f"b{n}") for n in (1, 4095, 4097, 100_000)]
    for b in buffers:
        assert b.tensor.data_ptr() % PAGE_SIZE == 0
        b.tensor.fill_(7)
        assert int(b.tensor.sum()) == 7 * b.nbytes
    # distinct, non-overlapping slices
    starts = sorted((b.tensor.data_ptr(), b.nbytes) for b in buffers)
    for (a, n), (b, _) in zip(starts, starts[1:], strict=False):
        assert a + n <= b


def test_dtype_view():
    pool = make_pool()
    b = pool.allocate(4000, "f", dtype=torch.float32)
    assert b.tensor.dtype == torch.float32 and b.tensor.numel() == 1000
    with pytest.raises(ValueError, match="whole number"):
        pool.allocate(4001, "odd", dtype=torch.float32)


def test_accounting_current_peak_reserved():
    pool = make_pool()
    a = pool.allocate(MiB, "a")
    b = pool.allocate(MiB, "b")
    assert pool.account.current == 2 * MiB
    assert pool.reserved == 4 * MiB  # one lazily mapped block
    pool.free(a)
    assert pool.account.current == MiB and pool.account.peak == 2 * MiB
    pool.free(b)
    assert pool.account.current == 0


def test_free_list_coalesces_neighbours():
    pool = make_pool(block=4 * MiB)
    parts = [pool.allocate(MiB, f"p{i}") for i in range(4)]  # fills the block exactly
    assert pool.stats()["blocks"] == 1
    hole_start = parts[1].tensor.data_ptr()
    # free the middle two out of order: they must merge into one 2 MiB hole
    pool.free(parts[2])
    pool.free(parts[1])
    whole = pool.allocate(2 * MiB, "merged")
    assert pool.stats()["blocks"] == 1, "a coalesced 2 MiB hole must be reused, not a new block"
    assert whole.tensor.data_ptr() == hole_start


def test_blocks_grow_lazily_and_large_requests_get_their_own_block():
    pool = make_pool(capacity=64 * MiB, block=4 * MiB)
    assert pool.reserved == 0
    big = pool.allocate(10 * MiB, "big")
    assert pool.reserved == 10 * MiB
    pool.free(big)


def test_block_tails_do_not_strand_the_capacity():
    # requests over half a block get blocks of their exact size: in 1 MiB blocks two
    # 600 KiB requests would strand 2 x 424 KiB of tail, and the third request (within
    # the capacity by the accounting) would find no room for a block of its own
    pool = make_pool(capacity=2 * MiB, block=MiB)
    first, second = pool.allocate(600 * 1024, "a"), pool.allocate(600 * 1024, "b")
    third = pool.allocate(800 * 1024, "c")
    assert pool.reserved == 2000 * 1024 <= pool.capacity
    assert len({first.tensor.data_ptr(), second.tensor.data_ptr(), third.tensor.data_ptr()}) == 3


def test_a_spare_free_block_is_unmapped_to_make_room():
    pool = make_pool(capacity=2 * MiB, block=MiB)
    pool.free(pool.allocate(256 * 1024, "small"))  # its 1 MiB block stays mapped, spare
    assert pool.reserved == MiB
    big = pool.allocate(1536 * 1024, "big")  # needs the spare's room
    assert pool.reserved == 1536 * 1024 and pool.stats()["blocks"] == 1
    pool.free(big)


def test_capacity_error_names_the_tier_and_key():
    pool = make_pool(capacity=8 * MiB, block=4 * MiB)
    pool.allocate(6 * MiB, "states unit 0")
    with pytest.raises(OutOfTierMemory) as info:
        pool.allocate(3 * MiB, "states unit 1")
    message = str(info.value)
    assert info.value.tier == "host"
    assert "offload_cpu_size" in message and "states unit 1" in message
    assert "states unit 0" in message  # largest holder
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_last_block_shrinks_to_capacity():
    pool = make_pool(capacity=6 * MiB, block=4 * MiB)
    pool.allocate(4 * MiB, "a")
    pool.allocate(2 * MiB, "b")
    assert pool.reserved == 6 * MiB


def test_double_free_refused():
    pool = make_pool()
    b = pool.allocate(10, "x")
    pool.free(b)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(b)


def test_fully_free_blocks_are_returned_to_the_os():
    pool = make_pool(capacity=64 * MiB, block=4 * MiB)
    bufs = [pool.allocate(4 * MiB, f"x{i}") for i in range(3)]
    assert pool.stats()["blocks"] == 3
    for b in bufs:
        pool.free(b)
    assert pool.stats()["blocks"] == 1  # one spare kept so free/alloc cycles do not remap


def test_pinning_without_accelerator_falls_back_with_one_warning():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only fallback")
    with pytest.warns(PinnedMemoryWarning, match="pageable"):
        pool = make_pool(pin=True)
    assert pool.pinned is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = pool.allocate(MiB, "after fallback")  # no further warnings, no crash
    b.tensor.fill_(1)


def test_a_mapping_is_unlocked_when_its_last_view_dies_not_before():
    """Page locks (mlock here; CUDA's registration on a GPU, tests/api/test_cuda.py) are
    undone when the last tensor viewing the mapping dies, before its pages are unmapped:
    a lock left on unmapped pages is what made CUDA refuse the next mapping placed there."""
    import gc

    from hetstore.tiers.hostmem import MappedBlock

    block = MappedBlock(4 * 4096)
    try:
        block.lock()
    except OSError as exc:  # a memlock limit under the block's size
        pytest.skip(f"cannot mlock here: {exc}")
    locks, view = block.page_locks, block.tensor[4096:]
    view.fill_(7)
    del block
    gc.collect()
    assert locks.locked  # the view still uses the pages
    assert int(view.sum()) == 7 * 3 * 4096
    del view
    gc.collect()
    assert not locks.locked
