"""What the tests of hetstore's public API share (moved here from test_config and
test_release, unchanged)."""

import os

# The two dicts of the MindSpore guide (seeds/002), verbatim.
SEED_MANUAL = {
    "offload_param": "cpu",
    "auto_offload": False,
    "offload_cpu_size": "512GB",
    "offload_disk_size": "1024GB",
    "offload_path": "./offload/",
    "host_mem_block_size": "1GB",
    "enable_aio": True,
    "enable_pinned_mem": True,
}
SEED_AUTO = {
    "offload_path": "./offload/",
    "auto_offload": True,
    "offload_param": "cpu",
    "offload_cpu_size": "512GB",
    "offload_disk_size": "1024GB",
    "host_mem_block_size": "1GB",
    "enable_aio": True,
    "enable_pinned_mem": True,
}


def footprint(offload_dir) -> dict[str, int]:
    """What a leaked model would leave behind in this process and on disk."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/maps") as f:
        mappings = sum(1 for _ in f)
    return {
        "files": sum(len(files) + len(dirs) for _, dirs, files in os.walk(offload_dir)),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "mappings": mappings,
        "rss": rss,
    }
