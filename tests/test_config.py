"""OffloadConfig: the seed's dicts accepted verbatim, every bad value refused by name."""

import json

import pytest
import torch

import hetstore
from hetstore import ConfigError, OffloadConfig
from hetstore._sizes import format_size, parse_size

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


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512GB", 512 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("100MB", 100 * 2**20),
        ("30GB", 30 * 2**30),  # MindSpore's max_device_memory: binary
        ("4096", 4096),
        ("64KiB", 65536),
        ("2 tb", 2 * 2**40),
        ("1g", 2**30),
        ("0", 0),
        (12345, 12345),
        ("8B", 8),
    ],
)
def test_parse_size_table(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GB", -5, "lots", "1.5XB", "", "GB", True, None, [1], "nan"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size_is_binary():
    assert format_size(3 * 2**29) == "1.50 GiB"
    assert format_size(512) == "512 B"
    assert format_size(None) == "unlimited"


@pytest.mark.parametrize("seed", [SEED_MANUAL, SEED_AUTO], ids=["manual", "auto"])
def test_seed_dicts_accepted_verbatim(seed):
    config = OffloadConfig.from_mindspore(seed, max_device_memory="30GB")
    assert config.offload_param == "cpu"
    # MindSpore's "parameters" include optimizer states: both follow offload_param.
    assert config.offload_optimizer == "cpu"
    assert config.grad_tier == "cpu"
    assert config.auto_offload is seed["auto_offload"]
    assert config.offload_cpu_size == 512 * 2**30
    assert config.offload_disk_size == 1024 * 2**30
    assert config.host_mem_block_size == 2**30
    assert config.max_device_memory == 30 * 2**30
    assert config.offload_path == "./offload/"
    assert config.enable_aio is True and config.enable_pinned_mem is True


def test_seed_context_memory_offload_off_places_everything_on_device():
    config = OffloadConfig.from_mindspore(SEED_MANUAL, memory_offload="OFF", mode=0)
    assert config.offload_param == "none" and config.offload_optimizer == "none"


def test_every_mindspore_key_and_ours_accepted_by_constructor():
    config = OffloadConfig(
        offload_param="disk",
        offload_optimizer="cpu",
        offload_grad="cpu",
        offload_activations="disk",
        auto_offload=True,
        max_device_memory="8GB",
        offload_cpu_size="64GB",
        offload_disk_size=2**40,
        offload_path="/tmp/x",
        hbm_ratio=0.9,
        cpu_ratio=0.5,
        gpu_margin_mem_ratio=0.8,
        host_mem_block_size="256MB",
        enable_pinned_mem=False,
        enable_aio=False,
        aio_block_size="1MB",
        aio_queue_depth=8,
        aio_threads=4,
        compute_dtype="bf16",
        device="cpu",
        prefetch_depth=2,
    )
    assert config.max_device_memory == 8 * 2**30
    assert config.torch_compute_dtype == torch.bfloat16
    assert config.resolved_device() == torch.device("cpu")
    assert isinstance(config.offload_cpu_size, int)


def test_frozen_and_keyword_only():
    config = OffloadConfig()
    with pytest.raises(AttributeError):
        config.offload_param = "cpu"
    with pytest.raises(ConfigError, match="keyword"):
        OffloadConfig("cpu")


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"offload_parm": "cpu"}, ["offload_parm", "did you mean 'offload_param'"]),
        ({"max_device_memroy": "8GB"}, ["max_device_memroy", "did you mean 'max_device_memory'"]),
        ({"offload_param": "gpu"}, ["offload_param", "'gpu'", "'none', 'cpu', 'disk'"]),
        ({"offload_optimizer": "nvme"}, ["offload_optimizer", "'nvme'"]),
        ({"offload_grad": 1}, ["offload_grad"]),
        ({"offload_activations": "host"}, ["offload_activations", "'host'"]),
        ({"auto_offload": "yes"}, ["auto_offload", "True or False"]),
        ({"enable_aio": 1}, ["enable_aio"]),
        ({"hbm_ratio": 0}, ["hbm_ratio", "(0, 1]"]),
        ({"hbm_ratio": 1.5}, ["hbm_ratio", "1.5"]),
        ({"cpu_ratio": -0.1}, ["cpu_ratio"]),
        ({"cpu_ratio": "half"}, ["cpu_ratio", "'half'"]),
        ({"gpu_margin_mem_ratio": 2}, ["gpu_margin_mem_ratio", "[0, 1]"]),
        ({"max_device_memory": "-1GB"}, ["max_device_memory", "negative"]),
        ({"offload_cpu_size": "lots"}, ["offload_cpu_size", "'lots'", "GB"]),
        ({"offload_disk_size": -3}, ["offload_disk_size", "-3"]),
        ({"host_mem_block_size": "1000"}, ["host_mem_block_size", "4096"]),
        ({"aio_block_size": 0}, ["aio_block_size"]),
        ({"aio_queue_depth": 0}, ["aio_queue_depth", ">= 1"]),
        ({"aio_threads": -1}, ["aio_threads"]),
        ({"prefetch_depth": 1.5}, ["prefetch_depth"]),
        ({"compute_dtype": "fp8"}, ["compute_dtype", "'fp8'", "'bf16'"]),
        ({"device": "tpu"}, ["device", "'tpu'", "'cuda:N'"]),
        ({"offload_path": ""}, ["offload_path"]),
    ],
)
def test_bad_values_name_the_key(kwargs, names):
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_from_mindspore_rejects_unknown_and_bad_values():
    with pytest.raises(ConfigError, match="offload_prama"):
        OffloadConfig.from_mindspore({"offload_prama": "cpu"})
    with pytest.raises(ConfigError, match="memory_offload"):
        OffloadConfig.from_mindspore(SEED_MANUAL, memory_offload="MAYBE")
    with pytest.raises(ConfigError, match="offload_cpu_size"):
        OffloadConfig.from_mindspore({**SEED_MANUAL, "offload_cpu_size": "512XB"})


