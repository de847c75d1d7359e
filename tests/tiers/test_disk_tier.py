"""The disk tier: private directory, regions, capacity, cleanup of crashed runs."""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import warnings

import pytest
import torch

from hetstore.errors import DiskIOError, OutOfTierMemory
from hetstore.tiers.aio import AsyncIOEngine
from hetstore.tiers.disk import DiskTier, proc_start_ticks
from hetstore.tiers.hostmem import aligned_empty
from tests.disk_helpers import random_bytes, small_tmpfs

MiB = 2**20
TIMEOUT = 30


def region_files(tier: DiskTier) -> list[str]:
    return sorted(n for n in os.listdir(tier.path) if n.endswith(".bin"))


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(root=tmp_path / "offload", capacity=256 * MiB, block_size=MiB, threads=4)
    yield t
    t.close()


def test_private_directory_owner_file_and_modes(tier, tmp_path):
    name = os.path.basename(tier.path)
    assert os.path.dirname(tier.path) == str(tmp_path / "offload")  # root created if missing
    assert name.startswith(f"hetstore-{socket.gethostname()}-pid{os.getpid()}-rank0-")
    assert stat.S_IMODE(os.stat(tier.path).st_mode) == 0o700
    with open(os.path.join(tier.path, "owner.json")) as f:
        owner = json.load(f)
    assert owner["pid"] == os.getpid() and owner["hostname"] == socket.gethostname()
    assert owner["start_time"] > 0
    region = tier.allocate(5000, "w")
    assert stat.S_IMODE(os.stat(region.file.path).st_mode) == 0o600
    assert region.size == 8192 and os.stat(region.file.path).st_size == 8192  # preallocated


def test_two_tiers_of_one_process_get_distinct_directories(tmp_path):
    with (
        DiskTier(root=tmp_path, capacity=MiB, rank=0) as a,
        DiskTier(root=tmp_path, capacity=MiB, rank=1) as b,
    ):
        assert a.path != b.path and "-rank1-" in b.path


def test_the_root_it_created_goes_with_it_and_a_root_that_was_there_stays(tmp_path):
    """offload_path='./offload' by default: a run leaves no empty directory behind, and
    removes nothing it did not make (another process's entries keep a shared root)."""
    with DiskTier(root=tmp_path / "made" / "offload", capacity=MiB) as made:
        assert os.path.isdir(made.path)
    assert not (tmp_path / "made").exists()  # the root and the parent it made
    (tmp_path / "there").mkdir()
    with DiskTier(root=tmp_path / "there", capacity=MiB):
        pass
    assert (tmp_path / "there").is_dir()
    with DiskTier(root=tmp_path / "shared", capacity=MiB) as first:
        second = DiskTier(root=tmp_path / "shared", capacity=MiB)
        first.close()
        assert os.path.isdir(second.path)  # the other tier's directory is untouched
        second.close()
    with pytest.raises(OutOfTierMemory):  # refused at creation: nothing left either
        DiskTier(root=tmp_path / "refused", capacity=2**62)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    "nbytes,offset", [(1, 0), (4095, 0), (4097, 3), (3 * MiB + 17, 0), (20 * MiB, 0)]
)
def test_region_round_trip(tier, nbytes, offset):
    region = tier.allocate(nbytes + offset, "p")
    src = random_bytes(nbytes, seed=nbytes)
    tier.write(region, src, offset=offset).wait(TIMEOUT)
    dst = aligned_empty(nbytes + 4096)[3 : 3 + nbytes]
    tier.read(region, dst, offset=offset).wait(TIMEOUT)
    assert torch.equal(dst, src)


def test_sixty_four_regions_in_flight(tier):
    regions = [tier.allocate(100_000 + i, f"unit{i}") for i in range(64)]
    srcs = [random_bytes(r.nbytes, seed=i) for i, r in enumerate(regions)]
    for h in [tier.write(r, s) for r, s in zip(regions, srcs, strict=True)]:
        h.wait(TIMEOUT)
    dsts = [torch.empty_like(s) for s in srcs]
    for h in [tier.read(r, d) for r, d in zip(regions, dsts, strict=True)]:
        h.wait(TIMEOUT)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_synchronous_tier(tmp_path):
    with DiskTier(root=tmp_path, capacity=16 * MiB, enable_aio=False) as t:
        region = t.allocate(MiB + 1, "x")
        src = random_bytes(MiB + 1, seed=1)
        assert t.write(region, src).done()
        dst = torch.empty_like(src)
        assert t.read(region, dst).done()
        assert torch.equal(src, dst)


