"""The async IO engine: real files, real O_DIRECT (tmp_path is on ext4 on the project machine)."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from hetstore.errors import DiskIOError
from hetstore.tiers.aio import AsyncIOEngine, DiskFile
from hetstore.tiers.hostmem import aligned_empty
from tests import disk_helpers
from tests.disk_helpers import random_bytes

MiB = 2**20
TIMEOUT = 30  # seconds: an error must reach the waiter, never hang it


def buffer_at(n: int, shift: int = 0) -> torch.Tensor:
    """``n`` bytes starting ``shift`` bytes past a page boundary."""
    return aligned_empty(n + shift + 4096)[shift : shift + n]


@pytest.fixture
def direct_supported(tmp_path) -> bool:
    """Whether tmp_path's file system takes O_DIRECT (asserts about it are skipped if not)."""
    try:
        fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.fixture
def engine():
    # 1 MiB blocks: a 20 MiB transfer becomes 20 requests, and the bounce path spans blocks.
    with AsyncIOEngine(block_size=1 * MiB, queue_depth=8, threads=4) as eng:
        yield eng


@pytest.fixture
def dfile(tmp_path, direct_supported):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not direct_supported else "error")
        f = DiskFile(tmp_path / "data.bin")
    yield f
    f.close()


SIZES = [1, 4095, 4096, 4097, 3 * MiB + 17, 20 * MiB]
# (buffer address shift, file offset): aligned; unaligned buffer; unaligned offset;
# both unaligned but congruent mod 4096 (direct body, bounced head); incongruent.
PLACES = [(0, 0), (3, 0), (0, 5), (3, 4096 + 3), (3, 12288 + 100)]


@pytest.mark.parametrize("shift,offset", PLACES)
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_odd_sizes_and_offsets(engine, dfile, direct_supported, nbytes, shift, offset):
    if direct_supported:
        assert dfile.direct
    src = buffer_at(nbytes, shift)
    src.copy_(random_bytes(nbytes, seed=nbytes + shift))
    engine.submit_write(dfile, offset, src).wait(TIMEOUT)
    dst = buffer_at(nbytes, (shift + 1) % 4096)  # read into a differently aligned buffer
    engine.submit_read(dfile, offset, dst).wait(TIMEOUT)
    assert torch.equal(dst, src)


