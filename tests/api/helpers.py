"""What the tests of hetstore's public API share (moved here from test_config, unchanged)."""

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