def test_read_of_never_written_bytes_raises(tier):
    region = tier.allocate(3 * 4096, "r")
    with pytest.raises(DiskIOError, match="never"):
        tier.read(region, torch.empty(10, dtype=torch.uint8))
    tier.write(region, random_bytes(200, seed=1), offset=4096).wait(TIMEOUT)
    tier.read(region, torch.empty(200, dtype=torch.uint8), offset=4096).wait(TIMEOUT)
    with pytest.raises(DiskIOError, match="byte 4296"):
        tier.read(region, torch.empty(300, dtype=torch.uint8), offset=4096)
    # a write owns the rest of its last page: [100, 200) written first is lost to its padding
    tier.write(region, random_bytes(100, seed=2), offset=100).wait(TIMEOUT)
    tier.write(region, random_bytes(100, seed=3), offset=0).wait(TIMEOUT)
    with pytest.raises(DiskIOError, match="padding"):
        tier.read(region, torch.empty(200, dtype=torch.uint8))


def test_range_checks_and_double_free(tier):
    region = tier.allocate(100, "r")
    with pytest.raises(ValueError, match="outside"):
        tier.write(region, torch.zeros(101, dtype=torch.uint8))
    tier.free(region)
    with pytest.raises(ValueError, match="freed"):
        tier.free(region)
    with pytest.raises(ValueError, match="freed"):
        tier.write(region, torch.zeros(1, dtype=torch.uint8))


def test_stats_track_current_and_peak(tier):
    sizes = ("current", "peak", "capacity")
    assert tier.stats() == dict(
        current=0, peak=0, capacity=256 * MiB, bytes_read=0, bytes_written=0
    )
    a = tier.allocate(MiB, "a")
    b = tier.allocate(4097, "b")
    assert tier.stats()["current"] == MiB + 8192
    tier.write(b, torch.ones(4097, dtype=torch.uint8)).wait()
    tier.read(b, torch.empty(100, dtype=torch.uint8), 7).wait()
    assert (tier.stats()["bytes_written"], tier.stats()["bytes_read"]) == (4097, 100)
    tier.free(a)
    stats = tier.stats()
    assert {k: stats[k] for k in sizes} == dict(current=8192, peak=MiB + 8192, capacity=256 * MiB)
    tier.free(b)
    assert tier.stats()["current"] == 0


def test_freed_file_is_reused_for_the_same_size_and_dropped_under_pressure(tmp_path):
    with DiskTier(root=tmp_path, capacity=MiB) as t:
        a = t.allocate(512 * 1024, "a")
        path = a.file.path
        t.write(a, random_bytes(512 * 1024, seed=1)).wait(TIMEOUT)
        t.free(a)
        assert t.kept_bytes == 512 * 1024 and region_files(t) == [os.path.basename(path)]
        b = t.allocate(512 * 1024 - 5, "b")  # same rounded size: the written file is reused
        assert b.file.path == path and t.kept_bytes == 0
        with pytest.raises(DiskIOError, match="never"):  # old bytes are not b's
            t.read(b, torch.empty(10, dtype=torch.uint8))
        t.free(b)
        c = t.allocate(768 * 1024, "c")  # fits the capacity only once the kept file goes
        assert t.kept_bytes == 0 and region_files(t) == [os.path.basename(c.file.path)]


def test_capacity_error_names_tier_request_capacity_and_fix(tmp_path):
    with DiskTier(root=tmp_path, capacity=MiB) as t:
        t.allocate(600 * 1024, "layer3.exp_avg")
        with pytest.raises(OutOfTierMemory) as info:
            t.allocate(600 * 1024, "layer4.exp_avg")
    err = info.value
    msg = str(err)
    assert err.tier == "disk" and err.requested == 600 * 1024 and err.capacity == MiB
    assert isinstance(err, torch.OutOfMemoryError)
    for part in (
        "disk tier",
        "600.00 KiB",
        "1.00 MiB",
        "offload_disk_size",
        "'layer3.exp_avg'",
        "layer4.exp_avg",
        "in use",
        "peak",
    ):
        assert part in msg, part


def test_capacity_above_free_space_is_refused_at_start(tmp_path):
    with pytest.raises(OutOfTierMemory) as info:
        DiskTier(root=tmp_path / "r", capacity="1000TB")
    msg = str(info.value)
    assert info.value.tier == "disk"
    assert "offload_disk_size" in msg and "free" in msg and "1000.00 TiB" in msg
    assert info.value.requested == 1000 * 2**40
    assert not (tmp_path / "r").exists()  # nothing left, not even the root it made