def test_any_dtype_and_a_view_at_byte_offset(engine, dfile):
    base = aligned_empty(4 * MiB + 4096, torch.float32)
    src = base[3 : 3 + MiB]  # float32 view, 12 bytes past the page boundary
    src.uniform_()
    engine.submit_write(dfile, 8192, src).wait(TIMEOUT)
    dst = torch.empty(MiB // 2, dtype=torch.float64)  # same bytes, other dtype, torch allocator
    engine.submit_read(dfile, 8192, dst).wait(TIMEOUT)
    assert torch.equal(dst.view(torch.float32), src)


def test_unaligned_write_keeps_bytes_before_it_and_owns_rest_of_its_page(engine, dfile):
    first = random_bytes(10000, seed=1)
    engine.submit_write(dfile, 0, first).wait(TIMEOUT)
    patch = random_bytes(1000, seed=2)
    engine.submit_write(dfile, 5000, patch).wait(TIMEOUT)
    back = torch.empty(6000, dtype=torch.uint8)
    engine.submit_read(dfile, 0, back).wait(TIMEOUT)
    assert torch.equal(back[:5000], first[:5000])  # same page, before the offset: preserved
    assert torch.equal(back[5000:], patch)
    if dfile.direct:  # documented rule: the rest of the last page is the write's (zeroed)
        rest = torch.empty(8192 - 6000, dtype=torch.uint8)
        engine.submit_read(dfile, 6000, rest).wait(TIMEOUT)
        assert not rest.any()


def test_sixty_four_transfers_in_flight_at_once(engine, dfile):
    n, stride = 256 * 1024 + 17, 384 * 1024
    srcs = [random_bytes(n, seed=i) for i in range(64)]
    writes = [engine.submit_write(dfile, i * stride, s) for i, s in enumerate(srcs)]
    for h in writes:
        h.wait(TIMEOUT)
    dsts = [buffer_at(n, i % 7) for i in range(64)]
    reads = [engine.submit_read(dfile, i * stride, d) for i, d in enumerate(dsts)]
    for h in reads:
        h.wait(TIMEOUT)
    assert all(h.done() for h in writes + reads)
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(s, d)


def test_synchronous_mode_finishes_inside_submit(dfile):
    with AsyncIOEngine(enable_aio=False) as eng:
        src = random_bytes(3 * MiB + 17, seed=5)
        h = eng.submit_write(dfile, 7, src)
        assert h.done()
        h.wait()
        dst = torch.empty_like(src)
        assert eng.submit_read(dfile, 7, dst).done()
        assert torch.equal(dst, src)
        assert not eng.started_threads  # no worker was ever started


def test_buffered_file_round_trip(engine, tmp_path):
    f = DiskFile(tmp_path / "buffered.bin", direct=False)
    assert not f.direct
    src = random_bytes(3 * MiB + 17, seed=6)
    engine.submit_write(f, 3, src).wait(TIMEOUT)
    dst = buffer_at(src.numel(), 5)
    engine.submit_read(f, 3, dst).wait(TIMEOUT)
    assert torch.equal(dst, src)
    assert f.size == 3 + src.numel()  # buffered IO writes exactly the bytes asked
    f.close()


def test_disk_full_reaches_the_waiter_naming_the_file():
    # /dev/full refuses O_DIRECT (EINVAL), so this also covers the buffered fallback's warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = DiskFile("/dev/full", create=False)
    if not f.direct:
        assert any("O_DIRECT is not supported" in str(w.message) for w in caught)
    with AsyncIOEngine(block_size=MiB, threads=2) as eng:
        h = eng.submit_write(f, 0, random_bytes(4 * MiB, seed=7))
        with pytest.raises(DiskIOError) as info:
            h.wait(TIMEOUT)
    err = info.value
    assert err.errno == errno.ENOSPC
    assert err.path == "/dev/full"
    assert "/dev/full" in str(err) and "offload_disk_size" in str(err) and "ENOSPC" in str(err)
    f.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (tmpfs takes O_DIRECT on Linux >= 6.6); skipped where mount is refused."""
    with disk_helpers.small_tmpfs(tmp_path, "1M") as mnt:
        yield mnt


def test_enospc_on_a_full_file_system_then_engine_still_works(engine, small_tmpfs, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = DiskFile(small_tmpfs / "big.bin")
    h = engine.submit_write(f, 0, random_bytes(4 * MiB, seed=8))
    with pytest.raises(DiskIOError) as info:
        h.wait(TIMEOUT)
    assert info.value.errno == errno.ENOSPC
    assert str(small_tmpfs / "big.bin") in str(info.value)
    assert "free space" in str(info.value)
    assert h.done() and f.pending == 0  # every request of the transfer has finished
    f.close()
    # the failure stayed with its transfer: the pool serves the next one normally
    g = DiskFile(tmp_path / "after.bin")
    src = random_bytes(2 * MiB, seed=9)
    engine.submit_write(g, 0, src).wait(TIMEOUT)
    dst = torch.empty_like(src)
    engine.submit_read(g, 0, dst).wait(TIMEOUT)
    assert torch.equal(dst, src)
    g.close()


@pytest.mark.parametrize("shift", [0, 3])
def test_read_past_end_of_file_is_a_short_read_error(engine, dfile, shift):
    engine.submit_write(dfile, 0, random_bytes(MiB, seed=10)).wait(TIMEOUT)
    dst = buffer_at(4 * MiB, shift)  # blocks 1..3 lie past the end of the 1 MiB file
    h = engine.submit_read(dfile, 0, dst)
    with pytest.raises(DiskIOError, match="short read") as info:
        h.wait(TIMEOUT)
    assert info.value.path == dfile.path
    assert h.done() and dfile.pending == 0


def test_submit_after_close_raises_from_wait(dfile):
    eng = AsyncIOEngine()
    eng.close()
    eng.close()  # idempotent
    h = eng.submit_write(dfile, 0, random_bytes(4096, seed=11))
    assert h.done()
    with pytest.raises(DiskIOError, match="closed"):
        h.wait(TIMEOUT)


def test_close_with_queued_requests_cancels_them_without_hanging(dfile):
    eng = AsyncIOEngine(block_size=4096, threads=1)
    h = eng.submit_write(dfile, 0, random_bytes(8 * MiB, seed=12))  # 2048 requests
    eng.close()
    assert h.done()
    try:
        h.wait(TIMEOUT)
    except DiskIOError as err:
        assert "closed" in str(err)
    assert dfile.pending == 0


def test_file_close_waits_for_its_transfers(engine, tmp_path):
    f = DiskFile(tmp_path / "busy.bin")
    h = engine.submit_write(f, 0, random_bytes(8 * MiB, seed=13))
    f.close()  # must not pull the fd out from under the running requests
    assert h.done()
    h.wait()


def test_rejects_non_contiguous_and_non_cpu_buffers(engine, dfile):
    with pytest.raises(ValueError, match="contiguous"):
        engine.submit_write(dfile, 0, torch.zeros(64, 64).t())
    with pytest.raises(ValueError, match=">= 0"):
        engine.submit_write(dfile, -1, torch.zeros(4))
    assert dfile.pending == 0


def test_background_threads_transfers_wait_behind_the_compute_paths(tmp_path, monkeypatch):
    """Two lanes (``background_io``): requests a background thread (the optimizer's step
    worker) queued are served only once the other threads' queued requests are. The one
    worker thread is held inside the first background request until the compute path's
    read is queued behind eight more background ones: it is served next, and the bytes
    of every transfer are still right."""
    import threading

    from hetstore.tiers import aio

    served, gate, first, armed = [], threading.Event(), threading.Event(), threading.Event()
    run = aio._run

    def recording(req, bounces):
        if armed.is_set() and not served:
            first.set()
            assert gate.wait(30), "the test never let the worker go"
        served.append("bg" if req.transfer.write else "fg")
        run(req, bounces)

    monkeypatch.setattr(aio, "_run", recording)
    block = 64 * 1024
    data = aligned_empty(9 * block)
    data.copy_(random_bytes(9 * block, seed=3))
    other = aligned_empty(block)
    other.copy_(random_bytes(block, seed=4))
    with AsyncIOEngine(block_size=block, threads=1) as eng:
        f = DiskFile(tmp_path / "lanes.bin")
        g = DiskFile(tmp_path / "other.bin")
        eng.submit_write(g, 0, other).wait()  # (the compute path's file)
        served.clear()
        armed.set()
        handles = []

        def step_worker():
            aio.background_io()
            handles.append(eng.submit_write(f, 0, data))

        thread = threading.Thread(target=step_worker)
        thread.start()
        thread.join()
        assert first.wait(30)
        into = aligned_empty(block)
        read = eng.submit_read(g, 0, into)
        gate.set()
        read.wait()
        handles[0].wait()
        assert torch.equal(into, other)
        back = aligned_empty(9 * block)
        eng.submit_read(f, 0, back).wait()
        f.close()
        g.close()
    assert served[:3] == ["bg", "fg", "bg"] and served.count("bg") == 9, served
    assert torch.equal(back, data)