def test_compute_dtype_aliases():
    assert OffloadConfig(compute_dtype=torch.float16).compute_dtype == "fp16"
    assert OffloadConfig(compute_dtype="bfloat16").compute_dtype == "bf16"


def test_cuda_device_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        OffloadConfig(device="cuda").resolved_device()


def test_from_file_json_yaml_toml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"offload_param": "cpu", "hbm_ratio": 0.5}))
    (tmp_path / "c.yaml").write_text("offload_param: disk\nmax_device_memory: 2GB\n")
    (tmp_path / "c.toml").write_text('offload_optimizer = "cpu"\noffload_cpu_size = "4GiB"\n')
    assert OffloadConfig.from_file(tmp_path / "c.json").hbm_ratio == 0.5
    assert OffloadConfig.from_file(tmp_path / "c.yaml").max_device_memory == 2 * 2**30
    assert OffloadConfig.from_file(tmp_path / "c.toml").offload_cpu_size == 4 * 2**30


def test_from_file_mindspore_form(tmp_path):
    path = tmp_path / "ms.json"
    path.write_text(json.dumps({"offload_config": SEED_AUTO, "max_device_memory": "30GB"}))
    config = OffloadConfig.from_file(path)
    assert config.auto_offload and config.max_device_memory == 30 * 2**30


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("bad.json", "{not json", "not valid json"),
        ("bad.yaml", "offload_parm: cpu\n", "did you mean 'offload_param'"),
        ("bad.toml", "offload_param = [", "not valid toml"),
        ("bad.ini", "x=1", "unknown extension"),
        ("list.json", "[1, 2]", "mapping"),
    ],
)
def test_from_file_errors(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_file(path)


def test_from_file_missing(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadConfig.from_file(tmp_path / "nope.json")


def test_replace_revalidates():
    config = OffloadConfig(offload_param="cpu")
    assert config.replace(offload_param="disk").offload_param == "disk"
    with pytest.raises(ConfigError):
        config.replace(offload_param="x")


def test_public_names():
    for name in ("offload", "OffloadConfig", "memory_stats", "ConfigError", "OutOfDeviceMemory"):
        if name == "offload" and not hasattr(hetstore, "offload"):
            continue  # arrives with the runtime
        assert hasattr(hetstore, name)


def test_docs_config_reference_is_in_sync():
    from pathlib import Path

    from hetstore.config import config_reference_markdown

    path = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert path.read_text() == config_reference_markdown(), (
        'docs/config.md is stale: regenerate with python -c "from hetstore.config import '
        "config_reference_markdown as m; open('docs/config.md','w').write(m())\""
    )
    for key in OffloadConfig.keys():
        assert f"`{key}`" in path.read_text()