def test_capacity_none_means_free_space_at_start(tmp_path):
    with DiskTier(root=tmp_path, capacity=None) as t:
        st = os.statvfs(tmp_path)
        free = st.f_bavail * st.f_frsize
        assert abs(t.stats()["capacity"] - free) < 256 * MiB


def test_close_removes_files_and_directory(tmp_path):
    t = DiskTier(root=tmp_path, capacity=64 * MiB)
    regions = [t.allocate(MiB, str(i)) for i in range(3)]
    handles = [t.write(r, random_bytes(MiB, seed=i)) for i, r in enumerate(regions)]
    t.free(regions[0])  # a kept file must go too
    path = t.path
    t.close()  # waits for the writes still in flight
    assert all(h.done() for h in handles)
    assert not os.path.exists(path)
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t.allocate(1, "late")


def test_files_go_when_the_tier_is_collected(tmp_path):
    t = DiskTier(root=tmp_path, capacity=MiB)
    t.allocate(4096, "x")
    path = t.path
    del t
    gc.collect()
    assert not os.path.exists(path)


def test_files_go_at_interpreter_exit(tmp_path):
    code = (
        "import sys; from hetstore.tiers.disk import DiskTier\n"
        f"t = DiskTier(root={str(tmp_path)!r}, capacity=2**20)\n"
        "t.allocate(4096, 'x'); print(t.path); sys.exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not os.path.exists(out.stdout.strip())


def test_shared_engine_is_not_closed_by_the_tier(tmp_path):
    with AsyncIOEngine() as eng:
        with DiskTier(root=tmp_path, capacity=MiB, engine=eng) as t:
            assert t.engine is eng
        assert not eng.closed


def _fake_dir(root, host: str, pid: int, owner: dict | None, tag: str = "deadbeef") -> str:
    path = os.path.join(root, f"hetstore-{host}-pid{pid}-rank0-{tag}")
    os.makedirs(path)
    if owner is not None:
        with open(os.path.join(path, "owner.json"), "w") as f:
            json.dump(owner, f)
    with open(os.path.join(path, "r000001.bin"), "wb") as f:
        f.write(os.urandom(MiB))
    return path


def test_leftovers_of_dead_processes_are_reclaimed_and_live_ones_left(tmp_path, caplog):
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = proc_start_ticks(live.pid)
        dead_dir = _fake_dir(tmp_path, host, dead.pid, {"pid": dead.pid, "hostname": host})
        reused_pid = _fake_dir(  # the pid is alive again but started at another time
            tmp_path,
            host,
            live.pid,
            {"pid": live.pid, "hostname": host, "proc_start_ticks": ticks + 1},
            "01",
        )
        live_dir = _fake_dir(
            tmp_path,
            host,
            live.pid,
            {"pid": live.pid, "hostname": host, "proc_start_ticks": ticks},
            "02",
        )
        other_host = _fake_dir(
            tmp_path, "elsewhere", dead.pid + 1, {"pid": dead.pid + 1, "hostname": "elsewhere"}
        )
        not_ours = tmp_path / "hetstore-data"
        not_ours.mkdir()
        with caplog.at_level(logging.WARNING, logger="hetstore.tiers.disk"):
            with DiskTier(root=tmp_path, capacity=MiB):
                pass
        assert not os.path.exists(dead_dir) and not os.path.exists(reused_pid)
        assert os.path.exists(live_dir) and os.path.exists(other_host) and not_ours.exists()
        lines = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
        assert len(lines) == 1 and "2 leftover" in lines[0] and "reclaiming 2.0" in lines[0]
    finally:
        live.kill()
        live.wait()


def test_leftover_without_owner_file_judged_by_its_name(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = _fake_dir(tmp_path, socket.gethostname(), dead.pid, None)
    with DiskTier(root=tmp_path, capacity=MiB):
        assert not os.path.exists(path)


def test_full_file_system_at_allocate_is_a_capacity_error(tmp_path):
    with small_tmpfs(tmp_path, "2M") as mnt:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # older kernels: tmpfs without O_DIRECT
            with DiskTier(root=mnt, capacity=MiB + 512 * 1024) as t:
                with open(mnt / "filler", "wb") as f:  # someone else fills the disk meanwhile
                    f.write(b"\0" * (MiB + 256 * 1024))
                with pytest.raises(OutOfTierMemory) as info:
                    t.allocate(MiB, "big")
                assert "file system under offload_path is full" in str(info.value)
                assert region_files(t) == []  # the failed file is not left behind
